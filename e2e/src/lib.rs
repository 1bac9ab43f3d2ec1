//! Harness for the end-to-end suites against real engines: starting and stopping vLLM instances
//! through `ci/vllm/engine.sh` (SGLang servers through `ci/sglang/engine.sh`: [`sglang`]),
//! binaries of this workspace, HTTP helpers and Prometheus parsing.
//!
//! Every process started here runs under a small guardian shell that leads its own process group
//! and holds a pipe from the test process: when the test process goes away in any way (even
//! SIGKILL), the pipe closes and the guardian kills the group (SIGTERM, SIGKILL after 15 s). On
//! drop, and from an `atexit` hook for fixtures held in `static`s, the group is killed directly.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, Once};
use std::time::{Duration, Instant};

use pd_protocols::kv_events::{decode_batch, EventBatch, KvEvent};
use pd_protocols::zmq_frames::parse_pub;
use serde_json::Value;

pub mod error;
pub mod outcome;
pub mod sglang;

pub use error::E2eError;

/// The repository root (this crate lives in `e2e/`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("e2e has a parent").to_path_buf()
}

/// Where logs of started processes go: `target/e2e-logs/`.
pub fn log_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"))
        .join("e2e-logs");
    std::fs::create_dir_all(&dir).expect("create log dir");
    dir
}

// ---------------------------------------------------------------------------------------------
// Process groups

static GROUPS: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());
static ATEXIT: Once = Once::new();

extern "C" fn kill_registered_groups() {
    let groups: Vec<i32> = match GROUPS.lock() {
        Ok(g) => g.iter().copied().collect(),
        Err(p) => p.into_inner().iter().copied().collect(),
    };
    for pgid in &groups {
        // SAFETY: signalling a process group we created; no memory is involved.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    for pgid in &groups {
        while group_alive(*pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
    }
}

fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks existence.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

/// A child process in its own process group, killed (with the group) on drop.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    pub pgid: i32,
    pub log: PathBuf,
    exited: mpsc::Receiver<Option<i32>>,
    exit_status: Option<Option<i32>>,
    /// The guardian's stdin: closing it (this process ending) makes the guardian kill the group.
    _lifeline: ChildStdin,
}

/// Runs "$@" in the guardian's process group and waits for it. A watcher reads the pipe from the
/// test process; at EOF (the test process is gone) it sends SIGTERM to the group — ignoring it
/// itself —, waits up to 15 s for the main process, then SIGKILLs the group (itself included).
/// A SIGTERM from the test (stop) also ends the watcher. (A background job's stdin would be
/// /dev/null: the pipe is handed over as fd 3.)
const GUARDIAN: &str = r#"
exec 3<&0
"$@" </dev/null 3<&- &
child=$!
(
  while read -r _ <&3; do :; done
  trap '' TERM
  kill -TERM -- -$$ 2>/dev/null
  for _ in $(seq 150); do kill -0 "$child" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- -$$ 2>/dev/null
) &
watcher=$!
wait "$child"
status=$?
kill -KILL "$watcher" 2>/dev/null
exit "$status"
"#;

