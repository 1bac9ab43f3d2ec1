//! The POSIX backend's only `unsafe`: the positioned reads and writes of registered host memory
//! (through `xfer_core::file_io`, where the loops and their typed errors live) and the io_uring
//! that owns buffers in flight ([`ring`]).

#![allow(unsafe_code)]

pub(crate) mod ring;

use std::os::fd::RawFd;

pub(crate) use xfer_core::file_io::{file_mode, os_error, FileMode};
use xfer_core::{file_io, FileIoError, MemSlice};

/// Fills `host` from `fd` at `offset`; the end of the file before the last byte is `ShortFile`.
pub(crate) fn read_exact_at(fd: RawFd, offset: u64, host: &mut MemSlice) -> Result<(), FileIoError> {
    let len = host.len();
    // SAFETY: `host` is pinned registered host memory that stays allocated while the slice lives
    // (`LocalRegion::new`'s contract). The kernel writes it the way a NIC's DMA would: no Rust
    // reference to registered memory exists (`HostMemory` hands out copies), and the application
    // does not let another transfer use these bytes meanwhile (the contract of registered
    // memory). `offset + len` fits `off_t`: the plan checked `offset + len <= i64::MAX`.
    unsafe { file_io::read_exact_raw(fd, offset, host.as_mut_ptr(), len) }
}

/// Writes all of `host` to `fd` at `offset`.
pub(crate) fn write_all_at(fd: RawFd, offset: u64, host: &MemSlice) -> Result<(), FileIoError> {
    // SAFETY: as in `read_exact_at`, except that the kernel only reads the memory.
    unsafe { file_io::write_all_raw(fd, offset, host.as_ptr(), host.len()) }
}
