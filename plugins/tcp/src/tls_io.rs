//! The socket side of `tls=on`: the handshake, driven through rustls's unbuffered API, then
//! [records](crate::records) sealed into one send buffer and opened from one receive buffer. A
//! large payload thus costs one read(2) or write(2) per [`RECEIVE_BUFFER`] or
//! [`crate::tls::SEND_BUFFER`] bytes, not one per 16 KiB record. A record whose plaintext fits
//! the reader's next buffer is opened straight into it; others are opened in place and copied.

use std::io::{self, IoSlice, IoSliceMut, Read, Write};
use std::net::TcpStream;
use std::ops::Range;
use std::time::Instant;

use rustls::client::UnbufferedClientConnection;
use rustls::server::UnbufferedServerConnection;
use rustls::unbuffered::{ConnectionState, EncodeError, UnbufferedStatus};
use rustls::ExtractedSecrets;

use crate::conn::{is_retry, ConnError};
use crate::records::{self, Handshake, Opened, RecordError, Records, HEADER, MAX_BODY, MAX_FRAGMENT, OVERHEAD};
use crate::tls::SEND_BUFFER;

/// Ciphertext read at once: many records per read(2).
pub const RECEIVE_BUFFER: usize = 256 * 1024;
const _: () = assert!(RECEIVE_BUFFER >= HEADER + MAX_BODY);
/// Room for [`SEND_BUFFER`] bytes of plaintext in whole records, and a key update or two.
const SEND_ROOM: usize = SEND_BUFFER + (SEND_BUFFER / MAX_FRAGMENT + 4) * (OVERHEAD + 8);

/// rustls's unbuffered client or server, as the handshake drives it.
pub trait Side {
    type Data;
    fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data>;
    fn handshaking(&self) -> bool;
    fn finish(self) -> Result<(ExtractedSecrets, Handshake), rustls::Error>;
}

/// Both sides implement [`Side`] alike; only their types and [`Handshake`] variant differ.
macro_rules! side {
    ($conn:ty, $data:ty, $variant:ident) => {
        impl Side for $conn {
            type Data = $data;
            fn process<'c, 'i>(&'c mut self, incoming: &'i mut [u8]) -> UnbufferedStatus<'c, 'i, Self::Data> {
                self.process_tls_records(incoming)
            }
            fn handshaking(&self) -> bool {
                self.is_handshaking()
            }
            fn finish(self) -> Result<(ExtractedSecrets, Handshake), rustls::Error> {
                let (secrets, kernel) = self.dangerous_into_kernel_connection()?;
                Ok((secrets, Handshake::$variant(kernel)))
            }
        }
    };
}
side!(UnbufferedClientConnection, rustls::client::ClientConnectionData, Client);
side!(UnbufferedServerConnection, rustls::server::ServerConnectionData, Server);

/// What the handshake loop does after one step of rustls.
enum Next {
    Continue,
    Read,
    /// rustls could send application data: done unless the handshake still runs (a server may
    /// send before the client's Finished arrives).
    Writable,
}

