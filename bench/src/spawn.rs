//! Finding the target: spawning this binary as one (and cleaning it up on every exit path), or
//! using one that already runs.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

const READY_TIMEOUT: Duration = Duration::from_secs(30);
const EXIT_GRACE: Duration = Duration::from_secs(2);

/// Where the target serves. Dropping it stops a target this process spawned.
#[derive(Debug)]
pub struct Target {
    /// Side-channel address (`None` for a raw-tcp-only target).
    pub side: Option<String>,
    /// Raw-tcp address (baseline and check control).
    pub raw: String,
    child: Option<Child>,
}

impl Target {
    /// Starts `current_exe() <args>` and waits for its READY line.
    pub fn spawn(args: &[String]) -> Result<Target> {
        let exe = std::env::current_exe().context("locating this executable")?;
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning the target process")?;
        let stdout = child.stdout.take().expect("piped stdout");
        // From here on the guard owns the child: any error below still stops it.
        let mut target = Target { side: None, raw: String::new(), child: Some(child) };
        let line = ready_line(stdout, READY_TIMEOUT).map_err(|e| {
            let status = target.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            match status {
                Some(status) => anyhow!("the target exited ({status}) before it was ready"),
                None => e,
            }
        })?;
        let (side, raw) = parse_ready(&line).map_err(|e| anyhow!("target: {e}"))?;
        (target.side, target.raw) = (side, raw);
        Ok(target)
    }

    /// A target that already runs: its side channel at `addr`, its raw-tcp port at PORT+1.
    pub fn running(addr: &str) -> Result<Target> {
        Ok(Target { side: Some(addr.to_string()), raw: next_port(addr)?, child: None })
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else { return };
        drop(child.stdin.take()); // the target's signal to exit
        let deadline = Instant::now() + EXIT_GRACE;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Reads `stream` up to its first line that starts with `READY` within `timeout`, then keeps
/// draining it. Lines before it go to stderr: libraries the target loads (UCX with
/// `UCX_LOG_LEVEL` set, say) may log to stdout before the target is ready.
fn ready_line(stream: impl Read + Send + 'static, timeout: Duration) -> Result<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        let read = loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(n) if n > 0 && !line.starts_with("READY") => eprint!("xferbench target: {line}"),
                done => break done.map(|_| line),
            }
        };
        let _ = tx.send(read);
        let _ = std::io::copy(&mut reader, &mut std::io::sink());
    });
    match rx.recv_timeout(timeout) {
        Ok(Ok(line)) if !line.is_empty() => Ok(line),
        Ok(Ok(_)) => bail!("the target closed its stdout before it was ready"),
        Ok(Err(err)) => Err(err).context("reading the target's READY line"),
        Err(_) => bail!("the target was not ready within {timeout:?}"),
    }
}

/// Parses `READY <side|-> <raw>`.
pub fn parse_ready(line: &str) -> Result<(Option<String>, String), String> {
    match line.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["READY", side, raw] => Ok(((*side != "-").then(|| side.to_string()), raw.to_string())),
        _ => Err(format!("expected `READY <side-channel> <raw-tcp>`, got {:?}", line.trim_end())),
    }
}

/// `host:port` → `host:port+1`.
pub fn next_port(addr: &str) -> Result<String> {
    let (host, port) = addr.rsplit_once(':').ok_or_else(|| anyhow!("{addr}: expected HOST:PORT"))?;
    let port: u16 = port.parse().with_context(|| format!("{addr}: bad port"))?;
    let next = port.checked_add(1).filter(|_| port != 0).ok_or_else(|| anyhow!("{addr}: no port after {port}"))?;
    Ok(format!("{host}:{next}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ready_lines() {
        assert_eq!(
            parse_ready("READY 127.0.0.1:4000 127.0.0.1:4001\n"),
            Ok((Some("127.0.0.1:4000".into()), "127.0.0.1:4001".into()))
        );
        assert_eq!(parse_ready("READY - 127.0.0.1:9"), Ok((None, "127.0.0.1:9".into())));
        assert!(parse_ready("error: bind failed").is_err());
    }

    #[test]
    fn next_port_is_the_raw_port() {
        assert_eq!(next_port("node-7:5600").unwrap(), "node-7:5601");
        assert_eq!(next_port("[::1]:80").unwrap(), "[::1]:81");
        assert!(next_port("node-7").is_err());
        assert!(next_port("h:65535").is_err());
        assert!(next_port("h:0").is_err());
    }

    #[test]
    fn ready_line_skips_logs_and_times_out_on_silence() {
        let (reader, _writer) = std::os::unix::net::UnixStream::pair().unwrap();
        let err = ready_line(reader, Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("not ready"), "{err}");
        assert_eq!(ready_line(&b"READY a b\nmore"[..], Duration::from_secs(5)).unwrap(), "READY a b\n");
        let logged = &b"[1.2] UCX  DEBUG loaded\nREADY a b\n"[..];
        assert_eq!(ready_line(logged, Duration::from_secs(5)).unwrap(), "READY a b\n");
        let err = ready_line(&b"UCX  ERROR failed\n"[..], Duration::from_secs(5)).unwrap_err();
        assert!(err.to_string().contains("closed its stdout"), "{err}");
    }
}
