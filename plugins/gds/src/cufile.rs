//! The GDS backend's only `unsafe`: cuFile's driver, its buffer and file-handle registrations,
//! and the reads and writes between them.

#![allow(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cudarc::cufile::sys;
use xfer_core::{file_io, BackendError, Desc, DeviceError, FileIoError};

/// Names cuFile's library is installed under: the CUDA toolkit's development link, and the
/// versioned name alone, which is all PyPI's nvidia-cufile (what torch's and vLLM's wheels
/// install) ships. cudarc's own loader tries neither `.so.0` nor `.so.1`, hence this one;
/// cudarc still gives the types.
const LIBRARY_NAMES: [&str; 3] = ["libcufile.so", "libcufile.so.0", "libcufile.so.1"];

/// The cuFile entry points this backend calls, resolved once per process.
struct CuFile {
    driver_open: unsafe extern "C" fn() -> sys::CUfileError_t,
    driver_close: unsafe extern "C" fn() -> sys::CUfileError_t,
    buf_register: unsafe extern "C" fn(*const c_void, usize, c_int) -> sys::CUfileError_t,
    buf_deregister: unsafe extern "C" fn(*const c_void) -> sys::CUfileError_t,
    handle_register: unsafe extern "C" fn(*mut sys::CUfileHandle_t, *mut sys::CUfileDescr_t) -> sys::CUfileError_t,
    handle_deregister: unsafe extern "C" fn(sys::CUfileHandle_t),
    read: unsafe extern "C" fn(sys::CUfileHandle_t, *mut c_void, usize, sys::off_t, sys::off_t) -> isize,
    write: unsafe extern "C" fn(sys::CUfileHandle_t, *const c_void, usize, sys::off_t, sys::off_t) -> isize,
    batch_set_up: unsafe extern "C" fn(*mut sys::CUfileBatchHandle_t, c_uint) -> sys::CUfileError_t,
    batch_submit: unsafe extern "C" fn(
        sys::CUfileBatchHandle_t,
        c_uint,
        *mut sys::CUfileIOParams_t,
        c_uint,
    ) -> sys::CUfileError_t,
    batch_status: unsafe extern "C" fn(
        sys::CUfileBatchHandle_t,
        c_uint,
        *mut c_uint,
        *mut sys::CUfileIOEvents_t,
        *mut sys::timespec,
    ) -> sys::CUfileError_t,
    batch_cancel: unsafe extern "C" fn(sys::CUfileBatchHandle_t) -> sys::CUfileError_t,
    batch_destroy: unsafe extern "C" fn(sys::CUfileBatchHandle_t),
    /// Kept loaded for the process's life: the pointers above point into it.
    _library: libloading::Library,
}

impl CuFile {
    /// The library, loaded on first call; the same answer afterwards.
    fn get() -> Result<&'static CuFile, DeviceError> {
        static CUFILE: OnceLock<Result<CuFile, DeviceError>> = OnceLock::new();
        CUFILE.get_or_init(CuFile::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<CuFile, DeviceError> {
        // SAFETY: loading runs the library's initialisers, as linking it would.
        let library = LIBRARY_NAMES.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok());
        let Some(library) = library else {
            let tried = LIBRARY_NAMES.join(", ");
            return Err(DeviceError::Unavailable(format!(
                "the GPUDirect Storage library is not installed (tried {tried})"
            )));
        };
        let missing = |name: &str, err: libloading::Error| {
            DeviceError::Unavailable(format!("the GPUDirect Storage library lacks {name}: {err}"))
        };
        macro_rules! entry {
            ($name:literal) => {
                // SAFETY: each field's type is cuFile's prototype of that name (cufile.h, as
                // cudarc's bindings declare it); the pointers live in the same struct as the
                // library, which a static keeps loaded for the process's life.
                *unsafe { library.get(concat!($name, "\0").as_bytes()) }.map_err(|err| missing($name, err))?
            };
        }
        Ok(CuFile {
            driver_open: entry!("cuFileDriverOpen"),
            driver_close: entry!("cuFileDriverClose"),
            buf_register: entry!("cuFileBufRegister"),
            buf_deregister: entry!("cuFileBufDeregister"),
            handle_register: entry!("cuFileHandleRegister"),
            handle_deregister: entry!("cuFileHandleDeregister"),
            read: entry!("cuFileRead"),
            write: entry!("cuFileWrite"),
            batch_set_up: entry!("cuFileBatchIOSetUp"),
            batch_submit: entry!("cuFileBatchIOSubmit"),
            batch_status: entry!("cuFileBatchIOGetStatus"),
            batch_cancel: entry!("cuFileBatchIOCancel"),
            batch_destroy: entry!("cuFileBatchIODestroy"),
            _library: library,
        })
    }
}

