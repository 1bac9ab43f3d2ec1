//! An io_uring that owns the host memory of every read and write it has handed to the kernel,
//! so that memory stays valid until the kernel has reported the I/O done.
//!
//! Ownership rule: a [`RingIo`] moves into the ring at [`Ring::push`] and comes back only with
//! its completion from [`Ring::submit_and_reap`]; its `host` slice holds the registration's pin
//! meanwhile. Dropping the ring first waits for every I/O still in flight; if the kernel stops
//! answering, the slices are leaked (their pins never drop), never freed under the kernel.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, register::Probe, types, IoUring};
use xfer_core::MemSlice;

/// The most one submission moves: an SQE length is 32 bits, and a power of two keeps every
/// O_DIRECT remainder aligned. Longer pieces complete short and are resubmitted.
const MAX_SQE_BYTES: usize = 1 << 30;

/// One read (file → `host`) or write (`host` → file) of `host.len()` bytes at `offset`;
/// `tag` is the caller's, returned with the completion.
#[derive(Debug)]
pub(crate) struct RingIo<T> {
    pub fd: RawFd,
    pub offset: u64,
    pub host: MemSlice,
    pub write: bool,
    pub tag: T,
}

/// The bytes the kernel moved for one [`RingIo`], or its errno.
pub(crate) type RingResult = io::Result<usize>;

pub(crate) struct Ring<T> {
    ring: IoUring,
    /// The I/O the kernel holds, indexed by each SQE's `user_data`.
    slots: Vec<Option<RingIo<T>>>,
    free: Vec<usize>,
}

impl<T> std::fmt::Debug for Ring<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("entries", &self.slots.len()).field("in_flight", &self.in_flight()).finish()
    }
}

impl<T> Ring<T> {
    /// A ring of `depth` entries (the kernel may round up), refused when the kernel lacks
    /// io_uring (ENOSYS), forbids it (EPERM: seccomp, `kernel.io_uring_disabled`) or lacks
    /// the READ/WRITE operations (before Linux 5.6).
    pub fn new(depth: u32) -> io::Result<Ring<T>> {
        let ring = IoUring::new(depth.max(1))?;
        let mut probe = Probe::new();
        ring.submitter().register_probe(&mut probe)?;
        if !probe.is_supported(opcode::Read::CODE) || !probe.is_supported(opcode::Write::CODE) {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "io_uring has no READ/WRITE operations"));
        }
        // Never more in flight than SQ entries: the CQ (twice as large) cannot overflow.
        let entries = ring.params().sq_entries() as usize;
        Ok(Ring { ring, slots: (0..entries).map(|_| None).collect(), free: (0..entries).rev().collect() })
    }

    pub fn is_full(&self) -> bool {
        self.free.is_empty()
    }

    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Queues `io` for the next [`submit_and_reap`](Ring::submit_and_reap); gives it back when
    /// the ring is full.
    pub fn push(&mut self, mut io: RingIo<T>) -> Result<(), RingIo<T>> {
        let Some(slot) = self.free.pop() else { return Err(io) };
        let len = io.host.len().min(MAX_SQE_BYTES) as u32;
        let fd = types::Fd(io.fd);
        let entry = if io.write {
            opcode::Write::new(fd, io.host.as_ptr(), len).offset(io.offset).build()
        } else {
            opcode::Read::new(fd, io.host.as_mut_ptr(), len).offset(io.offset).build()
        };
        // SAFETY: the SQE points at `len <= host.len()` bytes of `io.host`, pinned registered
        // host memory that `LocalRegion::new`'s contract keeps allocated while the pin lives.
        // `io` (and so the pin) moves into `slots[slot]` right below and leaves it only when the
        // CQE with this `user_data` is reaped (`submit_and_reap`) or never (`Drop` leaks what the
        // kernel does not return). The kernel writing the memory is the DMA-like access
        // registered memory allows (see `read_exact_at`). A full SQ returns the entry unqueued.
        let pushed = unsafe { self.ring.submission().push(&entry.user_data(slot as u64)) };
        if pushed.is_err() {
            self.free.push(slot);
            return Err(io);
        }
        self.slots[slot] = Some(io);
        Ok(())
    }

    /// Submits what is queued, waits until at least one I/O has completed (when any is in
    /// flight) and appends every completion to `out`. An error of `io_uring_enter` itself other
    /// than an interruption is returned; what is in flight stays in the ring.
    pub fn submit_and_reap(&mut self, out: &mut Vec<(RingIo<T>, RingResult)>) -> io::Result<()> {
        if self.in_flight() == 0 {
            return Ok(());
        }
        match self.ring.submit_and_wait(1) {
            Ok(_) => {}
            // EBUSY: completions are pending to be reaped first; EINTR: a signal.
            Err(err) if matches!(err.raw_os_error(), Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)) => {}
            Err(err) => return Err(err),
        }
        for cqe in self.ring.completion() {
            let slot = cqe.user_data() as usize;
            let Some(io) = self.slots.get_mut(slot).and_then(Option::take) else { continue };
            self.free.push(slot);
            let result = match cqe.result() {
                n if n >= 0 => Ok(n as usize),
                errno => Err(io::Error::from_raw_os_error(-errno)),
            };
            out.push((io, result));
        }
        Ok(())
    }
}

/// Attempts to drain before the kernel is left with nothing to write into.
const DRAIN_ATTEMPTS: usize = 1000;

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        let mut reaped = Vec::new();
        for _ in 0..DRAIN_ATTEMPTS {
            if self.in_flight() == 0 {
                return;
            }
            if self.submit_and_reap(&mut reaped).is_err() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            reaped.clear();
        }
        // The kernel may still hold these buffers: their pins must never drop.
        tracing::warn!(in_flight = self.in_flight(), "posix: io_uring did not drain; leaking its buffers");
        for io in self.slots.iter_mut().filter_map(Option::take) {
            std::mem::forget(io);
        }
    }
}
