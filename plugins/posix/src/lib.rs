//! POSIX file backend of `xfer`: moves bytes between an agent's host memory (DRAM) and its
//! registered files (FILE), batched through io_uring where the kernel allows it, else with
//! `pread`/`pwrite` on a thread pool.
//!
//! NIXL's POSIX plugin semantics: the transfer stays inside one agent. A request names the
//! agent itself as its peer; its local list is DRAM and its "remote" list FILE (or the other way
//! round), and READ moves remote → local, WRITE local → remote as always. A FILE descriptor is
//! `(offset in the file as addr, len, file descriptor as dev_id)`; `Agent::register_file`
//! registers an open `File` that way and keeps it open. Naming the agent itself as the peer
//! needs no metadata exchange: the agent resolves such requests against its own registrations
//! (see `xfer::Agent`), and this backend's `connect` accepts only its own agent.
//!
//! The data path: the host and file byte streams are paired in order (boundaries need not line
//! up), cut into runs of at most `chunk_bytes`, grouped into tasks, and the tasks run on
//! `threads` workers in parallel (see Engines below). The request completes when the last task
//! has; the first error wins and stops the rest. Before any byte moves, every run is checked:
//! the range must be addressable (`offset + len ≤ i64::MAX`, else `BadOffset`), a WRITE needs a
//! descriptor open for writing (`NotWritable`), a READ one open for reading (`NotReadable`). A
//! read that meets the end of the file fails with `ShortFile`; a closed descriptor gives
//! `BadFd`; every other refusal of the kernel is `Os` with the errno. All are
//! `BackendError::File(FileIoError::…)`: never a panic. A file deleted while registered stays
//! readable and writable through its descriptor (POSIX keeps the inode until the last close),
//! so that is not an error.
//!
//! **O_DIRECT**: open the file with `O_DIRECT` (`OpenOptions::custom_flags(libc::O_DIRECT)`);
//! the backend sees the flag when the file is registered. Every run must then have its host
//! address, file offset and length a multiple of `direct_align` (default 4096, the largest common
//! logical block size), checked before any I/O (`Misaligned`); runs are cut at `chunk_bytes`,
//! which must itself be a multiple of it. `HostBuffer`s are page-aligned, so whole-block
//! descriptors into them qualify.
//!
//! **GPU memory ↔ FILE** (VRAM on one side, FILE on the other) is staged: the agent's CUDA lane
//! copies between the device and pinned slots, and the slots are read from and written to the
//! file in order (`xfer_core::staging` with the files as its wire), a slot's device copy
//! overlapping the next slot's file I/O. Such a request runs on its own thread; the checks above
//! apply, and with O_DIRECT every file range and GPU piece length must be aligned. Registering
//! VRAM without a CUDA driver fails with the reason. GPUDirect Storage (no host copy) is not
//! used yet.
//!
//! Waits: a request's `wait` is bounded by its caller's timeout; local file I/O has no other
//! wait (a hung network file system would hold a worker, as it would any `pread`).
//!
//! **Engines**: with `engine=uring` every worker owns an io_uring and keeps up to `iodepth`
//! runs in flight, drawn from as many queued tasks as fit (one `io_uring_enter` submits a batch
//! and reaps what completed); short transfers are resubmitted for the rest. With
//! `engine=threads` every worker does one blocking `pread`/`pwrite` at a time. `auto` (the
//! default) creates the rings and falls back to threads, logging why at debug level, where the
//! kernel has no io_uring (before 5.6), forbids it (seccomp, `kernel.io_uring_disabled`,
//! containers) or the ring's memory is refused; `engine=uring` there is an error at creation.
//! Both engines plan, check and report errors the same way.
//!
//! Parameters (all optional):
//! | key | default | meaning |
//! |---|---|---|
//! | `engine` | `auto` | `auto`, `uring` or `threads` (above) |
//! | `threads` | 4 | worker threads doing reads and writes (with `uring`: rings, one per thread) |
//! | `iodepth` | 32 | runs one ring keeps in flight (`uring` only) |
//! | `chunk_bytes` | 4194304 | largest single read or write |
//! | `task_bytes` | 16777216 | bytes one worker takes from the queue at once |
//! | `direct_align` | 4096 | alignment required for files opened with `O_DIRECT` |

#![deny(unsafe_code)]

