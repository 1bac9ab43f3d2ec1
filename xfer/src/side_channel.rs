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

/// Parses a request header (9 bytes) into the op and body length.
pub fn decode_request_header(header: &[u8; 9]) -> Result<(SideOp, usize), String> {
    if header[..4] != MAGIC {
        return Err("not an xfer side-channel request".into());
    }
    let op = SideOp::from_code(header[4]).ok_or_else(|| format!("unknown op {}", header[4]))?;
    let len = u32::from_le_bytes([header[5], header[6], header[7], header[8]]) as usize;
    if len > MAX_BLOB_LEN {
        return Err(format!("body of {len} bytes is too large"));
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

fn write_response(stream: &mut TcpStream, result: Result<Vec<u8>, String>) -> io::Result<()> {
    let (status, body) = match result {
        Ok(body) => (0u8, body),
        Err(text) => (1u8, text.into_bytes()),
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
    fn put(&self, blob: &[u8]) -> Result<String, String>;
    fn invalidate(&self, name: &str) -> Result<(), String>;
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
        Err(reason) => return write_response(&mut stream, Err(reason)),
    };
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body)?;
    let result = match op {
        SideOp::Get => Ok(handler.get()),
        SideOp::Put => handler.put(&body).map(String::into_bytes),
        SideOp::Invalidate => match std::str::from_utf8(&body) {
            Ok(name) => handler.invalidate(name).map(|()| Vec::new()),
            Err(_) => Err("agent name is not UTF-8".into()),
        },
    };
    write_response(&mut stream, result)?;
    stream.shutdown(Shutdown::Write)
}

/// Sends one request to a side channel and returns the response body. Every step is bounded
/// by `timeout`.
pub fn call(addr: &str, op: SideOp, body: &[u8], timeout: Duration) -> Result<Vec<u8>, String> {
    let target = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve: {e}"))?
        .next()
        .ok_or_else(|| "address resolves to nothing".to_string())?;
    let mut stream = TcpStream::connect_timeout(&target, timeout).map_err(|e| format!("connect: {e}"))?;
    let io = |e: io::Error| format!("i/o: {e}");
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    stream.write_all(&encode_request(op, body)).map_err(io)?;
    let mut header = [0u8; 5];
    stream.read_exact(&mut header).map_err(io)?;
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len > MAX_BLOB_LEN {
        return Err(format!("response of {len} bytes is too large"));
    }
    let mut response = vec![0u8; len];
    stream.read_exact(&mut response).map_err(io)?;
    match header[0] {
        0 => Ok(response),
        _ => Err(format!("peer refused: {}", String::from_utf8_lossy(&response))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_headers_round_trip_and_reject_garbage() {
        let encoded = encode_request(SideOp::Put, b"abc");
        let header: [u8; 9] = encoded[..9].try_into().unwrap();
        assert_eq!(decode_request_header(&header), Ok((SideOp::Put, 3)));
        assert!(decode_request_header(b"GET / HTT").is_err());
        let mut bad_op = header;
        bad_op[4] = 77;
        assert!(decode_request_header(&bad_op).is_err());
        let mut huge = header;
        huge[5..9].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_request_header(&huge).is_err());
    }
}
