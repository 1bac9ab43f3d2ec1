//! Registered memory: regions, the usage gate that keeps deregistration from freeing memory
//! under a transfer, and the slices backends copy through.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use crate::error::BackendError;

/// Kind of memory a descriptor points at (NIXL's segment types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum MemType {
    /// Host memory, addressable by the CPU.
    Dram,
    /// GPU memory; `dev_id` is the CUDA device ordinal.
    Vram,
    /// A file; `dev_id` is the file descriptor, `addr` the offset in the file.
    File,
    /// Block device (reserved).
    Blk,
    /// Object store (reserved).
    Obj,
}

impl MemType {
    pub const ALL: [MemType; 5] = [MemType::Dram, MemType::Vram, MemType::File, MemType::Blk, MemType::Obj];
}

/// A memory type name that is none of NIXL's (`DRAM`, `VRAM`, `FILE`, `BLK`, `OBJ`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown memory type {0:?} (expected DRAM, VRAM, FILE, BLK or OBJ)")]
pub struct UnknownMemType(pub String);

impl std::str::FromStr for MemType {
    type Err = UnknownMemType;

    /// NIXL's names, in any case, and the torch device types `cpu` and `cuda`.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name.to_ascii_uppercase().as_str() {
            "DRAM" | "CPU" => Ok(MemType::Dram),
            "VRAM" | "CUDA" => Ok(MemType::Vram),
            "FILE" => Ok(MemType::File),
            "BLK" => Ok(MemType::Blk),
            "OBJ" => Ok(MemType::Obj),
            _ => Err(UnknownMemType(name.to_string())),
        }
    }
}

impl std::fmt::Display for MemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemType::Dram => "DRAM",
            MemType::Vram => "VRAM",
            MemType::File => "FILE",
            MemType::Blk => "BLK",
            MemType::Obj => "OBJ",
        })
    }
}

/// One contiguous piece of memory: `(address, length, device id)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Desc {
    pub addr: u64,
    pub len: u64,
    pub dev_id: u64,
}

impl Desc {
    pub fn new(addr: u64, len: u64, dev_id: u64) -> Self {
        Desc { addr, len, dev_id }
    }

    /// One past the last byte, or `None` when the range wraps around the address space.
    pub fn end(&self) -> Option<u64> {
        self.addr.checked_add(self.len)
    }

    /// Whether the two ranges share a byte on the same device.
    pub fn overlaps(&self, other: &Desc) -> bool {
        self.dev_id == other.dev_id
            && self.addr < other.end().unwrap_or(u64::MAX)
            && other.addr < self.end().unwrap_or(u64::MAX)
    }

    /// Whether `inner` lies entirely within `self` on the same device.
    pub fn contains(&self, inner: &Desc) -> bool {
        match (self.end(), inner.end()) {
            (Some(end), Some(inner_end)) => self.dev_id == inner.dev_id && inner.addr >= self.addr && inner_end <= end,
            _ => false,
        }
    }
}

const CLOSED: u64 = 1 << 63;

/// A registered region of local memory. Created by the agent's registration; backends look
/// regions up by their own keys and [`pin`](LocalRegion::pin) them for the duration of each
/// transfer.
#[derive(Debug)]
pub struct LocalRegion {
    id: u64,
    mem_type: MemType,
    desc: Desc,
    /// Low bits: transfers currently using the region. High bit: closed for new users.
    users: AtomicU64,
    idle_lock: Mutex<()>,
    idle: Condvar,
}