mod plan;
mod pool;
mod sys;
mod uring;

use std::collections::HashMap;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, FileIoError, LocalMem, LocalRegion, MemType,
    NotifSink, Op, RefusalCode, RemoteAgent, RemoteKey, RemoteSeg, TransferJob,
};

use xfer_core::own::{resolve_own, side_type, Instance, RegionIdKey};
use xfer_core::split::pair_runs;
use xfer_core::staging::{self, FileWire, Flow, Staging};

use pool::{Direction, IoOp, Pool, Task, Tracker, Workers};
use sys::FileMode;

/// Creates [`PosixBackend`]s (`posix`).
#[derive(Debug)]
pub struct PosixFactory;

impl BackendFactory for PosixFactory {
    fn name(&self) -> &'static str {
        "posix"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(PosixBackend::new(ctx)?))
    }
}

#[derive(Debug, Clone, Copy)]
struct Config {
    /// The engine in use (`auto` resolved).
    engine: Engine,
    threads: usize,
    iodepth: u32,
    chunk_bytes: u64,
    task_bytes: u64,
    direct_align: u64,
}

/// The `engine` parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EngineChoice {
    Auto,
    Uring,
    Threads,
}

#[derive(Debug, thiserror::Error)]
#[error("expected auto, uring or threads")]
struct UnknownEngine;

impl std::str::FromStr for EngineChoice {
    type Err = UnknownEngine;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        match value {
            "auto" => Ok(EngineChoice::Auto),
            "uring" => Ok(EngineChoice::Uring),
            "threads" => Ok(EngineChoice::Threads),
            _ => Err(UnknownEngine),
        }
    }
}

/// The engine a backend runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Uring,
    Threads,
}

/// A registration this backend serves: the region, and for a file how it was opened.
struct Registered {
    region: Arc<LocalRegion>,
    file_mode: Option<FileMode>,
}

struct Shared {
    agent_name: String,
    /// Tells this backend instance's own metadata from another process's agent of the same name.
    instance: Instance,
    config: Config,
    registered: RwLock<HashMap<u64, Registered>>,
    pool: Pool,
    notifs: NotifSink,
    /// Lanes for GPU memory ↔ FILE (pinned slots and a CUDA stream from the agent).
    staging: Arc<dyn Staging>,
}

/// The POSIX backend: DRAM ↔ FILE within its own agent.
pub struct PosixBackend {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for PosixBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PosixBackend")
            .field("agent", &self.shared.agent_name)
            .field("config", &self.shared.config)
            .finish_non_exhaustive()
    }
}

impl PosixBackend {
    pub fn new(ctx: BackendContext) -> Result<PosixBackend, BackendError> {
        let mut params = ctx.params;
        let requested: EngineChoice = params.take_parsed("engine", EngineChoice::Auto)?;
        let mut config = Config {
            engine: Engine::Threads,
            threads: params.take_parsed("threads", 4usize)?.clamp(1, 256),
            iodepth: params.take_parsed("iodepth", 32u32)?.clamp(1, 4096),
            chunk_bytes: params.take_parsed("chunk_bytes", 4u64 << 20)?.max(1),
            task_bytes: params.take_parsed("task_bytes", 16u64 << 20)?.max(1),
            direct_align: params.take_parsed("direct_align", 4096u64)?,
        };
        params.finish("posix")?;
        if !config.direct_align.is_power_of_two() || !config.chunk_bytes.is_multiple_of(config.direct_align) {
            return Err(BackendError::InvalidParam {
                name: "direct_align".into(),
                reason: format!(
                    "{} must be a power of two dividing chunk_bytes ({})",
                    config.direct_align, config.chunk_bytes
                ),
            });
        }
        let instance = Instance::fresh();
        let workers = match requested {
            EngineChoice::Threads => Workers::Threads(config.threads),
            EngineChoice::Uring => Workers::Uring(uring::rings(config.threads, config.iodepth).map_err(|err| {
                BackendError::Unsupported(format!("posix engine=uring: io_uring is not available here: {err}"))
            })?),
            EngineChoice::Auto => match uring::rings(config.threads, config.iodepth) {
                Ok(rings) => Workers::Uring(rings),
                Err(err) => {
                    tracing::debug!(%err, "posix: io_uring is not available, using the pread/pwrite thread pool");
                    Workers::Threads(config.threads)
                }
            },
        };
        if matches!(workers, Workers::Uring(_)) {
            config.engine = Engine::Uring;
        }
        tracing::debug!(?config, "posix: backend created");
        let pool = Pool::start(workers)?;
        let shared = Shared {
            agent_name: ctx.agent_name,
            instance,
            config,
            registered: RwLock::new(HashMap::new()),
            pool,
            notifs: ctx.notifs,
            staging: ctx.staging,
        };
        Ok(PosixBackend { shared: Arc::new(shared) })
    }
}

