//! The metadata side channel (NIXL's socket mode): an agent serves its metadata blob on a TCP
//! port, so a peer connects knowing only `host:port`.
//!
//! One request per connection:
//! ```text
//! request:  "XFSC" | op u8 | body length u32 LE | body
//! response: status u8 (0 ok, 1 error) | body length u32 LE | body (blob or error text)
//! ```
//! Ops: 1 = get the metadata, 2 = put the sender's metadata (load it), 3 = invalidate the agent
//! named in the body, 4 = claim a grant offered under a name ([`crate::grant_offer`]). Response status 2 means "unauthenticated" (see below).
//!
//! When the agent has a cluster credential, each connection starts with a challenge-response
//! (distinct magic, so a peer of the other kind gets a clear status-2 refusal):
//! ```text
//! client: "XFSA" | version u8 (1) | client nonce [32] | name length u8 | client name
//! server: status u8 (0) | server nonce [32] | name length u8 | server name | server proof [32]
//!         (or an error response as above)
//! client: client proof [32] | request as above
//! ```
//! Proofs are HMACs over both nonces and both names ([`xfer_core::credential`]); the fresh
//! server nonce makes a recorded exchange useless when replayed. Only an authenticated client
//! gets the metadata (region keys); PUT is accepted only for a blob naming the authenticated
//! client, INVALIDATE only of the client's own name.

use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use xfer_core::credential::{self, ClusterCredential, Nonce, ProofLabel, Transcript, AUTH_LEN};

use crate::error::XferError;
use crate::metadata::MAX_BLOB_LEN;

const MAGIC: [u8; 4] = *b"XFSC";
/// Starts an authenticated connection.
pub const AUTH_MAGIC: [u8; 4] = *b"XFSA";
pub const AUTH_VERSION: u8 = 1;
const STATUS_OK: u8 = 0;
const STATUS_ERROR: u8 = 1;
const STATUS_UNAUTHENTICATED: u8 = 2;
/// Peers whose refusals were logged; beyond this many, refusals are no longer logged.
const MAX_LOGGED_REFUSALS: usize = 1024;
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// At most this many connections are served at once, each on its own thread with bounded reads and
/// writes. Further connections wait in the listen backlog until a slot frees, so a flood of idle
/// connections costs threads only up to this bound.
const MAX_SERVED_CONNECTIONS: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SideOp {
    Get,
    Put,
    Invalidate,
    Claim,
}

impl SideOp {
    fn code(self) -> u8 {
        match self {
            SideOp::Get => 1,
            SideOp::Put => 2,
            SideOp::Invalidate => 3,
            SideOp::Claim => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(SideOp::Get),
            2 => Some(SideOp::Put),
            3 => Some(SideOp::Invalidate),
            4 => Some(SideOp::Claim),
            _ => None,
        }
    }
}

