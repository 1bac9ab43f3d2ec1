//! Pure planning of a transfer: pairing the host byte stream with the file byte stream, cutting
//! it into pieces the thread pool moves in parallel, and the checks every piece passes before
//! any byte moves.

use xfer_core::FileIoError;

/// One contiguous run: `len` bytes at `host_offset` of host piece `host` and `file_offset` of
/// file piece `file` (offsets relative to those pieces).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub host: usize,
    pub host_offset: u64,
    pub file: usize,
    pub file_offset: u64,
    pub len: u64,
}

/// Matches the two byte streams in order (their boundaries need not line up) and cuts runs at
/// `max_run` bytes so one large descriptor still spreads over the pool. Zero-length pieces
/// produce nothing. The caller checked that both sides hold the same number of bytes.
pub(crate) fn runs(host_lens: &[u64], file_lens: &[u64], max_run: u64) -> Vec<Run> {
    let max_run = max_run.max(1);
    let mut out = Vec::new();
    let (mut host, mut host_offset) = (0usize, 0u64);
    let (mut file, mut file_offset) = (0usize, 0u64);
    while host < host_lens.len() && file < file_lens.len() {
        let host_left = host_lens[host] - host_offset;
        let file_left = file_lens[file] - file_offset;
        if host_left == 0 {
            (host, host_offset) = (host + 1, 0);
            continue;
        }
        if file_left == 0 {
            (file, file_offset) = (file + 1, 0);
            continue;
        }
        let len = host_left.min(file_left).min(max_run);
        out.push(Run { host, host_offset, file, file_offset, len });
        host_offset += len;
        file_offset += len;
    }
    out
}

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

    fn total(runs: &[Run]) -> u64 {
        runs.iter().map(|r| r.len).sum()
    }

    #[test]
    fn streams_pair_across_unaligned_boundaries() {
        let got = runs(&[5, 0, 7], &[3, 9], 100);
        let want = vec![
            Run { host: 0, host_offset: 0, file: 0, file_offset: 0, len: 3 },
            Run { host: 0, host_offset: 3, file: 1, file_offset: 0, len: 2 },
            Run { host: 2, host_offset: 0, file: 1, file_offset: 2, len: 7 },
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn long_runs_are_cut() {
        let got = runs(&[10], &[10], 4);
        assert_eq!(
            got.iter().map(|r| (r.host_offset, r.file_offset, r.len)).collect::<Vec<_>>(),
            [(0, 0, 4), (4, 4, 4), (8, 8, 2)]
        );
        assert!(runs(&[], &[], 4).is_empty());
        assert!(runs(&[0, 0], &[0], 4).is_empty());
    }

    #[test]
    fn every_byte_is_covered_once_for_many_shapes() {
        for seed in 1..60u64 {
            let host: Vec<u64> = (0..seed % 9 + 1).map(|i| (i * seed * 7) % 23).collect();
            let sum: u64 = host.iter().sum();
            let mut file = Vec::new();
            let mut left = sum;
            let mut step = seed % 5 + 1;
            while left > 0 {
                let n = step.min(left);
                file.push(n);
                left -= n;
                step = step * 3 % 11 + 1;
            }
            let got = runs(&host, &file, seed % 6 + 1);
            assert_eq!(total(&got), sum);
            // Consecutive runs continue each other on both sides.
            let mut host_pos = 0;
            let mut file_pos = 0;
            for run in &got {
                let host_at: u64 = host[..run.host].iter().sum::<u64>() + run.host_offset;
                let file_at: u64 = file[..run.file].iter().sum::<u64>() + run.file_offset;
                assert_eq!((host_at, file_at), (host_pos, file_pos));
                assert!(run.host_offset + run.len <= host[run.host]);
                assert!(run.file_offset + run.len <= file[run.file]);
                host_pos += run.len;
                file_pos += run.len;
            }
        }
    }

    #[test]
    fn groups_respect_bytes_and_counts() {
        let lens = |runs: Vec<Run>| runs.iter().map(|r| r.len).collect::<Vec<_>>();
        let small = lens(runs(&[1; 10], &[10], 100));
        assert_eq!(group(&small, 1 << 20, 4), vec![0..4, 4..8, 8..10]);
        let big = lens(runs(&[30], &[30], 10));
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