impl LocalRegion {
    /// Describes a registered region.
    ///
    /// # Safety
    /// For `MemType::Dram`, `desc.addr .. desc.addr + desc.len` must be memory of this process
    /// that stays allocated, and is not used by Rust code through references that assume
    /// exclusive access, until [`close_and_wait`](LocalRegion::close_and_wait) has returned.
    pub unsafe fn new(id: u64, mem_type: MemType, desc: Desc) -> Self {
        LocalRegion { id, mem_type, desc, users: AtomicU64::new(0), idle_lock: Mutex::new(()), idle: Condvar::new() }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn mem_type(&self) -> MemType {
        self.mem_type
    }

    pub fn desc(&self) -> Desc {
        self.desc
    }

    /// Marks the region used by one more transfer. `None` once deregistration has begun.
    pub fn pin(self: &Arc<Self>) -> Option<Pin> {
        let before = self.users.fetch_add(1, Ordering::Acquire);
        if before & CLOSED != 0 {
            self.unpin();
            return None;
        }
        Some(Pin(Arc::new(PinInner { region: Arc::clone(self) })))
    }

    fn unpin(&self) {
        let before = self.users.fetch_sub(1, Ordering::Release);
        if before == CLOSED | 1 {
            let _guard = self.idle_lock.lock();
            self.idle.notify_all();
        }
    }

    /// Number of transfers using the region right now.
    pub fn users(&self) -> u64 {
        self.users.load(Ordering::Acquire) & !CLOSED
    }

    /// Refuses new pins, then waits until no transfer uses the region. Transfers are bounded by
    /// their backends' timeouts, so this returns; a warning is logged by the caller when
    /// `warn_after` elapses (returning `false`), and the caller keeps waiting — freeing memory a
    /// transfer still touches is never an option.
    pub fn close_and_wait(&self, warn_after: Duration) -> bool {
        self.users.fetch_or(CLOSED, Ordering::AcqRel);
        let deadline = Instant::now() + warn_after;
        let mut guard = self.idle_lock.lock();
        while self.users() != 0 {
            if self.idle.wait_until(&mut guard, deadline).timed_out() {
                return self.users() == 0;
            }
        }
        true
    }

    pub fn is_closed(&self) -> bool {
        self.users.load(Ordering::Acquire) & CLOSED != 0
    }
}

#[derive(Debug)]
struct PinInner {
    region: Arc<LocalRegion>,
}

impl Drop for PinInner {
    fn drop(&mut self) {
        self.region.unpin();
    }
}

/// Keeps a region registered (and its memory alive) while a transfer uses it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Pin(Arc<PinInner>);

impl Pin {
    pub fn region(&self) -> &Arc<LocalRegion> {
        &self.0.region
    }

    /// A host-memory slice `offset .. offset + len` of the pinned region; `None` when the range
    /// is outside the region or the region is not host memory.
    pub fn slice(&self, offset: u64, len: u64) -> Option<MemSlice> {
        let region = &self.0.region;
        if region.mem_type != MemType::Dram {
            return None;
        }
        let end = offset.checked_add(len)?;
        if end > region.desc.len {
            return None;
        }
        let addr = region.desc.addr.checked_add(offset)?;
        Some(MemSlice { ptr: addr as usize as *mut u8, len: usize::try_from(len).ok()?, pin: self.clone() })
    }

    /// The range `addr .. addr + len` (absolute: a DRAM or VRAM address, a FILE offset) of the
    /// pinned region in the form its memory type needs; `None` when outside the region or the
    /// type has no data-path form (BLK, OBJ), or a FILE region's `dev_id` is not a descriptor.
    pub fn local_at(&self, addr: u64, len: u64) -> Option<LocalMem> {
        let region = &self.0.region;
        let inside = region.desc.contains(&Desc::new(addr, len, region.desc.dev_id));
        match region.mem_type {
            MemType::Dram => self.slice_at(addr, len).map(LocalMem::Host),
            MemType::File if inside => {
                let fd = RawFd::try_from(region.desc.dev_id).ok()?;
                Some(LocalMem::File(FileSlice { fd, offset: addr, len, pin: self.clone() }))
            }
            MemType::Vram if inside => {
                Some(LocalMem::Device(DeviceSlice { device: region.desc.dev_id, ptr: addr, len, pin: self.clone() }))
            }
            _ => None,
        }
    }

