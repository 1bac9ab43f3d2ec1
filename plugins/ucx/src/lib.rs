//! UCX backend of `xfer`, over the system's UCX library (UCP API).
//!
//! On bare-metal RDMA clusters UCX moves the bytes over InfiniBand or RoCE one-sidedly; on a
//! plain machine the same code runs over UCX's TCP and shared-memory transports. Each backend
//! instance has one UCP context (RMA + active messages + wakeup) and one worker behind a lock
//! ([`engine`]): callers post on their own thread, a thread waiting for (or polling) a request
//! drives the worker itself, and a progress thread handles what nobody waits for (incoming
//! notifications, requests waited for asynchronously, timeouts). Over shared memory a request
//! thus completes on the caller's thread, with no thread hand-off. The agent metadata carries
//! the worker address and, per registration (`ucp_mem_map`), the packed remote key.
//!
//! A READ or WRITE is one `ucp_get_nbx`/`ucp_put_nbx` per descriptor piece (the agent has
//! merged descriptors that continue one another). A WRITE then
//! issues one `ucp_ep_flush_nbx` and completes when the flush does, so the data is visible at
//! the target; a READ completes when its gets do (their data has landed here). A notification
//! is an active message sent after that, acknowledged by the receiver before the request
//! completes. Endpoints are created on first use, in peer error-handling mode: a dead peer
//! fails its requests, and no completion for `timeout_ms` fails them too (the endpoint is
//! force-closed; the next request reconnects).
//!
//! Parameters (all optional; UCX's own `UCX_*` environment variables apply underneath; inside
//! a value, `+` stands for the comma of UCX lists, since commas separate parameters):
//! | key | default | meaning |
//! |---|---|---|
//! | `tls` | `$UCX_TLS`, else UCX's choice | UCX transports, e.g. `tcp`, `posix+cma+self`, `rc+cuda_copy` |
//! | `net_devices` | `$UCX_NET_DEVICES` | devices, e.g. `lo`, `mlx5_0:1` |
//! | `ucx_<name>` | — | any UCX setting, e.g. `ucx_rndv_thresh=inf` sets `UCX_RNDV_THRESH`; a transport's own setting goes without the transport's prefix (`ucx_tx_seg_size=64k` sets `UCX_TCP_TX_SEG_SIZE` in UCX 1.13; UCX 1.22 wants the prefix, `ucx_tcp_tx_seg_size=64k`), as `ucp_config_modify` takes it |
//! | `tcp_seg_size` | 262144 | segment size of UCX's TCP transport, sent and received (`UCX_TCP_TX_SEG_SIZE` and `UCX_TCP_RX_SEG_SIZE`, set under the name the loaded UCX takes; 0: UCX's 8 KiB and 64 KiB). Unless given here, it steps aside when the environment or a `ucx_` setting sets either size, when `tls` (or `$UCX_TLS`) cannot select tcp, and when `net_devices` (or `$UCX_NET_DEVICES`) lists only RDMA ports (`mlx5_0:1`); with devices that hold no network interface otherwise, UCX warns that `TX_SEG_SIZE`/`RX_SEG_SIZE` went unused (`tcp_seg_size=0` silences it). Peers must fit: a peer's RX segment must hold this side's TX segment (UCX does not check); each side publishes its sizes in its connection info and refuses to connect UCX to a peer whose sizes do not fit (the agent then uses another backend, or has none for that peer) |
//! | `timeout_ms` | 5000 | no completion toward a peer for this long fails its requests |
//! | `spin_us` | 2000 | a waiting thread, and the progress thread, poll this long after the last event before they sleep (waking a sleeping thread costs more than a copy of 1 MiB) |
//! | `max_op_bytes` | 67108864 | longer descriptors are moved as several operations (progress, and so the timeout, is seen per operation) |
//! | `error_mode` | `auto` | `peer`: UCX reports dead peers (needs tcp, rc, ud, dc...); `none`: only `timeout_ms` does; `auto`: peer where the transports allow (UCX 1.13's posix shared memory does not) |
//! | `staging_slots` | 2 | host slots per staging lane (files; GPU memory when UCX has no CUDA) |
//! | `staging_bytes` | 1048576 | bytes per staging slot (a multiple of 4096) |
//!
//! How the bytes move depends on the transports. Over InfiniBand/RoCE, `ucp_put_nbx` and
//! `ucp_get_nbx` are one-sided RDMA. Over TCP and over shared memory (`posix`, `sysv`), UCX
//! 1.13 has no one-sided path for memory it did not allocate itself: it emulates put and get
//! with active messages that the target's UCX answers from its progress (with
//! `UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y` UCX prints "software emulation" for both; over shared
//! memory the endpoint's only RMA lane is `posix/memory`, which reaches only UCX-allocated
//! memory, and `cma` is only used for rendezvous active messages). So over those transports
//! the target's progress thread is on the data path (its `spin_us` keeps it polling between
//! requests); over shared memory the bytes cross a FIFO in 8 KiB pieces (two copies).
//!
//! Over TCP each emulated put or get moves as active messages of one TCP segment each, and
//! the target answers every put segment with a completion message of its own (the flush of a
//! WRITE waits for the last). With UCX's 8 KiB segments a 1 MiB WRITE is 128 sends by the
//! initiator and 128 acknowledgements by the target, each a system call and a TCP segment
//! (strace: about 130 `sendto` per MiB on each side, in ucx_perftest's `ucp_put_bw` alike), and
//! that, not the target's sleep or the initiator's wait, is where the time went. Hence the
//! `tcp_seg_size` default of 256 KiB: 4 of each per MiB, and WRITE 3-4 times faster on
//! loopback (bench/README.md, "UCX against ucx_perftest": 1.06 and 1.18 GB/s at 1 MiB and
//! 16 MiB against `ucp_put_bw`'s 0.33 and 0.29 with UCX's segments and 0.75 and 0.87 with the
//! same 256 KiB, 2 vCPUs, load average about 4; in a quieter run 0.47 and 0.73 against 0.32
//! and 0.32, and 2.66 and 0.67 with the same segments: `ucp_put_bw` pipelines its puts, a
//! WRITE here waits for its flush). The cost: each worker's TCP
//! transport keeps pools of segment buffers (grown 8 at a time: 2 MiB for sending, 4 MiB for
//! receiving at 256 KiB), and peers must use segment sizes that fit each other, which they do
//! with the same setting (the default); UCX does not check a peer's segments against its own
//! receive buffer.
//! `ucx_perftest`'s shared-memory figures come from buffers UCX allocates in POSIX shared
//! memory, which the peer maps and copies with plain `memcpy`; registered application memory
//! cannot take that path (see `bench/README.md`, "UCX against ucx_perftest").
//!
//! Memory UCX allocates can: [`Backend::allocate`] (`Agent::allocate` in `xfer`) has UCX
//! allocate and register host memory (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`, no address,
//! so `UCX_ALLOC_PRIO` picks the method: with `posix` loaded, a POSIX shared-memory segment;
//! `ucp_mem_query` gives its range). A registration inside such an allocation reuses its
//! handle (the packed key then names the segment), a peer on this host maps the segment when
//! it unpacks the key, and its puts and gets become copies through the mapping, as in
//! `ucx_perftest`: no active messages, no work for the target's progress. Over transports
//! without shared memory (TCP, RDMA) the allocation is ordinary memory, registered as usual.
//! The returned `BackendBuffer` keeps the allocation: it is unmapped once the buffer and every
//! registration inside it are gone, even after the backend shut down (the UCP context then
//! stays until the last such buffer drops). A peer that mapped the segment keeps its pages
//! until it destroys the key, so a stale key writes into memory nobody reads rather than
//! crashing anyone; it is not refused either (see the first limit below). The segments live in
//! `UCX_POSIX_DIR` (`/dev/shm`): its size bounds what can be allocated (a container's default
//! 64 MiB `/dev/shm` is small for a KV cache). Every page is backed when the memory is
//! allocated (`MADV_POPULATE_WRITE`), so a segment the file system cannot hold fails the
//! allocation with an error; on kernels before 5.14, which lack that advice, the pages are
//! first touched when the buffer is zeroed, and such a segment raises SIGBUS there, still at
//! allocation rather than in the middle of a transfer.
//!
//! Grants (`Agent::grant`, module `grants`): each granted range gets a memory handle of its own
//! (`ucp_mem_map` again, so an rkey of its own), published in the grant's key together with
//! the grantee's name and a wall-clock deadline. A holder loading the grant announces itself
//! to the target (`Hold`, answered before `load_grant` returns; unanswered within `timeout_ms`
//! plus 1 s, the load fails). The holder checks every descriptor under the grant before it
//! posts anything: another agent's grant is `UnknownKey`, a descriptor outside the granted
//! ranges `OutOfBounds`, a revoked or expired grant `Revoked`, and no byte moves. `revoke`
//! sends `Revoke` to every holder; a holder marks the grant revoked at once, acknowledges once
//! the transfers it had in flight to the target when the revocation came are complete (their
//! gets have landed, their puts are flushed; transfers posted later cannot use the grant, so a
//! connection that is never idle still acknowledges), and destroys the grant's rkeys; `revoke` returns when every holder acknowledged
//! or failed, and then unmaps the grant's handles.
//!
//! The bound: `revoke` waits at most `timeout_ms` plus 1 s. A holder that is dead (its endpoint
//! fails, or over shared memory nothing completes for `timeout_ms`) sends nothing more, and its
//! endpoint is force-closed; after the bound the handles are unmapped whatever the holders
//! said, and the revocation is logged as unacknowledged. On InfiniBand/RoCE the unmap alone
//! cuts every holder off. Over TCP and shared memory it does not (see the first limit): a holder
//! that is alive but frozen through the whole bound (SIGSTOP), and later resumes operations it
//! had posted before the revocation, can still reach the memory. Grant expiry is checked by the
//! holder against the wall clock, so across hosts it is as exact as their clocks agree; a
//! target that never revokes forgets the grant 60 s after its deadline.
//!
//! Limits:
//! - Remote keys are not enforced over TCP or shared memory: UCX's emulated put/get write and
//!   read the address a message names without checking it against a registration, so a peer
//!   holding a stale key (or any address) still reaches memory the target deregistered; on
//!   InfiniBand/RoCE the adapter refuses it. Grants close that for peers running this backend
//!   (the revocation exchange above), not against a peer that ignores revocations.
//! - UCX 1.13's shared-memory transports cannot detect a dead peer (`error_mode=auto` falls
//!   back to `none`, once per backend, with an info line of ours; the ERROR line UCX logs for
//!   that refusal is kept out of its log): requests to it end by `timeout_ms`, and UCX never
//!   completes the operations it had queued to it. Their memory stays pinned (a deregistration
//!   waits) until the peer's process has exited, then it is let go: a deregistration after a
//!   peer was killed returns within `timeout_ms` plus about 2.5 s. A frozen peer's operations
//!   pin their memory until it resumes or exits.
//! - In about one run in four of a shared-memory peer killed mid-transfer, requests to this
//!   worker's other shared-memory peers stop completing too, from the moment of the kill, and
//!   end by `timeout_ms`. The likely cause: a slot of this worker's receive FIFO that the dead
//!   peer had claimed but never published; UCX reads the FIFO in order, so everything behind
//!   it waits for good. Only a new worker (a new backend) recovers.
//! - GPU memory goes to UCX as it is only when UCX reports CUDA support (`ucp_context_query`);
//!   without it, local VRAM is staged through CUDA lanes (pinned host slots, one stream) and
//!   local files through file lanes, as over TCP (module `staged`): each slot crosses as a get
//!   or a put of its own (one flush after a WRITE's last) while the next slot's copy runs.
//!   Staged jobs of one backend run one at a time, on one stager thread. Such memory is not
//!   reachable by peers: its key in the metadata says so (an empty packed key), and a request
//!   that names it is refused with the reason. Peers' memory must be what their UCX exposes:
//!   DRAM, or VRAM with CUDA.

