//! Collector mode (`--kv-events-listen`): the coordinator binds one SUB socket (and one more per
//! data-parallel rank an engine declares), engines connect their publishers to it (as vLLM does
//! when its endpoint names a host) and are told apart by topic. Real processes: the coordinator, simulated engines publishing what they
//! really cached, and a raw ZMQ publisher sending garbage.

mod common;

use std::time::Duration;

use common::{adjacent_free_ports, eventually, free_port, tokens, Coord, Sim, MODEL};
use pd_protocols::zmq_frames::seq_frame;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collector_indexes_engines_by_topic_and_replays_their_gaps() {
    let coord = Coord::start_collecting(&[]).await;
    let listen = coord.collector(0);
    // p0 follows llm-d's convention (kv@<engine>@<model>, here the engine id); p1 publishes
    // under a topic of its own that its registration names. d0 binds its own publisher, as
    // before: both modes at once.
    let p0 = Sim::start_publishing_to("p0", &listen, "kv@p0@sim-model").await;
    let p1 = Sim::start_publishing_to("p1", &listen, "custom/p1").await;
    let d0 = Sim::start("d0", &[]).await;

    // Before registration their topics are nobody's: counted, dropped. Their replay buffers
    // keep the batches.
    p0.complete(&tokens(1000, 160)).await;
    p1.complete(&tokens(3000, 64)).await;
    eventually(Duration::from_secs(5), "two unknown-topic messages counted", || async {
        coord.metric("pd_coordinator_kv_events_unknown_topic_total").await >= 2.0
    })
    .await;
    assert_eq!(coord.indexed("p0").await, 0);

    coord.register(&p0.collected_spec("prefill", None)).await;
    coord.register(&p1.collected_spec("prefill", Some("custom/p1"))).await;
    coord.register(&d0.spec("decode", None)).await;

    // Each engine's next batch shows a gap from 0; its own replay socket fills it, so the
    // blocks published before registration are indexed too (10 + 5 on p0, 4 + 3 on p1).
    p0.complete(&tokens(5000, 80)).await;
    p1.complete(&tokens(7000, 48)).await;
    d0.complete(&tokens(9000, 32)).await;
    eventually(Duration::from_secs(10), "p0 15, p1 7 and d0 2 blocks indexed", || async {
        (coord.indexed("p0").await, coord.indexed("p1").await, coord.indexed("d0").await) == (15, 7, 2)
    })
    .await;
    assert!(coord.metric("pd_coordinator_kv_event_gaps_total").await >= 2.0);
    assert!(coord.metric("pd_coordinator_kv_event_replayed_batches_total").await >= 2.0);

    // Garbage on the open socket: counted and skipped, never fatal.
    let malformed_before = coord.metric("pd_coordinator_kv_events_malformed_total").await;
    let unknown_before = coord.metric("pd_coordinator_kv_events_unknown_topic_total").await;
    let ctx = zmq::Context::new();
    let rogue = ctx.socket(zmq::PUB).unwrap();
    rogue.set_linger(0).unwrap();
    rogue.connect(&listen).unwrap();
    let huge_topic = vec![b'k'; 100_000];
    eventually(Duration::from_secs(5), "garbage counted", || {
        // PUB drops what it sends before the connection is up: send until it is seen.
        rogue.send_multipart([b"only one frame".to_vec()], 0).unwrap();
        rogue.send_multipart([b"kv@p0@sim-model".to_vec(), vec![1, 2, 3], vec![0x90]], 0).unwrap();
        rogue.send_multipart([huge_topic.clone(), seq_frame(0).to_vec(), vec![0xc1]], 0).unwrap();
        async {
            coord.metric("pd_coordinator_kv_events_malformed_total").await >= malformed_before + 2.0
                && coord.metric("pd_coordinator_kv_events_unknown_topic_total").await > unknown_before
        }
    })
    .await;

    // Still following both engines: p1 caches 2 more blocks.
    p1.complete(&tokens(11_000, 32)).await;
    eventually(Duration::from_secs(5), "p1 9 blocks", || async { coord.indexed("p1").await == 9 }).await;
    assert_eq!(coord.indexed("p0").await, 15);
}

/// An engine running data parallel in collector mode: vLLM's rank r connects its publisher to
/// the collector's port + r and serves replay on its replay port + r. The coordinator listens
/// for rank 1 once an engine declares two ranks, follows each rank's sequence on its own
/// (rank 1's batches published before that are recovered through rank 1's replay socket), and
/// pairs a prompt with the rank holding it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collector_follows_each_data_parallel_rank_on_its_own_port() {
    let coord = Coord::start_collecting(&[]).await;
    let rank_listen = |rank: u32| coord.collector(rank);
    let replay = adjacent_free_ports();
    let topic = "kv@dp@sim-model";
    let rank0 = Sim::start_rank_publishing_to("dp", 0, &rank_listen(0), topic, replay).await;
    let rank1 = Sim::start_rank_publishing_to("dp", 1, &rank_listen(1), topic, replay + 1).await;

    // Rank 1 publishes before the engine registers: nobody listens on its port yet, and its
    // replay buffer keeps the batch.
    let (early, on_rank0) = (tokens(1000, 160), tokens(5000, 96));
    rank1.complete(&early).await;
    let mut spec = rank0.collected_spec("decode", None);
    spec["data_parallel_size"] = 2.into();
    coord.register(&spec).await;
    rank0.complete(&on_rank0).await;

    // Rank 1's publisher reaches the socket bound for it after a reconnect; what it publishes
    // before that is lost on the way (a block at a time here, until one arrives). The first
    // batch that arrives shows a gap, filled from rank 1's own replay socket: the early 10
    // blocks and every lost one come back.
    let mut sent = 0;
    eventually(Duration::from_secs(10), "a batch of rank 1 on its socket", || {
        sent += 1;
        let (rank1, coord, fresh) = (&rank1, &coord, tokens(3000 + 100 * sent, 16));
        async move {
            rank1.complete(&fresh).await;
            coord.indexed("dp").await > 6
        }
    })
    .await;
    let all = 10 + sent as u64 + 6;
    eventually(Duration::from_secs(10), &format!("both ranks' {all} blocks indexed"), || async {
        coord.indexed("dp").await == all
    })
    .await;
    assert!(coord.metric("pd_coordinator_kv_event_replayed_batches_total").await >= 1.0);
    assert_eq!(coord.metric("pd_coordinator_kv_events_malformed_total").await, 0.0);

    for (id, cached, rank, blocks) in [("on-rank-1", &early, 1, 10), ("on-rank-0", &on_rank0, 0, 6)] {
        let mut prompt = cached.clone();
        prompt.extend(tokens(20_000, 64));
        let (status, d) = coord.pair(&serde_json::json!({"request_id": id, "model": MODEL, "token_ids": prompt})).await;
        assert_eq!(status, 200, "{d}");
        assert_eq!(d["decode"]["id"], "dp", "{d}");
        assert_eq!(
            (d["decode_dp_rank"].as_u64(), d["decode_overlap_blocks"].as_u64()),
            (Some(rank), Some(blocks)),
            "{d}"
        );
    }
}

