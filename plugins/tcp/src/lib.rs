//! Pure-Rust TCP backend of `xfer`.
//!
//! The target serves its registered memory on a data port; the initiator keeps a pool of
//! connections per peer, cuts large requests into chunks spread over parallel streams, sends
//! many small descriptors in one frame, and moves payload bytes straight between the socket and
//! the registered memory with vectored I/O (no intermediate copies, except the bytes of a small
//! frame that arrive with its header: they are copied once out of the connection's
//! [read-ahead buffer](readahead), which saves a read(2) per part). Every request names a
//! registration by a random 128-bit key; the target checks key and bounds before touching
//! memory. Wire format: [`frame`]. A key may instead be a grant's (module `grants`): one
//! initiator, some ranges, until revoked or expired; the target refuses anything else under it
//! with `Revoked`, `OutOfBounds` or `UnknownKey` before touching memory.
//!
//! GPU memory (VRAM) and files (FILE) move on either side by staging (`xfer_core::staging`): the
//! initiator's stream workers and the target's connection threads each keep a copy lane
//! (CUDA's pinned slots and stream from the agent, or `pread`/`pwrite` for files), and the
//! payload crosses the socket slot by slot while the next slot is being copied. Files are
//! checked on both sides before any byte moves (open the right way, long enough to read,
//! O_DIRECT alignment), so those mistakes are typed refusals; requests are cut over the streams
//! at 4 KiB multiples so O_DIRECT pieces stay aligned. A target whose copy into staged memory
//! fails later still reads the payload and refuses with the reason; one whose copy out of it
//! fails mid-answer (a device error) can only close the connection.
//!
//! Parameters (all optional):
//! | key | default | meaning |
//! |---|---|---|
//! | `listen` | `0.0.0.0:0` | data port to serve on |
//! | `advertise` | `$XFER_HOST_IP`, else the listen IP, else `127.0.0.1` | host peers connect to |
//! | `streams` | 2 | parallel connections per peer |
//! | `chunk_bytes` | 524288 | largest piece one stream moves at once (README, "Large requests") |
//! | `split_bytes` | 262144 | requests from this size on are split over the streams |
//! | `timeout_ms` | 5000 | no progress for this long fails the request |
//! | `connect_timeout_ms` | 2000 | TCP connect bound |
//! | `socket_buffer` | 4194304 | SO_SNDBUF/SO_RCVBUF (0 = system default) |
//! | `staging_slots` | 2 | host slots per staging lane (2 or more overlap copy and wire) |
//! | `staging_bytes` | 1048576 | bytes per staging slot |
//! | `tls` | `off` | `on`: every data connection runs TLS 1.3 ([`tls`]), both ways |
//! | `tls_ca`, `tls_cert`, `tls_key` | none | mutual TLS (all three, PEM files; `tls` on): this backend's certificate chain and key, presented both ways, and the cluster CA an initiator's certificate must chain to |
//! | `spin_us` | 50 | a wait for an answer (initiator) or the next frame (target) polls the socket this long before it sleeps, adaptively ([`spin`]); 0 = never |
//! | `inline_bytes` | 262144 | single-chunk requests of host memory up to this size are sent by the caller's thread and their answer read by the waiting thread ([`inline`]), while fewer than `streams` of them are in flight to the peer; 0 = never |

// Unsafe only in `memio` (registered memory as slices for vectored socket I/O).
#![deny(unsafe_code)]

mod conn;
mod fence;
pub mod frame;
pub mod grants;
pub mod hello;
mod inline;
pub mod keys;
pub mod memio;
mod pool;
mod readahead;
pub mod records;
mod server;
mod spin;
mod staged;
pub mod tls;
mod tls_io;

use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, LocalRegion, MemType, RemoteAgent, Staging,
};

pub use keys::{TcpRemoteKey, PUBLIC_KEY_LEN};
// The target's checks and the initiator's key resolution, shared with the QUIC backend.
pub use pool::wire_descs;
pub use server::{resolve, Resolved};

use conn::SocketTuning;
use grants::GrantTable;
use keys::KeyTable;
use pool::{PeerPool, PoolConfig};
use server::{Server, ServerShared};
use tls::TlsIdentity;
use xfer_core::staging::StagingConfig;

