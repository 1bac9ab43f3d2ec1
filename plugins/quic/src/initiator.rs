//! The initiator side: one connection per peer, opened on first use and after a failure; each
//! request cut into pieces that move on streams of their own, a bounded number in flight.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use xfer_core::credential::{ClusterCredential, ProofLabel, Transcript, AUTH_LEN};
use xfer_core::split::{even_sizes, split_by_sizes};
use xfer_core::{BackendError, LocalMem, Op, RefusalCode, RemoteAgent, RemoteKey, TransferJob};
use xfer_tcp::frame::{self, Kind, WireDesc};
use xfer_tcp::{memio, wire_descs, TcpRemoteKey};

/// Most descriptors one stream's frame carries.
const MAX_STREAM_DESCS: usize = 8192;

/// One stream's share of a request: local pieces, the matching remote descriptors, their bytes.
struct Piece {
    local: Vec<LocalMem>,
    remote: Vec<WireDesc>,
    bytes: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct PeerConfig {
    pub streams: usize,
    pub chunk_bytes: u64,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// The connection's idle bound: a connection closed by it heard nothing from the peer.
    pub idle_timeout: Duration,
}

/// How to reach a peer: its address, and the endpoint and TLS config to dial it with.
pub struct Dialer {
    pub addr: SocketAddr,
    pub client: quinn::ClientConfig,
    pub endpoint: quinn::Endpoint,
}

pub struct PeerShared {
    local_name: String,
    peer: String,
    dialer: Dialer,
    handle: tokio::runtime::Handle,
    credential: Option<Arc<ClusterCredential>>,
    config: PeerConfig,
    /// The current connection; replaced after a failure.
    conn: tokio::sync::Mutex<Option<quinn::Connection>>,
    in_flight: Arc<Semaphore>,
    closed: AtomicBool,
    session_id: u64,
    next_request: AtomicU64,
}

impl PeerShared {
    pub fn new(
        local_name: String,
        peer: String,
        dialer: Dialer,
        handle: tokio::runtime::Handle,
        credential: Option<Arc<ClusterCredential>>,
        config: PeerConfig,
    ) -> Self {
        PeerShared {
            local_name,
            peer,
            dialer,
            handle,
            credential,
            config,
            conn: tokio::sync::Mutex::new(None),
            in_flight: Arc::new(Semaphore::new(config.streams)),
            closed: AtomicBool::new(false),
            session_id: xfer_tcp::keys::random_u64(),
            next_request: AtomicU64::new(1),
        }
    }

    fn disconnected(&self, reason: impl std::fmt::Display) -> BackendError {
        BackendError::PeerDisconnected { peer: self.peer.clone(), reason: reason.to_string() }
    }

    /// A request that lost its connection to the idle bound failed because the peer went
    /// silent (killed, frozen, cut off): `TimedOut`, as when its own timeout ends it.
    fn silent_peer(&self, conn: &quinn::Connection, err: BackendError) -> BackendError {
        match (&err, conn.close_reason()) {
            (BackendError::PeerDisconnected { .. }, Some(quinn::ConnectionError::TimedOut)) => {
                BackendError::TimedOut(self.config.idle_timeout)
            }
            _ => err,
        }
    }

