//! Pure planning of a transfer: grouping the runs that pair the host byte stream with the file
//! byte stream (`xfer_core::split::pair_runs`) into tasks the workers move in parallel, and the
//! checks every run passes before any byte moves.

use xfer_core::FileIoError;

/// Groups consecutive runs (given by their lengths) into tasks of about `task_bytes` and at
/// most `max_runs` runs, so a request of many small descriptors costs one queue hop per task
/// rather than per run, and a large one still spreads over the workers.
pub(crate) fn group(run_lens: &[u64], task_bytes: u64, max_runs: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups = Vec::new();
    let (mut start, mut bytes) = (0usize, 0u64);
    for (index, &len) in run_lens.iter().enumerate() {
        if index > start && (bytes + len > task_bytes || index - start >= max_runs) {
            groups.push(start..index);
            (start, bytes) = (index, 0);
        }
        bytes += len;
    }
    if start < run_lens.len() {
        groups.push(start..run_lens.len());
    }
    groups
}

/// The largest file offset the file API addresses (`off_t` is signed).
const MAX_FILE_OFFSET: u64 = i64::MAX as u64;

/// A range the kernel can address: `offset + len` within `off_t`.
pub(crate) fn check_range(fd: i32, offset: u64, len: u64) -> Result<(), FileIoError> {
    match offset.checked_add(len) {
        Some(end) if end <= MAX_FILE_OFFSET => Ok(()),
        _ => Err(FileIoError::BadOffset { fd, offset, len }),
    }
}

/// O_DIRECT's rule: buffer address, length and file offset are each a multiple of `align`
/// (the device's logical block size; 4096 covers every common device).
pub(crate) fn check_direct(fd: i32, host_addr: u64, offset: u64, len: u64, align: u64) -> Result<(), FileIoError> {
    for (what, value) in [("buffer address", host_addr), ("file offset", offset), ("length", len)] {
        if !value.is_multiple_of(align) {
            return Err(FileIoError::Misaligned { fd, what, value, align });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_core::split::{pair_runs, PairedRun};

    #[test]
    fn groups_respect_bytes_and_counts() {
        let lens = |runs: Vec<PairedRun>| runs.iter().map(|r| r.len).collect::<Vec<_>>();
        let small = lens(pair_runs(&[1; 10], &[10], 100));
        assert_eq!(group(&small, 1 << 20, 4), vec![0..4, 4..8, 8..10]);
        let big = lens(pair_runs(&[30], &[30], 10));
        assert_eq!(group(&big, 15, 64), vec![0..1, 1..2, 2..3]);
        assert_eq!(group(&big, 20, 64), vec![0..2, 2..3]);
        assert!(group(&[], 10, 4).is_empty());
    }

    #[test]
    fn ranges_and_alignment_are_checked() {
        assert!(check_range(3, 0, 10).is_ok());
        assert!(check_range(3, i64::MAX as u64 - 10, 10).is_ok());
        assert!(matches!(check_range(3, i64::MAX as u64 - 10, 11), Err(FileIoError::BadOffset { .. })));
        assert!(matches!(check_range(3, u64::MAX, 2), Err(FileIoError::BadOffset { .. })));
        assert!(check_direct(3, 8192, 4096, 4096, 4096).is_ok());
        let err = check_direct(3, 8192, 4096, 100, 4096).unwrap_err();
        assert!(matches!(err, FileIoError::Misaligned { what: "length", value: 100, .. }), "{err}");
        let err = check_direct(3, 8193, 0, 4096, 4096).unwrap_err();
        assert!(matches!(err, FileIoError::Misaligned { what: "buffer address", .. }), "{err}");
        assert!(matches!(
            check_direct(3, 0, 512, 4096, 4096),
            Err(FileIoError::Misaligned { what: "file offset", .. })
        ));
    }
}