    /// Like [`slice`](Pin::slice) but by absolute address.
    pub fn slice_at(&self, addr: u64, len: u64) -> Option<MemSlice> {
        let offset = addr.checked_sub(self.0.region.desc.addr)?;
        self.slice(offset, len)
    }
}

/// A piece of registered host memory that a transfer reads or writes. Holding it keeps the
/// region pinned.
///
/// Registered memory is shared with remote peers the way DMA memory is: a peer may write it
/// at any time, and the application coordinates through completions and notifications.
#[derive(Debug)]
pub struct MemSlice {
    ptr: *mut u8,
    len: usize,
    pin: Pin,
}

// SAFETY: a MemSlice is a raw view of registered memory; the registration contract of
// `LocalRegion::new` makes that memory valid from any thread while pinned, and the pin is
// itself Send + Sync.
unsafe impl Send for MemSlice {}
// SAFETY: as above; shared access only hands out `&[u8]`.
unsafe impl Sync for MemSlice {}

impl MemSlice {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn addr(&self) -> u64 {
        self.ptr as usize as u64
    }

    pub fn pin(&self) -> &Pin {
        &self.pin
    }

    /// The first byte, for I/O calls that take raw pointers (`pread`, `ucp_put_nbx`).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr
    }

    /// Like [`as_ptr`](MemSlice::as_ptr), for calls that write the memory.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    /// The bytes as a Rust slice, for vectored socket I/O.
    ///
    /// # Safety
    /// While the returned slice lives, no `&mut [u8]` over any of these bytes may exist
    /// (from another `MemSlice` of overlapping memory, e.g. a concurrent transfer into it) and
    /// nothing may write them. Registered memory can be written by peers and by other
    /// transfers at any time, so only a backend that knows the bytes are not a destination of
    /// anything else right now (the application's ordering of requests over the same memory)
    /// may call this.
    pub unsafe fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr .. ptr + len` lies inside a pinned DRAM region (checked by
        // `Pin::slice`), which `LocalRegion::new`'s contract keeps allocated while pinned; the
        // caller promises no concurrent writer (this function's contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes as a mutable Rust slice, for vectored socket reads.
    ///
    /// # Safety
    /// While the returned slice lives, no other reference to any of these bytes may exist or be
    /// created: not from another `MemSlice` over overlapping memory (two requests into the same
    /// bytes at once, a request reading what another writes) and not from the application.
    /// `&mut self` only rules out a second slice from *this* `MemSlice`; overlapping slices of
    /// other transfers are ruled out by the application ordering its requests, as with memory
    /// shared with a NIC.
    pub unsafe fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `as_slice` for validity; exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The piece `offset .. offset + len` of this slice (same pin), or `None` when outside.
    pub fn sub(&self, offset: usize, len: usize) -> Option<MemSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| MemSlice { ptr: self.ptr.wrapping_add(offset), len, pin: self.pin.clone() })
    }

    /// Splits off and returns the first `at` bytes, leaving the rest in `self`.
    pub fn split_front(&mut self, at: usize) -> MemSlice {
        let at = at.min(self.len);
        let front = MemSlice { ptr: self.ptr, len: at, pin: self.pin.clone() };
        self.ptr = self.ptr.wrapping_add(at);
        self.len -= at;
        front
    }
}

/// A byte range of a registered file: `len` bytes at `offset` of the open file `fd`. The pin
/// keeps the registration (and, for `Agent::register_file`, the file) open.
#[derive(Clone, Debug)]
pub struct FileSlice {
    fd: RawFd,
    offset: u64,
    len: u64,
    pin: Pin,
}

impl FileSlice {
    pub fn fd(&self) -> RawFd {
        self.fd
    }

    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pin(&self) -> &Pin {
        &self.pin
    }

    /// The piece `offset .. offset + len` of this range (same file and pin).
    pub fn sub(&self, offset: u64, len: u64) -> Option<FileSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| FileSlice { fd: self.fd, offset: self.offset + offset, len, pin: self.pin.clone() })
    }
}

/// A byte range of registered GPU memory: `len` bytes at device address `ptr` on CUDA device
/// `device`. Only backends that speak to the device (UCX with CUDA, GDS) move it; the CPU
/// must never dereference it.
#[derive(Clone, Debug)]
pub struct DeviceSlice {
    device: u64,
    ptr: u64,
    len: u64,
    pin: Pin,
}

impl DeviceSlice {
    pub fn device(&self) -> u64 {
        self.device
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn pin(&self) -> &Pin {
        &self.pin
    }

    /// The piece `offset .. offset + len` of this range (same device and pin).
    pub fn sub(&self, offset: u64, len: u64) -> Option<DeviceSlice> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then(|| DeviceSlice {
            device: self.device,
            ptr: self.ptr + offset,
            len,
            pin: self.pin.clone(),
        })
    }
}

/// The local memory of a transfer as a backend receives it: where its bytes live. Backends
/// declare the kinds they move in [`Capabilities`](crate::Capabilities) and refuse the others
/// with [`BackendError::MemoryNotMoved`].
#[derive(Debug)]
pub enum LocalMem {
    /// Host memory the CPU addresses.
    Host(MemSlice),
    /// A range of an open file.
    File(FileSlice),
    /// GPU memory.
    Device(DeviceSlice),
}

impl LocalMem {
    pub fn mem_type(&self) -> MemType {
        match self {
            LocalMem::Host(_) => MemType::Dram,
            LocalMem::File(_) => MemType::File,
            LocalMem::Device(_) => MemType::Vram,
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            LocalMem::Host(slice) => slice.len() as u64,
            LocalMem::File(slice) => slice.len(),
            LocalMem::Device(slice) => slice.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn pin(&self) -> &Pin {
        match self {
            LocalMem::Host(slice) => slice.pin(),
            LocalMem::File(slice) => slice.pin(),
            LocalMem::Device(slice) => slice.pin(),
        }
    }

    /// Splits off and returns the first `at` bytes (at most all of them), leaving the rest.
    pub fn split_front(&mut self, at: u64) -> LocalMem {
        let at = at.min(self.len());
        match self {
            LocalMem::Host(slice) => LocalMem::Host(slice.split_front(at as usize)),
            LocalMem::File(slice) => {
                let front = slice.sub(0, at).expect("front lies inside");
                *slice = slice.sub(at, slice.len - at).expect("rest lies inside");
                LocalMem::File(front)
            }
            LocalMem::Device(slice) => {
                let front = slice.sub(0, at).expect("front lies inside");
                *slice = slice.sub(at, slice.len - at).expect("rest lies inside");
                LocalMem::Device(front)
            }
        }
    }

    /// The memory's address in this process's (unified) address space: a host address, or a CUDA
    /// device pointer. `None` for files. For backends whose library takes either (UCX with CUDA).
    pub fn address(&self) -> Option<u64> {
        match self {
            LocalMem::Host(slice) => Some(slice.addr()),
            LocalMem::Device(slice) => Some(slice.ptr),
            LocalMem::File(_) => None,
        }
    }

    /// The GPU the memory is on, if it is GPU memory.
    pub fn device(&self) -> Option<u64> {
        match self {
            LocalMem::Device(slice) => Some(slice.device),
            _ => None,
        }
    }

    /// The host slice, or the typed refusal of a backend that moves host memory only.
    pub fn into_host(self, backend: &'static str) -> Result<MemSlice, BackendError> {
        match self {
            LocalMem::Host(slice) => Ok(slice),
            other => Err(BackendError::MemoryNotMoved { backend, mem_type: other.mem_type() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(buf: &mut [u8]) -> Arc<LocalRegion> {
        let desc = Desc::new(buf.as_mut_ptr() as usize as u64, buf.len() as u64, 0);
        // SAFETY: the buffer outlives the region in every test below.
        Arc::new(unsafe { LocalRegion::new(1, MemType::Dram, desc) })
    }

    #[test]
    fn pins_are_refused_after_close() {
        let mut buf = vec![0u8; 64];
        let region = region(&mut buf);
        let pin = region.pin().unwrap();
        assert_eq!(region.users(), 1);
        drop(pin);
        assert!(region.close_and_wait(Duration::from_millis(10)));
        assert!(region.pin().is_none());
        assert_eq!(region.users(), 0);
    }

    #[test]
    fn close_waits_for_users() {
        let mut buf = vec![0u8; 64];
        let region = region(&mut buf);
        let pin = region.pin().unwrap();
        assert!(!region.close_and_wait(Duration::from_millis(20)));
        let waiter = {
            let region = Arc::clone(&region);
            std::thread::spawn(move || region.close_and_wait(Duration::from_secs(5)))
        };
        std::thread::sleep(Duration::from_millis(20));
        drop(pin);
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn slices_are_bounds_checked() {
        let mut buf = vec![7u8; 64];
        let region = region(&mut buf);
        let pin = region.pin().unwrap();
        assert!(pin.slice(0, 64).is_some());
        assert!(pin.slice(1, 64).is_none());
        assert!(pin.slice(u64::MAX, 2).is_none());
        let mut s = pin.slice(8, 16).unwrap();
        let front = s.split_front(4);
        assert_eq!(front.len(), 4);
        assert_eq!(s.len(), 12);
        // SAFETY: the test holds the only slices of `buf`, and `front` does not overlap `s`.
        unsafe { s.as_mut_slice() }.fill(1);
        drop((s, front, pin));
        assert_eq!(&buf[12..24], &[1u8; 12]);
        assert_eq!(buf[11], 7);
    }

    #[test]
    fn local_memory_takes_the_form_of_its_type() {
        // SAFETY: FILE and VRAM regions name no host memory; nothing here dereferences them.
        let file = Arc::new(unsafe { LocalRegion::new(2, MemType::File, Desc::new(4096, 8192, 7)) });
        let pin = file.pin().unwrap();
        match pin.local_at(4096 + 100, 50) {
            Some(LocalMem::File(slice)) => {
                assert_eq!((slice.fd(), slice.offset(), slice.len()), (7, 4196, 50));
                let piece = slice.sub(10, 40).unwrap();
                assert_eq!((piece.offset(), piece.len()), (4206, 40));
                assert!(slice.sub(10, 41).is_none());
            }
            other => panic!("{other:?}"),
        }
        assert!(pin.local_at(0, 1).is_none());
        assert!(pin.local_at(4096, 8193).is_none());
        // SAFETY: as above.
        let gpu = Arc::new(unsafe { LocalRegion::new(3, MemType::Vram, Desc::new(1 << 40, 1 << 20, 1)) });
        let local = gpu.pin().unwrap().local_at(1 << 40, 64).unwrap();
        assert_eq!(local.mem_type(), MemType::Vram);
        let err = local.into_host("tcp").unwrap_err();
        assert!(matches!(err, BackendError::MemoryNotMoved { backend: "tcp", mem_type: MemType::Vram }), "{err}");
        let mut buf = vec![0u8; 16];
        let host = region(&mut buf);
        let local = host.pin().unwrap().local_at(host.desc().addr + 4, 8).unwrap();
        assert_eq!((local.mem_type(), local.len()), (MemType::Dram, 8));
        assert_eq!(local.into_host("tcp").unwrap().len(), 8);
    }

    #[test]
    fn desc_containment() {
        let outer = Desc::new(100, 50, 0);
        assert!(outer.contains(&Desc::new(100, 50, 0)));
        assert!(outer.contains(&Desc::new(120, 0, 0)));
        assert!(!outer.contains(&Desc::new(120, 31, 0)));
        assert!(!outer.contains(&Desc::new(100, 10, 1)));
        assert!(!outer.contains(&Desc::new(u64::MAX, 2, 0)));
        assert!(outer.overlaps(&Desc::new(149, 10, 0)));
        assert!(!outer.overlaps(&Desc::new(150, 10, 0)));
        assert!(!outer.overlaps(&Desc::new(90, 10, 0)));
        assert!(!outer.overlaps(&Desc::new(120, 10, 1)));
    }
}
