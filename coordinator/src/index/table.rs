//! Open addressing for the prefix index: fixed-stride slots of `u64` words in one flat allocation
//! whose slots start on cache-line boundaries; linear probing from a keyed mix of the slot's key;
//! backward-shift deletion, so there are no tombstones and every probe ends at the first empty
//! slot.
//!
//! Word 0 of a slot is its key, word 1 its meta word, which is 0 exactly when the slot is empty
//! (owners keep a flag bit set in occupied slots); the other words are the owner's.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

/// The table grows by half once more than 4/5 of its slots are taken.
const MAX_LOAD: (usize, usize) = (4, 5);
const MIN_CAP: usize = 16;

#[derive(Debug)]
pub(super) struct Slots {
    words: Vec<u64>,
    /// Where slot 0 starts in `words` (so that slots are aligned to 64 bytes).
    base: usize,
    stride: usize,
    cap: usize,
    len: usize,
    /// Keys are hashes already, but not always good ones (tests use 0, 1, 2...), and a client
    /// that can choose prompts could grind block hashes into one probe run: mix with a secret
    /// (drawn when the table first gets slots, so that an empty table costs nothing).
    seed: u64,
}

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
        Slots { words: Vec::new(), base: 0, stride, cap: 0, len: 0, seed: 0 }
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

    pub fn heap_bytes(&self) -> usize {
        self.words.capacity() * std::mem::size_of::<u64>()
    }

    #[inline]
    pub fn home(&self, key: u64) -> usize {
        ((u128::from(mix(key ^ self.seed)) * self.cap as u128) >> 64) as usize
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

    #[inline]
    fn occupied(&self, i: usize) -> bool {
        self.words[self.base + i * self.stride + 1] != 0
    }

    #[inline]
    fn key(&self, i: usize) -> u64 {
        self.words[self.base + i * self.stride]
    }

    /// The first slot holding `key`.
    #[inline]
    pub fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut i = self.home(key);
        loop {
            let at = self.base + i * self.stride;
            if self.words[at + 1] == 0 {
                return None;
            }
            if self.words[at] == key {
                return Some(i);
            }
            i = self.next(i);
        }
    }

    /// Reads the word a probe for `key` starts at, so that a batch of probes issued this way
    /// overlaps its cache misses; the caller passes the result to `std::hint::black_box`.
    #[inline]
    pub fn touch(&self, key: u64) -> u64 {
        if self.cap == 0 {
            return 0;
        }
        self.words[self.base + self.home(key) * self.stride]
    }

    /// Takes an empty slot for `key` (growing the table first when it is full enough), with
    /// `meta` (not 0) in word 1 and zeros after; returns its position.
    pub fn insert(&mut self, key: u64, meta: u64) -> usize {
        debug_assert_ne!(meta, 0, "meta 0 marks an empty slot");
        if (self.len + 1) * MAX_LOAD.1 > self.cap * MAX_LOAD.0 {
            let grown = (self.cap + self.cap / 2).max(MIN_CAP);
            self.rebuild(self.stride, grown);
        }
        let mut i = self.home(key);
        while self.occupied(i) {
            i = self.next(i);
        }
        let slot = self.slot_mut(i);
        slot[0] = key;
        slot[1] = meta;
        self.len += 1;
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
                hole = j;
            }
            j = self.next(j);
        }
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
        assert!(self.len * MAX_LOAD.1 <= cap * MAX_LOAD.0, "rebuild to {cap} slots cannot hold {}", self.len);
        // One spare line: slot 0 moves up to the first 64-byte boundary.
        let mut words = vec![0u64; cap * stride + 8];
        let base = (8 - (words.as_ptr() as usize / 8) % 8) % 8;
        std::mem::swap(&mut self.words, &mut words);
        let (old_base, old_stride, old_cap) = (self.base, self.stride, self.cap);
        (self.base, self.stride, self.cap) = (base, stride, cap);
        let keep = old_stride.min(stride);
        for i in 0..old_cap {
            let from = old_base + i * old_stride;
            if words[from + 1] == 0 {
                continue;
            }
            let mut j = self.home(words[from]);
            while self.occupied(j) {
                j = self.next(j);
            }
            self.slot_mut(j)[..keep].copy_from_slice(&words[from..from + keep]);
        }
    }

    /// Gives memory back after many removals.
    pub fn shrink(&mut self) {
        if self.cap > MIN_CAP && self.len * 4 < self.cap {
            self.rebuild(self.stride, self.len * 2);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// Insert, remove and retain against a HashMap, with keys that crowd a few probe runs.
    #[test]
    fn behaves_like_a_map() {
        let mut slots = Slots::new(4);
        let mut model: HashMap<u64, u64> = HashMap::new();
        let mut x = 0x1234_5678_u64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 600;
            match x % 7 {
                0..=3 => {
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
            for probe in [key, key + 1, key * 7 % 600] {
                assert_eq!(slots.find(probe).map(|i| slots.slot(i)[2]), model.get(&probe).copied(), "step {step}");
            }
        }
        slots.rebuild(8, slots.cap());
        for (k, v) in &model {
            assert_eq!(slots.slot(slots.find(*k).unwrap())[..3], [*k, 1, *v]);
        }
    }
}
