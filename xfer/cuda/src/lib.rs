//! CUDA for `xfer`: the driver found at run time, staging lanes for GPU memory, device buffers.
//!
//! Nothing here links CUDA. [`Cuda::get`] loads `libcuda` on first use and initialises it once
//! per process; a machine without the driver (or without devices) gets
//! [`DeviceError::Unavailable`] with the reason, never a panic: cudarc's loader panics when the
//! library is missing, so its presence is checked before any call.
//!
//! - [`CudaStaging`] is what the agent hands its backends: [`CudaLane`]s for GPU memory, and
//!   [`FileLane`](xfer_core::staging::FileLane)s when no GPU memory is involved.
//! - A [`CudaLane`] owns pinned host slots, one non-blocking stream and one event per slot.
//!   `fill`/`drain` of GPU memory are `cuMemcpy{DtoH,HtoD}Async` on the stream followed by the
//!   slot's event; `host(slot)` waits for that event. So while the wire moves one slot, the
//!   stream fills or drains the next.
//! - [`DeviceBuffer`] allocates device memory (tests, benchmarks, the GPU check).
//!
//! Every call first makes the device's primary context current on the calling thread: lanes run
//! on backend worker threads, and PyTorch's tensors live in the primary context.

use std::ffi::c_void;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use xfer_core::staging::{CopyLane, FileLane, Staging};
use xfer_core::{file_io, BackendError, DeviceError, LocalMem};

fn driver(call: &'static str) -> impl FnOnce(cu::DriverError) -> DeviceError {
    move |err| DeviceError::Driver { call, message: err.to_string() }
}

/// The loaded, initialised driver and the devices it sees.
#[derive(Debug)]
pub struct Cuda {
    devices: u64,
}

impl Cuda {
    /// The process's driver, loaded and initialised on first call; the same answer afterwards.
    pub fn get() -> Result<&'static Cuda, DeviceError> {
        static CUDA: OnceLock<Result<Cuda, DeviceError>> = OnceLock::new();
        CUDA.get_or_init(Cuda::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Cuda, DeviceError> {
        // SAFETY: only tries to open the library (dlopen) under its usual names.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Unavailable("the CUDA driver library (libcuda.so) is not installed".into()));
        }
        cu::init().map_err(|err| DeviceError::Unavailable(format!("cuInit failed: {err}")))?;
        let devices = cu::device::get_count().map_err(driver("cuDeviceGetCount"))?;
        if devices <= 0 {
            return Err(DeviceError::Unavailable("the CUDA driver reports no devices".into()));
        }
        tracing::debug!(devices, "CUDA driver loaded");
        Ok(Cuda { devices: devices as u64 })
    }

    /// Number of CUDA devices.
    pub fn devices(&self) -> u64 {
        self.devices
    }

    /// Makes `device`'s primary context current on this thread (retaining it once per device
    /// for the life of the process, as the runtime API does).
    fn bind(&self, device: u64) -> Result<(), DeviceError> {
        static CONTEXTS: OnceLock<Vec<OnceLock<Result<Context, DeviceError>>>> = OnceLock::new();
        if device >= self.devices {
            return Err(DeviceError::NoSuchDevice { device, count: self.devices });
        }
        let contexts = CONTEXTS.get_or_init(|| (0..self.devices).map(|_| OnceLock::new()).collect());
        let context =
            contexts[device as usize].get_or_init(|| Context::retain(device)).as_ref().map_err(Clone::clone)?;
        // SAFETY: the context was retained and is never released.
        unsafe { cu::ctx::set_current(context.0) }.map_err(driver("cuCtxSetCurrent"))
    }
}

#[derive(Debug)]
struct Context(sys::CUcontext);

// SAFETY: a CUcontext handle may be made current on any thread; it is never released.
unsafe impl Send for Context {}
// SAFETY: as above; the handle is only read.
unsafe impl Sync for Context {}

impl Context {
    fn retain(device: u64) -> Result<Context, DeviceError> {
        let ordinal = i32::try_from(device).map_err(|_| DeviceError::NoSuchDevice { device, count: 0 })?;
        let dev = cu::device::get(ordinal).map_err(driver("cuDeviceGet"))?;
        // SAFETY: `dev` came from cuDeviceGet.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(driver("cuDevicePrimaryCtxRetain"))?;
        Ok(Context(ctx))
    }
}

