//! The target side: accepts connections, checks each one's hello, then serves every request
//! stream in a task of its own.
//!
//! Until the hello has passed, a connection may open one stream (the hello's) and send a
//! hello's worth of bytes ([`crate::Tuning::target_transport`]); anything but a hello on that
//! stream closes the connection with [`REFUSED`]. Only then are request streams allowed and
//! accepted, so a stranger never has a request read, buffered or served.
//!
//! The payload bytes a connection's streams hold in buffers (a WRITE's received and not yet
//! stored, a READ's loaded and not yet handed to quinn) are counted against `conn_buffer`: a
//! stream waits for room before it reads or loads its payload.
//!
//! A request's payload is received whole before its descriptors are resolved, and a READ's
//! bytes are copied out whole before its answer is sent: the grants a request uses are held
//! only across those copies, never across a wait on the network, so `revoke` is never held up
//! by a slow peer.

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Semaphore;
use xfer_core::credential::{ClusterCredential, AUTH_LEN};
use xfer_core::{LocalMem, NotifSink, RefusalCode};
use xfer_tcp::frame::{self, FrameError, Header, Kind, WireDesc};
use xfer_tcp::grants::{GrantTable, Refusal};
use xfer_tcp::hello::{self, Verdict};
use xfer_tcp::keys::KeyTable;
use xfer_tcp::{memio, resolve};

/// Most payload bytes one request stream carries (the target buffers them).
pub const MAX_STREAM_BYTES: u64 = 64 << 20;

/// Application error code a target closes a refused connection with.
pub const REFUSED: u32 = 1;

/// What every connection task shares.
pub struct TargetShared {
    pub agent_name: String,
    pub credential: Option<Arc<ClusterCredential>>,
    /// Initiator addresses whose refusal was logged (once each).
    pub refused: Mutex<HashSet<IpAddr>>,
    pub keys: Arc<KeyTable>,
    pub grants: Arc<GrantTable>,
    pub notifs: NotifSink,
    pub timeout: Duration,
    /// Payload bytes one connection's streams may hold in buffers at once.
    pub conn_buffer: u32,
    /// The stream limit and receive window a connection gets once its hello has passed.
    pub max_streams: u32,
    pub conn_window: u32,
}