mod config;
mod conn;
mod engine;
mod grants;
mod keys;
mod msg;
mod peer;
mod staged;
mod ucp;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer_core::{
    Backend, BackendBuffer, BackendContext, BackendError, BackendFactory, Capabilities, LocalRegion, MemType,
    RemoteAgent,
};

pub use config::Settings;
// The connection info and keys a peer's metadata carries, checked without the UCX library (the
// fuzz targets reach them).
pub use keys::{
    decode_conn_info, encode_conn_info, segments_fit, ConnInfo, ProcessId, SegmentsMisfit, TcpSegments, UcxRemoteKey,
};

use conn::PeerInfo;
use engine::Shared;
use peer::UcxPeer;
use staged::Stager;

/// Registers the UCX backend under the name `ucx`.
#[derive(Clone, Copy, Debug, Default)]
pub struct UcxFactory;

impl BackendFactory for UcxFactory {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(UcxBackend::new(ctx)?))
    }
}

/// The UCX library's version as `(major, minor, release)`.
pub fn ucx_version() -> (u32, u32, u32) {
    ucp::version()
}

pub struct UcxBackend {
    agent_name: String,
    settings: Settings,
    engine: Arc<Shared>,
    conn_info: Vec<u8>,
    /// This side's TCP segments, as published (peers must fit them).
    segments: keys::TcpSegments,
    cuda: bool,
    staging: Arc<dyn xfer_core::Staging>,
    stager: Arc<Stager>,
    next_peer: AtomicU64,
    stopped: AtomicBool,
    own_conn_info: Arc<[u8]>,
    /// This process as peers on this host recognise it.
    process: keys::ProcessId,
}

