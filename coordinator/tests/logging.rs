//! The daemon's log filter: an explicit `--log` wins over `RUST_LOG` (launchers such as pdbench
//! pass flags per child while the environment is shared), and `RUST_LOG` applies without it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long the daemon may take to start and print its first lines.
const START: Duration = Duration::from_secs(30);
/// After its start-up warning, how long the start line (logged right after it) is looked for.
const AFTER_WARNING: Duration = Duration::from_secs(2);

/// Starts pd-coordinator on free ports with `args` and `RUST_LOG=rust_log`, without an auth
/// token (so it warns at start, then logs its start at INFO); returns whether the start line
/// came, then kills it. Bounded by `START`, or by `AFTER_WARNING` once the warning came.
fn logs_its_start(args: &[&str], rust_log: &str) -> bool {
    let mut child: Child = Command::new(env!("CARGO_BIN_EXE_pd-coordinator"))
        .args(["--listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"])
        .args(args)
        .env("RUST_LOG", rust_log)
        .env_remove("PD_COORDINATOR_LOG")
        .env_remove("PD_COORDINATOR_AUTH_TOKEN")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("pd-coordinator starts");
    let stderr = child.stderr.take().expect("stderr is piped");
    let (lines, seen) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let mut deadline = Instant::now() + START;
    let mut started = false;
    while let Ok(line) = seen.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        if line.contains("INFO") && line.contains("pd-coordinator running") {
            started = true;
            break;
        }
        if line.contains("WARN") && line.contains("--auth-token") {
            deadline = deadline.min(Instant::now() + AFTER_WARNING);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    started
}

#[test]
fn log_flag_wins_over_rust_log() {
    assert!(logs_its_start(&["--log", "info"], "off"), "--log info was overridden by RUST_LOG=off");
    assert!(!logs_its_start(&["--log", "warn"], "info"), "--log warn was overridden by RUST_LOG=info");
}

#[test]
fn rust_log_applies_without_the_flag() {
    assert!(!logs_its_start(&[], "warn"), "RUST_LOG=warn was ignored: the daemon logged its start at INFO");
    assert!(logs_its_start(&[], "info"), "RUST_LOG=info: the daemon did not log its start");
}
