//! Splitting a transfer's segment lists into consecutive byte ranges (for parallel streams).

use crate::backend::RemoteSeg;
use crate::mem::LocalMem;

/// A contiguous piece that can be cut in two.
pub trait Segment: Sized {
    fn seg_len(&self) -> u64;
    /// Removes and returns the first `n` bytes (`n < seg_len`).
    fn take_front(&mut self, n: u64) -> Self;
}

impl Segment for LocalMem {
    fn seg_len(&self) -> u64 {
        self.len()
    }

    fn take_front(&mut self, n: u64) -> Self {
        self.split_front(n)
    }
}

impl Segment for RemoteSeg {
    fn seg_len(&self) -> u64 {
        self.len
    }

    fn take_front(&mut self, n: u64) -> Self {
        let front = RemoteSeg { key: self.key.clone(), addr: self.addr, len: n };
        self.addr += n;
        self.len -= n;
        front
    }
}

/// At most `parts` sizes adding up to `total`, as equal as possible, each but the last a
/// multiple of `align` (so every cut of an O_DIRECT file stays aligned; `align` 1 cuts anywhere).
/// Earlier parts get the remainder.
pub fn even_sizes(total: u64, parts: usize, align: u64) -> Vec<u64> {
    let align = align.max(1);
    let units = total.div_ceil(align);
    let parts = (parts.max(1) as u64).min(units.max(1));
    let (base, extra) = (units / parts, units % parts);
    let mut sizes: Vec<u64> = (0..parts).map(|i| (base + u64::from(i < extra)) * align).collect();
    // The units cover `total` rounded up to `align`: the last part gives the difference back.
    if let Some(last) = sizes.last_mut() {
        *last -= units * align - total;
    }
    sizes.retain(|&size| size > 0);
    sizes
}

/// Cuts `segs` into consecutive groups holding `sizes[i]` bytes each, splitting segments that
/// straddle a boundary. Zero-length segments are dropped. Bytes beyond `sum(sizes)` are dropped
/// too, so callers pass sizes that add up to the total.
pub fn split_by_sizes<S: Segment>(segs: Vec<S>, sizes: &[u64]) -> Vec<Vec<S>> {
    let mut groups: Vec<Vec<S>> = sizes.iter().map(|_| Vec::new()).collect();
    let mut group = 0;
    let mut room = sizes.first().copied().unwrap_or(0);
    for mut seg in segs {
        while seg.seg_len() > 0 && group < sizes.len() {
            if room == 0 {
                group += 1;
                room = sizes.get(group).copied().unwrap_or(0);
                continue;
            }
            if seg.seg_len() <= room {
                room -= seg.seg_len();
                groups[group].push(seg);
                break;
            }
            let front = seg.take_front(room);
            groups[group].push(front);
            room = 0;
        }
    }
    groups
}

/// One contiguous run of a memory ↔ file transfer: `len` bytes at `mem_offset` of memory piece
/// `mem` and `file_offset` of file piece `file` (offsets relative to those pieces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PairedRun {
    pub mem: usize,
    pub mem_offset: u64,
    pub file: usize,
    pub file_offset: u64,
    pub len: u64,
}

