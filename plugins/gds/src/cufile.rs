//! The GDS backend's only `unsafe`: cuFile's driver, its buffer and file-handle registrations,
//! and the reads and writes between them.

#![allow(unsafe_code)]

use std::ffi::c_void;
use std::sync::Arc;

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

    /// Moves one run between a registered buffer and a registered file, retrying short
    /// transfers; a read that meets the end of the file is `ShortFile`.
    pub fn transfer(&self, file: &Registered, io: Io, to_file: bool, fd: i32) -> Result<(), BackendError> {
        let Kind::File { handle, readable, writable } = file.kind else {
            return Err(BackendError::Protocol("gds: a file run names a buffer registration".into()));
        };
        if to_file && !writable {
            return Err(FileIoError::NotWritable { fd }.into());
        }
        if !to_file && !readable {
            return Err(FileIoError::NotReadable { fd }.into());
        }
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
