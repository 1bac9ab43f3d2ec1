//! TLS 1.3 records after the handshake, sealed and opened here rather than in rustls (the way
//! kernel TLS takes over from a user-space handshake). rustls runs the handshake and hands over
//! the traffic keys and a [`KernelConnection`] for key updates; this layer then seals many
//! records into one send buffer and opens them from one receive buffer. That costs one system
//! call per large read or write instead of one per 16 KiB record, and no allocation per record.
//! A large payload is sealed straight from its memory into the send buffer, and opened straight
//! from the receive buffer into its destination, so its bytes are never copied in user space;
//! aws-lc's AEAD does this out of place, and its AES-GCM uses AVX-512 where the CPU has it (about
//! 1.8 × ring's per byte here). The records are standard TLS 1.3 (RFC 8446 §5), so a peer that
//! runs rustls's own record layer reads and writes them unchanged.
//!
//! Pure code: buffers in, buffers out; the socket stays with the caller.

use std::ops::Range;

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey, NONCE_LEN};
use rustls::client::ClientConnectionData;
use rustls::kernel::KernelConnection;
use rustls::server::ServerConnectionData;
use rustls::{ConnectionTrafficSecrets, ExtractedSecrets};

/// Bytes of a record's header: content type, legacy version, body length.
pub const HEADER: usize = 5;
/// Most plaintext one record carries.
pub const MAX_FRAGMENT: usize = 1 << 14;
/// Longest body a peer may send: the fragment, its content type and padding, and the tag
/// (RFC 8446 §5.2 allows 2^14 + 256).
pub const MAX_BODY: usize = MAX_FRAGMENT + 256;
const TAG: usize = 16;
/// What a record adds to its plaintext: header, content type, tag.
pub const OVERHEAD: usize = HEADER + 1 + TAG;
/// A piece at least this long is sealed from where it lies; shorter ones are gathered into one
/// record by copying.
const SEAL_IN_PLACE_BELOW: usize = 4096;

/// Content types (RFC 8446 §5.1).
pub const ALERT: u8 = 21;
pub const HANDSHAKE: u8 = 22;
pub const APPLICATION_DATA: u8 = 23;
const LEGACY_VERSION: [u8; 2] = [3, 3];
const NEW_SESSION_TICKET: u8 = 4;
const KEY_UPDATE: u8 = 24;
const CLOSE_NOTIFY: u8 = 0;
/// A KeyUpdate that asks nothing of the peer.
pub const KEY_UPDATE_NOT_REQUESTED: [u8; 5] = [KEY_UPDATE, 0, 0, 1, 0];
const KEY_UPDATE_RECORD: usize = KEY_UPDATE_NOT_REQUESTED.len() + OVERHEAD;

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("record header {0:02x?} is not a TLS 1.3 protected record")]
    BadHeader([u8; HEADER]),
    #[error("record body of {0} bytes is over the limit")]
    TooLong(usize),
    #[error("a record did not decrypt (tampered, or not from the peer)")]
    Decrypt,
    #[error("sealing a record failed")]
    Seal,
    /// A fatal alert: e.g. 116 (certificate required) or 48 (unknown CA) from a mutual-TLS
    /// target that refused this initiator's certificate.
    #[error("the peer sent TLS alert {0} ({name:?})", name = rustls::AlertDescription::from(*.0))]
    Alert(u8),
    #[error("the peer sent a malformed or unexpected {0} message after the handshake")]
    Unexpected(&'static str),
    #[error("cipher suite {0:?} is not one this layer seals")]
    UnsupportedSuite(rustls::CipherSuite),
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The side of the connection rustls keeps for key updates and tickets.
pub(crate) enum Handshake {
    Client(KernelConnection<ClientConnectionData>),
    Server(KernelConnection<ServerConnectionData>),
}

impl Handshake {
    fn update_tx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Handshake::Client(kernel) => kernel.update_tx_secret(),
            Handshake::Server(kernel) => kernel.update_tx_secret(),
        }
    }

    fn update_rx(&mut self) -> Result<(u64, ConnectionTrafficSecrets), rustls::Error> {
        match self {
            Handshake::Client(kernel) => kernel.update_rx_secret(),
            Handshake::Server(kernel) => kernel.update_rx_secret(),
        }
    }

    fn new_session_ticket(&mut self, payload: &[u8]) -> Result<(), rustls::Error> {
        match self {
            Handshake::Client(kernel) => kernel.handle_new_session_ticket(payload),
            // Only servers send tickets.
            Handshake::Server(_) => Err(rustls::Error::General("a client sent a session ticket".into())),
        }
    }

    fn confidentiality_limit(&self) -> u64 {
        let suite = match self {
            Handshake::Client(kernel) => kernel.negotiated_cipher_suite(),
            Handshake::Server(kernel) => kernel.negotiated_cipher_suite(),
        };
        suite.tls13().map_or(u64::MAX, |suite| suite.common.confidentiality_limit)
    }
}

