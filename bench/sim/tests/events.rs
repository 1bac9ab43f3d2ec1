//! KV events over real ZMQ sockets, decoded with a plain msgpack decoder (not the suite's own).

mod common;

use std::time::{Duration, Instant};

use common::{free_port, Sim};
use rmpv::Value as Mp;
use serde_json::json;

fn sub(port: u16) -> zmq::Socket {
    let ctx = zmq::Context::new();
    let s = ctx.socket(zmq::SUB).unwrap();
    s.set_subscribe(b"").unwrap();
    s.set_rcvtimeo(200).unwrap();
    s.set_linger(0).unwrap();
    s.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
    s
}

/// The next message's `(topic, seq, batch)`, bounded.
fn next(s: &zmq::Socket) -> (Vec<u8>, u64, Mp) {
    let deadline = Instant::now() + common::WAIT;
    loop {
        if let Ok(frames) = s.recv_multipart(0) {
            assert_eq!(frames.len(), 3);
            let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
            let batch = rmpv::decode::read_value(&mut frames[2].as_slice()).unwrap();
            return (frames[0].clone(), seq, batch);
        }
        assert!(Instant::now() < deadline, "no event batch arrived");
    }
}

fn field<'a>(event: &'a Mp, key: &str) -> &'a Mp {
    event.as_map().unwrap().iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v).unwrap()
}

fn kind(event: &Mp) -> String {
    match event {
        Mp::Map(_) => field(event, "type").as_str().unwrap().to_string(),
        Mp::Array(items) => items[0].as_str().unwrap().to_string(),
        other => panic!("event {other}"),
    }
}