impl std::fmt::Debug for UcxBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxBackend")
            .field("agent", &self.agent_name)
            .field("settings", &self.settings)
            .field("cuda", &self.cuda)
            .finish_non_exhaustive()
    }
}

impl UcxBackend {
    pub fn new(ctx: BackendContext) -> Result<Self, BackendError> {
        let BackendContext { agent_name, params, notifs, staging, .. } = ctx;
        let settings = Settings::parse(params)?;
        let process = keys::ProcessId::current();
        let segments = settings.tcp_segments(|name| std::env::var(name).ok());
        let started = engine::start(agent_name.clone(), settings.clone(), notifs)?;
        tracing::debug!(agent = %agent_name, ucx = ?ucp::version(), cuda = started.cuda, "ucx backend started");
        let stager = Arc::new(Stager::new(
            Arc::clone(&started.shared),
            Arc::clone(&staging),
            settings.staging,
            settings.timeout,
            settings.max_op_bytes,
        ));
        let conn_info = keys::encode_conn_info(&started.address, process, segments);
        Ok(UcxBackend {
            agent_name,
            settings,
            engine: started.shared,
            own_conn_info: Arc::from(conn_info.as_slice()),
            conn_info,
            segments,
            cuda: started.cuda,
            staging,
            stager,
            next_peer: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            process,
        })
    }