impl Proc {
    /// Spawns `program args...` (stdout and stderr to `log_dir()/NAME.log`, environment of
    /// this process plus `envs`) under a guardian in a new process group.
    pub fn spawn(name: &str, program: &Path, args: &[String], envs: &[(&str, &str)]) -> Result<Proc, E2eError> {
        ATEXIT.call_once(|| {
            // SAFETY: registering a plain extern "C" function.
            unsafe { libc::atexit(kill_registered_groups) };
        });
        let log = log_dir().join(format!("{name}.log"));
        let out = File::create(&log).map_err(E2eError::io(log.display().to_string()))?;
        let err = out.try_clone().map_err(E2eError::io(format!("{}: a second handle", log.display())))?;
        let mut cmd = Command::new("bash");
        cmd.args(["-c", GUARDIAN, "guardian"]).arg(program).args(args);
        cmd.envs(envs.iter().copied());
        cmd.stdin(Stdio::piped()).stdout(out).stderr(err);
        cmd.process_group(0);
        let mut child = cmd.spawn().map_err(E2eError::io(format!("{name}: spawn")))?;
        let pgid = child.id() as i32;
        GROUPS.lock().unwrap_or_else(|p| p.into_inner()).insert(pgid);
        let lifeline = child.stdin.take().expect("piped stdin");
        let (exit_tx, exit_rx) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("reaper-{name}"))
            .spawn(move || {
                let status = child.wait().ok().and_then(|s| s.code());
                let _ = exit_tx.send(status);
            })
            .map_err(E2eError::io(format!("{name}: the reaper thread")))?;
        Ok(Proc { name: name.to_string(), pgid, log, exited: exit_rx, exit_status: None, _lifeline: lifeline })
    }

    /// The pid of the real process (the guardian's child), e.g. to pause it; waits up to 5 s
    /// for the guardian to have started it.
    pub fn main_pid(&self) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let children =
                std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", self.pgid)).unwrap_or_default();
            let found = children.split_whitespace().filter_map(|p| p.parse().ok()).find(|&pid: &i32| {
                // The watcher subshell is a bash too; the real process is the one that is not.
                std::fs::read_to_string(format!("/proc/{pid}/comm")).map(|c| c.trim() != "bash").unwrap_or(false)
            });
            if found.is_some() || Instant::now() > deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Whether the direct child is still running.
    pub fn running(&mut self) -> bool {
        if self.exit_status.is_none() {
            if let Ok(status) = self.exited.try_recv() {
                self.exit_status = Some(status);
            }
        }
        self.exit_status.is_none()
    }

    /// SIGTERM to the group, SIGKILL after `grace`; waits (bounded) for the group to vanish.
    pub fn kill_with(&mut self, signal: i32, grace: Duration) {
        // SAFETY: signalling our own process group.
        unsafe { libc::kill(-self.pgid, signal) };
        let deadline = Instant::now() + grace;
        while group_alive(self.pgid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if group_alive(self.pgid) {
            // SAFETY: as above.
            unsafe { libc::kill(-self.pgid, libc::SIGKILL) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while group_alive(self.pgid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        GROUPS.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.pgid);
        let _ = self.exited.recv_timeout(Duration::from_secs(5)).map(|s| self.exit_status = Some(s));
    }

    /// Sends `signal` to the whole group without waiting.
    pub fn signal_group(&self, signal: i32) {
        // SAFETY: signalling our own process group.
        unsafe { libc::kill(-self.pgid, signal) };
    }

    pub fn stop(&mut self) {
        self.kill_with(libc::SIGTERM, Duration::from_secs(15));
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log, lines)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if group_alive(self.pgid) {
            self.stop();
        }
    }
}

pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else { return format!("(no log at {})", path.display()) };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(64 * 1024)));
    let mut text = String::new();
    let _ = f.read_to_string(&mut text);
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The lines of a log file containing `needle` (for assertions on engine logs).
pub fn log_lines_with(path: &Path, needle: &str) -> Vec<String> {
    let Ok(f) = File::open(path) else { return Vec::new() };
    BufReader::new(f).lines().map_while(Result::ok).filter(|l| l.contains(needle)).collect()
}

// ---------------------------------------------------------------------------------------------
// Real vLLM engines

/// What the real-vLLM suite needs from the environment.
#[derive(Clone, Debug)]
pub struct VllmSettings {
    pub venv: PathBuf,
    pub model: PathBuf,
    /// First port of the range the suite uses (default 18100).
    pub port_base: u16,
    pub connector: Connector,
}

/// The KV connector both engines run (`PD_VLLM_CONNECTOR`: `nixl`, the default, or `xfer`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Connector {
    /// vLLM's NixlConnector over NIXL.
    Nixl,
    /// pd_xfer.vllm.XferConnector: the same protocol over xfer, loaded from the unpacked wheel
    /// (`PD_XFER_SITE`), on the xfer backend `PD_XFER_BACKEND` (TCP or UCX; default TCP).
    /// `tcp_params` is the engines' `PD_XFER_TCP_PARAMS`: with `PD_XFER_MUTUAL_TLS=1`, the TCP
    /// backend's mutual TLS with a CA made for the run ([`mutual_tls_params`]).
    Xfer { site: PathBuf, backend: String, tcp_params: Option<String> },
}

