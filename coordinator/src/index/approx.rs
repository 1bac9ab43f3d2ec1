//! Approximate entries: per block, which engines probably hold it and until when.
//!
//! One slot per block: `[hash, meta, entry, entry]`, 32 bytes, whatever the number of engines.
//! An entry is a deadline and an engine in one word; a slot's entries are kept sorted by
//! deadline, so a read skips those that expired since the last `expire` (usually none). Most
//! guessed blocks have one or two entries (the decode engine and the prefill one of a
//! decision); more spill to a vector of their own. Engine resets are handled as for exact
//! entries: the slot's stamp in the meta word says which resets it has seen.

use super::due::Deadlines;
use super::table::Slots;
use super::{Resets, BITS, STAMP};

const OCCUPIED: u64 = 1 << 63;
const SPILLED: u64 = 1 << 62;
/// Where a spilled slot's entries are in `Approx::spill` (meta bits 32..62).
const SPILL_SHIFT: u32 = 32;
const SPILL_MASK: u64 = (1 << 30) - 1;

/// An entry: the deadline (biased so that entries sort by it) above the engine's number + 1.
fn entry(local: u32, deadline: i32) -> u64 {
    u64::from(deadline as u32 ^ 0x8000_0000) << 32 | u64::from(local + 1)
}

pub(super) fn engine(entry: u64) -> u32 {
    (entry as u32) - 1
}

pub(super) fn deadline(entry: u64) -> i32 {
    ((entry >> 32) as u32 ^ 0x8000_0000) as i32
}

/// Slots are `[hash, meta, entry, entry]`: 32 bytes, two to a cache line.
const STRIDE: usize = 4;
/// Entries that fit in a slot; more spill.
const INLINE: usize = STRIDE - BITS;

/// The entries of slot `j` of `slots`, by deadline.
#[inline]
fn entries_of<'a>(slots: &'a Slots, spill: &'a [Vec<u64>], j: usize) -> &'a [u64] {
    let s = slots.slot(j);
    if s[1] & SPILLED != 0 {
        &spill[((s[1] >> SPILL_SHIFT) & SPILL_MASK) as usize]
    } else {
        let inline = &s[BITS..];
        &inline[..inline.iter().position(|&e| e == 0).unwrap_or(INLINE)]
    }
}

/// Whether engine `local` is in bitset `bits` (missing words are zeros).
#[inline]
fn has_bit(bits: &[u64], local: u32) -> bool {
    bits.get(local as usize / 64).is_some_and(|w| w & 1 << (local % 64) != 0)
}

/// Approximate entries by block.
#[derive(Debug)]
pub(super) struct Approx {
    slots: Slots,
    spill: Vec<Vec<u64>>,
    free: Vec<u32>,
    /// Blocks by the deadlines set on them, so that `expire` visits what expired instead of
    /// every slot.
    due: Deadlines,
}

impl Default for Approx {
    fn default() -> Self {
        Approx {
            // Sparse: inserts (a decision's guesses for blocks new to the table) walk to the
            // first empty slot.
            slots: Slots::sparse(STRIDE),
            spill: Vec::new(),
            free: Vec::new(),
            due: Deadlines::default(),
        }
    }
}

impl Approx {
    /// Blocks with approximate entries.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Each block's slot and hash.
    pub fn occupied_slots(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.slots.occupied_slots().map(|j| (j, self.slots.slot(j)[0]))
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.heap_bytes()
            + self.spill.capacity() * std::mem::size_of::<Vec<u64>>()
            + self.spill.iter().map(|v| v.capacity() * 8).sum::<usize>()
            + self.free.capacity() * 4
            + self.due.heap_bytes()
    }

    /// See [`Slots::home`] and [`Slots::touch_at`]; `cap` tells when homes computed before are
    /// stale (the table grew).
    #[inline]
    pub fn home(&self, hash: u64) -> usize {
        self.slots.home(hash)
    }

    #[inline]
    pub fn touch_at(&self, home: usize) -> u64 {
        self.slots.touch_at(home)
    }

    #[inline]
    pub fn cap(&self) -> usize {
        self.slots.cap()
    }

    /// Whether slot `j` (found earlier, perhaps stale since) is block `hash`'s.
    #[inline]
    pub fn holds_at(&self, j: usize, hash: u64) -> bool {
        self.slots.holds_at(j, hash)
    }

    /// Slot `j`, known to be block `hash`'s (see [`Approx::holds_at`]), cleaned.
    pub fn slot_at(&mut self, j: usize, resets: &Resets) -> usize {
        self.clean(j, resets);
        j
    }

    /// Where block `hash`'s entries are.
    #[inline]
    pub fn find(&self, hash: u64) -> Option<usize> {
        self.slots.find(hash)
    }

    /// [`Approx::find`] from `home` (`self.home(hash)` at the current capacity).
    #[inline]
    pub fn find_from(&self, home: usize, hash: u64) -> Option<usize> {
        self.slots.find_from(home, hash)
    }

    /// The entries of slot `j`, by deadline.
    #[inline]
    fn entries(&self, j: usize) -> &[u64] {
        entries_of(&self.slots, &self.spill, j)
    }

