//! Pairing over real processes: simulated engines publish KV events for what they really
//! cached, the coordinator ingests them and routes to the engine holding the prefix — from
//! token ids and from prompt text through the same tokenizer.json the engines use. A
//! coordinator killed and restarted rebuilds its index from re-registration and replay.

mod common;

use std::time::{Duration, Instant};

use common::{eventually, tokens, Coord, Sim, MODEL};
use serde_json::json;

/// A word-level tokenizer.json ("w0".."w499", whitespace pre-tokenizer) shared by the
/// simulated engines and the coordinator, in a directory of the test's own.
fn write_tokenizer(test: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pd-coord-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for i in 0..500 {
        vocab.insert(format!("w{i}"), (i + 1).into());
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    path
}

fn words(from: usize, n: usize) -> String {
    (from..from + n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pairing_follows_real_kv_events() {
    let tokenizer = write_tokenizer("pairing");
    let tok = tokenizer.to_str().unwrap();
    let p0 = Sim::start("p0", &["--tokenizer", tok]).await;
    // p1 publishes like older vLLM: events as tagged arrays, hashes as raw digests.
    let p1 = Sim::start("p1", &["--tokenizer", tok, "--kv-events-layout", "array", "--kv-events-bytes-hashes"]).await;
    let d0 = Sim::start("d0", &["--tokenizer", tok]).await;
    let d1 = Sim::start("d1", &["--tokenizer", tok]).await;
    let coord = Coord::start(&["--tokenizer", tok]).await;
    coord.register(&p0.spec("prefill", None)).await;
    coord.register(&p1.spec("prefill", None)).await;
    coord.register(&d0.spec("decode", None)).await;
    coord.register(&d1.spec("decode", None)).await;

    // p1 really computes a 10-block prefix; its events reach the index.
    let prefix = tokens(1000, 160);
    p1.complete(&prefix).await;
    eventually(Duration::from_secs(5), "p1's blocks indexed", || async { coord.indexed("p1").await == 10 }).await;

    // A longer prompt sharing that prefix goes to p1 for prefill (disaggregated: nothing of it
    // is on a decode), with the overlap counted.
    let mut prompt = prefix.clone();
    prompt.extend(tokens(5000, 320));
    let (status, d) = coord.pair(&json!({"request_id": "r1", "model": MODEL, "token_ids": prompt})).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["reason"], "disaggregated");
    assert_eq!(d["prefill"]["id"], "p1");
    assert_eq!(d["prefill_overlap_blocks"], 10);
    assert_eq!(d["prefill"]["engine_url"], p1.url.as_str());
    coord.post("/v1/report", &json!({"request_id": "r1", "event": "finished"})).await;

    // Another prefix cached on p0 through prompt text: the coordinator tokenizes the same way.
    let text = words(100, 64);
    p0.complete_text(&text).await;
    eventually(Duration::from_secs(5), "p0's blocks indexed", || async { coord.indexed("p0").await == 4 }).await;
    let long = format!("{text} {}", words(200, 200));
    let (status, d) = coord.pair(&json!({"request_id": "r2", "model": MODEL, "prompt": long})).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["prefill"]["id"].as_str(), d["prefill_overlap_blocks"].as_u64()), (Some("p0"), Some(4)));
    coord.post("/v1/report", &json!({"request_id": "r2", "event": "finished"})).await;

    // A decode holding most of the prompt prefills it itself.
    let decoded = tokens(20_000, 320);
    d1.complete(&decoded).await;
    eventually(Duration::from_secs(5), "d1's blocks indexed", || async { coord.indexed("d1").await == 20 }).await;
    let mut mostly_cached = decoded.clone();
    mostly_cached.extend(tokens(30_000, 32));
    let (_, d) = coord.pair(&json!({"request_id": "r3", "model": MODEL, "token_ids": mostly_cached})).await;
    assert_eq!((d["decode"]["id"].as_str(), d["reason"].as_str()), (Some("d1"), Some("local_prefill")), "{d}");
    assert_eq!(d["prefill"], serde_json::Value::Null);
    assert_eq!(d["decode_overlap_blocks"], 20);
    coord.post("/v1/report", &json!({"request_id": "r3", "event": "finished"})).await;

    // The caller's own engine stays the decode when it is not much worse...
    for (i, local) in ["d0", "d1", "d0"].iter().enumerate() {
        let fresh = tokens(40_000 + 100 * i as u32, 64);
        let req = json!({"request_id": format!("l{i}"), "model": MODEL, "token_ids": fresh, "local_engine": local});
        let (_, d) = coord.pair(&req).await;
        assert_eq!(d["decode"]["id"].as_str(), Some(*local), "{d}");
        coord.post("/v1/report", &json!({"request_id": format!("l{i}"), "event": "finished"})).await;
    }
    // ...but not when another decode already holds most of the prompt.
    let req = json!({"request_id": "l3", "model": MODEL, "token_ids": decoded, "local_engine": "d0"});
    let (_, d) = coord.pair(&req).await;
    assert_eq!(d["decode"]["id"].as_str(), Some("d1"), "{d}");
    let (_, stats) = coord.get("/v1/index/stats").await;
    assert!(stats["models"][MODEL]["blocks"].as_u64().unwrap() >= 34, "{stats}");
    assert!(coord.metric("pd_coordinator_kv_block_events_total").await >= 34.0);
    assert!(coord.metric("pd_coordinator_pair_decisions_total{reason=\"disaggregated\"}").await >= 2.0);
    assert_eq!(coord.metric("pd_coordinator_pair_moved_total").await, 1.0, "l3 only");
    std::fs::remove_dir_all(tokenizer.parent().unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_rebuilds_from_reregistration_and_replay() {
    let p0 = Sim::start("p0", &[]).await;
    let p1 = Sim::start("p1", &[]).await;
    let d0 = Sim::start("d0", &[]).await;
    let mut coord = Coord::start(&[]).await;
    let sims = [(&p0, "prefill"), (&p1, "prefill"), (&d0, "decode")];
    for (sim, role) in sims {
        coord.register(&sim.spec(role, None)).await;
    }
    let prefix = tokens(1, 256);
    p1.complete(&prefix).await;
    eventually(Duration::from_secs(5), "indexed", || async { coord.indexed("p1").await == 16 }).await;

    // The coordinator dies; while it is away the engines keep caching.
    coord.proc.kill9();
    p0.complete(&tokens(900, 64)).await;
    coord.restart().await;
    let restarted = Instant::now();

    // The sidecars' next heartbeats get 404 and they register again (as a sidecar does).
    for (sim, role) in sims {
        let (status, _) = coord.heartbeat(&sim.id).await;
        assert_eq!(status, 404);
        coord.register(&sim.spec(role, None)).await;
    }
    eventually(Duration::from_secs(5), "index rebuilt through replay", || async {
        coord.indexed("p1").await == 16 && coord.indexed("p0").await == 4
    })
    .await;
    let mut prompt = prefix.clone();
    prompt.extend(tokens(7000, 256));
    let (status, d) = coord.pair(&json!({"request_id": "after", "model": MODEL, "token_ids": prompt})).await;
    assert_eq!(status, 200);
    assert_eq!((d["prefill"]["id"].as_str(), d["prefill_overlap_blocks"].as_u64()), (Some("p1"), Some(16)));
    println!("restarted coordinator rebuilt its index and paired by prefix {:?} after restart", restarted.elapsed());
    assert!(restarted.elapsed() < Duration::from_secs(5));
    assert!(coord.metric("pd_coordinator_kv_event_replayed_batches_total").await >= 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approximate_mode_remembers_routed_prompts() {
    // No tokenizer, engines without events (nothing listens at their URLs; health off):
    // prompt text is hashed in chunks and routed prefixes are remembered for a while.
    let coord = Coord::start(&["--health-interval-ms", "0", "--speculative-ttl-ms", "100"]).await;
    for (id, role) in [("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")] {
        let port = common::free_port();
        let spec = json!({"id": id, "role": role, "node": "n", "model": MODEL,
                          "engine_url": format!("http://127.0.0.1:{port}"), "block_size": 16});
        coord.register(&spec).await;
    }
    // d0's sidecar reports a busy engine (request counts only, as it scrapes vLLM's metrics).
    let busy = json!({"load": {"running": 40, "waiting": 12, "kv_usage": 0.9}});
    let (status, _) = coord.post("/v1/engines/d0/heartbeat", &busy).await;
    assert_eq!(status, 200);
    let system = "You are a helpful assistant. ".repeat(40);
    let first = format!("{system} Question one about something else entirely. {}", "x ".repeat(400));
    let (_, d1) = coord.pair(&json!({"request_id": "a1", "model": MODEL, "prompt": first})).await;
    assert_eq!(d1["reason"], "disaggregated", "{d1}");
    assert_eq!(d1["decode"]["id"], "d1", "the busy decode is avoided: {d1}");
    for event in ["prefill_done", "decode_started", "finished"] {
        coord.post("/v1/report", &json!({"request_id": "a1", "event": event})).await;
    }
    // Past the speculative TTL, a prompt sharing the long system text still finds the engines
    // it was routed to.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // (a long distinct tail, so that the decode's cached share stays small: disaggregated)
    let second = format!("{system} A different question. {}", "y ".repeat(2000));
    let (_, d2) = coord.pair(&json!({"request_id": "a2", "model": MODEL, "prompt": second})).await;
    assert_eq!(d2["prefill"]["id"], d1["prefill"]["id"], "{d2}");
    assert_eq!(d2["decode"]["id"], d1["decode"]["id"], "{d2}");
    for overlap in [&d2["prefill_overlap_blocks"], &d2["decode_overlap_blocks"]] {
        let blocks = overlap.as_u64().unwrap();
        assert!(blocks >= 15, "the shared system text ({} bytes) is ≥ 15 chunks of 64: {d2}", system.len());
    }
}

/// An engine's KV-event publisher in vLLM's wire format (PUB socket, tagged-map batches), for
/// events pd-sim does not produce (adapters, data-parallel ranks).
struct EventPublisher {
    socket: zmq::Socket,
    endpoint: String,
    seq: u64,
    /// The `dp_rank` its batches carry.
    dp_rank: i64,
}

impl EventPublisher {
    fn bind(ctx: &zmq::Context) -> EventPublisher {
        let socket = ctx.socket(zmq::PUB).unwrap();
        let endpoint = common::bind_any_port(&socket);
        EventPublisher { socket, endpoint, seq: 0, dp_rank: 0 }
    }

    /// The publishers of a vLLM engine's data-parallel ranks 0 and 1: each its own PUB socket,
    /// rank r on the configured port + r.
    fn bind_ranks(ctx: &zmq::Context) -> [EventPublisher; 2] {
        for _ in 0..20 {
            let base = common::free_port();
            let Some(next) = base.checked_add(1) else { continue };
            let bound = [(0, base), (1, next)].map(|(rank, port)| {
                let socket = ctx.socket(zmq::PUB).unwrap();
                let endpoint = format!("tcp://127.0.0.1:{port}");
                socket.bind(&endpoint).ok().map(|()| EventPublisher { socket, endpoint, seq: 0, dp_rank: rank })
            });
            if let [Some(rank0), Some(rank1)] = bound {
                return [rank0, rank1];
            }
        }
        panic!("no two adjacent free loopback ports for data-parallel ranks");
    }

    fn spec(&self, id: &str) -> serde_json::Value {
        json!({
            "id": id, "role": "decode", "node": "node-1", "model": MODEL, "engine_url": "http://127.0.0.1:9",
            "kv_events": self.endpoint, "kv_events_topic": "kv-events", "block_size": 16,
        })
    }

    /// Stores `tokens`' full blocks in `medium`, hashed as vLLM does under `lora_name`.
    fn store(&mut self, tokens: &[u32], lora_name: Option<&str>, medium: &str) {
        use pd_protocols::hash::{block_hashes_with, event_id, none_hash, ExtraKey};
        use pd_protocols::kv_events::{encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};
        let extra = |_| lora_name.map(|name| vec![ExtraKey::Text(name.to_owned())]);
        let hashes = block_hashes_with(&none_hash(None), tokens, 16, extra);
        let batch = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: hashes.iter().map(|h| BlockHash::Int(event_id(h))).collect(),
                parent_block_hash: None,
                token_ids: tokens.to_vec(),
                block_size: 16,
                lora_id: None,
                medium: Some(medium.into()),
                lora_name: lora_name.map(str::to_owned),
                cache_salt: None,
            }],
            dp_rank: Some(self.dp_rank),
        };
        let payload = encode_batch(&batch, EventFormat::TaggedMap);
        let seq = pd_protocols::zmq_frames::seq_frame(self.seq).to_vec();
        self.seq += 1;
        self.socket.send_multipart([b"kv-events".to_vec(), seq, payload], 0).unwrap();
    }
}

/// Blocks indexed for `engine` in the index of `key` (a model, or a model's adapter).
async fn indexed_under(coord: &Coord, key: &str, engine: &str) -> u64 {
    let (_, stats) = coord.get("/v1/index/stats").await;
    stats["models"][key]["engines"][engine].as_u64().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_adapters_never_match_each_others_blocks() {
    let ctx = zmq::Context::new();
    let (mut d0, mut d1) = (EventPublisher::bind(&ctx), EventPublisher::bind(&ctx));
    let coord = Coord::start(&[]).await;
    coord.register(&d0.spec("d0")).await;
    coord.register(&d1.spec("d1")).await;
    // The same 10-block prompt: under adapter "sql" on d0, under the base model on d1.
    let prompt = tokens(7000, 160);
    let adapter_key = format!("{MODEL}#lora=sql");
    // The subscribers join a moment after registration: republish until indexed (a store of
    // held blocks changes nothing).
    eventually(Duration::from_secs(10), "both engines' blocks indexed", || {
        d0.store(&prompt, Some("sql"), "GPU");
        d1.store(&prompt, None, "GPU");
        let (coord, adapter_key) = (&coord, &adapter_key);
        async move { indexed_under(coord, adapter_key, "d0").await == 10 && coord.indexed("d1").await == 10 }
    })
    .await;
    assert_eq!(indexed_under(&coord, &adapter_key, "d1").await, 0);
    assert_eq!(coord.indexed("d0").await, 0, "the adapter's blocks stay out of the base model's index");

    let pair = |id: &str, lora: Option<&str>| {
        let mut body = json!({"request_id": id, "model": MODEL, "token_ids": prompt});
        if let Some(name) = lora {
            body["lora_name"] = name.into();
        }
        body
    };
    let (status, d) = coord.pair(&pair("sql", Some("sql"))).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["decode"]["id"].as_str(), d["decode_overlap_blocks"].as_u64()), (Some("d0"), Some(10)), "{d}");
    let (status, d) = coord.pair(&pair("base", None)).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["decode"]["id"].as_str(), d["decode_overlap_blocks"].as_u64()), (Some("d1"), Some(10)), "{d}");
    // Adapter B: neither A's blocks nor the base model's attract it.
    let (status, d) = coord.pair(&pair("other", Some("other"))).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["decode_overlap_blocks"], 0, "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_copy_beats_a_cpu_copy() {
    let ctx = zmq::Context::new();
    let (mut d0, mut d1) = (EventPublisher::bind(&ctx), EventPublisher::bind(&ctx));
    let coord = Coord::start(&[]).await;
    coord.register(&d0.spec("d0")).await;
    coord.register(&d1.spec("d1")).await;
    // Both hold the prompt's first 10 blocks: d0 offloaded to host memory, d1 on GPU. d0
    // would win a tie (lower number); the tier weighting must decide it.
    let cached = tokens(9000, 160);
    eventually(Duration::from_secs(10), "both engines' blocks indexed", || {
        d0.store(&cached, None, "CPU");
        d1.store(&cached, None, "GPU");
        let coord = &coord;
        async move { coord.indexed("d0").await == 10 && coord.indexed("d1").await == 10 }
    })
    .await;
    let mut prompt = cached.clone();
    prompt.extend(tokens(20_000, 160));
    let (status, d) = coord.pair(&json!({"request_id": "tiers", "model": MODEL, "token_ids": prompt})).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["decode"]["id"].as_str(), d["decode_overlap_blocks"].as_u64()), (Some("d1"), Some(10)), "{d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_paired_by_rank() {
    let ctx = zmq::Context::new();
    let [mut rank0, mut rank1] = EventPublisher::bind_ranks(&ctx);
    let mut plain = EventPublisher::bind(&ctx);
    let coord = Coord::start(&[]).await;
    // One registration for the engine (rank 0's endpoint, as vLLM is configured): the
    // coordinator subscribes to rank 1 on the next port by itself.
    let mut dp = rank0.spec("dp");
    dp["data_parallel_size"] = 2.into();
    coord.register(&dp).await;
    coord.register(&plain.spec("plain")).await;
    let (on_rank0, on_rank1, on_plain) = (tokens(11_000, 160), tokens(12_000, 160), tokens(13_000, 160));
    eventually(Duration::from_secs(10), "every rank's blocks indexed", || {
        rank0.store(&on_rank0, None, "GPU");
        rank1.store(&on_rank1, None, "GPU");
        plain.store(&on_plain, None, "GPU");
        let coord = &coord;
        async move { coord.indexed("dp").await == 20 && coord.indexed("plain").await == 10 }
    })
    .await;

    // A prompt whose 10-block prefix only rank 1 holds names rank 1; rank 0's names rank 0.
    let pair = |id: &str, cached: &[u32]| {
        let mut prompt = cached.to_vec();
        prompt.extend(tokens(20_000, 320));
        json!({"request_id": id, "model": MODEL, "token_ids": prompt})
    };
    for (id, cached, rank) in [("on-rank-1", &on_rank1, 1), ("on-rank-0", &on_rank0, 0)] {
        let (status, d) = coord.pair(&pair(id, cached)).await;
        assert_eq!(status, 200, "{d}");
        assert_eq!(d["decode"]["id"], "dp", "{d}");
        assert_eq!((d["decode_dp_rank"].as_u64(), d["decode_overlap_blocks"].as_u64()), (Some(rank), Some(10)), "{d}");
        coord.post("/v1/report", &json!({"request_id": id, "event": "finished"})).await;
    }
    // An engine without data parallel gets no rank (its batches' dp_rank 0 notwithstanding).
    let (status, d) = coord.pair(&pair("plain", &on_plain)).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["decode"]["id"].as_str(), d["decode_overlap_blocks"].as_u64()), (Some("plain"), Some(10)), "{d}");
    let fields = d.as_object().unwrap();
    assert!(!fields.contains_key("decode_dp_rank") && !fields.contains_key("prefill_dp_rank"), "{d}");

    // A batch naming a rank the engine did not declare is refused and counted, not indexed.
    let malformed = coord.metric("pd_coordinator_kv_events_malformed_total").await;
    rank1.dp_rank = 2;
    let undeclared = tokens(30_000, 160);
    rank1.store(&undeclared, None, "GPU");
    eventually(Duration::from_secs(5), "the undeclared rank's batch counted", || async {
        coord.metric("pd_coordinator_kv_events_malformed_total").await > malformed
    })
    .await;
    let (_, d) = coord.pair(&pair("undeclared", &undeclared)).await;
    assert_eq!(d["decode_overlap_blocks"], 0, "{d}");
}

