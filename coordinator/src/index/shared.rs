//! A [`PrefixIndex`] that lookups read while another thread writes to it, without ever waiting
//! for the writer: two copies, lookups read the front one, a write goes to the back one, the two
//! swap, and the write is repeated on the old front once the lookups still reading it are done.
//!
//! Lookups cost what they cost on a plain index (and an atomic load); a write costs twice its
//! work, and the index twice its memory. A writer waits for lookups that started on a copy
//! before it swapped (one lookup's time); lookups never wait for a write.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Mutex, RwLock};

use super::PrefixIndex;

/// Failed attempts at the front copy before a lookup waits for it instead (a writer that swaps
/// again and again between a lookup's two atomic reads; bounded by one write's time).
const TRIES_BEFORE_WAITING: usize = 64;

/// Attempts at the old front's write lock before the writer parks on it.
const SPINS_BEFORE_PARKING: usize = 4096;

#[derive(Debug, Default)]
pub struct SharedIndex {
    copies: [RwLock<PrefixIndex>; 2],
    /// The copy lookups read (0 or 1).
    front: AtomicUsize,
    /// One writer at a time: the copies must see the same writes in the same order.
    writer: Mutex<()>,
}

impl SharedIndex {
    /// Runs `lookup` on the current state. It never waits for a write in progress: a write is
    /// made to the copy lookups are not reading.
    pub fn read<R>(&self, lookup: impl FnOnce(&PrefixIndex) -> R) -> R {
        for _ in 0..TRIES_BEFORE_WAITING {
            let front = self.front.load(Ordering::Acquire);
            if let Some(copy) = self.copies[front].try_read() {
                return lookup(&copy);
            }
            std::hint::spin_loop();
        }
        lookup(&self.copies[self.front.load(Ordering::Acquire)].read())
    }

    /// Applies `write` to the index: to the back copy, which then becomes the front, and again
    /// to the other. `write` must do the same to both: a function of its arguments and the
    /// index alone (every [`PrefixIndex`] method is, given the same `Instant`s).
    pub fn update(&self, write: impl Fn(&mut PrefixIndex)) {
        let _writer = self.writer.lock();
        let front = self.front.load(Ordering::Acquire);
        let back = 1 - front;
        write(&mut self.copies[back].write());
        self.front.store(back, Ordering::Release);
        // Waits for lookups that read the old front before the swap: one lookup's time, less
        // than a parked thread's wake-up, so it spins first.
        for _ in 0..SPINS_BEFORE_PARKING {
            if let Some(mut copy) = self.copies[front].try_write() {
                return write(&mut copy);
            }
            std::hint::spin_loop();
        }
        write(&mut self.copies[front].write());
    }

    /// Heap bytes of both copies.
    pub fn heap_bytes(&self) -> usize {
        self.copies.iter().map(|copy| copy.read().heap_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::time::{Duration, Instant};

    use pd_protocols::kv_events::{BlockHash, KvEvent};

    use super::*;

    fn stored(hashes: impl IntoIterator<Item = u64>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.into_iter().map(BlockHash::Int).collect(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            medium: None,
            lora_name: None,
            cache_salt: None,
        }
    }

    /// Both copies go through the same writes: whichever is the front answers as a plain index.
    #[test]
    fn answers_as_a_plain_index_after_every_write() {
        let now = Instant::now();
        let shared = SharedIndex::default();
        let mut plain = PrefixIndex::default();
        let request: Vec<u64> = (0..40).collect();
        for step in 0..30u64 {
            let engine = (step % 4) as usize;
            let event = if step % 5 == 4 {
                KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(step)], medium: None }
            } else {
                stored(0..step + 1)
            };
            shared.update(|index| index.apply(engine, &event));
            plain.apply(engine, &event);
            if step == 20 {
                let until = now + Duration::from_secs(1);
                shared.update(|index| index.insert_approximate(9, &request[..7], until));
                plain.insert_approximate(9, &request[..7], until);
            }
            assert_eq!(
                shared.read(|index| index.overlaps(&request, now)),
                plain.overlaps(&request, now),
                "step {step}"
            );
        }
        shared.update(|index| index.remove_engine(1));
        plain.remove_engine(1);
        assert_eq!(shared.read(|index| index.overlaps(&request, now)), plain.overlaps(&request, now));
        assert_eq!(shared.read(|index| index.entries()), plain.entries());
        assert_eq!(shared.heap_bytes(), 2 * plain.heap_bytes(), "two copies, grown alike");
    }

    /// A lookup running alongside a writer sees whole writes only: every write stores one more
    /// block of the prefix for every engine, so all engines always match the same length, and
    /// that length never goes back.
    #[test]
    fn lookups_alongside_a_writer_see_whole_writes() {
        const BLOCKS: u64 = 3000;
        let now = Instant::now();
        let shared = SharedIndex::default();
        let request: Vec<u64> = (0..BLOCKS).collect();
        let done = AtomicBool::new(false);
        let lookups = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (mut last, mut lookups, mut out) = (0, 0u64, Vec::new());
                while !done.load(Ordering::Relaxed) || lookups == 0 {
                    shared.read(|index| index.prefix_matches(&request, now, &mut out));
                    let lengths: Vec<usize> = out.iter().map(|&(_, n)| n).collect();
                    let length = lengths.first().copied().unwrap_or(0);
                    assert!(lengths.iter().all(|&n| n == length), "a write seen in part: {out:?}");
                    assert!(out.is_empty() || out.len() == 3, "engines missing: {out:?}");
                    assert!(length >= last, "went back from {last} to {length}");
                    last = length;
                    lookups += 1;
                }
                (last, lookups)
            });
            for block in 0..BLOCKS {
                shared.update(|index| {
                    for engine in 0..3 {
                        index.apply(engine, &stored([block]));
                    }
                });
            }
            done.store(true, Ordering::Relaxed);
            reader.join().expect("the reader's checks hold")
        });
        assert!(lookups.1 > 0);
        assert!(lookups.0 <= BLOCKS as usize);
        assert_eq!(shared.read(|index| index.overlaps(&request, now).len()), 3);
        assert_eq!(shared.read(|index| index.overlaps(&request, now)[&0]), BLOCKS as usize);
    }
}
