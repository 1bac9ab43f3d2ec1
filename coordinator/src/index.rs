//! Which engines hold which KV blocks, per model: fed by KV events (exact) or by routing
//! decisions (approximate, with a time to live), queried for the longest cached prefix of a
//! request on every engine.
//!
//! How it stays small and fast (figures in `coordinator/BENCH.md`):
//! - One open-addressing table keyed by block hash. A block's slot is its hash, a meta word and a
//!   bitset of the engines that hold it exactly; engines are numbered densely per index, so up to
//!   128 engines fit a 32-byte slot, whatever their global ids. A lookup walks the request's
//!   hashes a chunk at a time, probing the whole chunk before reading it so the cache misses
//!   overlap (unless the table is small enough to stay cached), and intersects bitsets: two
//!   words per block for 128 engines.
//! - Forgetting an engine (it died, restarted, cleared its cache, or its event stream had a gap)
//!   is O(1): it is logged as a reset, and its bit counts as stale in every slot stamped before
//!   the reset. Reads mask stale bits; a slot drops them when it is next written; `expire` (or
//!   too many pending resets) sweeps the rest out.
//! - Approximate entries live in a second table, one 32-byte slot per block with two entries
//!   inline (engine and deadline packed in a word; more engines spill to a vector), so exact
//!   entries carry no timestamp. A block with exact holders has its guesses flagged on
//!   its slot; a block only guessed has no block slot at all (a lookup that misses the block
//!   table asks the approximate one), so a decision's guesses for blocks nobody holds yet write
//!   one table, not two, and a lookup just before tells the insert which blocks are absent.
//! - A block's tiers on an engine (a copy may sit on GPU and CPU at once) are kept in a side map
//!   when they are not GPU alone, flagged too: the common case costs nothing.

mod approx;
mod due;
mod pages;
mod shared;
mod table;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::{Duration, Instant};

use pd_protocols::kv_events::{BlockHash, KvEvent};

use self::approx::Approx;
pub use self::shared::{IndexWriter, SharedIndex, PUBLISH_EVERY};
use self::table::Slots;
use crate::pairing::TierWeights;

/// Where a block lives on an engine, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Gpu,
    Cpu,
    /// Disk, or any other medium slower than host memory.
    Other,
}

impl Tier {
    /// From an event's `medium` (vLLM says "GPU" even on CPU builds; absent means GPU).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("GPU") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("CPU") => Tier::Cpu,
            Some(_) => Tier::Other,
        }
    }

    fn bit(self) -> u8 {
        match self {
            Tier::Gpu => 1,
            Tier::Cpu => 2,
            Tier::Other => 4,
        }
    }

    /// The fastest tier of a non-empty set.
    fn fastest(tiers: u8) -> Tier {
        if tiers & 1 != 0 {
            Tier::Gpu
        } else if tiers & 2 != 0 {
            Tier::Cpu
        } else {
            Tier::Other
        }
    }
}

/// The tier set of a block no side-map entry describes.
const GPU_ONLY: u8 = 1;

// A block's slot: [hash, meta, exact-holder bitset words..., padding].
const BITS: usize = 2;
const STAMP: u64 = 0xffff_ffff;
const OCCUPIED: u64 = 1 << 32;
const HAS_APPROX: u64 = 1 << 33;
const HAS_TIER: u64 = 1 << 34;

/// Resets pending before `remove_engine` sweeps by itself (each costs a few words per lookup
/// at most, and `expire` normally sweeps long before).
const MAX_PENDING_RESETS: usize = 64;
/// Tables this small are swept at once on a reset (cheaper than carrying the reset).
const EAGER_SWEEP_BELOW: usize = 4096;
/// Blocks probed ahead of reading them in a write (stores, guesses): their homes are computed,
/// then loaded, so that the cache misses overlap (sizes measured in BENCH.md).
const CHUNK: usize = 64;
/// The same in a lookup, which may stop early (32; the first chunk is shorter: a request whose
/// first block nobody holds costs a few probes only).
const LOOKUP_CHUNK: usize = 32;
const FIRST_CHUNK: usize = 8;
/// Slots [`PrefixIndex::apply_batch`] loads from a removed block's home: the block's own slot
/// (often past its home) and the slots after it that the backward shift reads. The best length
/// follows the table's load (BENCH.md, "A block table that doubles").
const REMOVAL_RUN: usize = 4;
/// Block tables smaller than this (about a core's L2 cache) stay cached, so there are no misses
/// to overlap: [`PrefixIndex::apply_batch`] loads nothing ahead for them, and lookups walk each
/// block once instead of loading a chunk's tags, then its slots, then walking.
const CACHED_TABLE_BYTES: usize = 2 << 20;
const NONE: usize = usize::MAX;
/// Deadlines are `i32` milliseconds from the clock origin; past this the origin moves up.
const REBASE_AFTER: Duration = Duration::from_secs(12 * 24 * 3600);
/// Engines one index numbers (bitsets grow with them).
const MAX_ENGINES: usize = 1 << 15;

fn stride_for(words: usize) -> usize {
    (BITS + words).next_power_of_two().max(4)
}

fn set_bit(bits: &mut Vec<u64>, local: u32) {
    let word = local as usize / 64;
    if bits.len() <= word {
        bits.resize(word + 1, 0);
    }
    bits[word] |= 1 << (local % 64);
}

/// Calls `f` with the position of every set bit.
fn each_bit(bits: &[u64], mut f: impl FnMut(u32)) {
    for (w, &word) in bits.iter().enumerate() {
        let mut rest = word;
        while rest != 0 {
            f(w as u32 * 64 + rest.trailing_zeros());
            rest &= rest - 1;
        }
    }
}

/// Hashes an engine id with one multiplication: every event looks its engine up, and the ids
/// are numbers the coordinator assigns, not keys a peer chooses, so SipHash's defence against
/// chosen keys would buy nothing for its cost on each one-block removal.
#[derive(Default)]
struct EngineIdHasher(u64);

impl Hasher for EngineIdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 ^ self.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Engines as the caller numbers them, and the dense numbers this index uses.
#[derive(Debug, Default)]
struct Engines {
    local: HashMap<usize, u32, BuildHasherDefault<EngineIdHasher>>,
    global: Vec<usize>,
    exact: Vec<usize>,
    approx: Vec<usize>,
    /// Dense numbers of forgotten engines, for the next new ones.
    free: Vec<u32>,
}

/// Engine resets since the last sweep.
#[derive(Debug, Default)]
struct Resets {
    /// Resets so far; a slot written now is stamped with it.
    seq: u32,
    /// `seq` at the last sweep: every slot's stamp is at least this.
    base: u32,
    /// `stale[k]`: the engines reset after stamp `base + k` (a bitset).
    stale: Vec<Vec<u64>>,
}

impl Resets {
    /// Engines whose bits are stale in a slot stamped `stamp`.
    #[inline]
    fn stale(&self, stamp: u32) -> Option<&[u64]> {
        if stamp == self.seq {
            None
        } else {
            Some(&self.stale[(stamp - self.base) as usize])
        }
    }

    fn push(&mut self, local: u32) {
        for bits in &mut self.stale {
            set_bit(bits, local);
        }
        let mut bits = Vec::new();
        set_bit(&mut bits, local);
        self.stale.push(bits);
        self.seq += 1;
    }
}

