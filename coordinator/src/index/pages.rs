//! Hints about the index's memory, neither of which changes a value:
//!
//! - [`advise_huge`] asks the kernel to back a big table with huge pages where it allows them on
//!   request (transparent huge pages set to `madvise`, as on many distributions; with `always`
//!   it does so anyway, with `never` this changes nothing). A table of millions of blocks spans
//!   tens of MiB, and its probes land on random pages. With 4 KiB pages nearly every probe also
//!   misses the TLB, and a fresh table faults in one page per 4 KiB as it fills (about 2 µs each
//!   on our VM). 2 MiB pages take both costs away (BENCH.md, "Huge pages for the block table").
//! - [`prefetch`] asks the CPU for a cache line ahead of its use, so that a batch of probes (a
//!   lookup's chunk, a store's, a run of removals) overlaps its misses (BENCH.md, "Prefetched
//!   probes").

/// The huge page size of x86-64 and of arm64 with 4 KiB pages; where it is larger, ranges this
/// small are simply never backed by one.
const HUGE_PAGE: usize = 2 << 20;

/// Advises huge pages for every whole, aligned 2 MiB stretch of `memory`, and says whether the
/// kernel took the advice (false too where `memory` holds no such stretch). Best effort: a kernel
/// without transparent huge pages refuses, and the table works as before. Call it before the
/// memory is first written, so that its pages are faulted in huge.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub(super) fn advise_huge<T>(memory: &mut [T]) -> bool {
    let start = memory.as_mut_ptr() as usize;
    let end = start + std::mem::size_of_val(memory);
    let (first, last) = (start.next_multiple_of(HUGE_PAGE), end / HUGE_PAGE * HUGE_PAGE);
    if first >= last {
        return false;
    }
    // SAFETY: [first, last) lies inside `memory`, which is borrowed mutably for the call, so
    // nothing else refers to it. MADV_HUGEPAGE changes only how the kernel backs those pages,
    // never what they hold, so no value in them changes.
    unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_HUGEPAGE) == 0 }
}

#[cfg(not(target_os = "linux"))]
pub(super) fn advise_huge<T>(_memory: &mut [T]) -> bool {
    false
}

/// Asks the CPU to start loading the cache line holding `value` into its caches, without
/// waiting for it: a batch of probes issued this way overlaps its cache misses and leaves the
/// CPU free to work meanwhile (a load whose value is kept would hold up the instructions
/// behind it until it arrives). A hint: it changes no value and never faults. A no-op where
/// there is no such instruction here.
#[inline(always)]
#[allow(unsafe_code)]
pub(super) fn prefetch<T>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 only moves a line into the caches; it reads no value into the program,
    // and `value` is a live reference anyway. SSE, which has it, is part of every x86-64 CPU.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((value as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// The kernel marks the advised stretch (its mapping's `VmFlags` gain `hg`); a slice with no
    /// whole aligned 2 MiB stretch is left alone.
    #[test]
    fn advice_reaches_the_kernel() {
        assert!(!advise_huge(&mut vec![0u64; 1000]), "nothing to advise in 8 KB");
        let mut table = vec![0u64; 1 << 20]; // 8 MiB
        if !advise_huge(&mut table) {
            let thp = "/sys/kernel/mm/transparent_hugepage";
            assert!(!std::path::Path::new(thp).exists(), "the kernel refused the advice, though it has {thp}");
            eprintln!("advice_reaches_the_kernel: this kernel has no transparent huge pages; checked the refusal only");
            return;
        }
        let inside = table.as_ptr() as usize + (4 << 20);
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        let mut in_range = false;
        let mut flags = None;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ').filter(|(r, _)| r.contains('-') && !r.ends_with(':')) {
                let (lo, hi) = range.split_once('-').expect("a range");
                let (lo, hi) = (usize::from_str_radix(lo, 16).unwrap_or(0), usize::from_str_radix(hi, 16).unwrap_or(0));
                in_range = lo <= inside && inside < hi;
            } else if in_range && line.starts_with("VmFlags:") {
                flags = Some(line.to_string());
            }
        }
        let flags = flags.expect("the table's mapping is in /proc/self/smaps");
        assert!(flags.split_whitespace().any(|f| f == "hg"), "no huge-page advice on the table's mapping: {flags}");
        table[0] = 1; // still ordinary memory
        assert_eq!(table.iter().sum::<u64>(), 1);
    }
}
