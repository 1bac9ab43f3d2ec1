//! A [`PrefixIndex`] that lookups read while one writer applies events, neither waiting for the
//! other: two copies. Lookups read the published one; the writer applies events to the other
//! and keeps them, and every [`PUBLISH_EVERY`] block events (or on [`IndexWriter::publish`])
//! the two swap and the kept events are applied again to the copy the lookups left.
//!
//! A lookup costs what it costs on a plain index, plus taking a reference to the published
//! copy (a short lock and a reference count). The writer applies every event twice, and the
//! index takes twice the memory. What lookups see is at most `PUBLISH_EVERY` block events
//! behind the writer: a routing decision already works from events that crossed a network.
//!
//! The writer waits, at each swap, for the lookups still reading the copy it takes back (each
//! runs inside [`SharedIndex::read`], as under a read lock).

use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pd_protocols::kv_events::KvEvent;

use super::PrefixIndex;

/// Block events the writer applies before it publishes them by itself.
pub const PUBLISH_EVERY: usize = 4096;

/// The side lookups read; made only with its writer ([`SharedIndex::new`]).
#[derive(Debug)]
pub struct SharedIndex {
    published: Mutex<Arc<PrefixIndex>>,
}

impl SharedIndex {
    /// The index and its one writer.
    pub fn new() -> (Arc<SharedIndex>, IndexWriter) {
        let shared = Arc::new(SharedIndex { published: Mutex::new(Arc::new(PrefixIndex::default())) });
        let writer =
            IndexWriter { shared: Arc::clone(&shared), back: PrefixIndex::default(), kept: Vec::new(), unpublished: 0 };
        (shared, writer)
    }

    /// Runs `lookup` on the published copy. The writer's next swap waits for it, so it should
    /// look up and return, as under a read lock.
    pub fn read<R>(&self, lookup: impl FnOnce(&PrefixIndex) -> R) -> R {
        let published = Arc::clone(&self.published.lock());
        lookup(&published)
    }
}

/// A write the published copy has not had yet.
#[derive(Debug)]
enum Write {
    Events { engine: usize, events: Vec<KvEvent> },
    RemoveEngine(usize),
    ForgetEngine(usize),
    Expire(Instant),
}

impl Write {
    fn apply(&self, index: &mut PrefixIndex) {
        match self {
            Write::Events { engine, events } => index.apply_batch(*engine, events),
            Write::RemoveEngine(engine) => index.remove_engine(*engine),
            Write::ForgetEngine(engine) => index.forget_engine(*engine),
            Write::Expire(now) => index.expire(*now),
        }
    }
}

/// The one writer of a [`SharedIndex`]. Both copies go through the same writes in the same
/// order, and every [`PrefixIndex`] write is a function of its arguments and the index alone,
/// so they hold the same entries.
#[derive(Debug)]
pub struct IndexWriter {
    shared: Arc<SharedIndex>,
    /// The copy lookups do not read.
    back: PrefixIndex,
    /// Writes applied to `back` and not yet to the other copy.
    kept: Vec<Write>,
    /// Block events in `kept` since the last swap.
    unpublished: usize,
}

impl IndexWriter {
    /// [`PrefixIndex::apply_batch`]: one engine's events, in order.
    pub fn apply_batch(&mut self, engine: usize, events: Vec<KvEvent>) {
        self.unpublished += events.iter().map(KvEvent::block_count).sum::<usize>();
        self.write(Write::Events { engine, events });
    }

    /// [`PrefixIndex::remove_engine`].
    pub fn remove_engine(&mut self, engine: usize) {
        self.write(Write::RemoveEngine(engine));
        self.publish();
    }

    /// [`PrefixIndex::forget_engine`].
    pub fn forget_engine(&mut self, engine: usize) {
        self.write(Write::ForgetEngine(engine));
        self.publish();
    }

    /// [`PrefixIndex::expire`].
    pub fn expire(&mut self, now: Instant) {
        self.write(Write::Expire(now));
        self.publish();
    }

    fn write(&mut self, write: Write) {
        write.apply(&mut self.back);
        self.kept.push(write);
        if self.unpublished >= PUBLISH_EVERY {
            self.publish();
        }
    }

