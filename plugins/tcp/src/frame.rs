//! Wire format of the TCP backend, as pure encode/decode functions.
//!
//! A connection starts with a hello from the initiator and the target's reply, then carries
//! request/response exchanges (little-endian integers):
//! ```text
//! hello:        "XFT1" | version u8 | flags u8 | from_len u16 | to_len u16 | 0 u16
//!               | session u64 | epoch u64 | from | to
//! hello reply:  status u8 | 0 u8 | code u16 | msg_len u16 | 0 u16 | msg
//! challenge:    2 u8 | 0 u8 | 0 u16 | 32 u16 | 0 u16 | target nonce [32]
//! proof:        initiator proof [32]
//! request:      kind u8 | 0 [3] | n_desc u32 | request id u64 | payload_len u64
//!               then n_desc × (key [16] | offset u64 | len u64), then the payload (WRITE, NOTIF)
//! response:     status u8 | 0 u8 | code u16 | msg_len u32 | request id u64 | payload_len u64
//!               then msg, then the payload (READ)
//! ```
//! For WRITE and READ, `payload_len` must equal the sum of the descriptor lengths; for NOTIF,
//! `n_desc` is 0 and the payload is the message.
//!
//! Zero padding follows the descriptor table of every request, and the message of a response
//! that carries a payload, up to a multiple of [`ALIGN`] bytes: a payload that starts at a
//! misaligned offset of the sender's write copies several times slower through loopback TCP
//! (bench/README.md, "Payload alignment"), and KV payloads are page-aligned in memory.

//!
//! Flag bit 0 of the hello: the initiator holds the cluster credential. A target that holds it
//! too answers with a challenge (a fresh nonce); the initiator sends its proof, an HMAC over
//! the nonce, its session and both names ([`xfer_core::credential`]); then the target sends
//! the hello reply. A target with a credential refuses a hello without the flag, and one
//! without a credential refuses a hello with it, both `Unauthenticated` (code 8), before any
//! request is read. Pooled connections are reused, so this costs one round trip per connection.

pub const MAGIC: [u8; 4] = *b"XFT1";
/// Hello flag: the initiator authenticates with the cluster credential.
pub const FLAG_AUTH: u8 = 1;
/// Status byte of a challenge (see the module docs).
pub const CHALLENGE_STATUS: u8 = 2;
pub const VERSION: u8 = 1;
pub const HELLO_LEN: usize = 28;
pub const HELLO_REPLY_LEN: usize = 8;
pub const HEADER_LEN: usize = 24;
pub const DESC_LEN: usize = 32;
pub const RESPONSE_LEN: usize = 24;
pub const KEY_LEN: usize = 16;
/// Payloads start at a multiple of this many bytes from the start of their frame.
pub const ALIGN: usize = 128;

/// Most descriptors in one frame (the target buffers the descriptor table: 32 MiB at most).
pub const MAX_DESCS: u32 = 1 << 20;
/// Most bytes of one notification.
pub const MAX_NOTIF: u64 = 16 << 20;
/// Most bytes of an agent name or an error message.
pub const MAX_NAME: usize = 255;
pub const MAX_MESSAGE: usize = 4096;

pub type Key = [u8; KEY_LEN];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Write,
    Read,
    Notif,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Write => 1,
            Kind::Read => 2,
            Kind::Notif => 3,
        }
    }
}

/// Which connections of an initiator are current. A pool picks a random `id` when it starts and
/// bumps `epoch` whenever it abandons a connection mid-exchange; the target then refuses frames
/// from older connections of that initiator, so a timed-out write still sitting in a socket
/// buffer can never land after a newer one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Session {
    pub id: u64,
    pub epoch: u64,
}

/// A decoded hello's fixed part.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub from_len: usize,
    pub to_len: usize,
    pub session: Session,
    /// The initiator authenticates ([`FLAG_AUTH`]).
    pub auth: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub n_desc: u32,
    pub request_id: u64,
    pub payload_len: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WireDesc {
    pub key: Key,
    pub offset: u64,
    pub len: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    /// 0 = ok, otherwise a refusal code.
    pub code: u16,
    pub request_id: u64,
    pub payload_len: u64,
    pub msg_len: u32,
}