    /// Host memory allocated by UCX (see [`Backend::allocate`] and the crate docs).
    pub fn allocate_host(&self, len: usize) -> Result<BackendBuffer, BackendError> {
        let len64 = u64::try_from(len).map_err(|_| BackendError::Unsupported(format!("allocation of {len} bytes")))?;
        let (id, range) = self.engine.with(|engine| engine.allocate(len64))??;
        tracing::debug!(agent = %self.agent_name, len, addr = format_args!("{:#x}", range.addr()), got = range.len(), "ucx allocation");
        let keep = UcxAllocation { id, engine: Arc::clone(&self.engine) };
        // `mem_alloc` checked that UCX's range holds `len` bytes; should it not, `keep` drops
        // here and releases the allocation.
        range
            .into_buffer(len, "ucx", Box::new(keep))
            .ok_or_else(|| BackendError::Protocol("ucx allocated fewer bytes than asked for".into()))
    }

    /// Whether this UCX build moves CUDA memory (and so whether VRAM registers).
    pub fn has_cuda(&self) -> bool {
        self.cuda
    }
}

impl Backend for UcxBackend {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn capabilities(&self) -> Capabilities {
        // Local files, and local GPU memory without CUDA, are staged through host slots; the
        // peer's memory must be what its UCX exposes (DRAM, or VRAM with CUDA).
        let mut paths = vec![(MemType::Dram, MemType::Dram), (MemType::File, MemType::Dram)];
        if self.cuda {
            // UCX with CUDA takes device pointers on either side (it detects the memory type,
            // and our registrations tell it too).
            paths.extend([
                (MemType::Dram, MemType::Vram),
                (MemType::Vram, MemType::Dram),
                (MemType::Vram, MemType::Vram),
                (MemType::File, MemType::Vram),
            ]);
        } else {
            paths.push((MemType::Vram, MemType::Dram));
        }
        Capabilities { paths, remote: true, local: true, notifications: true }
    }

