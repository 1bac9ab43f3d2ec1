//! QUIC backend of `xfer`: every transfer encrypted with TLS 1.3 (quinn + rustls, ring), many
//! streams per connection, quinn's congestion control (CUBIC).
//!
//! One UDP endpoint per backend serves its registered memory and carries its outgoing
//! connections; one connection per peer. A connection opens with a hello on its first stream
//! (the TCP backend's hello, with the cluster credential's challenge-response); every request
//! then has a stream of its own, carrying one TCP request frame and its response frame
//! ([`xfer_tcp::frame`]). Large requests are cut into `chunk_bytes` pieces spread over
//! streams, at most `streams` in flight per peer. The target checks keys, bounds and grants
//! with the TCP backend's code ([`xfer_tcp::resolve`]) and holds the grants while it copies
//! between the stream's buffer and the registration, so `revoke` returns only after those
//! copies end and no later request moves a byte under the grant.
//!
//! The certificate is the TCP backend's `tls=on` identity ([`xfer_tcp::tls`]): self-signed,
//! made at creation, pinned by the SHA-256 fingerprint in the connection info
//! (`HOST:PORT#tls-sha256=HEX`).
//!
//! Host memory (DRAM) only: GPU memory and files are not staged over QUIC.
//!
//! Parameters (all optional):
//! | key | default | meaning |
//! |---|---|---|
//! | `listen` | `0.0.0.0:0` | UDP address to serve on |
//! | `advertise` | `$XFER_HOST_IP`, else the listen IP, else `127.0.0.1` | host peers connect to |
//! | `streams` | 16 | request streams in flight per peer |
//! | `chunk_bytes` | 1048576 | largest piece one stream moves |
//! | `threads` | 2 | threads of the backend's runtime |
//! | `timeout_ms` | 5000 | a stream exchange that has not ended by then fails (and the connection with it) |
//! | `connect_timeout_ms` | 2000 | QUIC handshake and hello bound |
//! | `keep_alive_ms` | 1000 | an idle connection sends a keep-alive this often (below `idle_timeout_ms`) |
//! | `idle_timeout_ms` | 3000 | a connection that has heard nothing from its peer for this long is closed: a killed or frozen peer is noticed by then, and its requests fail with `TimedOut` |
//! | `conn_buffer` | 134217728 | most payload bytes the target holds in buffers for one connection's streams (received and not yet stored, or loaded and not yet sent); further streams wait for room, within `timeout_ms`. One stream's payload is at most this and 64 MiB |
//! | `socket_buffer` | 8388608 | the UDP socket's SO_SNDBUF/SO_RCVBUF |
//! | `stream_window` | 16777216 | receive window of one stream |
//! | `conn_window` | 67108864 | receive window of a connection, and its send window |
//! | `mtu` | 1452 | largest UDP payload path MTU discovery tries (up to 65527, e.g. on loopback) |
//! | `initial_mtu` | 1200 | UDP payload size before discovery (up to `mtu`; only where the path is known to carry it) |
//! | `tls_ca`, `tls_cert`, `tls_key` | none | mutual TLS (all three, PEM files), as the TCP backend's: this backend's certificate chain and key instead of a self-signed one, presented both ways, and the cluster CA an initiator's certificate must chain to |

#![forbid(unsafe_code)]

mod initiator;
mod target;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use quinn::congestion::ControllerFactory as _;
use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, LocalRegion, MemType, RemoteAgent,
};
use xfer_tcp::grants::GrantTable;
use xfer_tcp::keys::KeyTable;
use xfer_tcp::tls::{self, TlsIdentity};

use initiator::{PeerConfig, QuicPeer};
use target::TargetShared;

/// Most request streams a peer may have open at once (the initiator's `streams` and one
/// notification fit well under it), once its hello has passed.
const MAX_STREAMS: usize = 256;

/// Connection receive window a target grants before the hello has passed: the hello and the
/// credential's proof fit, a stranger's request payloads do not.
const HELLO_WINDOW: u32 = 16 << 10;

/// Largest `conn_buffer`: it is counted in one semaphore's `u32` permits.
const MAX_CONN_BUFFER: u64 = u32::MAX as u64;

/// Registers the QUIC backend under the name `quic`.
#[derive(Clone, Copy, Debug, Default)]
pub struct QuicFactory;

impl BackendFactory for QuicFactory {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(QuicBackend::new(ctx)?))
    }
}

/// The transport settings both ends of a connection use.
#[derive(Clone, Copy, Debug)]
struct Tuning {
    keep_alive: Duration,
    idle_timeout: quinn::IdleTimeout,
    stream_window: u32,
    conn_window: u32,
    mtu: u16,
    initial_mtu: u16,
}

