//! A blocking TCP connection whose every read and write is bounded: no progress for `timeout`
//! is an error, and a stop flag ends waits between frames promptly. With `tls=on` the same
//! bounded loops run over TLS 1.3 records ([`crate::tls_io`]), whose handshake is bounded the same way.
//! Reads go through a [read-ahead buffer](crate::readahead), so a small frame costs one read(2).

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::client::UnbufferedClientConnection;
use rustls::server::UnbufferedServerConnection;
use socket2::SockRef;

use crate::readahead::{self, Offer, ReadAhead};
use crate::spin::{SpinBudget, Spun};
use crate::tls_io::{self, TlsIo};

/// How often a blocked call wakes to check the stop flag and the progress deadline.
const POLL: Duration = Duration::from_millis(200);
/// A gap this long between two polls of a spin means another thread had the CPU meanwhile.
const PREEMPTED_GAP: Duration = Duration::from_micros(20);
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
    /// The TLS handshake failed, or a record did not decrypt (a peer without TLS, a wrong
    /// certificate, tampering).
    #[error("TLS: {0}")]
    Tls(io::Error),
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

/// The byte every TLS connection starts with (a handshake record).
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// The socket, and TLS records over it once the handshake is done.
#[derive(Debug)]
struct Stream {
    tcp: TcpStream,
    tls: Option<Box<TlsIo>>,
}

impl Stream {
    fn read_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        match &mut self.tls {
            Some(tls) => tls.read_vectored(&mut self.tcp, bufs),
            None => self.tcp.read_vectored(bufs),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match &mut self.tls {
            Some(tls) => tls.write_vectored(&mut self.tcp, bufs),
            None => self.tcp.write_vectored(bufs),
        }
    }
}

#[derive(Debug)]
pub struct Conn {
    stream: Stream,
    timeout: Duration,
    stop: Arc<AtomicBool>,
    /// How long a wait for a frame or an answer polls before it sleeps ([`crate::spin`]).
    spin: SpinBudget,
    /// Bytes read past what the last read asked for (plain text, after TLS).
    ahead: ReadAhead,
}

impl Conn {
    pub fn new(stream: TcpStream, timeout: Duration, stop: Arc<AtomicBool>) -> io::Result<Conn> {
        let poll = Some(POLL.min(timeout).max(Duration::from_millis(1)));
        stream.set_read_timeout(poll)?;
        stream.set_write_timeout(poll)?;
        Ok(Conn {
            stream: Stream { tcp: stream, tls: None },
            timeout,
            stop,
            spin: SpinBudget::new(Duration::ZERO),
            ahead: ReadAhead::new(readahead::CAPACITY),
        })
    }

    /// Lets waits for a frame or an answer poll for up to `max` before they sleep.
    /// Bytes read from the stream that no read has taken yet.
    pub fn buffered(&self) -> usize {
        self.ahead.buffered()
    }

    pub fn set_spin(&mut self, max: Duration) {
        self.spin = SpinBudget::new(max);
    }

    /// Runs the client side of a TLS handshake; every later read and write is encrypted.
    pub fn start_tls_client(&mut self, tls: UnbufferedClientConnection) -> Result<(), ConnError> {
        self.start_tls(tls)
    }

    /// Runs the server side of a TLS handshake. An initiator without TLS gets no handshake:
    /// `Ok(false)` says its first byte is no TLS record (the caller refuses it in plain text).
    pub fn start_tls_server(&mut self, tls: UnbufferedServerConnection) -> Result<bool, ConnError> {
        if !self.opens_with_tls()? {
            return Ok(false);
        }
        self.start_tls(tls)?;
        Ok(true)
    }

