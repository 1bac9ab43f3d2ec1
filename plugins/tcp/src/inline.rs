//! The inline fast path for small requests: the caller's thread sends the frame on a pooled
//! connection of its own, and the thread that waits for the request reads the answer (through
//! the completion's [`Progress`] hook), so a small request crosses no thread of this process.
//! Handing a chunk to a stream worker and the answer back to the waiter costs two thread
//! wake-ups, which on a busy machine take longer than moving a few kilobytes.
//!
//! Whoever reads the answer does it with the same bounded reads as a stream worker, so dead
//! peers, timeouts and refusals end the request exactly as on the queued path. The answer goes
//! to the stream workers instead when nobody on the caller's side will read it soon:
//! - a poller (`progress`), or a waiter whose deadline is shorter than the backend's own
//!   bound (it must not block past its deadline), hands the request over at once;
//! - a request nobody waits for or polls is adopted by a worker after [`ADOPT_AFTER`] (checked
//!   on the workers' idle tick), so its memory, connection and notification are released.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xfer_core::staging::needs_staging;
use xfer_core::{BackendError, Completion, Progress};

use crate::pool::{finish, receive_host, request_head, send_host, Chunk, PoolShared, Pooled, Work};

/// How old an inline request nobody has claimed must be before a worker adopts it.
pub const ADOPT_AFTER: Duration = Duration::from_millis(10);

/// A request sent inline, until its answer is read.
pub struct Inline {
    pool: Arc<PoolShared>,
    in_flight: Mutex<Option<InFlight>>,
    handed_over: AtomicBool,
    posted_at: Instant,
}

struct InFlight {
    pooled: Pooled,
    chunk: Chunk,
    request_id: u64,
}

/// What the request's completion carries. Weak: a finished request kept by the user holds
/// nothing of the pool.
struct Hook(Weak<Inline>);

/// Whether a planned request goes inline: one chunk of host memory, small, not empty, while
/// fewer inline requests to this peer are in flight than it has streams. Past that, the stream
/// workers keep many requests in flight on each of their connections; more inline connections
/// would each cost a thread of the target's.
pub fn eligible(pool: &PoolShared, chunk: &Chunk) -> bool {
    let config = &pool.config;
    chunk.bytes > 0
        && chunk.bytes <= config.inline_bytes
        && !needs_staging(&chunk.local)
        && pool.inline.lock().iter().filter(|inline| inline.is_pending()).count() < config.streams.max(1)
}

/// Sends `chunk` on this thread; its answer is read by the request's waiter (or a worker).
pub fn post(pool: &Arc<PoolShared>, chunk: Chunk) {
    let (request_id, head) = request_head(pool, &chunk);
    let sent = pool.check_out().and_then(|mut pooled| match send_host(pool, &mut pooled.conn, &chunk, &head) {
        Ok(()) => Ok(pooled),
        Err(err) => {
            pool.abandon(&mut Some(pooled));
            Err(err)
        }
    });
    let pooled = match sent {
        Ok(pooled) => pooled,
        Err(err) => {
            pool.record_failure(&err);
            return finish(pool, chunk, Err(err));
        }
    };
    let tracker = Arc::clone(&chunk.tracker);
    let inline = Arc::new(Inline {
        pool: Arc::clone(pool),
        in_flight: Mutex::new(Some(InFlight { pooled, chunk, request_id })),
        handed_over: AtomicBool::new(false),
        posted_at: Instant::now(),
    });
    if let Some(done) = tracker.done.lock().as_ref() {
        done.set_progress(Arc::new(Hook(Arc::downgrade(&inline))));
    }
    {
        let mut pending = pool.inline.lock();
        pending.retain(|other| other.is_pending());
        pending.push(inline);
    }
    if pool.is_closed() {
        // Closed meanwhile: the workers may be gone, so end it here (on the stop flag).
        adopt_unclaimed(pool, Duration::ZERO);
    }
}

/// Lets a worker finish the inline requests nobody claimed for `older_than` (all of them
/// when the pool closes).
pub fn adopt_unclaimed(pool: &PoolShared, older_than: Duration) {
    let due: Vec<Arc<Inline>> = {
        let mut pending = pool.inline.lock();
        if pending.is_empty() {
            return;
        }
        let (due, waiting) = std::mem::take(&mut *pending)
            .into_iter()
            .filter(|inline| inline.is_pending())
            .partition(|inline| inline.posted_at.elapsed() >= older_than);
        *pending = waiting;
        due
    };
    for inline in due {
        inline.finish();
    }
}

impl Inline {
    fn is_pending(&self) -> bool {
        self.in_flight.lock().is_some()
    }

    /// Reads the answer on this thread, bounded by the backend's timeouts, and completes the
    /// request; does nothing when another thread already took it.
    pub fn finish(&self) {
        let Some(InFlight { pooled, mut chunk, request_id }) = self.in_flight.lock().take() else { return };
        let pool = &*self.pool;
        let mut slot = Some(pooled);
        // As on the queue: once the peer failed another exchange after this one was sent, do
        // not wait out a second timeout for it.
        if let Some(err) = pool.failed_since(chunk.queued_at) {
            pool.abandon(&mut slot);
            return finish(pool, chunk, Err(err));
        }
        let result = match &mut slot {
            Some(pooled) => receive_host(pool, &mut pooled.conn, &mut chunk, request_id),
            None => Err(pool.disconnected("no connection")),
        };
        match &result {
            Ok(()) | Err(BackendError::Refused { .. }) => {
                if let Some(pooled) = slot {
                    pool.check_in(pooled);
                }
            }
            Err(err) => {
                pool.record_failure(err);
                pool.abandon(&mut slot);
            }
        }
        finish(pool, chunk, result);
    }

    /// Leaves the answer to the stream workers (once).
    fn hand_over(self: Arc<Self>) {
        if self.handed_over.swap(true, Ordering::AcqRel) || !self.is_pending() {
            return;
        }
        let pool = Arc::clone(&self.pool);
        if let Err(unsent) = pool.queue.send(Work::Adopt(self)) {
            // No worker left (the pool is gone): the read ends at once on the stop flag.
            if let Work::Adopt(inline) = unsent.0 {
                inline.finish();
            }
        }
    }
}

impl Progress for Hook {
    fn progress(&self) {
        if let Some(inline) = self.0.upgrade() {
            inline.hand_over();
        }
    }

    fn drive(&self, _completion: &Completion, deadline: Instant) {
        let Some(inline) = self.0.upgrade() else { return };
        // The read is bounded by the backend's progress timeout, not by the waiter's deadline.
        if deadline.saturating_duration_since(Instant::now()) >= inline.pool.config.timeout {
            inline.finish();
        } else {
            inline.hand_over();
        }
    }
}