/// The staging the agent gives its backends: CUDA lanes for GPU memory when the driver is here.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaStaging;

impl Staging for CudaStaging {
    fn device_ready(&self, device: u64) -> Result<(), DeviceError> {
        let cuda = Cuda::get()?;
        if device >= cuda.devices() {
            return Err(DeviceError::NoSuchDevice { device, count: cuda.devices() });
        }
        Ok(())
    }

    fn lane(&self, device: Option<u64>, slots: usize, slot_bytes: usize) -> Result<Box<dyn CopyLane>, BackendError> {
        match device {
            Some(device) => Ok(Box::new(CudaLane::new(device, slots, slot_bytes)?)),
            None => Ok(Box::new(FileLane::new(slots, slot_bytes))),
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`): what device copies run at full speed against.
#[derive(Debug)]
pub struct PinnedHost {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the allocation is owned by this value alone; access goes through `&`/`&mut self`.
unsafe impl Send for PinnedHost {}
// SAFETY: shared access only hands out `&[u8]`.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    /// `len` bytes (at least one), zeroed.
    pub fn new(len: usize) -> Result<PinnedHost, DeviceError> {
        Cuda::get()?;
        let len = len.max(1);
        // SAFETY: a plain allocation of pinned host memory, freed in drop.
        let ptr = unsafe { cu::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(driver("cuMemHostAlloc"))?;
        let ptr = ptr.cast::<u8>();
        // SAFETY: `ptr` is a fresh allocation of `len` bytes.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedHost { ptr, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: a live allocation of `len` initialised bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`, freed once; no copy uses it any more (its owners wait first).
        let _ = unsafe { cu::free_host(self.ptr.cast::<c_void>()) };
    }
}

#[derive(Debug)]
struct Slot {
    memory: PinnedHost,
    event: sys::CUevent,
    /// A copy into or out of the slot was started and not yet awaited.
    pending: bool,
}

/// Pinned host slots and one stream on one device: the CUDA side of staging.
#[derive(Debug)]
pub struct CudaLane {
    cuda: &'static Cuda,
    device: u64,
    stream: sys::CUstream,
    slot_bytes: usize,
    slots: Vec<Slot>,
}

// SAFETY: the lane owns its stream, events and pinned allocations; CUDA handles may be used from
// any thread once the context is current, which every method makes sure of.
unsafe impl Send for CudaLane {}

impl CudaLane {
    pub fn new(device: u64, slots: usize, slot_bytes: usize) -> Result<CudaLane, DeviceError> {
        let cuda = Cuda::get()?;
        cuda.bind(device)?;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver("cuStreamCreate"))?;
        let slot_bytes = slot_bytes.max(1);
        let mut lane = CudaLane { cuda, device, stream, slot_bytes, slots: Vec::new() };
        for _ in 0..slots.max(1) {
            let memory = PinnedHost::new(slot_bytes)?;
            let event =
                cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map_err(driver("cuEventCreate"))?;
            lane.slots.push(Slot { memory, event, pending: false });
        }
        Ok(lane)
    }

    fn slot(&mut self, slot: usize) -> Result<&mut Slot, BackendError> {
        let count = self.slots.len();
        self.slots
            .get_mut(slot)
            .ok_or_else(|| BackendError::Protocol(format!("staging slot {slot} of {count} does not exist")))
    }

    /// Waits for the slot's last copy.
    fn settle(&mut self, slot: usize) -> Result<(), BackendError> {
        self.cuda.bind(self.device)?;
        let slot = self.slot(slot)?;
        if slot.pending {
            slot.pending = false;
            // SAFETY: the event was created by this lane and recorded on its stream.
            unsafe { cu::event::synchronize(slot.event) }.map_err(driver("cuEventSynchronize"))?;
        }
        Ok(())
    }

    /// The slot's first `len` bytes, its copies settled (so no copy touches them while borrowed).
    fn bytes(&mut self, slot: usize, len: usize) -> Result<&mut [u8], BackendError> {
        self.settle(slot)?;
        let len = len.min(self.slot_bytes);
        Ok(&mut self.slot(slot)?.memory.as_mut_slice()[..len])
    }

    fn record(&mut self, slot: usize) -> Result<(), BackendError> {
        let stream = self.stream;
        let slot = self.slot(slot)?;
        // SAFETY: the event and stream belong to this lane.
        unsafe { cu::event::record(slot.event, stream) }.map_err(driver("cuEventRecord"))?;
        slot.pending = true;
        Ok(())
    }
}

