//! For the test harnesses that run `pd-sim` processes (this crate's, the sidecar's and the
//! coordinator's): where the binary is, a command with a clean environment, bounded waits for
//! `/health` (cut short when the child dies) and for an exit, and retries on fresh ports.
//! Ports come from [`crate::ports`].

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long building a missing `pd-sim` may take.
const BUILD_LIMIT: Duration = Duration::from_secs(900);

/// The `pd-sim` binary: `PD_SIM_BIN` when set, else the one in the target directory `dir` (where
/// the calling test's own binaries are), built with cargo first when it is missing (`cargo test
/// -p <crate>` alone does not build another package's binaries). The build is bounded, so a
/// cargo that still holds the build lock makes the test fail with a hint instead of hang.
pub fn binary_in(dir: &Path) -> PathBuf {
    if let Some(path) = std::env::var_os("PD_SIM_BIN") {
        return PathBuf::from(path);
    }
    let path = dir.join("pd-sim");
    if !path.exists() {
        let mut build = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        build.args(["build", "-p", "pd-sim", "--bin", "pd-sim"]);
        if dir.ends_with("release") {
            build.arg("--release");
        }
        let mut child = build.spawn().expect("running cargo build -p pd-sim");
        let deadline = Instant::now() + BUILD_LIMIT;
        let status = loop {
            if let Some(status) = child.try_wait().expect("waiting for cargo") {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("cargo build -p pd-sim did not finish; build it first (cargo build -p pd-sim)");
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(status.success(), "cargo build -p pd-sim failed");
    }
    assert!(path.exists(), "no pd-sim binary at {}", path.display());
    path
}

/// A `pd-sim` command listening on `port`, logging at `log` (`RUST_LOG`), stdin closed, without
/// the variables a developer's shell may carry that change what the simulator advertises or
/// hashes (vLLM's `VLLM_HOST_IP`, `VLLM_NIXL_SIDE_CHANNEL_PORT`, `PYTHONHASHSEED`).
pub fn command(bin: &Path, port: u16, log: &str) -> Command {
    let mut cmd = Command::new(bin);
    cmd.args(["--port", &port.to_string()])
        .env("RUST_LOG", log)
        .env_remove("PYTHONHASHSEED")
        .env_remove("VLLM_HOST_IP")
        .env_remove("VLLM_NIXL_SIDE_CHANNEL_PORT")
        .stdin(Stdio::null());
    cmd
}

/// Why a process started for a test never answered `/health`.
#[derive(Debug)]
pub enum NotHealthy {
    /// It exited first (most often: its port was taken between drawing it and binding it).
    Exited(ExitStatus),
    /// It was still running, silent, when the wait ended.
    TimedOut(Duration),
}

impl std::fmt::Display for NotHealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotHealthy::Exited(status) => write!(f, "it exited ({status}) before answering /health"),
            NotHealthy::TimedOut(after) => write!(f, "/health did not answer 200 within {after:?}"),
        }
    }
}

/// Waits until `GET {url}/health` answers 200 (`url` is `http://host:port`), `child` exits, or
/// `within` passes, whichever comes first: a child that died says so at once instead of
/// leaving the caller to wait out the bound.
pub async fn healthy(child: &mut Child, url: &str, within: Duration) -> Result<(), NotHealthy> {
    let Some(authority) = url.strip_prefix("http://").map(|rest| rest.trim_end_matches('/')) else {
        panic!("health checks take an http:// URL, not {url}");
    };
    let deadline = Instant::now() + within;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(NotHealthy::Exited(status));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(NotHealthy::TimedOut(within));
        }
        if let Ok(Ok(true)) = tokio::time::timeout(left.min(Duration::from_secs(2)), health_ok(authority)).await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `start` (which draws fresh ports each time) until what it started is healthy, at most
