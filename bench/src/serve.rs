//! The target's raw-tcp port: the baseline's data requests and `--check`'s control requests
//! (protocol in [`crate::wire`]). One thread per connection.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use xfer::{Agent, Grant};

use crate::memory::{BenchBuffer, PageBuf};
use crate::pattern;
use crate::wire::{decode_ranges, Cmd, Header, Refusal, Reply, HEADER_LEN, RANGE_LEN};

/// Most ranges one REGION_VERIFY may carry.
const MAX_RANGES: u64 = 1 << 24;
/// Longest initiator name a GRANT may carry.
const MAX_NAME: u64 = 4096;
/// Grants last the run: the target lives no longer.
const GRANT_TTL: Duration = Duration::from_secs(24 * 3600);
const CHUNK: usize = 1 << 20;

/// What every connection of the target shares.
#[derive(Debug)]
pub struct Shared {
    /// The registered region of an xfer target; `None` for a raw-tcp-only target.
    pub region: Option<BenchBuffer>,
    /// Largest raw request a connection buffers.
    pub max_bytes: u64,
    /// The xfer target's agent, which issues `--grants`' grants.
    pub agent: Option<Agent>,
    /// Grants issued, kept (live) until the target exits.
    pub grants: Mutex<Vec<Grant>>,
}

/// Accepts connections for as long as the process lives.
pub fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        match stream {
            Ok(stream) => {
                let shared = Arc::clone(&shared);
                std::thread::spawn(move || {
                    if let Err(err) = handle(stream, &shared) {
                        eprintln!("xferbench target: raw-tcp connection: {err}");
                    }
                });
            }
            Err(err) => eprintln!("xferbench target: accept: {err}"),
        }
    }
}

fn handle(mut stream: TcpStream, shared: &Shared) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut buf = PageBuf::default();
    let mut raw = [0u8; HEADER_LEN];
    while read_header(&mut stream, &mut raw)? {
        let header = Header::decode(&raw).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        let reply = match header.cmd {
            Cmd::Write | Cmd::Read | Cmd::Fill | Cmd::Verify => {
                if header.len > shared.max_bytes {
                    stream.write_all(&Reply::Refused(Refusal::TooLarge).encode())?;
                    return Err(io::Error::other(format!("{} bytes is over the target's cap", header.len)));
                }
                let len = header.len as usize;
                buf.grow(len);
                buffer_request(&mut stream, header, &mut buf[..len])?
            }
            Cmd::RegionFill => Some(region_fill(shared.region.as_ref(), header.len, header.seed)),
            Cmd::RegionVerify => {
                if header.len > MAX_RANGES {
                    stream.write_all(&Reply::Refused(Refusal::TooLarge).encode())?;
                    return Err(io::Error::other("too many ranges"));
                }
                let mut encoded = vec![0u8; header.len as usize * RANGE_LEN];
                stream.read_exact(&mut encoded)?;
                Some(region_verify(shared.region.as_ref(), &decode_ranges(&encoded), header.seed))
            }
            Cmd::Grant => {
                if header.len > MAX_RANGES || header.seed > MAX_NAME {
                    stream.write_all(&Reply::Refused(Refusal::TooLarge).encode())?;
                    return Err(io::Error::other("grant request too large"));
                }
                let mut name = vec![0u8; header.seed as usize];
                stream.read_exact(&mut name)?;
                let mut encoded = vec![0u8; header.len as usize * RANGE_LEN];
                stream.read_exact(&mut encoded)?;
                match grant(shared, &String::from_utf8_lossy(&name), &decode_ranges(&encoded)) {
                    Ok(token) => {
                        stream.write_all(&Reply::Ok.encode())?;
                        stream.write_all(&(token.len() as u64).to_le_bytes())?;
                        stream.write_all(&token)?;
                        None
                    }
                    Err(reply) => Some(reply),
                }
            }
        };
        if let Some(reply) = reply {
            stream.write_all(&reply.encode())?;
        }
    }
    Ok(())
}