impl Backend for PosixBackend {
    fn name(&self) -> &'static str {
        "posix"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            paths: vec![
                (MemType::Dram, MemType::File),
                (MemType::File, MemType::Dram),
                (MemType::Vram, MemType::File),
                (MemType::File, MemType::Vram),
            ],
            remote: false,
            local: true,
            notifications: true,
        }
    }

    fn conn_info(&self) -> Vec<u8> {
        self.shared.instance.conn_info()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        let file_mode = match region.mem_type() {
            MemType::Dram => None,
            MemType::Vram => {
                self.shared.staging.device_ready(region.desc().dev_id)?;
                None
            }
            MemType::File => {
                let dev_id = region.desc().dev_id;
                let fd = i32::try_from(dev_id).map_err(|_| BackendError::InvalidParam {
                    name: "dev_id".into(),
                    reason: format!("{dev_id} is not a file descriptor"),
                })?;
                Some(sys::file_mode(fd)?)
            }
            other => return Err(BackendError::MemoryNotMoved { backend: "posix", mem_type: other }),
        };
        let registered = Registered { region: Arc::clone(region), file_mode };
        self.shared.registered.write().insert(region.id(), registered);
        Ok(RegionIdKey::encode(region))
    }

    fn deregister(&self, region: &LocalRegion) {
        self.shared.registered.write().remove(&region.id());
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        self.shared.instance.admit("posix", &self.shared.agent_name, peer, conn_info)?;
        Ok(Arc::new(Loopback { shared: Arc::clone(&self.shared) }))
    }

    fn shutdown(&self) {
        self.shared.pool.stop();
    }
}

/// The agent's link to itself through this backend.
struct Loopback {
    shared: Arc<Shared>,
}

impl RemoteAgent for Loopback {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        RegionIdKey::unpack(public, "posix")
    }

    fn post(&self, job: TransferJob) {
        let TransferJob { op, local, remote, notif, done } = job;
        if local.iter().any(|piece| piece.mem_type() == MemType::Vram) || self.shared.remote_is_vram(&remote) {
            return self.stage_gpu(op, local, &remote, notif, done);
        }
        match self.plan(op, local, &remote) {
            Ok((direction, ops, file_side)) => {
                let notif = notif.map(|m| (Arc::clone(&self.shared.notifs), self.shared.agent_name.clone(), m));
                self.submit(direction, ops, file_side, notif, done);
            }
            Err(err) => done.complete(Err(err)),
        }
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        (self.shared.notifs)(&self.shared.agent_name, message.to_vec());
        Ok(())
    }

    fn disconnect(&self) {}
}

type Plan = (Direction, Vec<IoOp>, Vec<LocalMem>);

/// Slots of a GPU staging lane, and the largest slot (the chunk size, at most this).
const STAGING_SLOTS: usize = 2;
const STAGING_SLOT_MAX: u64 = 4 << 20;

impl Shared {
    /// Whether a request's remote side is GPU memory (its keys name VRAM registrations).
    fn remote_is_vram(&self, remote: &[RemoteSeg]) -> bool {
        let registered = self.registered.read();
        remote.iter().any(|seg| {
            RegionIdKey::of(seg, "posix")
                .ok()
                .and_then(|id| registered.get(&id))
                .is_some_and(|entry| entry.region.mem_type() == MemType::Vram)
        })
    }
}

