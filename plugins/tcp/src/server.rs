//! The target side: serves registered memory on the data port, one thread per connection.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xfer_core::staging::{check_files, needs_staging, Flow, Staging, StagingConfig};
use xfer_core::{LocalMem, NotifSink, Pin, RefusalCode};

use crate::conn::{tune, Conn, ConnError, SocketTuning};
use crate::fence::{Fence, Fences};
use xfer_core::credential::{ClusterCredential, AUTH_LEN};

use crate::hello::{self, Admitted, Verdict};

use crate::frame::{self, FrameError, Header, Kind, Session, WireDesc};
use crate::grants::{Grant, GrantTable, Refusal};
use crate::keys::KeyTable;
use crate::memio;
use crate::staged::Lanes;
use parking_lot::RwLockReadGuard;

/// What every connection thread shares.
pub struct ServerShared {
    pub agent_name: String,
    /// With a credential, every initiator must prove it in the hello.
    pub credential: Option<Arc<ClusterCredential>>,
    /// Initiator addresses whose refusal was logged (once each).
    pub refused: parking_lot::Mutex<std::collections::HashSet<std::net::IpAddr>>,
    pub keys: Arc<KeyTable>,
    pub grants: Arc<GrantTable>,
    pub notifs: NotifSink,
    pub timeout: Duration,
    pub tuning: SocketTuning,
    pub stop: Arc<AtomicBool>,
    pub fences: Fences,
    pub staging: Arc<dyn Staging>,
    pub staging_config: StagingConfig,
    /// With `tls=on`: every connection must start TLS.
    pub tls: Option<Arc<crate::tls::TlsIdentity>>,
    /// How long a connection polls for the next frame before it sleeps ([`crate::spin`]).
    pub spin: Duration,
}