/// Matches the memory and file byte streams in order (their boundaries need not line up) and cuts runs at
/// `max_run` bytes so one large descriptor still spreads over workers. Zero-length pieces
/// produce nothing. The caller checked that both sides hold the same number of bytes.
pub fn pair_runs(mem_lens: &[u64], file_lens: &[u64], max_run: u64) -> Vec<PairedRun> {
    let max_run = max_run.max(1);
    let mut out = Vec::new();
    let (mut mem, mut mem_offset) = (0usize, 0u64);
    let (mut file, mut file_offset) = (0usize, 0u64);
    while mem < mem_lens.len() && file < file_lens.len() {
        let mem_left = mem_lens[mem] - mem_offset;
        let file_left = file_lens[file] - file_offset;
        if mem_left == 0 {
            (mem, mem_offset) = (mem + 1, 0);
            continue;
        }
        if file_left == 0 {
            (file, file_offset) = (file + 1, 0);
            continue;
        }
        let len = mem_left.min(file_left).min(max_run);
        out.push(PairedRun { mem, mem_offset, file, file_offset, len });
        mem_offset += len;
        file_offset += len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Span(u64, u64);

    impl Segment for Span {
        fn seg_len(&self) -> u64 {
            self.1
        }
        fn take_front(&mut self, n: u64) -> Self {
            let front = Span(self.0, n);
            self.0 += n;
            self.1 -= n;
            front
        }
    }

    #[test]
    fn even_sizes_add_up() {
        assert_eq!(even_sizes(10, 3, 1), vec![4, 3, 3]);
        assert_eq!(even_sizes(2, 4, 1), vec![1, 1]);
        assert_eq!(even_sizes(0, 4, 1), Vec::<u64>::new());
        assert_eq!(even_sizes(7, 0, 1), vec![7]);
        // Aligned: every part but the last a multiple of the alignment.
        assert_eq!(even_sizes(10 * 4096 + 5, 3, 4096), vec![4 * 4096, 4 * 4096, 2 * 4096 + 5]);
        assert_eq!(even_sizes(4096, 4, 4096), vec![4096]);
        assert_eq!(even_sizes(100, 2, 4096), vec![100]);
        assert_eq!(even_sizes(3 * 4096, 3, 4096), vec![4096; 3]);
    }

    #[test]
    fn splits_across_boundaries() {
        let segs = vec![Span(0, 5), Span(100, 0), Span(10, 7), Span(50, 3)];
        let groups = split_by_sizes(segs, &[6, 6, 3]);
        assert_eq!(groups[0], vec![Span(0, 5), Span(10, 1)]);
        assert_eq!(groups[1], vec![Span(11, 6)]);
        assert_eq!(groups[2], vec![Span(50, 3)]);
    }

    #[test]
    fn total_is_preserved_for_many_shapes() {
        for n_segs in 1..20u64 {
            for parts in 1..7 {
                let segs: Vec<Span> = (0..n_segs).map(|i| Span(i * 1000, i * 7 % 13 + 1)).collect();
                let total: u64 = segs.iter().map(|s| s.1).sum();
                let sizes = even_sizes(total, parts, 1);
                let groups = split_by_sizes(segs, &sizes);
                for (group, size) in groups.iter().zip(&sizes) {
                    assert_eq!(group.iter().map(|s| s.1).sum::<u64>(), *size);
                }
            }
        }
    }

    #[test]
    fn streams_pair_across_unaligned_boundaries() {
        let got = pair_runs(&[5, 0, 7], &[3, 9], 100);
        let want = vec![
            PairedRun { mem: 0, mem_offset: 0, file: 0, file_offset: 0, len: 3 },
            PairedRun { mem: 0, mem_offset: 3, file: 1, file_offset: 0, len: 2 },
            PairedRun { mem: 2, mem_offset: 0, file: 1, file_offset: 2, len: 7 },
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn long_runs_are_cut() {
        let got = pair_runs(&[10], &[10], 4);
        assert_eq!(
            got.iter().map(|r| (r.mem_offset, r.file_offset, r.len)).collect::<Vec<_>>(),
            [(0, 0, 4), (4, 4, 4), (8, 8, 2)]
        );
        assert!(pair_runs(&[], &[], 4).is_empty());
        assert!(pair_runs(&[0, 0], &[0], 4).is_empty());
    }

    #[test]
    fn every_byte_is_covered_once_for_many_shapes() {
        for seed in 1..60u64 {
            let mem: Vec<u64> = (0..seed % 9 + 1).map(|i| (i * seed * 7) % 23).collect();
            let sum: u64 = mem.iter().sum();
            let mut file = Vec::new();
            let mut left = sum;
            let mut step = seed % 5 + 1;
            while left > 0 {
                let n = step.min(left);
                file.push(n);
                left -= n;
                step = step * 3 % 11 + 1;
            }
            let got = pair_runs(&mem, &file, seed % 6 + 1);
            assert_eq!(got.iter().map(|r| r.len).sum::<u64>(), sum);
            // Consecutive runs continue each other on both sides.
            let mut mem_pos = 0;
            let mut file_pos = 0;
            for run in &got {
                let mem_at: u64 = mem[..run.mem].iter().sum::<u64>() + run.mem_offset;
                let file_at: u64 = file[..run.file].iter().sum::<u64>() + run.file_offset;
                assert_eq!((mem_at, file_at), (mem_pos, file_pos));
                assert!(run.mem_offset + run.len <= mem[run.mem]);
                assert!(run.file_offset + run.len <= file[run.file]);
                mem_pos += run.len;
                file_pos += run.len;
            }
        }
    }
}
