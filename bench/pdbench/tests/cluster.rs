//! `pdbench cluster` end to end: real pd-sim engines started by pdbench, a real workload, the
//! JSON report checked, and every child process gone afterwards — after a normal exit, after
//! SIGINT, and after a panic.

mod common;

use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Whether the suite's daemons are built next to pdbench (`cargo test --workspace` builds them).
/// One cluster at a time: each picks free loopback ports by binding port 0 and releasing it, and
/// clusters started side by side raced for the same ports (an engine failed to bind under load).
fn one_cluster_at_a_time() -> MutexGuard<'static, ()> {
    static CLUSTERS: Mutex<()> = Mutex::new(());
    CLUSTERS.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn daemons_built() -> bool {
    let dir = pdbench().parent().unwrap().to_path_buf();
    let ok = ["pd-coordinator", "pd-sidecar"].iter().all(|b| {
        Command::new(dir.join(b)).arg("--help").output().is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
    });
    if !ok {
        eprintln!("LOUD SKIP: pd-coordinator / pd-sidecar not built next to pdbench; sidecar-mode test skipped");
    }
    ok
}

#[test]
fn cluster_runs_50_requests_and_leaves_no_process() {
    let _serial = one_cluster_at_a_time();
    cluster_50("direct", 4, &[]);
}

#[test]
fn cluster_with_sidecar_pull_moves_kv_through_shared_memory_pools() {
    let _serial = one_cluster_at_a_time();
    if !daemons_built() {
        return;
    }
    let shm = TempDir::new("shm");
    let r = cluster_50("sidecar", 9, &["--pull", "--shm-dir", shm.0.to_str().unwrap()]);
    assert_eq!(r["mode"], "sidecar-pull");
    assert!(r["decisions"]["daemons"]["sidecar_pull_bytes"].as_f64().unwrap() > 0.0, "{}", r["decisions"]);
    let left: Vec<_> = std::fs::read_dir(&shm.0).unwrap().collect();
    assert!(left.is_empty(), "shared-memory pool files left behind: {left:?}");
}

#[test]
fn cluster_with_sidecars_and_coordinator_runs_50_requests_and_leaves_no_process() {
    let _serial = one_cluster_at_a_time();
    if !daemons_built() {
        return;
    }
    let r = cluster_50("sidecar", 9, &[]);
    // The sidecars and the coordinator made every decision, and they agree.
    let d = &r["decisions"];
    assert_eq!(d["disaggregated"].as_u64().unwrap() + d["local"].as_u64().unwrap(), 50, "{d}");
    assert_eq!(d["daemons"]["coordinator_disaggregated"], d["daemons"]["sidecar_disaggregated"], "{d}");
    assert_eq!(r["sidecars"].as_array().unwrap().len(), 4);
}