#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    #[error("reading: {0}")]
    Read(#[from] quinn::ReadExactError),
    #[error("reading: {0}")]
    ReadChunk(#[from] quinn::ReadError),
    #[error("the stream ended {missing} bytes short of its payload")]
    Truncated { missing: usize },
    #[error("writing: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("stream: {0}")]
    Closed(#[from] quinn::ClosedStream),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("no progress for {0:?}")]
    TimedOut(Duration),
    #[error("hello: {0}")]
    Hello(#[from] hello::HelloError),
    #[error("the connection's buffer budget was closed")]
    Budget(#[from] tokio::sync::AcquireError),
}

async fn timed<T, E: Into<ServeError>>(
    bound: Duration,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, ServeError> {
    match tokio::time::timeout(bound, work).await {
        Ok(result) => result.map_err(Into::into),
        Err(_) => Err(ServeError::TimedOut(bound)),
    }
}

pub async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<TargetShared>) {
    while let Some(incoming) = endpoint.accept().await {
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            if let Err(err) = serve_connection(incoming, shared).await {
                tracing::debug!(%remote, %err, "quic connection ended with an error");
            }
        });
    }
}

async fn serve_connection(incoming: quinn::Incoming, shared: Arc<TargetShared>) -> Result<(), ServeError> {
    let conn = timed(shared.timeout, std::future::IntoFuture::into_future(incoming)).await?;
    let peer = match hello(&conn, &shared).await {
        Ok(Some(peer)) => peer,
        Ok(None) => {
            // Let the refusal reach the initiator before the close does.
            tokio::time::sleep(Duration::from_millis(50)).await;
            conn.close(quinn::VarInt::from_u32(REFUSED), b"refused at hello");
            return Ok(());
        }
        Err(err) => {
            // Not a hello (a request first, a malformed or truncated hello, a stall): nothing
            // on this connection is read further.
            conn.close(quinn::VarInt::from_u32(REFUSED), b"no valid hello");
            return Err(err);
        }
    };
    let peer: Arc<str> = peer.into();
    let budget = Arc::new(Semaphore::new(shared.conn_buffer as usize));
    loop {
        let (send, recv) = match conn.accept_bi().await {
            Ok(streams) => streams,
            Err(quinn::ConnectionError::ApplicationClosed(_) | quinn::ConnectionError::LocallyClosed) => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        let (shared, peer, budget) = (Arc::clone(&shared), Arc::clone(&peer), Arc::clone(&budget));
        tokio::spawn(async move {
            if let Err(err) = serve_stream(send, recv, &shared, &peer, &budget).await {
                tracing::debug!(%peer, %err, "quic request stream failed");
            }
        });
    }
}

/// Reads the hello on the connection's first stream, checks it is meant for this agent and,
/// with a credential, runs the challenge-response; answers. Returns the initiator's name, or
/// `None` when it was refused.
async fn hello(conn: &quinn::Connection, shared: &TargetShared) -> Result<Option<String>, ServeError> {
    // One bound for the whole hello, as for the connection's handshake before it.
    let deadline = tokio::time::Instant::now() + shared.timeout;
    let (mut send, mut recv) = timed(shared.timeout, conn.accept_bi()).await?;
    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
    let judged = timed(left, judge_hello(&mut send, &mut recv, conn, shared)).await;
    if judged.is_err() {
        // Dropped, quinn would finish the stream, and the initiator could read a clean, empty
        // answer before the connection's close reaches it.
        let _ = send.reset(quinn::VarInt::from_u32(REFUSED));
    }
    judged
}

/// [`hello`] on its accepted stream (bounded by the caller).
async fn judge_hello(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    conn: &quinn::Connection,
    shared: &TargetShared,
) -> Result<Option<String>, ServeError> {
    let mut fixed = [0u8; frame::HELLO_LEN];
    recv.read_exact(&mut fixed).await?;
    let hello = frame::decode_hello(&fixed)?;
    let mut names = vec![0u8; hello::names_len(&hello)];
    recv.read_exact(&mut names).await?;
    let admitted = match hello::judge(&hello, &names, &shared.agent_name, shared.credential.as_ref())? {
        Verdict::Admit(admitted) => Ok(admitted),
        Verdict::Refuse(refused) => Err(refused),
        Verdict::Challenge(challenge) => {
            send.write_all(&challenge.bytes).await?;
            let mut proof = [0u8; AUTH_LEN];
            recv.read_exact(&mut proof).await?;
            challenge.check(&proof)
        }
    };
    let from = match admitted {
        Ok(admitted) => admitted.from,
        Err(refused) => {
            refused.refusal.log_once(&shared.refused, conn.remote_address().ip(), "quic");
            send.write_all(&refused.reply).await?;
            send.finish()?;
            return Ok(None);
        }
    };
    // Request streams and their bytes are allowed from now on; the credit travels with the
    // reply, so the initiator's first requests need not wait for it.
    conn.set_max_concurrent_bi_streams(quinn::VarInt::from_u32(shared.max_streams));
    conn.set_receive_window(quinn::VarInt::from_u32(shared.conn_window));
    send.write_all(&hello::accepted_reply()).await?;
    send.finish()?;
    Ok(Some(from))
}

async fn serve_stream(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    shared: &TargetShared,
    peer: &str,
    budget: &Semaphore,
) -> Result<(), ServeError> {
    let bound = shared.timeout;
    let mut head = [0u8; frame::HEADER_LEN];
    timed(bound, recv.read_exact(&mut head)).await?;
    let header = frame::decode_header(&head)?;
    let mut table = vec![0u8; frame::table_len(header.n_desc)];
    timed(bound, recv.read_exact(&mut table)).await?;
    let mut descs = Vec::new();
    frame::decode_descs(&header, &table, &mut descs)?;
    let mut out = Vec::with_capacity(64);
    let limit = MAX_STREAM_BYTES.min(u64::from(shared.conn_buffer));
    let answer = if header.payload_len > limit {
        let _ = recv.stop(quinn::VarInt::from_u32(REFUSED));
        let msg = format!("{} bytes on one stream (limit {limit})", header.payload_len);
        Err((RefusalCode::BadRequest, msg))
    } else {
        // Fits in u32: at most `conn_buffer`. Held until the payload has been stored, or
        // handed to quinn.
        let room = timed(bound, budget.acquire_many(header.payload_len as u32)).await?;
        match header.kind {
            Kind::Notif => {
                let mut message = vec![0u8; header.payload_len as usize];
                timed(bound, recv.read_exact(&mut message)).await?;
                (shared.notifs)(peer, message);
                Ok(None)
            }
            Kind::Write => {
                let payload = receive(&mut recv, header.payload_len as usize, bound).await?;
                store(shared, peer, &descs, &payload).map(|()| None)
            }
            Kind::Read => load(shared, peer, &descs, &header).map(|payload| Some((payload, room))),
        }
    };
    match answer {
        Ok(payload) => {
            let len = payload.as_ref().map_or(0, |(p, _)| p.len() as u64);
            frame::encode_response(0, header.request_id, len, "", &mut out);
            timed(bound, send.write_all(&out)).await?;
            if let Some((payload, _room)) = payload {
                timed(bound, send.write_chunk(payload)).await?;
            }
        }
        Err((code, msg)) => {
            tracing::debug!(request = header.request_id, %code, msg, "refusing request");
            frame::encode_response(code.to_wire(), header.request_id, 0, &msg, &mut out);
            timed(bound, send.write_all(&out)).await?;
        }
    }
    // Finished streams deliver their data after the handle is gone, while the connection lives.
    send.finish()?;
    Ok(())
}

/// A WRITE's payload, grown as it arrives: memory follows the bytes a peer sent, not the length
/// its header claims.
async fn receive(recv: &mut quinn::RecvStream, len: usize, bound: Duration) -> Result<Vec<u8>, ServeError> {
    let mut payload = Vec::with_capacity(len.min(1 << 20));
    while payload.len() < len {
        match timed(bound, recv.read_chunk(len - payload.len(), true)).await? {
            Some(chunk) => payload.extend_from_slice(&chunk.bytes),
            None => return Err(ServeError::Truncated { missing: len - payload.len() }),
        }
    }
    Ok(payload)
}

/// Host slices only: the backend registers nothing else, so anything else is a refusal.
fn host_only(pieces: &[LocalMem]) -> Result<(), Refusal> {
    match pieces.iter().find(|piece| !matches!(piece, LocalMem::Host(_))) {
        None => Ok(()),
        Some(piece) => Err((RefusalCode::Unsupported, format!("quic moves host memory, not {}", piece.mem_type()))),
    }
}

/// Copies a WRITE's payload into the memory its descriptors name, with their grants held.
fn store(shared: &TargetShared, peer: &str, descs: &[WireDesc], payload: &[u8]) -> Result<(), Refusal> {
    let mut held = Vec::new();
    let mut resolved = resolve(&shared.keys, &shared.grants, peer, descs, &mut held)?;
    host_only(&resolved.pieces)?;
    let mut at = 0;
    for piece in &mut resolved.pieces {
        if let LocalMem::Host(slice) = piece {
            let mut dest = memio::receive_slice(slice);
            let len = dest.len();
            dest.copy_from_slice(&payload[at..at + len]);
            at += len;
        }
    }
    drop(resolved);
    Ok(())
}

/// Copies the bytes a READ names out of memory, with their grants held.
fn load(shared: &TargetShared, peer: &str, descs: &[WireDesc], header: &Header) -> Result<Bytes, Refusal> {
    let mut held = Vec::new();
    let resolved = resolve(&shared.keys, &shared.grants, peer, descs, &mut held)?;
    host_only(&resolved.pieces)?;
    let mut payload = Vec::with_capacity(header.payload_len as usize);
    for slice in memio::send_from(&resolved.pieces) {
        payload.extend_from_slice(&slice);
    }
    drop(resolved);
    Ok(Bytes::from(payload))
}