    /// The live connection, or a new one (handshake and hello within the connect timeout).
    async fn connection(&self) -> Result<quinn::Connection, BackendError> {
        let mut slot = self.conn.lock().await;
        if self.closed.load(Ordering::Acquire) {
            return Err(self.disconnected("disconnected"));
        }
        if let Some(conn) = slot.as_ref().filter(|c| c.close_reason().is_none()) {
            return Ok(conn.clone());
        }
        let bound = self.config.connect_timeout;
        let conn = tokio::time::timeout(bound, self.open()).await.map_err(|_| BackendError::TimedOut(bound))??;
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// Drops `failed` as the current connection, closing it so the target stops serving it.
    async fn abandon(&self, failed: &quinn::Connection) {
        let mut slot = self.conn.lock().await;
        if slot.as_ref().is_some_and(|c| c.stable_id() == failed.stable_id()) {
            slot.take();
        }
        close_once(failed, b"abandoned");
    }

    async fn open(&self) -> Result<quinn::Connection, BackendError> {
        let Dialer { addr, client, endpoint } = &self.dialer;
        let connecting = endpoint
            .connect_with(client.clone(), *addr, xfer_tcp::tls::SERVER_NAME)
            .map_err(|e| self.disconnected(format!("connecting: {e}")))?;
        let conn = connecting.await.map_err(|e| match e {
            // Crypto codes (0x100..0x200) carry a TLS alert: a certificate other than the pinned one.
            quinn::ConnectionError::TransportError(ref t) if (0x100..0x200).contains(&u64::from(t.code)) => {
                BackendError::Tls { peer: self.peer.clone(), reason: e.to_string() }
            }
            other => self.disconnected(format!("handshake: {other}")),
        })?;
        self.hello(&conn).await?;
        Ok(conn)
    }

    /// The TCP backend's hello and, with a credential, its challenge-response, on the
    /// connection's first stream.
    async fn hello(&self, conn: &quinn::Connection) -> Result<(), BackendError> {
        let lost = |e: &dyn std::fmt::Display| {
            self.closed_by_tls(conn).unwrap_or_else(|| self.disconnected(format!("hello: {e}")))
        };
        let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
        let session = frame::Session { id: self.session_id, epoch: 0 };
        let mut hello = Vec::new();
        frame::encode_hello_with(&self.local_name, &self.peer, session, self.credential.is_some(), &mut hello);
        send.write_all(&hello).await.map_err(|e| lost(&e))?;
        let mut reply = [0u8; frame::HELLO_REPLY_LEN];
        recv.read_exact(&mut reply).await.map_err(|e| lost(&e))?;
        if reply[0] == frame::CHALLENGE_STATUS {
            let Some(credential) = self.credential.as_ref() else {
                return Err(BackendError::Protocol(
                    "authentication challenge, but this agent has no credential".into(),
                ));
            };
            let fixed = frame::decode_hello_reply(&reply).map_err(|e| BackendError::Protocol(e.to_string()))?;
            if fixed != (0, AUTH_LEN) {
                return Err(BackendError::Protocol(format!("malformed authentication challenge {fixed:?}")));
            }
            let mut nonce = [0u8; AUTH_LEN];
            recv.read_exact(&mut nonce).await.map_err(|e| lost(&e))?;
            let transcript = Transcript {
                client_nonce: &frame::session_nonce(session),
                server_nonce: &nonce,
                client_name: &self.local_name,
                server_name: &self.peer,
            };
            let proof = credential.prove(ProofLabel::DataInitiator, &transcript);
            send.write_all(&proof).await.map_err(|e| lost(&e))?;
            recv.read_exact(&mut reply).await.map_err(|e| lost(&e))?;
        }
        let (code, msg_len) = frame::decode_hello_reply(&reply).map_err(|e| BackendError::Protocol(e.to_string()))?;
        let mut message = vec![0u8; msg_len];
        recv.read_exact(&mut message).await.map_err(|e| lost(&e))?;
        if code != 0 {
            return Err(BackendError::Refused {
                code: RefusalCode::from_wire(code),
                message: String::from_utf8_lossy(&message).into_owned(),
            });
        }
        let _ = send.finish();
        Ok(())
    }

    /// A connection the target closed with a TLS alert (a crypto code, 0x100 + the alert) after
    /// this side's handshake was done: a mutual-TLS target that refused this initiator's
    /// certificate, e.g. 116 (none) or 48 (another CA's).
    fn closed_by_tls(&self, conn: &quinn::Connection) -> Option<BackendError> {
        match conn.close_reason()? {
            quinn::ConnectionError::ConnectionClosed(close)
                if (0x100..0x200).contains(&u64::from(close.error_code)) =>
            {
                let alert = u64::from(close.error_code) - 0x100;
                let reason = format!("the target closed the connection with TLS alert {alert} ({close})");
                Some(BackendError::Tls { peer: self.peer.clone(), reason })
            }
            _ => None,
        }
    }

    /// One piece of a request on a stream of its own, bounded by the timeout.
    async fn exchange(
        &self,
        conn: &quinn::Connection,
        op: Op,
        mut local: Vec<LocalMem>,
        remote: Vec<WireDesc>,
        bytes: u64,
    ) -> Result<(), BackendError> {
        let bound = self.config.timeout;
        let work = async {
            let lost = |e: &dyn std::fmt::Display| self.disconnected(e);
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
            let kind = match op {
                Op::Read => Kind::Read,
                Op::Write => Kind::Write,
            };
            let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
            let mut head = Vec::new();
            frame::encode_request(kind, request_id, &remote, bytes, &mut head);
            send.write_all(&head).await.map_err(|e| lost(&e))?;
            if op == Op::Write {
                for slice in memio::send_from(&local) {
                    send.write_all(&slice).await.map_err(|e| lost(&e))?;
                }
            }
            let _ = send.finish();
            let expect = if op == Op::Read { bytes } else { 0 };
            read_response(&mut recv, request_id, expect, &lost).await?;
            if op == Op::Read {
                for piece in &mut local {
                    if let LocalMem::Host(slice) = piece {
                        let mut dest = memio::receive_slice(slice);
                        recv.read_exact(&mut dest).await.map_err(|e| lost(&e))?;
                    }
                }
            }
            Ok(())
        };
        let result = tokio::time::timeout(bound, work).await.map_err(|_| BackendError::TimedOut(bound))?;
        result.map_err(|err| self.silent_peer(conn, err))
    }

    async fn notify_on(&self, conn: &quinn::Connection, message: &[u8]) -> Result<(), BackendError> {
        let bound = self.config.timeout;
        let work = async {
            let lost = |e: &dyn std::fmt::Display| self.disconnected(e);
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| lost(&e))?;
            let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
            let mut head = Vec::new();
            frame::encode_request(Kind::Notif, request_id, &[], message.len() as u64, &mut head);
            send.write_all(&head).await.map_err(|e| lost(&e))?;
            send.write_all(message).await.map_err(|e| lost(&e))?;
            let _ = send.finish();
            read_response(&mut recv, request_id, 0, &lost).await
        };
        let result = tokio::time::timeout(bound, work).await.map_err(|_| BackendError::TimedOut(bound))?;
        result.map_err(|err| self.silent_peer(conn, err))
    }

