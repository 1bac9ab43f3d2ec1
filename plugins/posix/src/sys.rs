//! The POSIX backend's only `unsafe`: the libc calls that read and write files and ask the
//! kernel how a descriptor was opened, and the io_uring that owns buffers in flight ([`ring`]).

#![allow(unsafe_code)]

pub(crate) mod ring;

use std::io;
use std::os::fd::RawFd;

use xfer_core::{FileIoError, MemSlice};

/// How a descriptor was opened, as far as the data path cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileMode {
    pub readable: bool,
    pub writable: bool,
    /// Opened with `O_DIRECT`: every transfer must be aligned.
    pub direct: bool,
}

/// The open mode of `fd`; `BadFd` when it is not an open descriptor.
pub(crate) fn file_mode(fd: RawFd) -> Result<FileMode, FileIoError> {
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

/// Fills `host` from `fd` at `offset`, retrying short reads; the end of the file before the
/// last byte is `ShortFile`.
pub(crate) fn read_exact_at(fd: RawFd, offset: u64, host: &mut MemSlice) -> Result<(), FileIoError> {
    let len = host.len();
    let base = host.as_mut_ptr();
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        // SAFETY: `base + done .. base + len` lies inside `host`, pinned registered host memory
        // that stays allocated while the slice lives (`LocalRegion::new`'s contract). The kernel
        // writes it the way a NIC's DMA would: no Rust reference to registered memory exists
        // (`HostMemory` hands out copies), and the application does not let another transfer
        // use these bytes meanwhile (the contract of registered memory). `at` fits `off_t`:
        // the plan checked `offset + len <= i64::MAX`.
        let n = unsafe { libc::pread(fd, base.add(done).cast(), len - done, at as libc::off_t) };
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

/// Writes all of `host` to `fd` at `offset`, retrying short writes.
pub(crate) fn write_all_at(fd: RawFd, offset: u64, host: &MemSlice) -> Result<(), FileIoError> {
    let len = host.len();
    let base = host.as_ptr();
    let mut done = 0usize;
    while done < len {
        let at = offset + done as u64;
        // SAFETY: as in `read_exact_at`, except that the kernel only reads the memory.
        let n = unsafe { libc::pwrite(fd, base.add(done).cast(), len - done, at as libc::off_t) };
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

pub(crate) fn os_error(fd: RawFd, op: &'static str, offset: u64, len: u64, source: io::Error) -> FileIoError {
    // EBADF after registration checked the descriptor: it was closed (or reopened otherwise).
    if source.raw_os_error() == Some(libc::EBADF) {
        return FileIoError::BadFd { fd, source };
    }
    FileIoError::Os { fd, op, offset, len, source }
}