    /// Makes every write so far visible to lookups: the copies swap, and the writes are applied
    /// to the one lookups read until now, once the lookups still reading it are done.
    pub fn publish(&mut self) {
        if self.kept.is_empty() {
            return;
        }
        let fresh = Arc::new(std::mem::take(&mut self.back));
        let mut taken = std::mem::replace(&mut *self.shared.published.lock(), fresh);
        let mut back = loop {
            match Arc::try_unwrap(taken) {
                Ok(index) => break index,
                Err(still_read) => {
                    taken = still_read;
                    std::thread::yield_now();
                }
            }
        };
        for write in self.kept.drain(..) {
            write.apply(&mut back);
        }
        self.back = back;
        self.unpublished = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::super::tests::{removed, stored};
    use super::*;

    /// After each publish the published copy answers as a plain index given the same writes,
    /// and so does the other copy after the next one.
    #[test]
    fn answers_as_a_plain_index_once_published() {
        let now = Instant::now();
        let (shared, mut writer) = SharedIndex::new();
        let mut plain = PrefixIndex::default();
        let request: Vec<u64> = (0..40).collect();
        for step in 0..30u64 {
            let engine = (step % 4) as usize;
            let events =
                if step % 5 == 4 { vec![removed(&[step])] } else { vec![stored(&(0..step + 1).collect::<Vec<_>>())] };
            plain.apply_batch(engine, &events);
            writer.apply_batch(engine, events);
            writer.publish();
            assert_eq!(
                shared.read(|index| index.overlaps(&request, now)),
                plain.overlaps(&request, now),
                "step {step}"
            );
            assert_eq!(shared.read(|index| index.entries()), plain.entries(), "step {step}");
        }
        writer.remove_engine(1);
        plain.remove_engine(1);
        assert_eq!(shared.read(|index| index.overlaps(&request, now)), plain.overlaps(&request, now));
        writer.forget_engine(2);
        plain.forget_engine(2);
        writer.expire(now);
        plain.expire(now);
        assert_eq!(shared.read(|index| index.overlaps(&request, now)), plain.overlaps(&request, now));
        assert_eq!(shared.read(|index| index.entries()), plain.entries());
        // The writer's own copy caught up too.
        assert_eq!(writer.back.overlaps(&request, now), plain.overlaps(&request, now));
    }

    /// Writes stay out of sight until published: by the writer, or by itself after
    /// `PUBLISH_EVERY` block events.
    #[test]
    fn writes_show_once_published() {
        let now = Instant::now();
        let (shared, mut writer) = SharedIndex::new();
        writer.apply_batch(0, vec![stored(&(0..10).collect::<Vec<_>>())]);
        assert!(shared.read(|index| index.overlaps(&[0, 1], now).is_empty()));
        writer.publish();
        assert_eq!(shared.read(|index| index.overlaps(&[0, 1], now))[&0], 2);
        writer.apply_batch(1, vec![stored(&(0..PUBLISH_EVERY as u64).collect::<Vec<_>>())]);
        assert_eq!(shared.read(|index| index.overlaps(&[0, 1], now))[&1], 2, "published by itself");
    }

    /// A lookup running alongside the writer sees whole batches, in order: each round stores
    /// one more block of the prefix for engines 0, 1 and 2, in that order, so an engine never
    /// matches more than the one before it, nor one more than the one after it, and no
    /// engine's length goes back; the writer publishes by itself while lookups are reading.
    #[test]
    fn lookups_alongside_the_writer_see_whole_batches_in_order() {
        const BLOCKS: u64 = 20_000;
        let now = Instant::now();
        let (shared, mut writer) = SharedIndex::new();
        let request: Vec<u64> = (0..BLOCKS).collect();
        let done = AtomicBool::new(false);
        let (last, lookups) = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (mut last, mut lookups, mut out) = ([0; 3], 0u64, Vec::new());
                while !done.load(Ordering::Relaxed) || lookups == 0 {
                    shared.read(|index| index.prefix_matches(&request, now, &mut out));
                    let mut lengths = [0; 3];
                    for &(engine, n) in &out {
                        lengths[engine] = n;
                    }
                    assert!(lengths[0] >= lengths[1] && lengths[1] >= lengths[2], "out of order: {lengths:?}");
                    assert!(lengths[0] <= lengths[2] + 1, "a round seen in part twice: {lengths:?}");
                    assert!(lengths.iter().zip(&last).all(|(n, l)| n >= l), "went back: {last:?} to {lengths:?}");
                    last = lengths;
                    lookups += 1;
                }
                (last, lookups)
            });
            for block in 0..BLOCKS {
                for engine in 0..3 {
                    writer.apply_batch(engine, vec![stored(&[block])]);
                }
            }
            writer.publish();
            done.store(true, Ordering::Relaxed);
            reader.join().expect("the reader's checks hold")
        });
        assert!(lookups > 0 && last.iter().all(|&n| n <= BLOCKS as usize));
        let overlaps = shared.read(|index| index.overlaps(&request, now));
        assert_eq!((overlaps.len(), overlaps[&0], overlaps[&2]), (3, BLOCKS as usize, BLOCKS as usize));
    }
}
