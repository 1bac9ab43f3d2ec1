//! The GDS backend's only `unsafe`: cuFile's driver, its buffer and file-handle registrations,
//! and the reads and writes between them.

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::cufile::sys;
use xfer_core::{file_io, BackendError, Desc, DeviceError, FileIoError};

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
#[derive(Debug)]
pub struct Driver(());

impl Driver {
    pub fn open() -> Result<Arc<Driver>, BackendError> {
        xfer_cuda::Cuda::get()?;
        // SAFETY: only tries to open the library (dlopen) under its usual names.
        if !unsafe { sys::is_culib_present() } {
            let reason = "the GPUDirect Storage library (libcufile.so) is not installed".to_string();
            return Err(DeviceError::Unavailable(reason).into());
        }
        // SAFETY: the library is present (checked above); opening the driver has no inputs.
        check("cuFileDriverOpen", unsafe { sys::cuFileDriverOpen() })?;
        Ok(Arc::new(Driver(())))
    }

    /// Registers GPU memory with cuFile (in its device's primary context).
    pub fn register_buffer(self: &Arc<Self>, desc: Desc) -> Result<Registered, BackendError> {
        xfer_cuda::bind_device(desc.dev_id)?;
        let ptr = desc.addr as usize as *const c_void;
        // SAFETY: `desc` is a registered VRAM region (its registration's contract: live device
        // memory until deregistered, which drops this registration first).
        check("cuFileBufRegister", unsafe { sys::cuFileBufRegister(ptr, desc.len as usize, 0) })?;
        Ok(Registered { kind: Kind::Buffer { device: desc.dev_id, ptr: desc.addr }, _driver: Arc::clone(self) })
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
        check("cuFileHandleRegister", unsafe { sys::cuFileHandleRegister(&mut handle, &mut descr) })?;
        Ok(Registered {
            kind: Kind::File { handle, readable: mode.readable, writable: mode.writable },
            _driver: Arc::clone(self),
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
                    sys::cuFileWrite(handle, base, size, file_at, device_at)
                } else {
                    sys::cuFileRead(handle, base, size, file_at, device_at)
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
        check("cuFileBatchIOSetUp", unsafe { sys::cuFileBatchIOSetUp(&mut batch, count) })
            .map_err(BatchError::Unavailable)?;
        let batch = BatchHandle(batch);
        // SAFETY: `params` holds `count` entries naming registered buffers (the request's pins keep
        // them registered), registered file handles and offsets that fit `off_t` (the caller
        // checked); cuFile reads them during the call.
        check("cuFileBatchIOSubmit", unsafe { sys::cuFileBatchIOSubmit(batch.0, count, params.as_mut_ptr(), 0) })
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
                unsafe { sys::cuFileBatchIOGetStatus(batch.0, 1, &mut got, raw.as_mut_ptr().cast(), &mut wait) };
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
struct BatchHandle(sys::CUfileBatchHandle_t);

impl BatchHandle {
    fn cancel(&self) {
        // SAFETY: a live batch handle; cancelling one that is already done is harmless.
        let _ = unsafe { sys::cuFileBatchIOCancel(self.0) };
    }
}

impl Drop for BatchHandle {
    fn drop(&mut self) {
        // SAFETY: set up in `batch`, destroyed once; cancelled first when it did not finish.
        unsafe { sys::cuFileBatchIODestroy(self.0) };
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // SAFETY: opened in `open`; every registration (holding an Arc) is gone by now.
        let _ = unsafe { sys::cuFileDriverClose() };
    }
}

// SAFETY: the driver handle is process-wide state of cuFile, usable from any thread.
unsafe impl Send for Driver {}
// SAFETY: as above.
unsafe impl Sync for Driver {}

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
    _driver: Arc<Driver>,
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
                    let _ = unsafe { sys::cuFileBufDeregister(ptr as usize as *const c_void) };
                }
            }
            // SAFETY: registered in `register_file`, deregistered once.
            Kind::File { handle, .. } => unsafe { sys::cuFileHandleDeregister(handle) },
        }
    }
}