/// Reads a header; `false` on a clean end of stream before its first byte.
fn read_header(stream: &mut TcpStream, raw: &mut [u8; HEADER_LEN]) -> io::Result<bool> {
    let mut got = 0;
    while got < HEADER_LEN {
        match stream.read(&mut raw[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(true)
}

/// The requests on the connection's own buffer; READ answers with the data, not a reply.
fn buffer_request(stream: &mut TcpStream, header: Header, data: &mut [u8]) -> io::Result<Option<Reply>> {
    Ok(match header.cmd {
        Cmd::Write => {
            stream.read_exact(data)?;
            Some(Reply::Ok)
        }
        Cmd::Read => {
            stream.write_all(data)?;
            None
        }
        Cmd::Fill => {
            pattern::fill(data, 0, header.seed);
            Some(Reply::Ok)
        }
        _ => Some(match pattern::first_mismatch(data, 0, header.seed) {
            None => Reply::Ok,
            Some(at) => Reply::Mismatch(at as u64),
        }),
    })
}

fn region_fill(region: Option<&BenchBuffer>, len: u64, seed: u64) -> Reply {
    let Some(region) = region else { return Reply::Refused(Refusal::NoRegion) };
    if len > region.len() as u64 {
        return Reply::Refused(Refusal::OutOfRange);
    }
    let mut scratch = vec![0u8; CHUNK];
    for start in (0..len as usize).step_by(CHUNK) {
        let piece = &mut scratch[..CHUNK.min(len as usize - start)];
        pattern::fill(piece, start as u64, seed);
        if let Err(err) = region.write_at(start, piece) {
            return region_io_failed(&err);
        }
    }
    Reply::Ok
}

/// Grants `initiator` the `(offset, length)` ranges of the region; returns the token.
fn grant(shared: &Shared, initiator: &str, ranges: &[(u64, u64)]) -> Result<Vec<u8>, Reply> {
    let (Some(region), Some(agent)) = (shared.region.as_ref(), shared.agent.as_ref()) else {
        return Err(Reply::Refused(Refusal::NoRegion));
    };
    let inside = |&(offset, len): &(u64, u64)| offset.checked_add(len).is_some_and(|end| end <= region.len() as u64);
    if !ranges.iter().all(inside) {
        return Err(Reply::Refused(Refusal::OutOfRange));
    }
    let descs: Vec<xfer::Desc> =
        ranges.iter().map(|&(offset, len)| region.sub_desc(offset as usize, len as usize)).collect();
    match agent.grant(initiator, region.mem_type(), &descs, GRANT_TTL) {
        Ok(grant) => {
            let token = grant.token();
            shared.grants.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).push(grant);
            Ok(token)
        }
        Err(err) => {
            eprintln!("xferbench target: grant for {initiator}: {err}");
            Err(Reply::Refused(Refusal::Grant))
        }
    }
}

fn region_io_failed(err: &anyhow::Error) -> Reply {
    eprintln!("xferbench target: {}", pd_config_file::report::error_line(err.as_ref()));
    Reply::Refused(Refusal::RegionIo)
}

fn region_verify(region: Option<&BenchBuffer>, ranges: &[(u64, u64)], seed: u64) -> Reply {
    let Some(region) = region else { return Reply::Refused(Refusal::NoRegion) };
    let mut scratch = vec![0u8; CHUNK];
    for &(offset, len) in ranges {
        match offset.checked_add(len) {
            Some(end) if end <= region.len() as u64 => {}
            _ => return Reply::Refused(Refusal::OutOfRange),
        }
        let (offset, len) = (offset as usize, len as usize);
        for start in (offset..offset + len).step_by(CHUNK) {
            let piece = &mut scratch[..CHUNK.min(offset + len - start)];
            if let Err(err) = region.read_at(start, piece) {
                return region_io_failed(&err);
            }
            if let Some(at) = pattern::first_mismatch(piece, start as u64, seed) {
                return Reply::Mismatch((start + at) as u64);
            }
        }
    }
    Reply::Ok
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raw::RawConn;

    fn start(region: Option<usize>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let region = region.map(|len| BenchBuffer::Host(Arc::new(xfer::HostBuffer::new(len))));
        let shared = Arc::new(Shared { region, max_bytes: 1 << 20, agent: None, grants: Default::default() });
        std::thread::spawn(move || accept_loop(listener, shared));
        addr
    }

    #[test]
    fn raw_requests_move_bytes_and_checks_catch_differences() {
        let mut conn = RawConn::connect(&start(None)).unwrap();
        let mut data = vec![0u8; 100_000];
        pattern::fill(&mut data, 0, 3);
        conn.write(&data).unwrap();
        assert_eq!(conn.call(Header { cmd: Cmd::Verify, len: 100_000, seed: 3 }, &[]).unwrap(), Reply::Ok);
        assert_eq!(conn.call(Header { cmd: Cmd::Verify, len: 100_000, seed: 4 }, &[]).unwrap(), Reply::Mismatch(0));
        let mut back = vec![0u8; 100_000];
        conn.read(&mut back).unwrap();
        assert_eq!(back, data);
        assert_eq!(
            conn.call(Header { cmd: Cmd::RegionFill, len: 10, seed: 0 }, &[]).unwrap(),
            Reply::Refused(Refusal::NoRegion)
        );
        let too_big = conn.call(Header { cmd: Cmd::Fill, len: 2 << 20, seed: 0 }, &[]).unwrap();
        assert_eq!(too_big, Reply::Refused(Refusal::TooLarge));
    }

    #[test]
    fn region_checks_find_the_first_bad_byte() {
        let mut conn = RawConn::connect(&start(Some(64 << 10))).unwrap();
        assert_eq!(conn.call(Header { cmd: Cmd::RegionFill, len: 64 << 10, seed: 8 }, &[]).unwrap(), Reply::Ok);
        let verify = |conn: &mut RawConn, ranges: &[(u64, u64)], seed| {
            let header = Header { cmd: Cmd::RegionVerify, len: ranges.len() as u64, seed };
            conn.call(header, &crate::wire::encode_ranges(ranges)).unwrap()
        };
        assert_eq!(verify(&mut conn, &[(4096, 4096), (0, 100)], 8), Reply::Ok);
        assert_eq!(verify(&mut conn, &[(0, 100), (4096, 4096)], 9), Reply::Mismatch(0));
        assert_eq!(verify(&mut conn, &[(60 << 10, 8 << 10)], 8), Reply::Refused(Refusal::OutOfRange));
    }
}
