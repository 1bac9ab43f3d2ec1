//! The raw-tcp baseline's initiator side: one plain TCP connection per thread, the same bytes
//! per request as the case, from and into a preallocated buffer. Also carries `--check`'s
//! control requests to the target.

use std::io::{IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::ProgressBar;
use xfer::Op;

use crate::check;
use crate::layout::Case;
use crate::measure::{measure, Measurement, Plan, Worker, REQUEST_TIMEOUT};
use crate::memory::PageBuf;
use crate::wire::{encode_ranges, Cmd, Header, Reply, REPLY_LEN};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Far above any real token (a few dozen bytes per granted range).
const MAX_TOKEN_BYTES: u64 = 64 << 20;

/// A connection to the target's raw-tcp port.
#[derive(Debug)]
pub struct RawConn {
    stream: TcpStream,
}

impl RawConn {
    pub fn connect(addr: &str) -> Result<RawConn> {
        let resolved = addr.to_socket_addrs().with_context(|| format!("resolving {addr}"))?.next();
        let resolved = resolved.ok_or_else(|| anyhow!("{addr} resolves to nothing"))?;
        let stream = TcpStream::connect_timeout(&resolved, CONNECT_TIMEOUT)
            .with_context(|| format!("connecting to the target's raw-tcp port {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(REQUEST_TIMEOUT))?;
        stream.set_write_timeout(Some(REQUEST_TIMEOUT))?;
        Ok(RawConn { stream })
    }

    /// WRITE: sends `data` and waits for the target's ack.
    pub fn write(&mut self, data: &[u8]) -> Result<()> {
        let header = Header::new(Cmd::Write, data.len() as u64).encode();
        write_all_vectored(&mut self.stream, &mut [IoSlice::new(&header), IoSlice::new(data)])?;
        self.expect_ok("write")
    }

    /// READ: asks for `buf.len()` bytes and reads them into `buf`.
    pub fn read(&mut self, buf: &mut [u8]) -> Result<()> {
        self.stream.write_all(&Header::new(Cmd::Read, buf.len() as u64).encode())?;
        self.stream.read_exact(buf).context("reading raw-tcp payload")?;
        Ok(())
    }

    /// A control request with an optional payload; returns the target's reply.
    pub fn call(&mut self, header: Header, payload: &[u8]) -> Result<Reply> {
        let header = header.encode();
        write_all_vectored(&mut self.stream, &mut [IoSlice::new(&header), IoSlice::new(payload)])?;
        let mut reply = [0u8; REPLY_LEN];
        self.stream.read_exact(&mut reply).context("reading the target's reply")?;
        Reply::decode(&reply).map_err(|e| anyhow!("target: {e}"))
    }

    /// GRANT: asks the target to grant `initiator` the `(offset, length)` ranges of its
    /// region; returns the grant token.
    pub fn grant(&mut self, initiator: &str, ranges: &[(u64, u64)]) -> Result<Vec<u8>> {
        let header = Header { cmd: Cmd::Grant, len: ranges.len() as u64, seed: initiator.len() as u64 };
        let mut payload = initiator.as_bytes().to_vec();
        payload.extend(encode_ranges(ranges));
        match self.call(header, &payload)? {
            Reply::Ok => {}
            other => bail!("the target refused the grant: {other:?} (its stderr says why)"),
        }
        let mut len = [0u8; 8];
        self.stream.read_exact(&mut len).context("reading the grant token's length")?;
        let len = u64::from_le_bytes(len);
        if len > MAX_TOKEN_BYTES {
            bail!("the target announced a {len}-byte grant token");
        }
        let mut token = vec![0u8; len as usize];
        self.stream.read_exact(&mut token).context("reading the grant token")?;
        Ok(token)
    }

    fn expect_ok(&mut self, what: &str) -> Result<()> {
        let mut reply = [0u8; REPLY_LEN];
        self.stream.read_exact(&mut reply).with_context(|| format!("reading the {what} ack"))?;
        match Reply::decode(&reply).map_err(|e| anyhow!("target: {e}"))? {
            Reply::Ok => Ok(()),
            other => bail!("target refused the {what}: {other:?}"),
        }
    }
}

/// Writes every slice (header and payload in one system call where the kernel allows).
fn write_all_vectored(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> Result<()> {
    while !slices.is_empty() {
        let written = stream.write_vectored(slices).context("writing to the target")?;
        if written == 0 {
            bail!("the target closed the connection");
        }
        IoSlice::advance_slices(&mut slices, written);
    }
    Ok(())
}

/// One thread of the baseline: its connection and its request-sized buffer.
#[derive(Debug)]
pub struct RawWorker {
    pub op: Op,
    pub conn: RawConn,
    pub buf: PageBuf,
}

/// One lane: the exchange blocks, so `post` moves the whole request.
impl Worker for RawWorker {
    fn post(&mut self, _lane: usize) -> Result<()> {
        match self.op {
            Op::Write => self.conn.write(&self.buf),
            Op::Read => self.conn.read(&mut self.buf),
        }
    }

    fn wait(&mut self, _lane: usize) -> Result<()> {
        Ok(())
    }
}

/// The baseline engine: the target's raw-tcp address.
#[derive(Debug)]
pub struct RawEngine {
    pub addr: String,
}

impl RawEngine {
    pub fn run(
        &self,
        case: &Case,
        plan: Plan,
        threads: u64,
        check: Option<u64>,
        progress: &ProgressBar,
    ) -> Result<Measurement> {
        let len = case.request_bytes() as usize;
        let mut workers = (0..threads)
            .map(|_| Ok(RawWorker { op: case.op, conn: RawConn::connect(&self.addr)?, buf: PageBuf::new(len) }))
            .collect::<Result<Vec<_>>>()?;
        if let Some(seed) = check {
            workers.iter_mut().try_for_each(|w| check::raw_prepare(w, seed))?;
        }
        let measured = measure(&mut workers, plan, progress)?;
        if let Some(seed) = check {
            for (thread, worker) in workers.iter_mut().enumerate() {
                check::raw_verify(worker, seed).with_context(|| format!("raw-tcp {} thread {thread}", case.label()))?;
            }
        }
        Ok(measured)
    }
}