/// Drops the stale bits of a block's slot and stamps it current.
fn clean(slot: &mut [u64], words: usize, resets: &Resets, tiers: &mut HashMap<(u64, u32), u8>) {
    let stamp = (slot[1] & STAMP) as u32;
    let Some(stale) = resets.stale(stamp) else { return };
    let has_tier = slot[1] & HAS_TIER != 0;
    for (w, &mask) in stale.iter().enumerate().take(words) {
        let dropped = slot[BITS + w] & mask;
        slot[BITS + w] &= !mask;
        if has_tier && dropped != 0 {
            each_bit(&[dropped], |bit| {
                tiers.remove(&(slot[0], w as u32 * 64 + bit));
            });
        }
    }
    slot[1] = (slot[1] & !STAMP) | u64::from(resets.seq);
}

/// Instants as `i32` milliseconds from an origin (saturating; floor, so never later).
#[derive(Debug, Default, Clone, Copy)]
struct Clock {
    origin: Option<Instant>,
}

impl Clock {
    fn ms(&self, t: Instant) -> i32 {
        let Some(origin) = self.origin else { return 0 };
        let ms = if t >= origin { (t - origin).as_millis() as i128 } else { -((origin - t).as_millis() as i128) };
        ms.clamp(i32::MIN.into(), i32::MAX.into()) as i32
    }
}

/// The index of one model's blocks. Engines are small integer ids the caller assigns; an index
/// numbers up to 32768 of them (events and guesses for more are ignored).
pub struct PrefixIndex {
    blocks: Slots,
    /// Bitset words per block (64 engines each).
    words: usize,
    approx: Approx,
    /// Block slots flagged `HAS_APPROX`: the other approximate blocks have no block slot.
    flagged: usize,
    /// The tiers (bit set, [`Tier::bit`]) of a block on an engine, unless GPU alone.
    tiers: HashMap<(u64, u32), u8>,
    engines: Engines,
    resets: Resets,
    clock: Clock,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        PrefixIndex {
            blocks: Slots::new(stride_for(1)),
            words: 1,
            approx: Approx::default(),
            flagged: 0,
            tiers: HashMap::new(),
            engines: Engines::default(),
            resets: Resets::default(),
            clock: Clock::default(),
        }
    }
}

impl std::fmt::Debug for PrefixIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixIndex")
            .field("blocks", &self.blocks.len())
            .field("entries", &self.entries())
            .field("engines", &self.engines.global.len())
            .field("pending_resets", &self.resets.stale.len())
            .finish()
    }
}

/// Where a chunk's blocks start their probes in both tables, computed before any of them is
/// read: a loop that then only loads those slots keeps dozens of cache misses in flight, where
/// one that also computes them fits fewer in the CPU's window. Homes go stale when a table
/// grows (an insert), so each is checked against the capacity it was computed for.
struct Homes {
    blocks: [usize; CHUNK],
    approx: [usize; CHUNK],
    caps: (usize, usize),
}

impl Default for Homes {
    fn default() -> Self {
        Homes { blocks: [0; CHUNK], approx: [0; CHUNK], caps: (0, 0) }
    }
}

impl Homes {
    /// Computes the homes of `chunk` (at most `CHUNK` blocks) and touches them, except the
    /// block-table homes of blocks for which `known(k)` (by position in the chunk) says a lookup
    /// just read their slot or found none.
    #[inline]
    fn fill(&mut self, index: &PrefixIndex, chunk: &[u64], known: impl Fn(usize) -> bool) {
        self.caps = (index.blocks.cap(), index.approx.cap());
        for (k, ((b, a), &hash)) in self.blocks.iter_mut().zip(self.approx.iter_mut()).zip(chunk).enumerate() {
            *b = if known(k) { NONE } else { index.blocks.home(hash) };
            *a = index.approx.home(hash);
        }
        let n = chunk.len();
        let warm = (0..n).fold(0, |acc, k| {
            // Guessed blocks are mostly new to the block table: their tags tell so.
            let b = if self.blocks[k] == NONE { 0 } else { index.blocks.touch_tag_at(self.blocks[k]) };
            acc ^ b ^ index.approx.touch_at(self.approx[k])
        });
        std::hint::black_box(warm);
    }

    #[inline]
    fn block(&self, index: &PrefixIndex, k: usize, hash: u64) -> usize {
        if index.blocks.cap() == self.caps.0 && self.blocks[k] != NONE {
            self.blocks[k]
        } else {
            index.blocks.home(hash)
        }
    }

    #[inline]
    fn approx(&self, index: &PrefixIndex, k: usize, hash: u64) -> usize {
        if index.approx.cap() == self.caps.1 {
            self.approx[k]
        } else {
            index.approx.home(hash)
        }
    }
}

/// The slots a lookup found, by block position in its request, so that a speculative insert of
/// the same request right after it need not probe for them again
/// ([`PrefixIndex::prefix_matches_probed`], [`PrefixIndex::insert_speculative_probed`]). Each
/// is checked before use (the slot must still hold that block), so stale ones only cost a probe.
#[derive(Debug, Default, Clone)]
pub struct Probes {
    /// Block-table slots; `NONE` where the block was not found or not probed.
    blocks: Vec<usize>,
    /// Approximate-table slots, likewise.
    approx: Vec<usize>,
    /// The blocks probed, by position.
    hashes: Vec<u64>,
    /// The block table's [`Slots::stamp`] then: while it is unchanged, a block probed and not
    /// found is still not there.
    stamp: (u64, u64),
}

impl Probes {
    fn clear(&mut self) {
        self.blocks.clear();
        self.approx.clear();
        self.hashes.clear();
    }

    #[inline]
    fn get(list: &[usize], at: usize) -> usize {
        list.get(at).copied().unwrap_or(NONE)
    }

    /// Whether block `hash`, at position `at`, was probed and not found, in a block table
    /// that has gained no key since (its stamp is `stamp`).
    #[inline]
    fn absent(&self, at: usize, hash: u64, stamp: (u64, u64)) -> bool {
        self.stamp == stamp && self.hashes.get(at) == Some(&hash) && self.blocks[at] == NONE
    }
}

impl PrefixIndex {
    /// Applies one engine's event. Unknown event kinds are ignored.
    pub fn apply(&mut self, engine: usize, event: &KvEvent) {
        match event {
            KvEvent::BlockStored { block_hashes, medium, .. } => {
                let tier = Tier::from_medium(medium.as_deref());
                let Some(local) = self.local(engine) else { return };
                let (mut homes, mut guesses) = ([0; CHUNK], [NONE; CHUNK]);
                let any_guesses = self.approx.len() > 0;
                for chunk in block_hashes.chunks(CHUNK) {
                    // Every block's first slot requested before any is written (prefetches, which
                    // do not wait): the cache misses overlap. A block new to the block table may
                    // have been guessed (most stores confirm a decision's guesses), so its
                    // approximate slot is touched too.
                    let caps = (self.blocks.cap(), self.approx.cap());
                    for ((home, guess), hash) in homes.iter_mut().zip(&mut guesses).zip(chunk) {
                        *home = self.blocks.home(hash.as_u64());
                        if any_guesses {
                            *guess = self.approx.home(hash.as_u64());
                        }
                    }
                    for &home in &homes[..chunk.len()] {
                        self.blocks.prefetch_at(home);
                    }
                    if any_guesses {
                        std::hint::black_box(
                            guesses[..chunk.len()].iter().fold(0, |a, &j| a ^ self.approx.touch_at(j)),
                        );
                    }
                    for ((&home, &guess), hash) in homes.iter().zip(&guesses).zip(chunk) {
                        let hash = hash.as_u64();
                        let home = if self.blocks.cap() == caps.0 { home } else { self.blocks.home(hash) };
                        let guess = if self.approx.cap() == caps.1 { guess } else { self.approx.home(hash) };
                        self.store(local, home, guess, hash, tier);
                    }
                }
            }
            KvEvent::BlockRemoved { block_hashes, medium } => {
                let Some(local) = self.known(engine) else { return };
                self.remove_all(local, block_hashes, medium.as_deref());
            }
            KvEvent::AllBlocksCleared => self.remove_engine(engine),
            KvEvent::Other { .. } => {}
        }
    }

