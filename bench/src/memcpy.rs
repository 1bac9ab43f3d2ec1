//! Single-thread memcpy bandwidth per block size: the ceiling a shared-memory transport is
//! compared with, measured in the same run as the transfers.

use std::time::{Duration, Instant};

use crate::memory::PageBuf;
use crate::units::{format_size, gbps};

/// How long each size is copied for.
const SPAN: Duration = Duration::from_millis(300);

/// GB/s of copying `block` bytes between two page-aligned, resident buffers on this thread.
pub fn bandwidth(block: u64) -> f64 {
    let len = block as usize;
    let src = PageBuf::new(len);
    let mut dst = PageBuf::new(len);
    dst.copy_from_slice(&src); // warm up: caches, TLB
    let started = Instant::now();
    let mut copies = 0u64;
    while started.elapsed() < SPAN {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copies += 1;
    }
    gbps(copies * block, started.elapsed())
}

/// The lines `--memcpy` prints before the table.
pub fn report(blocks: &[u64]) -> Vec<String> {
    blocks
        .iter()
        .map(|&block| format!("memcpy {} {:.3} GB/s (one thread)", format_size(block), bandwidth(block)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_measurably() {
        assert!(bandwidth(64 << 10) > 0.0);
        assert!(report(&[4096])[0].starts_with("memcpy 4K "), "{:?}", report(&[4096]));
    }
}