/// One direction's key and the sequence number of its next record.
struct Direction {
    key: LessSafeKey,
    iv: [u8; NONCE_LEN],
    seq: u64,
}

impl Direction {
    fn new((seq, secrets): (u64, ConnectionTrafficSecrets)) -> Result<Direction, RecordError> {
        let (algorithm, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&aead::AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&aead::AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&aead::CHACHA20_POLY1305, key, iv),
            _ => return Err(RecordError::UnsupportedSuite(rustls::CipherSuite::Unknown(0))),
        };
        let key = UnboundKey::new(algorithm, key.as_ref()).map_err(|_| RecordError::Seal)?;
        let iv = iv.as_ref().try_into().map_err(|_| RecordError::Seal)?;
        Ok(Direction { key: LessSafeKey::new(key), iv, seq })
    }

    /// The per-record nonce: the IV with the sequence number folded into its last 8 bytes.
    fn next_nonce(&mut self) -> Nonce {
        let mut nonce = self.iv;
        for (byte, seq) in nonce[NONCE_LEN - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *byte ^= seq;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(nonce)
    }
}

/// What one opened record held.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Opened {
    /// Application data, at this range of the buffer it was opened in (possibly empty).
    Data(Range<usize>),
    /// The peer's close_notify: no more data will come.
    Closed,
    /// A key update or a session ticket, handled here.
    Control,
}

/// Both directions' record protection for one connection.
pub(crate) struct Records {
    tx: Direction,
    rx: Direction,
    handshake: Handshake,
    /// Records sent under one key before it is replaced (the suite's confidentiality limit).
    tx_limit: u64,
    /// The peer asked for our key to be updated too: done before our next record.
    owe_key_update: bool,
    /// Keys replaced so far, sending and receiving.
    updates: (u32, u32),
}

impl Records {
    pub fn new(secrets: ExtractedSecrets, handshake: Handshake) -> Result<Records, RecordError> {
        let tx_limit = handshake.confidentiality_limit();
        Ok(Records {
            tx: Direction::new(secrets.tx)?,
            rx: Direction::new(secrets.rx)?,
            handshake,
            tx_limit,
            owe_key_update: false,
            updates: (0, 0),
        })
    }

    /// Replaces the key after this many records instead of the suite's limit (tests).
    #[cfg(test)]
    pub fn set_tx_limit(&mut self, records: u64) {
        self.tx_limit = records;
    }

    /// Keys replaced so far: (sending, receiving).
    #[cfg(test)]
    pub fn key_updates(&self) -> (u32, u32) {
        self.updates
    }

