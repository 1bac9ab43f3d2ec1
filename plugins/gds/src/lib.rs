//! GPUDirect Storage backend of `xfer` (`gds`): GPU memory (VRAM) ↔ registered files (FILE)
//! within one agent through cuFile, so the bytes go between the device and storage without a
//! host copy where the platform allows (nvidia-fs), and through cuFile's own bounce buffers in
//! compatibility mode where not (`"allow_compat_mode": true` in the `cufile.json` that
//! `CUFILE_ENV_PATH_JSON` names).
//!
//! As with POSIX, the transfer stays inside the agent: name the agent itself as the peer, one
//! list VRAM and the other FILE. Attach `gds` before `posix` to prefer it for VRAM↔FILE (attach
//! order is preference); where cuFile is absent, creating the backend fails with the reason and
//! `posix` stages VRAM↔FILE through host slots instead.
//!
//! Registration: a VRAM region is `cuFileBufRegister`ed (in its device's primary context), a
//! FILE region's descriptor `cuFileHandleRegister`ed; both are undone on deregistration. A
//! request pairs the GPU and file byte streams, cuts runs at `max_request_bytes`, and issues
//! them in order with `cuFileRead`/`cuFileWrite` on the request's own thread; a read that meets
//! the end of the file is `ShortFile`. The batch API is not used yet.
//!
//! The library is loaded at run time: builds need no CUDA. cudarc panics when a library it calls
//! is missing, so presence is checked before the first call.
//!
//! Parameters: `max_request_bytes` (default 16777216, NIXL's GDS default): the largest single
//! cuFile call.

// Unsafe only in `cufile` (the FFI calls and the handles they return).
#![deny(unsafe_code)]

mod cufile;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;
use xfer_core::own::{resolve_own, side_type, Instance, RegionIdKey};
use xfer_core::split::pair_runs;
use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, FileIoError, LocalMem, LocalRegion, MemType,
    NotifSink, Op, RefusalCode, RemoteAgent, RemoteKey, TransferJob,
};

use cufile::{Driver, Registered};

/// Creates [`GdsBackend`]s (`gds`).
#[derive(Debug)]
pub struct GdsFactory;

impl BackendFactory for GdsFactory {
    fn name(&self) -> &'static str {
        "gds"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(GdsBackend::new(ctx)?))
    }
}

struct Entry {
    region: Arc<LocalRegion>,
    registered: Registered,
}

struct Shared {
    agent_name: String,
    instance: Instance,
    max_request: u64,
    registered: RwLock<HashMap<u64, Entry>>,
    notifs: NotifSink,
    driver: Arc<Driver>,
}

/// The GDS backend: VRAM ↔ FILE within its own agent through cuFile.
pub struct GdsBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for GdsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GdsBackend").field("agent", &self.shared.agent_name).finish_non_exhaustive()
    }
}

impl GdsBackend {
    pub fn new(ctx: BackendContext) -> Result<GdsBackend, BackendError> {
        let mut params = ctx.params;
        let max_request: u64 = params.take_parsed("max_request_bytes", 16u64 << 20)?;
        params.finish("gds")?;
        if max_request == 0 {
            return Err(BackendError::InvalidParam {
                name: "max_request_bytes".into(),
                reason: "must be positive".into(),
            });
        }
        let driver = Driver::open()?;
        let instance = Instance::fresh();
        let shared = Shared {
            agent_name: ctx.agent_name,
            instance,
            max_request,
            registered: RwLock::new(HashMap::new()),
            notifs: ctx.notifs,
            driver,
        };
        Ok(GdsBackend { shared: Arc::new(shared) })
    }
}

impl Backend for GdsBackend {
    fn name(&self) -> &'static str {
        "gds"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            paths: vec![(MemType::Vram, MemType::File), (MemType::File, MemType::Vram)],
            remote: false,
            local: true,
            notifications: true,
        }
    }

    fn conn_info(&self) -> Vec<u8> {
        self.shared.instance.conn_info()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        let registered = match region.mem_type() {
            MemType::Vram => self.shared.driver.register_buffer(region.desc())?,
            MemType::File => self.shared.driver.register_file(region.desc())?,
            other => return Err(BackendError::MemoryNotMoved { backend: "gds", mem_type: other }),
        };
        let entry = Entry { region: Arc::clone(region), registered };
        self.shared.registered.write().insert(region.id(), entry);
        Ok(RegionIdKey::encode(region))
    }

    fn deregister(&self, region: &LocalRegion) {
        // Dropping the entry undoes the cuFile registration.
        self.shared.registered.write().remove(&region.id());
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        self.shared.instance.admit("gds", &self.shared.agent_name, peer, conn_info)?;
        Ok(Arc::new(Loopback { shared: Arc::clone(&self.shared) }))
    }

    fn shutdown(&self) {}
}