fn device_range(mem: &LocalMem, offset: u64, len: usize) -> Result<Option<sys::CUdeviceptr>, BackendError> {
    match mem {
        LocalMem::Device(gpu) => {
            let inside = offset.checked_add(len as u64).is_some_and(|end| end <= gpu.len());
            if !inside {
                return Err(BackendError::Protocol(format!(
                    "staging {len} bytes at {offset} of a {}-byte GPU range",
                    gpu.len()
                )));
            }
            Ok(Some(gpu.ptr() + offset))
        }
        _ => Ok(None),
    }
}

impl CopyLane for CudaLane {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn fill(&mut self, slot: usize, src: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        let dev_ptr = device_range(src, offset, len)?;
        let stream = self.stream;
        let bytes = self.bytes(slot, len)?;
        match (dev_ptr, src) {
            (Some(dev_ptr), _) => {
                // SAFETY: `bytes` is pinned host memory of this lane that nothing else touches until
                // `settle` (the event recorded next); `dev_ptr .. + len` lies in pinned, registered
                // GPU memory (checked above; the pin in `src` keeps it registered until the
                // transfer, which waits for `finish`, ends).
                unsafe { cu::memcpy_dtoh_async(bytes, dev_ptr, stream) }.map_err(driver("cuMemcpyDtoHAsync"))?;
                self.record(slot)
            }
            (None, LocalMem::File(file)) => Ok(file_io::read_exact_at(file, offset, bytes)?),
            (None, other) => Err(BackendError::MemoryNotMoved { backend: "cuda staging", mem_type: other.mem_type() }),
        }
    }

    fn drain(&mut self, slot: usize, dst: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        let dev_ptr = device_range(dst, offset, len)?;
        let stream = self.stream;
        let bytes = self.bytes(slot, len)?;
        match (dev_ptr, dst) {
            (Some(dev_ptr), _) => {
                // SAFETY: as in `fill`, with the copy reading the slot.
                unsafe { cu::memcpy_htod_async(dev_ptr, &*bytes, stream) }.map_err(driver("cuMemcpyHtoDAsync"))?;
                self.record(slot)
            }
            (None, LocalMem::File(file)) => Ok(file_io::write_all_at(file, offset, bytes)?),
            (None, other) => Err(BackendError::MemoryNotMoved { backend: "cuda staging", mem_type: other.mem_type() }),
        }
    }

    fn host(&mut self, slot: usize) -> Result<&mut [u8], BackendError> {
        let len = self.slot_bytes;
        self.bytes(slot, len)
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        self.cuda.bind(self.device)?;
        for slot in &mut self.slots {
            slot.pending = false;
        }
        // SAFETY: the stream belongs to this lane.
        Ok(unsafe { cu::stream::synchronize(self.stream) }.map_err(driver("cuStreamSynchronize"))?)
    }
}

impl Drop for CudaLane {
    fn drop(&mut self) {
        // Copies may still read or write the slots: wait before freeing them.
        if let Err(err) = self.finish() {
            tracing::warn!(%err, "CUDA staging lane: waiting for copies before freeing failed");
        }
        for slot in &self.slots {
            // SAFETY: created by this lane, unused after the stream synchronised (the slot's
            // pinned memory is freed after this, by its own drop).
            let _ = unsafe { cu::event::destroy(slot.event) };
        }
        // SAFETY: the stream belongs to this lane and has no work left.
        let _ = unsafe { cu::stream::destroy(self.stream) };
    }
}

/// Device memory on one GPU, freed on drop. For tests, benchmarks and the GPU check; engines
/// register their own tensors' memory instead.
#[derive(Debug)]
pub struct DeviceBuffer {
    cuda: &'static Cuda,
    device: u64,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl DeviceBuffer {
    /// `len` bytes on `device` (contents undefined).
    pub fn new(device: u64, len: usize) -> Result<DeviceBuffer, DeviceError> {
        let cuda = Cuda::get()?;
        cuda.bind(device)?;
        // SAFETY: a plain device allocation in the current (primary) context, freed in drop.
        let ptr = unsafe { cu::malloc_sync(len.max(1)) }.map_err(driver("cuMemAlloc"))?;
        Ok(DeviceBuffer { cuda, device, ptr, len })
    }

    pub fn device(&self) -> u64 {
        self.device
    }

    /// The device address (a descriptor's `addr`; its `dev_id` is [`device`](DeviceBuffer::device)).
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `src` to the start of the buffer (synchronously).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.check(offset, src.len())?;
        self.cuda.bind(self.device)?;
        // SAFETY: the range lies inside this allocation (checked).
        unsafe { cu::memcpy_htod_sync(self.ptr + offset as u64, src) }.map_err(driver("cuMemcpyHtoD"))
    }