/// vLLM's own publisher class, in both topologies: bound (the coordinator connects to it, the
/// engine registered with `kv_events`) and connecting (collector mode, found by llm-d's topic
/// convention), there also as data-parallel rank 1 of an engine (vLLM offsets its endpoints by
/// the rank: its blocks arrive only on the socket the coordinator binds for rank 1). Needs the real-vLLM venv (`PD_VLLM_VENV`, installed by `ci/vllm/install.sh`;
/// ci/test.sh sets it for this test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_publisher_in_both_topologies() {
    let Some(venv) = std::env::var_os("PD_VLLM_VENV").filter(|v| !v.is_empty()) else {
        eprintln!(
            "\n!!!!!!!! SKIPPED: kv_collector::vllm_publisher_in_both_topologies did not run: PD_VLLM_VENV is not set \
             (PD_VLLM_VENV=$(ci/vllm/install.sh | tail -n1) cargo test --test kv_collector runs it) !!!!!!!!\n"
        );
        return;
    };
    let python = std::path::Path::new(&venv).join("bin/python");
    assert!(python.exists(), "PD_VLLM_VENV has no bin/python: {}", python.display());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/vllm_publisher.py");
    let coord = Coord::start_collecting(&[]).await;
    let listen = coord.collector(0);
    // Engine URLs are only health-checked: a pd-sim without events answers for each.
    let bound_engine = Sim::start("vb", &[]).await;
    let connecting_engine = Sim::start("vc", &[]).await;
    let ranked_engine = Sim::start("vr", &[]).await;

    let (bound_events, bound_replay, connecting_replay) = (free_port(), free_port(), free_port());
    let ranked_replay = adjacent_free_ports();
    let publisher = |name: &str, endpoint: String, replay: String, topic: &str, first_hash: u64, blocks: u64| {
        let mut cmd = std::process::Command::new(&python);
        cmd.arg(&script).args([endpoint, replay, topic.to_string(), first_hash.to_string(), blocks.to_string()]);
        // The rank, when the name gives one.
        cmd.args(name.strip_prefix("vllm-publisher-rank-"));
        cmd.env("VLLM_LOGGING_LEVEL", "WARNING");
        common::spawn(cmd, name)
    };
    // Bound: vLLM binds tcp://*:PORT, the coordinator subscribes to it.
    let _bound = publisher(
        "vllm-publisher-bound",
        format!("tcp://*:{bound_events}"),
        format!("tcp://*:{bound_replay}"),
        "kv-events",
        1 << 40,
        6,
    );
    let mut spec = bound_engine.spec("prefill", None);
    spec["kv_events"] = format!("tcp://*:{bound_events}").into();
    spec["replay"] = format!("tcp://*:{bound_replay}").into();
    coord.register(&spec).await;
    // Connecting: vLLM connects to the coordinator's --kv-events-listen socket.
    let _connecting = publisher(
        "vllm-publisher-connecting",
        listen.clone(),
        format!("tcp://*:{connecting_replay}"),
        "kv@vc@sim-model",
        2 << 40,
        9,
    );
    let mut spec = connecting_engine.collected_spec("decode", None);
    spec["replay"] = format!("tcp://*:{connecting_replay}").into();
    coord.register(&spec).await;
    // Rank 1 of an engine running data parallel: given rank 0's endpoints, vLLM connects to the
    // listen port + 1 and binds replay on its port + 1.
    let _ranked = publisher(
        "vllm-publisher-rank-1",
        listen.clone(),
        format!("tcp://*:{ranked_replay}"),
        "kv@vr@sim-model",
        3 << 40,
        5,
    );
    let mut spec = ranked_engine.collected_spec("decode", None);
    spec["replay"] = format!("tcp://*:{ranked_replay}").into();
    spec["data_parallel_size"] = 2.into();
    coord.register(&spec).await;

    // vLLM's Python start (importing torch) takes seconds on a busy machine.
    eventually(Duration::from_secs(90), "vb 6, vc 9 and vr 5 blocks indexed", || async {
        (coord.indexed("vb").await, coord.indexed("vc").await, coord.indexed("vr").await) == (6, 9, 5)
    })
    .await;
    assert_eq!(coord.metric("pd_coordinator_kv_events_malformed_total").await, 0.0);
}
