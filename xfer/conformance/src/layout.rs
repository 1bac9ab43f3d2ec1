//! Scattered descriptor layouts: a request's byte stream cut into pieces of varied lengths,
//! placed at shuffled positions with gaps between them.

use rand::seq::SliceRandom;
use rand::Rng;

/// One descriptor: `len` bytes at buffer offset `off`, carrying stream bytes `pos .. pos + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub off: u64,
    pub len: u64,
    pub pos: u64,
}

/// A descriptor list in stream order, and the buffer window `0 .. window` it lies in.
#[derive(Clone, Debug)]
pub struct Layout {
    pub pieces: Vec<Piece>,
    pub window: u64,
}

/// Largest gap left between two pieces.
pub const MAX_GAP: u64 = 97;
/// Largest offset of the first piece (so single-descriptor transfers start off page).
pub const MAX_LEAD: u64 = 4093;

impl Layout {
    /// The bytes a layout of `count` pieces over `total` bytes may need at most.
    pub fn max_window(total: u64, count: usize) -> u64 {
        total + MAX_LEAD + count as u64 * MAX_GAP
    }

    /// `total` bytes cut at random points into `count` non-empty pieces, placed in shuffled
    /// order with random gaps. Needs `1 <= count <= total`.
    pub fn scatter(rng: &mut impl Rng, total: u64, count: usize) -> Layout {
        assert!(count >= 1 && count as u64 <= total, "{count} pieces of {total} bytes");
        // Distinct cut points in 1 .. total; sampling needs usize, which holds any buffer length.
        let mut cuts: Vec<u64> = match count {
            1 => Vec::new(),
            _ => {
                rand::seq::index::sample(rng, total as usize - 1, count - 1).into_iter().map(|i| i as u64 + 1).collect()
            }
        };
        cuts.sort_unstable();
        cuts.push(total);
        let mut pieces = Vec::with_capacity(count);
        let mut pos = 0;
        for cut in cuts {
            pieces.push(Piece { off: 0, len: cut - pos, pos });
            pos = cut;
        }
        let mut order: Vec<usize> = (0..count).collect();
        order.shuffle(rng);
        let mut cursor = rng.random_range(0..=MAX_LEAD);
        for index in order {
            pieces[index].off = cursor;
            cursor += pieces[index].len + rng.random_range(0..=MAX_GAP);
        }
        Layout { pieces, window: cursor }
    }

    /// `total` bytes cut at random points into `count` non-empty pieces in stream order, most
    /// starting where the one before ends (as an engine lists a KV run block by block; the agent
    /// merges those), about one in eight after a gap. Needs `1 <= count <= total`.
    pub fn runs(rng: &mut impl Rng, total: u64, count: usize) -> Layout {
        let mut layout = Layout::scatter(rng, total, count);
        let mut cursor = rng.random_range(0..=MAX_LEAD);
        for piece in &mut layout.pieces {
            if rng.random_ratio(1, 8) {
                cursor += rng.random_range(1..=MAX_GAP);
            }
            piece.off = cursor;
            cursor += piece.len;
        }
        layout.window = cursor;
        layout
    }

    /// The whole stream as one piece at `off`.
    pub fn contiguous(off: u64, total: u64) -> Layout {
        Layout { pieces: vec![Piece { off, len: total, pos: 0 }], window: off + total }
    }

    pub fn total(&self) -> u64 {
        self.pieces.iter().map(|p| p.len).sum()
    }

    /// Descriptors for a buffer at address `base`.
    pub fn descs(&self, base: u64) -> Vec<xfer::Desc> {
        self.pieces.iter().map(|p| xfer::Desc::new(base + p.off, p.len, 0)).collect()
    }

    /// The parts of `0 .. window` no piece covers, as `(off, len)`.
    pub fn gaps(&self) -> Vec<(u64, u64)> {
        let mut spans: Vec<(u64, u64)> = self.pieces.iter().map(|p| (p.off, p.len)).collect();
        spans.sort_unstable();
        let mut gaps = Vec::new();
        let mut cursor = 0;
        for (off, len) in spans {
            if off > cursor {
                gaps.push((cursor, off - cursor));
            }
            cursor = cursor.max(off + len);
        }
        if self.window > cursor {
            gaps.push((cursor, self.window - cursor));
        }
        gaps
    }
}

/// Walks two layouts of the same stream together: calls `f(a_off, b_off, len)` for every run of
/// stream bytes that lies in one piece of each.
pub fn zip_runs(a: &Layout, b: &Layout, mut f: impl FnMut(u64, u64, u64)) {
    let (mut i, mut j) = (0, 0);
    let (mut used_a, mut used_b) = (0, 0);
    while i < a.pieces.len() && j < b.pieces.len() {
        let (pa, pb) = (a.pieces[i], b.pieces[j]);
        let n = (pa.len - used_a).min(pb.len - used_b);
        if n > 0 {
            f(pa.off + used_a, pb.off + used_b, n);
        }
        used_a += n;
        used_b += n;
        if used_a == pa.len {
            i += 1;
            used_a = 0;
        }
        if used_b == pb.len {
            j += 1;
            used_b = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn scatter_covers_the_stream_without_overlap() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for (total, count) in [(1u64, 1usize), (4099, 4096), (4099, 7), (1 << 20, 1024)] {
            let layout = Layout::scatter(&mut rng, total, count);
            assert_eq!(layout.pieces.len(), count);
            assert_eq!(layout.total(), total);
            assert!(layout.window <= Layout::max_window(total, count));
            let covered: u64 = layout.gaps().iter().map(|g| g.1).sum::<u64>() + total;
            assert_eq!(covered, layout.window, "pieces overlap or leave the window");
            assert!(layout.pieces.windows(2).all(|w| w[0].pos + w[0].len == w[1].pos));
        }
    }

    #[test]
    fn runs_cover_the_stream_in_order_mostly_without_gaps() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let layout = Layout::runs(&mut rng, 1 << 20, 65536);
        assert_eq!((layout.pieces.len(), layout.total()), (65536, 1 << 20));
        assert!(layout.window <= Layout::max_window(1 << 20, 65536));
        assert!(layout.pieces.windows(2).all(|w| w[0].pos + w[0].len == w[1].pos && w[0].off + w[0].len <= w[1].off));
        let continuing = layout.pieces.windows(2).filter(|w| w[0].off + w[0].len == w[1].off).count();
        assert!((50_000..63_000).contains(&continuing), "{continuing} of 65535 pieces continue the one before");
    }

    #[test]
    fn zip_runs_pairs_stream_bytes() {
        let a =
            Layout { pieces: vec![Piece { off: 10, len: 5, pos: 0 }, Piece { off: 0, len: 3, pos: 5 }], window: 15 };
        let b = Layout::contiguous(100, 8);
        let mut runs = Vec::new();
        zip_runs(&a, &b, |x, y, n| runs.push((x, y, n)));
        assert_eq!(runs, vec![(10, 100, 5), (0, 105, 3)]);
    }
}