    fn has(&self, j: usize, local: u32) -> bool {
        self.entries(j).iter().any(|&e| engine(e) == local)
    }

    /// Adds to `out` (a bitset wide enough for every engine) the engines of slot `j` whose
    /// entries are live at `now`.
    #[inline]
    pub fn live(&self, j: usize, now: i32, resets: &Resets, out: &mut [u64]) {
        let stale = resets.stale((self.slots.slot(j)[1] & STAMP) as u32).unwrap_or_default();
        // By deadline: the expired ones (usually none) come first.
        for &e in self.entries(j).iter().skip_while(|&&e| deadline(e) <= now) {
            let local = engine(e);
            if !has_bit(stale, local) {
                out[local as usize / 64] |= 1 << (local % 64);
            }
        }
    }

    /// Drops the entries of engines reset since slot `j` was stamped, and stamps it current.
    fn clean(&mut self, j: usize, resets: &Resets) {
        let meta = &mut self.slots.slot_mut(j)[1];
        let Some(stale) = resets.stale((*meta & STAMP) as u32) else { return };
        *meta = (*meta & !STAMP) | u64::from(resets.seq);
        if self.entries(j).iter().any(|&e| has_bit(stale, engine(e))) {
            self.retain_entries(j, |e| !has_bit(stale, engine(e)));
        }
    }

    /// Keeps the entries of slot `j` that `keep` wants, preserving order; re-inlines a spilled
    /// list that fits again. The deadline lists learn of every entry that leaves.
    fn retain_entries(&mut self, j: usize, mut keep: impl FnMut(u64) -> bool) {
        let due = &mut self.due;
        let mut keep = |e: u64| {
            let kept = keep(e);
            if !kept {
                due.unlist(deadline(e));
            }
            kept
        };
        let s = self.slots.slot_mut(j);
        if s[1] & SPILLED == 0 {
            let area = &mut s[BITS..];
            let mut n = 0;
            for k in 0..area.len() {
                let e = area[k];
                if e != 0 && keep(e) {
                    area[n] = e;
                    n += 1;
                }
            }
            area[n..].fill(0);
            return;
        }
        let at = ((s[1] >> SPILL_SHIFT) & SPILL_MASK) as usize;
        let list = &mut self.spill[at];
        list.retain(|&e| keep(e));
        if list.len() <= INLINE {
            let list = std::mem::take(list);
            self.free.push(at as u32);
            let s = self.slots.slot_mut(j);
            s[1] &= !(SPILLED | SPILL_MASK << SPILL_SHIFT);
            let area = &mut s[BITS..];
            area.fill(0);
            area[..list.len()].copy_from_slice(&list);
        }
    }

    /// Adds an entry to slot `j` in deadline order (spilling when the slot is full).
    fn insert_entry(&mut self, j: usize, e: u64) {
        let s = self.slots.slot_mut(j);
        if s[1] & SPILLED != 0 {
            let list = &mut self.spill[((s[1] >> SPILL_SHIFT) & SPILL_MASK) as usize];
            let at = list.partition_point(|&x| x < e);
            list.insert(at, e);
            return;
        }
        let area = &mut s[BITS..];
        let n = area.iter().position(|&x| x == 0).unwrap_or(INLINE);
        if n < INLINE {
            let at = area[..n].partition_point(|&x| x < e);
            area.copy_within(at..n, at + 1);
            area[at] = e;
            return;
        }
        let mut list = Vec::with_capacity(INLINE * 2);
        list.extend_from_slice(area);
        let at = list.partition_point(|&x| x < e);
        list.insert(at, e);
        area.fill(0);
        let index = match self.free.pop() {
            Some(free) => {
                self.spill[free as usize] = list;
                free as u64
            }
            None => {
                self.spill.push(list);
                (self.spill.len() - 1) as u64
            }
        };
        assert!(index <= SPILL_MASK, "too many spilled approximate blocks");
        s[1] |= SPILLED | index << SPILL_SHIFT;
    }

    /// The slot of block `hash`, cleaned, created empty when there is none, in one walk from
    /// `home` (`self.home(hash)` at the current capacity). The position stays valid until a
    /// slot is added or removed.
    pub fn slot_for(&mut self, home: usize, hash: u64, resets: &Resets) -> usize {
        let (j, new) = self.slots.find_or_insert_from(home, hash, OCCUPIED | u64::from(resets.seq));
        if !new {
            self.clean(j, resets);
        }
        j
    }

    /// Sets `local`'s deadline in (cleaned) slot `j`; true when the engine had no live entry.
    pub fn set(&mut self, j: usize, local: u32, at: i32) -> bool {
        let had = self.has(j, local);
        if had {
            self.retain_entries(j, |e| engine(e) != local);
        }
        self.insert_entry(j, entry(local, at));
        self.due.add(at, self.slots.slot(j)[0]);
        !had
    }

    /// Forgets the deadline lists (no entries are left).
    pub fn clear_due(&mut self) {
        self.due.clear();
    }

