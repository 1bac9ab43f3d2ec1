//! Open addressing for the prefix index: fixed-stride slots of `u64` words in one flat allocation
//! whose slots start on cache-line boundaries; linear probing from a keyed mix of the slot's key;
//! backward-shift deletion, so there are no tombstones and every probe ends at the first empty
//! slot.
//!
//! Word 0 of a slot is its key, word 1 its meta word, set when the slot is taken; the other
//! words are the owner's.
//!
//! Beside the slots, one tag byte per slot (0 when empty, else 7 bits of the key's mix), the
//! one record of which slots are taken: a probe walks the tags, a few bytes in one cache line, and reads a slot only where the tag
//! matches. A key that is absent (most of a decision's new blocks) then costs a read of the
//! small tag array, which stays in the CPU's cache, instead of slot lines from memory.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use super::pages::{advise_huge, prefetch};

/// A dense table doubles once more than 4/5 of its slots are taken (40-80 % full), and shrinks
/// (to half full) below a quarter. Growing by half would save memory, but its longer probe runs
/// slow the stores (which walk to the first empty slot) and the removals (whose backward shift
/// reads the rest of the run) more than that is worth (BENCH.md, "A block table that doubles").
const DENSE: Load = Load { max: (4, 5), grow: (2, 1), shrink_below: 4 };
/// A sparse one grows by half past half full (33-50 % full), and shrinks (to a third full)
/// below a sixth: probes that miss (new keys) walk about 2 slots instead of 5-13.
const SPARSE: Load = Load { max: (1, 2), grow: (3, 2), shrink_below: 6 };
const MIN_CAP: usize = 16;

#[derive(Debug, Clone, Copy)]
struct Load {
    /// Most slots taken, as a fraction.
    max: (usize, usize),
    /// What the capacity is multiplied by when it grows, as a fraction.
    grow: (usize, usize),
    /// Shrinks when fewer than 1 / this are taken, to twice that share.
    shrink_below: usize,
}

#[derive(Debug)]
pub(super) struct Slots {
    words: Vec<u64>,
    /// One per slot: 0 empty, else [`Slots::tag`] of its key.
    tags: Vec<u8>,
    /// Where slot 0 starts in `words` (so that slots are aligned to 64 bytes).
    base: usize,
    stride: usize,
    cap: usize,
    len: usize,
    load: Load,
    /// Keys are hashes already, but not always good ones (tests use 0, 1, 2...), and a client
    /// that can choose prompts could grind block hashes into one probe run: mix with a secret
    /// (drawn when the table first gets slots, so that an empty table costs nothing).
    seed: u64,
    /// This table's number and the keys added to it so far (see [`Slots::stamp`]).
    stamp: (u64, u64),
}

