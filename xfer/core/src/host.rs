//! Page-aligned host memory that can be registered safely and shared with remote peers:
//! [`HostBuffer`] from the global allocator, [`BackendBuffer`] allocated by a backend.

use std::alloc::{self, Layout};
use std::any::Any;

use crate::mem::Desc;

const PAGE: usize = 4096;

/// Memory an agent may register without `unsafe`: it stays mapped while any `Arc` of it lives,
/// and it hands out copies, never references.
///
/// # Safety
/// `desc()` must describe memory owned by the value for its whole life, readable and writable,
/// and never handed out as Rust references (remote peers may write it at any time).
pub unsafe trait HostMemory: Send + Sync + std::fmt::Debug + 'static {
    fn desc(&self) -> Desc;
}

/// A bounds-checked range of host memory that only hands out copies: the one place the
/// host-memory types ([`HostBuffer`], [`BackendBuffer`], [`SharedFile`](crate::SharedFile))
/// touch their bytes; each of them dereferences to it for its accessors.
#[derive(Debug)]
pub struct HostRegion {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: all access goes through raw copies whose ordering is the application's responsibility
// (see `HostBuffer`); the owner of the region keeps it alive.
unsafe impl Send for HostRegion {}
// SAFETY: as above.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// # Safety
    /// `ptr .. ptr + len` must stay valid for reads and writes for the region's life.
    pub(crate) unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        HostRegion { ptr, len }
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn addr(&self) -> u64 {
        self.ptr as usize as u64
    }

    /// The descriptor of the whole region (device 0).
    pub fn desc(&self) -> Desc {
        Desc::new(self.addr(), self.len as u64, 0)
    }

    /// The descriptor of `offset .. offset + len`; panics when out of range (a caller bug).
    pub fn sub_desc(&self, offset: usize, len: usize) -> Desc {
        self.check(offset, len);
        Desc::new(self.addr() + offset as u64, len as u64, 0)
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: the range is inside the region (checked, valid by `new`'s contract) and `dst`
        // is a distinct Rust buffer, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    /// Copies `src` into the region at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: as in `read_at`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) }
    }

    /// Copies the whole region out.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len];
        self.read_at(0, &mut out);
        out
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "range outside buffer");
    }
}

/// A zero-initialised, page-aligned host allocation meant for registration.
///
/// Its bytes may be written by remote peers while it is registered, so it hands out copies
/// (`read_at`, `write_at`) rather than references; the application orders accesses through
/// completions and notifications, as with any memory shared with a NIC.
#[derive(Debug)]
pub struct HostBuffer {
    region: HostRegion,
}

impl HostBuffer {
    /// Allocates `len` zeroed bytes (at least one page is reserved so the address is unique).
    pub fn new(len: usize) -> Self {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size (at least one page).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            alloc::handle_alloc_error(layout);
        }
        // SAFETY: a fresh allocation of at least `len` bytes, freed only in `drop`.
        HostBuffer { region: unsafe { HostRegion::new(ptr, len) } }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(PAGE), PAGE).expect("allocation size overflows")
    }
}

impl std::ops::Deref for HostBuffer {
    type Target = HostRegion;
    fn deref(&self) -> &HostRegion {
        &self.region
    }
}

// SAFETY: the allocation lives until drop and is only accessed through copies.
unsafe impl HostMemory for HostBuffer {
    fn desc(&self) -> Desc {
        self.region.desc()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this same layout and is freed once.
        unsafe { alloc::dealloc(self.region.ptr(), Self::layout(self.region.len())) }
    }
}

/// Host memory allocated by a backend (see `Backend::allocate`), e.g. UCX's shared-memory
/// segments, which a peer on the same host maps so that its puts and gets are plain copies.
/// Used like a [`HostBuffer`]: bounds-checked copies in and out, registrable as
/// [`HostMemory`]. Dropping the last `Arc` of it (registrations hold one) releases the
/// backend's allocation.
pub struct BackendBuffer {
    region: HostRegion,
    backend: &'static str,
    /// Owns the backend's allocation: dropped after the last use of `region`.
    _allocation: Box<dyn Any + Send + Sync>,
}

