//! `pdbench compare-routing --trace`: Mooncake-format traces replayed through real pd-sim
//! processes (and the coordinator's daemons when they are built).

mod common;

use std::time::Duration;

use common::*;

const SAMPLE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_conversation_head.jsonl");

fn daemons_built() -> bool {
    ["pd-coordinator", "pd-sidecar"].iter().all(|b| pdbench().parent().unwrap().join(b).is_file())
}

/// Three conversations of seven turns, interleaved, one request every `gap_ms`: turn t resends
/// the conversation's earlier blocks and adds two, and every prompt starts with block 0.
fn conversation_trace(gap_ms: u64) -> String {
    let mut out = String::new();
    for i in 0..21u64 {
        let (conv, turn) = (i % 3, i / 3);
        let mut ids = vec![0];
        ids.extend((0..2 * (turn + 1)).map(|k| 1000 * (conv + 1) + k));
        out.push_str(&format!(
            "{{\"timestamp\": {}, \"input_length\": {}, \"output_length\": 40, \"hash_ids\": {ids:?}}}\n",
            i * gap_ms,
            ids.len() * 512 - 100
        ));
    }
    out
}

#[test]
fn the_public_sample_replays_through_round_robin() {
    let dir = TempDir::new("trace-sample");
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--setups",
            "round-robin",
            "--trace",
            SAMPLE,
            "--trace-requests",
            "20",
            "--trace-block-tokens",
            "16",
            "--trace-time-scale",
            "10",
            "--trace-max-output",
            "4",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    assert!(stdout.contains("20 trace requests over 0.3 s (time scale 10), 16 tokens per 512-token block"), "{stdout}");
    let r = read_json(&json);
    assert_eq!(r["trace"]["block_tokens"], 16);
    let row = &r["setups"][0];
    assert_eq!(row["summary"]["ok"], 20, "{row}");
    assert_eq!(row["summary"]["failed"], 0, "{row}");
    // The engines looked up every scaled prompt token: ceil(input_length × 16 / 512) summed over
    // the first 20 lines is 9070.
    assert_eq!(row["kv"]["prefix_queries"], 9070.0, "{row}");
    // Those 20 requests share only block 0 (16 tokens): at most the 16 requests after each
    // engine's first find it cached (fewer when they arrive before it is computed).
    let hits = row["kv"]["prefix_hits"].as_f64().unwrap();
    assert!(hits > 0.0 && hits <= 16.0 * 16.0 && hits % 16.0 == 0.0, "{row}");
}

#[test]
fn a_trace_of_continued_conversations_hits_more_through_the_coordinator_than_round_robin() {
    if !daemons_built() {
        eprintln!("LOUD SKIP: pd-coordinator / pd-sidecar not built next to pdbench; test skipped");
        return;
    }
    let dir = TempDir::new("trace-conv");
    let trace = dir.path("trace.jsonl");
    std::fs::write(&trace, conversation_trace(150)).unwrap();
    let json = dir.path("cmp.json");
    let sim = sim_bin();
    // vllm-router (cache_aware, P/D mode) as well when `$PDBENCH_VLLM_ROUTER` names it (the CI
    // installs it); pdbench reads the variable itself.
    let router = std::env::var_os("PDBENCH_VLLM_ROUTER").is_some();
    if !router {
        eprintln!("LOUD SKIP: $PDBENCH_VLLM_ROUTER not set: the trace is not replayed through vllm-router");
    }
    let setups = if router { "round-robin,coordinator,vllm-router" } else { "round-robin,coordinator" };
    let (status, stdout, stderr) = run_pdbench(
        &[
            "compare-routing",
            "--setups",
            setups,
            "--trace",
            trace.to_str().unwrap(),
            "--trace-block-tokens",
            "16",
            "--trace-time-scale",
            "1",
            "--trace-max-output",
            "4",
            "--sim-bin",
            sim.to_str().unwrap(),
            "--log-dir",
            dir.0.to_str().unwrap(),
            "--no-progress",
            "--json",
            json.to_str().unwrap(),
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "{status}\n{stdout}\n{stderr}");
    // The pools were sized from the trace: never less than its longest request (237 prompt and
    // 4 output tokens: 16 blocks of 16, and one) for each of the 8 requests in flight.
    assert!(stderr.contains("--num-blocks=136"), "{stderr}");
    let r = read_json(&json);
    let rows = r["setups"].as_array().unwrap();
    let hit = |i: usize| rows[i]["kv"]["prefix_hit_rate"].as_f64().unwrap();
    assert_eq!(rows.len(), if router { 3 } else { 2 });
    for row in rows {
        assert_eq!(row["summary"]["ok"], 21, "{row}");
    }
    let d = &rows[1]["decisions"];
    let pairings = d["coordinator_disaggregated"].as_f64().unwrap() + d["coordinator_local_prefill"].as_f64().unwrap();
    assert_eq!(pairings, 21.0, "{}", rows[1]);
    // Round robin sends a conversation's next turn to another engine three times in four; the
    // coordinator sends it where the earlier turns' blocks are.
    assert!(hit(1) > hit(0), "coordinator {} vs round robin {}\n{stdout}", hit(1), hit(0));
    eprintln!("{stdout}");
}
