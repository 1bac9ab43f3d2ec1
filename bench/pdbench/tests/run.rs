//! `pdbench run` and `pdbench compare-routing` against real pd-sim processes.

mod common;

use std::time::Duration;

use common::*;

const LIMIT: Duration = Duration::from_secs(120);

#[test]
fn streaming_chat_multi_turn_round_robin_with_json_and_plots() {
    let (a, b) = (Sim::start(&["--decode-us-per-token", "500"]), Sim::start(&["--decode-us-per-token", "500"]));
    let dir = TempDir::new("run-chat");
    let json = dir.path("run.json");
    let plot = dir.path("run");
    let (status, stdout, stderr) = run_pdbench(
        &[
            "run",
            "--url",
            &a.url,
            "--url",
            &b.url,
            "--api",
            "chat",
            "--requests",
            "40",
            "--turns",
            "2",
            "--prompt-len",
            "normal:40:10",
            "--output-len",
            "8",
            "--prefixes",
            "2",
            "--prefix-len",
            "64",
            "--concurrency",
            "4",
            "--slo-ttft-ms",
            "10000",
            "--slo-itl-ms",
            "10000",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
            "--plot",
            plot.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let s = &read_json(&json)["summary"];
    assert_eq!((s["ok"].as_u64(), s["failed"].as_u64()), (Some(40), Some(0)), "{s}");
    assert_eq!(s["output_tokens"], 320, "8 tokens each, counted from the usage chunk");
    assert_eq!(s["good"], 40);
    // 7 gaps per 8-token stream, 0.5 ms per simulated decode step on average (chunks that
    // arrive in one read show as near-zero gaps, the timer's rounding as longer ones).
    assert_eq!(s["itl_ms"]["count"], 40 * 7);
    assert!(s["itl_ms"]["mean"].as_f64().unwrap() >= 0.4, "{}", s["itl_ms"]);
    assert!(s["ttft_ms"]["p99"].as_f64().unwrap() <= s["e2e_ms"]["max"].as_f64().unwrap());
    assert_eq!(s["local"], 40, "no P/D: every request served by one engine");
    // Round robin: both engines served half; second turns resend the first answer (longer prompts).
    for sim in [&a, &b] {
        let m = sim.metrics();
        let ok = pdbench::metrics::sum(&m, "vllm:request_success_total");
        assert_eq!(ok, 20.0, "{}", sim.url);
    }
    assert!(stdout.contains("40 ok, 0 failed") && stdout.contains("goodput"), "{stdout}");
    for suffix in ["-cdf.svg", "-cdf.png", "-ttft-hist.svg", "-ttft-hist.png"] {
        let f = dir.path(&format!("run{suffix}"));
        if stderr.contains("no TrueType font") {
            eprintln!("LOUD SKIP: no font on this machine, plots not checked");
            break;
        }
        assert!(std::fs::metadata(&f).map(|m| m.len() > 1000).unwrap_or(false), "{} missing or tiny", f.display());
    }
}

#[test]
fn non_streaming_direct_pd_moves_kv() {
    let (p, d) = (Sim::start(&[]), Sim::start(&[]));
    let dir = TempDir::new("run-pd");
    let json = dir.path("pd.json");
    let (status, stdout, stderr) = run_pdbench(
        &[
            "run",
            "--prefill-url",
            &p.url,
            "--decode-url",
            &d.url,
            "--no-stream",
            "--requests",
            "20",
            "--prompt-len",
            "uniform:20:60",
            "--output-len",
            "uniform:2:6",
            "--prefixes",
            "0",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        LIMIT,
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let s = &read_json(&json)["summary"];
    assert_eq!(s["ok"], 20, "{s}");
    assert_eq!(s["disaggregated"], 20);
    assert_eq!(s["itl_ms"]["count"], 0, "non-streaming: no inter-token gaps");
    let out = s["output_tokens"].as_u64().unwrap();
    assert!((40..=120).contains(&out), "{out}");
    let m = d.metrics();
    assert!(pdbench::metrics::sum(&m, "vllm:nixl_bytes_transferred_total") > 0.0, "decode pulled nothing");
    assert_eq!(pdbench::metrics::sum(&m, "vllm:nixl_xfer_time_seconds_count"), 20.0);
}

#[test]
fn errors_are_counted_by_kind() {
    // Every request refused with HTTP 500 by failure injection.
    let bad = Sim::start(&["--error-rate", "1"]);
    let (status, stdout, stderr) =
        run_pdbench(&["run", "--url", &bad.url, "--requests", "6", "--output-len", "2", "--no-progress"], LIMIT);
    assert!(status.success(), "{stderr}");
    assert!(stdout.contains("0 ok, 6 failed") && stdout.contains("http_500=6"), "{stdout}");
    // Nobody listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("http://127.0.0.1:{port}");
    let (_, stdout, _) = run_pdbench(&["run", "--url", &url, "--requests", "3", "--no-progress"], LIMIT);
    assert!(stdout.contains("connect=3"), "{stdout}");
    // A hung engine: the request timeout turns it into an error.
    let slow = Sim::start(&["--delay-ms", "5000"]);
    let (_, stdout, _) =
        run_pdbench(&["run", "--url", &slow.url, "--requests", "2", "--timeout-secs", "0.5", "--no-progress"], LIMIT);
    assert!(stdout.contains("timeout=2"), "{stdout}");
}

#[test]
fn compare_routing_runs_every_setup_on_the_same_workload() {
    let dir = TempDir::new("compare");
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--requests",
            "60",
            "--prefixes",
            "6",
            "--prefix-len",
            "512",
            "--prompt-len",
            "16",
            "--output-len",
            "4",
            "--prefill-us-per-token",
            "50",
            "--decode-us-per-token",
            "200",
            "--concurrency",
            "4",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let r = read_json(&json);
    let setups = r["setups"].as_array().unwrap();
    let names: Vec<&str> = setups.iter().map(|s| s["setup"].as_str().unwrap()).collect();
    assert_eq!(names, ["RoundRobin", "PdRoundRobin", "PdPrefixAffinity", "Coordinator"]);
    let daemons_built = ["pd-coordinator", "pd-sidecar"].iter().all(|b| pdbench().parent().unwrap().join(b).is_file());
    for s in setups {
        if s["setup"] == "Coordinator" && !daemons_built {
            eprintln!("LOUD SKIP: pd-coordinator / pd-sidecar not built: the coordinator setup was skipped");
            assert!(s["skipped"].is_string(), "{s}");
            continue;
        }
        assert_eq!(s["summary"]["ok"], 60, "{s}");
        assert!(s["summary"]["ttft_ms"]["mean"].as_f64().unwrap() > 0.0);
    }
    // Only the P/D setups move KV. Which setup caches better is a benchmark figure (it depends
    // on request interleaving), so the test only checks the rates are measured.
    assert_eq!(setups[0]["kv"]["bytes"], 0.0);
    assert!(setups[1]["kv"]["bytes"].as_f64().unwrap() > 0.0);
    for i in 0..3 {
        let hit = setups[i]["kv"]["prefix_hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0 && hit <= 1.0, "{} hit rate {hit}", names[i]);
    }
    for n in ["RoundRobin", "PdRoundRobin", "PdPrefixAffinity", "mean TTFT"] {
        assert!(stdout.contains(n), "{stdout}");
    }
    eprintln!("{stdout}");
}

/// vllm-router (PyPI) in P/D mode in front of the simulators, when `$PDBENCH_VLLM_ROUTER` names
/// its executable (`pip install vllm-router`).
#[test]
fn compare_routing_with_vllm_router() {
    let Ok(router) = std::env::var("PDBENCH_VLLM_ROUTER") else {
        eprintln!("LOUD SKIP: PDBENCH_VLLM_ROUTER is not set (path to a vllm-router executable); test skipped");
        return;
    };
    let dir = TempDir::new("vllm-router");
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--setups",
            "pd-round-robin,vllm-router",
            "--vllm-router",
            &router,
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--requests",
            "40",
            "--output-len",
            "4",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    let r = read_json(&json);
    let router_row = &r["setups"][1];
    assert_eq!(router_row["setup"], "VllmRouter");
    assert_eq!(router_row["summary"]["ok"], 40, "{router_row}");
    assert!(router_row["kv"]["bytes"].as_f64().unwrap() > 0.0, "vllm-router did no P/D handoff: {router_row}");
}
