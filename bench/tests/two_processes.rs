//! xferbench end to end: the initiator spawns itself as the target, moves real bytes over
//! loopback and verifies them (`--check`).

use std::path::PathBuf;
use std::process::{Command, Output};

fn xferbench(line: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xferbench"))
        .args(line.split_whitespace())
        .arg("--no-progress")
        .output()
        .expect("runs xferbench")
}

fn json_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("xferbench-{name}-{}.json", std::process::id()))
}

/// Runs `line --json <tmp>` and returns the rows it wrote, and its stdout.
fn rows(name: &str, line: &str) -> (Vec<serde_json::Value>, String) {
    let path = json_path(name);
    let output = xferbench(&format!("{line} --json {}", path.display()));
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).ok();
    (serde_json::from_str(&text).unwrap(), stdout)
}

#[test]
fn compare_both_ops_with_check() {
    let line = "--compare --op both --block-sizes 4K,64K --batch 4 --threads 2 --iters 5 --warmup 1 --repeat 2 --check";
    let (rows, stdout) = rows("compare", line);
    assert_eq!(rows.len(), 8);
    for row in &rows {
        assert!(row["gbps"].as_f64().unwrap() > 0.0, "{row}");
        assert_eq!(row["bytes"], row["block_size"].as_u64().unwrap() * 4 * 2 * 5);
        assert_eq!(row["repeat"], 2);
        let is_tcp = row["backend"] == "tcp";
        assert_eq!(row.get("ratio_vs_raw").is_some(), is_tcp, "{row}");
    }
    assert!(stdout.contains("vs raw") && stdout.contains("raw-tcp"), "{stdout}");
}

#[test]
fn scattered_kv_shape_with_check() {
    let (rows, stdout) = rows("kv", "--kv-shape --op both --iters 2 --warmup 0 --check");
    assert_eq!(rows.len(), 4);
    assert_eq!((rows[0]["block_size"].as_u64(), rows[0]["batch"].as_u64()), (Some(16384), Some(2048)));
    assert_eq!(rows[0]["scatter"], true);
    assert!(rows[0]["ratio_vs_contiguous"].as_f64().unwrap() > 0.0);
    assert!(stdout.contains("kv-shape tcp write"), "{stdout}");
}

#[test]
fn kv_shape_under_grants_with_check() {
    let (rows, stdout) = rows("grants", "--kv-shape --op both --iters 2 --warmup 0 --check --grants");
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|row| row["backend"] == "tcp+grants"), "{rows:?}");
    assert!(stdout.contains("kv-shape tcp+grants read"), "{stdout}");

    let out = xferbench("--backend raw-tcp --grants --iters 1");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--grants needs an xfer backend"));
}

#[test]
fn a_window_of_requests_in_flight_with_check() {
    let line = "--op both --block-sizes 4K,1M --threads 2 --window 8 --iters 12 --warmup 3 --check";
    let (rows, stdout) = rows("window", line);
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!((row["window"].as_u64(), row["threads"].as_u64()), (Some(8), Some(2)), "{row}");
        assert_eq!(row["bytes"], row["block_size"].as_u64().unwrap() * 2 * 12);
        assert!(row["gbps"].as_f64().unwrap() > 0.0 && row["p99_us"].as_f64().unwrap() > 0.0, "{row}");
    }
    assert!(stdout.contains("window 8"), "{stdout}");

    let out = xferbench("--window 4 --compare --iters 1");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--window needs an xfer backend"));
}

#[test]
fn raw_baseline_alone_and_clear_errors() {
    let (rows, _) = rows("raw", "--backend raw-tcp --op read --block-sizes 8K --iters 3 --check");
    assert_eq!(rows.len(), 1);

    let out = xferbench("--params no_such_param=1 --iters 1");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no_such_param"));

    let out = xferbench("--block-sizes 128M");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside 4K..64M"));

    // A target that is not there: the cause is said once, not once per layer that names it.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let out = xferbench(&format!("--connect {closed} --iters 1"));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.matches("Connection refused").count(), 1, "{stderr}");
    assert!(stderr.contains(&format!("side channel {closed}: connect: ")), "{stderr}");
}