/// A prompt that takes long to tokenize (megabytes of text) never holds the coordinator's
/// runtime: while as many of them as it has workers are being tokenized, /health and an
/// engine's heartbeat (whose absence would declare the engine dead) are answered first.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_prompts_are_tokenized_off_the_runtime() {
    let tokenizer = write_tokenizer("long-prompt");
    let tok = tokenizer.to_str().unwrap();
    let d0 = Sim::start("d0", &["--tokenizer", tok]).await;
    let coord = std::sync::Arc::new(Coord::start(&["--tokenizer", tok]).await);
    coord.register(&d0.spec("decode", None)).await;
    // About 4 MiB of words: each tokenization takes far longer than a health check.
    let text = std::sync::Arc::new((0..800_000).map(|i| format!("w{}", i % 500)).collect::<Vec<_>>().join(" "));

    let started = Instant::now();
    // The harness runs the coordinator with two workers.
    let pairs: Vec<_> = (0..2)
        .map(|i| {
            let (coord, text) = (std::sync::Arc::clone(&coord), std::sync::Arc::clone(&text));
            tokio::spawn(async move {
                let body = json!({"request_id": format!("long-{i}"), "model": MODEL, "prompt": *text});
                let answer = coord.pair(&body).await;
                (answer, started.elapsed())
            })
        })
        .collect();
    // The bodies are uploaded and being tokenized by now.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let (status, body) = coord.get("/health").await;
    assert_eq!((status, body.as_str()), (200, Some("ok")));
    let (status, body) = coord.heartbeat("d0").await;
    assert_eq!(status, 200, "{body}");
    let answered = started.elapsed();
    for pair in pairs {
        let ((status, decision), done) = pair.await.unwrap();
        assert_eq!(status, 200, "{decision}");
        assert_eq!(decision["decode"]["id"], "d0");
        assert!(
            answered < done,
            "health and heartbeat answered after {answered:?}, behind a pairing done after {done:?}"
        );
    }
    std::fs::remove_dir_all(tokenizer.parent().unwrap()).unwrap();
}