    async fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        if message.len() as u64 > frame::MAX_NOTIF {
            return Err(BackendError::Unsupported(format!("notification of {} bytes", message.len())));
        }
        let conn = self.connection().await?;
        let sent = self.notify_on(&conn, message).await;
        if matches!(sent, Err(BackendError::TimedOut(_) | BackendError::PeerDisconnected { .. })) {
            self.abandon(&conn).await;
        }
        sent
    }

    /// Moves a planned request: its pieces on parallel streams, then its notification.
    async fn run(self: Arc<Self>, op: Op, pieces: Vec<Piece>, notif: Option<Vec<u8>>) -> Result<(), BackendError> {
        let conn = self.connection().await?;
        let mut tasks = tokio::task::JoinSet::new();
        let failed = Arc::new(AtomicBool::new(false));
        for Piece { local, remote, bytes } in pieces {
            let permit = Arc::clone(&self.in_flight)
                .acquire_owned()
                .await
                .map_err(|_| self.disconnected("connection closed"))?;
            if failed.load(Ordering::Acquire) {
                break;
            }
            let (shared, conn, failed) = (Arc::clone(&self), conn.clone(), Arc::clone(&failed));
            tasks.spawn(async move {
                let _permit = permit;
                let result = shared.exchange(&conn, op, local, remote, bytes).await;
                if let Err(err) = &result {
                    failed.store(true, Ordering::Release);
                    // A silent or lost peer fails the other pieces on the connection now, not
                    // one timeout each.
                    if !matches!(err, BackendError::Refused { .. }) {
                        close_once(&conn, b"request failed");
                    }
                }
                result
            });
        }
        let mut first_error = None;
        while let Some(joined) = tasks.join_next().await {
            let result = joined.unwrap_or_else(|e| Err(BackendError::Protocol(format!("stream task failed: {e}"))));
            if let Err(err) = result {
                first_error.get_or_insert(err);
            }
        }
        if let Some(err) = first_error {
            if !matches!(err, BackendError::Refused { .. }) {
                self.abandon(&conn).await;
            }
            return Err(err);
        }
        match notif {
            Some(message) => self.notify(&message).await,
            None => Ok(()),
        }
    }
}

/// Reads a response frame; a refusal becomes `Refused` with the target's message.
/// Closes `conn` unless it is closed already. Closing overwrites the reason every pending and
/// later stream operation reports (`LocallyClosed`), so closing a connection the idle bound ended
/// would make the requests still running on it report a lost peer where it went silent.
fn close_once(conn: &quinn::Connection, reason: &[u8]) {
    if conn.close_reason().is_none() {
        conn.close(quinn::VarInt::from_u32(0), reason);
    }
}