    /// Applies a batch of one engine's events in order, with the same result as
    /// [`PrefixIndex::apply`] on each in turn. Engines evict one block per `BlockRemoved`
    /// event, so removals applied one at a time each wait for their own cache misses; here the
    /// slots of a run of up to `CHUNK` removed blocks are loaded together first, so that their
    /// misses overlap (stores already load theirs a chunk at a time).
    pub fn apply_batch(&mut self, engine: usize, events: &[KvEvent]) {
        if self.blocks.heap_bytes() < CACHED_TABLE_BYTES {
            // The slots are in the CPU's cache already: loading them first would only cost.
            for event in events {
                self.apply(engine, event);
            }
            return;
        }
        let mut homes = [0; CHUNK];
        let mut at = 0;
        while at < events.len() {
            let (mut end, mut n) = (at, 0);
            while let Some(KvEvent::BlockRemoved { block_hashes, .. }) = events.get(end) {
                for hash in block_hashes.iter().take(CHUNK - n) {
                    homes[n] = self.blocks.home(hash.as_u64());
                    n += 1;
                }
                end += 1;
                if n == CHUNK {
                    break;
                }
            }
            if end == at {
                self.apply(engine, &events[at]);
                at += 1;
                continue;
            }
            // Homes at the current capacity: removals never grow the table.
            for &home in &homes[..n] {
                self.blocks.prefetch_run_at(home, REMOVAL_RUN);
            }
            // The engine is looked up once for the run (most runs are one block per event).
            if let Some(local) = self.known(engine) {
                for event in &events[at..end] {
                    if let KvEvent::BlockRemoved { block_hashes, medium } = event {
                        self.remove_all(local, block_hashes, medium.as_deref());
                    }
                }
            }
            at = end;
        }
    }

    /// Records blocks an engine probably holds (a routing decision, or a speculative entry
    /// right after one), until `expires`. An event for the same block makes it exact.
    pub fn insert_approximate(&mut self, engine: usize, hashes: &[u64], expires: Instant) {
        if hashes.is_empty() {
            return;
        }
        let Some(local) = self.local(engine) else { return };
        self.clock.origin.get_or_insert(expires);
        let deadline = self.clock.ms(expires);
        let (word, bit) = (BITS + local as usize / 64, 1u64 << (local % 64));
        let mut homes = Homes::default();
        for chunk in hashes.chunks(CHUNK) {
            homes.fill(self, chunk, |_| false);
            for (k, &hash) in chunk.iter().enumerate() {
                let i = self.find_cleaned(homes.block(self, k, hash), hash);
                if i.is_some_and(|i| self.blocks.slot(i)[word] & bit != 0) {
                    continue; // an exact entry is never downgraded to an approximate one
                }
                let j = self.approx.slot_for(homes.approx(self, k, hash), hash, &self.resets);
                if self.approx.set(j, local, deadline) {
                    self.engines.approx[local as usize] += 1;
                }
                if let Some(i) = i {
                    self.flag_approx(i);
                }
            }
        }
    }

    /// Speculative entries after a routing decision: for each `(engine, first)` of `guesses`,
    /// `engine` probably holds `hashes[first..]` until `expires` (as
    /// [`PrefixIndex::insert_approximate`] per engine, in one pass over the blocks: each block
    /// is found or created once for all engines).
    pub fn insert_speculative(&mut self, guesses: &[(usize, usize)], hashes: &[u64], expires: Instant) {
        self.insert_speculative_probed(guesses, hashes, expires, &Probes::default());
    }

    /// [`PrefixIndex::insert_speculative`] right after [`PrefixIndex::prefix_matches_probed`]
    /// of the same `hashes`: the slots that lookup found are used instead of probing again
    /// (each checked first; `probes` from another request or an older state only cost probes).
    pub fn insert_speculative_probed(
        &mut self,
        guesses: &[(usize, usize)],
        hashes: &[u64],
        expires: Instant,
        probes: &Probes,
    ) {
        const MOST: usize = 4;
        if guesses.len() > MOST {
            for &(engine, first) in guesses {
                self.insert_approximate(engine, hashes.get(first..).unwrap_or_default(), expires);
            }
            return;
        }
        let mut who = [(0u32, 0usize); MOST];
        let mut n = 0;
        for &(engine, first) in guesses {
            if first < hashes.len() {
                if let Some(local) = self.local(engine) {
                    who[n] = (local, first);
                    n += 1;
                }
            }
        }
        let who = &who[..n];
        let Some(start) = who.iter().map(|&(_, first)| first).min() else { return };
        self.clock.origin.get_or_insert(expires);
        let deadline = self.clock.ms(expires);
        let mut homes = Homes::default();
        for (c, chunk) in hashes[start..].chunks(CHUNK).enumerate() {
            let first_at = start + c * CHUNK;
            let stamp = self.blocks.stamp();
            homes.fill(self, chunk, |k| {
                let seen = Probes::get(&probes.blocks, first_at + k);
                seen != NONE || probes.absent(first_at + k, chunk[k], stamp)
            });
            for (k, &hash) in chunk.iter().enumerate() {
                let at = first_at + k;
                let seen = Probes::get(&probes.blocks, at);
                let i = if seen != NONE && self.blocks.holds_at(seen, hash) {
                    clean(self.blocks.slot_mut(seen), self.words, &self.resets, &mut self.tiers);
                    Some(seen)
                } else if probes.absent(at, hash, self.blocks.stamp()) {
                    None
                } else {
                    self.find_cleaned(homes.block(self, k, hash), hash)
                };
                let mut j = None;
                for &(local, first) in who {
                    let (word, bit) = (BITS + local as usize / 64, 1u64 << (local % 64));
                    if at < first || i.is_some_and(|i| self.blocks.slot(i)[word] & bit != 0) {
                        continue; // an exact entry is never downgraded to an approximate one
                    }
                    let slot = match j {
                        Some(slot) => slot,
                        None => {
                            let seen = Probes::get(&probes.approx, at);
                            if seen != NONE && self.approx.holds_at(seen, hash) {
                                self.approx.slot_at(seen, &self.resets)
                            } else {
                                self.approx.slot_for(homes.approx(self, k, hash), hash, &self.resets)
                            }
                        }
                    };
                    j = Some(slot);
                    if self.approx.set(slot, local, deadline) {
                        self.engines.approx[local as usize] += 1;
                    }
                }
                match (i, j) {
                    (Some(i), Some(_)) => self.flag_approx(i),
                    (Some(i), None) => self.remove_if_empty(i),
                    (None, _) => {}
                }
            }
        }
    }