/// Runs the handshake over `tcp`. `waited` is called after a read or write timed out, with the
/// time of the last progress, and fails once the caller's bound has run out.
pub fn handshake<S: Side>(
    tcp: &mut TcpStream,
    mut conn: S,
    mut waited: impl FnMut(Instant) -> Result<(), ConnError>,
) -> Result<TlsIo, ConnError> {
    let mut incoming = vec![0u8; RECEIVE_BUFFER];
    let mut filled = 0;
    let mut out = Vec::new();
    // Application data that arrived with the end of the handshake, opened by rustls.
    let mut early = Vec::new();
    let mut last_progress = Instant::now();
    loop {
        let status = conn.process(&mut incoming[..filled]);
        let mut discard = status.discard;
        let next = match status.state {
            Err(err) => {
                send_alert(tcp, &mut conn, &mut incoming[discard.min(filled)..filled]);
                return Err(tls_failed(err));
            }
            Ok(ConnectionState::EncodeTlsData(mut data)) => {
                encode(&mut out, |buf| data.encode(buf))?;
                Next::Continue
            }
            Ok(ConnectionState::TransmitTlsData(data)) => {
                write_all(tcp, &out, &mut last_progress, &mut waited)?;
                out.clear();
                data.done();
                Next::Continue
            }
            Ok(ConnectionState::BlockedHandshake) => Next::Read,
            Ok(ConnectionState::ReadTraffic(mut traffic)) => {
                while let Some(record) = traffic.next_record() {
                    let record = record.map_err(tls_failed)?;
                    discard += record.discard;
                    early.extend_from_slice(record.payload);
                }
                Next::Continue
            }
            Ok(ConnectionState::WriteTraffic(_)) => Next::Writable,
            Ok(ConnectionState::PeerClosed | ConnectionState::Closed) => return Err(ConnError::Eof),
            Ok(_) => return Err(protocol("unexpected state")),
        };
        incoming.copy_within(discard..filled, 0);
        filled -= discard;
        match next {
            Next::Continue => {}
            Next::Writable if !conn.handshaking() => break,
            Next::Read | Next::Writable => {
                if filled == incoming.len() {
                    return Err(protocol("handshake message over the receive buffer"));
                }
                match tcp.read(&mut incoming[filled..]) {
                    Ok(0) => return Err(ConnError::Eof),
                    Ok(n) => {
                        filled += n;
                        last_progress = Instant::now();
                    }
                    Err(e) if is_retry(&e) => waited(last_progress)?,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    let (secrets, side) = conn.finish().map_err(tls_failed)?;
    let records = Records::new(secrets, side).map_err(|e| ConnError::Tls(invalid_data(e)))?;
    // Early plaintext goes first, then the records read past the handshake.
    if !early.is_empty() {
        let mut buffer = Vec::with_capacity(early.len() + RECEIVE_BUFFER);
        buffer.extend_from_slice(&early);
        buffer.extend_from_slice(&incoming[..filled]);
        buffer.resize(early.len() + RECEIVE_BUFFER, 0);
        incoming = buffer;
    }
    Ok(TlsIo {
        records,
        incoming,
        plain: 0..early.len(),
        unopened: early.len()..early.len() + filled,
        outgoing: vec![0; SEND_ROOM],
        sealed: 0,
        sent: 0,
        peer_closed: false,
    })
}

/// Appends what `encode` writes to `out`, growing it as rustls asks.
fn encode(out: &mut Vec<u8>, mut encode: impl FnMut(&mut [u8]) -> Result<usize, EncodeError>) -> Result<(), ConnError> {
    let start = out.len();
    let mut room = 4096;
    loop {
        out.resize(start + room, 0);
        match encode(&mut out[start..]) {
            Ok(n) => {
                out.truncate(start + n);
                return Ok(());
            }
            Err(EncodeError::InsufficientSize(need)) if need.required_size > room => room = need.required_size,
            Err(_) => return Err(protocol("encoding a handshake message")),
        }
    }
}

/// Best effort: send the alert rustls queued after an error, so the peer learns why.
fn send_alert<S: Side>(tcp: &mut TcpStream, conn: &mut S, incoming: &mut [u8]) {
    let mut out = Vec::new();
    if let Ok(ConnectionState::EncodeTlsData(mut data)) = conn.process(incoming).state {
        if encode(&mut out, |buf| data.encode(buf)).is_ok() {
            let _ = tcp.write_all(&out);
        }
    }
}

fn write_all(
    tcp: &mut TcpStream,
    mut bytes: &[u8],
    last_progress: &mut Instant,
    waited: &mut impl FnMut(Instant) -> Result<(), ConnError>,
) -> Result<(), ConnError> {
    while !bytes.is_empty() {
        match tcp.write(bytes) {
            Ok(0) => return Err(ConnError::Eof),
            Ok(n) => {
                bytes = &bytes[n..];
                *last_progress = Instant::now();
            }
            Err(e) if is_retry(&e) => waited(*last_progress)?,
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// A connection's records once the handshake is done.
#[derive(Debug)]
pub struct TlsIo {
    records: Records,
    /// Ciphertext read from the socket; records are opened in place here.
    incoming: Vec<u8>,
    /// Opened plaintext not yet handed out, within `incoming`.
    plain: Range<usize>,
    /// Bytes of `incoming` read but not yet opened.
    unopened: Range<usize>,
    /// Sealed records in `outgoing[..sealed]`, sent up to `sent`.
    outgoing: Vec<u8>,
    sealed: usize,
    sent: usize,
    peer_closed: bool,
}

impl TlsIo {
    /// Reads plaintext into `bufs` (0: the peer closed). A timeout from the socket comes back
    /// as the error it is, with nothing lost.
    pub fn read_vectored(&mut self, tcp: &mut TcpStream, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
        loop {
            if !self.plain.is_empty() {
                return Ok(self.hand_out(bufs));
            }
            if self.peer_closed {
                return Ok(0);
            }
            if let Some(end) = self.whole_record().map_err(invalid_data)? {
                match self.open_record(end, bufs.first_mut().map(|buf| &mut **buf)).map_err(invalid_data)? {
                    Some(placed) if placed > 0 => return Ok(placed),
                    // Opened in place, or it held no data.
                    _ => continue,
                }
            }
            // A partial record at most is left: move it to the front and read behind it.
            if self.unopened.start > 0 {
                self.incoming.copy_within(self.unopened.clone(), 0);
                self.unopened = 0..self.unopened.len();
            }
            let got = tcp.read(&mut self.incoming[self.unopened.end..])?;
            if got == 0 {
                return match self.unopened.is_empty() {
                    true => Ok(0),
                    false => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed inside a TLS record")),
                };
            }
            self.unopened.end += got;
        }
    }

    fn hand_out(&mut self, bufs: &mut [IoSliceMut<'_>]) -> usize {
        let mut done = 0;
        for buf in bufs.iter_mut() {
            let plain = &self.incoming[self.plain.start + done..self.plain.end];
            if plain.is_empty() {
                break;
            }
            let n = buf.len().min(plain.len());
            buf[..n].copy_from_slice(&plain[..n]);
            done += n;
        }
        self.plain.start += done;
        done
    }

    /// The end of the next record in `incoming` if it is all there.
    fn whole_record(&self) -> Result<Option<usize>, RecordError> {
        let start = self.unopened.start;
        let Some(header) = self.incoming.get(start..start + HEADER).filter(|_| self.unopened.len() >= HEADER) else {
            return Ok(None);
        };
        let header: &[u8; HEADER] = header.try_into().map_err(|_| RecordError::Decrypt)?;
        let end = start + HEADER + records::body_len(header)?;
        Ok((end <= self.unopened.end).then_some(end))
    }

    /// Opens the next record, which ends at `end`: into `dest` when its plaintext fits there
    /// (`Some(bytes of data placed)`), else in place (`None`; its data is then in `plain`).
    fn open_record(&mut self, end: usize, dest: Option<&mut [u8]>) -> Result<Option<usize>, RecordError> {
        let start = self.unopened.start;
        self.unopened.start = end;
        let record = &mut self.incoming[start..end];
        let header: &[u8; HEADER] = record[..HEADER].try_into().map_err(|_| RecordError::Decrypt)?;
        let fits = Records::plaintext_len(header)?;
        if let Some(dest) = dest.filter(|dest| dest.len() >= fits) {
            return match self.records.open_into(record, dest)? {
                Opened::Data(range) => Ok(Some(range.len())),
                Opened::Closed => {
                    self.peer_closed = true;
                    Ok(Some(0))
                }
                Opened::Control => Ok(Some(0)),
            };
        }
        match self.records.open(record)? {
            Opened::Data(range) => self.plain = start + range.start..start + range.end,
            Opened::Closed => self.peer_closed = true,
            Opened::Control => {}
        }
        Ok(None)
    }

    /// Seals up to [`SEND_BUFFER`] bytes of `bufs` and sends what the socket takes now; the
    /// rest goes with the next call or [`TlsIo::send_some`]. Records sealed earlier go first.
    pub fn write_vectored(&mut self, tcp: &mut TcpStream, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        while self.wants_write() {
            self.send_some(tcp)?;
        }
        let (accepted, sealed) =
            self.records.seal(bufs.iter().map(|buf| &**buf), &mut self.outgoing).map_err(invalid_data)?;
        self.sealed = sealed;
        self.sent = 0;
        while self.wants_write() {
            match self.send_some(tcp) {
                Ok(_) => {}
                Err(e) if is_retry(&e) => break,
                Err(e) => return Err(e),
            }
        }
        Ok(accepted)
    }

    /// The record layer alone (tests that craft records).
    #[cfg(test)]
    pub fn into_records(self) -> Records {
        self.records
    }

    /// Whether sealed records wait to be sent.
    pub fn wants_write(&self) -> bool {
        self.sent < self.sealed
    }

    /// One write(2) of the sealed records not yet sent.
    pub fn send_some(&mut self, tcp: &mut TcpStream) -> io::Result<usize> {
        let n = tcp.write(&self.outgoing[self.sent..self.sealed])?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        self.sent += n;
        Ok(n)
    }
}

fn invalid_data(err: RecordError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, err)
}

/// A handshake the peer's certificate, messages or keys failed.
fn tls_failed(err: rustls::Error) -> ConnError {
    ConnError::Tls(io::Error::new(io::ErrorKind::InvalidData, err))
}

fn protocol(what: &'static str) -> ConnError {
    ConnError::Tls(io::Error::other(format!("TLS handshake: {what}")))
}

#[cfg(test)]
pub(crate) mod tests {
    //! Our records against rustls's own record layer on the other end of a loopback socket: each
    //! side must read exactly what the other wrote, across key updates in both directions.
    use std::net::TcpListener;
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::tls::{self, TlsIdentity};

    const BOUND: Duration = Duration::from_secs(10);

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 10) as u8).collect()
    }

    pub(crate) fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        for s in [&client, &server] {
            s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
            s.set_write_timeout(Some(Duration::from_millis(100))).unwrap();
        }
        (client, server)
    }

    pub(crate) fn bounded(last_progress: Instant) -> Result<(), ConnError> {
        match last_progress.elapsed() < BOUND {
            true => Ok(()),
            false => Err(ConnError::TimedOut(BOUND)),
        }
    }

    fn read_exact(io: &mut TlsIo, tcp: &mut TcpStream, mut buf: &mut [u8]) -> io::Result<()> {
        let started = Instant::now();
        while !buf.is_empty() {
            match io.read_vectored(tcp, &mut [IoSliceMut::new(buf)]) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => buf = &mut buf[n..],
                Err(e) if is_retry(&e) && started.elapsed() < BOUND => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all(io: &mut TlsIo, tcp: &mut TcpStream, pieces: &[&[u8]]) {
        let mut slices: Vec<IoSlice<'_>> = pieces.iter().map(|p| IoSlice::new(p)).collect();
        let mut bufs = &mut slices[..];
        while !bufs.is_empty() {
            match io.write_vectored(tcp, bufs) {
                Ok(n) => IoSlice::advance_slices(&mut bufs, n),
                Err(e) if is_retry(&e) => {}
                Err(e) => panic!("write: {e}"),
            }
        }
        while io.wants_write() {
            match io.send_some(tcp) {
                Ok(_) => {}
                Err(e) if is_retry(&e) => {}
                Err(e) => panic!("flush: {e}"),
            }
        }
    }

    /// Our client against a rustls server with its own record layer, which reads `inbound`
    /// bytes, asks for a key update, sends `outbound` bytes and closes with close_notify.
    fn against_rustls_server(tx_limit: Option<u64>) {
        let identity = TlsIdentity::generate().unwrap();
        let config = identity.client_config(identity.fingerprint).unwrap();
        let (mut client, mut server) = socket_pair();
        let inbound = pattern(3 << 20, 7);
        let outbound = pattern((2 << 20) + 12345, 99);
        let (expect_in, send_out) = (inbound.clone(), outbound.clone());
        let server_config = identity.server_config();
        let peer = std::thread::spawn(move || {
            server.set_read_timeout(Some(BOUND)).unwrap();
            server.set_write_timeout(Some(BOUND)).unwrap();
            let mut conn = rustls::ServerConnection::new(Arc::clone(&server_config)).unwrap();
            let mut stream = rustls::Stream::new(&mut conn, &mut server);
            let mut got = vec![0u8; expect_in.len()];
            stream.read_exact(&mut got).unwrap();
            assert!(got == expect_in, "the rustls server read other bytes than ours sealed");
            stream.conn.refresh_traffic_keys().unwrap();
            stream.write_all(&send_out).unwrap();
            // Our side answers the key update before its next data: rustls must open it.
            let mut tail = [0u8; 5];
            stream.read_exact(&mut tail).unwrap();
            assert_eq!(&tail, b"after");
            stream.conn.send_close_notify();
            stream.flush().unwrap();
        });
        let conn = tls::connect(&config).unwrap();
        let mut io = handshake(&mut client, conn, bounded).unwrap();
        if let Some(limit) = tx_limit {
            io.records.set_tx_limit(limit);
        }
        // Pieces that cut across record boundaries.
        let (a, rest) = inbound.split_at(1);
        let (b, c) = rest.split_at(20_000);
        write_all(&mut io, &mut client, &[a, b, &[], c]);
        let mut got = vec![0u8; outbound.len()];
        read_exact(&mut io, &mut client, &mut got).unwrap();
        assert!(got == outbound, "we opened other bytes than rustls sealed");
        write_all(&mut io, &mut client, &[b"after"]);
        let mut end = [0u8; 1];
        let started = Instant::now();
        let closed = loop {
            match io.read_vectored(&mut client, &mut [IoSliceMut::new(&mut end)]) {
                Err(e) if is_retry(&e) && started.elapsed() < BOUND => {}
                other => break other.unwrap(),
            }
        };
        assert_eq!(closed, 0, "close_notify reads as the end");
        peer.join().unwrap();
        let (sent, received) = io.records.key_updates();
        assert_eq!(received, 1, "the server's key update");
        match tx_limit {
            // The one the server asked for.
            None => assert_eq!(sent, 1),
            // 3 MiB in 16 KiB records is 192 records: a new key every 7, and the one asked for.
            Some(limit) => assert!(u64::from(sent) >= 192 / limit, "{sent} key updates sent"),
        }
    }

    #[test]
    fn our_records_and_rustls_records_read_each_other() {
        against_rustls_server(None);
    }

    #[test]
    fn key_updates_both_ways_keep_the_stream_intact() {
        // A new key every 7 records of ours, and one asked for by the rustls server.
        against_rustls_server(Some(7));
    }

    #[test]
    fn a_tampered_record_fails_and_nothing_is_handed_out() {
        let identity = TlsIdentity::generate().unwrap();
        let config = identity.client_config(identity.fingerprint).unwrap();
        let (mut client, mut server) = socket_pair();
        let server_config = identity.server_config();
        let peer = std::thread::spawn(move || {
            let mut conn = rustls::ServerConnection::new(server_config).unwrap();
            server.set_read_timeout(Some(BOUND)).unwrap();
            while conn.is_handshaking() {
                conn.complete_io(&mut server).unwrap();
            }
            conn.writer().write_all(&pattern(40_000, 3)).unwrap();
            let mut sealed = Vec::new();
            while conn.wants_write() {
                conn.write_tls(&mut sealed).unwrap();
            }
            // Flip one bit in the second record's body.
            let second = 5 + usize::from(u16::from_be_bytes([sealed[3], sealed[4]]));
            sealed[second + 5 + 100] ^= 1;
            server.write_all(&sealed).unwrap();
            server
        });
        let conn = tls::connect(&config).unwrap();
        let mut io = handshake(&mut client, conn, bounded).unwrap();
        let mut got = vec![0u8; 40_000];
        let mut handed_out = 0;
        let started = Instant::now();
        let err = loop {
            match io.read_vectored(&mut client, &mut [IoSliceMut::new(&mut got[handed_out..])]) {
                Ok(0) => panic!("the stream ended instead of failing"),
                Ok(n) => handed_out += n,
                Err(e) if is_retry(&e) && started.elapsed() < BOUND => {}
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        // The destination of a record that fails to open holds undefined bytes, but none of
        // them is counted as read.
        assert_eq!(handed_out, 16_384, "exactly the first record is handed out");
        assert!(got[..16_384] == pattern(40_000, 3)[..16_384], "the first record is intact");
        drop(peer.join().unwrap());
    }
}