/// Waits until a request made now will be seen (a SUB joins asynchronously).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_removed_cleared_and_replay() {
    let (port, replay_port) = (free_port(), free_port());
    let endpoint = format!("tcp://*:{port}");
    let replay = format!("tcp://*:{replay_port}");
    let s = Sim::start(&[
        "--kv-events-endpoint",
        &endpoint,
        "--kv-events-replay-endpoint",
        &replay,
        "--kv-events-topic",
        "kv-events",
        "--num-blocks",
        "4",
        "--data-parallel-rank",
        "0",
    ])
    .await;
    let socket = sub(port);
    settle().await;

    // Tokens 0..16 then one more: one full block, hashed as vLLM's test vector says.
    let prompt: Vec<u32> = (0..17).collect();
    assert_eq!(s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1})).await.0, 200);
    let (topic, seq, batch) = next(&socket);
    assert_eq!((topic.as_slice(), seq), (&b"kv-events"[..], 0));
    let parts = batch.as_array().unwrap();
    assert!(parts[0].as_f64().unwrap() > 1.7e9);
    assert_eq!(parts[2].as_i64(), Some(0));
    let events = parts[1].as_array().unwrap();
    assert_eq!(kind(&events[0]), "AllBlocksCleared", "a fresh publisher starts clean");
    assert_eq!(kind(&events[1]), "BlockStored");
    let stored = &events[1];
    assert_eq!(field(stored, "block_hashes").as_array().unwrap()[0].as_u64(), Some(2233398808101521225));
    assert!(field(stored, "parent_block_hash").is_nil());
    assert_eq!(field(stored, "token_ids").as_array().unwrap().len(), 16);
    assert_eq!(field(stored, "block_size").as_u64(), Some(16));
    assert_eq!(field(stored, "medium").as_str(), Some("GPU"));

    // A second prompt needs all 4 blocks: the cached one is evicted.
    let big: Vec<u32> = (1000..1064).collect();
    assert_eq!(s.post("/v1/completions", &json!({"prompt": big, "max_tokens": 1})).await.0, 200);
    let mut kinds = Vec::new();
    while kinds.len() < 2 {
        let (_, _, batch) = next(&socket);
        kinds.extend(batch.as_array().unwrap()[1].as_array().unwrap().iter().map(kind));
    }
    assert_eq!(kinds, ["BlockRemoved", "BlockStored"]);

    assert_eq!(common::client().post(format!("{}/reset_prefix_cache", s.url)).send().await.unwrap().status(), 200);
    let (_, seq, batch) = next(&socket);
    assert_eq!(kind(&batch.as_array().unwrap()[1].as_array().unwrap()[0]), "AllBlocksCleared");

    let replayed: Vec<u64> = replay_from(replay_port, 1).into_iter().map(|(seq, _)| seq).collect();
    assert_eq!(replayed, (1..=seq).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_arrays_bytes_hashes_and_restart_clears() {
    let (port, replay_port) = (free_port(), free_port());
    let (endpoint, replay) = (format!("tcp://*:{port}"), format!("tcp://*:{replay_port}"));
    let flags = ["--kv-events-layout", "array", "--kv-events-bytes-hashes"];
    let mut s = Sim::start(
        &[&["--kv-events-endpoint", &endpoint, "--kv-events-replay-endpoint", &replay][..], &flags].concat(),
    )
    .await;
    let socket = sub(port);
    settle().await;
    let prompt: Vec<u32> = (0..16).collect();
    assert_eq!(s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1})).await.0, 200);
    let (_, seq, batch) = next(&socket);
    assert_eq!(seq, 0);
    let events = batch.as_array().unwrap()[1].as_array().unwrap().clone();
    let stored = events[1].as_array().unwrap();
    assert_eq!(stored[0].as_str(), Some("BlockStored"));
    let digest = stored[1].as_array().unwrap()[0].as_slice().unwrap();
    let expected = pd_protocols::hash::block_hashes(&pd_protocols::hash::none_hash(None), &prompt, 16);
    assert_eq!(digest, expected[0].as_slice());

    // A restarted engine numbers from 0 again and its first batch starts with AllBlocksCleared.
    // A SUB that reconnects may miss the very first batch (ZMQ's slow joiner; subscribers detect
    // the restart from the sequence going back), so the first batch is also checked by replay.
    s.restart().await;
    settle().await;
    let mut seen = None;
    for i in 0..20 {
        let body = json!({"prompt": common::words(20, &format!("after{i}")), "max_tokens": 1});
        assert_eq!(s.post("/v1/completions", &body).await.0, 200);
        if let Ok(frames) = socket.recv_multipart(0) {
            seen = Some(u64::from_be_bytes(frames[1].as_slice().try_into().unwrap()));
            break;
        }
    }
    assert!(seen.is_some_and(|seq| seq <= 1), "the sequence restarted: {seen:?}");
    let first = replay_from(replay_port, 0).remove(0);
    assert_eq!(first.0, 0);
    assert_eq!(kind(&first.1.as_array().unwrap()[1].as_array().unwrap()[0]), "AllBlocksCleared");
}

/// Every `(seq, batch)` the replay socket returns from `start` on, over a DEALER (framed as a
/// REQ would be: empty delimiter, then the start sequence).
fn replay_from(port: u16, start: u64) -> Vec<(u64, Mp)> {
    let ctx = zmq::Context::new();
    let dealer = ctx.socket(zmq::DEALER).unwrap();
    dealer.set_rcvtimeo(5000).unwrap();
    dealer.set_linger(0).unwrap();
    dealer.connect(&format!("tcp://127.0.0.1:{port}")).unwrap();
    dealer.send_multipart([&b""[..], &start.to_be_bytes()], 0).unwrap();
    let mut out = Vec::new();
    loop {
        let frames = dealer.recv_multipart(0).expect("replay reply");
        assert_eq!((frames.len(), frames[0].len()), (3, 0));
        if frames[1] == [0xff; 8] {
            assert!(frames[2].is_empty());
            return out;
        }
        let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
        out.push((seq, rmpv::decode::read_value(&mut frames[2].as_slice()).unwrap()));
    }
}