/// three times when it exits first: a port drawn free can be taken by another process before
/// the child binds it. `what` names it in the panic when every attempt failed.
pub async fn start_with_retries<T, F>(what: &str, mut start: impl FnMut() -> F) -> T
where
    F: std::future::Future<Output = Result<T, NotHealthy>>,
{
    const ATTEMPTS: usize = 3;
    for attempt in 1..=ATTEMPTS {
        match start().await {
            Ok(started) => return started,
            Err(NotHealthy::Exited(status)) if attempt < ATTEMPTS => {
                eprintln!("{what}: exited ({status}) before answering /health; retrying on fresh ports");
            }
            Err(reason) => panic!("{what}: {reason} (attempt {attempt} of {ATTEMPTS})"),
        }
    }
    unreachable!("the last attempt returns or panics")
}

async fn health_ok(authority: &str) -> std::io::Result<bool> {
    let mut stream = tokio::net::TcpStream::connect(authority).await?;
    let request = format!("GET /health HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut head = [0u8; 16];
    let mut read = 0;
    while read < head.len() {
        let n = stream.read(&mut head[read..]).await?;
        if n == 0 {
            break;
        }
        read += n;
    }
    Ok(head[..read].starts_with(b"HTTP/1.1 200") || head[..read].starts_with(b"HTTP/1.0 200"))
}

/// Whether `child` exited within `within` (polled; it is reaped if so).
pub async fn exited_within(child: &mut Child, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if child.try_wait().is_ok_and(|status| status.is_some()) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn health_is_a_200_and_nothing_else() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let answers = ["HTTP/1.1 503 Service Unavailable\r\n\r\n", "HTTP/1.1 200 OK\r\n\r\n"];
        let server = tokio::spawn(async move {
            for answer in answers {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 256];
                let _ = s.read(&mut buf).await.unwrap();
                s.write_all(answer.as_bytes()).await.unwrap();
            }
        });
        let mut running = Command::new("sleep").arg("5").spawn().unwrap();
        assert!(healthy(&mut running, &url, Duration::from_secs(5)).await.is_ok());
        server.await.unwrap();
        // Nobody listening: timed out after the bound, not a hang.
        let started = Instant::now();
        let reason = healthy(&mut running, &url, Duration::from_millis(200)).await;
        assert!(matches!(reason, Err(NotHealthy::TimedOut(_))), "{reason:?}");
        assert!(started.elapsed() < Duration::from_secs(3));
        let _ = running.kill();
        let _ = running.wait();
        // A child that dies is reported at once, well before the bound.
        let mut dead = Command::new("false").spawn().unwrap();
        let started = Instant::now();
        let reason = healthy(&mut dead, &url, Duration::from_secs(20)).await;
        assert!(matches!(reason, Err(NotHealthy::Exited(status)) if !status.success()), "{reason:?}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn starts_are_retried_only_when_the_child_exited() {
        let mut attempts = 0;
        let started = start_with_retries("flaky", || {
            attempts += 1;
            let outcome = if attempts < 3 {
                Err(NotHealthy::Exited(Command::new("false").status().unwrap()))
            } else {
                Ok(attempts)
            };
            async move { outcome }
        })
        .await;
        assert_eq!(started, 3);
        let silent = tokio::spawn(start_with_retries("silent", || async {
            Err::<(), _>(NotHealthy::TimedOut(Duration::from_millis(1)))
        }));
        let panic = silent.await.expect_err("a timeout is not retried").into_panic();
        let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(message.contains("attempt 1 of 3"), "{message}");
    }

    #[tokio::test]
    async fn exits_are_seen_and_waits_are_bounded() {
        let mut quick = Command::new("true").spawn().unwrap();
        assert!(exited_within(&mut quick, Duration::from_secs(5)).await);
        let mut slow = Command::new("sleep").arg("5").spawn().unwrap();
        assert!(!exited_within(&mut slow, Duration::from_millis(100)).await);
        let _ = slow.kill();
        let _ = slow.wait();
    }
}
