//! KV-event ingestion from one engine's ZMQ publisher: subscribe, check sequence numbers, fill
//! gaps through the replay socket when there is one, and hand decoded batches on. The decoding
//! and sequence rules are in `pd_protocols`; this is the socket edge.

use std::sync::atomic::{AtomicBool, Ordering};
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

/// Runs until `stop` is set, calling `deliver` for every update. Blocking: run it on its own
/// thread.
pub fn run(
    ctx: &zmq::Context,
    source: &Source,
    stop: &Arc<AtomicBool>,
    mut deliver: impl FnMut(Update),
) -> Result<(), IngestError> {
    let sub = ctx.socket(zmq::SUB)?;
    sub.set_rcvtimeo(POLL_MS)?;
    sub.set_linger(0)?;
    sub.set_subscribe(source.topic.as_bytes())?;
    sub.connect(&source.endpoint)?;
    let mut tracker = SeqTracker::default();
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
        match tracker.observe(seq) {
            SeqCheck::InOrder => {}
            SeqCheck::Gap { expected, got } => {
                let filled = source.replay.as_deref().is_some_and(|replay| {
                    replay_range(ctx, replay, expected, got, &mut deliver).unwrap_or_else(|err| {
                        tracing::warn!(%err, "replay failed");
                        false
                    })
                });
                if !filled {
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

/// Asks the replay socket for `from .. until` and delivers those batches; `Ok(false)` when the
/// publisher no longer has all of them.
fn replay_range(
    ctx: &zmq::Context,
    endpoint: &str,
    from: u64,
    until: u64,
    deliver: &mut impl FnMut(Update),
) -> Result<bool, IngestError> {
    let dealer = ctx.socket(zmq::DEALER)?;
    dealer.set_linger(0)?;
    dealer.set_rcvtimeo(POLL_MS)?;
    dealer.connect(endpoint)?;
    dealer.send(&seq_frame(from)[..], 0)?;
    let deadline = Instant::now() + REPLAY_TIMEOUT;
    let mut next = from;
    while Instant::now() < deadline {
        let frames = match dealer.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => continue,
            Err(err) => return Err(err.into()),
        };
        // A ROUTER may prefix an empty delimiter frame; replies are the last two frames.
        let tail = &frames[frames.len().saturating_sub(2)..];
        match parse_replay_reply(tail) {
            Ok(None) => return Ok(next >= until),
            Ok(Some((seq, payload))) if seq == next && seq < until => {
                deliver(decode(payload));
                next += 1;
            }
            // Batches past the gap arrive on the subscription too; skip them here.
            Ok(Some((seq, _))) if seq >= until => {}
            Ok(Some(_)) | Err(_) => return Ok(false),
        }
    }
    Ok(false)
}