    /// Copies the buffer's bytes at `offset` into `dst` (synchronously).
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check(offset, dst.len())?;
        self.cuda.bind(self.device)?;
        // SAFETY: as in `write`.
        unsafe { cu::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }.map_err(driver("cuMemcpyDtoH"))
    }

    /// Copies all of `src` (another device buffer, any device) to the start of this one.
    pub fn copy_from(&self, src: &DeviceBuffer) -> Result<(), DeviceError> {
        self.check(0, src.len)?;
        self.cuda.bind(self.device)?;
        // SAFETY: both ranges lie inside live device allocations (checked), and unified
        // addressing lets one context copy between devices.
        unsafe { cu::memcpy_dtod_sync(self.ptr, src.ptr, src.len) }.map_err(driver("cuMemcpyDtoD"))
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), DeviceError> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(DeviceError::Driver {
                call: "DeviceBuffer",
                message: format!("{len} bytes at {offset} of a {}-byte buffer", self.len),
            });
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.cuda.bind(self.device).is_ok() {
            // SAFETY: allocated in `new`, freed once.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

/// Makes `device`'s primary context current on this thread, for CUDA libraries called next
/// (cuFile registers device buffers in the current context).
pub fn bind_device(device: u64) -> Result<(), DeviceError> {
    Cuda::get()?.bind(device)
}

/// Why GPU tests cannot run here, or `None` when they can: the message GPU-only tests print when
/// they skip.
pub fn why_no_gpu() -> Option<String> {
    Cuda::get().err().map(|err| err.to_string())
}

/// For GPU-only tests: whether a GPU is here. When not, prints a loud `SKIPPED` line naming the
/// test and the reason; with `XFER_REQUIRE_GPU` set (the GPU check does), a missing GPU fails
/// the test instead, so a GPU machine never passes by skipping.
pub fn gpu_or_skip(test: &str) -> bool {
    let Some(reason) = why_no_gpu() else { return true };
    assert!(std::env::var_os("XFER_REQUIRE_GPU").is_none(), "{test}: XFER_REQUIRE_GPU is set but {reason}");
    // Straight to the process's stderr: the test harness captures `eprintln!` of passing tests,
    // and a skip must be seen.
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "SKIPPED {test} (no GPU): {reason}");
    false
}

/// A shared handle for the agent.
pub fn staging() -> Arc<dyn Staging> {
    Arc::new(CudaStaging)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without CUDA (every CI machine) the driver is refused with a typed reason;
    /// with one, a buffer round-trips through the device.
    #[test]
    fn the_driver_is_found_or_refused_with_the_reason() {
        match Cuda::get() {
            Err(DeviceError::Unavailable(reason)) => {
                assert!(!gpu_or_skip("the_driver_is_found_or_refused_with_the_reason (GPU half)"));
                assert!(!reason.is_empty());
                assert!(matches!(CudaStaging.device_ready(0), Err(DeviceError::Unavailable(_))));
                assert!(CudaStaging.lane(Some(0), 2, 4096).is_err());
                assert!(DeviceBuffer::new(0, 64).is_err());
                // Files need no GPU.
                assert_eq!(CudaStaging.lane(None, 2, 4096).unwrap().slots(), 2);
            }
            Err(other) => panic!("CUDA present but failing: {other}"),
            Ok(cuda) => {
                assert!(cuda.devices() >= 1);
                let buf = DeviceBuffer::new(0, 1 << 20).unwrap();
                let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
                buf.write(0, &data).unwrap();
                let mut back = vec![0u8; 1 << 20];
                buf.read(0, &mut back).unwrap();
                assert_eq!(back, data);
                assert!(matches!(CudaStaging.device_ready(cuda.devices()), Err(DeviceError::NoSuchDevice { .. })));
            }
        }
    }
}
