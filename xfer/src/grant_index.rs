//! Which of a peer's loaded grants a descriptor goes through, in time that grows with the log
//! of the number of grants rather than with the number itself.
//!
//! Grants may overlap (a range re-granted after reuse while the older grant stays loaded) and
//! are ranked by age: the newest grant containing a descriptor wins, else the newest one
//! overlapping it. The index cuts each memory type's and device's address line at every
//! grant's two ends; each piece between two cuts records the newest grant covering it. A
//! grant covers a piece entirely or not at all, so a descriptor inside one piece is contained
//! by exactly the grants that overlap it, and the piece's newest grant is the answer.

use xfer_core::{Desc, MemType};

use crate::tables::PeerRegion;

/// A cut in the address line: memory type, device, address.
type Cut = (MemType, u64, u64);

#[derive(Debug, Default)]
pub(crate) struct GrantIndex {
    /// Every grant's start and end, sorted and without repeats.
    cuts: Vec<Cut>,
    /// `newest[k]`: the newest grant covering `[cuts[k], cuts[k + 1])`, for cuts of one
    /// memory type and device; `None` for a gap between grants and after a device's last cut.
    newest: Vec<Option<usize>>,
    /// Some grant is empty or ends past `u64::MAX` (`Agent::load_grant` loads neither): the
    /// rule treats those apart (an empty range "overlaps" a descriptor around it, a wrapping
    /// one everything after its start), so [`find`](GrantIndex::find) scans instead.
    scan_only: bool,
}

/// Whether the index can place `desc`: a non-empty range whose end fits in 64 bits.
fn indexable(desc: &Desc) -> bool {
    desc.len > 0 && desc.end().is_some()
}

impl GrantIndex {
    /// Indexes `grants`, oldest first.
    pub fn new(grants: &[PeerRegion]) -> GrantIndex {
        if !grants.iter().all(|g| indexable(&g.desc)) {
            return GrantIndex { cuts: Vec::new(), newest: Vec::new(), scan_only: true };
        }
        let mut cuts: Vec<Cut> = grants
            .iter()
            .flat_map(|g| {
                let end = g.desc.end().unwrap_or(u64::MAX);
                [(g.mem_type, g.desc.dev_id, g.desc.addr), (g.mem_type, g.desc.dev_id, end)]
            })
            .collect();
        cuts.sort_unstable();
        cuts.dedup();
        let mut newest = vec![None; cuts.len()];
        // Painting newest first, each piece is painted once: `next_unpainted` skips over
        // runs already painted (a union-find with path halving), so nested grants cost no
        // more than disjoint ones.
        let mut next_unpainted: Vec<usize> = (0..=cuts.len()).collect();
        let find = |next: &mut Vec<usize>, mut at: usize| {
            while next[at] != at {
                next[at] = next[next[at]];
                at = next[at];
            }
            at
        };
        for (rank, grant) in grants.iter().enumerate().rev() {
            let end = grant.desc.end().unwrap_or(u64::MAX);
            let (mem_type, dev) = (grant.mem_type, grant.desc.dev_id);
            let first = cuts.partition_point(|c| *c < (mem_type, dev, grant.desc.addr));
            let last = cuts.partition_point(|c| *c < (mem_type, dev, end));
            let mut piece = find(&mut next_unpainted, first);
            while piece < last {
                newest[piece] = Some(rank);
                next_unpainted[piece] = piece + 1;
                piece = find(&mut next_unpainted, piece + 1);
            }
        }
        GrantIndex { cuts, newest, scan_only: false }
    }

    /// The grant `desc` goes through among `grants` (the same slice the index was built
    /// from): the newest containing it, else the newest overlapping it, else none.
    pub fn find(&self, grants: &[PeerRegion], mem_type: MemType, desc: &Desc) -> Option<usize> {
        if self.scan_only || !indexable(desc) {
            return scan(grants, mem_type, desc);
        }
        let (a, b, dev) = (desc.addr, desc.end().unwrap_or(u64::MAX), desc.dev_id);
        let same_line = |k: usize| self.cuts[k].0 == mem_type && self.cuts[k].1 == dev;
        // The piece holding `a`, or the first piece after it when `a` precedes every cut.
        let after = self.cuts.partition_point(|c| *c <= (mem_type, dev, a));
        let first = if after > 0 && same_line(after - 1) { after - 1 } else { after };
        let mut starts_covered = first < self.cuts.len() && same_line(first) && self.cuts[first].2 <= a;
        let mut overlapping: Option<usize> = None;
        let (mut lowest, mut highest) = (usize::MAX, 0);
        let mut pieces = 0;
        let mut k = first;
        while k < self.cuts.len() && same_line(k) && self.cuts[k].2 < b {
            pieces += 1;
            match self.newest[k] {
                Some(rank) => {
                    overlapping = overlapping.max(Some(rank));
                    lowest = lowest.min(rank);
                    highest = highest.max(rank);
                }
                None => starts_covered = false,
            }
            k += 1;
        }
        // Every piece under `desc` is covered (a piece with a grant is never a line's last,
        // so the covered pieces reach `b`). One grant on all of them contains `desc`.
        if starts_covered && pieces > 0 {
            if lowest == highest {
                return Some(highest);
            }
            // Several grants share the pieces: one containing `desc` covers them all, so it
            // is at most the lowest rank seen; rare enough (a descriptor across the boundary
            // of a newer grant inside an older one) to scan for.
            if let Some(rank) = grants[..=lowest].iter().rposition(|g| g.mem_type == mem_type && g.desc.contains(desc))
            {
                return Some(rank);
            }
        }
        overlapping
    }
}

