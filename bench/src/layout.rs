//! What one measurement moves, and where its blocks sit in the registered memory.

use rand::rngs::StdRng;
use rand::SeedableRng;
use xfer::Op;

use crate::units::format_size;

/// A scattered layout draws its blocks from a pool this many times larger than needed.
pub const SCATTER_FACTOR: u64 = 4;

/// One measured configuration: every thread posts requests of `batch` blocks of `block` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Case {
    pub op: Op,
    pub block: u64,
    pub batch: u64,
    /// Blocks at random distinct slots (different on each side) instead of back to back.
    pub scatter: bool,
}

impl Case {
    /// Bytes one request moves.
    pub fn request_bytes(&self) -> u64 {
        self.block * self.batch
    }

    /// Bytes of registered memory each side needs for `threads` threads.
    pub fn region_bytes(&self, threads: u64) -> u64 {
        let factor = if self.scatter { SCATTER_FACTOR } else { 1 };
        self.request_bytes().saturating_mul(threads).saturating_mul(factor)
    }

    pub fn label(&self) -> String {
        let shape = if self.scatter { " scatter" } else { "" };
        format!("{} {}x{}{shape}", self.op, format_size(self.block), self.batch)
    }
}

/// Block slots of one case: slot `s` is bytes `s*block .. (s+1)*block` of a side's region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub block: u64,
    /// Slots in the pool the blocks are drawn from.
    pub slots: usize,
    /// Per thread: the local slot of each descriptor.
    pub local: Vec<Vec<usize>>,
    /// Per thread: the remote slot of each descriptor (same position = same block).
    pub remote: Vec<Vec<usize>>,
}

impl Layout {
    pub fn new(case: &Case, threads: usize, seed: u64) -> Layout {
        let batch = case.batch as usize;
        let needed = batch * threads;
        let (slots, local, remote) = if case.scatter {
            let slots = needed * SCATTER_FACTOR as usize;
            let draw = |seed: u64| {
                let mut rng = StdRng::seed_from_u64(seed);
                rand::seq::index::sample(&mut rng, slots, needed).into_vec()
            };
            (slots, draw(seed), draw(seed.wrapping_add(0x9e37_79b9)))
        } else {
            (needed, (0..needed).collect(), (0..needed).collect())
        };
        let per_thread = |all: Vec<usize>| all.chunks(batch).map(<[usize]>::to_vec).collect();
        Layout { block: case.block, slots, local: per_thread(local), remote: per_thread(remote) }
    }

    /// Bytes of the pool, from the start of a region.
    pub fn pool_bytes(&self) -> u64 {
        self.slots as u64 * self.block
    }

    /// Byte offset of a slot inside a region.
    pub fn offset(&self, slot: usize) -> u64 {
        slot as u64 * self.block
    }

    /// Every `(local slot, remote slot)` pair of every thread.
    pub fn pairs(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.local.iter().zip(&self.remote).flat_map(|(l, r)| l.iter().copied().zip(r.iter().copied()))
    }
}

/// The most memory any case needs on one side.
pub fn region_bytes(cases: &[Case], threads: u64) -> u64 {
    cases.iter().map(|c| c.region_bytes(threads)).max().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    fn case(block: u64, batch: u64, scatter: bool) -> Case {
        Case { op: Op::Read, block, batch, scatter }
    }

    #[test]
    fn contiguous_layout_is_back_to_back_per_thread() {
        let layout = Layout::new(&case(4096, 3, false), 2, 1);
        assert_eq!(layout.slots, 6);
        assert_eq!(layout.local, vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(layout.remote, layout.local);
        assert_eq!(layout.pool_bytes(), 6 * 4096);
        assert_eq!(layout.offset(2), 8192);
    }

    #[test]
    fn scattered_layout_uses_distinct_slots_in_a_pool_four_times_larger() {
        let layout = Layout::new(&case(16384, 64, true), 3, 7);
        assert_eq!(layout.slots, 64 * 3 * 4);
        for side in [&layout.local, &layout.remote] {
            assert_eq!(side.len(), 3);
            assert!(side.iter().all(|t| t.len() == 64));
            let all: HashSet<usize> = side.iter().flatten().copied().collect();
            assert_eq!(all.len(), 64 * 3, "slots are distinct across threads");
            assert!(all.iter().all(|&s| s < layout.slots));
        }
        assert_ne!(layout.local, layout.remote, "each side has its own permutation");
        assert_eq!(layout.pairs().count(), 64 * 3);
        assert_eq!(Layout::new(&case(16384, 64, true), 3, 7), layout, "seeded");
    }

    #[test]
    fn region_needs_cover_the_largest_case() {
        let cases = [case(64 << 10, 1, false), case(16 << 10, 2048, true), case(32 << 20, 1, false)];
        assert_eq!(cases[1].region_bytes(1), 128 << 20);
        assert_eq!(region_bytes(&cases, 1), 128 << 20);
        assert_eq!(region_bytes(&cases, 2), 256 << 20);
        assert_eq!(cases[1].label(), "read 16Kx2048 scatter");
    }
}