    /// Drops every entry of an engine (it died, restarted, or cleared its cache).
    pub fn remove_engine(&mut self, engine: usize) {
        let Some(local) = self.known(engine) else { return };
        let l = local as usize;
        if self.engines.exact[l] == 0 && self.engines.approx[l] == 0 {
            return;
        }
        self.resets.push(local);
        self.engines.exact[l] = 0;
        self.engines.approx[l] = 0;
        if self.blocks.len() < EAGER_SWEEP_BELOW || self.resets.stale.len() >= MAX_PENDING_RESETS {
            self.sweep();
        }
    }

    /// Forgets an engine for good (it was removed from membership): its entries go as with
    /// [`PrefixIndex::remove_engine`], and its dense number (its bit in every bitset) goes to
    /// the next engine this index sees, so bitsets do not widen for engines long gone.
    pub fn forget_engine(&mut self, engine: usize) {
        self.remove_engine(engine);
        let Some(local) = self.engines.local.remove(&engine) else { return };
        self.engines.global[local as usize] = NONE;
        self.engines.free.push(local);
    }

    /// Drops approximate entries that expired by `now`, and sweeps out what engine resets left.
    pub fn expire(&mut self, now: Instant) {
        if self.approx.len() > 0 {
            let now_ms = self.clock.ms(now);
            // Keep deadlines far from the ends of i32 milliseconds: move the origin up.
            let shift = if now_ms > REBASE_AFTER.as_millis() as i32 { now_ms } else { 0 };
            if let Some(origin) = self.clock.origin.as_mut() {
                *origin += Duration::from_millis(shift as u64);
            }
            let counts = &mut self.engines.approx;
            let mut emptied = Vec::new();
            self.approx.expire(
                now_ms,
                shift,
                &self.resets,
                |local| counts[local as usize] -= 1,
                |hash| emptied.push(hash),
            );
            for hash in emptied {
                if let Some(i) = self.blocks.find(hash) {
                    self.unflag_approx(i);
                    clean(self.blocks.slot_mut(i), self.words, &self.resets, &mut self.tiers);
                    self.remove_if_empty(i);
                }
            }
        } else {
            self.approx.clear_due();
        }
        self.sweep();
    }

    /// For each engine holding the first block, how many leading blocks of `hashes` it holds
    /// consecutively (entries expired by `now` do not count).
    pub fn overlaps(&self, hashes: &[u64], now: Instant) -> HashMap<usize, usize> {
        let mut matches = Vec::new();
        self.prefix_matches(hashes, now, &mut matches);
        matches.into_iter().collect()
    }

    /// [`PrefixIndex::overlaps`] into a reusable vector: `(engine, leading blocks held)` for
    /// every engine holding the first block, in no particular order (every caller reads them by
    /// engine or collects them into a map, so none pays for a sort).
    pub fn prefix_matches(&self, hashes: &[u64], now: Instant, out: &mut Vec<(usize, usize)>) {
        self.local_matches(hashes, now, out, None);
        self.to_engines(out);
    }

    /// [`PrefixIndex::prefix_matches`], keeping in `probes` the slots it found, for
    /// [`PrefixIndex::insert_speculative_probed`] of the same request right after.
    pub fn prefix_matches_probed(
        &self,
        hashes: &[u64],
        now: Instant,
        out: &mut Vec<(usize, usize)>,
        probes: &mut Probes,
    ) {
        probes.clear();
        probes.stamp = self.blocks.stamp();
        self.local_matches(hashes, now, out, Some(probes));
        self.to_engines(out);
    }

    /// Dense engine numbers in matches to the caller's.
    fn to_engines(&self, out: &mut [(usize, usize)]) {
        for (engine, _) in out.iter_mut() {
            *engine = self.engines.global[*engine];
        }
    }

    /// The matches by dense engine number, in the order engines stop matching.
    fn local_matches(&self, hashes: &[u64], now: Instant, out: &mut Vec<(usize, usize)>, probes: Option<&mut Probes>) {
        // The bitset width as a constant where it is small (up to 128 engines), so that each
        // block's copy and intersection compile to a few instructions, not loops and a call.
        match self.words {
            1 => self.matches_in::<1>(hashes, now, out, probes),
            2 => self.matches_in::<2>(hashes, now, out, probes),
            _ => self.matches_in::<0>(hashes, now, out, probes),
        }
    }

