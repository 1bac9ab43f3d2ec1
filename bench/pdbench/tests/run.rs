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
    let port = pdbench::procs::free_port().expect("a free loopback port");
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
    let markdown = dir.path("cmp.md");
    let readme = dir.path("README.md");
    let (begin, end) = ("<!-- compare-routing:begin -->", "<!-- compare-routing:end -->");
    std::fs::write(&readme, format!("# Title\n\nSee `{begin}`.\n\n{begin}\nold table\n{end}\n\nafter\n")).unwrap();
    let sim = sim_bin();
    // The default preset (shared tokenizer, sized pools, coordinator flags) with a small workload.
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--setups",
            "round-robin,pd-round-robin,pd-prefix-affinity,coordinator,ideal",
            "--repeat",
            "2",
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
            "--markdown",
            markdown.to_str().unwrap(),
            "--update-readme",
            readme.to_str().unwrap(),
        ],
        Duration::from_secs(600),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    // The engines ran with the preset's pool size and the shared tokenizer.
    assert!(stderr.contains("--num-blocks=") && stderr.contains("tokenizer.json"), "{stderr}");
    assert!(dir.0.join("tokenizer.json").is_file());
    let r = read_json(&json);
    let setups = r["setups"].as_array().unwrap();
    let names: Vec<&str> = setups.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let one_run = ["round-robin", "pd-round-robin", "pd-prefix-affinity", "coordinator", "ideal"];
    assert_eq!(names, [one_run, one_run].concat());
    assert_eq!(setups[5]["run"], 2);
    // The ideal engine: one more pd-sim, its pool sized for every request, prompts side by side,
    // decodes never slowed, whatever the cluster's engines were given.
    let ideal_flags = stderr.lines().find(|l| l.starts_with("ideal engine up")).expect("the ideal engine's flags");
    for flag in ["--num-blocks=30720\"", "--prefill-queue=none", "--interference-factor=0", "tokenizer.json"] {
        assert!(ideal_flags.contains(flag), "{ideal_flags}");
    }
    assert_eq!(setups[0]["setup"], "RoundRobin");
    let daemons_built = ["pd-coordinator", "pd-sidecar"].iter().all(|b| pdbench().parent().unwrap().join(b).is_file());
    for s in setups {
        if s["name"] == "coordinator" && !daemons_built {
            eprintln!("LOUD SKIP: pd-coordinator / pd-sidecar not built: the coordinator setup was skipped");
            assert!(s["skipped"].is_string(), "{s}");
            continue;
        }
        assert_eq!(s["summary"]["ok"], 60, "{s}");
        assert!(s["summary"]["ttft_ms"]["mean"].as_f64().unwrap() > 0.0);
        let per_engine = s["kv_per_engine"].as_array().unwrap();
        assert_eq!(per_engine.len(), if s["name"] == "ideal" { 1 } else { 4 }, "{s}");
        // The per-engine figures add up to the total.
        let queries: f64 = per_engine.iter().map(|k| k["prefix_queries"].as_f64().unwrap()).sum();
        assert_eq!(queries, s["kv"]["prefix_queries"].as_f64().unwrap(), "{s}");
        if s["name"] == "coordinator" {
            // Every request was paired, either way.
            let d = &s["decisions"];
            let pairings =
                d["coordinator_disaggregated"].as_f64().unwrap() + d["coordinator_local_prefill"].as_f64().unwrap();
            assert_eq!(pairings, 60.0, "{s}");
        }
    }
    // Only the P/D setups move KV. Which setup caches better is a benchmark figure (it depends
    // on request interleaving), so the test only checks the rates are measured.
    assert_eq!(setups[0]["kv"]["bytes"], 0.0);
    assert!(setups[1]["kv"]["bytes"].as_f64().unwrap() > 0.0);
    for (i, name) in names.iter().enumerate().take(3) {
        let hit = setups[i]["kv"]["prefix_hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0 && hit <= 1.0, "{name} hit rate {hit}");
    }
    // One cache holding everything: each of the 6 prefixes is computed about once, not once on
    // each of the 4 engines, as round robin computes them.
    for run in [0, 5] {
        let hit = |i: usize| setups[run + i]["kv"]["prefix_hit_rate"].as_f64().unwrap();
        assert!(hit(4) > hit(0), "ideal {} against round-robin {}", hit(4), hit(0));
        assert_eq!(setups[run + 4]["kv"]["bytes"], 0.0);
    }
    // A ratio per run, measured when the coordinator ran; none against the absent vllm-router.
    let ratios = r["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 2);
    for v in ratios {
        assert!(v["coordinator_over_vllm_router"].is_null(), "{v}");
        assert!(v["ideal_over_vllm_router"].is_null(), "{v}");
        assert_eq!(v["coordinator_over_round_robin"].as_f64().is_some(), daemons_built, "{v}");
        assert_eq!(v["coordinator_over_ideal"].as_f64().is_some(), daemons_built, "{v}");
    }
    for n in ["round-robin", "pd-prefix-affinity", "mean TTFT", "x round-robin", "load average"] {
        assert!(stdout.contains(n), "{stdout}");
    }
    // The Markdown table, and the README with it between the marker lines, the rest untouched.
    let md = std::fs::read_to_string(&markdown).unwrap();
    assert!(md.starts_with("Generated by `pdbench compare-routing --setups"), "{md}");
    assert!(md.contains("| 2 | pd-prefix-affinity | 60 |"), "{md}");
    assert!(md.contains("| run | coordinator / round-robin |"), "{md}");
    assert!(md.contains("| run | ideal / vllm-router (cache_aware) |"), "{md}");
    let new_readme = std::fs::read_to_string(&readme).unwrap();
    assert_eq!(new_readme, format!("# Title\n\nSee `{begin}`.\n\n{begin}\n{}\n{end}\n\nafter\n", md.trim_end()));
    eprintln!("{stdout}");
}

#[test]
fn compare_routing_legacy_preset_keeps_the_old_workload() {
    let dir = TempDir::new("compare-legacy");
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--preset",
            "legacy",
            "--setups",
            "round-robin,pd-prefix-affinity",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--requests",
            "24",
            "--output-len",
            "4",
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    // No pool sizing, no tokenizer; the old defaults: 4 cyclic prompts of 256 words.
    assert!(stderr.contains("extra pd-sim flags: []"), "{stderr}");
    let r = read_json(&json);
    assert_eq!(r["workload"]["prefixes"], 4);
    assert_eq!(r["workload"]["prefix_len"], 256);
    assert_eq!(r["workload"]["popularity"]["kind"], "cyclic");
    for s in r["setups"].as_array().unwrap() {
        assert_eq!(s["summary"]["ok"], 24, "{s}");
    }
}

/// The coordinator setup with the decode engines registered as `both` (requests still enter
/// through the decode sidecars), and the coordinator-colocated setup (every engine `both`,
/// requests through all four sidecars): every request is paired, in each.
#[test]
fn compare_routing_coordinator_with_decodes_as_both_and_colocated() {
    let daemons_built = ["pd-coordinator", "pd-sidecar"].iter().all(|b| pdbench().parent().unwrap().join(b).is_file());
    if !daemons_built {
        eprintln!("LOUD SKIP: pd-coordinator / pd-sidecar not built next to pdbench; test skipped");
        return;
    }
    let dir = TempDir::new("compare-both");
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--coordinator-decode-role",
            "both",
            "--setups",
            "coordinator,coordinator-colocated",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--requests",
            "40",
            "--prefixes",
            "6",
            "--prefix-len",
            "256",
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
    let rows = r["setups"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["coordinator", "coordinator-colocated"]);
    for row in rows {
        assert_eq!(row["summary"]["ok"], 40, "{row}");
        let d = &row["decisions"];
        let pairings =
            d["coordinator_disaggregated"].as_f64().unwrap() + d["coordinator_local_prefill"].as_f64().unwrap();
        assert_eq!(pairings, 40.0, "{row}");
    }
    // Colocated: every engine serves prompts itself, so each one looked prompts up in its cache.
    for (i, k) in rows[1]["kv_per_engine"].as_array().unwrap().iter().enumerate() {
        assert!(k["prefix_queries"].as_f64().unwrap() > 0.0, "engine {i} served nothing: {}", rows[1]);
    }
    // The ratio against the absent vllm-router-colocated is null, not made up.
    assert!(r["ratios"][0]["coordinator_colocated_over_vllm_router_colocated"].is_null(), "{}", r["ratios"]);
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
            "pd-round-robin,vllm-router,vllm-router-round-robin,vllm-router-colocated",
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
    let rows = r["setups"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["pd-round-robin", "vllm-router", "vllm-router-round-robin", "vllm-router-colocated"]);
    for row in &rows[1..] {
        assert_eq!(row["summary"]["ok"], 40, "{row}");
    }
    // cache_aware and round_robin in P/D mode hand KV over; the colocated router does not.
    for row in &rows[1..3] {
        assert!(row["kv"]["bytes"].as_f64().unwrap() > 0.0, "vllm-router did no P/D handoff: {row}");
    }
    assert_eq!(rows[3]["kv"]["bytes"], 0.0, "{}", rows[3]);
    // Its policy really was cache_aware (the log shows the router's policy line).
    let log = std::fs::read_to_string(dir.0.join("vllm-router-0.log")).unwrap_or_default();
    assert!(log.contains("CacheAware"), "{log}");
}