pub struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn start(listener: TcpListener, shared: ServerShared) -> std::io::Result<Server> {
        let addr = listener.local_addr()?;
        let stop = Arc::clone(&shared.stop);
        let shared = Arc::new(shared);
        let thread =
            std::thread::Builder::new().name("xfer-tcp-accept".into()).spawn(move || accept_loop(listener, shared))?;
        Ok(Server { addr, stop, thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the blocking accept.
        let wake = if self.addr.ip().is_unspecified() {
            SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), self.addr.port())
        } else {
            self.addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<ServerShared>) {
    for incoming in listener.incoming() {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match incoming {
            Ok(stream) => stream,
            Err(err) => {
                tracing::warn!(%err, "tcp backend accept failed");
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new().name("xfer-tcp-serve".into()).spawn(move || {
            let peer = stream.peer_addr().ok();
            if let Err(err) = serve(stream, &shared) {
                tracing::debug!(?peer, %err, "tcp backend connection closed with an error");
            }
        });
        if let Err(err) = spawned {
            tracing::warn!(%err, "cannot spawn a connection thread");
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ServeError {
    #[error("malformed frame: {0}")]
    Frame(#[from] FrameError),
    #[error("{0}")]
    Conn(#[from] ConnError),
    #[error("hello: {0}")]
    Hello(#[from] hello::HelloError),
    #[error("a newer connection of this initiator took over")]
    Superseded,
    #[error("staging the payload of a read failed: {0}")]
    Staging(xfer_core::BackendError),
    #[error("{0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error("an initiator without TLS was refused (this target runs tls=on)")]
    PlainRefused,
    #[error("a TLS initiator was refused (this target runs without TLS)")]
    TlsRefused,
}

fn serve(stream: TcpStream, shared: &ServerShared) -> Result<(), ServeError> {
    tune(&stream, shared.tuning).map_err(ConnError::from)?;
    let peer_addr = stream.peer_addr().ok();
    let mut conn = Conn::new(stream, shared.timeout, Arc::clone(&shared.stop)).map_err(ConnError::from)?;
    match &shared.tls {
        Some(identity) => {
            if !conn.start_tls_server(identity.accept()?)? {
                refuse_mismatch(&mut conn, "this target runs tls=on: connect with tls=on")?;
                return Err(ServeError::PlainRefused);
            }
        }
        None => {
            if conn.opens_with_tls()? {
                refuse_mismatch(&mut conn, "this target runs without TLS: connect without tls=on")?;
                return Err(ServeError::TlsRefused);
            }
        }
    }
    let Some((peer, session, fence)) = handshake(&mut conn, shared, peer_addr)? else { return Ok(()) };
    conn.set_spin(shared.spin);
    let mut header_buf = [0u8; frame::HEADER_LEN];
    let mut table = Vec::new();
    let mut descs = Vec::new();
    // Answers not written yet: an answer without payload waits while the next request is
    // already read ahead, so a run of pipelined requests is answered in one write.
    let mut out = Vec::with_capacity(64);
    let mut lanes = Lanes::default();
    let staging = &*shared.staging;
    let io = |e: ConnError| xfer_core::BackendError::Protocol(e.to_string());
    loop {
        if !conn.read_frame_start(&mut header_buf)? {
            return Ok(());
        }
        let header = frame::decode_header(&header_buf)?;
        table.resize(frame::table_len(header.n_desc), 0);
        conn.read_exact(&mut table)?;
        frame::decode_descs(&header, &table, &mut descs)?;
        let current = fence.read();
        if *current != session {
            return Err(ServeError::Superseded);
        }
        // Memory requests: every descriptor checked, and the grants they use held against
        // revocation (checked live under the guard) until the frame is done with the memory
        // (the end of the match on the resolution).
        let mut grants_used = Vec::new();
        match header.kind {
            Kind::Notif => {
                let mut message = vec![0u8; header.payload_len as usize];
                conn.read_exact(&mut message)?;
                (shared.notifs)(&peer, message);
                drop(current);
                frame::encode_response(0, header.request_id, 0, "", &mut out);
            }
            Kind::Write => match resolve(&shared.keys, &shared.grants, &peer, &descs, &mut grants_used) {
                Ok(Resolved { mut pieces, .. }) if needs_staging(&pieces) => {
                    let staged = match check_files(Flow::FromWire, &pieces) {
                        // Refused before any byte moved: the payload is read and dropped.
                        Err(err) => {
                            conn.discard(header.payload_len)?;
                            Err(err)
                        }
                        // A failed copy still reads the whole payload, so the refusal stays in step.
                        Ok(()) => {
                            lanes.run(staging, shared.staging_config, Flow::FromWire, &mut pieces, &mut conn, &io)
                        }
                    };
                    drop(pieces);
                    drop(current);
                    match staged {
                        Ok(()) => frame::encode_response(0, header.request_id, 0, "", &mut out),
                        Err(err) => {
                            let msg = format!("storing staged memory: {err}");
                            refusal(&header, RefusalCode::BadRequest, &msg, &mut out);
                        }
                    }
                }
                Ok(Resolved { pieces: mut slices, .. }) => {
                    memio::with_receive_slices(&mut [], &mut slices, |iov| conn.read_exact_vectored(iov))?;
                    drop(slices);
                    drop(current);
                    frame::encode_response(0, header.request_id, 0, "", &mut out);
                }
                Err((code, msg)) => {
                    conn.discard(header.payload_len)?;
                    refusal(&header, code, &msg, &mut out);
                }
            },
            Kind::Read => match resolve(&shared.keys, &shared.grants, &peer, &descs, &mut grants_used) {
                Ok(Resolved { mut pieces, .. }) if needs_staging(&pieces) => match check_files(Flow::ToWire, &pieces) {
                    Err(err) => {
                        let msg = format!("reading staged memory: {err}");
                        refusal(&header, RefusalCode::BadRequest, &msg, &mut out);
                    }
                    Ok(()) => {
                        frame::encode_response(0, header.request_id, header.payload_len, "", &mut out);
                        conn.write_all(&out)?;
                        out.clear();
                        // The answer is promised: a copy failing now (checked above, so a device
                        // error or the file changing meanwhile) can only end the connection.
                        lanes
                            .run(staging, shared.staging_config, Flow::ToWire, &mut pieces, &mut conn, &io)
                            .map_err(ServeError::Staging)?;
                    }
                },
                Ok(Resolved { pieces: slices, .. }) => {
                    frame::encode_response(0, header.request_id, header.payload_len, "", &mut out);
                    memio::with_send_slices(&out, &slices, |iov| conn.write_all_vectored(iov))?;
                    out.clear();
                }
                Err((code, msg)) => refusal(&header, code, &msg, &mut out),
            },
        }
        if !out.is_empty() && (conn.buffered() < frame::HEADER_LEN || out.len() >= MAX_HELD_ANSWERS) {
            conn.write_all(&out)?;
            out.clear();
        }
    }
}

/// Bytes of answers held back for the requests read ahead.
const MAX_HELD_ANSWERS: usize = 16 << 10;

/// Appends a refusal of `header`'s request to the answers to write.
fn refusal(header: &Header, code: RefusalCode, msg: &str, out: &mut Vec<u8>) {
    tracing::debug!(request = header.request_id, %code, msg, "refusing request");
    frame::encode_response(code.to_wire(), header.request_id, 0, msg, out);
}

/// Answers an initiator that sent a plain hello to this TLS target with a refusal it can read,
/// then lets it close first (closing with its hello unread would reset the reply away).
/// Answers an initiator whose TLS setting differs from this target's, in plain text.
fn refuse_mismatch(conn: &mut Conn, msg: &str) -> Result<(), ConnError> {
    let mut out = Vec::new();
    frame::encode_hello_reply(RefusalCode::Unsupported.to_wire(), msg, &mut out);
    conn.write_all(&out)?;
    conn.drain_until_closed()
}

/// Reads the hello, checks it is meant for this agent and current, answers; returns the
/// initiator's name, its session and the fence frames check.
fn handshake(
    conn: &mut Conn,
    shared: &ServerShared,
    peer_addr: Option<std::net::SocketAddr>,
) -> Result<Option<(String, Session, Fence)>, ServeError> {
    let mut fixed = [0u8; frame::HELLO_LEN];
    if !conn.read_frame_start(&mut fixed)? {
        return Ok(None);
    }
    let hello = frame::decode_hello(&fixed)?;
    let mut names = vec![0u8; hello::names_len(&hello)];
    conn.read_exact(&mut names)?;
    let admitted = match hello::judge(&hello, &names, &shared.agent_name, shared.credential.as_ref())? {
        Verdict::Admit(admitted) => Ok(admitted),
        Verdict::Refuse(refused) => Err(refused),
        Verdict::Challenge(challenge) => {
            conn.write_all(&challenge.bytes)?;
            let mut proof = [0u8; AUTH_LEN];
            conn.read_exact(&mut proof)?;
            challenge.check(&proof)
        }
    };
    let Admitted { from, session } = match admitted {
        Ok(admitted) => admitted,
        Err(refused) => {
            if let Some(peer) = peer_addr {
                refused.refusal.log_once(&shared.refused, peer.ip(), "tcp");
            }
            conn.write_all(&refused.reply)?;
            return Ok(None);
        }
    };
    let Some(fence) = shared.fences.admit(&from, session) else {
        let msg = format!("connection epoch {} of {from:?} is stale", session.epoch);
        conn.write_all(&hello::refusal_reply(RefusalCode::BadRequest, &msg))?;
        return Ok(None);
    };
    conn.write_all(&hello::accepted_reply())?;
    Ok(Some((from, session, fence)))
}

/// A memory frame's pieces, and the grants it uses held against revocation while it touches
/// them (dropped with this).
#[derive(Debug)]
pub struct Resolved<'g> {
    pub pieces: Vec<LocalMem>,
    _holds: Vec<RwLockReadGuard<'g, bool>>,
}

/// Checks every descriptor before any byte moves: known key (a region's, or a grant's for
/// this initiator and inside its ranges), live region, within bounds; then holds the grants
/// used (`held` keeps them for the guards), live and unexpired. The clock is read only when a
/// grant is used.
pub fn resolve<'g>(
    keys: &KeyTable,
    grants: &GrantTable,
    initiator: &str,
    descs: &[WireDesc],
    held: &'g mut Vec<Arc<Grant>>,
) -> Result<Resolved<'g>, Refusal> {
    let mut slices = Vec::with_capacity(descs.len());
    let mut pinned: Option<(frame::Key, Pin, Option<Arc<Grant>>)> = None;
    for (index, desc) in descs.iter().enumerate() {
        let (pin, grant) = match &pinned {
            Some((key, pin, grant)) if *key == desc.key => (pin.clone(), grant.clone()),
            _ => {
                let (region, grant) = match keys.get(&desc.key) {
                    Some(region) => (region, None),
                    None => {
                        let grant = grants.get(&desc.key).ok_or_else(|| {
                            (RefusalCode::UnknownKey, format!("descriptor {index} names an unknown key"))
                        })?;
                        if !held.iter().any(|h| Arc::ptr_eq(h, &grant)) {
                            held.push(Arc::clone(&grant));
                        }
                        (Arc::clone(&grant.region), Some(grant))
                    }
                };
                let pin = region.pin().ok_or_else(|| {
                    (RefusalCode::Deregistered, format!("descriptor {index}: region is being deregistered"))
                })?;
                pinned = Some((desc.key, pin.clone(), grant.clone()));
                (pin, grant)
            }
        };
        if let Some(grant) = &grant {
            grant
                .admits(initiator, desc.offset, desc.len)
                .map_err(|(code, msg)| (code, format!("descriptor {index}: {msg}")))?;
        }
        let base = pin.region().desc().addr;
        let slice = desc.offset.checked_add(base).and_then(|addr| pin.local_at(addr, desc.len)).ok_or_else(|| {
            (
                RefusalCode::OutOfBounds,
                format!(
                    "descriptor {index}: offset {} + {} bytes is outside a {}-byte region",
                    desc.offset,
                    desc.len,
                    pin.region().desc().len
                ),
            )
        })?;
        slices.push(slice);
    }
    let held: &'g [Arc<Grant>] = held;
    let holds = match held {
        [] => Vec::new(),
        used => {
            let now = Instant::now();
            used.iter().map(|grant| grant.hold(now)).collect::<Result<_, _>>()?
        }
    };
    Ok(Resolved { pieces: slices, _holds: holds })
}