    /// [`PrefixIndex::local_matches`] with `WORDS` bitset words per block (0: `self.words`).
    fn matches_in<const WORDS: usize>(
        &self,
        hashes: &[u64],
        now: Instant,
        out: &mut Vec<(usize, usize)>,
        mut probes: Option<&mut Probes>,
    ) {
        out.clear();
        if hashes.is_empty() || self.blocks.len() + self.approx.len() == 0 {
            return;
        }
        let words = if WORDS == 0 { self.words } else { WORDS };
        let any_guesses = self.approx.len() > 0;
        let now = self.clock.ms(now);
        // active: engines holding every block so far; live: holders of the current block.
        let (mut small, mut large) = ([0u64; 8], Vec::new());
        let scratch: &mut [u64] = if 2 * words <= small.len() {
            &mut small[..2 * words]
        } else {
            large.resize(2 * words, 0);
            &mut large
        };
        let (active, live) = scratch.split_at_mut(words);
        let mut found = [NONE; CHUNK];
        // Homes in the block table, then (for blocks flagged as guessed, or without a block
        // slot) in the approximate one.
        let mut homes = [NONE; CHUNK];
        let mut tags = [0u8; CHUNK];
        let mut guessed = [NONE; CHUNK];
        let mut end = hashes.len();
        let mut start = 0;
        let cached = self.blocks.heap_bytes() < CACHED_TABLE_BYTES;
        'chunks: while start < hashes.len() {
            let len = if start == 0 { FIRST_CHUNK } else { LOOKUP_CHUNK };
            let chunk = &hashes[start..hashes.len().min(start + len)];
            // Independent probes first, so that their cache misses overlap: homes computed, then
            // only loaded (many loads in flight), then the walks, which mostly hit the cache.
            for ((home, tag), &hash) in homes.iter_mut().zip(&mut tags).zip(chunk) {
                (*home, *tag) = self.blocks.home_and_tag(hash);
            }
            // Every home's tag and slot line requested at once, without waiting for any: in a
            // table other work has pushed out of the caches, the misses then overlap (a deep
            // match walks dozens of random lines) and the walks below find most lines arrived.
            for &home in &homes[..chunk.len()] {
                self.blocks.prefetch_at(home);
            }
            let mut probed = chunk.len();
            if cached {
                // One walk a block: the table mostly stays cached, and the prefetches above
                // overlap what does not.
                for (k, ((slot, &hash), (&home, &tag))) in
                    found.iter_mut().zip(chunk).zip(homes.iter().zip(&tags)).enumerate()
                {
                    *slot = self.blocks.find_tagged(home, tag, hash).unwrap_or(NONE);
                    if *slot == NONE && !any_guesses {
                        probed = k + 1;
                        break;
                    }
                }
            } else {
                // Tags first (a byte a slot: they mostly stay cached), all loaded before any is
                // walked; the walks then name the slot each block's key is first compared in,
                // so that the slot lines loaded next are the right ones (a block often sits past
                // its home's line, a second miss otherwise found only after the first), and none
                // is loaded for blocks after one that is absent (without guesses, the match ends
                // there).
                let warm = homes[..chunk.len()].iter().fold(0, |acc, &i| acc ^ self.blocks.touch_tag_at(i));
                std::hint::black_box(warm);
                for (k, (home, &tag)) in homes[..chunk.len()].iter_mut().zip(&tags).enumerate() {
                    *home = self.blocks.first_tagged(*home, tag).unwrap_or(NONE);
                    if *home == NONE && !any_guesses {
                        probed = k + 1;
                        break;
                    }
                }
                let warm =
                    homes[..probed].iter().filter(|&&i| i != NONE).fold(0, |acc, &i| acc ^ self.blocks.touch_at(i));
                std::hint::black_box(warm);
                for (((slot, &hash), &first), &tag) in found.iter_mut().zip(&chunk[..probed]).zip(&homes).zip(&tags) {
                    *slot =
                        if first == NONE { NONE } else { self.blocks.find_tagged(first, tag, hash).unwrap_or(NONE) };
                }
            }
            let chunk = &chunk[..probed];
            if let Some(p) = probes.as_deref_mut() {
                p.hashes.extend_from_slice(chunk);
                p.blocks.extend_from_slice(&found[..chunk.len()]);
                p.approx.resize(p.blocks.len(), NONE);
            }
            // The same for the approximate slots of guessed blocks (their flag is in the block
            // slots just read) and of blocks without a block slot; none without guesses.
            if any_guesses {
                for ((j, &i), &hash) in guessed.iter_mut().zip(&found).zip(chunk) {
                    let maybe = i == NONE || self.blocks.slot(i)[1] & HAS_APPROX != 0;
                    *j = if maybe { self.approx.home(hash) } else { NONE };
                }
                let warm = guessed[..chunk.len()]
                    .iter()
                    .filter(|&&j| j != NONE)
                    .fold(0, |acc, &j| acc ^ self.approx.touch_at(j));
                std::hint::black_box(warm);
            }
            for (k, &i) in found[..chunk.len()].iter().enumerate() {
                let at = start + k;
                if i == NONE {
                    live.fill(0);
                } else {
                    self.live_exact(i, live);
                }
                // Guesses only matter for engines still matching that do not hold the block
                // exactly (on the first block, for every engine).
                let undecided = || at == 0 || active.iter().zip(live.iter()).any(|(a, l)| a & !l != 0);
                let guess =
                    if guessed[k] != NONE && undecided() { self.approx.find_from(guessed[k], chunk[k]) } else { None };
                match guess {
                    Some(j) => {
                        if let Some(p) = probes.as_deref_mut() {
                            p.approx[at] = j;
                        }
                        self.approx.live(j, now, &self.resets, live);
                    }
                    None if i == NONE => {
                        end = at;
                        break 'chunks;
                    }
                    None => {}
                }
                let mut any = 0;
                for (w, (a, &l)) in active.iter_mut().zip(live.iter()).enumerate() {
                    if at == 0 {
                        *a = l;
                    } else {
                        let mut dropped = *a & !l;
                        while dropped != 0 {
                            out.push((w * 64 + dropped.trailing_zeros() as usize, at));
                            dropped &= dropped - 1;
                        }
                        *a &= l;
                    }
                    any |= *a;
                }
                if any == 0 {
                    break 'chunks;
                }
            }
            start += chunk.len();
        }
        each_bit(active, |local| out.push((local as usize, end)));
    }

    /// Where `engine` holds block `hash` now, if it does (approximate entries count as GPU).
    pub fn holds(&self, engine: usize, hash: u64, now: Instant) -> Option<Tier> {
        let local = self.known(engine)?;
        let mut live = vec![0u64; self.words];
        if let Some(i) = self.blocks.find(hash) {
            self.live_exact(i, &mut live);
        }
        if let Some(j) = self.approx.find(hash) {
            self.approx.live(j, self.clock.ms(now), &self.resets, &mut live);
        }
        if live[local as usize / 64] & 1 << (local % 64) == 0 {
            return None;
        }
        Some(Tier::fastest(self.tiers.get(&(hash, local)).copied().unwrap_or(GPU_ONLY)))
    }

    /// `hashes` (leading blocks a lookup found `engine` holding) counted each at its fastest
    /// tier's weight there; `hashes.len()` when everything is on GPU.
    pub fn tier_weighted(&self, engine: usize, hashes: &[u64], weights: &TierWeights) -> f64 {
        let Some(local) = self.known(engine).filter(|_| !self.tiers.is_empty()) else {
            return hashes.len() as f64;
        };
        hashes
            .iter()
            .map(|&hash| weights.of(Tier::fastest(self.tiers.get(&(hash, local)).copied().unwrap_or(GPU_ONLY))))
            .sum()
    }

    /// Every engine number this index has seen and not forgotten.
    pub fn holders(&self) -> impl Iterator<Item = usize> + '_ {
        self.engines.local.keys().copied()
    }

    /// Blocks indexed for an engine (approximate entries count until `expire` drops them).
    pub fn engine_blocks(&self, engine: usize) -> usize {
        self.known(engine).map_or(0, |l| self.engines.exact[l as usize] + self.engines.approx[l as usize])
    }

    /// (block, engine) entries, exact and approximate.
    pub fn entries(&self) -> usize {
        self.engines.exact.iter().sum::<usize>() + self.engines.approx.iter().sum::<usize>()
    }

    /// Blocks some engine holds (approximate entries count until `expire` drops them).
    pub fn len(&self) -> usize {
        if self.resets.stale.is_empty() {
            // Every block slot has an exact holder or a guess; guessed blocks without one are
            // the approximate blocks not flagged on a block slot.
            return self.blocks.len() + self.approx.len() - self.flagged;
        }
        // Resets not swept yet: count the blocks with a holder left (expired guesses count
        // until `expire` drops them).
        let mut live = vec![0u64; self.words];
        let exact = self
            .blocks
            .occupied_slots()
            .filter(|&i| {
                self.live_exact(i, &mut live);
                if let Some(j) = self.approx.find(self.blocks.slot(i)[0]) {
                    self.approx.live(j, i32::MIN, &self.resets, &mut live);
                }
                live.iter().any(|&w| w != 0)
            })
            .count();
        let guessed = self
            .approx
            .occupied_slots()
            .filter(|&(j, hash)| {
                live.fill(0);
                self.approx.live(j, i32::MIN, &self.resets, &mut live);
                self.blocks.find(hash).is_none() && live.iter().any(|&w| w != 0)
            })
            .count();
        exact + guessed
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes this index holds (tables at capacity, side maps estimated).
    pub fn heap_bytes(&self) -> usize {
        fn map<K, V, S>(m: &HashMap<K, V, S>) -> usize {
            // hashbrown: a power of two of buckets, at most 7/8 full, each (K, V) and a control byte.
            let buckets = if m.capacity() == 0 { 0 } else { (m.capacity() * 8 / 7).next_power_of_two() };
            buckets * (std::mem::size_of::<(K, V)>() + 1)
        }
        let e = &self.engines;
        self.blocks.heap_bytes()
            + self.approx.heap_bytes()
            + map(&self.tiers)
            + map(&e.local)
            + (e.global.capacity() + e.exact.capacity() + e.approx.capacity()) * 8
            + e.free.capacity() * 4
            + self.resets.stale.iter().map(|b| b.capacity() * 8 + 24).sum::<usize>()
    }

    // ---- internals ----

    fn known(&self, engine: usize) -> Option<u32> {
        self.engines.local.get(&engine).copied()
    }

    /// The dense number of `engine`, assigned on first sight (widening block slots when the
    /// bitsets need another word); `None` past the engines an index can number.
    fn local(&mut self, engine: usize) -> Option<u32> {
        if let Some(local) = self.known(engine) {
            return Some(local);
        }
        let e = &mut self.engines;
        if let Some(local) = e.free.pop() {
            // A forgotten engine's number: its entries were reset when it was forgotten, and
            // whatever stale bits remain are masked and cleaned like any reset engine's.
            e.local.insert(engine, local);
            e.global[local as usize] = engine;
            return Some(local);
        }
        if e.global.len() >= MAX_ENGINES {
            tracing::warn!(engine, "the prefix index numbers {MAX_ENGINES} engines at most; ignoring this one");
            return None;
        }
        let local = e.global.len() as u32;
        e.local.insert(engine, local);
        e.global.push(engine);
        e.exact.push(0);
        e.approx.push(0);
        let words = local as usize / 64 + 1;
        if words > self.words {
            self.words = words;
            if stride_for(words) != self.blocks.stride() {
                self.blocks.rebuild(stride_for(words), self.blocks.cap());
            }
        }
        Some(local)
    }

    /// The slot of block `hash`, cleaned, if it has one (walking from `home`,
    /// `self.blocks.home(hash)` at the current capacity).
    fn find_cleaned(&mut self, home: usize, hash: u64) -> Option<usize> {
        let i = self.blocks.find_from(home, hash)?;
        clean(self.blocks.slot_mut(i), self.words, &self.resets, &mut self.tiers);
        Some(i)
    }

    /// Flags block slot `i`: the block has approximate entries.
    fn flag_approx(&mut self, i: usize) {
        let meta = &mut self.blocks.slot_mut(i)[1];
        if *meta & HAS_APPROX == 0 {
            *meta |= HAS_APPROX;
            self.flagged += 1;
        }
    }

    fn unflag_approx(&mut self, i: usize) {
        let meta = &mut self.blocks.slot_mut(i)[1];
        if *meta & HAS_APPROX != 0 {
            *meta &= !HAS_APPROX;
            self.flagged -= 1;
        }
    }

    /// Records that `local` holds block `hash` in `tier`; `home` is the block's in the block
    /// table, `guess` its home in the approximate table (both at their current capacities).
    fn store(&mut self, local: u32, home: usize, guess: usize, hash: u64, tier: Tier) {
        let (i, new) = self.blocks.find_or_insert_from(home, hash, OCCUPIED | u64::from(self.resets.seq));
        let mut guessed = None;
        if !new {
            clean(self.blocks.slot_mut(i), self.words, &self.resets, &mut self.tiers);
        } else if self.approx.len() > 0 {
            // Guesses made before the block had a slot.
            guessed = self.approx.find_from(guess, hash);
            if guessed.is_some() {
                self.flag_approx(i);
            }
        }
        let (word, bit) = (BITS + local as usize / 64, 1u64 << (local % 64));
        let slot = self.blocks.slot_mut(i);
        let meta = slot[1];
        // The tiers it already has there: a copy in another tier adds to them.
        let mut held = 0;
        let newly_held = if new {
            // A slot just taken has zeros past its meta word, so this one is written without
            // being read: its line may still be on its way, and a read would wait for it.
            debug_assert!(slot[BITS..].iter().all(|&w| w == 0), "a new slot holds bits");
            slot[word] = bit;
            true
        } else if slot[word] & bit == 0 {
            slot[word] |= bit;
            true
        } else {
            false
        };
        if newly_held {
            self.engines.exact[local as usize] += 1;
            if meta & HAS_APPROX != 0 {
                self.drop_approx(i, hash, local, guessed);
            }
        } else {
            held = self.tiers_of(meta, hash, local);
        }
        let tiers = held | tier.bit();
        if tiers != GPU_ONLY {
            self.tiers.insert((hash, local), tiers);
            self.blocks.slot_mut(i)[1] |= HAS_TIER;
        } else if meta & HAS_TIER != 0 {
            self.tiers.remove(&(hash, local));
        }
    }

    /// The tiers of a block `local` holds exactly (its slot's meta word given).
    fn tiers_of(&self, meta: u64, hash: u64, local: u32) -> u8 {
        if meta & HAS_TIER == 0 {
            return GPU_ONLY;
        }
        self.tiers.get(&(hash, local)).copied().unwrap_or(GPU_ONLY)
    }

    /// A `BlockRemoved` event of engine `local`: a medium removes that tier's copy only; none
    /// removes every copy.
    fn remove_all(&mut self, local: u32, hashes: &[BlockHash], medium: Option<&str>) {
        let tier = medium.map(|m| Tier::from_medium(Some(m)));
        for hash in hashes {
            self.remove(local, hash.as_u64(), tier);
        }
    }

    /// Drops `local`'s copy of `hash` in `tier`, or every copy (`None`).
    fn remove(&mut self, local: u32, hash: u64, tier: Option<Tier>) {
        let Some(i) = self.blocks.find(hash) else {
            // Perhaps guessed: guesses need no block slot.
            if self.approx.len() > 0 && self.approx.remove(hash, local, &self.resets).0 {
                self.engines.approx[local as usize] -= 1;
            }
            return;
        };
        let (word, bit) = (BITS + local as usize / 64, 1u64 << (local % 64));
        let slot = self.blocks.slot_mut(i);
        clean(slot, self.words, &self.resets, &mut self.tiers);
        let meta = slot[1];
        let holds = slot[word] & bit != 0;
        if let (true, Some(tier)) = (holds, tier) {
            let left = self.tiers_of(meta, hash, local) & !tier.bit();
            if left == GPU_ONLY {
                self.tiers.remove(&(hash, local));
            } else if left != 0 {
                self.tiers.insert((hash, local), left);
            }
            if left != 0 {
                return; // still held in another tier
            }
        }
        let slot = self.blocks.slot_mut(i);
        if holds {
            slot[word] &= !bit;
            self.engines.exact[local as usize] -= 1;
            if meta & HAS_TIER != 0 {
                self.tiers.remove(&(hash, local));
            }
        }
        if meta & HAS_APPROX != 0 {
            self.drop_approx(i, hash, local, None);
        }
        self.remove_if_empty(i);
    }

    /// Removes `local`'s approximate entry for block slot `i`, and the flag if it was the last;
    /// `found` is the block's approximate slot when the caller just found it.
    fn drop_approx(&mut self, i: usize, hash: u64, local: u32, found: Option<usize>) {
        let (had, left) = match found {
            Some(j) => self.approx.remove_at(j, local, &self.resets),
            None => self.approx.remove(hash, local, &self.resets),
        };
        if had {
            self.engines.approx[local as usize] -= 1;
        }
        if !left {
            self.unflag_approx(i);
        }
    }

    /// Removes block slot `i` (cleaned) if no engine holds the block exactly: approximate
    /// entries need no block slot.
    fn remove_if_empty(&mut self, i: usize) {
        let slot = self.blocks.slot(i);
        if slot[BITS..BITS + self.words].iter().all(|&w| w == 0) {
            self.unflag_approx(i);
            self.blocks.remove_at(i);
        }
    }

    /// Exact holders of block slot `i`, stale bits masked (`out` is `self.words` long).
    #[inline]
    fn live_exact(&self, i: usize, out: &mut [u64]) {
        let slot = self.blocks.slot(i);
        out.copy_from_slice(&slot[BITS..BITS + out.len()]);
        if let Some(stale) = self.resets.stale((slot[1] & STAMP) as u32) {
            for (o, &s) in out.iter_mut().zip(stale) {
                *o &= !s;
            }
        }
    }

    /// Drops what pending resets left behind: stale approximate entries, stale bits, and blocks
    /// nobody holds any more.
    fn sweep(&mut self) {
        if self.resets.stale.is_empty() {
            return;
        }
        let mut emptied = Vec::new();
        self.approx.sweep(&self.resets, |hash| emptied.push(hash));
        for hash in emptied {
            if let Some(i) = self.blocks.find(hash) {
                self.unflag_approx(i);
            }
        }
        let (words, resets, tiers, flagged) = (self.words, &self.resets, &mut self.tiers, &mut self.flagged);
        self.blocks.retain(|slot| {
            clean(slot, words, resets, tiers);
            let held = slot[BITS..BITS + words].iter().any(|&w| w != 0);
            if !held && slot[1] & HAS_APPROX != 0 {
                *flagged -= 1;
            }
            held
        });
        self.resets.base = self.resets.seq;
        self.resets.stale.clear();
        self.blocks.shrink();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pd_protocols::kv_events::BlockHash;

    use super::*;

    pub(super) fn stored(hashes: &[u64]) -> KvEvent {
        stored_on(hashes, "GPU")
    }

    fn stored_on(hashes: &[u64], medium: &str) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            medium: Some(medium.into()),
            lora_name: None,
            cache_salt: None,
        }
    }

    pub(super) fn removed(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockRemoved { block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(), medium: None }
    }

    #[test]
    fn longest_consecutive_prefix_per_engine() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.apply(1, &stored(&[10, 11, 12]));
        index.apply(2, &stored(&[10, 11]));
        index.apply(3, &stored(&[11, 12])); // no first block: no prefix
        index.apply(2, &stored(&[13])); // not consecutive after the gap at 12
        let overlaps = index.overlaps(&[10, 11, 12, 13], now);
        assert_eq!(overlaps.get(&1), Some(&3));
        assert_eq!(overlaps.get(&2), Some(&2));
        assert_eq!(overlaps.get(&3), None);
        assert!(index.overlaps(&[99], now).is_empty());
        assert!(index.overlaps(&[], now).is_empty());
    }

    #[test]
    fn removal_and_clearing() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.apply(1, &stored(&[10, 11]));
        index.apply(2, &stored(&[10, 11]));
        index.apply(1, &removed(&[11]));
        assert_eq!(index.overlaps(&[10, 11], now).get(&1), Some(&1));
        index.apply(2, &KvEvent::AllBlocksCleared);
        assert_eq!(index.engine_blocks(2), 0);
        index.remove_engine(1);
        assert!(index.is_empty());
    }

    #[test]
    fn approximate_entries_expire_and_events_make_them_exact() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.insert_approximate(1, &[10, 11], now + Duration::from_secs(2));
        index.insert_approximate(2, &[10], now + Duration::from_secs(2));
        index.apply(2, &stored(&[10]));
        let later = now + Duration::from_secs(3);
        assert_eq!(index.overlaps(&[10, 11], now).get(&1), Some(&2));
        assert_eq!(index.overlaps(&[10, 11], later).get(&1), None);
        index.expire(later);
        assert_eq!(index.engine_blocks(1), 0);
        assert_eq!(index.overlaps(&[10], later).get(&2), Some(&1));
        // A later guess never downgrades an exact entry.
        index.insert_approximate(2, &[10], now);
        assert_eq!(index.overlaps(&[10], later).get(&2), Some(&1));
        assert_eq!(index.len(), 1);
    }

    #[test]
    fn tiers_are_kept_per_engine() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.apply(1, &stored_on(&[10, 11], "cpu"));
        index.apply(2, &stored(&[10]));
        index.insert_approximate(3, &[10], now + Duration::from_secs(1));
        assert_eq!(index.holds(1, 10, now), Some(Tier::Cpu));
        assert_eq!(index.holds(2, 10, now), Some(Tier::Gpu));
        assert_eq!(index.holds(3, 10, now), Some(Tier::Gpu));
        assert_eq!(index.holds(3, 10, now + Duration::from_secs(1)), None);
        index.apply(1, &stored(&[10]));
        assert_eq!(index.holds(1, 10, now), Some(Tier::Gpu));
        assert_eq!(index.holds(1, 11, now), Some(Tier::Cpu));
        assert_eq!(index.holds(4, 10, now), None);
        index.apply(1, &KvEvent::AllBlocksCleared);
        assert_eq!(index.holds(1, 11, now), None);
        assert!(index.tiers.is_empty(), "a reset drops the engine's tiers");
    }

    #[test]
    fn removal_naming_a_tier_drops_that_copy_only() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        let removed = |hashes: &[u64], medium: Option<&str>| KvEvent::BlockRemoved {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            medium: medium.map(str::to_owned),
        };
        index.apply(1, &stored(&[10, 11, 12]));
        index.apply(1, &stored_on(&[10, 11], "CPU"));
        index.apply(1, &stored_on(&[10], "LOCAL_DISK"));
        let weights = TierWeights { cpu: 0.5, disk: 0.25 };
        assert_eq!(index.tier_weighted(1, &[10, 11, 12], &weights), 3.0, "every block is on GPU too");
        index.apply(1, &removed(&[10, 11, 12], Some("GPU")));
        assert_eq!(index.holds(1, 10, now), Some(Tier::Cpu));
        assert_eq!(index.holds(1, 12, now), None, "its only copy");
        assert_eq!(index.tier_weighted(1, &[10, 11], &weights), 1.0);
        index.apply(1, &removed(&[10], Some("CPU")));
        assert_eq!(index.holds(1, 10, now), Some(Tier::Other));
        assert_eq!(index.tier_weighted(1, &[10], &weights), 0.25);
        assert_eq!(index.overlaps(&[10, 11], now).get(&1), Some(&2));
        index.apply(1, &removed(&[10], Some("CPU")));
        assert_eq!(index.holds(1, 10, now), Some(Tier::Other), "no CPU copy left to drop");
        // No medium: every copy goes.
        index.apply(1, &removed(&[10, 11], None));
        assert_eq!(index.holds(1, 10, now), None);
        assert_eq!(index.holds(1, 11, now), None);
        assert!(index.tiers.is_empty());
        assert_eq!(index.engine_blocks(1), 0);
        assert_eq!(index.tier_weighted(2, &[10], &weights), 1.0, "unknown engines count as given");
    }

    /// Resets stay pending on a large table: reads mask them, writes and sweeps drop them.
    #[test]
    fn lazy_resets_on_a_large_table() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        let many: Vec<u64> = (0..2 * EAGER_SWEEP_BELOW as u64).collect();
        index.apply(1, &stored(&many));
        index.apply(2, &stored(&many[..10]));
        index.insert_approximate(3, &many[..5], now + Duration::from_secs(5));
        index.apply(1, &KvEvent::AllBlocksCleared);
        assert_eq!(index.resets.stale.len(), 1, "not swept yet");
        assert_eq!(index.engine_blocks(1), 0);
        assert_eq!(index.len(), 10);
        assert_eq!(index.entries(), 15);
        assert_eq!(index.overlaps(&many[..20], now), HashMap::from([(2, 10), (3, 5)]));
        // The engine comes back with part of it; its old bits stay gone.
        index.apply(1, &stored(&many[..3]));
        index.apply(1, &stored(&many[100..103]));
        assert_eq!(index.overlaps(&many[..20], now).get(&1), Some(&3));
        assert_eq!(index.engine_blocks(1), 6);
        index.remove_engine(3);
        index.expire(now);
        assert!(index.resets.stale.is_empty());
        assert_eq!(index.len(), 13);
        assert_eq!(index.entries(), 16);
        assert_eq!(index.blocks.len(), 13, "swept");
        assert_eq!(index.approx.len(), 0);
    }

    /// Expiry visits the blocks listed under due deadlines (guesses renewed since keep their
    /// later deadline), and ends with nothing left.
    #[test]
    fn expiry_follows_the_deadlines() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        for k in 0..2000u64 {
            index.insert_approximate((k % 3) as usize, &[k, k + 10_000], now + Duration::from_millis(k));
        }
        index.insert_approximate(0, &[0, 3], now + Duration::from_secs(10));
        assert_eq!(index.entries(), 4000);
        index.expire(now + Duration::from_millis(999));
        assert_eq!(index.entries(), 2002);
        assert_eq!(index.engine_blocks(0), 2 + (1000..2000).filter(|k| k % 3 == 0).count() * 2);
        let later = now + Duration::from_millis(999);
        assert_eq!(index.overlaps(&[0], later), HashMap::from([(0, 1)]));
        assert!(index.overlaps(&[1], later).is_empty());
        assert_eq!(index.len(), 2002);
        index.expire(now + Duration::from_secs(20));
        assert_eq!((index.entries(), index.len(), index.approx.len()), (0, 0, 0));
    }

    /// Guessed blocks nobody holds exactly live in the approximate table only; a block slot
    /// comes with the first exact holder (flagged if guesses were there before) and goes with
    /// the last, whatever guesses remain.
    #[test]
    fn guesses_need_no_block_slot() {
        let now = Instant::now();
        let until = now + Duration::from_secs(1);
        let mut index = PrefixIndex::default();
        index.insert_approximate(1, &[10, 11, 12], until);
        assert_eq!((index.blocks.len(), index.approx.len(), index.len()), (0, 3, 3));
        assert_eq!(index.overlaps(&[10, 11, 12, 13], now), HashMap::from([(1, 3)]));
        index.apply(2, &stored(&[10, 11]));
        assert_eq!((index.blocks.len(), index.flagged, index.len()), (2, 2, 3));
        assert_eq!(index.overlaps(&[10, 11, 12], now), HashMap::from([(1, 3), (2, 2)]));
        // Engine 1's event confirms block 10: its guess goes, the flag with it.
        index.apply(1, &stored(&[10]));
        assert_eq!((index.flagged, index.approx.len(), index.entries()), (1, 2, 5));
        index.apply(2, &removed(&[10, 11]));
        assert_eq!((index.blocks.len(), index.flagged, index.len()), (1, 0, 3));
        // A removal reaches a guess without a block slot too.
        index.apply(1, &removed(&[12]));
        assert_eq!((index.approx.len(), index.engine_blocks(1), index.len()), (1, 2, 2));
        index.expire(until);
        assert_eq!((index.blocks.len(), index.approx.len(), index.len()), (1, 0, 1));
        assert_eq!(index.overlaps(&[10, 11], until), HashMap::from([(1, 1)]));
    }

    /// Matches name the caller's engines whether they came in order or not, and after a
    /// forgotten engine's number goes to a new one.
    #[test]
    fn matches_name_the_callers_engines() {
        let now = Instant::now();
        let request: Vec<u64> = (0..40).collect();
        for order in [(0..100).collect::<Vec<usize>>(), (0..100).rev().collect()] {
            let mut index = PrefixIndex::default();
            let mut expected = HashMap::new();
            for &k in &order {
                index.apply(k * 3, &stored(&request[..1 + k * 7 % 40]));
                expected.insert(k * 3, 1 + k * 7 % 40);
            }
            assert_eq!(index.overlaps(&request, now), expected);
            // Engine 30 goes; its number goes to engine 1000.
            index.forget_engine(30);
            expected.remove(&30);
            for newcomer in [1000, 1] {
                index.apply(newcomer, &stored(&request[..5]));
                expected.insert(newcomer, 5);
                assert_eq!(index.overlaps(&request, now), expected, "newcomer {newcomer}");
            }
        }
    }

    /// More than 64 engines widen the bitsets; more than 128 the slots.
    #[test]
    fn many_engines() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        for engine in 0..300 {
            index.apply(engine * 1000, &stored(&[1, 2, 3][..1 + engine % 3]));
        }
        let overlaps = index.overlaps(&[1, 2, 3], now);
        assert_eq!(overlaps.len(), 300);
        for engine in 0..300 {
            assert_eq!(overlaps[&(engine * 1000)], 1 + engine % 3);
        }
        index.apply(299_000, &KvEvent::AllBlocksCleared);
        assert_eq!(index.overlaps(&[1, 2, 3], now).len(), 299);
    }

    /// Lookups walk a cached table block by block and a larger one a chunk at a time: both
    /// give the same answers, exact and guessed, whatever else the table holds.
    #[test]
    fn lookups_agree_in_cached_and_uncached_tables() {
        let now = Instant::now();
        let (mut small, mut large) = (PrefixIndex::default(), PrefixIndex::default());
        let filler: Vec<u64> = (1 << 40..(1 << 40) + 150_000).collect();
        for run in filler.chunks(5000) {
            large.apply(999, &stored(run));
        }
        let mut x = 7u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 5000
        };
        let mut requests = Vec::new();
        for index in [&mut small, &mut large] {
            for engine in 0..6u64 {
                // Engine e holds 0..100 + 20 e, then guesses the next 10 blocks.
                let held: Vec<u64> = (0..100 + 20 * engine).collect();
                index.apply(engine as usize, &stored(&held));
                let guessed: Vec<u64> = (held.len() as u64..held.len() as u64 + 10).collect();
                index.insert_approximate(engine as usize, &guessed, now + Duration::from_secs(5));
            }
        }
        for _ in 0..200 {
            let cut = next() % 260;
            let mut request: Vec<u64> = (0..cut).collect();
            request.extend((0..next() % 40).map(|k| (1 << 50) + k));
            requests.push((cut as usize, request));
        }
        assert!(small.blocks.heap_bytes() < CACHED_TABLE_BYTES);
        assert!(large.blocks.heap_bytes() >= CACHED_TABLE_BYTES);
        for (cut, request) in &requests {
            let (a, b) = (small.overlaps(request, now), large.overlaps(request, now));
            assert_eq!(a, b, "request of {} blocks", request.len());
            assert_eq!(a.get(&5).copied(), Some((*cut).min(210)).filter(|&n| n > 0), "engine 5");
        }
    }
}