/// Tables made so far, to number them.
static TABLES: AtomicU64 = AtomicU64::new(0);

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Slots {
    /// An empty table of `stride`-word slots (`stride` a power of two, at least 2).
    pub fn new(stride: usize) -> Self {
        debug_assert!(stride.is_power_of_two() && stride >= 2);
        let stamp = (TABLES.fetch_add(1, Ordering::Relaxed), 0);
        Slots { words: Vec::new(), tags: Vec::new(), base: 0, stride, cap: 0, len: 0, load: DENSE, seed: 0, stamp }
    }

    /// [`Slots::new`], kept at most half full: for a table whose size matters less than its
    /// inserts (they walk to the first empty slot).
    pub fn sparse(stride: usize) -> Self {
        Slots { load: SPARSE, ..Slots::new(stride) }
    }

    #[inline]
    fn fits(&self, len: usize, cap: usize) -> bool {
        len * self.load.max.1 <= cap * self.load.max.0
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    pub fn stride(&self) -> usize {
        self.stride
    }

    /// A value that differs from every earlier one of this table, and from any other table's,
    /// once a key has been added: a key not found before is still absent while it is unchanged.
    pub fn stamp(&self) -> (u64, u64) {
        self.stamp
    }

    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * std::mem::size_of::<u64>() + self.tags.capacity()
    }

    /// Where `key`'s probe starts: the high bits of its mix, scaled to the capacity.
    #[inline]
    pub fn home(&self, key: u64) -> usize {
        ((u128::from(mix(key ^ self.seed)) * self.cap as u128) >> 64) as usize
    }

    /// `key`'s tag: the low 7 bits of its mix (independent of its home), and the top bit so
    /// that it is never 0.
    #[inline]
    fn tag(&self, key: u64) -> u8 {
        (mix(key ^ self.seed) as u8 & 0x7f) | 0x80
    }

    /// [`Slots::home`] and [`Slots::tag`] of `key`, from one mix.
    #[inline]
    pub fn home_and_tag(&self, key: u64) -> (usize, u8) {
        let mixed = mix(key ^ self.seed);
        (((u128::from(mixed) * self.cap as u128) >> 64) as usize, (mixed as u8 & 0x7f) | 0x80)
    }

    #[inline]
    pub fn next(&self, i: usize) -> usize {
        if i + 1 == self.cap {
            0
        } else {
            i + 1
        }
    }

    #[inline]
    pub fn slot(&self, i: usize) -> &[u64] {
        let at = self.base + i * self.stride;
        &self.words[at..at + self.stride]
    }

    #[inline]
    pub fn slot_mut(&mut self, i: usize) -> &mut [u64] {
        let at = self.base + i * self.stride;
        &mut self.words[at..at + self.stride]
    }

    /// Whether slot `i` holds a key.
    #[inline]
    pub fn occupied(&self, i: usize) -> bool {
        self.tags[i] != 0
    }

    #[inline]
    fn key(&self, i: usize) -> u64 {
        self.words[self.base + i * self.stride]
    }

    /// The positions of the occupied slots.
    pub fn occupied_slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.cap).filter(|&i| self.occupied(i))
    }

    /// The first slot holding `key`.
    #[inline]
    pub fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.find_from(self.home(key), key)
    }

    /// [`Slots::find`] from `home`, which must be `self.home(key)` for the current capacity
    /// (a caller that computed a batch of homes first passes them here).
    #[inline]
    pub fn find_from(&self, home: usize, key: u64) -> Option<usize> {
        self.find_tagged(home, self.tag(key), key)
    }

    /// [`Slots::find_from`] with `key`'s tag given too ([`Slots::home_and_tag`]).
    #[inline]
    pub fn find_tagged(&self, home: usize, tag: u8, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = home;
        loop {
            match self.tags[i] {
                0 => return None,
                t if t == tag && self.key(i) == key => return Some(i),
                _ => i = self.next(i),
            }
        }
    }

    /// Where a walk from `home` for a key tagged `tag` first compares a key: the first slot with
    /// that tag before an empty one, or `None` when the key is absent. It reads tags only, so a
    /// batch of probes learns which slot lines to load (and which blocks are absent) without
    /// loading any.
    #[inline]
    pub fn first_tagged(&self, home: usize, tag: u8) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = home;
        loop {
            match self.tags[i] {
                0 => return None,
                t if t == tag => return Some(i),
                _ => i = self.next(i),
            }
        }
    }

    /// Reads the first word of slot `i` (a home computed before), so that a batch of probes
    /// issued this way overlaps its cache misses (the caller passes the result to
    /// `std::hint::black_box`). A loop doing only this over
    /// homes computed beforehand keeps dozens of loads in flight at once, where one that also
    /// computes the homes (a few multiplications each) fits fewer in the CPU's window.
    #[inline]
    pub fn touch_at(&self, i: usize) -> u64 {
        let tag = self.tags.get(i).copied().unwrap_or(0);
        u64::from(tag) ^ self.words.get(self.base + i * self.stride).copied().unwrap_or(0)
    }

    /// Starts loading slot `i`'s tag and its slot's first line (a home computed before) without
    /// waiting for them (see [`prefetch`]).
    #[inline]
    pub fn prefetch_at(&self, i: usize) {
        if let (Some(tag), Some(word)) = (self.tags.get(i), self.words.get(self.base + i * self.stride)) {
            prefetch(tag);
            prefetch(word);
        }
    }

    /// [`Slots::prefetch_at`] of slot `i`, and each later cache line holding any of the
    /// `slots - 1` slots after it (none past the last slot: a run that wraps round to slot 0 is
    /// requested up to the table's end only).
    #[inline]
    pub fn prefetch_run_at(&self, i: usize, slots: usize) {
        self.prefetch_at(i);
        let per_line = (8 / self.stride).max(1);
        let mut k = per_line - i % per_line;
        while k < slots {
            if let Some(word) = self.words.get(self.base + (i + k) * self.stride) {
                prefetch(word);
            }
            k += per_line;
        }
    }

    /// [`Slots::touch_at`] of the tag only: enough for a key that is probably absent.
    #[inline]
    pub fn touch_tag_at(&self, i: usize) -> u64 {
        u64::from(self.tags.get(i).copied().unwrap_or(0))
    }

    /// Whether slot `i` (a position found earlier, perhaps stale since) holds `key`.
    #[inline]
    pub fn holds_at(&self, i: usize, key: u64) -> bool {
        i < self.cap && self.key(i) == key && self.occupied(i)
    }

    /// The slot holding `key` from `home` (as [`Slots::find_from`]), or a new one taken for it
    /// (as [`Slots::insert`]) in the same walk; true when it is new.
    pub fn find_or_insert_from(&mut self, home: usize, key: u64, meta: u64) -> (usize, bool) {
        if self.cap > 0 {
            let tag = self.tag(key);
            let mut i = home;
            loop {
                match self.tags[i] {
                    0 => break,
                    t if t == tag && self.key(i) == key => return (i, false),
                    _ => i = self.next(i),
                }
            }
            if self.fits(self.len + 1, self.cap) {
                self.tags[i] = tag;
                self.words[self.base + i * self.stride] = key;
                self.words[self.base + i * self.stride + 1] = meta;
                self.len += 1;
                self.stamp.1 += 1;
                return (i, true);
            }
        }
        (self.insert(key, meta), true)
    }

    /// Takes an empty slot for `key` (growing the table first when it is full enough), with
    /// `meta` in word 1 and zeros after; returns its position.
    pub fn insert(&mut self, key: u64, meta: u64) -> usize {
        if !self.fits(self.len + 1, self.cap) {
            let grown = (self.cap * self.load.grow.0 / self.load.grow.1).max(MIN_CAP);
            self.rebuild(self.stride, grown);
        }
        let mut i = self.home(key);
        while self.occupied(i) {
            i = self.next(i);
        }
        self.tags[i] = self.tag(key);
        let slot = self.slot_mut(i);
        slot[0] = key;
        slot[1] = meta;
        self.len += 1;
        self.stamp.1 += 1;
        i
    }

    /// Empties slot `i`, moving later slots of its probe run back so that no probe stops early.
    pub fn remove_at(&mut self, i: usize) {
        let mut hole = i;
        let mut j = self.next(i);
        while self.occupied(j) {
            let home = self.home(self.key(j));
            // Slot j may fill the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                let from = self.base + j * self.stride;
                self.words.copy_within(from..from + self.stride, self.base + hole * self.stride);
                self.tags[hole] = self.tags[j];
                hole = j;
            }
            j = self.next(j);
        }
        self.tags[hole] = 0;
        self.slot_mut(hole).fill(0);
        self.len -= 1;
    }

    /// Visits every occupied slot once; `keep` may change any word but the key and says whether
    /// the slot stays.
    pub fn retain(&mut self, mut keep: impl FnMut(&mut [u64]) -> bool) {
        if self.len == 0 {
            return;
        }
        // Start after an empty slot: no probe run crosses it, so slots moved back by a removal
        // always come from ahead of the cursor.
        let start = (0..self.cap).find(|&i| !self.occupied(i)).expect("the table is never full");
        let mut i = self.next(start);
        let mut visited = 1;
        while visited < self.cap {
            if self.occupied(i) && !keep(self.slot_mut(i)) {
                self.remove_at(i);
                continue; // a later slot may have moved into i
            }
            i = self.next(i);
            visited += 1;
        }
    }

    /// Moves every slot into a new table of `cap` slots of `stride` words (the first
    /// `min(old, new)` words are kept, the rest zeroed).
    pub fn rebuild(&mut self, stride: usize, cap: usize) {
        debug_assert!(stride.is_power_of_two() && stride >= 2);
        let cap = cap.max(MIN_CAP);
        if self.cap == 0 && self.seed == 0 {
            self.seed = RandomState::new().hash_one(0x5eed_u64);
        }
        assert!(self.fits(self.len, cap), "rebuild to {cap} slots cannot hold {}", self.len);
        // One spare line: slot 0 moves up to the first 64-byte boundary.
        let mut words = vec![0u64; cap * stride + 8];
        let base = (8 - (words.as_ptr() as usize / 8) % 8) % 8;
        let mut new_tags = vec![0u8; cap];
        // Before any is written (a big zeroed allocation is fresh, untouched memory).
        advise_huge(&mut words);
        advise_huge(&mut new_tags);
        std::mem::swap(&mut self.words, &mut words);
        let tags = std::mem::replace(&mut self.tags, new_tags);
        let (old_base, old_stride) = (self.base, self.stride);
        (self.base, self.stride, self.cap) = (base, stride, cap);
        let keep = old_stride.min(stride);
        for (i, &tag) in tags.iter().enumerate().filter(|&(_, &tag)| tag != 0) {
            let from = old_base + i * old_stride;
            let mut j = self.home(words[from]);
            while self.occupied(j) {
                j = self.next(j);
            }
            self.tags[j] = tag; // same key, same seed
            self.slot_mut(j)[..keep].copy_from_slice(&words[from..from + keep]);
        }
    }

    /// Gives memory back after many removals.
    pub fn shrink(&mut self) {
        if self.cap > MIN_CAP && self.len * self.load.shrink_below < self.cap {
            self.rebuild(self.stride, self.len * self.load.shrink_below / 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Insert (both ways), remove and retain against a HashMap, with keys that crowd a few
    /// probe runs, in a dense and a sparse table.
    #[test]
    fn behaves_like_a_map() {
        behaves_like_a_map_with(Slots::new(4));
        behaves_like_a_map_with(Slots::sparse(4));
    }

    fn behaves_like_a_map_with(mut slots: Slots) {
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 600;
            match x % 7 {
                0..=1 => {
                    let (i, new) = slots.find_or_insert_from(slots.home(key), key, 1);
                    assert_eq!(new, !model.contains_key(&key), "step {step}");
                    assert!(slots.holds_at(i, key));
                    slots.slot_mut(i)[2] = step;
                    model.insert(key, step);
                }
                2..=3 => {
                    if let Some(i) = slots.find(key) {
                        slots.slot_mut(i)[2] = step;
                    } else {
                        let i = slots.insert(key, 1);
                        slots.slot_mut(i)[2] = step;
                    }
                    model.insert(key, step);
                }
                4..=5 => {
                    if let Some(i) = slots.find(key) {
                        slots.remove_at(i);
                    }
                    model.remove(&key);
                }
                _ if step % 97 == 0 => {
                    slots.retain(|s| s[0] % 3 != 0);
                    model.retain(|k, _| k % 3 != 0);
                    slots.shrink();
                }
                _ => {}
            }
            assert_eq!(slots.len(), model.len());
            assert!(slots.fits(slots.len(), slots.cap()), "step {step}: over its load");
            for probe in [key, key + 1, key * 7 % 600] {
                assert_eq!(slots.find(probe).map(|i| slots.slot(i)[2]), model.get(&probe).copied(), "step {step}");
            }
        }
        // Prefetches are hints: at every slot, past the last one and into an empty table, they
        // change nothing and never fail.
        Slots::new(4).prefetch_run_at(0, 4);
        for i in 0..=slots.cap() + 1 {
            slots.prefetch_run_at(i, 4);
        }
        slots.rebuild(8, slots.cap());
        for (k, v) in &model {
            assert_eq!(slots.slot(slots.find(*k).unwrap())[..3], [*k, 1, *v]);
        }
    }
}
