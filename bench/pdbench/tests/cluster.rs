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
    let (disaggregated, local) = (d["disaggregated"].as_u64().unwrap(), d["local"].as_u64().unwrap());
    assert_eq!(disaggregated + local, 50, "{d}");
    assert_eq!(d["daemons"]["coordinator_disaggregated"], d["daemons"]["sidecar_disaggregated"], "{d}");
    // The sample workload's prompts are long enough to be worth moving: most are disaggregated.
    assert!(disaggregated >= 40, "only {disaggregated} of 50 disaggregated: {d}");
    // Every local decision has a reason the sidecars counted, and the report says it in words.
    let reasons = &d["daemons"]["local_reasons"];
    let explained: f64 = reasons.as_object().unwrap().values().map(|v| v.as_f64().unwrap()).sum();
    assert_eq!(explained, local as f64, "{reasons}");
    if reasons["coordinator"].as_f64().unwrap() > 0.0 {
        let stdout = r["stdout"].as_str().unwrap();
        assert!(
            stdout.contains("mostly cached on the decode") && stdout.contains("--local-prefill-max-tokens"),
            "{stdout}"
        );
    }
    assert_eq!(r["sidecars"].as_array().unwrap().len(), 4);
}

#[test]
fn cluster_serve_answers_openai_requests_until_sigint() {
    let _serial = one_cluster_at_a_time();
    if !daemons_built() {
        return;
    }
    let dir = TempDir::new("serve");
    let (out, pids_file, report) = (dir.path("stdout"), dir.path("pids.json"), dir.path("report.json"));
    let sim = sim_bin();
    let mut g = Guard::spawn(
        Command::new(pdbench())
            .args(["cluster", "--mode", "sidecar", "--serve", "--requests", "4", "--no-progress"])
            .args(["--sim-bin", sim.to_str().unwrap(), "--log-dir", dir.0.to_str().unwrap()])
            .args(["--pids-file", pids_file.to_str().unwrap(), "--json", report.to_str().unwrap()])
            .stdout(std::fs::File::create(&out).unwrap()),
    );
    // The sample workload runs first, then the banner.
    let deadline = Instant::now() + Duration::from_secs(120);
    let stdout = loop {
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        if text.contains("python (pip install openai)") && text.contains("print(r.choices") {
            break text;
        }
        if let Some(s) = g.0.try_wait().unwrap() {
            panic!("pdbench exited while it should serve: {s}\n{text}");
        }
        assert!(Instant::now() < deadline, "no --serve banner after 120 s:\n{text}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let pids: Vec<u32> = serde_json::from_slice(&std::fs::read(&pids_file).unwrap()).unwrap();
    let _cleanup = PidsGuard(pids.clone());
    assert_eq!(pids.len(), 9);
    assert!(stdout.contains("4 ok, 0 failed"), "{stdout}");
    let base = stdout.lines().find_map(|l| l.strip_prefix("  base URL   ")).expect("a base URL line").trim();
    let model = stdout.lines().find_map(|l| l.strip_prefix("  model      ")).expect("a model line").trim();
    assert_eq!(model, "sim-model");
    assert!(stdout.contains(&format!("curl -sN {base}/chat/completions")), "{stdout}");
    assert_eq!(read_json(&report)["serve"]["base_url"], base);

    // A real request from outside, long enough to be disaggregated, through the printed URL.
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(64);
    let body = serde_json::json!({
        "model": model, "max_tokens": 8,
        "messages": [{"role": "user", "content": prompt}],
    });
    let (status, answer) = post_json(&format!("{base}/chat/completions"), &body);
    assert_eq!(status, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{e}: {answer}"));
    assert!(v["choices"][0]["message"]["content"].as_str().is_some_and(|c| !c.is_empty()), "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");

    assert!(pids.iter().all(|&p| alive(p)), "children died while serving");
    kill(Pid::from_raw(g.pid() as i32), Signal::SIGINT).unwrap();
    let status = g.wait(Duration::from_secs(20));
    assert_eq!(status.code(), Some(130), "exit status after SIGINT: {status}");
    assert_eq!(survivors(&pids, Duration::from_secs(5)), Vec::<u32>::new(), "children survived SIGINT");
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
    // The TTFT/E2E plots go to the log directory by default, and the report names them.
    let plots: Vec<&str> = r["plots"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
    if plots.is_empty() {
        assert!(stdout.contains("plots        skipped: no TrueType font"), "{stdout}");
        eprintln!("LOUD SKIP: no TrueType font on this machine; the report said the plots were skipped");
    } else {
        assert_eq!(plots.len(), 4, "{plots:?}");
        for p in &plots {
            assert!(p.starts_with(dir.0.to_str().unwrap()), "{p} is not in the log directory");
            assert!(std::fs::metadata(p).is_ok_and(|m| m.len() > 0), "{p} missing or empty");
            assert!(stdout.contains(p), "report does not name {p}:\n{stdout}");
        }
    }
    eprintln!("{stdout}");
    let mut r = r;
    r["stdout"] = stdout.into();
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