impl Loopback {
    /// GPU memory ↔ FILE: the file is the wire of a staged transfer (`xfer_core::staging`), so a
    /// slot's device copy overlaps the next slot's `pread`/`pwrite`. On its own thread: the
    /// pool's workers move host memory only.
    fn stage_gpu(
        &self,
        op: Op,
        local: Vec<LocalMem>,
        remote: &[RemoteSeg],
        notif: Option<Vec<u8>>,
        done: xfer_core::Completer,
    ) {
        let remote = match self.resolve(remote) {
            Ok(remote) => remote,
            Err(err) => return done.complete(Err(err)),
        };
        let shared = Arc::clone(&self.shared);
        let spawned = std::thread::Builder::new().name("xfer-posix-gpu".into()).spawn(move || {
            let result = stage_gpu(&shared, op, local, remote);
            if let (Ok(()), Some(message)) = (&result, notif) {
                (shared.notifs)(&shared.agent_name, message);
            }
            done.complete(result);
        });
        if let Err(err) = spawned {
            tracing::error!(%err, "posix: cannot spawn a GPU staging thread");
        }
    }
}

/// Checks and runs one GPU memory ↔ FILE request; see [`Loopback::stage_gpu`].
fn stage_gpu(shared: &Shared, op: Op, local: Vec<LocalMem>, remote: Vec<LocalMem>) -> Result<(), BackendError> {
    let local_is_file = match (side_type(&local, "posix")?, side_type(&remote, "posix")?) {
        (Some(MemType::Vram), Some(MemType::File)) => false,
        (Some(MemType::File), Some(MemType::Vram)) => true,
        (l, r) => {
            return Err(BackendError::Unsupported(format!(
                "posix moves VRAM↔FILE, not {}→{}",
                l.map_or("empty".to_string(), |t| t.to_string()),
                r.map_or("empty".to_string(), |t| t.to_string())
            )))
        }
    };
    let (mut gpu, files) = if local_is_file { (remote, local) } else { (local, remote) };
    let (gpu_total, file_total) = (gpu.iter().map(LocalMem::len).sum::<u64>(), files.iter().map(LocalMem::len).sum());
    if gpu_total != file_total {
        let message = format!("GPU memory {gpu_total} bytes vs file {file_total} bytes");
        return Err(BackendError::Refused { code: RefusalCode::BadRequest, message });
    }
    let to_file = matches!((op, local_is_file), (Op::Write, false) | (Op::Read, true));
    let config = &shared.config;
    {
        let registered = shared.registered.read();
        for piece in &files {
            let LocalMem::File(file) = piece else { continue };
            let (fd, offset) = (file.fd(), file.offset());
            plan::check_range(fd, offset, file.len())?;
            let mode = registered.get(&file.pin().region().id()).and_then(|r| r.file_mode).ok_or_else(|| {
                BackendError::Refused {
                    code: RefusalCode::Deregistered,
                    message: format!("file fd {fd} is no longer registered with posix"),
                }
            })?;
            match to_file {
                true if !mode.writable => return Err(FileIoError::NotWritable { fd }.into()),
                false if !mode.readable => return Err(FileIoError::NotReadable { fd }.into()),
                _ => {}
            }
            if mode.direct {
                // Slots are page-aligned and a multiple of the alignment; the pieces must be too.
                plan::check_direct(fd, 0, offset, file.len(), config.direct_align)?;
                for device in &gpu {
                    plan::check_direct(fd, 0, 0, device.len(), config.direct_align)?;
                }
            }
        }
    }
    let device = gpu.iter().find_map(LocalMem::device);
    let mut lane = shared.staging.lane(device, STAGING_SLOTS, config.chunk_bytes.min(STAGING_SLOT_MAX) as usize)?;
    let flow = if to_file { Flow::ToWire } else { Flow::FromWire };
    staging::run(flow, &mut gpu, lane.as_mut(), &mut FileWire::new(&files))
}