impl Tuning {
    /// The initiator's transport: full windows from the start.
    fn transport(&self) -> Arc<quinn::TransportConfig> {
        Arc::new(self.transport_with(MAX_STREAMS as u32, self.conn_window))
    }

    /// The target's transport until a connection's hello has passed: one stream (the hello's)
    /// and a window the size of a hello, so a stranger can make it hold no request streams nor
    /// their bytes. [`target`] raises both once the hello passes.
    fn target_transport(&self) -> Arc<quinn::TransportConfig> {
        Arc::new(self.transport_with(1, HELLO_WINDOW))
    }

    fn transport_with(&self, streams: u32, receive_window: u32) -> quinn::TransportConfig {
        let mut transport = quinn::TransportConfig::default();
        transport
            .max_concurrent_bidi_streams(quinn::VarInt::from_u32(streams))
            .max_concurrent_uni_streams(quinn::VarInt::from_u32(0))
            .stream_receive_window(quinn::VarInt::from_u32(self.stream_window))
            .receive_window(quinn::VarInt::from_u32(receive_window))
            .send_window(u64::from(self.conn_window))
            // A peer that is killed or frozen sends nothing, keep-alives included: the
            // connection closes one idle bound after the last packet heard, whatever its
            // requests' own timeout.
            .max_idle_timeout(Some(self.idle_timeout))
            .keep_alive_interval(Some(self.keep_alive));
        let mut mtu = quinn::MtuDiscoveryConfig::default();
        mtu.upper_bound(self.mtu);
        transport.mtu_discovery_config(Some(mtu)).initial_mtu(self.initial_mtu);
        // quinn builds a datagram only while the bytes in flight, those it has built and not yet
        // counted (up to a datagram), and a whole next datagram stay under the congestion
        // window, and its initial window does not grow with the MTU (12,000 bytes in 0.11):
        // from an initial MTU of about 12,000 bytes the handshake's second flight never goes,
        // and connecting times out. A window of three datagrams lets it go.
        let datagrams = 3 * u64::from(self.initial_mtu);
        let default_window = Arc::new(quinn::congestion::CubicConfig::default())
            .build(Instant::now(), self.initial_mtu)
            .initial_window();
        if datagrams > default_window {
            let mut cubic = quinn::congestion::CubicConfig::default();
            cubic.initial_window(datagrams);
            transport.congestion_controller_factory(Arc::new(cubic));
        }
        transport
    }
}

pub struct QuicBackend {
    agent_name: String,
    advertised: String,
    identity: Arc<TlsIdentity>,
    keys: Arc<KeyTable>,
    grants: Arc<GrantTable>,
    credential: Option<Arc<xfer_core::credential::ClusterCredential>>,
    peer_config: PeerConfig,
    tuning: Tuning,
    endpoint: quinn::Endpoint,
    /// Taken at shutdown.
    runtime: Mutex<Option<tokio::runtime::Runtime>>,
}

impl std::fmt::Debug for QuicBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicBackend")
            .field("agent", &self.agent_name)
            .field("advertised", &self.advertised)
            .finish_non_exhaustive()
    }
}

fn invalid(name: &str, reason: impl Into<String>) -> BackendError {
    BackendError::InvalidParam { name: name.into(), reason: reason.into() }
}

fn tls_error(peer: &str, reason: impl std::fmt::Display) -> BackendError {
    BackendError::Tls { peer: peer.to_string(), reason: reason.to_string() }
}

/// A UDP socket with large kernel buffers: a burst of a congestion window's datagrams must not
/// overflow the receiver's queue before quinn reads it.
fn udp_socket(addr: SocketAddr, buffer: usize) -> std::io::Result<std::net::UdpSocket> {
    let domain = if addr.is_ipv4() { socket2::Domain::IPV4 } else { socket2::Domain::IPV6 };
    let socket = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP))?;
    if buffer > 0 {
        socket.set_recv_buffer_size(buffer)?;
        socket.set_send_buffer_size(buffer)?;
    }
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