/// The unpacked pd-xfer wheel engines load (`PD_XFER_SITE`) and the xfer backend they move KV
/// over (`PD_XFER_BACKEND`: TCP, the default, or UCX), for a suite whose `asked_by` setting
/// chose xfer.
pub fn xfer_site_from_env(asked_by: &'static str) -> Result<(PathBuf, String), E2eError> {
    let site =
        std::env::var_os("PD_XFER_SITE").filter(|v| !v.is_empty()).map(PathBuf::from).ok_or(E2eError::BadSetting {
            var: asked_by,
            value: "xfer".into(),
            problem: "needs PD_XFER_SITE (bindings/python/build.sh prints it)",
        })?;
    Ok((site, std::env::var("PD_XFER_BACKEND").unwrap_or_else(|_| "TCP".into())))
}

/// engine.sh's flags naming the pd-xfer wheel and backend (both engine scripts take them).
pub fn xfer_engine_args(site: &Path, backend: &str) -> Vec<String> {
    vec!["--xfer-site".into(), site.display().to_string(), "--xfer-backend".into(), backend.into()]
}

/// `PD_XFER_TCP_PARAMS` for mutual TLS: a cluster CA and one certificate of it (both extended
/// key usages, as every engine is a target and an initiator), made once per test process in
/// the log folder, so that every engine the suite starts holds the same.
pub fn mutual_tls_params() -> Result<String, E2eError> {
    // Held while the files are written: two callers at once must not write two CAs.
    static PARAMS: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);
    let mut made = PARAMS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(params) = made.as_ref() {
        return Ok(params.clone());
    }
    let dir = log_dir().join("mutual-tls");
    std::fs::create_dir_all(&dir).map_err(E2eError::io("the certificates' folder"))?;
    let ca = xfer_conformance::TestCa::new("pd-e2e cluster CA");
    let (node_cert, node_key) = ca.issue("pd-e2e-engine");
    let files = [("ca.pem", ca.cert_pem()), ("node.pem", node_cert), ("node.key", node_key)];
    for (name, pem) in &files {
        std::fs::write(dir.join(name), pem).map_err(E2eError::io(format!("writing {name}")))?;
    }
    let path = |name: &str| dir.join(name).display().to_string();
    let params = format!("tls_ca={},tls_cert={},tls_key={}", path("ca.pem"), path("node.pem"), path("node.key"));
    *made = Some(params.clone());
    Ok(params)
}

impl Connector {
    fn from_env() -> Result<Connector, E2eError> {
        match std::env::var("PD_VLLM_CONNECTOR").unwrap_or_default().as_str() {
            "" | "nixl" => Ok(Connector::Nixl),
            "xfer" => {
                let (site, backend) = xfer_site_from_env("PD_VLLM_CONNECTOR")?;
                let tcp_params = match std::env::var("PD_XFER_MUTUAL_TLS").unwrap_or_default().as_str() {
                    "" | "0" => None,
                    "1" if backend == "TCP" => Some(mutual_tls_params()?),
                    other => {
                        return Err(E2eError::BadSetting {
                            var: "PD_XFER_MUTUAL_TLS",
                            value: other.into(),
                            problem: "expected 0, or 1 with PD_XFER_BACKEND=TCP",
                        })
                    }
                };
                Ok(Connector::Xfer { site, backend, tcp_params })
            }
            other => Err(E2eError::BadSetting {
                var: "PD_VLLM_CONNECTOR",
                value: format!("{other:?}"),
                problem: "expected nixl or xfer",
            }),
        }
    }

    /// The engines' environment for this connector.
    fn engine_env(&self) -> Vec<(&'static str, &str)> {
        match self {
            Connector::Xfer { tcp_params: Some(params), .. } => vec![("PD_XFER_TCP_PARAMS", params.as_str())],
            _ => Vec::new(),
        }
    }

    /// engine.sh's flags for this connector.
    fn engine_args(&self) -> Vec<String> {
        match self {
            Connector::Nixl => vec!["--connector".into(), "nixl".into()],
            Connector::Xfer { site, backend, .. } => {
                [vec!["--connector".into(), "xfer".into()], xfer_engine_args(site, backend)].concat()
            }
        }
    }
}

impl std::fmt::Display for Connector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Connector::Nixl => f.write_str("NixlConnector"),
            Connector::Xfer { backend, tcp_params: None, .. } => write!(f, "XferConnector over {backend}"),
            Connector::Xfer { backend, tcp_params: Some(_), .. } => {
                write!(f, "XferConnector over {backend} with mutual TLS")
            }
        }
    }
}

