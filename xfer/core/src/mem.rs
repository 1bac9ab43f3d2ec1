//! Registered memory: regions, the usage gate that keeps deregistration from freeing memory
//! under a transfer, and the slices backends copy through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

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

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr .. ptr + len` lies inside a pinned DRAM region (checked by
        // `Pin::slice`), which `LocalRegion::new`'s contract keeps allocated while pinned.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: as in `as_slice`; `&mut self` makes this the only slice handed out from this
        // MemSlice. Overlap with other transfers' slices is the application's concern, as
        // with any memory shared with a NIC.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
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
        s.as_mut_slice().fill(1);
        drop((s, front, pin));
        assert_eq!(&buf[12..24], &[1u8; 12]);
        assert_eq!(buf[11], 7);
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
