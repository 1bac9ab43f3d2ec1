//! KV-event ingestion from one engine's ZMQ publisher: subscribe, check sequence numbers, fill
//! gaps through the replay socket when there is one (and replay everything buffered on joining),
//! and hand decoded batches on. The decoding and sequence rules are in `pd_protocols`; this is
//! the socket edge.

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
    let count = |counter: &AtomicU64| counter.fetch_add(1, Ordering::Relaxed);
    let mut deliver = |update: Update| {
        match &update {
            Update::Reset => {
                count(&counters.resets);
            }
            Update::Batch(_) | Update::Malformed(_) => {}
        }
        deliver(update)
    };
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvtimeo(POLL_MS)?;
    sub.set_linger(0)?;
    sub.set_subscribe(source.topic.as_bytes())?;
    sub.connect(&source.endpoint)?;
    let mut tracker = SeqTracker::default();
    // Batches up to this sequence came through the initial replay; the subscription may
    // deliver them again.
    let mut replayed_until = None;
    if let Some(replay) = source.replay.as_deref() {
        count(&counters.replays);
        let (outcome, last) = replay_range(ctx, replay, 0, None, counters, &mut deliver).unwrap_or_else(|err| {
            tracing::warn!(%err, "initial replay failed");
            (Replayed::Incomplete, None)
        });
        if outcome == Replayed::Incomplete {
            deliver(Update::Reset);
        }
        if let Some(last) = last {
            tracker.observe(last);
            replayed_until = Some(last);
        }
    }
    while !stop.load(Ordering::Acquire) {
        let frames = match sub.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(err) => return Err(err.into()),
        };
        let (_, seq, payload) = match parse_pub(&frames) {
            Ok(parsed) => parsed,
            Err(err) => {
                deliver(Update::Malformed(err.to_string()));
                continue;
            }
        };
        if let Some(until) = replayed_until {
            if seq <= until {
                continue;
            }
            replayed_until = None;
        }
        match tracker.observe(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Gap { expected, got } => {
                count(&counters.gaps);
                let outcome = match source.replay.as_deref() {
                    Some(replay) => {
                        count(&counters.replays);
                        replay_range(ctx, replay, expected, Some(got), counters, &mut deliver)
                            .map(|(outcome, _)| outcome)
                            .unwrap_or_else(|err| {
                                tracing::warn!(%err, "replay failed");
                                Replayed::Incomplete
                            })
                    }
                    None => Replayed::Incomplete,
                };
                if outcome == Replayed::Incomplete {
                    deliver(Update::Reset);
                }
            }
            SeqCheck::Restarted { .. } => deliver(Update::Reset),
        }
        deliver(decode(payload));
    }
    Ok(())
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
                    deliver(Update::Reset);
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
