//! KV-event ingestion: subscribe to one engine's ZMQ publisher (or, in collector mode, bind one
//! socket that many engines connect to, told apart by topic), check sequence numbers per
//! engine, fill gaps through the replay socket when there is one (and replay everything
//! buffered on joining a publisher), and hand decoded batches on. The decoding and sequence
//! rules are in `pd_protocols`, topic routing in `topic`; this is the socket edge.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pd_protocols::kv_events::{decode_batch, EventBatch};
use pd_protocols::zmq_frames::{parse_pub, parse_replay_reply, seq_frame, SeqCheck, SeqTracker};

/// Where one engine publishes.
#[derive(Clone, Debug)]
pub struct Source {
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
}

/// What the ingester tells its owner.
#[derive(Debug)]
pub enum Update {
    Batch(EventBatch),
    /// Events were lost (no replay, or replay could not fill the gap) or the publisher
    /// restarted: drop this engine's index entries; what follows rebuilds them.
    Reset,
    /// A message that does not decode; skipped.
    Malformed(String),
}

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
}

/// How long replay may take before the gap is declared unfillable.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);
/// How often a blocked receive wakes to check the stop flag.
const POLL_MS: i32 = 200;

/// What an ingester did, for metrics (shared with its owner).
#[derive(Debug, Default)]
pub struct Counters {
    /// Sequence gaps seen on the subscription (a restart counts as a reset, not a gap).
    pub gaps: AtomicU64,
    /// Replay requests sent (the first one on joining included).
    pub replays: AtomicU64,
    /// Batches received through replay.
    pub replayed_batches: AtomicU64,
    /// Resets delivered (history lost: unfillable gap, publisher restart, truncated replay).
    pub resets: AtomicU64,
}

/// Runs until `stop` is set, calling `deliver` for every update. Blocking: run it on its own
/// thread. With a replay socket it first asks for everything buffered, so an idle engine's
/// cache is known at once (a coordinator that restarts rebuilds its index this way).
pub fn run(
    ctx: &zmq::Context,
    source: &Source,
    stop: &Arc<AtomicBool>,
    deliver: impl FnMut(Update),
) -> Result<(), IngestError> {
    run_counted(ctx, source, stop, &Counters::default(), deliver)
}

/// [`run`], counting into `counters`.
pub fn run_counted(
    ctx: &zmq::Context,
    source: &Source,
    stop: &Arc<AtomicBool>,
    counters: &Counters,
    mut deliver: impl FnMut(Update),
) -> Result<(), IngestError> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvtimeo(POLL_MS)?;
    sub.set_linger(0)?;
    sub.set_subscribe(source.topic.as_bytes())?;
    sub.connect(&source.endpoint)?;
    let mut stream = Stream::new(source.replay.clone());
    if source.replay.is_some() {
        stream.join(ctx, counters, &mut deliver);
    }
    while !stop.load(Ordering::Acquire) {
        let frames = match sub.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(err) => return Err(err.into()),
        };
        match parse_pub(&frames) {
            Ok((_, seq, payload)) => stream.receive(ctx, seq, payload, counters, &mut deliver),
            Err(err) => deliver(Update::Malformed(err.to_string())),
        }
    }
    Ok(())
}

/// Which engine a collector-mode message belongs to, as the owner decides from its topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The engine's number.
    pub engine: usize,
    /// Changes when the engine's sequence must be followed afresh (a new registration).
    pub epoch: (u64, u64),
    pub replay: Option<String>,
}

/// Largest message the collector's bound socket accepts; a peer sending more is disconnected
/// by ZMQ (the socket is open to anyone who reaches the port).
const MAX_COLLECTED_MESSAGE: i64 = 64 << 20;

/// Binds collector mode's SUB socket (subscribed to every topic).
pub fn bind_collector(ctx: &zmq::Context, endpoint: &str) -> Result<zmq::Socket, IngestError> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvtimeo(POLL_MS)?;
    sub.set_linger(0)?;
    sub.set_maxmsgsize(MAX_COLLECTED_MESSAGE)?;
    sub.set_subscribe(b"")?;
    sub.bind(endpoint)?;
    Ok(sub)
}

/// Collector mode: engines connect to `sub` ([`bind_collector`]) and publish under their own
/// topic. `route` names each topic's engine (`None`: unknown, the message is dropped); every
/// engine's sequence is followed as [`run`] follows one publisher's, gaps filled through its
/// replay socket. `deliver` gets the engine's route, or `None` for a message no engine can be
/// told from (malformed frames). Runs until `stop` is set.
pub fn collect(
    ctx: &zmq::Context,
    sub: &zmq::Socket,
    stop: &Arc<AtomicBool>,
    counters: &Counters,
    mut route: impl FnMut(&[u8]) -> Option<Route>,
    mut deliver: impl FnMut(Option<&Route>, Update),
) -> Result<(), IngestError> {
    // By engine number: bounded by the membership, a reused number replaces the old stream.
    let mut streams: HashMap<usize, (Route, Stream)> = HashMap::new();
    while !stop.load(Ordering::Acquire) {
        let frames = match sub.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(err) => return Err(err.into()),
        };
        let (topic, seq, payload) = match parse_pub(&frames) {
            Ok(parsed) => parsed,
            Err(err) => {
                deliver(None, Update::Malformed(err.to_string()));
                continue;
            }
        };
        let Some(route) = route(topic) else { continue };
        let entry = streams.entry(route.engine).or_insert_with(|| (route.clone(), Stream::new(route.replay.clone())));
        if entry.0 != route {
            *entry = (route.clone(), Stream::new(route.replay.clone()));
        }
        let (route, stream) = (&entry.0, &mut entry.1);
        stream.receive(ctx, seq, payload, counters, &mut |update| deliver(Some(route), update));
    }
    Ok(())
}

