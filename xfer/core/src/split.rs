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

/// `parts` sizes adding up to `total`, as equal as possible (earlier parts get the remainder).
pub fn even_sizes(total: u64, parts: usize) -> Vec<u64> {
    let parts = parts.max(1) as u64;
    let base = total / parts;
    let extra = total % parts;
    (0..parts).map(|i| base + u64::from(i < extra)).filter(|&size| size > 0).collect()
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
        assert_eq!(even_sizes(10, 3), vec![4, 3, 3]);
        assert_eq!(even_sizes(2, 4), vec![1, 1]);
        assert_eq!(even_sizes(0, 4), Vec::<u64>::new());
        assert_eq!(even_sizes(7, 0), vec![7]);
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
                let sizes = even_sizes(total, parts);
                let groups = split_by_sizes(segs, &sizes);
                for (group, size) in groups.iter().zip(&sizes) {
                    assert_eq!(group.iter().map(|s| s.1).sum::<u64>(), *size);
                }
            }
        }
    }
}