struct Loopback {
    shared: Arc<Shared>,
}

impl RemoteAgent for Loopback {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        RegionIdKey::unpack(public, "gds")
    }

    fn post(&self, job: TransferJob) {
        let TransferJob { op, local, remote, notif, done } = job;
        let remote = {
            let registered = self.shared.registered.read();
            resolve_own(&remote, "gds", |id| registered.get(&id).map(|entry| Arc::clone(&entry.region)))
        };
        let remote = match remote {
            Ok(remote) => remote,
            Err(err) => return done.complete(Err(err)),
        };
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new().name("xfer-gds".into()).spawn(move || {
            let result = run(&shared, op, local, remote);
            if let (Ok(()), Some(message)) = (&result, notif) {
                (shared.notifs)(&shared.agent_name, message);
            }
            done.complete(result);
        });
        if let Err(err) = spawned {
            tracing::error!(%err, "gds: cannot spawn a request thread");
        }
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        (self.shared.notifs)(&self.shared.agent_name, message.to_vec());
        Ok(())
    }

    fn disconnect(&self) {}
}

/// Orients, checks and moves one request; see the crate docs.
fn run(shared: &Shared, op: Op, local: Vec<LocalMem>, remote: Vec<LocalMem>) -> Result<(), BackendError> {
    let local_is_file = match (side_type(&local, "gds")?, side_type(&remote, "gds")?) {
        (Some(MemType::Vram), Some(MemType::File)) => false,
        (Some(MemType::File), Some(MemType::Vram)) => true,
        _ => return Err(BackendError::Unsupported("gds moves VRAM↔FILE, one type per side".into())),
    };
    let (gpu, files) = if local_is_file { (remote, local) } else { (local, remote) };
    let gpu_lens: Vec<u64> = gpu.iter().map(LocalMem::len).collect();
    let file_lens: Vec<u64> = files.iter().map(LocalMem::len).collect();
    let (gpu_total, file_total) = (gpu_lens.iter().sum::<u64>(), file_lens.iter().sum::<u64>());
    if gpu_total != file_total {
        let message = format!("GPU memory {gpu_total} bytes vs file {file_total} bytes");
        return Err(BackendError::Refused { code: RefusalCode::BadRequest, message });
    }
    let to_file = matches!((op, local_is_file), (Op::Write, false) | (Op::Read, true));
    let registered = shared.registered.read();
    let lookup = |piece: &LocalMem| {
        registered.get(&piece.pin().region().id()).map(|entry| (&entry.region, &entry.registered)).ok_or_else(|| {
            BackendError::Refused {
                code: RefusalCode::Deregistered,
                message: "region is no longer registered with gds".into(),
            }
        })
    };
    for run in pair_runs(&gpu_lens, &file_lens, shared.max_request) {
        let (LocalMem::Device(device), LocalMem::File(file)) = (&gpu[run.mem], &files[run.file]) else {
            return Err(BackendError::Protocol("gds: sides changed type after orientation".into()));
        };
        let (gpu_region, _) = lookup(&gpu[run.mem])?;
        let (_, file_handle) = lookup(&files[run.file])?;
        let base = gpu_region.desc().addr;
        let device_offset = device.ptr() - base + run.mem_offset;
        let file_offset = file.offset() + run.file_offset;
        if file_offset.checked_add(run.len).is_none_or(|end| end > i64::MAX as u64) {
            return Err(FileIoError::BadOffset { fd: file.fd(), offset: file_offset, len: run.len }.into());
        }
        let io = cufile::Io { device: device.device(), base, device_offset, file_offset, len: run.len };
        shared.driver.transfer(file_handle, io, to_file, file.fd())?;
    }
    Ok(())
}
