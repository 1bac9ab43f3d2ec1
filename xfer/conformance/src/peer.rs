//! The target process: a child `xfer-peer` driven by one-line commands over its stdin/stdout.
//!
//! Every wait on the child is bounded, and dropping a [`Peer`] kills it, so a failing test
//! never leaves a process behind (and a killed test closes the child's stdin, which ends it
//! too).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError};

/// How long a peer may take to start and print `READY`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long one command may take (hashing or filling 256 MiB included).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error("cannot start {exe}: {source}")]
    Spawn { exe: PathBuf, source: std::io::Error },
    #[error("peer {name}: no answer within {after:?} (waiting for {what})")]
    Timeout { name: String, after: Duration, what: String },
    #[error("peer {name} exited ({status}) while waiting for {what}")]
    Exited { name: String, status: String, what: String },
    #[error("peer {name} answered {line:?} to {what}")]
    Unexpected { name: String, line: String, what: String },
    #[error("peer {name} refused {what}: {message}")]
    Refused { name: String, what: String, message: String },
    #[error("peer {name}: cannot send a command: {source}")]
    Io { name: String, source: std::io::Error },
}

/// How to start a peer.
#[derive(Clone, Debug)]
pub struct PeerConfig {
    pub name: String,
    pub backend: String,
    /// `k=v,...` as `xfer::BackendParams::parse` reads it.
    pub params: String,
    /// Bytes of the one registered buffer.
    pub size: u64,
    /// The buffer is allocated by the backend (`Agent::allocate`, `xfer-peer --alloc backend`)
    /// rather than a `HostBuffer`.
    pub backend_alloc: bool,
    /// The cluster secret file the peer authenticates with (`xfer-peer --credential`).
    pub credential: Option<PathBuf>,
    /// The network namespace the peer runs in (`ip netns exec`); `None`: this one.
    pub netns: Option<String>,
    /// Where its side channel listens (`127.0.0.1:0` unless set).
    pub side_channel: String,
}

impl PeerConfig {
    pub fn new(name: &str, backend: &str, params: &str, size: u64) -> Self {
        PeerConfig {
            name: name.into(),
            backend: backend.into(),
            params: params.into(),
            size,
            backend_alloc: false,
            credential: None,
            netns: None,
            side_channel: "127.0.0.1:0".into(),
        }
    }

    /// The same in network namespace `netns`, its side channel listening on `side_channel`
    /// (an address of that namespace the initiator can reach).
    pub fn in_netns(mut self, netns: &str, side_channel: &str) -> Self {
        self.netns = Some(netns.into());
        self.side_channel = side_channel.into();
        self
    }

    /// The same with a cluster credential read from `file`.
    pub fn credential(mut self, file: &Path) -> Self {
        self.credential = Some(file.to_path_buf());
        self
    }

    /// The same with the buffer allocated by the backend.
    pub fn backend_alloc(mut self) -> Self {
        self.backend_alloc = true;
        self
    }
}

static PEER_EXE: OnceLock<PathBuf> = OnceLock::new();

/// Tells the scenarios where `xfer-peer` is (integration tests pass
/// `env!("CARGO_BIN_EXE_xfer-peer")`). The first call wins.
pub fn set_peer_exe(path: impl Into<PathBuf>) {
    let _ = PEER_EXE.set(path.into());
}

/// The `xfer-peer` to run: the one given to [`set_peer_exe`], else `$XFER_PEER_EXE`, else the
/// one Cargo builds next to the running test binary (`target/<profile>/xfer-peer`).
pub fn peer_exe() -> PathBuf {
    if let Some(path) = PEER_EXE.get() {
        return path.clone();
    }
    if let Some(path) = std::env::var_os("XFER_PEER_EXE") {
        return path.into();
    }
    let mut dir = std::env::current_exe().unwrap_or_default();
    dir.pop();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir.join(format!("xfer-peer{}", std::env::consts::EXE_SUFFIX))
}

/// A running `xfer-peer`.
#[derive(Debug)]
pub struct Peer {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    side_channel: String,
    buf_addr: u64,
    buf_len: u64,
}