fn failed(call: &'static str, err: sys::CUfileError_t) -> DeviceError {
    DeviceError::Driver { call, message: format!("{:?} (CUDA {:?})", err.err, err.cu_err) }
}

fn check(call: &'static str, err: sys::CUfileError_t) -> Result<(), DeviceError> {
    match err.err {
        sys::CUfileOpError::CU_FILE_SUCCESS => Ok(()),
        _ => Err(failed(call, err)),
    }
}

/// cuFile's driver, open for this backend's life (and its registrations': each holds it).
pub struct Driver {
    cufile: &'static CuFile,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Driver")
    }
}

impl Driver {
    pub fn open() -> Result<Arc<Driver>, BackendError> {
        xfer_cuda::Cuda::get()?;
        let cufile = CuFile::get()?;
        // SAFETY: a loaded library's entry point; opening the driver has no inputs.
        check("cuFileDriverOpen", unsafe { (cufile.driver_open)() })?;
        Ok(Arc::new(Driver { cufile }))
    }

    /// Registers GPU memory with cuFile (in its device's primary context).
    pub fn register_buffer(self: &Arc<Self>, desc: Desc) -> Result<Registered, BackendError> {
        xfer_cuda::bind_device(desc.dev_id)?;
        let ptr = desc.addr as usize as *const c_void;
        // SAFETY: `desc` is a registered VRAM region (its registration's contract: live device
        // memory until deregistered, which drops this registration first).
        check("cuFileBufRegister", unsafe { (self.cufile.buf_register)(ptr, desc.len as usize, 0) })?;
        Ok(Registered { kind: Kind::Buffer { device: desc.dev_id, ptr: desc.addr }, driver: Arc::clone(self) })
    }

    /// Registers a FILE region's descriptor with cuFile.
    pub fn register_file(self: &Arc<Self>, desc: Desc) -> Result<Registered, BackendError> {
        let fd = i32::try_from(desc.dev_id).map_err(|_| BackendError::InvalidParam {
            name: "dev_id".into(),
            reason: format!("{} is not a file descriptor", desc.dev_id),
        })?;
        let mode = file_io::file_mode(fd)?;
        let mut descr = sys::CUfileDescr_t {
            type_: sys::CUfileFileHandleType::CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: sys::CUfileDescr_t__bindgen_ty_1 { fd },
            fs_ops: std::ptr::null(),
        };
        let mut handle: sys::CUfileHandle_t = std::ptr::null_mut();
        // SAFETY: `descr` names an open descriptor (checked above) that the FILE registration keeps
        // open; cuFile writes the handle.
        check("cuFileHandleRegister", unsafe { (self.cufile.handle_register)(&mut handle, &mut descr) })?;
        Ok(Registered {
            kind: Kind::File { handle, readable: mode.readable, writable: mode.writable },
            driver: Arc::clone(self),
        })
    }

    /// The cuFile handle of a file registration, if it may be used that way.
    fn file_handle(file: &Registered, to_file: bool, fd: i32) -> Result<sys::CUfileHandle_t, BackendError> {
        let Kind::File { handle, readable, writable } = file.kind else {
            return Err(BackendError::Protocol("gds: a file run names a buffer registration".into()));
        };
        if to_file && !writable {
            return Err(FileIoError::NotWritable { fd }.into());
        }
        if !to_file && !readable {
            return Err(FileIoError::NotReadable { fd }.into());
        }
        Ok(handle)
    }

    /// Moves one run between a registered buffer and a registered file, retrying short
    /// transfers; a read that meets the end of the file is `ShortFile`.
    pub fn transfer(&self, file: &Registered, io: Io, to_file: bool, fd: i32) -> Result<(), BackendError> {
        let handle = Self::file_handle(file, to_file, fd)?;
        xfer_cuda::bind_device(io.device)?;
        let base = io.base as usize as *mut c_void;
        let mut done = 0u64;
        while done < io.len {
            let (size, file_at, device_at) =
                ((io.len - done) as usize, (io.file_offset + done) as i64, (io.device_offset + done) as i64);
            // SAFETY: `base` is a cuFile-registered buffer whose region contains
            // `device_offset .. device_offset + len` (the request's pins keep it registered);
            // `handle` is registered and its descriptor open; offsets fit `off_t` (checked by the
            // caller).
            let n = unsafe {
                if to_file {
                    (self.cufile.write)(handle, base, size, file_at, device_at)
                } else {
                    (self.cufile.read)(handle, base, size, file_at, device_at)
                }
            };
            let op = if to_file { "cuFileWrite" } else { "cuFileRead" };
            match n {
                0 if !to_file => {
                    return Err(FileIoError::ShortFile { fd, offset: io.file_offset, len: io.len, got: done }.into())
                }
                0 => {
                    let source = std::io::Error::new(std::io::ErrorKind::WriteZero, "the file took no bytes");
                    return Err(file_io::os_error(fd, "write", file_at as u64, size as u64, source).into());
                }
                n if n > 0 => done += n as u64,
                -1 => {
                    let source = std::io::Error::last_os_error();
                    let name = if to_file { "write" } else { "read" };
                    return Err(file_io::os_error(fd, name, file_at as u64, size as u64, source).into());
                }
                code => {
                    let message = format!("cuFile error {} at file offset {file_at}", -code);
                    return Err(DeviceError::Driver { call: op, message }.into());
                }
            }
        }
        Ok(())
    }