/// The reference rule, one grant at a time: the newest containing `desc`, else the newest
/// overlapping it.
fn scan(grants: &[PeerRegion], mem_type: MemType, desc: &Desc) -> Option<usize> {
    let of_type = |g: &PeerRegion| g.mem_type == mem_type;
    grants
        .iter()
        .rposition(|g| of_type(g) && g.desc.contains(desc))
        .or_else(|| grants.iter().rposition(|g| of_type(g) && g.desc.overlaps(desc)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(mem_type: MemType, addr: u64, len: u64, dev: u64) -> PeerRegion {
        PeerRegion { mem_type, desc: Desc::new(addr, len, dev), keys: vec![] }
    }

    fn granted(ranges: &[(u64, u64, u64)]) -> Vec<PeerRegion> {
        ranges.iter().map(|&(addr, len, dev)| grant(MemType::Dram, addr, len, dev)).collect()
    }

    fn find(grants: &[PeerRegion], addr: u64, len: u64, dev: u64) -> Option<usize> {
        let desc = Desc::new(addr, len, dev);
        let found = GrantIndex::new(grants).find(grants, MemType::Dram, &desc);
        assert_eq!(found, scan(grants, MemType::Dram, &desc), "index and scan disagree on {desc:?}");
        found
    }

    #[test]
    fn the_newest_containing_grant_wins_over_older_and_overlapping_ones() {
        // 0: [0, 400), 1: [100, 200) re-granted inside it, 2: [150, 300) across 1's end.
        let grants = granted(&[(0, 400, 0), (100, 100, 0), (150, 150, 0)]);
        assert_eq!(find(&grants, 0, 100, 0), Some(0));
        assert_eq!(find(&grants, 100, 50, 0), Some(1));
        assert_eq!(find(&grants, 160, 10, 0), Some(2));
        // Across 2's start: 1 contains it, though 2 is newer and overlaps it.
        assert_eq!(find(&grants, 120, 60, 0), Some(1));
        // Across 1's start: only 0 contains it, though 1 is newer and overlaps it.
        assert_eq!(find(&grants, 90, 60, 0), Some(0));
        assert_eq!(find(&grants, 140, 100, 0), Some(0));
        assert_eq!(find(&grants, 390, 10, 0), Some(0));
    }

    #[test]
    fn a_descriptor_no_grant_contains_goes_to_the_newest_overlapping_one() {
        let grants = granted(&[(0, 100, 0), (200, 100, 0), (50, 100, 0)]);
        // Spans the gap [150, 200): no grant contains it; 2 and 1 overlap it, 2 is newer.
        assert_eq!(find(&grants, 140, 70, 0), Some(2));
        // Starts before every grant.
        assert_eq!(find(&grants, 0, 1000, 0), Some(2));
        // Past the end of the last grant, and in a gap.
        assert_eq!(find(&grants, 300, 10, 0), None);
        assert_eq!(find(&grants, 150, 50, 0), None);
        assert_eq!(find(&grants, 290, 20, 0), Some(1));
    }

    #[test]
    fn devices_and_memory_types_are_separate_lines() {
        let mut grants = granted(&[(0, 100, 1), (0, 100, 0)]);
        grants.push(grant(MemType::Vram, 0, 1000, 0));
        assert_eq!(find(&grants, 10, 10, 1), Some(0));
        assert_eq!(find(&grants, 10, 10, 0), Some(1));
        assert_eq!(find(&grants, 10, 10, 2), None);
        assert_eq!(find(&grants, 90, 20, 1), Some(0));
        let index = GrantIndex::new(&grants);
        assert_eq!(index.find(&grants, MemType::Vram, &Desc::new(500, 10, 0)), Some(2));
        assert_eq!(index.find(&grants, MemType::File, &Desc::new(0, 10, 0)), None);
    }

    #[test]
    fn empty_and_wrapping_ranges_follow_the_scan_rule() {
        // Descriptors: an empty one is contained where it lies.
        let grants = granted(&[(0, 100, 0), (50, 100, 0)]);
        assert_eq!(find(&grants, 100, 0, 0), Some(1));
        assert_eq!(find(&grants, 20, 0, 0), Some(0));
        assert_eq!(find(&grants, 200, 0, 0), None);
        // Grants: an empty one "overlaps" a descriptor around it, a wrapping one what follows.
        let grants = granted(&[(100, 0, 0), (u64::MAX - 10, 100, 0), (0, 100, 0)]);
        assert_eq!(find(&grants, 100, 0, 0), Some(2));
        assert_eq!(find(&grants, 50, 0, 0), Some(2));
        assert_eq!(find(&granted(&[(0, 10, 0), (100, 0, 0)]), 90, 20, 0), Some(1));
        // The wrapping grant contains nothing but overlaps what lies after its start.
        assert_eq!(find(&grants, u64::MAX - 5, 2, 0), Some(1));
        assert_eq!(find(&grants, u64::MAX - 5, 10, 0), Some(1));
        assert_eq!(find(&grants, 90, 20, 0), Some(2));
        assert_eq!(find(&[], 0, 10, 0), None);
    }

    #[test]
    fn the_index_agrees_with_the_scan_on_random_overlapping_grants() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = |bound: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % bound
        };
        for _ in 0..200 {
            let grants: Vec<PeerRegion> =
                (0..next(12) + 1).map(|_| grant(MemType::Dram, next(64) * 8, (next(16) + 1) * 8, next(2))).collect();
            let index = GrantIndex::new(&grants);
            for _ in 0..50 {
                let desc = Desc::new(next(80) * 4, next(40) * 4, next(2));
                assert_eq!(
                    index.find(&grants, MemType::Dram, &desc),
                    scan(&grants, MemType::Dram, &desc),
                    "{desc:?} in {:?}",
                    grants.iter().map(|g| g.desc).collect::<Vec<_>>()
                );
            }
        }
    }
}
