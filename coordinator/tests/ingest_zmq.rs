//! Ingestion over real ZMQ sockets: a publisher in vLLM's wire format (PUB + replay ROUTER),
//! the ingester filling a join race and a gap through replay, and noticing a restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use common::bind_any_port;
use pd_coordinator::ingest::{self, Source, Update};
use pd_protocols::kv_events::{encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};
use pd_protocols::zmq_frames::{parse_seq, seq_frame, ReplayBuffer, REPLAY_END};

fn batch(n: u64) -> EventBatch {
    EventBatch {
        ts: n as f64,
        events: vec![KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(n)], medium: None }],
        dp_rank: Some(0),
    }
}

struct Publisher {
    publisher: zmq::Socket,
    buffer: Arc<Mutex<ReplayBuffer>>,
}

impl Publisher {
    /// Numbers and buffers a batch; sends it on the PUB socket unless `drop_on_wire`.
    fn publish(&self, n: u64, drop_on_wire: bool) {
        let payload = encode_batch(&batch(n), EventFormat::TaggedMap);
        let seq = self.buffer.lock().unwrap().push(payload.clone());
        if !drop_on_wire {
            self.publisher.send_multipart([b"kv-events".to_vec(), seq_frame(seq).to_vec(), payload], 0).unwrap();
        }
    }
}

fn serve_replay(router: zmq::Socket, buffer: Arc<Mutex<ReplayBuffer>>, stop: Arc<AtomicBool>) {
    router.set_rcvtimeo(100).unwrap();
    while !stop.load(Ordering::Acquire) {
        let Ok(frames) = router.recv_multipart(0) else { continue };
        let (identity, start) = (frames[0].clone(), parse_seq(frames.last().unwrap()).unwrap());
        let replies: Vec<(u64, Vec<u8>)> = buffer.lock().unwrap().since(start).map(|(s, p)| (s, p.to_vec())).collect();
        for (seq, payload) in replies {
            router.send_multipart([identity.clone(), seq_frame(seq).to_vec(), payload], 0).unwrap();
        }
        router.send_multipart([identity, REPLAY_END.to_vec(), Vec::new()], 0).unwrap();
    }
}

fn next(rx: &mpsc::Receiver<Update>) -> Update {
    rx.recv_timeout(Duration::from_secs(5)).expect("an update within 5 s")
}

fn ts_of(update: Update) -> u64 {
    match update {
        Update::Batch(b) => b.ts as u64,
        other => panic!("expected a batch, got {other:?}"),
    }
}

#[test]
fn replay_fills_join_race_and_gaps_and_restarts_reset() {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    let endpoint = bind_any_port(&publisher);
    let router = ctx.socket(zmq::ROUTER).unwrap();
    let replay = bind_any_port(&router);
    let buffer = Arc::new(Mutex::new(ReplayBuffer::new(100)));
    let stop = Arc::new(AtomicBool::new(false));
    let replay_thread = {
        let (buffer, stop) = (Arc::clone(&buffer), Arc::clone(&stop));
        std::thread::spawn(move || serve_replay(router, buffer, stop))
    };

    let (tx, rx) = mpsc::channel();
    let source = Source { endpoint, replay: Some(replay), topic: "kv-events".into() };
    let ingester = {
        let (ctx, stop) = (ctx.clone(), Arc::clone(&stop));
        std::thread::spawn(move || ingest::run(&ctx, &source, &stop, |u| tx.send(u).unwrap()))
    };
    let publisher = Publisher { publisher, buffer };

    // Messages sent before the subscription is live are lost on the wire (ZMQ's slow joiner);
    // the first one that arrives shows a gap from 0 and replay fills it.
    for n in 0..5 {
        publisher.publish(n, false);
        std::thread::sleep(Duration::from_millis(50));
    }
    let first: Vec<u64> = (0..5).map(|_| ts_of(next(&rx))).collect();
    assert_eq!(first, vec![0, 1, 2, 3, 4]);

    publisher.publish(5, false);
    publisher.publish(6, true); // lost on the wire, still in the replay buffer
    publisher.publish(7, false);
    let after: Vec<u64> = (0..3).map(|_| ts_of(next(&rx))).collect();
    assert_eq!(after, vec![5, 6, 7]);

    // A restarted publisher numbers from 0 again: the engine's entries must be rebuilt.
    *publisher.buffer.lock().unwrap() = ReplayBuffer::new(100);
    publisher.publish(100, false);
    assert!(matches!(next(&rx), Update::Reset));
    assert_eq!(ts_of(next(&rx)), 100);

    // Garbage payload: reported, skipped, the stream goes on.
    publisher.publisher.send_multipart([b"kv-events".to_vec(), seq_frame(1).to_vec(), b"\xc1".to_vec()], 0).unwrap();
    assert!(matches!(next(&rx), Update::Malformed(_)));

    stop.store(true, Ordering::Release);
    ingester.join().unwrap().unwrap();
    replay_thread.join().unwrap();
}
