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
//! them through cuFile's batch API (`cuFileBatchIOSetUp`/`Submit`/`GetStatus`): up to
//! `batch_limit` runs of one device per batch, waited for at most `timeout_ms`. A request of one
//! run, and every request once cuFile has refused to set up or take a batch (compat mode without
//! batch support, no nvidia-fs), goes run by run with `cuFileRead`/`cuFileWrite` instead. All of
//! it runs on the request's own thread. An entry that moved fewer bytes than asked finishes run
//! by run, so a read that meets the end of the file is `ShortFile`.
//!
//! The library is loaded at run time: builds need no CUDA. cuFile is looked for as
//! `libcufile.so`, then `libcufile.so.0` and `.so.1` (PyPI's nvidia-cufile ships only
//! `libcufile.so.0`, outside the loader's path: `pd_xfer.load_cufile()` loads it first, or name
//! its folder in `LD_LIBRARY_PATH`); cudarc gives the types only, its own loader not knowing
//! those names. The run on an NVIDIA H200 (`ci/gpu-check.sh`) passed with the CUDA toolkit's
//! cuFile and with PyPI's alone, in compatibility mode (no nvidia-fs there); moving 64 blocks of
//! 256 KiB took cuFile 0.12–0.16 GB/s against 1.4–2.5 GB/s for `posix`'s staging, so where
//! nvidia-fs is missing `posix` is the faster choice.
//!
//! Parameters: `max_request_bytes` (default 16777216, NIXL's GDS default): the largest single
//! cuFile read or write; `batch_limit` (default 128, cuFile's default `io_batchsize`): the most
//! runs in one batch (1: no batches); `timeout_ms` (default 30000): the wait for one batch.

// Unsafe only in `cufile` (the FFI calls and the handles they return).
#![deny(unsafe_code)]

mod cufile;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use xfer_core::own::{resolve_own, side_type, Instance, RegionIdKey};
use xfer_core::split::pair_runs;
use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, DeviceError, FileIoError, LocalMem,
    LocalRegion, MemType, NotifSink, Op, RefusalCode, RemoteAgent, RemoteKey, TransferJob,
};

use cufile::{BatchError, BatchEvent, Driver, Registered};

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
    batch_limit: usize,
    batch_timeout: Duration,
    /// Cleared once cuFile refused a batch: later requests go run by run.
    batches_work: AtomicBool,
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
        let batch_limit: usize = params.take_parsed("batch_limit", 128)?;
        let batch_timeout = params.take_millis("timeout_ms", Duration::from_secs(30))?;
        params.finish("gds")?;
        let invalid =
            |name: &str, reason: &str| BackendError::InvalidParam { name: name.into(), reason: reason.into() };
        if max_request == 0 {
            return Err(invalid("max_request_bytes", "must be positive"));
        }
        if !(1..=1024).contains(&batch_limit) {
            return Err(invalid("batch_limit", "must be 1..=1024"));
        }
        if batch_timeout.is_zero() {
            return Err(invalid("timeout_ms", "must be positive"));
        }
        let driver = Driver::open()?;
        let instance = Instance::fresh();
        let shared = Shared {
            agent_name: ctx.agent_name,
            instance,
            max_request,
            batch_limit,
            batch_timeout,
            batches_work: AtomicBool::new(true),
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
    let mut runs = Vec::new();
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
        runs.push((file_handle, io, file.fd()));
    }
    let devices: Vec<u64> = runs.iter().map(|(_, io, _)| io.device).collect();
    for group in batch_groups(&devices, shared.batch_limit) {
        let group = &runs[group];
        if group.len() > 1 && shared.batches_work.load(Ordering::Relaxed) {
            match shared.driver.batch(group, to_file, shared.batch_timeout) {
                Ok(events) => {
                    for (&(file, io, fd), event) in group.iter().zip(events) {
                        match settle(event, io.len) {
                            Settled::Done => {}
                            // The rest, run by run: at the end of the file that is `ShortFile`.
                            Settled::Rest(moved) => shared.driver.transfer(file, io.advanced(moved), to_file, fd)?,
                            Settled::Failed { status } => {
                                let message = format!("batch entry ended with cuFile status {status}");
                                return Err(DeviceError::Driver { call: "cuFileBatchIOGetStatus", message }.into());
                            }
                        }
                    }
                    continue;
                }
                Err(BatchError::Failed(err)) => return Err(err),
                Err(BatchError::Unavailable(err)) => {
                    tracing::info!(%err, "gds: cuFile takes no batches here; runs go one by one");
                    shared.batches_work.store(false, Ordering::Relaxed);
                }
            }
        }
        for &(file, io, fd) in group {
            shared.driver.transfer(file, io, to_file, fd)?;
        }
    }
    Ok(())
}

/// Cuts runs (given by device) into batches of consecutive runs on one device, at most `limit`
/// each.
fn batch_groups(devices: &[u64], limit: usize) -> Vec<std::ops::Range<usize>> {
    let limit = limit.max(1);
    let mut groups = Vec::new();
    let mut start = 0;
    for at in 1..=devices.len() {
        if at == devices.len() || at - start == limit || devices[at] != devices[start] {
            groups.push(start..at);
            start = at;
        }
    }
    groups
}

/// What a finished batch entry leaves to do.
#[derive(Debug, PartialEq, Eq)]
enum Settled {
    Done,
    /// Moved only this many bytes; the rest is still to move.
    Rest(u64),
    Failed {
        status: u32,
    },
}

fn settle(event: BatchEvent, len: u64) -> Settled {
    match event {
        BatchEvent { status: cufile::COMPLETE, ret } if ret >= len => Settled::Done,
        BatchEvent { status: cufile::COMPLETE, ret } => Settled::Rest(ret),
        BatchEvent { status, .. } => Settled::Failed { status },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_batch_by_device_and_limit() {
        assert_eq!(batch_groups(&[], 128), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(batch_groups(&[0], 128), vec![0..1]);
        assert_eq!(batch_groups(&[0; 5], 2), vec![0..2, 2..4, 4..5]);
        assert_eq!(batch_groups(&[0, 0, 1, 1, 1, 0], 128), vec![0..2, 2..5, 5..6]);
        assert_eq!(batch_groups(&[0, 0, 0], 1), vec![0..1, 1..2, 2..3], "1: no batches");
        assert_eq!(batch_groups(&[3; 4], 0), vec![0..1, 1..2, 2..3, 3..4], "0 is taken as 1");
    }

    #[test]
    fn batch_entries_settle_as_table() {
        let event = |status, ret| BatchEvent { status, ret };
        let table = [
            (event(cufile::COMPLETE, 4096), 4096, Settled::Done),
            (event(cufile::COMPLETE, 1000), 4096, Settled::Rest(1000)),
            (event(cufile::COMPLETE, 0), 4096, Settled::Rest(0)),
            (event(64, 0), 4096, Settled::Failed { status: 64 }),
            (event(8, 4096), 4096, Settled::Failed { status: 8 }),
            (event(12345, 4096), 4096, Settled::Failed { status: 12345 }),
        ];
        for (event, len, want) in table {
            assert_eq!(settle(event, len), want, "{event:?} of {len}");
        }
    }
}
