//! A blocking TCP connection whose every read and write is bounded: no progress for `timeout`
//! is an error, and a stop flag ends waits between frames promptly.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use socket2::SockRef;

/// How often a blocked call wakes to check the stop flag and the progress deadline.
const POLL: Duration = Duration::from_millis(200);
/// Linux refuses more iovecs than this in one call.
const IOV_MAX: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    #[error("connection closed by peer")]
    Eof,
    #[error("no progress for {0:?}")]
    TimedOut(Duration),
    #[error("stopped")]
    Stopped,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// Socket tuning shared by both ends.
#[derive(Clone, Copy, Debug)]
pub struct SocketTuning {
    pub buffer_bytes: Option<usize>,
}

pub fn tune(stream: &TcpStream, tuning: SocketTuning) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let sock = SockRef::from(stream);
    sock.set_keepalive(true)?;
    if let Some(bytes) = tuning.buffer_bytes {
        sock.set_send_buffer_size(bytes)?;
        sock.set_recv_buffer_size(bytes)?;
    }
    Ok(())
}

#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    timeout: Duration,
    stop: Arc<AtomicBool>,
}

impl Conn {
    pub fn new(stream: TcpStream, timeout: Duration, stop: Arc<AtomicBool>) -> io::Result<Conn> {
        let poll = Some(POLL.min(timeout).max(Duration::from_millis(1)));
        stream.set_read_timeout(poll)?;
        stream.set_write_timeout(poll)?;
        Ok(Conn { stream, timeout, stop })
    }

    pub fn connect(
        addr: SocketAddr,
        connect_timeout: Duration,
        timeout: Duration,
        tuning: SocketTuning,
        stop: Arc<AtomicBool>,
    ) -> Result<Conn, ConnError> {
        let stream = TcpStream::connect_timeout(&addr, connect_timeout)?;
        tune(&stream, tuning)?;
        Ok(Conn::new(stream, timeout, stop)?)
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Waits for the first bytes of the next frame and reads it whole: `Ok(false)` on a clean
    /// close or a stop while idle. Idle time before the frame is unbounded (a pooled connection
    /// may wait for work); once a frame has started, the progress bound applies.
    pub fn read_frame_start(&mut self, buf: &mut [u8]) -> Result<bool, ConnError> {
        loop {
            if self.stopped() {
                return Ok(false);
            }
            match self.stream.read(buf) {
                Ok(0) => return Ok(false),
                Ok(n) => {
                    self.read_exact(&mut buf[n..])?;
                    return Ok(true);
                }
                Err(e) if is_timeout(&e) => continue,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }

    pub fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ConnError> {
        self.read_exact_vectored(&mut [IoSliceMut::new(buf)])
    }

    /// Fills every buffer in order.
    pub fn read_exact_vectored(&mut self, mut bufs: &mut [IoSliceMut<'_>]) -> Result<(), ConnError> {
        IoSliceMut::advance_slices(&mut bufs, 0);
        let mut last_progress = Instant::now();
        while !bufs.is_empty() {
            let window = bufs.len().min(IOV_MAX);
            match self.stream.read_vectored(&mut bufs[..window]) {
                Ok(0) => return Err(ConnError::Eof),
                Ok(n) => {
                    IoSliceMut::advance_slices(&mut bufs, n);
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {
                    self.check_wait(last_progress)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Reads and discards `len` bytes (the payload of a refused WRITE), keeping the stream in
    /// step.
    pub fn discard(&mut self, mut len: u64) -> Result<(), ConnError> {
        let mut scratch = vec![0u8; 64 * 1024];
        while len > 0 {
            let n = len.min(scratch.len() as u64) as usize;
            self.read_exact(&mut scratch[..n])?;
            len -= n as u64;
        }
        Ok(())
    }

    pub fn write_all(&mut self, buf: &[u8]) -> Result<(), ConnError> {
        self.write_all_vectored(&mut [IoSlice::new(buf)])
    }

    /// Writes every buffer in order.
    pub fn write_all_vectored(&mut self, mut bufs: &mut [IoSlice<'_>]) -> Result<(), ConnError> {
        IoSlice::advance_slices(&mut bufs, 0);
        let mut last_progress = Instant::now();
        while !bufs.is_empty() {
            let window = bufs.len().min(IOV_MAX);
            match self.stream.write_vectored(&bufs[..window]) {
                Ok(0) => return Err(ConnError::Eof),
                Ok(n) => {
                    IoSlice::advance_slices(&mut bufs, n);
                    last_progress = Instant::now();
                }
                Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {
                    self.check_wait(last_progress)?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    fn check_wait(&self, last_progress: Instant) -> Result<(), ConnError> {
        if self.stopped() {
            return Err(ConnError::Stopped);
        }
        if last_progress.elapsed() >= self.timeout {
            return Err(ConnError::TimedOut(self.timeout));
        }
        Ok(())
    }

    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}