impl Peer {
    /// Starts `exe` and waits (bounded) for its `READY` line.
    pub fn spawn(exe: &Path, config: &PeerConfig) -> Result<Peer, PeerError> {
        let mut command = match &config.netns {
            Some(ns) => {
                let mut ip = Command::new("ip");
                ip.args(["netns", "exec", ns]).arg(exe);
                ip
            }
            None => Command::new(exe),
        };
        let mut child = command
            .args(["--name", &config.name, "--backend", &config.backend, "--params", &config.params])
            .args(["--size", &config.size.to_string(), "--side-channel", &config.side_channel])
            .args(["--alloc", if config.backend_alloc { "backend" } else { "host" }])
            .args(config.credential.iter().flat_map(|file| [std::ffi::OsStr::new("--credential"), file.as_os_str()]))
            // The peer's stdout is its answer protocol: UCX's own log lines (an error it prints
            // after a stalled peer resumes, say) must not land there.
            .env("UCX_LOG_FILE", "stderr")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|source| PeerError::Spawn { exe: exe.to_path_buf(), source })?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stdin = child.stdin.take();
        let (send, lines) = crossbeam_channel::unbounded();
        // A reader thread makes every wait for an answer a bounded channel receive, and keeps
        // the child's stdout drained while many commands are in flight.
        std::thread::Builder::new()
            .name(format!("peer-{}-stdout", config.name))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if send.send(line).is_err() {
                        break;
                    }
                }
            })
            .map_err(|source| PeerError::Spawn { exe: exe.to_path_buf(), source })?;
        let mut peer = Peer {
            name: config.name.clone(),
            child,
            stdin,
            lines,
            side_channel: String::new(),
            buf_addr: 0,
            buf_len: 0,
        };
        let line = peer.recv(Instant::now(), READY_TIMEOUT, "READY")?;
        let ready: Vec<&str> = line.split_whitespace().collect();
        let parsed = match ready.as_slice() {
            ["READY", addr, buf_addr, buf_len] => buf_addr.parse().ok().zip(buf_len.parse().ok()).map(|v| (addr, v)),
            _ => None,
        };
        let Some((addr, (buf_addr, buf_len))) = parsed else {
            return Err(peer.unexpected(&line, "READY"));
        };
        peer.side_channel = addr.to_string();
        (peer.buf_addr, peer.buf_len) = (buf_addr, buf_len);
        Ok(peer)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The side channel's `host:port`: all an initiator needs to reach this peer.
    pub fn side_channel(&self) -> &str {
        &self.side_channel
    }

    /// Address of the registered buffer in the peer's address space.
    pub fn buf_addr(&self) -> u64 {
        self.buf_addr
    }

    pub fn buf_len(&self) -> u64 {
        self.buf_len
    }

    /// The descriptor of `off .. off + len` of the peer's buffer.
    pub fn desc(&self, off: u64, len: u64) -> xfer::Desc {
        xfer::Desc::new(self.buf_addr + off, len, 0)
    }

    fn unexpected(&self, line: &str, what: &str) -> PeerError {
        PeerError::Unexpected { name: self.name.clone(), line: line.to_string(), what: what.to_string() }
    }

    /// The next answer line, waiting until `started + budget` at most.
    fn recv(&mut self, started: Instant, budget: Duration, what: &str) -> Result<String, PeerError> {
        match self.lines.recv_deadline(started + budget) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => {
                Err(PeerError::Timeout { name: self.name.clone(), after: budget, what: what.to_string() })
            }
            Err(RecvTimeoutError::Disconnected) => {
                // stdout closed: the process is gone or about to be; give it a moment to exit.
                let status = wait_bounded(&mut self.child, Duration::from_secs(2))
                    .map_or_else(|| "still running, stdout closed".to_string(), |s| s.to_string());
                Err(PeerError::Exited { name: self.name.clone(), status, what: what.to_string() })
            }
        }
    }

    fn send(&mut self, text: &str) -> Result<(), PeerError> {
        let name = &self.name;
        let io = |source| PeerError::Io { name: name.clone(), source };
        let stdin = self.stdin.as_mut().ok_or_else(|| io(std::io::ErrorKind::BrokenPipe.into()))?;
        stdin.write_all(text.as_bytes()).and_then(|()| stdin.flush()).map_err(io)
    }

    fn answer(&self, line: String, what: &str) -> Result<String, PeerError> {
        if line == "OK" {
            return Ok(String::new());
        }
        if let Some(rest) = line.strip_prefix("OK ") {
            return Ok(rest.to_string());
        }
        if let Some(message) = line.strip_prefix("ERR ") {
            return Err(PeerError::Refused {
                name: self.name.clone(),
                what: what.to_string(),
                message: message.to_string(),
            });
        }
        Err(self.unexpected(&line, what))
    }

    /// Sends one command line and returns what follows `OK` in the answer.
    pub fn command(&mut self, cmd: &str) -> Result<String, PeerError> {
        self.send(&format!("{cmd}\n"))?;
        let line = self.recv(Instant::now(), COMMAND_TIMEOUT, cmd)?;
        self.answer(line, cmd)
    }

    /// Sends many commands at once and collects their answers in order (one round trip's
    /// latency for thousands of ranges).
    pub fn commands(&mut self, cmds: &[String]) -> Result<Vec<String>, PeerError> {
        let mut text = String::new();
        for cmd in cmds {
            text.push_str(cmd);
            text.push('\n');
        }
        self.send(&text)?;
        let started = Instant::now();
        let mut answers = Vec::with_capacity(cmds.len());
        for cmd in cmds {
            let line = self.recv(started, COMMAND_TIMEOUT, cmd)?;
            answers.push(self.answer(line, cmd)?);
        }
        Ok(answers)
    }

    /// Fills `off .. off + len` with the pattern of `seed` (pattern position 0 at `off`).
    pub fn fill(&mut self, seed: u64, off: u64, len: u64) -> Result<(), PeerError> {
        self.command(&format!("fill {seed} {off} {len}")).map(drop)
    }

    pub fn hash(&mut self, off: u64, len: u64) -> Result<u64, PeerError> {
        let answer = self.command(&format!("hash {off} {len}"))?;
        u64::from_str_radix(&answer, 16).map_err(|_| self.unexpected(&answer, "hash"))
    }

    /// Hashes of many `(off, len)` ranges, pipelined.
    pub fn hashes(&mut self, ranges: &[(u64, u64)]) -> Result<Vec<u64>, PeerError> {
        let cmds: Vec<String> = ranges.iter().map(|(off, len)| format!("hash {off} {len}")).collect();
        self.commands(&cmds)?
            .into_iter()
            .map(|answer| u64::from_str_radix(&answer, 16).map_err(|_| self.unexpected(&answer, "hash")))
            .collect()
    }

    /// Drains the notifications the peer recorded: `SEQ=ok`/`SEQ=bad` for checks, the escaped
    /// message otherwise, in arrival order.
    pub fn notifs(&mut self) -> Result<Vec<String>, PeerError> {
        let answer = self.command("notifs")?;
        Ok(answer.split(',').filter(|s| !s.is_empty()).map(str::to_string).collect())
    }

    /// Collects notifications until `count` have arrived or `timeout` passes.
    pub fn collect_notifs(&mut self, count: usize, timeout: Duration) -> Result<Vec<String>, PeerError> {
        let deadline = Instant::now() + timeout;
        let mut got = Vec::new();
        loop {
            got.extend(self.notifs()?);
            if got.len() >= count || Instant::now() >= deadline {
                return Ok(got);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Drops the peer's registration (waits for transfers using it, as deregistration does).
    pub fn dereg(&mut self) -> Result<(), PeerError> {
        self.command("dereg").map(drop)
    }

    /// Drops the registration and the buffer (memory a backend allocated is released).
    pub fn free(&mut self) -> Result<(), PeerError> {
        self.command("free").map(drop)
    }

    /// Whether the process is still running.
    pub fn is_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL (on Unix), then reaps the process.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Asks the peer to exit; returns its exit status (killing it if it does not exit).
    pub fn quit(mut self) -> Result<ExitStatus, PeerError> {
        self.send("quit\n")?;
        self.stdin = None;
        match wait_bounded(&mut self.child, Duration::from_secs(10)) {
            Some(status) => Ok(status),
            None => Err(PeerError::Timeout {
                name: self.name.clone(),
                after: Duration::from_secs(10),
                what: "exit after quit".into(),
            }),
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => return None,
        }
    }
}
