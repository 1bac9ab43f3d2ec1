//! The metadata side channel (NIXL's socket mode): an agent serves its metadata blob on a TCP
//! port, so a peer connects knowing only `host:port`.
//!
//! One request per connection:
//! ```text
//! request:  "XFSC" | op u8 | body length u32 LE | body
//! response: status u8 (0 ok, 1 error) | body length u32 LE | body (blob or error text)
//! ```
//! Ops: 1 = get the metadata, 2 = put the sender's metadata (load it), 3 = invalidate the agent
//! named in the body.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::XferError;
use crate::metadata::MAX_BLOB_LEN;

const MAGIC: [u8; 4] = *b"XFSC";
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SideOp {
    Get,
    Put,
    Invalidate,
}

impl SideOp {
    fn code(self) -> u8 {
        match self {
            SideOp::Get => 1,
            SideOp::Put => 2,
            SideOp::Invalidate => 3,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(SideOp::Get),
            2 => Some(SideOp::Put),
            3 => Some(SideOp::Invalidate),
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

fn write_response(stream: &mut TcpStream, result: Result<Vec<u8>, SideChannelError>) -> io::Result<()> {
    let (status, body) = match result {
        Ok(body) => (0u8, body),
        Err(err) => (1u8, err.to_string().into_bytes()),
    };
    let mut out = Vec::with_capacity(5 + body.len());
    out.push(status);
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&body);
    stream.write_all(&out)
}

/// What the server asks of its agent.
pub(crate) trait Handler: Send + Sync + 'static {
    fn get(&self) -> Vec<u8>;
    /// Loads a peer's metadata; returns the peer's name.
    fn put(&self, blob: &[u8]) -> Result<String, SideChannelError>;
    fn invalidate(&self, name: &str) -> Result<(), SideChannelError>;
}

/// A running side-channel server; stops when dropped.
#[derive(Debug)]
pub(crate) struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn start(addr: &str, handler: Arc<dyn Handler>) -> io::Result<Server> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("xfer-side-channel".into())
                .spawn(move || accept_loop(listener, handler, stop))?
        };
        Ok(Server { addr, stop, thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
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

fn accept_loop(listener: TcpListener, handler: Arc<dyn Handler>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let handler = Arc::clone(&handler);
                let spawned = std::thread::Builder::new().name("xfer-side-conn".into()).spawn(move || {
                    if let Err(err) = serve_one(stream, handler.as_ref()) {
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

fn serve_one(mut stream: TcpStream, handler: &dyn Handler) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut header = [0u8; 9];
    stream.read_exact(&mut header)?;
    let (op, len) = match decode_request_header(&header) {
        Ok(parsed) => parsed,
        Err(err) => return write_response(&mut stream, Err(err)),
    };
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    let result = match op {
        SideOp::Get => Ok(handler.get()),
        SideOp::Put => handler.put(&body).map(String::into_bytes),
        SideOp::Invalidate => match std::str::from_utf8(&body) {
            Ok(name) => handler.invalidate(name).map(|()| Vec::new()),
            Err(_) => Err(SideChannelError::NameNotUtf8),
        },
    };
    write_response(&mut stream, result)?;
    stream.shutdown(Shutdown::Write)
}

/// Sends one request to a side channel and returns the response body. Every step is bounded
/// by `timeout`.
pub fn call(addr: &str, op: SideOp, body: &[u8], timeout: Duration) -> Result<Vec<u8>, SideChannelError> {
    let target =
        addr.to_socket_addrs().map_err(SideChannelError::Resolve)?.next().ok_or(SideChannelError::NoAddress)?;
    let mut stream = TcpStream::connect_timeout(&target, timeout).map_err(SideChannelError::Connect)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(&encode_request(op, body))?;
    let mut header = [0u8; 5];
    stream.read_exact(&mut header)?;
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len > MAX_BLOB_LEN {
        return Err(SideChannelError::TooLarge { what: "response", len });
    }
    let mut response = vec![0u8; len];
    stream.read_exact(&mut response)?;
    match header[0] {
        0 => Ok(response),
        _ => Err(SideChannelError::Refused(String::from_utf8_lossy(&response).into_owned())),
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
}
