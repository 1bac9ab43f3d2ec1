//! Positioned reads and writes of registered files with the typed errors of [`FileIoError`]:
//! the one place the `pread`/`pwrite` loops live (the POSIX backend and staging both use them).

use std::io;
use std::os::fd::RawFd;

use crate::error::FileIoError;
use crate::mem::FileSlice;

/// Fills `buf` from `file` at `offset` (relative to the slice), retrying short reads.
pub fn read_exact_at(file: &FileSlice, offset: u64, buf: &mut [u8]) -> Result<(), FileIoError> {
    let at = file_offset(file, offset, buf.len())?;
    // SAFETY: `buf` is a live, exclusively borrowed byte slice of `buf.len()` bytes.
    unsafe { read_exact_raw(file.fd(), at, buf.as_mut_ptr(), buf.len()) }
}

/// Writes all of `buf` to `file` at `offset` (relative to the slice), retrying short writes.
pub fn write_all_at(file: &FileSlice, offset: u64, buf: &[u8]) -> Result<(), FileIoError> {
    let at = file_offset(file, offset, buf.len())?;
    // SAFETY: `buf` is a live byte slice of `buf.len()` bytes.
    unsafe { write_all_raw(file.fd(), at, buf.as_ptr(), buf.len()) }
}

/// The absolute file offset of `len` bytes at `offset` of `file`, checked to lie inside the slice
/// and to fit `off_t`.
pub(crate) fn file_offset(file: &FileSlice, offset: u64, len: usize) -> Result<u64, FileIoError> {
    let bad =
        || FileIoError::BadOffset { fd: file.fd(), offset: file.offset().saturating_add(offset), len: len as u64 };
    let end = offset.checked_add(len as u64).ok_or_else(bad)?;
    if end > file.len() {
        return Err(bad());
    }
    let at = file.offset().checked_add(offset).ok_or_else(bad)?;
    if at.checked_add(len as u64).is_none_or(|end| end > i64::MAX as u64) {
        return Err(bad());
    }
    Ok(at)
}

/// Reads `len` bytes at `offset` of `fd` into `ptr`; the end of the file before the last byte is
/// `ShortFile`.
///
/// # Safety
/// `ptr .. ptr + len` must be memory this process may write, not referenced by any Rust
/// reference while the call runs; `offset + len` must fit `off_t` (at most `i64::MAX`).
pub unsafe fn read_exact_raw(fd: RawFd, offset: u64, ptr: *mut u8, len: usize) -> Result<(), FileIoError> {
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        // SAFETY: `ptr + done .. ptr + len` is writable memory (this function's contract); `at`
        // fits `off_t` (also the contract).
        let n = unsafe { libc::pread(fd, ptr.add(done).cast(), len - done, at as libc::off_t) };
        match n {
            0 => return Err(FileIoError::ShortFile { fd, offset, len: len as u64, got: done as u64 }),
            n if n > 0 => done += n as usize,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(os_error(fd, "read", at, (len - done) as u64, err));
                }
            }
        }
    }
    Ok(())
}

/// Writes `len` bytes from `ptr` to `fd` at `offset`.
///
/// # Safety
/// `ptr .. ptr + len` must be readable memory of this process for the call's duration;
/// `offset + len` must fit `off_t`.
pub unsafe fn write_all_raw(fd: RawFd, offset: u64, ptr: *const u8, len: usize) -> Result<(), FileIoError> {
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        // SAFETY: as in `read_exact_raw`, except that the kernel only reads the memory.
        let n = unsafe { libc::pwrite(fd, ptr.add(done).cast(), len - done, at as libc::off_t) };
        match n {
            0 => {
                let err = io::Error::new(io::ErrorKind::WriteZero, "the file took no bytes");
                return Err(os_error(fd, "write", at, (len - done) as u64, err));
            }
            n if n > 0 => done += n as usize,
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(os_error(fd, "write", at, (len - done) as u64, err));
                }
            }
        }
    }
    Ok(())
}

/// The typed error of a failed `pread`/`pwrite` (or their io_uring forms) of `len` bytes at `offset`.
pub fn os_error(fd: RawFd, op: &'static str, offset: u64, len: u64, source: io::Error) -> FileIoError {
    if source.raw_os_error() == Some(libc::EBADF) {
        // EBADF is also the answer for a descriptor open the other way round.
        return match file_mode(fd) {
            Ok(mode) if op == "write" && !mode.writable => FileIoError::NotWritable { fd },
            Ok(mode) if op == "read" && !mode.readable => FileIoError::NotReadable { fd },
            _ => FileIoError::BadFd { fd, source },
        };
    }
    FileIoError::Os { fd, op, offset, len, source }
}

/// The alignment O_DIRECT asks of buffers, offsets and lengths: the largest common logical
/// block size.
pub const DIRECT_ALIGN: u64 = 4096;

/// The size of the file open as `fd`.
pub fn file_size(fd: RawFd) -> Result<u64, FileIoError> {
    let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `stat` into the provided buffer and reads nothing else; any integer
    // is a valid descriptor argument (an unknown one gives EBADF).
    if unsafe { libc::fstat(fd, stat.as_mut_ptr()) } != 0 {
        return Err(FileIoError::BadFd { fd, source: io::Error::last_os_error() });
    }
    // SAFETY: fstat succeeded, so it filled the structure.
    let stat = unsafe { stat.assume_init() };
    Ok(stat.st_size.max(0) as u64)
}

/// How a descriptor was opened, as far as the data path cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileMode {
    pub readable: bool,
    pub writable: bool,
    /// Opened with `O_DIRECT`: every transfer must be aligned.
    pub direct: bool,
}

/// The open mode of `fd`; `BadFd` when it is not an open descriptor.
pub fn file_mode(fd: RawFd) -> Result<FileMode, FileIoError> {
    // SAFETY: F_GETFL only reads the descriptor's status flags; any integer is a valid argument
    // (an unknown descriptor gives EBADF).
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(FileIoError::BadFd { fd, source: io::Error::last_os_error() });
    }
    let access = flags & libc::O_ACCMODE;
    Ok(FileMode {
        readable: access == libc::O_RDONLY || access == libc::O_RDWR,
        writable: access == libc::O_WRONLY || access == libc::O_RDWR,
        direct: flags & libc::O_DIRECT != 0,
    })
}