#[test]
fn measured_rows_replay_with_peer_rows_into_plots_and_csv() {
    let (measured, _) = rows("replay-src", "--op read --block-sizes 4K,64K --iters 3 --warmup 0");
    let ours = json_path("replay-ours");
    std::fs::write(&ours, serde_json::to_string(&measured).unwrap()).unwrap();
    // A peer script's rows carry only the essentials.
    let peer = json_path("replay-peer");
    std::fs::write(&peer, r#"[{"backend":"mooncake-tcp","op":"read","block_size":65536,"gbps":0.3}]"#).unwrap();
    let stem = std::env::temp_dir().join(format!("xferbench-plot-{}", std::process::id()));
    let csv = stem.with_extension("csv");
    let output = xferbench(&format!(
        "--rows {},{} --plot {} --csv {}",
        ours.display(),
        peer.display(),
        stem.display(),
        csv.display()
    ));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(stdout.lines().count(), 4, "header + 2 measured + 1 peer row:\n{stdout}");
    assert!(stdout.contains("mooncake-tcp"), "{stdout}");
    let svg = std::fs::read_to_string(stem.with_extension("svg")).unwrap();
    assert!(svg.contains("mooncake-tcp") && svg.contains("READ"));
    assert!(std::fs::read(stem.with_extension("png")).unwrap().starts_with(b"\x89PNG"));
    assert_eq!(std::fs::read_to_string(&csv).unwrap().lines().count(), 4);
    let missing = xferbench("--rows /nonexistent/rows.json");
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("reading /nonexistent/rows.json"));
    for path in [ours, peer, csv, stem.with_extension("svg"), stem.with_extension("png")] {
        std::fs::remove_file(path).ok();
    }
}

#[test]
fn many_to_one_and_one_to_many_schemes() {
    let (m2o, stdout) = rows("m2o", "--scheme many-to-one --peers 3 --op both --block-sizes 64K --iters 4 --warmup 1");
    assert!(stdout.contains("3 initiator agent(s), 1 target(s)"), "{stdout}");
    assert_eq!(m2o.len(), 2);
    for row in &m2o {
        assert_eq!(row["scheme"], "many-to-one:3");
        assert_eq!(row["threads"], 3, "raised to one thread per agent");
        assert_eq!(row["bytes"], 64 * 1024 * 3 * 4);
    }
    let (o2m, stdout) = rows("o2m", "--scheme one-to-many --peers 2 --threads 4 --block-sizes 4K,1M --iters 3");
    assert!(stdout.contains("1 initiator agent(s), 2 target(s)"), "{stdout}");
    assert_eq!(o2m.len(), 2);
    assert!(o2m.iter().all(|r| r["scheme"] == "one-to-many:2" && r["gbps"].as_f64().unwrap() > 0.0));
    let refused = xferbench("--scheme one-to-many --check");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("no raw-tcp, --compare or --check"));
}

/// Over UCX 1.13's shared memory no transport can detect a failed peer, and the backend learns
/// so by asking for peer error handling once; UCX logs the refusal at ERROR level, which on a
/// healthy run would tell an operator something is broken. The run moves and checks its bytes
/// and neither process logs a UCX error.
#[cfg(feature = "ucx")]
#[test]
fn ucx_over_shared_memory_logs_no_error() {
    let out = xferbench("--backend ucx --params tls=posix+cma+self --op both --block-sizes 64K --iters 10 --check");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    // UCX logs to stdout unless UCX_LOG_FILE says otherwise.
    assert!(!stdout.contains("UCX  ERROR") && !stderr.contains("UCX  ERROR"), "{stdout}\n{stderr}");
}

/// QUIC with datagrams larger than quinn's initial congestion window allows (14,720 bytes hold
/// one 16 KiB datagram and nothing of the next): the backend raises that window, and the pair
/// connects and moves its bytes (the handshake stalled until its bound before).
#[cfg(feature = "quic")]
#[test]
fn quic_with_loopback_sized_datagrams_connects_and_moves_bytes() {
    let out =
        xferbench("--backend quic --params mtu=16384,initial_mtu=16384 --op both --block-sizes 1M --iters 4 --check");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
}