/// A pairing body of the largest size accepted (16 MiB of token ids, far more than a prompt
/// needs, but a peer may send it) is joined and parsed off the coordinator's runtime, as long
/// prompts are hashed: while four of them are in, /health keeps answering. On the runtime, each
/// held one of its two workers for about as long as the pairing took.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_largest_pairing_bodies_are_parsed_off_the_runtime() {
    let d0 = Sim::start("d0", &[]).await;
    let coord = std::sync::Arc::new(Coord::start(&[]).await);
    coord.register(&d0.spec("decode", None)).await;
    // Single-digit ids, the most of them a body can hold: the slowest body to parse.
    let prefix = format!(r#"{{"request_id": "big", "model": "{MODEL}", "token_ids": ["#);
    let ids = (16 << 20) - prefix.len() - 8;
    let mut body = prefix.into_bytes();
    for i in 0..ids / 2 {
        body.extend_from_slice(if i == 0 { b"7" } else { b",7" });
    }
    body.extend_from_slice(b"]}");
    let body = std::sync::Arc::new(body);

    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let prober = {
        let (coord, done) = (std::sync::Arc::clone(&coord), std::sync::Arc::clone(&done));
        tokio::spawn(async move {
            let mut waits = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let asked = Instant::now();
                let (status, _) = coord.get("/health").await;
                assert_eq!(status, 200);
                waits.push(asked.elapsed());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            waits
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let pairs: Vec<_> = (0..4)
        .map(|_| {
            let (coord, body) = (std::sync::Arc::clone(&coord), std::sync::Arc::clone(&body));
            tokio::spawn(async move {
                let sent = Instant::now();
                let answer = coord.post_raw("/v1/pair", body.to_vec()).await;
                (answer, sent.elapsed())
            })
        })
        .collect();
    let mut fastest = Duration::MAX;
    for pair in pairs {
        let ((status, decision), took) = pair.await.unwrap();
        assert_eq!(status, 200, "{decision}");
        assert_eq!(decision["decode"]["id"], "d0");
        fastest = fastest.min(took);
    }
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let waits = prober.await.unwrap();
    let longest = waits.iter().max().copied().unwrap();
    eprintln!("fastest pairing {fastest:?}; longest /health wait {longest:?} over {} checks", waits.len());
    assert!(waits.len() >= 10, "only {} health checks", waits.len());
    assert!(longest * 3 < fastest, "/health waited {longest:?} while pairings took {fastest:?} and more");
}