/// Why a side-channel request failed, on either end.
#[derive(Debug, thiserror::Error)]
pub enum SideChannelError {
    #[error("not an xfer side-channel request")]
    NotARequest,
    #[error("unknown op {0}")]
    UnknownOp(u8),
    #[error("{what} of {len} bytes is too large (at most {MAX_BLOB_LEN})")]
    TooLarge { what: &'static str, len: usize },
    #[error("agent name is not UTF-8")]
    NameNotUtf8,
    #[error("cannot resolve: {0}")]
    Resolve(#[source] io::Error),
    #[error("address resolves to nothing")]
    NoAddress,
    #[error("connect: {0}")]
    Connect(#[source] io::Error),
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    /// The peer answered with an error; its text as sent.
    #[error("peer refused: {0}")]
    Refused(String),
    #[error("the agent is shutting down")]
    AgentGone,
    /// The peer refused us as unauthenticated (no, a wrong or a mismatched credential); its
    /// text as sent.
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    /// The serving agent's proof does not verify: it does not hold our cluster secret.
    #[error("the serving agent failed to prove the cluster credential")]
    ServerUnauthenticated,
    #[error("authenticated hello version {0} is not supported (this build speaks {AUTH_VERSION})")]
    AuthVersion(u8),
    /// A PUT of a blob naming another agent than the authenticated peer.
    #[error("peer {peer:?} may not put metadata of agent {named:?}")]
    NotOwnMetadata { peer: String, named: String },
    /// An INVALIDATE of another agent than the authenticated peer.
    #[error("peer {peer:?} may not invalidate agent {named:?}")]
    NotOwnName { peer: String, named: String },
    #[error("credential: {0}")]
    Credential(#[from] credential::CredentialError),
    /// The serving agent could not do what was asked (a blob that does not load, an unknown
    /// agent to invalidate).
    #[error("{0}")]
    Agent(Box<XferError>),
}

/// Parses a request header (9 bytes) into the op and body length.
pub fn decode_request_header(header: &[u8; 9]) -> Result<(SideOp, usize), SideChannelError> {
    if header[..4] != MAGIC {
        return Err(SideChannelError::NotARequest);
    }
    let op = SideOp::from_code(header[4]).ok_or(SideChannelError::UnknownOp(header[4]))?;
    let len = u32::from_le_bytes([header[5], header[6], header[7], header[8]]) as usize;
    if len > MAX_BLOB_LEN {
        return Err(SideChannelError::TooLarge { what: "body", len });
    }
    Ok((op, len))
}

fn encode_request(op: SideOp, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + body.len());
    out.extend_from_slice(&MAGIC);
    out.push(op.code());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

fn status_of(err: &SideChannelError) -> u8 {
    match err {
        SideChannelError::Unauthenticated(_) => STATUS_UNAUTHENTICATED,
        _ => STATUS_ERROR,
    }
}

fn write_response(stream: &mut TcpStream, result: Result<Vec<u8>, SideChannelError>) -> io::Result<()> {
    let (status, body) = match result {
        Ok(body) => (STATUS_OK, body),
        Err(SideChannelError::Unauthenticated(text)) => (STATUS_UNAUTHENTICATED, text.into_bytes()),
        Err(err) => (status_of(&err), err.to_string().into_bytes()),
    };
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(status);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    stream.write_all(&out)
}

/// A name as the hello carries it: at most 255 bytes, cut at a character boundary (agent
/// names in metadata are at most 255 bytes anyway).
fn wire_name(name: &str) -> &str {
    let mut end = name.len().min(255);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// The client's opening of an authenticated connection.
pub fn encode_auth_hello(client_nonce: &Nonce, client_name: &str) -> Vec<u8> {
    let name = wire_name(client_name).as_bytes();
    let mut out = Vec::with_capacity(4 + 1 + AUTH_LEN + 1 + name.len());
    out.extend_from_slice(&AUTH_MAGIC);
    out.push(AUTH_VERSION);
    out.extend_from_slice(client_nonce);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out
}

/// Reads a length-prefixed (u8) UTF-8 name.
fn read_name(stream: &mut impl Read) -> Result<String, SideChannelError> {
    let mut len = [0u8; 1];
    stream.read_exact(&mut len)?;
    let mut name = vec![0u8; usize::from(len[0])];
    stream.read_exact(&mut name)?;
    String::from_utf8(name).map_err(|_| SideChannelError::NameNotUtf8)
}

/// Who the client is and what it proves itself with.
#[derive(Clone, Copy, Debug)]
pub struct ClientAuth<'a> {
    pub credential: &'a ClusterCredential,
    pub name: &'a str,
}

/// What the server asks of its agent. `peer` is the authenticated client's name, `None` when
/// the agent runs without a credential.
pub(crate) trait Handler: Send + Sync + 'static {
    fn get(&self) -> Vec<u8>;
    /// Loads a peer's metadata; returns the peer's name.
    fn put(&self, blob: &[u8], peer: Option<&str>) -> Result<String, SideChannelError>;
    fn invalidate(&self, name: &str, peer: Option<&str>) -> Result<(), SideChannelError>;
    /// Answers a grant claim (body and reply: [`crate::grant_offer`]).
    fn claim(&self, body: &[u8], peer: Option<&str>) -> Result<Vec<u8>, SideChannelError>;
}

/// The serving side's credential and name.
#[derive(Debug)]
pub(crate) struct ServerAuth {
    pub credential: Arc<ClusterCredential>,
    pub name: String,
}

/// Logs each refusing peer address once, so that a retry storm does not flood the log.
#[derive(Debug, Default)]
struct RefusalLog(Mutex<HashSet<IpAddr>>);

impl RefusalLog {
    fn refused(&self, peer: SocketAddr, err: &SideChannelError) {
        let mut seen = self.0.lock();
        if seen.len() < MAX_LOGGED_REFUSALS && seen.insert(peer.ip()) {
            tracing::warn!(%peer, %err, "side channel refused a peer (logged once per address)");
        }
    }
}

/// A running side-channel server; stops when dropped.
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    #[cfg(test)]
    serving: Arc<Serving>,
}

struct Serving {
    handler: Arc<dyn Handler>,
    auth: Option<ServerAuth>,
    refusals: RefusalLog,
    /// Connections being served now (at most [`MAX_SERVED_CONNECTIONS`]).
    served: AtomicUsize,
}

/// One connection's slot in [`Serving::served`], given back when its thread ends.
struct ServedSlot(Arc<Serving>);

impl Drop for ServedSlot {
    fn drop(&mut self) {
        self.0.served.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Server {
    pub fn start(addr: &str, handler: Arc<dyn Handler>, auth: Option<ServerAuth>) -> io::Result<Server> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let serving = Arc::new(Serving { handler, auth, refusals: RefusalLog::default(), served: AtomicUsize::new(0) });
        let thread = {
            let stop = Arc::clone(&stop);
            let serving = Arc::clone(&serving);
            std::thread::Builder::new()
                .name("xfer-side-channel".into())
                .spawn(move || accept_loop(listener, serving, stop))?
        };
        Ok(Server {
            addr,
            stop,
            thread: Some(thread),
            #[cfg(test)]
            serving,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections being served at this instant.
    #[cfg(test)]
    fn served_now(&self) -> usize {
        self.serving.served.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn accept_loop(listener: TcpListener, serving: Arc<Serving>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        if serving.served.load(Ordering::Acquire) >= MAX_SERVED_CONNECTIONS {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        match listener.accept() {
            Ok((stream, peer)) => {
                serving.served.fetch_add(1, Ordering::AcqRel);
                let slot = ServedSlot(Arc::clone(&serving));
                let spawned = std::thread::Builder::new().name("xfer-side-conn".into()).spawn(move || {
                    if let Err(err) = serve_one(stream, peer, &slot.0) {
                        tracing::debug!(%peer, %err, "side-channel request failed");
                    }
                });
                if let Err(err) = spawned {
                    tracing::warn!(%err, "cannot spawn side-channel thread");
                }
            }
            Err(err) if err.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(err) => {
                tracing::warn!(%err, "side-channel accept failed");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

fn serve_one(mut stream: TcpStream, peer: SocketAddr, serving: &Serving) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut magic = [0u8; 4];
    stream.read_exact(&mut magic)?;
    let authenticated = match (&serving.auth, magic == AUTH_MAGIC) {
        (Some(auth), true) => match authenticate_client(&mut stream, auth) {
            Ok(Ok(name)) => Some(name),
            Ok(Err(err)) => {
                serving.refusals.refused(peer, &err);
                return write_response(&mut stream, Err(err));
            }
            Err(err) => {
                serving.refusals.refused(peer, &err);
                return Ok(());
            }
        },
        (Some(_), false) => {
            let err = SideChannelError::Unauthenticated(
                "this agent requires a cluster credential (authenticated hello XFSA)".into(),
            );
            serving.refusals.refused(peer, &err);
            return write_response(&mut stream, Err(err));
        }
        (None, true) => {
            let err = SideChannelError::Unauthenticated("this agent has no cluster credential".into());
            serving.refusals.refused(peer, &err);
            return write_response(&mut stream, Err(err));
        }
        (None, false) => None,
    };
    let mut header = [0u8; 9];
    if authenticated.is_some() {
        stream.read_exact(&mut header[..4])?;
    } else {
        header[..4].copy_from_slice(&magic);
    }
    stream.read_exact(&mut header[4..])?;
    let (op, len) = match decode_request_header(&header) {
        Ok(parsed) => parsed,
        Err(err) => return write_response(&mut stream, Err(err)),
    };
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    let peer_name = authenticated.as_deref();
    let handler = serving.handler.as_ref();
    let result = match op {
        SideOp::Get => Ok(handler.get()),
        SideOp::Put => handler.put(&body, peer_name).map(String::into_bytes),
        SideOp::Invalidate => match std::str::from_utf8(&body) {
            Ok(name) => handler.invalidate(name, peer_name).map(|()| Vec::new()),
            Err(_) => Err(SideChannelError::NameNotUtf8),
        },
        SideOp::Claim => handler.claim(&body, peer_name),
    };
    if let Err(err @ (SideChannelError::NotOwnMetadata { .. } | SideChannelError::NotOwnName { .. })) = &result {
        serving.refusals.refused(peer, err);
    }
    write_response(&mut stream, result)?;
    stream.shutdown(Shutdown::Write)
}

/// The server's half of the challenge-response, after the magic. The outer error is an i/o
/// failure (nothing to answer); the inner one is a refusal to send back.
fn authenticate_client(
    stream: &mut TcpStream,
    auth: &ServerAuth,
) -> Result<Result<String, SideChannelError>, SideChannelError> {
    let mut version = [0u8; 1];
    stream.read_exact(&mut version)?;
    if version[0] != AUTH_VERSION {
        return Ok(Err(SideChannelError::AuthVersion(version[0])));
    }
    let mut client_nonce = [0u8; AUTH_LEN];
    stream.read_exact(&mut client_nonce)?;
    let client_name = match read_name(stream) {
        Ok(name) => name,
        Err(SideChannelError::NameNotUtf8) => return Ok(Err(SideChannelError::NameNotUtf8)),
        Err(err) => return Err(err),
    };
    let server_nonce = credential::fresh_nonce()?;
    let transcript = Transcript {
        client_nonce: &client_nonce,
        server_nonce: &server_nonce,
        client_name: &client_name,
        server_name: wire_name(&auth.name),
    };
    let server_name = wire_name(&auth.name).as_bytes();
    let mut challenge = Vec::with_capacity(1 + AUTH_LEN + 1 + server_name.len() + AUTH_LEN);
    challenge.push(STATUS_OK);
    challenge.extend_from_slice(&server_nonce);
    challenge.push(server_name.len() as u8);
    challenge.extend_from_slice(server_name);
    challenge.extend_from_slice(&auth.credential.prove(ProofLabel::SideChannelServer, &transcript));
    stream.write_all(&challenge)?;
    let mut client_proof = [0u8; AUTH_LEN];
    stream.read_exact(&mut client_proof)?;
    if !auth.credential.verify(ProofLabel::SideChannelClient, &transcript, &client_proof) {
        return Ok(Err(SideChannelError::Unauthenticated(format!(
            "{client_name:?} did not prove the cluster credential"
        ))));
    }
    Ok(Ok(client_name))
}

/// Sends one request to a side channel and returns the response body. Every step is bounded
/// by `timeout`.
pub fn call(addr: &str, op: SideOp, body: &[u8], timeout: Duration) -> Result<Vec<u8>, SideChannelError> {
    call_as(addr, op, body, timeout, None)
}

/// [`call`], authenticated with `auth` when given (see the module docs).
pub fn call_as(
    addr: &str,
    op: SideOp,
    body: &[u8],
    timeout: Duration,
    auth: Option<ClientAuth<'_>>,
) -> Result<Vec<u8>, SideChannelError> {
    let target =
        addr.to_socket_addrs().map_err(SideChannelError::Resolve)?.next().ok_or(SideChannelError::NoAddress)?;
    let mut stream = TcpStream::connect_timeout(&target, timeout).map_err(SideChannelError::Connect)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let mut request = Vec::new();
    if let Some(auth) = auth {
        let client_nonce = credential::fresh_nonce()?;
        stream.write_all(&encode_auth_hello(&client_nonce, auth.name))?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status)?;
        if status[0] != STATUS_OK {
            return Err(read_error_response(&mut stream, status[0]));
        }
        let mut server_nonce = [0u8; AUTH_LEN];
        stream.read_exact(&mut server_nonce)?;
        let server_name = read_name(&mut stream)?;
        let mut server_proof = [0u8; AUTH_LEN];
        stream.read_exact(&mut server_proof)?;
        let transcript = Transcript {
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
            client_name: wire_name(auth.name),
            server_name: &server_name,
        };
        if !auth.credential.verify(ProofLabel::SideChannelServer, &transcript, &server_proof) {
            return Err(SideChannelError::ServerUnauthenticated);
        }
        request.extend_from_slice(&auth.credential.prove(ProofLabel::SideChannelClient, &transcript));
    }
    request.extend_from_slice(&encode_request(op, body));
    stream.write_all(&request)?;
    let mut status = [0u8; 1];
    stream.read_exact(&mut status)?;
    match status[0] {
        STATUS_OK => read_body(&mut stream),
        other => Err(read_error_response(&mut stream, other)),
    }
}

fn read_body(stream: &mut TcpStream) -> Result<Vec<u8>, SideChannelError> {
    let mut len = [0u8; 4];
    stream.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_BLOB_LEN {
        return Err(SideChannelError::TooLarge { what: "response", len });
    }
    let mut response = vec![0u8; len];
    stream.read_exact(&mut response)?;
    Ok(response)
}

fn read_error_response(stream: &mut TcpStream, status: u8) -> SideChannelError {
    let text = match read_body(stream) {
        Ok(body) => String::from_utf8_lossy(&body).into_owned(),
        Err(err) => return err,
    };
    match status {
        STATUS_UNAUTHENTICATED => SideChannelError::Unauthenticated(text),
        _ => SideChannelError::Refused(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_headers_round_trip_and_reject_garbage() {
        let encoded = encode_request(SideOp::Put, b"abc");
        let header: [u8; 9] = encoded[..9].try_into().unwrap();
        assert_eq!(decode_request_header(&header).unwrap(), (SideOp::Put, 3));
        assert!(matches!(decode_request_header(b"GET / HTT"), Err(SideChannelError::NotARequest)));
        let mut bad_op = header;
        bad_op[4] = 77;
        assert!(matches!(decode_request_header(&bad_op), Err(SideChannelError::UnknownOp(77))));
        let mut huge = header;
        huge[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = decode_request_header(&huge).unwrap_err();
        assert!(matches!(err, SideChannelError::TooLarge { what: "body", .. }), "{err}");
    }

    struct Fixed;

    impl Handler for Fixed {
        fn get(&self) -> Vec<u8> {
            b"metadata".to_vec()
        }
        fn put(&self, _: &[u8], _: Option<&str>) -> Result<String, SideChannelError> {
            Err(SideChannelError::NotARequest)
        }
        fn invalidate(&self, _: &str, _: Option<&str>) -> Result<(), SideChannelError> {
            Err(SideChannelError::NotARequest)
        }
        fn claim(&self, _: &[u8], _: Option<&str>) -> Result<Vec<u8>, SideChannelError> {
            Err(SideChannelError::NotARequest)
        }
    }

    fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn idle_connections_hold_at_most_the_bound_and_later_callers_wait_instead_of_failing() {
        let server = Server::start("127.0.0.1:0", Arc::new(Fixed), None).unwrap();
        let addr = server.addr().to_string();
        let idle: Vec<TcpStream> =
            (0..MAX_SERVED_CONNECTIONS + 16).map(|_| TcpStream::connect(&addr).unwrap()).collect();
        wait_until("every slot is taken", || server.served_now() == MAX_SERVED_CONNECTIONS);

        let waiting = {
            let addr = addr.clone();
            std::thread::spawn(move || call(&addr, SideOp::Get, b"", Duration::from_secs(10)))
        };
        for _ in 0..20 {
            assert!(server.served_now() <= MAX_SERVED_CONNECTIONS, "{} served", server.served_now());
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!waiting.is_finished(), "a caller beyond the bound was served before a slot freed");

        drop(idle);
        assert_eq!(waiting.join().unwrap().unwrap(), b"metadata");
        wait_until("every slot is given back", || server.served_now() == 0);
        assert_eq!(call(&addr, SideOp::Get, b"", Duration::from_secs(5)).unwrap(), b"metadata");
    }
}