    /// Seals records carrying the front of `pieces`, in order, into `out`, as many as fit:
    /// returns the plaintext bytes sealed and the bytes of `out` written. Each record carries up
    /// to [`MAX_FRAGMENT`] bytes; short pieces are gathered into one record.
    pub fn seal<'a>(
        &mut self,
        pieces: impl IntoIterator<Item = &'a [u8]>,
        out: &mut [u8],
    ) -> Result<(usize, usize), RecordError> {
        let mut pieces = pieces.into_iter().filter(|p| !p.is_empty()).peekable();
        let mut current: &[u8] = &[];
        let (mut sealed, mut written) = (0, 0);
        loop {
            if current.is_empty() {
                match pieces.next() {
                    Some(piece) => current = piece,
                    None => break,
                }
            }
            let room = (out.len() - written).saturating_sub(KEY_UPDATE_RECORD + OVERHEAD).min(MAX_FRAGMENT);
            if room == 0 {
                break;
            }
            written += self.key_update_if_due(&mut out[written..])?;
            let out = &mut out[written..];
            if current.len() >= SEAL_IN_PLACE_BELOW {
                let (now, later) = current.split_at(room.min(current.len()));
                written += self.seal_from(now, APPLICATION_DATA, out)?;
                sealed += now.len();
                current = later;
                continue;
            }
            // Gather short pieces (and the start of a long one after them) into one record.
            let mut len = 0;
            while len < room {
                if current.is_empty() {
                    match pieces.next() {
                        Some(piece) => current = piece,
                        None => break,
                    }
                }
                let (now, later) = current.split_at((room - len).min(current.len()));
                out[HEADER + len..HEADER + len + now.len()].copy_from_slice(now);
                len += now.len();
                current = later;
            }
            written += self.seal_placed(len, APPLICATION_DATA, out)?;
            sealed += len;
        }
        Ok((sealed, written))
    }

    /// Writes the key update that is due, if one is, and switches to the new key.
    fn key_update_if_due(&mut self, out: &mut [u8]) -> Result<usize, RecordError> {
        if !self.owe_key_update && self.tx.seq < self.tx_limit {
            return Ok(0);
        }
        let written = self.seal_from(&KEY_UPDATE_NOT_REQUESTED, HANDSHAKE, out)?;
        self.tx = Direction::new(self.handshake.update_tx()?)?;
        self.owe_key_update = false;
        self.updates.0 += 1;
        Ok(written)
    }

    /// Seals `plaintext` from where it lies into a record at the front of `out`.
    fn seal_from(&mut self, plaintext: &[u8], content_type: u8, out: &mut [u8]) -> Result<usize, RecordError> {
        let header = record_header(plaintext.len())?;
        let total = plaintext.len() + OVERHEAD;
        let record = out.get_mut(..total).ok_or(RecordError::TooLong(total))?;
        record[..HEADER].copy_from_slice(&header);
        let (ciphertext, type_and_tag) = record[HEADER..].split_at_mut(plaintext.len());
        let nonce = self.tx.next_nonce();
        self.tx
            .key
            .seal_out_of_place_scatter(nonce, Aad::from(header), plaintext, ciphertext, &[content_type], type_and_tag)
            .map_err(|_| RecordError::Seal)?;
        Ok(total)
    }

    /// Seals the `len` bytes already placed after the header space at the front of `out`.
    fn seal_placed(&mut self, len: usize, content_type: u8, out: &mut [u8]) -> Result<usize, RecordError> {
        let header = record_header(len)?;
        let total = len + OVERHEAD;
        let record = out.get_mut(..total).ok_or(RecordError::TooLong(total))?;
        record[..HEADER].copy_from_slice(&header);
        let (plaintext, type_and_tag) = record[HEADER..].split_at_mut(len);
        let nonce = self.tx.next_nonce();
        self.tx
            .key
            .seal_in_place_scatter(nonce, Aad::from(header), plaintext, &[content_type], type_and_tag)
            .map_err(|_| RecordError::Seal)?;
        Ok(total)
    }

    /// How many bytes a whole record's plaintext takes, content type and padding included:
    /// [`Records::open_into`] needs that much room.
    pub fn plaintext_len(header: &[u8; HEADER]) -> Result<usize, RecordError> {
        Ok(body_len(header)? - TAG)
    }

    /// Opens one whole record (header and body) in place: data comes back as a range of
    /// `record`.
    pub fn open(&mut self, record: &mut [u8]) -> Result<Opened, RecordError> {
        let (header, body) = Records::split(record)?;
        let nonce = self.rx.next_nonce();
        let plaintext = self.rx.key.open_in_place(nonce, Aad::from(header), body).map_err(|_| RecordError::Decrypt)?;
        match self.take_content(plaintext)? {
            Opened::Data(range) => Ok(Opened::Data(HEADER + range.start..HEADER + range.end)),
            other => Ok(other),
        }
    }

    /// Opens one whole record straight into `dest`, which needs
    /// [`Records::plaintext_len`] bytes: data comes back as a range of `dest`. If the record
    /// fails to open, `dest` holds undefined bytes (and the connection is done).
    pub fn open_into(&mut self, record: &mut [u8], dest: &mut [u8]) -> Result<Opened, RecordError> {
        let (header, body) = Records::split(record)?;
        let (ciphertext, tag) = body.split_at(body.len() - TAG);
        let dest = dest.get_mut(..ciphertext.len()).ok_or(RecordError::TooLong(ciphertext.len()))?;
        let nonce = self.rx.next_nonce();
        self.rx
            .key
            .open_separate_gather(nonce, Aad::from(header), ciphertext, tag, dest)
            .map_err(|_| RecordError::Decrypt)?;
        self.take_content(dest)
    }

    /// A record's header, and its body (ciphertext and tag).
    fn split(record: &mut [u8]) -> Result<([u8; HEADER], &mut [u8]), RecordError> {
        let header: [u8; HEADER] = record.get(..HEADER).and_then(|h| h.try_into().ok()).ok_or(RecordError::Decrypt)?;
        let body_len = body_len(&header)?;
        let body = record.get_mut(HEADER..HEADER + body_len).ok_or(RecordError::TooLong(body_len))?;
        Ok((header, body))
    }

    /// Acts on an opened record's plaintext: data is left where it is, key updates and
    /// tickets go to rustls's side.
    fn take_content(&mut self, plaintext: &[u8]) -> Result<Opened, RecordError> {
        match decode_plaintext(plaintext)? {
            Content::Data(len) => Ok(Opened::Data(0..len)),
            Content::Closed => Ok(Opened::Closed),
            Content::Messages(messages) => {
                for message in messages {
                    match message? {
                        Message::KeyUpdate { peer_asks_ours } => {
                            self.rx = Direction::new(self.handshake.update_rx()?)?;
                            self.owe_key_update |= peer_asks_ours;
                            self.updates.1 += 1;
                        }
                        Message::Ticket(body) => self.handshake.new_session_ticket(body)?,
                    }
                }
                Ok(Opened::Control)
            }
        }
    }
}