    /// Removes `local`'s entry for `hash`: whether it had a live one, and whether the block has
    /// entries left.
    pub fn remove(&mut self, hash: u64, local: u32, resets: &Resets) -> (bool, bool) {
        match self.slots.find(hash) {
            Some(j) => self.remove_at(j, local, resets),
            None => (false, false),
        }
    }

    /// [`Approx::remove`] from slot `j`, found for the block just before.
    pub fn remove_at(&mut self, j: usize, local: u32, resets: &Resets) -> (bool, bool) {
        self.clean(j, resets);
        let had = self.has(j, local);
        if had {
            self.retain_entries(j, |e| engine(e) != local);
        }
        let left = !self.entries(j).is_empty();
        if !left {
            self.free_slot(j);
        }
        (had, left)
    }

    fn free_slot(&mut self, j: usize) {
        let meta = self.slots.slot(j)[1];
        if meta & SPILLED != 0 {
            let at = (meta >> SPILL_SHIFT) & SPILL_MASK;
            self.spill[at as usize] = Vec::new();
            self.free.push(at as u32);
        }
        self.slots.remove_at(j);
    }

    /// Drops the entries whose deadline is at or before `now` (calling `expired` with each of
    /// those) and stale ones on the blocks visited; then moves every deadline `shift` earlier
    /// (the clock's origin moved up); calls `gone` with each block left without entries.
    /// Visits only the blocks listed under expired deadlines, unless most of those lists are
    /// obsolete (events confirmed the entries long ago): then one pass over the slots, which
    /// also lists the survivors afresh.
    pub fn expire(
        &mut self,
        now: i32,
        shift: i32,
        resets: &Resets,
        mut expired: impl FnMut(u32),
        mut gone: impl FnMut(u64),
    ) {
        if shift != 0 || self.due.len() > 2 * self.slots.len() + 1024 {
            self.expire_all(now, shift, resets, &mut expired, &mut gone);
            return;
        }
        while let Some(hashes) = self.due.pop_due(now) {
            for hash in hashes {
                let Some(j) = self.slots.find(hash) else { continue };
                self.expire_slot(j, now, resets, &mut expired);
                if self.entries(j).is_empty() {
                    gone(hash);
                    self.free_slot(j);
                }
            }
        }
        self.slots.shrink();
        if self.free.len() == self.spill.len() {
            self.spill.clear();
            self.free.clear();
        }
    }

    /// Cleans slot `j` and drops its entries expired by `now`.
    fn expire_slot(&mut self, j: usize, now: i32, resets: &Resets, expired: &mut impl FnMut(u32)) {
        self.clean(j, resets);
        if self.entries(j).first().is_none_or(|&e| deadline(e) > now) {
            return;
        }
        self.retain_entries(j, |e| {
            let live = deadline(e) > now;
            if !live {
                expired(engine(e));
            }
            live
        });
    }

    /// [`Approx::expire`] as one pass over every slot; the deadline lists are rebuilt from
    /// the entries left.
    fn expire_all(
        &mut self,
        now: i32,
        shift: i32,
        resets: &Resets,
        expired: &mut impl FnMut(u32),
        gone: &mut impl FnMut(u64),
    ) {
        // Entries leaving in this pass are unlisted from the cleared lists (nothing); the new
        // lists only count what is left.
        self.clear_due();
        let mut fresh = Deadlines::default();
        for j in 0..self.slots.cap() {
            if !self.slots.occupied(j) {
                continue;
            }
            self.expire_slot(j, now, resets, expired);
            let s = self.slots.slot_mut(j);
            if shift != 0 {
                let rebased = |e: u64| entry(engine(e), deadline(e).saturating_sub(shift));
                if s[1] & SPILLED != 0 {
                    let at = ((s[1] >> SPILL_SHIFT) & SPILL_MASK) as usize;
                    self.spill[at].iter_mut().for_each(|e| *e = rebased(*e));
                } else {
                    s[BITS..].iter_mut().filter(|e| **e != 0).for_each(|e| *e = rebased(*e));
                }
            }
            let hash = self.slots.slot(j)[0];
            let mut rest = entries_of(&self.slots, &self.spill, j);
            while let Some(&first) = rest.first() {
                let same = rest.iter().take_while(|&&e| deadline(e) == deadline(first)).count();
                fresh.list(deadline(first), hash, same);
                rest = &rest[same..];
            }
        }
        self.due = fresh;
        self.drop_empty(gone);
    }

    /// Drops what resets left behind; calls `gone` with each block left without entries.
    pub fn sweep(&mut self, resets: &Resets, mut gone: impl FnMut(u64)) {
        for j in 0..self.slots.cap() {
            if self.slots.occupied(j) {
                self.clean(j, resets);
            }
        }
        self.drop_empty(&mut gone);
    }

    fn drop_empty(&mut self, gone: &mut impl FnMut(u64)) {
        self.slots.retain(|s| {
            // Spilled lists are never empty (they re-inline first).
            let empty = s[1] & SPILLED == 0 && s[BITS] == 0;
            if empty {
                gone(s[0]);
            }
            !empty
        });
        self.slots.shrink();
        if self.free.len() == self.spill.len() {
            self.spill.clear();
            self.free.clear();
        }
    }
}