impl Loopback {
    /// Resolves the remote side against this agent's registrations, orients the request
    /// (which side is the file), pairs the byte streams and checks every run.
    fn plan(&self, op: Op, local: Vec<LocalMem>, remote: &[RemoteSeg]) -> Result<Plan, BackendError> {
        let remote = self.resolve(remote)?;
        let local_is_file = match (side_type(&local, "posix")?, side_type(&remote, "posix")?) {
            (Some(MemType::Dram), Some(MemType::File)) | (None, Some(MemType::File)) => false,
            (Some(MemType::File), Some(MemType::Dram)) | (Some(MemType::File), None) => true,
            (Some(MemType::Dram), None) | (None, Some(MemType::Dram)) | (None, None) => false,
            (l, r) => {
                return Err(BackendError::Unsupported(format!(
                    "posix moves DRAM↔FILE, not {}→{}",
                    l.map_or("empty".to_string(), |t| t.to_string()),
                    r.map_or("empty".to_string(), |t| t.to_string())
                )))
            }
        };
        let (host_side, file_side) = if local_is_file { (remote, local) } else { (local, remote) };
        // Bytes go local → remote on WRITE; the file is the destination when it is remote then.
        let direction = match (op, local_is_file) {
            (Op::Write, false) | (Op::Read, true) => Direction::HostToFile,
            (Op::Read, false) | (Op::Write, true) => Direction::FileToHost,
        };
        let host_lens: Vec<u64> = host_side.iter().map(LocalMem::len).collect();
        let file_lens: Vec<u64> = file_side.iter().map(LocalMem::len).collect();
        let (host_total, file_total) = (host_lens.iter().sum::<u64>(), file_lens.iter().sum::<u64>());
        if host_total != file_total {
            let message = format!("memory {host_total} bytes vs file {file_total} bytes");
            return Err(BackendError::Refused { code: RefusalCode::BadRequest, message });
        }
        let host: Vec<_> = host_side.into_iter().map(|m| m.into_host("posix")).collect::<Result<_, _>>()?;
        let registered = self.shared.registered.read();
        let config = &self.shared.config;
        let mut ops = Vec::new();
        for run in pair_runs(&host_lens, &file_lens, config.chunk_bytes) {
            let LocalMem::File(file) = &file_side[run.file] else { unreachable!("oriented above") };
            let (fd, offset) = (file.fd(), file.offset() + run.file_offset);
            let host_piece = host[run.mem]
                .sub(run.mem_offset as usize, run.len as usize)
                .ok_or_else(|| BackendError::Protocol("posix plan cut outside a host piece".into()))?;
            plan::check_range(fd, offset, run.len)?;
            let mode = registered.get(&file.pin().region().id()).and_then(|r| r.file_mode).ok_or_else(|| {
                BackendError::Refused {
                    code: RefusalCode::Deregistered,
                    message: format!("file fd {fd} is no longer registered with posix"),
                }
            })?;
            match direction {
                Direction::HostToFile if !mode.writable => return Err(FileIoError::NotWritable { fd }.into()),
                Direction::FileToHost if !mode.readable => return Err(FileIoError::NotReadable { fd }.into()),
                _ => {}
            }
            if mode.direct {
                plan::check_direct(fd, host_piece.addr(), offset, run.len, config.direct_align)?;
            }
            ops.push(IoOp { fd, file_offset: offset, host: host_piece });
        }
        Ok((direction, ops, file_side))
    }

    /// The remote segments as this agent's own memory, pinned.
    fn resolve(&self, remote: &[RemoteSeg]) -> Result<Vec<LocalMem>, BackendError> {
        let registered = self.shared.registered.read();
        resolve_own(remote, "posix", |id| registered.get(&id).map(|entry| Arc::clone(&entry.region)))
    }

    fn submit(
        &self,
        direction: Direction,
        ops: Vec<IoOp>,
        file_side: Vec<LocalMem>,
        notif: Option<(NotifSink, String, Vec<u8>)>,
        done: xfer_core::Completer,
    ) {
        let runs: Vec<u64> = ops.iter().map(|op| op.host.len() as u64).collect();
        let groups = plan::group(&runs, self.shared.config.task_bytes, MAX_RUNS_PER_TASK);
        let tracker = Arc::new(Tracker {
            direction,
            remaining: AtomicUsize::new(groups.len().max(1)),
            error: Mutex::new(None),
            done: Mutex::new(Some(done)),
            notif,
            _file_side: file_side,
        });
        if ops.is_empty() {
            // Nothing to move: one empty task still completes the request (and notifies).
            return self.shared.pool.submit(vec![Task { ops: Vec::new(), tracker }]);
        }
        let mut ops = ops.into_iter();
        let tasks = groups
            .iter()
            .map(|range| Task { ops: ops.by_ref().take(range.len()).collect(), tracker: Arc::clone(&tracker) })
            .collect();
        self.shared.pool.submit(tasks);
    }
}

/// Runs one worker takes at once at most: enough to amortise the queue hop over tiny
/// descriptors, few enough that 4096 of them still spread over every worker.
const MAX_RUNS_PER_TASK: usize = 256;
