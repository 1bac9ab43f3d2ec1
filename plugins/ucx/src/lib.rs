//! UCX backend of `xfer`, over the system's UCX library (UCP API).
//!
//! On bare-metal RDMA clusters UCX moves the bytes over InfiniBand or RoCE one-sidedly; on a
//! plain machine the same code runs over UCX's TCP and shared-memory transports. Each backend
//! instance has one UCP context (RMA + active messages + wakeup) and one worker, driven by a
//! progress thread that makes every UCP call ([`engine`]). The agent metadata carries the
//! worker address and, per registration (`ucp_mem_map`), the packed remote key.
//!
//! A READ or WRITE is one `ucp_get_nbx`/`ucp_put_nbx` per descriptor piece, then one
//! `ucp_ep_flush_nbx`: the request completes when the flush does, so the data is visible at
//! the target. A notification is an active message sent after that flush, acknowledged by the
//! receiver before the request completes. Endpoints are created on first use, in peer
//! error-handling mode: a dead peer fails its requests, and no completion for `timeout_ms`
//! fails them too (the endpoint is force-closed; the next request reconnects).
//!
//! Parameters (all optional; UCX's own `UCX_*` environment variables apply underneath; inside
//! a value, `+` stands for the comma of UCX lists, since commas separate parameters):
//! | key | default | meaning |
//! |---|---|---|
//! | `tls` | `$UCX_TLS`, else UCX's choice | UCX transports, e.g. `tcp`, `posix+cma+self`, `rc+cuda_copy` |
//! | `net_devices` | `$UCX_NET_DEVICES` | devices, e.g. `lo`, `mlx5_0:1` |
//! | `ucx_<name>` | — | any UCX setting, e.g. `ucx_rndv_thresh=inf` sets `UCX_RNDV_THRESH` |
//! | `timeout_ms` | 5000 | no completion toward a peer for this long fails its requests |
//! | `spin_us` | 2000 | the progress thread polls this long after the last event before it sleeps (waking a sleeping thread costs more than a copy of 1 MiB) |
//! | `max_op_bytes` | 67108864 | longer descriptors are moved as several operations (progress, and so the timeout, is seen per operation) |
//! | `error_mode` | `auto` | `peer`: UCX reports dead peers (needs tcp, rc, ud, dc...); `none`: only `timeout_ms` does; `auto`: peer where the transports allow (UCX 1.13's posix shared memory does not) |
//!
//! Limits: UCX over TCP or shared memory cannot enforce remote keys (the target does not take
//! part in a one-sided operation), so a peer holding a stale key can still reach memory the
//! target deregistered; on InfiniBand/RoCE the adapter refuses it. VRAM registers only when
//! UCX reports CUDA support; local VRAM as a request's source or destination additionally
//! needs device slices in `xfer-core` (today's `MemSlice` is host memory only).

mod config;
mod conn;
mod engine;
mod keys;
mod msg;
mod peer;
mod ucp;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, LocalRegion, MemType, RemoteAgent,
};

pub use config::Settings;
pub use keys::UcxRemoteKey;

use conn::PeerInfo;
use engine::{Command, Handle, CONTROL_TIMEOUT};
use peer::UcxPeer;

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
    engine: Arc<Handle>,
    conn_info: Vec<u8>,
    cuda: bool,
    next_peer: AtomicU64,
    stopped: AtomicBool,
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
        let BackendContext { agent_name, params, notifs } = ctx;
        let settings = Settings::parse(params)?;
        let started = engine::start(agent_name.clone(), settings.clone(), notifs)?;
        tracing::debug!(agent = %agent_name, ucx = ?ucp::version(), cuda = started.cuda, "ucx backend started");
        Ok(UcxBackend {
            agent_name,
            settings,
            engine: Arc::new(started.handle),
            conn_info: keys::encode_conn_info(&started.address),
            cuda: started.cuda,
            next_peer: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
        })
    }

    /// Whether this UCX build moves CUDA memory (and so whether VRAM registers).
    pub fn has_cuda(&self) -> bool {
        self.cuda
    }

    fn call<T>(&self, command: Command, answer: crossbeam_channel::Receiver<T>) -> Result<T, BackendError> {
        self.engine.send(command).map_err(|_| BackendError::Protocol("the ucx backend is shut down".into()))?;
        answer.recv_timeout(CONTROL_TIMEOUT).map_err(|_| BackendError::TimedOut(CONTROL_TIMEOUT))
    }
}

impl Backend for UcxBackend {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn capabilities(&self) -> Capabilities {
        let mut mem_types = vec![MemType::Dram];
        if self.cuda {
            mem_types.push(MemType::Vram);
        }
        Capabilities { mem_types, remote: true, local: true, notifications: true }
    }

    fn conn_info(&self) -> Vec<u8> {
        self.conn_info.clone()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        if region.mem_type() == MemType::Vram && !self.cuda {
            return Err(BackendError::Unsupported(
                "VRAM through ucx: this UCX build has no CUDA support (ucx_info -v shows its configure line)".into(),
            ));
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        self.call(Command::Register { region: Arc::clone(region), reply }, answer)?
    }

    fn deregister(&self, region: &LocalRegion) {
        let (reply, answer) = crossbeam_channel::bounded(1);
        if let Err(err) = self.call(Command::Deregister { region_id: region.id(), reply }, answer) {
            tracing::warn!(%err, region = region.id(), "ucx deregistration");
        }
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        let address = keys::decode_conn_info(conn_info)?;
        let info = PeerInfo {
            id: self.next_peer.fetch_add(1, Ordering::Relaxed),
            name: peer.to_string(),
            address,
            closed: AtomicBool::new(false),
        };
        Ok(Arc::new(UcxPeer {
            info: Arc::new(info),
            engine: Arc::clone(&self.engine),
            notify_bound: self.settings.timeout + Duration::from_secs(1),
        }))
    }

    fn shutdown(&self) {
        if !self.stopped.swap(true, Ordering::AcqRel) {
            self.engine.shutdown();
        }
    }
}

impl Drop for UcxBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}