/// The memory TCP moves: host memory straight from the socket, GPU memory and files staged.
const STAGED: [MemType; 3] = [MemType::Dram, MemType::Vram, MemType::File];

/// Default of `spin_us`: waking a sleeping thread costs more, in latency and in CPU, than a
/// short spin while the answer is on its way; on a loaded machine the adaptive budget stops
/// spinning after misses (bench/README.md, "Small transfers: spin and CPU").
const DEFAULT_SPIN_US: u64 = 50;

/// Registers the TCP backend under the name `tcp`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TcpFactory;

impl BackendFactory for TcpFactory {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(TcpBackend::new(ctx)?))
    }
}

pub struct TcpBackend {
    agent_name: String,
    advertised: String,
    /// This backend's certificate when `tls=on`.
    tls: Option<Arc<TlsIdentity>>,
    keys: Arc<KeyTable>,
    grants: Arc<GrantTable>,
    pool_config: PoolConfig,
    staging: Arc<dyn Staging>,
    credential: Option<Arc<xfer_core::credential::ClusterCredential>>,
    server: Mutex<Option<Server>>,
}

impl std::fmt::Debug for TcpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpBackend")
            .field("agent", &self.agent_name)
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

fn invalid(name: &str, reason: impl Into<String>) -> BackendError {
    BackendError::InvalidParam { name: name.into(), reason: reason.into() }
}

impl TcpBackend {
    pub fn new(ctx: BackendContext) -> Result<Self, BackendError> {
        let BackendContext { agent_name, mut params, notifs, staging, credential } = ctx;
        let listen = params.take("listen").unwrap_or_else(|| "0.0.0.0:0".into());
        let advertise = params.take("advertise");
        let streams: usize = params.take_parsed("streams", 2)?;
        let chunk_bytes: u64 = params.take_parsed("chunk_bytes", 512 << 10)?;
        let split_bytes: u64 = params.take_parsed("split_bytes", 256 << 10)?;
        let timeout = params.take_millis("timeout_ms", Duration::from_secs(5))?;
        let connect_timeout = params.take_millis("connect_timeout_ms", Duration::from_secs(2))?;
        let socket_buffer: usize = params.take_parsed("socket_buffer", 4 << 20)?;
        let spin = Duration::from_micros(params.take_parsed("spin_us", DEFAULT_SPIN_US)?);
        let inline_bytes: u64 = params.take_parsed("inline_bytes", 256 << 10)?;
        let staging_config = StagingConfig::take(&mut params)?;
        let mutual = tls::MutualTls::take(&mut params)?;
        let tls = match (params.take("tls").as_deref(), mutual) {
            (None | Some("on"), Some(files)) => Some(Arc::new(files.identity()?)),
            (Some("off"), Some(_)) => return Err(invalid("tls", "off, with tls_ca, tls_cert and tls_key given")),
            (None | Some("off"), None) => None,
            (Some("on"), None) => Some(Arc::new(TlsIdentity::generate().map_err(|e| invalid("tls", e.to_string()))?)),
            (Some(other), _) => return Err(invalid("tls", format!("{other:?} is neither on nor off"))),
        };
        params.finish("tcp")?;
        if !(1..=64).contains(&streams) {
            return Err(invalid("streams", "must be 1..=64"));
        }
        if chunk_bytes < 4096 {
            return Err(invalid("chunk_bytes", "must be at least 4096"));
        }
        if timeout.is_zero() || connect_timeout.is_zero() {
            return Err(invalid("timeout_ms", "timeouts must be positive"));
        }
        if spin >= timeout {
            return Err(invalid("spin_us", "must be shorter than timeout_ms"));
        }
        let tuning = SocketTuning { buffer_bytes: (socket_buffer > 0).then_some(socket_buffer) };
        let listener = TcpListener::bind(&listen).map_err(|e| invalid("listen", format!("{listen}: {e}")))?;
        let bound = listener.local_addr()?;
        let host = match advertise.or_else(|| std::env::var("XFER_HOST_IP").ok()) {
            Some(host) => host,
            None if !bound.ip().is_unspecified() => bound.ip().to_string(),
            None => "127.0.0.1".to_string(),
        };
        let advertised = SocketAddr::new(
            host.parse::<IpAddr>().map_err(|e| invalid("advertise", format!("{host}: {e}")))?,
            bound.port(),
        )
        .to_string();
        let keys = Arc::new(KeyTable::default());
        let grants = Arc::new(GrantTable::default());
        let shared = ServerShared {
            agent_name: agent_name.clone(),
            credential: credential.clone(),
            refused: Default::default(),
            keys: Arc::clone(&keys),
            grants: Arc::clone(&grants),
            notifs,
            timeout,
            tuning,
            stop: Arc::new(AtomicBool::new(false)),
            fences: fence::Fences::default(),
            staging: Arc::clone(&staging),
            staging_config,
            tls: tls.clone(),
            spin,
        };
        let server = Server::start(listener, shared)?;
        tracing::debug!(agent = %agent_name, %advertised, "tcp backend serving");
        Ok(TcpBackend {
            agent_name,
            credential,
            advertised,
            tls,
            keys,
            grants,
            pool_config: PoolConfig {
                streams,
                chunk_bytes,
                split_bytes,
                timeout,
                connect_timeout,
                tuning,
                staging: staging_config,
                spin,
                inline_bytes,
            },
            staging,
            server: Mutex::new(Some(server)),
        })
    }