/// The header of a record with `plaintext` bytes of content.
pub fn record_header(plaintext: usize) -> Result<[u8; HEADER], RecordError> {
    let body = plaintext + 1 + TAG;
    let len = u16::try_from(body).map_err(|_| RecordError::TooLong(body))?;
    let [high, low] = len.to_be_bytes();
    Ok([APPLICATION_DATA, LEGACY_VERSION[0], LEGACY_VERSION[1], high, low])
}

/// The body length a record header announces, checked (pure: the fuzz target `tls_records`
/// drives it).
pub fn body_len(header: &[u8; HEADER]) -> Result<usize, RecordError> {
    // After the handshake every record is protected, so its outer type is application data.
    if header[0] != APPLICATION_DATA || header[1..3] != LEGACY_VERSION {
        return Err(RecordError::BadHeader(*header));
    }
    let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
    if len > MAX_BODY {
        return Err(RecordError::TooLong(len));
    }
    if len < TAG + 1 {
        return Err(RecordError::BadHeader(*header));
    }
    Ok(len)
}

/// What an opened record's plaintext (content, content type, padding) holds.
#[derive(Debug)]
pub enum Content<'a> {
    /// Application data: the plaintext's first this many bytes.
    Data(usize),
    /// The peer's close_notify.
    Closed,
    /// Handshake messages after the handshake.
    Messages(Messages<'a>),
}

/// Reads an opened record's plaintext (pure: the fuzz target `tls_records` drives it).
pub fn decode_plaintext(plaintext: &[u8]) -> Result<Content<'_>, RecordError> {
    // Padding is zeros after the content type (RFC 8446 §5.4).
    let typed_len = plaintext.iter().rposition(|&b| b != 0).ok_or(RecordError::Unexpected("empty"))?;
    let content = &plaintext[..typed_len];
    match plaintext[typed_len] {
        APPLICATION_DATA => Ok(Content::Data(typed_len)),
        ALERT => match content {
            [_, CLOSE_NOTIFY] => Ok(Content::Closed),
            [_, description] => Err(RecordError::Alert(*description)),
            _ => Err(RecordError::Unexpected("alert")),
        },
        HANDSHAKE => Ok(Content::Messages(Messages(content))),
        _ => Err(RecordError::Unexpected("record")),
    }
}

/// A handshake message after the handshake.
#[derive(Debug, PartialEq, Eq)]
pub enum Message<'a> {
    /// The peer's key changes; it may ask for ours to change too.
    KeyUpdate { peer_asks_ours: bool },
    /// A session ticket's body.
    Ticket(&'a [u8]),
}

/// The handshake messages of one record, each whole within it; iteration ends at the first
/// error.
#[derive(Debug)]
pub struct Messages<'a>(&'a [u8]);