    /// Submits `runs` (each with its file registration and descriptor) as one cuFile batch, all
    /// on one device, and waits at most `timeout` for every one; returns each run's
    /// [`BatchEvent`] in order. [`BatchError::Unavailable`] when cuFile would not set the batch
    /// up or take it (no nvidia-fs, or compat mode without batch support): the caller moves the
    /// runs one by one instead.
    pub fn batch(
        &self,
        runs: &[(&Registered, Io, i32)],
        to_file: bool,
        timeout: Duration,
    ) -> Result<Vec<BatchEvent>, BatchError> {
        let Some(device) = runs.first().map(|(_, io, _)| io.device) else { return Ok(Vec::new()) };
        let count = u32::try_from(runs.len()).map_err(|_| BatchError::Failed(too_many(runs.len())))?;
        let mut params = Vec::with_capacity(runs.len());
        for (index, (file, io, fd)) in runs.iter().enumerate() {
            let fh = Self::file_handle(file, to_file, *fd).map_err(BatchError::Failed)?;
            params.push(sys::CUfileIOParams_t {
                mode: sys::CUfileBatchMode_t::CUFILE_BATCH,
                u: sys::CUfileIOParams__bindgen_ty_1 {
                    batch: sys::CUfileIOParams__bindgen_ty_1__bindgen_ty_1 {
                        devPtr_base: io.base as usize as *mut c_void,
                        file_offset: io.file_offset as i64,
                        devPtr_offset: io.device_offset as i64,
                        size: io.len as usize,
                    },
                },
                fh,
                opcode: if to_file { sys::CUfileOpcode_t::CUFILE_WRITE } else { sys::CUfileOpcode_t::CUFILE_READ },
                // The run's index comes back in its event.
                cookie: index as *mut c_void,
            });
        }
        xfer_cuda::bind_device(device).map_err(|err| BatchError::Failed(err.into()))?;
        let mut batch: sys::CUfileBatchHandle_t = std::ptr::null_mut();
        // SAFETY: cuFile writes the batch handle; `count` entries are allocated for it.
        check("cuFileBatchIOSetUp", unsafe { (self.cufile.batch_set_up)(&mut batch, count) })
            .map_err(BatchError::Unavailable)?;
        let batch = BatchHandle { raw: batch, cufile: self.cufile };
        // SAFETY: `params` holds `count` entries naming registered buffers (the request's pins keep
        // them registered), registered file handles and offsets that fit `off_t` (the caller
        // checked); cuFile reads them during the call.
        check("cuFileBatchIOSubmit", unsafe { (self.cufile.batch_submit)(batch.raw, count, params.as_mut_ptr(), 0) })
            .map_err(BatchError::Unavailable)?;
        let mut events: Vec<Option<BatchEvent>> = vec![None; runs.len()];
        let mut raw = vec![RawEvent { cookie: std::ptr::null_mut(), status: 0, ret: 0 }; runs.len()];
        let deadline = Instant::now() + timeout;
        let mut seen = 0usize;
        while seen < runs.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                batch.cancel();
                return Err(BatchError::Failed(BackendError::TimedOut(timeout)));
            }
            let mut wait = sys::timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ };
            let mut got = (runs.len() - seen) as u32;
            // SAFETY: `raw` has room for `got` events and mirrors `CUfileIOEvents_t`'s layout with
            // the status as a plain u32 (see `RawEvent`); cuFile writes at most `got` of them.
            let status =
                unsafe { (self.cufile.batch_status)(batch.raw, 1, &mut got, raw.as_mut_ptr().cast(), &mut wait) };
            if let Err(err) = check("cuFileBatchIOGetStatus", status) {
                batch.cancel();
                return Err(BatchError::Failed(err.into()));
            }
            for event in raw.iter().take(got as usize) {
                let index = event.cookie as usize;
                let Some(slot) = events.get_mut(index) else { continue };
                if slot.is_none() && is_final(event.status) {
                    *slot = Some(BatchEvent { status: event.status, ret: event.ret as u64 });
                    seen += 1;
                }
            }
        }
        Ok(events.into_iter().map(|event| event.expect("every run reported")).collect())
    }
}