    fn conn_info(&self) -> Vec<u8> {
        self.conn_info.clone()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        match region.mem_type() {
            MemType::Vram if !self.cuda => {
                self.staging.device_ready(region.desc().dev_id)?;
                self.engine.with(|engine| engine.register_local_only(region))
            }
            MemType::File => self.engine.with(|engine| engine.register_local_only(region)),
            _ => self.engine.with(|engine| engine.register(region))?,
        }
    }

    fn deregister(&self, region: &LocalRegion) {
        let id = region.id();
        if let Err(err) = self.engine.with(|engine| engine.deregister(id)) {
            tracing::warn!(%err, region = id, "ucx deregistration");
        }
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        let info = keys::decode_conn_info(conn_info)?;
        keys::segments_fit(self.segments, info.segments)
            .map_err(|reason| BackendError::Unsupported(format!("connecting to {peer}: {reason}")))?;
        let info = PeerInfo {
            id: self.next_peer.fetch_add(1, Ordering::Relaxed),
            name: peer.to_string(),
            address: info.address,
            local_pid: info.process.local_pid(&self.process),
            closed: AtomicBool::new(false),
        };
        Ok(Arc::new(UcxPeer {
            info: Arc::new(info),
            engine: Arc::clone(&self.engine),
            notify_bound: self.settings.timeout + Duration::from_secs(1),
            cuda: self.cuda,
            stager: Arc::clone(&self.stager),
            agent_name: self.agent_name.clone(),
            own_conn_info: Arc::clone(&self.own_conn_info),
        }))
    }

    fn grant(
        &self,
        region: &Arc<LocalRegion>,
        peer: &str,
        ranges: &[(u64, u64)],
        expires: Instant,
    ) -> Result<Vec<u8>, BackendError> {
        if region.mem_type() == MemType::File || (region.mem_type() == MemType::Vram && !self.cuda) {
            return Err(BackendError::Unsupported(format!("ucx cannot grant {} memory it stages", region.mem_type())));
        }
        let deadline_ms = grants::deadline_after(expires.saturating_duration_since(Instant::now()));
        self.engine.with(|engine| engine.grant(region, peer, ranges, deadline_ms))?
    }

    /// Revokes with the exchange of module `grants`: returns once every holder acknowledged,
    /// or failed, or after `timeout_ms` plus a second; the grant's handles are unmapped then.
    fn revoke(&self, public: &[u8]) {
        let Ok(key) = grants::UcxGrantKey::decode(public) else {
            return tracing::warn!(agent = %self.agent_name, "ucx revoke: not a ucx grant key");
        };
        let grant_id = key.grant_id;
        let (reply, answers) = crossbeam_channel::unbounded();
        let expected = self.engine.with(|engine| engine.revoke_grant(grant_id, &reply)).unwrap_or(0);
        drop(reply);
        if expected > 0 {
            self.engine.posted();
            let bound = self.settings.timeout + Duration::from_secs(1);
            let deadline = Instant::now() + bound;
            self.engine.drive_until(|| answers.len() >= expected, deadline);
            let mut unanswered = expected;
            while unanswered > 0 {
                match answers.recv_deadline(deadline) {
                    Ok(Ok(())) => {}
                    // A failed holder's endpoint is closed already (that is how it failed).
                    Ok(Err(err)) => tracing::warn!(agent = %self.agent_name, peer = %key.peer, %err,
                        "ucx revoke: a holder did not acknowledge; unmapping the grant's memory"),
                    Err(_) => {
                        tracing::warn!(agent = %self.agent_name, peer = %key.peer, ?bound,
                            "ucx revoke: no answer from a holder within the bound; unmapping the grant's memory");
                        break;
                    }
                }
                unanswered -= 1;
            }
        }
        let _ = self.engine.with(|engine| engine.release_grant(grant_id));
    }

    fn allocate(&self, len: usize, mem_type: MemType) -> Option<Result<BackendBuffer, BackendError>> {
        if mem_type != MemType::Dram {
            return None;
        }
        Some(self.allocate_host(len))
    }

    fn shutdown(&self) {
        if !self.stopped.swap(true, Ordering::AcqRel) {
            self.stager.shutdown();
            self.engine.shutdown();
        }
    }
}

/// Keeps a UCX allocation mapped; dropping it (with its buffer) releases it.
struct UcxAllocation {
    id: u64,
    engine: Arc<Shared>,
}

impl Drop for UcxAllocation {
    fn drop(&mut self) {
        self.engine.release_allocation(self.id);
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}