pub const SKIP_HOW: &str = "install it with `ci/vllm/install.sh` (prints the venv) and run \
     `PD_VLLM_VENV=<venv> cargo test -p pd-e2e --test vllm -- --test-threads 1` (ci/test.sh does)";

impl VllmSettings {
    /// `Err(reason)` when the suite cannot run here (no `PD_VLLM_VENV`).
    pub fn from_env() -> Result<VllmSettings, E2eError> {
        let venv = std::env::var_os("PD_VLLM_VENV")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .ok_or(E2eError::Unset { var: "PD_VLLM_VENV" })?;
        if !venv.join("bin/vllm").exists() {
            let value = venv.display().to_string();
            return Err(E2eError::BadSetting { var: "PD_VLLM_VENV", value, problem: "has no bin/vllm" });
        }
        let model = match std::env::var_os("PD_VLLM_MODEL") {
            Some(m) if !m.is_empty() => PathBuf::from(m),
            _ => build_model(&venv)?,
        };
        let wanted = std::env::var("PD_E2E_PORT_BASE").ok().and_then(|p| p.parse().ok()).unwrap_or(27100);
        let port_base = free_port_range(wanted, 50)?;
        Ok(VllmSettings { venv, model, port_base, connector: Connector::from_env()? })
    }
}

/// The first base (from `wanted`, in steps of 100) whose `count` ports all accept a bind on
/// 127.0.0.1 and on all interfaces: other suites on this machine may hold some.
pub fn free_port_range(wanted: u16, count: u16) -> Result<u16, E2eError> {
    for step in 0..20u16 {
        let base = wanted.saturating_add(step * 100);
        let free = (base..base.saturating_add(count)).all(|p| {
            std::net::TcpListener::bind(("127.0.0.1", p)).is_ok() && std::net::TcpListener::bind(("0.0.0.0", p)).is_ok()
        });
        if free {
            return Ok(base);
        }
    }
    Err(E2eError::NoFreePorts { wanted, count })
}

/// Runs `ci/vllm/make-model.py` with the venv's python (cached after the first build).
pub fn build_model(venv: &Path) -> Result<PathBuf, E2eError> {
    let out = Command::new(venv.join("bin/python"))
        .arg(repo_root().join("ci/vllm/make-model.py"))
        .stderr(Stdio::inherit())
        .output()
        .map_err(E2eError::io("make-model.py"))?;
    if !out.status.success() {
        return Err(E2eError::Failed { what: "make-model.py".into(), status: out.status });
    }
    let path = String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or_default().trim().to_string();
    Ok(PathBuf::from(path))
}

/// How to start one engine.
#[derive(Clone, Debug)]
pub struct EngineSpec {
    pub name: String,
    pub port: u16,
    pub side_port: u16,
    pub core: u32,
    /// KV-event publisher port (replay on the next one).
    pub events_port: Option<u16>,
    /// Collector mode: the publisher connects to this endpoint (a coordinator's
    /// --kv-events-listen) under this topic instead of binding `events_port`; replay still binds
    /// `events_port + 1`.
    pub events_collector: Option<(String, String)>,
    pub block_size: u32,
}

/// A running real vLLM instance (started with `ci/vllm/engine.sh run`).
#[derive(Debug)]
pub struct Engine {
    pub spec: EngineSpec,
    pub proc: Proc,
    pub started_in: Duration,
}