impl QuicBackend {
    pub fn new(ctx: BackendContext) -> Result<Self, BackendError> {
        let BackendContext { agent_name, mut params, notifs, staging: _, credential } = ctx;
        let listen = params.take("listen").unwrap_or_else(|| "0.0.0.0:0".into());
        let advertise = params.take("advertise");
        let streams: usize = params.take_parsed("streams", 16)?;
        let chunk_bytes: u64 = params.take_parsed("chunk_bytes", 1 << 20)?;
        let threads: usize = params.take_parsed("threads", 2)?;
        let timeout = params.take_millis("timeout_ms", Duration::from_secs(5))?;
        let connect_timeout = params.take_millis("connect_timeout_ms", Duration::from_secs(2))?;
        let keep_alive = params.take_millis("keep_alive_ms", Duration::from_secs(1))?;
        let idle_timeout = params.take_millis("idle_timeout_ms", Duration::from_secs(3))?;
        let conn_buffer: u64 = params.take_parsed("conn_buffer", 128 << 20)?;
        let socket_buffer: usize = params.take_parsed("socket_buffer", 8 << 20)?;
        let stream_window: u32 = params.take_parsed("stream_window", 16 << 20)?;
        let conn_window: u32 = params.take_parsed("conn_window", 64 << 20)?;
        let mtu: u16 = params.take_parsed("mtu", 1452)?;
        let initial_mtu: u16 = params.take_parsed("initial_mtu", 1200)?;
        let mutual = tls::MutualTls::take(&mut params)?;
        params.finish("quic")?;
        if !(1..=MAX_STREAMS).contains(&streams) {
            return Err(invalid("streams", format!("must be 1..={MAX_STREAMS}")));
        }
        if !(4096..=target::MAX_STREAM_BYTES).contains(&chunk_bytes) {
            return Err(invalid("chunk_bytes", format!("must be 4096..={}", target::MAX_STREAM_BYTES)));
        }
        if !(1..=64).contains(&threads) {
            return Err(invalid("threads", "must be 1..=64"));
        }
        if timeout.is_zero() || connect_timeout.is_zero() {
            return Err(invalid("timeout_ms", "timeouts must be positive"));
        }
        if idle_timeout.is_zero() {
            return Err(invalid("idle_timeout_ms", "must be positive"));
        }
        if keep_alive.is_zero() || keep_alive >= idle_timeout {
            return Err(invalid("keep_alive_ms", "must be positive and below idle_timeout_ms"));
        }
        let idle_timeout_bound =
            quinn::IdleTimeout::try_from(idle_timeout).map_err(|e| invalid("idle_timeout_ms", e.to_string()))?;
        if !(1 << 20..=MAX_CONN_BUFFER).contains(&conn_buffer) {
            return Err(invalid("conn_buffer", format!("must be 1 MiB..={MAX_CONN_BUFFER}")));
        }
        if stream_window < 65536 || conn_window < stream_window {
            return Err(invalid(
                "stream_window",
                "windows must be at least 64 KiB, the connection's at least a stream's",
            ));
        }
        if !(1200..=mtu).contains(&initial_mtu) {
            return Err(invalid("initial_mtu", "QUIC needs 1200..=mtu"));
        }
        let tuning =
            Tuning { keep_alive, idle_timeout: idle_timeout_bound, stream_window, conn_window, mtu, initial_mtu };
        let listen_addr: SocketAddr = listen.parse().map_err(|e| invalid("listen", format!("{listen}: {e}")))?;
        let identity = Arc::new(match mutual {
            Some(files) => files.identity()?,
            None => TlsIdentity::generate().map_err(|e| invalid("tls", e.to_string()))?,
        });
        let server_crypto = quinn::crypto::rustls::QuicServerConfig::try_from(identity.server_config())
            .map_err(|e| invalid("tls", e.to_string()))?;
        let mut server_config = quinn::ServerConfig::with_crypto(Arc::new(server_crypto));
        server_config.transport_config(tuning.target_transport());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("xfer-quic")
            .enable_time()
            .enable_io()
            .build()?;
        let socket = udp_socket(listen_addr, socket_buffer).map_err(|e| invalid("listen", format!("{listen}: {e}")))?;
        let bound = socket.local_addr()?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config.max_udp_payload_size(mtu.max(1200)).map_err(|e| invalid("mtu", e.to_string()))?;
        let endpoint = {
            let _entered = runtime.enter();
            quinn::Endpoint::new(endpoint_config, Some(server_config), socket, Arc::new(quinn::TokioRuntime))?
        };
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
        let shared = Arc::new(TargetShared {
            agent_name: agent_name.clone(),
            credential: credential.clone(),
            refused: Default::default(),
            keys: Arc::clone(&keys),
            grants: Arc::clone(&grants),
            notifs,
            timeout,
            conn_buffer: conn_buffer as u32,
            max_streams: MAX_STREAMS as u32,
            conn_window,
        });
        runtime.spawn(target::accept_loop(endpoint.clone(), shared));
        tracing::debug!(agent = %agent_name, %advertised, "quic backend serving");
        Ok(QuicBackend {
            agent_name,
            advertised,
            identity,
            keys,
            grants,
            credential,
            peer_config: PeerConfig { streams, chunk_bytes, timeout, connect_timeout, idle_timeout },
            tuning,
            endpoint,
            runtime: Mutex::new(Some(runtime)),
        })
    }