/// One publisher's sequence as a subscriber follows it.
struct Stream {
    replay: Option<String>,
    tracker: SeqTracker,
    /// Batches up to this sequence came through the initial replay; the subscription may
    /// deliver them again.
    replayed_until: Option<u64>,
}

impl Stream {
    fn new(replay: Option<String>) -> Stream {
        Stream { replay, tracker: SeqTracker::default(), replayed_until: None }
    }

    /// Asks the replay socket for everything buffered (joining a publisher).
    fn join(&mut self, ctx: &zmq::Context, counters: &Counters, deliver: &mut impl FnMut(Update)) {
        let Some(replay) = self.replay.as_deref() else { return };
        count(&counters.replays);
        let (outcome, last) = replay_range(ctx, replay, 0, None, counters, deliver).unwrap_or_else(|err| {
            tracing::warn!(%err, "initial replay failed");
            (Replayed::Incomplete, None)
        });
        if outcome == Replayed::Incomplete {
            reset(counters, deliver);
        }
        if let Some(last) = last {
            self.tracker.observe(last);
            self.replayed_until = Some(last);
        }
    }

    /// One message from the subscription: checks its sequence (replaying or resetting first
    /// when needed), then delivers it.
    fn receive(
        &mut self,
        ctx: &zmq::Context,
        seq: u64,
        payload: &[u8],
        counters: &Counters,
        deliver: &mut impl FnMut(Update),
    ) {
        if let Some(until) = self.replayed_until {
            if seq <= until {
                return;
            }
            self.replayed_until = None;
        }
        match self.tracker.observe(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Gap { expected, got } => {
                count(&counters.gaps);
                let outcome = match self.replay.as_deref() {
                    Some(replay) => {
                        count(&counters.replays);
                        replay_range(ctx, replay, expected, Some(got), counters, deliver)
                            .map(|(outcome, _)| outcome)
                            .unwrap_or_else(|err| {
                                tracing::warn!(%err, "replay failed");
                                Replayed::Incomplete
                            })
                    }
                    None => Replayed::Incomplete,
                };
                if outcome == Replayed::Incomplete {
                    reset(counters, deliver);
                }
            }
            SeqCheck::Restarted { .. } => reset(counters, deliver),
        }
        deliver(decode(payload));
    }
}

fn count(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

fn reset(counters: &Counters, deliver: &mut impl FnMut(Update)) {
    count(&counters.resets);
    deliver(Update::Reset);
}

fn decode(payload: &[u8]) -> Update {
    match decode_batch(payload) {
        Ok(batch) => Update::Batch(batch),
        Err(err) => Update::Malformed(err.to_string()),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replayed {
    /// Every batch asked for was delivered.
    Complete,
    /// The publisher no longer had the oldest ones: a reset was delivered, then what it had.
    Truncated,
    /// Replay failed part-way (timeout, hole, bad reply); the caller resets.
    Incomplete,
}

/// Asks the replay socket for `from .. until` (`None`: everything buffered) and delivers those
/// batches; also returns the last sequence delivered.
fn replay_range(
    ctx: &zmq::Context,
    endpoint: &str,
    from: u64,
    until: Option<u64>,
    counters: &Counters,
    deliver: &mut impl FnMut(Update),
) -> Result<(Replayed, Option<u64>), IngestError> {
    let dealer = ctx.socket(zmq::DEALER)?;
    dealer.set_linger(0)?;
    dealer.set_rcvtimeo(POLL_MS)?;
    dealer.connect(endpoint)?;
    dealer.send(&seq_frame(from)[..], 0)?;
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let mut next = from;
    let mut last = None;
    let mut truncated = false;
    while Instant::now() < deadline {
        let frames = match dealer.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(err) => return Err(err.into()),
        };
        // A ROUTER may prefix an empty delimiter frame; replies are the last two frames.
        let tail = &frames[frames.len().saturating_sub(2)..];
        match parse_replay_reply(tail) {
            Ok(None) => {
                let complete = until.is_none_or(|until| next >= until);
                let outcome = match (complete, truncated) {
                    (false, _) => Replayed::Incomplete,
                    (true, false) => Replayed::Complete,
                    (true, true) => Replayed::Truncated,
                };
                return Ok((outcome, last));
            }
            // Batches past the gap arrive on the subscription too; skip them here.
            Ok(Some((seq, _))) if until.is_some_and(|until| seq >= until) => {}
            Ok(Some((seq, payload))) if seq >= next => {
                if seq > next {
                    if last.is_some() {
                        return Ok((Replayed::Incomplete, last));
                    }
                    // The oldest batches are gone: start over from what the publisher has.
                    truncated = true;
                    reset(counters, deliver);
                }
                counters.replayed_batches.fetch_add(1, Ordering::Relaxed);
                deliver(decode(payload));
                next = seq + 1;
                last = Some(seq);
            }
            Ok(Some(_)) | Err(_) => return Ok((Replayed::Incomplete, last)),
        }
    }
    Ok((Replayed::Incomplete, last))
}