impl Engine {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.spec.port)
    }

    /// Where the engine's own publisher binds (`None` in collector mode).
    pub fn events_endpoint(&self) -> Option<String> {
        match self.spec.events_collector {
            Some(_) => None,
            None => self.spec.events_port.map(|p| format!("tcp://127.0.0.1:{p}")),
        }
    }

    pub fn replay_endpoint(&self) -> Option<String> {
        self.spec.events_port.map(|p| format!("tcp://127.0.0.1:{}", p + 1))
    }

    /// Spawns the engine; call [`Engine::wait_healthy`] next (lets two engines start together).
    pub fn spawn(settings: &VllmSettings, spec: EngineSpec) -> Result<Engine, E2eError> {
        let mut args: Vec<String> = vec!["run".into(), spec.name.clone()];
        for (flag, value) in [
            ("--port", spec.port.to_string()),
            ("--side-port", spec.side_port.to_string()),
            ("--core", spec.core.to_string()),
            ("--block-size", spec.block_size.to_string()),
            ("--venv", settings.venv.display().to_string()),
            ("--model", settings.model.display().to_string()),
        ] {
            args.push(flag.into());
            args.push(value);
        }
        match (spec.events_port, &spec.events_collector) {
            (Some(p), Some((collector, topic))) => {
                for (flag, value) in [
                    ("--events", collector.clone()),
                    ("--replay", format!("tcp://*:{}", p + 1)),
                    ("--topic", topic.clone()),
                ] {
                    args.push(flag.into());
                    args.push(value);
                }
            }
            (Some(p), None) => {
                args.push("--events".into());
                args.push(format!("tcp://*:{p}"));
            }
            (None, _) => {}
        }
        args.extend(settings.connector.engine_args());
        // The suites check the protocol, not the engine's speed: eager mode skips the
        // torch.compile warm-up, about 25 s of every start on two cores.
        args.push("--eager".into());
        let script = repo_root().join("ci/vllm/engine.sh");
        let env = settings.connector.engine_env();
        let proc =
            Proc::spawn(&spec.name, Path::new("bash"), &[vec![script.display().to_string()], args].concat(), &env)?;
        Ok(Engine { spec, proc, started_in: Duration::ZERO })
    }

    /// Waits (bounded) for `GET /health` to answer 200.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<(), E2eError> {
        let start = Instant::now();
        let url = format!("{}/health", self.url());
        loop {
            if http_status_blocking(&url) == Some(200) {
                self.started_in = start.elapsed();
                return Ok(());
            }
            if !self.proc.running() {
                let (name, log_tail) = (self.spec.name.clone(), self.proc.log_tail(40));
                return Err(E2eError::ExitedDuringStart { name, log_tail });
            }
            if start.elapsed() > timeout {
                let (name, log_tail) = (self.spec.name.clone(), self.proc.log_tail(40));
                return Err(E2eError::NotReady { name, waited_for: "no /health".into(), timeout, log_tail });
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Stops this instance and starts it again with the same spec (waits for health).
    pub fn restart(&mut self, settings: &VllmSettings, timeout: Duration) -> Result<(), E2eError> {
        self.proc.stop();
        let mut fresh = Engine::spawn(settings, self.spec.clone())?;
        fresh.wait_healthy(timeout)?;
        std::mem::swap(self, &mut fresh);
        Ok(())
    }
}

/// A minimal blocking HTTP GET status check on 127.0.0.1 (no runtime needed).
pub fn http_status_blocking(url: &str) -> Option<u16> {
    use std::io::Write;
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let addr: std::net::SocketAddr = host.replace("localhost", "127.0.0.1").parse().ok()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(3))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).ok()?;
    let line = std::str::from_utf8(&buf[..n]).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

// ---------------------------------------------------------------------------------------------
// Prometheus text

/// The sum of every sample of `name` whose labels include all of `labels` (`k="v"` pairs).
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut total = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = match line.rsplit_once(' ') {
            Some(x) => x,
            None => continue,
        };
        let (metric, label_text) = match series.split_once('{') {
            Some((m, l)) => (m, l.trim_end_matches('}')),
            None => (series, ""),
        };
        if metric != name {
            continue;
        }
        if labels.iter().all(|(k, v)| label_text.contains(&format!("{k}=\"{v}\""))) {
            total += value.parse::<f64>().unwrap_or(0.0);
        }
    }
    total
}

/// `GET url` within 10 s, the body as text.
pub async fn get_text(client: &reqwest::Client, url: &str) -> String {
    let response = client.get(url).timeout(Duration::from_secs(10)).send().await;
    let body = response.unwrap_or_else(|e| panic!("GET {url}: {e}")).text().await;
    body.unwrap_or_else(|e| panic!("GET {url}: the body: {e}"))
}

/// `GET {base}/metrics` and [`metric_sum`].
pub async fn metric(client: &reqwest::Client, base: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_sum(&get_text(client, &format!("{base}/metrics")).await, name, labels)
}

// ---------------------------------------------------------------------------------------------
// OpenAI helpers