    /// Whether the peer's first byte opens a TLS handshake (a plain target refuses such an
    /// initiator in plain text, which its TLS client reports as a TLS error). A connection
    /// closed before any byte is left to the hello to report.
    pub fn opens_with_tls(&mut self) -> Result<bool, ConnError> {
        match self.peek_first_byte() {
            Ok(byte) => Ok(byte == TLS_HANDSHAKE_RECORD),
            Err(ConnError::Eof) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Waits, bounded by the progress timeout, for the first byte without consuming it.
    fn peek_first_byte(&mut self) -> Result<u8, ConnError> {
        let started = Instant::now();
        let mut byte = [0u8; 1];
        loop {
            match self.stream.tcp.peek(&mut byte) {
                Ok(0) => return Err(ConnError::Eof),
                Ok(_) => return Ok(byte[0]),
                Err(e) if is_retry(&e) => self.check_wait(started)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn start_tls(&mut self, tls: impl tls_io::Side) -> Result<(), ConnError> {
        if self.stream.tls.is_some() {
            return Err(ConnError::Tls(io::Error::other("TLS is already running on this connection")));
        }
        // The handshake reads the socket itself: plain bytes read ahead would be skipped.
        if self.ahead.buffered() > 0 {
            return Err(ConnError::Tls(io::Error::other("plain-text bytes arrived before the TLS handshake")));
        }
        let (stop, timeout) = (&self.stop, self.timeout);
        let io =
            tls_io::handshake(&mut self.stream.tcp, tls, |last_progress| check_deadline(stop, timeout, last_progress))?;
        self.stream.tls = Some(Box::new(io));
        Ok(())
    }

    /// Sends the records still held (after a write, before waiting for the answer).
    fn flush_tls(&mut self, mut last_progress: Instant) -> Result<(), ConnError> {
        let Stream { tcp, tls: Some(tls) } = &mut self.stream else { return Ok(()) };
        while tls.wants_write() {
            match tls.send_some(tcp) {
                Ok(_) => last_progress = Instant::now(),
                Err(e) if is_retry(&e) => check_deadline(&self.stop, self.timeout, last_progress)?,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
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
        if self.ahead.buffered() > 0 {
            // The frame has started already (read with the previous one).
            self.read_exact(buf)?;
            return Ok(true);
        }
        let (got, spun) = self.spin(buf, Offer::Buffer)?;
        self.spin.after_wait(spun);
        let first = match got {
            Some(n) => n,
            None => loop {
                if self.stopped() {
                    return Ok(false);
                }
                match self.read_some(&mut [IoSliceMut::new(buf)], Offer::Buffer) {
                    Ok(n) => break n,
                    Err(e) if is_retry(&e) => continue,
                    Err(e) => return Err(e.into()),
                }
            },
        };
        if first == 0 {
            return Ok(false);
        }
        self.read_exact(&mut buf[first..])?;
        Ok(true)
    }

    /// Reads an answer the peer is about to send (polling first, see [`crate::spin`]), bounded
    /// like [`Conn::read_exact`]; `offer`: whether what follows may land in the read-ahead
    /// buffer.
    pub fn read_answer(&mut self, buf: &mut [u8], offer: Offer) -> Result<(), ConnError> {
        let first = if self.ahead.buffered() > 0 {
            0
        } else {
            let (got, spun) = self.spin(buf, offer)?;
            self.spin.after_wait(spun);
            match got {
                Some(0) => return Err(ConnError::Eof),
                Some(n) => n,
                None => 0,
            }
        };
        self.read_exact_offering(&mut [IoSliceMut::new(&mut buf[first..])], offer)
    }

    /// Polls the socket without sleeping for up to the spin budget: `Some(n)` once `n` bytes
    /// were read into `buf` (0: the peer closed), `None` when nothing came (or spinning is
    /// off); and how the spin went. A spin that lost its CPU stops at once.
    fn spin(&mut self, buf: &mut [u8], offer: Offer) -> Result<(Option<usize>, Spun), ConnError> {
        let budget = self.spin.current();
        if budget.is_zero() || buf.is_empty() {
            return Ok((None, Spun::No));
        }
        self.stream.tcp.set_nonblocking(true)?;
        let started = Instant::now();
        let mut last_poll = started;
        let result = loop {
            match self.read_some(&mut [IoSliceMut::new(buf)], offer) {
                Ok(n) => break Ok((Some(n), Spun::Caught)),
                Err(e) if is_retry(&e) => {}
                Err(e) => break Err(ConnError::from(e)),
            }
            let now = Instant::now();
            let preempted = now.saturating_duration_since(last_poll) >= PREEMPTED_GAP;
            if preempted || now.saturating_duration_since(started) >= budget || self.stopped() {
                break Ok((None, Spun::Missed));
            }
            last_poll = now;
            std::hint::spin_loop();
        };
        let restored = self.stream.tcp.set_nonblocking(false);
        let got = result?;
        restored?;
        Ok(got)
    }

    /// One read into the front of `bufs`, from the read-ahead buffer or the stream (0: the
    /// peer closed).
    fn read_some(&mut self, bufs: &mut [IoSliceMut<'_>], offer: Offer) -> io::Result<usize> {
        let Conn { stream, ahead, .. } = self;
        ahead.read_into(bufs, offer, |iov| stream.read_vectored(iov))
    }

    pub fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), ConnError> {
        self.read_exact_vectored(&mut [IoSliceMut::new(buf)])
    }

    /// Fills every buffer in order.
    pub fn read_exact_vectored(&mut self, bufs: &mut [IoSliceMut<'_>]) -> Result<(), ConnError> {
        self.read_exact_offering(bufs, Offer::Buffer)
    }

    fn read_exact_offering(&mut self, mut bufs: &mut [IoSliceMut<'_>], offer: Offer) -> Result<(), ConnError> {
        IoSliceMut::advance_slices(&mut bufs, 0);
        let mut last_progress = Instant::now();
        while !bufs.is_empty() {
            let window = bufs.len().min(IOV_MAX);
            match self.read_some(&mut bufs[..window], offer) {
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
        self.flush_tls(last_progress)
    }

    fn check_wait(&self, last_progress: Instant) -> Result<(), ConnError> {
        check_deadline(&self.stop, self.timeout, last_progress)
    }

    /// Ends the sending side and discards what the peer still sends until it closes (bounded
    /// by the progress timeout), so the last bytes sent are not lost to a reset.
    pub fn drain_until_closed(&mut self) -> Result<(), ConnError> {
        let _ = self.stream.tcp.shutdown(std::net::Shutdown::Write);
        let started = Instant::now();
        let mut scratch = [0u8; 4096];
        loop {
            match self.stream.tcp.read(&mut scratch) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if is_retry(&e) => self.check_wait(started)?,
                Err(e) => return Err(e.into()),
            }
        }
    }

    pub fn shutdown(&self) {
        let _ = self.stream.tcp.shutdown(std::net::Shutdown::Both);
    }
}

fn check_deadline(stop: &AtomicBool, timeout: Duration, last_progress: Instant) -> Result<(), ConnError> {
    if stop.load(Ordering::Acquire) {
        return Err(ConnError::Stopped);
    }
    if last_progress.elapsed() >= timeout {
        return Err(ConnError::TimedOut(timeout));
    }
    Ok(())
}

/// A poll wake-up (or a signal): wait on unless stopped or out of time.
pub(crate) fn is_retry(e: &io::Error) -> bool {
    is_timeout(e) || e.kind() == io::ErrorKind::Interrupted
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}