async fn read_response(
    recv: &mut quinn::RecvStream,
    request_id: u64,
    payload_len: u64,
    lost: &(dyn Fn(&dyn std::fmt::Display) -> BackendError + Sync),
) -> Result<(), BackendError> {
    let mut fixed = [0u8; frame::RESPONSE_LEN];
    recv.read_exact(&mut fixed).await.map_err(|e| lost(&e))?;
    let response = frame::decode_response(&fixed).map_err(|e| BackendError::Protocol(e.to_string()))?;
    let mut tail = vec![0u8; response.tail_len()];
    recv.read_exact(&mut tail).await.map_err(|e| lost(&e))?;
    if response.request_id != request_id {
        return Err(BackendError::Protocol(format!(
            "answer to request {} on the stream of {request_id}",
            response.request_id
        )));
    }
    if response.code != 0 {
        let message = String::from_utf8_lossy(&tail[..response.msg_len as usize]).into_owned();
        return Err(BackendError::Refused { code: RefusalCode::from_wire(response.code), message });
    }
    if response.payload_len != payload_len {
        return Err(BackendError::Protocol(format!(
            "{} payload bytes for a {payload_len}-byte request",
            response.payload_len
        )));
    }
    Ok(())
}

/// A peer as seen by this backend.
pub struct QuicPeer {
    shared: Arc<PeerShared>,
}

impl QuicPeer {
    pub fn new(shared: PeerShared) -> Self {
        QuicPeer { shared: Arc::new(shared) }
    }

    /// Cuts a job into pieces of at most `chunk_bytes` (and [`MAX_STREAM_DESCS`] descriptors).
    fn plan(&self, local: Vec<LocalMem>, wire: Vec<WireDesc>) -> Result<Vec<Piece>, BackendError> {
        if let Some(piece) = local.iter().find(|piece| !matches!(piece, LocalMem::Host(_))) {
            return Err(BackendError::MemoryNotMoved { backend: "quic", mem_type: piece.mem_type() });
        }
        let total: u64 = wire.iter().map(|d| d.len).sum();
        let by_bytes = total.div_ceil(self.shared.config.chunk_bytes);
        let by_descs = wire.len().max(local.len()).div_ceil(MAX_STREAM_DESCS) as u64;
        let sizes = even_sizes(total, by_bytes.max(by_descs).max(1) as usize, 1);
        if sizes.is_empty() {
            return Ok(Vec::new());
        }
        let locals = split_by_sizes(local, &sizes);
        let remotes = split_by_sizes(wire, &sizes);
        Ok(locals
            .into_iter()
            .zip(remotes)
            .zip(&sizes)
            .map(|((local, remote), &bytes)| Piece { local, remote, bytes })
            .collect())
    }

    /// Runs `task` on the backend's runtime and waits for it from a caller's thread.
    fn wait_for<F, Fut>(&self, task: F) -> Result<(), BackendError>
    where
        F: FnOnce(Arc<PeerShared>) -> Fut,
        Fut: std::future::Future<Output = Result<(), BackendError>> + Send + 'static,
    {
        let future = task(Arc::clone(&self.shared));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.shared.handle.spawn(async move {
            let _ = tx.send(future.await);
        });
        // The task itself is bounded by the connect and request timeouts; this is the backstop.
        let bound = self.shared.config.connect_timeout + self.shared.config.timeout + Duration::from_secs(1);
        match rx.recv_timeout(bound) {
            Ok(done) => done,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(BackendError::TimedOut(bound)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Err(self.shared.disconnected("the quic backend was shut down"))
            }
        }
    }
}

impl RemoteAgent for QuicPeer {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        Ok(Arc::new(TcpRemoteKey::decode(public)?))
    }

    fn post(&self, job: TransferJob) {
        let TransferJob { op, local, remote, notif, done } = job;
        if self.shared.closed.load(Ordering::Acquire) {
            return done.complete(Err(self.shared.disconnected("disconnected")));
        }
        let pieces = match wire_descs(&remote, &local).and_then(|wire| self.plan(local, wire)) {
            Ok(pieces) => pieces,
            Err(err) => return done.complete(Err(err)),
        };
        let shared = Arc::clone(&self.shared);
        self.shared.handle.spawn(async move {
            let result = shared.run(op, pieces, notif).await;
            done.complete(result);
        });
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        let message = message.to_vec();
        self.wait_for(move |shared| async move { shared.notify(&message).await })
    }

    /// The connection, through its QUIC and TLS handshakes and the hello.
    fn connect_now(&self) -> Result<(), BackendError> {
        self.wait_for(|shared| async move { shared.connection().await.map(drop) })
    }

    fn disconnect(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let shared = Arc::clone(&self.shared);
        self.shared.handle.spawn(async move {
            if let Some(conn) = shared.conn.lock().await.take() {
                conn.close(quinn::VarInt::from_u32(0), b"disconnected");
            }
        });
    }
}