/// The generated text of a non-streaming completion or chat completion.
pub fn response_text(body: &Value) -> String {
    let choice = &body["choices"][0];
    if let Some(t) = choice["text"].as_str() {
        return t.to_string();
    }
    choice["message"]["content"].as_str().unwrap_or_default().to_string()
}

/// Concatenates the text deltas of an SSE stream body; `Err` when it never said `[DONE]`.
pub fn sse_text(body: &str) -> Result<String, E2eError> {
    let mut text = String::new();
    let mut done = false;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data:") else { continue };
        let data = data.trim();
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(E2eError::json(format!("bad SSE chunk {data:?}")))?;
        if v.get("error").is_some() {
            return Err(E2eError::Answer { what: "error in stream", body: v.to_string() });
        }
        let choice = &v["choices"][0];
        if let Some(t) = choice["text"].as_str() {
            text.push_str(t);
        } else if let Some(t) = choice["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    if done {
        Ok(text)
    } else {
        Err(E2eError::Answer { what: "stream ended without [DONE]", body: format!("{body:?}") })
    }
}

/// Written straight to stderr: libtest's capture only hooks the print macros, so these lines
/// show even for passing tests.
pub fn loud(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// The suites' runtime: two workers, like the 2-core machines they run on.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// A client that opens a fresh connection per request (no reuse across engines' restarts).
pub fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("client")
}

/// Polls a metric until `pred` holds (bounded), returning the last value.
pub async fn wait_metric(
    client: &reqwest::Client,
    base: &str,
    name: &str,
    labels: &[(&str, &str)],
    timeout: Duration,
    pred: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + timeout;
    loop {
        let v = metric(client, base, name, labels).await;
        if pred(v) || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// POSTs JSON and returns (status, body as text).
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Result<(u16, String), E2eError> {
    let http = |what: String| move |source| E2eError::Http { what, source };
    let resp = client.post(url).json(body).timeout(timeout).send().await.map_err(http(format!("POST {url}")))?;
    let status = resp.status().as_u16();
    let text = resp.text().await.map_err(http(format!("POST {url}: body")))?;
    Ok((status, text))
}

/// A suite's shared fixture, started once by `start` on first use. `None`, after a loud
/// SKIPPED line naming `test` and `how_to_run`, when the environment variable `venv_var` (the
/// engine's venv) is unset; a fixture that fails to start fails every test that asks for it.
pub fn shared_fixture<T>(
    cell: &'static std::sync::OnceLock<Result<T, E2eError>>,
    start: fn() -> Result<T, E2eError>,
    (engine, venv_var, how_to_run): (&str, &str, &str),
    test: &str,
) -> Option<&'static T> {
    if std::env::var_os(venv_var).is_none_or(|v| v.is_empty()) {
        loud(&format!("SKIPPED: real-{engine} test `{test}` did not run: {venv_var} is not set; {how_to_run}"));
        return None;
    }
    match cell.get_or_init(start) {
        Ok(fixture) => Some(fixture),
        Err(e) => panic!("real {engine} cluster did not start: {e}"),
    }
}

/// Registers an engine with the coordinator at `coordinator` (`spec` is the body of
/// `POST /v1/engines`, its `id` the engine's name); anything but 200 is an error with the body.
pub fn register_engine(coordinator: &str, spec: &Value) -> Result<(), E2eError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(E2eError::io("a runtime"))?;
    let (status, body) =
        rt.block_on(post_json(&client(), &format!("{coordinator}/v1/engines"), spec, Duration::from_secs(10)))?;
    if status != 200 {
        let id = spec.get("id").and_then(Value::as_str).unwrap_or("an engine");
        return Err(E2eError::Status { what: format!("registering {id} with the coordinator"), status, body });
    }
    Ok(())
}