fn too_many(runs: usize) -> BackendError {
    BackendError::InvalidParam { name: "batch_limit".into(), reason: format!("{runs} runs in one batch") }
}

/// Whether a batch entry's status is final (done, failed, cancelled, timed out or invalid).
fn is_final(status: u32) -> bool {
    !matches!(status, WAITING | PENDING)
}

const WAITING: u32 = sys::CUfileStatus_t::CUFILE_WAITING as u32;
const PENDING: u32 = sys::CUfileStatus_t::CUFILE_PENDING as u32;
/// `CUFILE_COMPLETE`: the entry moved `ret` bytes.
pub const COMPLETE: u32 = sys::CUfileStatus_t::CUFILE_COMPLETE as u32;

/// `CUfileIOEvents_t` with its status read as an integer: a value cuFile writes that the Rust
/// enum lacks must not become an invalid enum.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawEvent {
    cookie: *mut c_void,
    status: u32,
    ret: usize,
}

const _: () = assert!(std::mem::size_of::<RawEvent>() == std::mem::size_of::<sys::CUfileIOEvents_t>());

/// How one entry of a batch ended: cuFile's status (see [`COMPLETE`]) and the bytes it moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchEvent {
    pub status: u32,
    pub ret: u64,
}

/// Why a batch did not run.
#[derive(Debug)]
pub enum BatchError {
    /// cuFile does not take batches here; nothing was submitted.
    Unavailable(DeviceError),
    /// The batch failed or timed out.
    Failed(BackendError),
}

/// A batch set up with cuFile, destroyed on drop.
struct BatchHandle {
    raw: sys::CUfileBatchHandle_t,
    cufile: &'static CuFile,
}

impl BatchHandle {
    fn cancel(&self) {
        // SAFETY: a live batch handle; cancelling one that is already done is harmless.
        let _ = unsafe { (self.cufile.batch_cancel)(self.raw) };
    }
}

impl Drop for BatchHandle {
    fn drop(&mut self) {
        // SAFETY: set up in `batch`, destroyed once; cancelled first when it did not finish.
        unsafe { (self.cufile.batch_destroy)(self.raw) };
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; every registration (holding an Arc) is gone by now.
        let _ = unsafe { (self.cufile.driver_close)() };
    }
}

/// One run of a request: `len` bytes at `device_offset` of the registered buffer at `base` on
/// `device`, and at `file_offset` of the file.
#[derive(Debug, Clone, Copy)]
pub struct Io {
    pub device: u64,
    pub base: u64,
    pub device_offset: u64,
    pub file_offset: u64,
    pub len: u64,
}

impl Io {
    /// The run without its first `moved` bytes.
    pub fn advanced(self, moved: u64) -> Io {
        let moved = moved.min(self.len);
        Io {
            device_offset: self.device_offset + moved,
            file_offset: self.file_offset + moved,
            len: self.len - moved,
            ..self
        }
    }
}

#[derive(Debug)]
enum Kind {
    Buffer { device: u64, ptr: u64 },
    File { handle: sys::CUfileHandle_t, readable: bool, writable: bool },
}

/// A cuFile registration, undone on drop.
#[derive(Debug)]
pub struct Registered {
    kind: Kind,
    driver: Arc<Driver>,
}

// SAFETY: cuFile handles and registered buffer addresses may be used from any thread.
unsafe impl Send for Registered {}
// SAFETY: as above; the handle is only passed to cuFile, which synchronises internally.
unsafe impl Sync for Registered {}

impl Drop for Registered {
    fn drop(&mut self) {
        match self.kind {
            Kind::Buffer { device, ptr } => {
                if xfer_cuda::bind_device(device).is_ok() {
                    // SAFETY: registered in `register_buffer`, deregistered once.
                    let _ = unsafe { (self.driver.cufile.buf_deregister)(ptr as usize as *const c_void) };
                }
            }
            // SAFETY: registered in `register_file`, deregistered once.
            Kind::File { handle, .. } => unsafe { (self.driver.cufile.handle_deregister)(handle) },
        }
    }
}