fn cluster_50(mode: &str, processes: usize, extra: &[&str]) -> serde_json::Value {
    let dir = TempDir::new(&format!("cluster50-{mode}{}", extra.len()));
    let sim = sim_bin();
    let report = dir.path("report.json");
    let (status, stdout, stderr) = run_pdbench(
        &[
            "cluster",
            "--mode",
            mode,
            "--requests",
            "50",
            "--no-progress",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--json",
            report.to_str().unwrap(),
        ]
        .iter()
        .chain(extra)
        .copied()
        .collect::<Vec<_>>(),
        Duration::from_secs(120),
    );
    assert!(status.success(), "pdbench cluster failed: {status}\n{stdout}\n{stderr}");
    let r = read_json(&report);
    let pids: Vec<u32> = r["pids"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap() as u32).collect();
    let _cleanup = PidsGuard(pids.clone());
    assert_eq!(r["ok"], 50, "{r}");
    assert_eq!(r["failed"], 0, "{r}");
    assert_eq!(r["summary"]["requests"], 50);
    assert!(r["kv"]["bytes"].as_f64().unwrap() > 0.0, "no KV moved: {}", r["kv"]);
    assert!(r["kv"]["transfers"].as_f64().unwrap() >= 1.0);
    assert!(r["kv"]["gb_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(r["kv"]["failed_transfers"], 0.0);
    // Shared system prompts: the prefills find them cached after their first use.
    assert!(r["kv"]["prefix_hit_rate"].as_f64().unwrap() > 0.2, "{}", r["kv"]);
    if mode == "direct" {
        assert_eq!(r["decisions"]["disaggregated"], 50);
    }
    assert!(r["summary"]["ttft_ms"]["p50"].as_f64().unwrap() > 0.0);
    assert!(r["summary"]["itl_ms"]["count"].as_u64().unwrap() > 0);
    assert_eq!(r["engines"].as_array().unwrap().len(), 4);
    assert_eq!(pids.len(), processes);
    for needle in ["50 ok, 0 failed", "KV moved", "prefix hits", "disaggregated", "TTFT", "ITL"] {
        assert!(stdout.contains(needle), "report lacks {needle:?}:\n{stdout}");
    }
    assert_eq!(survivors(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "children survived pdbench's exit");
    eprintln!("{stdout}");
    r
}

/// Starts a long cluster run and waits (bounded) until its children are up.
fn start_long_cluster(dir: &TempDir, mode: &str, extra_env: &[(&str, &str)]) -> (Guard, Vec<u32>) {
    let sim = sim_bin();
    let pids_file = dir.path("pids.json");
    let mut cmd = Command::new(pdbench());
    cmd.args(["cluster", "--mode", mode, "--requests", "1000000", "--rate", "20", "--no-progress"])
        .args(["--sim-bin", sim.to_str().unwrap(), "--log-dir", dir.0.to_str().unwrap()])
        .args(["--pids-file", pids_file.to_str().unwrap()]);
    for (k, v) in extra_env {
        cmd.env(k, v);
    }
    let mut g = Guard::spawn(&mut cmd);
    let deadline = Instant::now() + Duration::from_secs(60);
    let pids: Vec<u32> = loop {
        if let Ok(bytes) = std::fs::read(&pids_file) {
            if let Ok(p) = serde_json::from_slice::<Vec<u32>>(&bytes) {
                break p;
            }
        }
        if let Some(s) = g.0.try_wait().unwrap() {
            panic!("pdbench exited before its cluster was up: {s}");
        }
        assert!(Instant::now() < deadline, "pdbench never wrote {}", pids_file.display());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(pids.len(), if mode == "sidecar" { 9 } else { 4 });
    (g, pids)
}

#[test]
fn sigint_stops_every_child() {
    let _serial = one_cluster_at_a_time();
    sigint("direct");
}

#[test]
fn sigint_stops_every_child_with_sidecars() {
    let _serial = one_cluster_at_a_time();
    if daemons_built() {
        sigint("sidecar");
    }
}

fn sigint(mode: &str) {
    let dir = TempDir::new(&format!("sigint-{mode}"));
    let (mut g, pids) = start_long_cluster(&dir, mode, &[]);
    let _cleanup = PidsGuard(pids.clone());
    // Let the workload run a little, then interrupt as Ctrl-C would.
    std::thread::sleep(Duration::from_millis(500));
    assert!(pids.iter().all(|&p| alive(p)), "children died before SIGINT");
    assert!(g.0.try_wait().unwrap().is_none(), "pdbench finished a million requests already?");
    kill(Pid::from_raw(g.pid() as i32), Signal::SIGINT).unwrap();
    let status = g.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(130), "exit status after SIGINT: {status}");
    assert_eq!(survivors(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "children survived SIGINT");
}

#[test]
fn sigterm_stops_every_child() {
    let _serial = one_cluster_at_a_time();
    let dir = TempDir::new("sigterm");
    let (mut g, pids) = start_long_cluster(&dir, "direct", &[]);
    let _cleanup = PidsGuard(pids.clone());
    kill(Pid::from_raw(g.pid() as i32), Signal::SIGTERM).unwrap();
    let status = g.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(130), "{status}");
    assert_eq!(survivors(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "children survived SIGTERM");
}

#[test]
fn panic_stops_every_child() {
    let _serial = one_cluster_at_a_time();
    let dir = TempDir::new("panic");
    // A test hook: pdbench panics right after its cluster is up; unwinding must stop the children.
    let (mut g, pids) = start_long_cluster(&dir, "direct", &[("PDBENCH_TEST_PANIC_AFTER_START", "1")]);
    let _cleanup = PidsGuard(pids.clone());
    let status = g.wait(Duration::from_secs(20));
    assert!(!status.success(), "pdbench should have panicked");
    assert_eq!(survivors(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "children survived a panic");
}

#[test]
fn vllm_variant_drives_engines_it_did_not_start() {
    let _serial = one_cluster_at_a_time();
    // Simulators stand in for already-running vLLM engines: pdbench must use them as given,
    // start nothing, and stop nothing.
    let (p, d) = (Sim::start(&[]), Sim::start(&[]));
    let dir = TempDir::new("vllm-variant");
    let report = dir.path("report.json");
    let (status, stdout, stderr) = run_pdbench(
        &[
            "cluster",
            "--vllm",
            "--prefill-url",
            &p.url,
            "--decode-url",
            &d.url,
            "--requests",
            "12",
            "--model",
            "sim-model",
            "--no-progress",
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--json",
            report.to_str().unwrap(),
        ],
        Duration::from_secs(120),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let r = read_json(&report);
    assert_eq!(r["ok"], 12, "{r}");
    assert_eq!(r["mode"], "direct");
    assert_eq!(r["pids"].as_array().unwrap().len(), 0);
    assert!(r["kv"]["bytes"].as_f64().unwrap() > 0.0, "{}", r["kv"]);
    assert!(alive(p.guard.pid()) && alive(d.guard.pid()), "pdbench stopped engines it did not start");
}