    /// The data port's local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.server.lock().as_ref().map(Server::addr)
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        let paths = STAGED.iter().flat_map(|&local| STAGED.iter().map(move |&remote| (local, remote))).collect();
        Capabilities { paths, remote: true, local: true, notifications: true }
    }

    fn conn_info(&self) -> Vec<u8> {
        tls::encode_conn_info(&self.advertised, self.tls.as_ref().map(|t| t.fingerprint)).into_bytes()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        match region.mem_type() {
            MemType::Dram | MemType::File => {}
            MemType::Vram => self.staging.device_ready(region.desc().dev_id)?,
            other => return Err(BackendError::Unsupported(format!("tcp moves DRAM, VRAM and FILE, not {other}"))),
        }
        self.keys.publish(region)
    }

    fn deregister(&self, region: &LocalRegion) {
        self.grants.revoke_region(region.id());
        self.keys.remove(region.id());
    }

    fn grant(
        &self,
        region: &Arc<LocalRegion>,
        peer: &str,
        ranges: &[(u64, u64)],
        expires: Instant,
    ) -> Result<Vec<u8>, BackendError> {
        self.grants.issue(region, peer, ranges, expires)
    }

    fn revoke(&self, public: &[u8]) {
        self.grants.revoke_public(public);
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        let text = std::str::from_utf8(conn_info)
            .map_err(|_| BackendError::InvalidMetadata("tcp address is not UTF-8".into()))?;
        let (text, fingerprint) =
            tls::decode_conn_info(text).map_err(|e| BackendError::InvalidMetadata(e.to_string()))?;
        let tls_error = |reason: String| BackendError::Tls { peer: peer.to_string(), reason };
        let client_tls = match (&self.tls, fingerprint) {
            (None, _) => None,
            (Some(identity), Some(pinned)) => {
                Some(identity.client_config(pinned).map_err(|e| tls_error(e.to_string()))?)
            }
            // Never fall back to plain text: metadata without a fingerprint is a plain target
            // (or a downgrade).
            (Some(_), None) => {
                return Err(tls_error("the target serves plain tcp (no TLS fingerprint in its metadata)".into()))
            }
        };
        let addr = text
            .to_socket_addrs()
            .map_err(|e| BackendError::InvalidMetadata(format!("tcp address {text:?}: {e}")))?
            .next()
            .ok_or_else(|| BackendError::InvalidMetadata(format!("tcp address {text:?} resolves to nothing")))?;
        Ok(Arc::new(PeerPool::new(
            self.agent_name.clone(),
            peer.to_string(),
            addr,
            self.pool_config,
            Arc::clone(&self.staging),
            self.credential.clone(),
            client_tls,
        )))
    }

    fn shutdown(&self) {
        self.server.lock().take();
    }
}
