//! KV-cache events on ZeroMQ as vLLM publishes them: a PUB socket sending
//! `[topic, seq, msgpack batch]` and an optional ROUTER socket replaying buffered batches.
//! The engine hands events to a channel (in the order the pool changed); one thread owns both
//! sockets (ZMQ sockets are not thread-safe) and publishes whatever is pending as one batch.

use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pd_protocols::hash::{event_id, BlockDigest};
use pd_protocols::kv_events::{encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};
use pd_protocols::zmq_frames::{parse_seq, seq_frame, ReplayBuffer, REPLAY_END};

#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("zmq {what} {endpoint}: {source}")]
    Zmq { what: &'static str, endpoint: String, source: zmq::Error },
}

#[derive(Clone, Debug)]
pub struct EventsConfig {
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub format: EventFormat,
    pub bytes_hashes: bool,
    pub buffer_steps: usize,
    pub dp_rank: Option<i64>,
}

/// The engine's side: cheap to clone, never blocks.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: Sender<Vec<KvEvent>>,
    bytes_hashes: bool,
}

impl EventSink {
    pub fn hash(&self, digest: &BlockDigest) -> BlockHash {
        if self.bytes_hashes {
            BlockHash::Bytes(digest.to_vec())
        } else {
            BlockHash::Int(event_id(digest))
        }
    }

    pub fn emit(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // A send fails only when the publisher thread is gone (shutdown): nothing to do.
            let _ = self.tx.send(events);
        }
    }
}

/// vLLM binds when the endpoint has a wildcard or is ipc/inproc, and connects otherwise.
fn binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

fn open(ctx: &zmq::Context, kind: zmq::SocketType, endpoint: &str, bind: bool) -> Result<zmq::Socket, EventsError> {
    let err = |what, source| EventsError::Zmq { what, endpoint: endpoint.to_string(), source };
    let socket = ctx.socket(kind).map_err(|e| err("socket", e))?;
    socket.set_linger(0).map_err(|e| err("linger", e))?;
    if kind == zmq::PUB {
        socket.set_sndhwm(100_000).map_err(|e| err("sndhwm", e))?;
    }
    if bind {
        socket.bind(endpoint).map_err(|e| err("bind", e))?;
    } else {
        socket.connect(endpoint).map_err(|e| err("connect", e))?;
    }
    Ok(socket)
}

/// Starts the publisher thread. Its first batch begins with `AllBlocksCleared`, so a
/// subscriber that saw an earlier incarnation of this engine drops what it knew.
pub fn start(config: EventsConfig) -> Result<(EventSink, JoinHandle<()>), EventsError> {
    let ctx = zmq::Context::new();
    let publisher = open(&ctx, zmq::PUB, &config.endpoint, binds(&config.endpoint))?;
    let replay = match &config.replay_endpoint {
        Some(endpoint) => Some(open(&ctx, zmq::ROUTER, endpoint, true)?),
        None => None,
    };
    let (tx, rx) = mpsc::channel();
    let sink = EventSink { tx, bytes_hashes: config.bytes_hashes };
    let _ = sink.tx.send(vec![KvEvent::AllBlocksCleared]);
    let handle = std::thread::Builder::new()
        .name("kv-events".into())
        .spawn(move || run(config, ctx, publisher, replay, rx))
        .expect("spawning the event thread");
    Ok((sink, handle))
}

fn now_secs() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

fn run(
    config: EventsConfig,
    _ctx: zmq::Context,
    publisher: zmq::Socket,
    replay: Option<zmq::Socket>,
    rx: Receiver<Vec<KvEvent>>,
) {
    let mut buffer = ReplayBuffer::new(config.buffer_steps);
    // The first batch waits for a real event so that subscribers have had time to connect.
    let mut pending: Vec<KvEvent> = Vec::new();
    let mut started = false;
    // Short enough that new subscribers' subscriptions are taken in promptly (see below) and
    // replay requests are answered fast.
    let tick = if replay.is_some() { Duration::from_millis(5) } else { Duration::from_millis(20) };
    loop {
        match rx.recv_timeout(tick) {
            Ok(events) => {
                pending.extend(events);
                while let Ok(more) = rx.try_recv() {
                    pending.extend(more);
                }
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        // Reading ZMQ_EVENTS makes libzmq process pending commands (new subscriber pipes and
        // their subscriptions) now rather than inside the next send, which could otherwise
        // filter that message out for a subscriber that reconnected while we were idle.
        let _ = publisher.get_events();
        let only_clear = pending.iter().all(|e| matches!(e, KvEvent::AllBlocksCleared));
        if !pending.is_empty() && (started || !only_clear) {
            started = true;
            let batch = EventBatch { ts: now_secs(), events: std::mem::take(&mut pending), dp_rank: config.dp_rank };
            let payload = encode_batch(&batch, config.format);
            let seq = buffer.next_seq();
            let frames: [&[u8]; 3] = [config.topic.as_bytes(), &seq_frame(seq), &payload];
            if let Err(err) = publisher.send_multipart(frames, 0) {
                tracing::warn!(%err, seq, "cannot publish KV events");
            }
            buffer.push(payload);
        }
        if let Some(replay) = &replay {
            serve_replay(replay, &buffer);
        }
    }
}

/// Answers every pending replay request: `[identity, start seq]` → `[identity, seq, payload]`…
/// then the end marker. Malformed requests get just the end marker.
fn serve_replay(socket: &zmq::Socket, buffer: &ReplayBuffer) {
    while let Ok(frames) = socket.recv_multipart(zmq::DONTWAIT) {
        let Some((identity, rest)) = frames.split_first() else { continue };
        // A REQ client puts an empty delimiter frame before its payload; a DEALER may not.
        let body: Vec<&Vec<u8>> = rest.iter().filter(|f| !f.is_empty()).collect();
        let start = match body.as_slice() {
            [seq] => parse_seq(seq).ok(),
            _ => None,
        };
        let delimiter = rest.first().is_some_and(|f| f.is_empty());
        let send = |seq: &[u8], payload: &[u8]| {
            let mut out: Vec<&[u8]> = vec![identity];
            if delimiter {
                out.push(&[]);
            }
            out.extend([seq, payload]);
            socket.send_multipart(out, 0)
        };
        if let Some(start) = start {
            for (seq, payload) in buffer.since(start) {
                if send(&seq_frame(seq), payload).is_err() {
                    break;
                }
            }
        }
        let _ = send(&REPLAY_END, &[]);
    }
}