impl std::fmt::Debug for BackendBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendBuffer")
            .field("backend", &self.backend)
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("len", &self.len())
            .finish_non_exhaustive()
    }
}

impl BackendBuffer {
    /// Wraps a backend's allocation. The bytes are zeroed here, so every buffer starts the way
    /// a [`HostBuffer`] does (and its pages are touched before the first transfer).
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be readable and writable host memory of this process that stays
    /// mapped until `allocation` is dropped, and that nothing else hands out as Rust references.
    pub unsafe fn new(ptr: *mut u8, len: usize, backend: &'static str, allocation: Box<dyn Any + Send + Sync>) -> Self {
        // SAFETY: forwarded from this function's contract; `allocation` is dropped only with
        // the buffer, after the region's last use.
        let region = unsafe { HostRegion::new(ptr, len) };
        let buffer = BackendBuffer { region, backend, _allocation: allocation };
        const CHUNK: usize = 64 << 10;
        let zeros = [0u8; CHUNK];
        let mut offset = 0;
        while offset < len {
            let n = CHUNK.min(len - offset);
            buffer.write_at(offset, &zeros[..n]);
            offset += n;
        }
        buffer
    }

    /// The backend that allocated the memory.
    pub fn backend(&self) -> &'static str {
        self.backend
    }
}

impl std::ops::Deref for BackendBuffer {
    type Target = HostRegion;
    fn deref(&self) -> &HostRegion {
        &self.region
    }
}

// SAFETY: the allocation stays mapped while the buffer lives (`new`'s contract) and is only
// accessed through copies.
unsafe impl HostMemory for BackendBuffer {
    fn desc(&self) -> Desc {
        self.region.desc()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A backend allocation for tests: a HostBuffer, with a flag raised when it is released.
    struct Released {
        _memory: HostBuffer,
        flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    }

    impl Drop for Released {
        fn drop(&mut self) {
            self.flag.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[test]
    fn backend_buffer_copies_zeroes_and_releases() {
        let released = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let inner = HostBuffer::new(200_000);
        inner.write_at(0, &[9u8; 100]);
        let (ptr, len) = (inner.addr() as usize as *mut u8, inner.len());
        // SAFETY: the HostBuffer moves into the allocation box and lives as long as the buffer.
        let buf = unsafe {
            BackendBuffer::new(ptr, len, "test", Box::new(Released { _memory: inner, flag: released.clone() }))
        };
        assert_eq!(buf.backend(), "test");
        assert_eq!(buf.desc(), Desc::new(ptr as usize as u64, 200_000, 0));
        assert!(buf.to_vec().iter().all(|&b| b == 0), "not zeroed");
        buf.write_at(199_990, &[5u8; 10]);
        let mut out = [0u8; 12];
        buf.read_at(199_988, &mut out);
        assert_eq!(out, [0, 0, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]);
        assert_eq!(buf.sub_desc(10, 20), Desc::new(buf.addr() + 10, 20, 0));
        assert!(!released.load(std::sync::atomic::Ordering::SeqCst));
        drop(buf);
        assert!(released.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    #[should_panic(expected = "range outside buffer")]
    fn backend_buffer_out_of_range_panics() {
        let inner = HostBuffer::new(64);
        let (ptr, len) = (inner.addr() as usize as *mut u8, inner.len());
        // SAFETY: as above.
        let buf = unsafe { BackendBuffer::new(ptr, len, "test", Box::new(inner)) };
        let mut out = [0u8; 2];
        buf.read_at(63, &mut out);
    }

    #[test]
    fn copies_in_and_out() {
        let buf = HostBuffer::new(10_000);
        assert_eq!(buf.addr() % PAGE as u64, 0);
        buf.write_at(9_990, &[5u8; 10]);
        let mut out = [0u8; 12];
        buf.read_at(9_988, &mut out);
        assert_eq!(out, [0, 0, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]);
    }

    #[test]
    #[should_panic(expected = "range outside buffer")]
    fn out_of_range_panics() {
        HostBuffer::new(10).write_at(5, &[0u8; 6]);
    }
}