impl<'a> Iterator for Messages<'a> {
    type Item = Result<Message<'a>, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        let bytes = std::mem::take(&mut self.0);
        let [kind, a, b, c, rest @ ..] = bytes else {
            return (!bytes.is_empty()).then_some(Err(RecordError::Unexpected("handshake")));
        };
        let len = usize::from(*a) << 16 | usize::from(*b) << 8 | usize::from(*c);
        if rest.len() < len {
            return Some(Err(RecordError::Unexpected("handshake")));
        }
        let (body, after) = rest.split_at(len);
        let message = match (*kind, body) {
            (KEY_UPDATE, [request @ (0 | 1)]) => Message::KeyUpdate { peer_asks_ours: *request == 1 },
            (KEY_UPDATE, _) => return Some(Err(RecordError::Unexpected("key update"))),
            (NEW_SESSION_TICKET, _) => Message::Ticket(body),
            _ => return Some(Err(RecordError::Unexpected("handshake"))),
        };
        self.0 = after;
        Some(Ok(message))
    }
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("tx_seq", &self.tx.seq)
            .field("rx_seq", &self.rx.seq)
            .field("key_updates", &self.updates)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    //! Records a peer with the keys could send that are not what this layer expects: each is a
    //! typed error, never a panic. Both ends are ours, keyed by a real handshake.
    use super::*;
    use crate::tls::{self, TlsIdentity};
    use crate::tls_io::{handshake, tests::bounded, tests::socket_pair};

    fn keyed_pair() -> (Records, Records) {
        let identity = TlsIdentity::generate().unwrap();
        let config = identity.client_config(identity.fingerprint).unwrap();
        let (mut client, mut server) = socket_pair();
        let accept = identity.accept().unwrap();
        let server_side = std::thread::spawn(move || handshake(&mut server, accept, bounded).unwrap().into_records());
        let client_side = handshake(&mut client, tls::connect(&config).unwrap(), bounded).unwrap().into_records();
        (client_side, server_side.join().unwrap())
    }

    /// Seals `plaintext` (content type and padding included) as one record and opens it.
    fn deliver(from: &mut Records, to: &mut Records, plaintext: &[u8]) -> Result<Opened, RecordError> {
        let (content, content_type) = plaintext.split_at(plaintext.len() - 1);
        let mut record = vec![0u8; plaintext.len() + OVERHEAD];
        from.seal_from(content, content_type[0], &mut record).unwrap();
        to.open(&mut record)
    }

    #[test]
    fn malformed_records_from_a_keyed_peer_are_typed_errors() {
        let (mut client, mut server) = keyed_pair();
        let data = deliver(&mut client, &mut server, b"hello\x17\0\0").unwrap();
        assert_eq!(data, Opened::Data(HEADER..HEADER + 5), "padding after the type is dropped");
        let cases: &[(&[u8], &str)] = &[
            (b"\0\0\0\0", "all padding, no content type"),
            (b"x\x63", "an unknown content type"),
            (b"\x02\x15", "an alert of one byte"),
            (b"\x18\0\0\x05\x01\x16", "a handshake message longer than its record"),
            (b"\x18\0\0\x01\x07\x16", "a key update asking for value 7"),
            (b"\x01\0\0\0\x16", "a handshake message other than key update or ticket"),
            (b"\x04\0\0\0\x16", "a session ticket sent by a client"),
            (b"\x18\0\x16", "a cut handshake header"),
        ];
        for (plaintext, what) in cases {
            // Each case on fresh keys: a failed open may leave the direction out of step.
            let (mut client, mut server) = keyed_pair();
            let result = deliver(&mut client, &mut server, plaintext);
            assert!(result.is_err(), "{what}: {result:?}");
        }
        let (mut client, mut server) = keyed_pair();
        assert!(matches!(deliver(&mut client, &mut server, b"\x02\x28\x15"), Err(RecordError::Alert(40))));
        assert_eq!(deliver(&mut client, &mut server, b"\x01\x00\x15").unwrap(), Opened::Closed);
    }

    #[test]
    fn headers_out_of_range_are_refused_before_any_work() {
        assert!(body_len(&[APPLICATION_DATA, 3, 3, 0x48, 0x01]).is_err(), "over 2^14 + 256");
        assert!(body_len(&[APPLICATION_DATA, 3, 3, 0, 16]).is_err(), "no room for type and tag");
        assert!(body_len(&[HANDSHAKE, 3, 3, 0, 40]).is_err(), "a plaintext handshake record");
        assert!(body_len(&[APPLICATION_DATA, 3, 1, 0, 40]).is_err(), "another version");
        assert_eq!(body_len(&[APPLICATION_DATA, 3, 3, 0x41, 0x00]).unwrap(), MAX_BODY);
        let (_, mut server) = keyed_pair();
        let mut short = [APPLICATION_DATA, 3, 3, 0, 40, 1, 2, 3];
        assert!(matches!(server.open(&mut short), Err(RecordError::TooLong(40))), "a record cut short");
        let mut forged = [APPLICATION_DATA, 3, 3, 0, 17].into_iter().chain([0u8; 17]).collect::<Vec<_>>();
        assert!(matches!(server.open(&mut forged), Err(RecordError::Decrypt)));
    }
}