    /// The UDP port's local address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.endpoint.local_addr().ok()
    }
}

impl Backend for QuicBackend {
    fn name(&self) -> &'static str {
        "quic"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { paths: vec![(MemType::Dram, MemType::Dram)], remote: true, local: true, notifications: true }
    }

    fn conn_info(&self) -> Vec<u8> {
        tls::encode_conn_info(&self.advertised, Some(self.identity.fingerprint)).into_bytes()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        if region.mem_type() != MemType::Dram {
            return Err(BackendError::Unsupported(format!("quic moves DRAM, not {}", region.mem_type())));
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
            .map_err(|_| BackendError::InvalidMetadata("quic address is not UTF-8".into()))?;
        let (text, fingerprint) =
            tls::decode_conn_info(text).map_err(|e| BackendError::InvalidMetadata(e.to_string()))?;
        let pinned =
            fingerprint.ok_or_else(|| tls_error(peer, "the peer's quic connection info has no fingerprint"))?;
        let addr: SocketAddr =
            text.parse().map_err(|e| BackendError::InvalidMetadata(format!("quic address {text:?}: {e}")))?;
        let client_tls = self.identity.client_config(pinned).map_err(|e| tls_error(peer, e))?;
        let client_crypto =
            quinn::crypto::rustls::QuicClientConfig::try_from(client_tls).map_err(|e| tls_error(peer, e))?;
        let mut client = quinn::ClientConfig::new(Arc::new(client_crypto));
        client.transport_config(self.tuning.transport());
        let handle = self.runtime.lock().as_ref().map(|rt| rt.handle().clone()).ok_or_else(|| {
            BackendError::PeerDisconnected { peer: peer.to_string(), reason: "the quic backend was shut down".into() }
        })?;
        Ok(Arc::new(QuicPeer::new(initiator::PeerShared::new(
            self.agent_name.clone(),
            peer.to_string(),
            initiator::Dialer { addr, client, endpoint: self.endpoint.clone() },
            handle,
            self.credential.clone(),
            self.peer_config,
        ))))
    }

    fn shutdown(&self) {
        self.endpoint.close(quinn::VarInt::from_u32(0), b"backend shut down");
        if let Some(runtime) = self.runtime.lock().take() {
            // A runtime may not block inside another one (an async caller dropping its agent).
            if tokio::runtime::Handle::try_current().is_ok() {
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(Duration::from_secs(1));
            }
        }
    }
}

impl Drop for QuicBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_core::{BackendParams, HostStaging};

    fn backend(params: &str) -> Result<QuicBackend, BackendError> {
        QuicBackend::new(BackendContext {
            agent_name: "unit".into(),
            params: BackendParams::parse(params)?,
            notifs: Arc::new(|_: &str, _: Vec<u8>| {}),
            staging: Arc::new(HostStaging::new("no GPU in this test")),
            credential: None,
        })
    }

    #[test]
    fn bad_parameters_are_typed_refusals() {
        for params in [
            "streams=0",
            "chunk_bytes=100",
            "mtu=1000",
            "stream_window=1024",
            "timeout_ms=0",
            "keep_alive_ms=0",
            "keep_alive_ms=3000",
            "idle_timeout_ms=500",
            "idle_timeout_ms=0",
            "conn_buffer=4096",
            "conn_buffer=8589934592",
        ] {
            let err = backend(&format!("listen=127.0.0.1:0,{params}")).unwrap_err();
            assert!(matches!(err, BackendError::InvalidParam { .. }), "{params}: {err:?}");
        }
        // Always TLS: QUIC takes no `tls` switch.
        let err = backend("listen=127.0.0.1:0,tls=on").unwrap_err();
        assert!(matches!(&err, BackendError::UnknownParam { name, .. } if name == "tls"), "{err:?}");
    }

    #[test]
    fn connection_info_pins_the_certificate_and_plain_info_is_refused() {
        let quic = backend("listen=127.0.0.1:0").expect("backend");
        let info = String::from_utf8(quic.conn_info()).expect("text");
        let (addr, fingerprint) = tls::decode_conn_info(&info).expect("decodes");
        assert_eq!(addr.parse::<SocketAddr>().ok(), quic.local_addr());
        assert_eq!(fingerprint, Some(quic.identity.fingerprint));
        let plain = quic.connect("peer", addr.as_bytes()).err().expect("plain info refused");
        assert!(matches!(plain, BackendError::Tls { .. }), "{plain:?}");
        quic.shutdown();
    }
}
