//! Test harness: the pdbench binary and pd-sim processes, killed on drop, every wait bounded.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

pub fn pdbench() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_pdbench"))
}

/// The pd-sim binary next to pdbench; built on demand when a lone `cargo test -p pd-bench` has
/// not built it (`cargo test --workspace` does).
pub fn sim_bin() -> PathBuf {
    let path = pdbench().parent().unwrap().join("pd-sim");
    if !path.is_file() {
        eprintln!("pd-sim not built yet: building it (cargo build -p pd-sim --bin pd-sim)");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut child = Command::new(cargo).args(["build", "-p", "pd-sim", "--bin", "pd-sim"]).spawn().unwrap();
        let status = wait_bounded(&mut child, Duration::from_secs(900)).expect("building pd-sim took too long");
        assert!(status.success(), "building pd-sim failed");
    }
    path
}

pub fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process killed on drop.
pub struct Guard(pub Child);

impl Guard {
    pub fn spawn(cmd: &mut Command) -> Guard {
        Guard(cmd.stdin(Stdio::null()).spawn().expect("spawn"))
    }

    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Waits for exit (bounded); panics when it does not exit in time.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        wait_bounded(&mut self.0, timeout)
            .unwrap_or_else(|| panic!("process {} still running after {timeout:?}", self.pid()))
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Kills the listed pids on drop (the cluster's children, should pdbench leave any behind).
pub struct PidsGuard(pub Vec<u32>);

impl Drop for PidsGuard {
    fn drop(&mut self) {
        for &p in &self.0 {
            let _ = kill(Pid::from_raw(p as i32), Signal::SIGKILL);
        }
    }
}

pub fn alive(pid: u32) -> bool {
    kill(Pid::from_raw(pid as i32), None).is_ok()
}

/// Waits (bounded) until none of `pids` is alive; returns those still alive.
pub fn survivors(pids: &[u32], timeout: Duration) -> Vec<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
        if alive.is_empty() || Instant::now() >= deadline {
            return alive;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("pdbench-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

/// A pd-sim process on a free port, healthy, killed on drop.
pub struct Sim {
    pub guard: Guard,
    pub url: String,
}

impl Sim {
    pub fn start(args: &[&str]) -> Sim {
        let port = pdbench::procs::free_port().expect("a free loopback port");
        let guard = Guard::spawn(
            Command::new(sim_bin())
                .args(["--port", &port.to_string(), "--workers", "1"])
                .args(args)
                .env("RUST_LOG", "warn")
                .env_remove("VLLM_HOST_IP")
                .env_remove("VLLM_NIXL_SIDE_CHANNEL_PORT"),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                use std::io::{Read, Write};
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
                let mut buf = [0u8; 16];
                if s.read(&mut buf).is_ok_and(|n| n >= 12 && &buf[9..12] == b"200") {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "pd-sim on {port} never became healthy");
            std::thread::sleep(Duration::from_millis(20));
        }
        Sim { guard, url }
    }

    pub fn metrics(&self) -> String {
        let port: u16 = self.url.rsplit(':').next().unwrap().parse().unwrap();
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }
}

/// Runs pdbench with these arguments to completion (bounded); returns (status, stdout, stderr).
pub fn run_pdbench(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    let out = std::env::temp_dir().join(format!("pdbench-out-{}-{}", std::process::id(), rand_suffix()));
    let err = out.with_extension("err");
    let mut g = Guard::spawn(
        Command::new(pdbench())
            .args(args)
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap()),
    );
    let status = g.wait(timeout);
    let (o, e) = (std::fs::read_to_string(&out).unwrap(), std::fs::read_to_string(&err).unwrap());
    let _ = std::fs::remove_file(out);
    let _ = std::fs::remove_file(err);
    (status, o, e)
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// POSTs `body` as JSON to an `http://host:port/path` URL (HTTP/1.1, connection closed, bounded);
/// returns the status and the body (de-chunked).
pub fn post_json(url: &str, body: &serde_json::Value) -> (u16, String) {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("an http:// URL");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let mut s = std::net::TcpStream::connect(authority).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let body = body.to_string();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nhost: {authority}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, payload) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let chunked = head.lines().any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding: chunked"));
    if !chunked {
        return (status, payload.to_string());
    }
    let mut out = String::new();
    let mut rest = payload;
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    (status, out)
}
