//! Child processes of a local cluster: each in its own process group, its output in a log file,
//! killed (the whole group: SIGTERM, then SIGKILL after a bounded wait) when its guard drops —
//! on normal exit, on Ctrl-C (the caller drops the cluster) and on panic (unwinding drops it).

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::sys::wait::{waitid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    #[error("starting {name} ({bin}): {source} (built? `cargo build -p pd-sim -p pd-coordinator -p pd-sidecar`, or name it with --sim-bin / --coordinator-bin / --sidecar-bin)")]
    Spawn { name: String, bin: String, source: std::io::Error },
    #[error("{name} exited during startup ({status}); last log lines:\n{log}")]
    Exited { name: String, status: String, log: String },
    #[error("{name} did not answer {url} within {secs} s; last log lines:\n{log}")]
    NotHealthy { name: String, url: String, secs: u64, log: String },
    #[error("no free port: {0}")]
    Port(std::io::Error),
}

/// A free loopback port for a child to bind ([`crate::ports::free_loopback_port`]).
pub fn free_port() -> Result<u16, ProcError> {
    crate::ports::free_loopback_port().map_err(ProcError::Port)
}

/// One child process; dropping it kills its process group.
#[derive(Debug)]
pub struct Proc {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Proc {
    /// Starts `cmd` in a new process group, stdin closed, stdout and stderr into `log_dir/name.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> Result<Proc, ProcError> {
        let log = log_dir.join(format!("{name}.log"));
        let bin = cmd.get_program().to_string_lossy().into_owned();
        let spawn_err = |source| ProcError::Spawn { name: name.to_string(), bin: bin.clone(), source };
        let out = File::create(&log).map_err(spawn_err)?;
        let err = out.try_clone().map_err(spawn_err)?;
        cmd.process_group(0).stdin(Stdio::null()).stdout(out).stderr(err);
        let child = cmd.spawn().map_err(spawn_err)?;
        tracing::debug!(name, pid = child.id(), "started");
        Ok(Proc { name: name.to_string(), child, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The last lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// What an exited child said: from the error it exited with (`Error: ...`, which a stack
    /// backtrace may follow) when there is one, else the log's last lines.
    fn exit_log(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        match all.iter().rposition(|l| l.starts_with("Error: ")) {
            Some(at) => all[at..].iter().take(lines).copied().collect::<Vec<_>>().join("\n"),
            None => self.log_tail(lines),
        }
    }

    /// Whether it has exited, with its status. The leader is not reaped here: while it is a
    /// zombie its pid, which is also its group's id, cannot be given to a new process, so the
    /// group signals of `stop_all` can never reach a stranger's group. `stop_all` reaps it.
    pub fn exited(&mut self) -> Option<String> {
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
        match waitid(Id::Pid(Pid::from_raw(self.child.id() as i32)), flags) {
            Ok(WaitStatus::StillAlive) => None,
            Ok(WaitStatus::Exited(_, code)) => Some(format!("exit status: {code}")),
            Ok(WaitStatus::Signaled(_, signal, _)) => Some(format!("signal: {} ({signal})", signal as i32)),
            // Stopped or continued: still there.
            Ok(_) => None,
            Err(e) => Some(format!("waiting for it failed: {e}")),
        }
    }

    /// Polls `GET url` until it answers 2xx (bounded by `timeout`); fails early if the process exits.
    pub async fn wait_healthy(
        &mut self,
        http: &reqwest::Client,
        url: &str,
        timeout: Duration,
    ) -> Result<(), ProcError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.exited() {
                return Err(ProcError::Exited { name: self.name.clone(), status, log: self.exit_log(20) });
            }
            if let Ok(r) = http.get(url).timeout(Duration::from_secs(1)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(ProcError::NotHealthy {
                    name: self.name.clone(),
                    url: url.to_string(),
                    secs: timeout.as_secs(),
                    log: self.log_tail(20),
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn signal(&self, sig: Signal) {
        // Its own process group: the group id is its pid.
        let _ = killpg(Pid::from_raw(self.child.id() as i32), sig);
    }
}

/// How long children get to exit after SIGTERM before SIGKILL.
pub const TERM_GRACE: Duration = Duration::from_secs(3);

/// Stops every process: SIGTERM to all groups, a bounded wait, SIGKILL to the rest, reaped.
pub fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter_mut() {
        if p.exited().is_none() {
            p.signal(Signal::SIGTERM);
        }
    }
    let deadline = Instant::now() + TERM_GRACE;
    while Instant::now() < deadline && procs.iter_mut().any(|p| p.exited().is_none()) {
        std::thread::sleep(Duration::from_millis(10));
    }
    for p in procs.iter_mut() {
        // SIGKILL the group even when the leader has exited, in case it left children behind; the
        // unreaped leader keeps the group id from being reused until the wait below.
        p.signal(Signal::SIGKILL);
        let _ = p.child.wait();
    }
}

/// The processes of a cluster; dropping it stops them all.
#[derive(Debug, Default)]
pub struct Group {
    procs: Vec<Proc>,
}

impl Group {
    pub fn push(&mut self, p: Proc) -> &mut Proc {
        self.procs.push(p);
        self.procs.last_mut().expect("just pushed")
    }

    pub fn pids(&self) -> Vec<u32> {
        self.procs.iter().map(Proc::pid).collect()
    }

    pub fn proc_mut(&mut self, i: usize) -> &mut Proc {
        &mut self.procs[i]
    }

    pub fn procs(&self) -> &[Proc] {
        &self.procs
    }

    pub fn stop(&mut self) {
        stop_all(&mut self.procs);
        self.procs.clear();
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Where a sibling binary is: next to this executable (`target/<profile>/`), else its name for a
/// `$PATH` lookup.
pub fn sibling_binary(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join(name)))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alive(pid: u32) -> bool {
        nix::sys::signal::kill(Pid::from_raw(pid as i32), None).is_ok()
    }

    #[test]
    fn an_exited_leader_stays_unreaped_until_its_group_is_stopped() {
        let dir = std::env::temp_dir();
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "exit 3"]);
        let mut p = Proc::spawn(&format!("pdbench-test-exit-{}", std::process::id()), cmd, &dir).unwrap();
        let pid = p.pid();
        let log = p.log_path().to_path_buf();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(status) = p.exited() {
                break status;
            }
            assert!(Instant::now() < deadline, "sh -c 'exit 3' never exited");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status, "exit status: 3");
        // Asked twice, it answers the same: nothing reaped it in between.
        assert_eq!(p.exited().as_deref(), Some("exit status: 3"));
        // A zombie still holds its pid (and so its group id) against reuse.
        assert!(alive(pid), "the exited leader was reaped before the group was stopped");
        let mut g = Group::default();
        g.push(p);
        g.stop();
        assert!(!alive(pid), "stopping the group did not reap the leader");
        let _ = std::fs::remove_file(log);
    }

    #[test]
    fn group_drop_kills_the_process_and_its_children() {
        let dir = std::env::temp_dir();
        let mut cmd = Command::new("sh");
        // A shell that ignores SIGTERM and leaves a grandchild: only SIGKILL to the group ends both.
        cmd.args(["-c", "trap '' TERM; sleep 300 & echo $! ; wait"]);
        let p = Proc::spawn(&format!("pdbench-test-{}", std::process::id()), cmd, &dir).unwrap();
        let leader = p.pid();
        let log = p.log_path().to_path_buf();
        let mut g = Group::default();
        g.push(p);
        let deadline = Instant::now() + Duration::from_secs(5);
        let grandchild: u32 = loop {
            if let Ok(n) = std::fs::read_to_string(&log).unwrap_or_default().trim().parse() {
                break n;
            }
            assert!(Instant::now() < deadline, "grandchild pid never logged");
            std::thread::sleep(Duration::from_millis(10));
        };
        assert!(alive(leader) && alive(grandchild));
        drop(g);
        // The grandchild is reparented and reaped by init; give it a bounded moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        while alive(grandchild) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!alive(leader), "leader survived");
        assert!(!alive(grandchild), "grandchild survived");
        let _ = std::fs::remove_file(log);
    }
}