impl Response {
    /// Bytes between the fixed header and the payload: the message, then padding when a
    /// payload follows.
    pub fn tail_len(&self) -> usize {
        response_tail_len(self.msg_len as usize, self.payload_len)
    }
}

fn round_up(len: usize) -> usize {
    len.div_ceil(ALIGN) * ALIGN
}

/// Bytes after a request header: the descriptor table and its padding.
pub fn table_len(n_desc: u32) -> usize {
    round_up(HEADER_LEN + n_desc as usize * DESC_LEN) - HEADER_LEN
}

fn response_tail_len(msg_len: usize, payload_len: u64) -> usize {
    if payload_len == 0 {
        msg_len
    } else {
        round_up(RESPONSE_LEN + msg_len) - RESPONSE_LEN
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("bad magic (not an xfer TCP peer)")]
    BadMagic,
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    #[error("{0} descriptors in one frame (limit {MAX_DESCS})")]
    TooManyDescs(u32),
    #[error("payload length {declared} differs from the descriptors' total {sum}")]
    LengthMismatch { declared: u64, sum: u64 },
    #[error("{what} of {len} bytes exceeds the limit")]
    TooLarge { what: &'static str, len: u64 },
    #[error("nonzero reserved bytes")]
    Reserved,
    #[error("truncated: {have} of {need} bytes")]
    Truncated { have: usize, need: usize },
    #[error("descriptors given for a notification")]
    DescsInNotif,
}

fn le_u16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

fn le_u32(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn need(buf: &[u8], len: usize) -> Result<(), FrameError> {
    if buf.len() < len {
        Err(FrameError::Truncated { have: buf.len(), need: len })
    } else {
        Ok(())
    }
}

pub fn encode_hello(from: &str, to: &str, session: Session, out: &mut Vec<u8>) {
    encode_hello_with(from, to, session, false, out);
}

/// [`encode_hello`], announcing authentication when `auth`.
pub fn encode_hello_with(from: &str, to: &str, session: Session, auth: bool, out: &mut Vec<u8>) {
    let (from, to) = (truncate(from, MAX_NAME), truncate(to, MAX_NAME));
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&[VERSION, if auth { FLAG_AUTH } else { 0 }]);
    out.extend_from_slice(&(from.len() as u16).to_le_bytes());
    out.extend_from_slice(&(to.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&session.id.to_le_bytes());
    out.extend_from_slice(&session.epoch.to_le_bytes());
    out.extend_from_slice(from.as_bytes());
    out.extend_from_slice(to.as_bytes());
}

/// Decodes the fixed part of a hello: the lengths of the two names that follow, the session.
pub fn decode_hello(buf: &[u8]) -> Result<Hello, FrameError> {
    // The magic first, so a stranger (an HTTP client, say) is told so however short its bytes.
    if buf.len() >= MAGIC.len() && buf[..MAGIC.len()] != MAGIC {
        return Err(FrameError::BadMagic);
    }
    need(buf, HELLO_LEN)?;
    if buf[4] != VERSION {
        return Err(FrameError::BadVersion(buf[4]));
    }
    if buf[5] & !FLAG_AUTH != 0 || buf[10] != 0 || buf[11] != 0 {
        return Err(FrameError::Reserved);
    }
    let (from, to) = (usize::from(le_u16(&buf[6..])), usize::from(le_u16(&buf[8..])));
    if from > MAX_NAME || to > MAX_NAME {
        return Err(FrameError::TooLarge { what: "agent name", len: from.max(to) as u64 });
    }
    let session = Session { id: le_u64(&buf[12..]), epoch: le_u64(&buf[20..]) };
    Ok(Hello { from_len: from, to_len: to, session, auth: buf[5] & FLAG_AUTH != 0 })
}

pub fn encode_challenge(nonce: &xfer_core::credential::Nonce, out: &mut Vec<u8>) {
    out.extend_from_slice(&[CHALLENGE_STATUS, 0, 0, 0]);
    out.extend_from_slice(&(nonce.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(nonce);
}

/// The session in the initiator-nonce slot of the proof's transcript: the session id is
/// random per pool and the epoch grows, and the target's nonce is fresh per connection.
pub fn session_nonce(session: Session) -> xfer_core::credential::Nonce {
    let mut nonce = [0u8; xfer_core::credential::AUTH_LEN];
    nonce[..8].copy_from_slice(&session.id.to_le_bytes());
    nonce[8..16].copy_from_slice(&session.epoch.to_le_bytes());
    nonce
}

pub fn encode_hello_reply(code: u16, msg: &str, out: &mut Vec<u8>) {
    let msg = truncate(msg, MAX_MESSAGE);
    out.push(u8::from(code != 0));
    out.push(0);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(msg.as_bytes());
}

/// Decodes a hello reply's fixed part: the refusal code (0 = accepted) and message length.
pub fn decode_hello_reply(buf: &[u8]) -> Result<(u16, usize), FrameError> {
    need(buf, HELLO_REPLY_LEN)?;
    let code = le_u16(&buf[2..]);
    let msg_len = usize::from(le_u16(&buf[4..]));
    if msg_len > MAX_MESSAGE {
        return Err(FrameError::TooLarge { what: "message", len: msg_len as u64 });
    }
    Ok((code, msg_len))
}

/// Appends a request header and its (padded) descriptor table.
pub fn encode_request(kind: Kind, request_id: u64, descs: &[WireDesc], payload_len: u64, out: &mut Vec<u8>) {
    let start = out.len();
    let table = table_len(descs.len() as u32);
    out.reserve(HEADER_LEN + table);
    out.push(kind.code());
    out.extend_from_slice(&[0, 0, 0]);
    out.extend_from_slice(&(descs.len() as u32).to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&payload_len.to_le_bytes());
    for desc in descs {
        out.extend_from_slice(&desc.key);
        out.extend_from_slice(&desc.offset.to_le_bytes());
        out.extend_from_slice(&desc.len.to_le_bytes());
    }
    out.resize(start + HEADER_LEN + table, 0);
}

/// Decodes a request header; checks everything that can be checked without the descriptors.
pub fn decode_header(buf: &[u8]) -> Result<Header, FrameError> {
    need(buf, HEADER_LEN)?;
    let kind = match buf[0] {
        1 => Kind::Write,
        2 => Kind::Read,
        3 => Kind::Notif,
        other => return Err(FrameError::UnknownKind(other)),
    };
    if buf[1..4] != [0, 0, 0] {
        return Err(FrameError::Reserved);
    }
    let n_desc = le_u32(&buf[4..]);
    let header = Header { kind, n_desc, request_id: le_u64(&buf[8..]), payload_len: le_u64(&buf[16..]) };
    if n_desc > MAX_DESCS {
        return Err(FrameError::TooManyDescs(n_desc));
    }
    if kind == Kind::Notif {
        if n_desc != 0 {
            return Err(FrameError::DescsInNotif);
        }
        if header.payload_len > MAX_NOTIF {
            return Err(FrameError::TooLarge { what: "notification", len: header.payload_len });
        }
    }
    Ok(header)
}

/// Decodes a descriptor table (with its padding, [`table_len`] bytes) and checks that it adds
/// up to the header's payload length (a notification's payload is its message instead).
pub fn decode_descs(header: &Header, buf: &[u8], out: &mut Vec<WireDesc>) -> Result<(), FrameError> {
    let n = header.n_desc as usize;
    let padded = table_len(header.n_desc);
    need(buf, padded)?;
    if buf[n * DESC_LEN..padded].iter().any(|&b| b != 0) {
        return Err(FrameError::Reserved);
    }
    out.clear();
    out.reserve(n);
    let mut sum: u64 = 0;
    for raw in buf[..n * DESC_LEN].chunks_exact(DESC_LEN) {
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&raw[..KEY_LEN]);
        let desc = WireDesc { key, offset: le_u64(&raw[16..]), len: le_u64(&raw[24..]) };
        sum = sum.checked_add(desc.len).ok_or(FrameError::TooLarge { what: "payload", len: u64::MAX })?;
        out.push(desc);
    }
    if header.kind != Kind::Notif && sum != header.payload_len {
        return Err(FrameError::LengthMismatch { declared: header.payload_len, sum });
    }
    Ok(())
}

/// Appends a response header and its message (padded when a payload follows).
pub fn encode_response(code: u16, request_id: u64, payload_len: u64, msg: &str, out: &mut Vec<u8>) {
    let start = out.len();
    let msg = truncate(msg, MAX_MESSAGE);
    out.push(u8::from(code != 0));
    out.push(0);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(&request_id.to_le_bytes());
    out.extend_from_slice(&payload_len.to_le_bytes());
    out.extend_from_slice(msg.as_bytes());
    out.resize(start + RESPONSE_LEN + response_tail_len(msg.len(), payload_len), 0);
}

pub fn decode_response(buf: &[u8]) -> Result<Response, FrameError> {
    need(buf, RESPONSE_LEN)?;
    let code = le_u16(&buf[2..]);
    if buf[0] != u8::from(code != 0) || buf[1] != 0 {
        return Err(FrameError::Reserved);
    }
    let msg_len = le_u32(&buf[4..]);
    if msg_len as usize > MAX_MESSAGE {
        return Err(FrameError::TooLarge { what: "message", len: u64::from(msg_len) });
    }
    Ok(Response { code, request_id: le_u64(&buf[8..]), payload_len: le_u64(&buf[16..]), msg_len })
}

/// The longest prefix of `text` within `max` bytes that ends on a character boundary.
fn truncate(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Decodes one complete request frame (header + descriptors, no payload) from the front of
/// `buf`: `Ok(None)` when more bytes are needed. The fuzz target drives this.
pub fn decode_request_frame(buf: &[u8]) -> Result<Option<(Header, Vec<WireDesc>, usize)>, FrameError> {
    if buf.len() < HEADER_LEN {
        return Ok(None);
    }
    let header = decode_header(buf)?;
    let table = table_len(header.n_desc);
    if buf.len() < HEADER_LEN + table {
        return Ok(None);
    }
    let mut descs = Vec::new();
    decode_descs(&header, &buf[HEADER_LEN..], &mut descs)?;
    Ok(Some((header, descs, HEADER_LEN + table)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(k: u8, offset: u64, len: u64) -> WireDesc {
        WireDesc { key: [k; KEY_LEN], offset, len }
    }

    #[test]
    fn request_round_trips() {
        let descs = vec![desc(1, 0, 10), desc(2, 4096, 6)];
        let mut buf = Vec::new();
        encode_request(Kind::Write, 42, &descs, 16, &mut buf);
        let (header, decoded, used) = decode_request_frame(&buf).unwrap().unwrap();
        assert_eq!(header, Header { kind: Kind::Write, n_desc: 2, request_id: 42, payload_len: 16 });
        assert_eq!(decoded, descs);
        assert_eq!(used, buf.len());
        assert_eq!(used % ALIGN, 0, "the payload starts aligned");
        for cut in 0..buf.len() {
            assert_eq!(decode_request_frame(&buf[..cut]), Ok(None), "cut at {cut}");
        }
    }

    #[test]
    fn rejects_malformed_requests() {
        let mut buf = Vec::new();
        encode_request(Kind::Read, 1, &[desc(1, 0, 10)], 11, &mut buf);
        assert_eq!(decode_request_frame(&buf), Err(FrameError::LengthMismatch { declared: 11, sum: 10 }));
        let mut bad_kind = buf.clone();
        bad_kind[0] = 9;
        assert_eq!(decode_header(&bad_kind), Err(FrameError::UnknownKind(9)));
        let mut reserved = buf.clone();
        reserved[2] = 1;
        assert_eq!(decode_header(&reserved), Err(FrameError::Reserved));
        let mut many = buf.clone();
        many[4..8].copy_from_slice(&(MAX_DESCS + 1).to_le_bytes());
        assert_eq!(decode_header(&many), Err(FrameError::TooManyDescs(MAX_DESCS + 1)));
        let mut padding = buf.clone();
        *padding.last_mut().unwrap() = 1;
        assert_eq!(decode_request_frame(&padding), Err(FrameError::Reserved));
        let mut overflow = Vec::new();
        encode_request(Kind::Write, 1, &[desc(1, 0, u64::MAX), desc(1, 0, 2)], 1, &mut overflow);
        assert!(matches!(decode_request_frame(&overflow), Err(FrameError::TooLarge { .. })));
        let mut notif = Vec::new();
        encode_request(Kind::Notif, 1, &[desc(1, 0, 1)], 1, &mut notif);
        assert_eq!(decode_header(&notif), Err(FrameError::DescsInNotif));
        let mut big_notif = Vec::new();
        encode_request(Kind::Notif, 1, &[], MAX_NOTIF + 1, &mut big_notif);
        assert!(matches!(decode_header(&big_notif), Err(FrameError::TooLarge { .. })));
    }

    #[test]
    fn hello_and_responses_round_trip() {
        let mut buf = Vec::new();
        let session = Session { id: 77, epoch: 3 };
        encode_hello("decode-0", "prefill-0", session, &mut buf);
        assert_eq!(decode_hello(&buf), Ok(Hello { from_len: 8, to_len: 9, session, auth: false }));
        let mut authed = Vec::new();
        encode_hello_with("decode-0", "prefill-0", session, true, &mut authed);
        assert_eq!(decode_hello(&authed), Ok(Hello { from_len: 8, to_len: 9, session, auth: true }));
        authed[5] = 2;
        assert_eq!(decode_hello(&authed), Err(FrameError::Reserved));
        let mut challenge = Vec::new();
        encode_challenge(&[9; 32], &mut challenge);
        assert_eq!(challenge[0], CHALLENGE_STATUS);
        assert_eq!(decode_hello_reply(&challenge), Ok((0, 32)));
        assert_eq!(&buf[HELLO_LEN..], b"decode-0prefill-0");
        assert_eq!(decode_hello(b"GET / HTTP/1.1\r\n"), Err(FrameError::BadMagic));

        let mut reply = Vec::new();
        encode_hello_reply(6, "wrong agent", &mut reply);
        assert_eq!(decode_hello_reply(&reply), Ok((6, 11)));

        let mut resp = Vec::new();
        encode_response(2, 7, 0, "out of bounds", &mut resp);
        let decoded = decode_response(&resp).unwrap();
        assert_eq!((decoded.code, decoded.request_id, decoded.msg_len), (2, 7, 13));
        assert_eq!(resp.len(), RESPONSE_LEN + decoded.tail_len());
        let mut with_payload = Vec::new();
        encode_response(0, 8, 4096, "", &mut with_payload);
        assert_eq!(with_payload.len(), ALIGN);
        assert_eq!(decode_response(&with_payload).unwrap().tail_len(), ALIGN - RESPONSE_LEN);
        let long = "é".repeat(MAX_MESSAGE);
        let mut resp = Vec::new();
        encode_response(1, 1, 0, &long, &mut resp);
        assert!(decode_response(&resp).unwrap().msg_len as usize <= MAX_MESSAGE);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A small deterministic generator stands in for the fuzzer in the unit suite.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 200) as usize;
            let bytes: Vec<u8> = (0..len).map(|i| (state >> (i % 56)) as u8).collect();
            let _ = decode_request_frame(&bytes);
            let _ = decode_response(&bytes);
            let _ = decode_hello(&bytes);
            let _ = decode_hello_reply(&bytes);
        }
    }
}