/// A prompt of distinct-looking words that no earlier request shares a prefix with.
pub fn fresh_prompt(tag: &str, words: usize) -> String {
    const WORDS: &[&str] = &[
        "license",
        "software",
        "copy",
        "source",
        "code",
        "program",
        "work",
        "terms",
        "rights",
        "any",
        "free",
        "public",
        "general",
        "version",
        "modify",
        "distribute",
        "without",
        "warranty",
        "notice",
        "permission",
        "provided",
        "holders",
        "conditions",
        "following",
        "library",
        "patent",
        "object",
    ];
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let mut x = (nanos as u64) ^ 0x9e37_79b9_7f4a_7c15;
    let mut out = format!("{tag} {nanos}:");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push(' ');
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// KV events

/// Subscribes to an engine's KV events (a ZMQ SUB socket on a thread, batches decoded by
/// pd_protocols).
#[derive(Debug)]
pub struct Subscription {
    stop: Arc<AtomicBool>,
    rx: mpsc::Receiver<EventBatch>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Subscription {
    pub fn new(endpoint: String) -> Subscription {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let sub = ctx.socket(zmq::SUB).expect("SUB");
            sub.set_rcvtimeo(200).expect("rcvtimeo");
            sub.set_linger(0).expect("linger");
            sub.set_subscribe(b"kv-events").expect("subscribe");
            sub.connect(&endpoint).expect("connect");
            while !flag.load(Ordering::Acquire) {
                let Ok(frames) = sub.recv_multipart(0) else { continue };
                let (_, _, payload) = parse_pub(&frames).expect("3-frame PUB message");
                let _ = tx.send(decode_batch(payload).expect("event batch decodes"));
            }
        });
        Subscription { stop, rx, thread: Some(thread) }
    }

    /// Stored block hashes (in order) and their token ids seen until `enough` holds or timeout.
    pub fn stored_until(
        &self,
        timeout: Duration,
        enough: impl Fn(&[u64]) -> bool,
    ) -> (Vec<u64>, Vec<u32>, Option<u64>) {
        let deadline = Instant::now() + timeout;
        let (mut hashes, mut tokens, mut first_parent) = (Vec::new(), Vec::new(), None);
        while !enough(&hashes) && Instant::now() < deadline {
            if let Ok(batch) = self.rx.recv_timeout(Duration::from_millis(200)) {
                for ev in batch.events {
                    if let KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } = ev {
                        if hashes.is_empty() {
                            first_parent = parent_block_hash.map(|h| h.as_u64());
                        }
                        hashes.extend(block_hashes.iter().map(|h| h.as_u64()));
                        tokens.extend(token_ids);
                    }
                }
            }
        }
        (hashes, tokens, first_parent)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Workspace binaries

/// Builds (if needed) and locates a binary of another workspace package, e.g.
/// `workspace_bin("pd-sidecar", "pd-sidecar")`. Integration tests cannot use
/// `CARGO_BIN_EXE_*` for other packages, so this runs `cargo build --workspace --all-features
/// --bin BIN` (a no-op after the test command's build; `package` only names it in errors).
pub fn workspace_bin(package: &str, bin: &str) -> Result<PathBuf, E2eError> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(repo_root())
        // The test command's own selection (every member, every feature), so this reuses its
        // build instead of compiling the daemons again with other features.
        .args(["build", "--quiet", "--locked", "--workspace", "--all-features", "--bin", bin])
        .status()
        .map_err(E2eError::io(format!("cargo build --bin {bin} (package {package})")))?;
    if !status.success() {
        return Err(E2eError::Failed { what: format!("cargo build --bin {bin} (package {package})"), status });
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| repo_root().join("target"));
    let path = target.join("debug").join(bin);
    if path.exists() {
        Ok(path)
    } else {
        Err(E2eError::NotBuilt { path })
    }
}

/// Waits (bounded) for `url` to answer 200, failing early when `proc` exits.
pub fn wait_http_ok(proc: &mut Proc, url: &str, timeout: Duration) -> Result<Duration, E2eError> {
    let start = Instant::now();
    loop {
        if http_status_blocking(url) == Some(200) {
            return Ok(start.elapsed());
        }
        if !proc.running() {
            return Err(E2eError::ExitedDuringStart { name: proc.name.clone(), log_tail: proc.log_tail(30) });
        }
        if start.elapsed() > timeout {
            let (name, log_tail) = (proc.name.clone(), proc.log_tail(30));
            return Err(E2eError::NotReady { name, waited_for: format!("{url} not 200"), timeout, log_tail });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops one process with SIGSTOP until dropped (SIGCONT), e.g. to hold a request between legs.
#[derive(Debug)]
pub struct Paused {
    pid: i32,
}

impl Paused {
    pub fn new(pid: i32) -> Paused {
        // SAFETY: signalling a process we started.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        Paused { pid }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.pid, libc::SIGCONT) };
    }
}
