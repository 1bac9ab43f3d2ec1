//! The client's HTTP/1.1 reading, without I/O: a response head from bytes, and the body's
//! framing (length, chunked, until close) cut out of a buffer as the bytes arrive.

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};

/// A response head larger than this is refused.
pub const MAX_HEAD_BYTES: usize = 64 << 10;
/// Headers per response head, at most.
const MAX_HEADERS: usize = 128;
/// A chunk-size line (with extensions) or a trailer line longer than this is refused.
const MAX_LINE_BYTES: usize = 4 << 10;
/// Trailer bytes of a chunked body, at most (they are read and dropped).
const MAX_TRAILER_BYTES: usize = 16 << 10;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FramingError {
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("response head larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("the server switched protocols (101), which this client does not do")]
    SwitchingProtocols,
    #[error("conflicting or invalid content-length")]
    ContentLength,
    #[error("malformed chunk: {0}")]
    Chunk(&'static str),
    #[error("the connection closed {0}")]
    Truncated(&'static str),
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub framing: Framing,
    /// The connection may carry another request once this body has ended.
    pub keep_alive: bool,
}

/// Takes the response head from the front of `buf`: `None` (and `buf` untouched) while it is
/// incomplete. Header values stay in the bytes read (no copy each). Interim (1xx) responses are
/// returned too; the caller skips them.
pub fn take_head(buf: &mut BytesMut, method: &Method) -> Result<Option<Head>, FramingError> {
    // Where each header's name and value lie in `buf`, kept while httparse borrows it.
    let mut spans = [(0usize, 0usize, 0usize, 0usize); MAX_HEADERS];
    let (len, code, minor, count) = {
        let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut parsed = httparse::Response::new(&mut slots);
        let len = match parsed.parse(buf) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD_BYTES => return Err(FramingError::HeadTooLarge),
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(FramingError::Head(format!("over {MAX_HEADERS} headers")))
            }
            Err(e) => return Err(FramingError::Head(e.to_string())),
        };
        let base = buf.as_ptr() as usize;
        for (span, h) in spans.iter_mut().zip(parsed.headers.iter()) {
            *span = (h.name.as_ptr() as usize - base, h.name.len(), h.value.as_ptr() as usize - base, h.value.len());
        }
        (len, parsed.code.unwrap_or_default(), parsed.version, parsed.headers.len())
    };
    if len > MAX_HEAD_BYTES {
        return Err(FramingError::HeadTooLarge);
    }
    let status = StatusCode::from_u16(code).map_err(|_| FramingError::Head(format!("status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(FramingError::SwitchingProtocols);
    }
    let version = if minor == Some(1) { Version::HTTP_11 } else { Version::HTTP_10 };
    let head = buf.split_to(len).freeze();
    let mut headers = HeaderMap::with_capacity(count);
    for &(name_at, name_len, value_at, value_len) in &spans[..count] {
        let name = &head[name_at..name_at + name_len];
        let name = HeaderName::from_bytes(name)
            .map_err(|_| FramingError::Head(format!("header name {:?}", String::from_utf8_lossy(name))))?;
        let value = HeaderValue::from_maybe_shared(head.slice(value_at..value_at + value_len))
            .map_err(|_| FramingError::Head(format!("value of {name}")))?;
        headers.append(name, value);
    }
    let (framing, framing_keeps) = framing_of(status, method, &headers)?;
    let keep_alive = framing_keeps && version == Version::HTTP_11 && !has_token(&headers, &CONNECTION, "close");
    Ok(Some(Head { status, version, headers, framing, keep_alive }))
}

/// The body's framing (RFC 9112 §6.3), and whether the connection can outlive it.
fn framing_of(status: StatusCode, method: &Method, headers: &HeaderMap) -> Result<(Framing, bool), FramingError> {
    if status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || method == Method::HEAD
    {
        return Ok((Framing::Length(0), true));
    }
    if headers.contains_key(TRANSFER_ENCODING) {
        // Chunked must be the last coding; a length beside it is ignored, and such a message
        // may have been meant to smuggle, so its connection is not reused.
        let last = headers.get_all(TRANSFER_ENCODING).iter().next_back().and_then(|v| v.to_str().ok());
        let chunked = last.and_then(|v| v.rsplit(',').next()).is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
        if chunked {
            return Ok((Framing::Chunked(Chunked::default()), !headers.contains_key(CONTENT_LENGTH)));
        }
        return Ok((Framing::UntilClose, false));
    }
    let mut length = None;
    for value in headers.get_all(CONTENT_LENGTH) {
        for part in value.to_str().map_err(|_| FramingError::ContentLength)?.split(',') {
            let part = part.trim();
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(FramingError::ContentLength);
            }
            let n: u64 = part.parse().map_err(|_| FramingError::ContentLength)?;
            if length.is_some_and(|l| l != n) {
                return Err(FramingError::ContentLength);
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => (Framing::Length(n), true),
        None => (Framing::UntilClose, false),
    })
}

fn has_token(headers: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
}

/// How a response body ends.
#[derive(Debug)]
pub enum Framing {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunked),
    /// Everything until the server closes the connection.
    UntilClose,
}

/// What the framing made of the buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// Body bytes, cut from the front of the buffer.
    Data(Bytes),
    /// More bytes are needed.
    More,
    /// The body has ended; what is left in the buffer follows it.
    End,
}

impl Framing {
    /// The next piece of the body in `buf`.
    pub fn step(&mut self, buf: &mut BytesMut) -> Result<Step, FramingError> {
        match self {
            Framing::Length(0) => Ok(Step::End),
            Framing::Length(left) => {
                if buf.is_empty() {
                    return Ok(Step::More);
                }
                let take = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
                *left -= take as u64;
                Ok(Step::Data(buf.split_to(take).freeze()))
            }
            Framing::Chunked(chunked) => chunked.step(buf),
            Framing::UntilClose if buf.is_empty() => Ok(Step::More),
            Framing::UntilClose => Ok(Step::Data(buf.split().freeze())),
        }
    }

    /// The server closed the connection: the end, for a body that runs until then.
    pub fn at_close(&self) -> Result<(), FramingError> {
        match self {
            Framing::UntilClose | Framing::Length(0) => Ok(()),
            Framing::Length(_) => Err(FramingError::Truncated("before the body's length was reached")),
            Framing::Chunked(c) if c.state == ChunkState::Done => Ok(()),
            Framing::Chunked(_) => Err(FramingError::Truncated("before the last chunk")),
        }
    }

    /// Whether the body has ended.
    pub fn is_done(&self) -> bool {
        match self {
            Framing::Length(left) => *left == 0,
            Framing::Chunked(c) => c.state == ChunkState::Done,
            Framing::UntilClose => false,
        }
    }

    /// The bytes left, when known.
    pub fn remaining(&self) -> Option<u64> {
        match self {
            Framing::Length(left) => Some(*left),
            Framing::Chunked(c) if c.state == ChunkState::Done => Some(0),
            _ => None,
        }
    }
}

/// The chunked transfer coding, decoded as it arrives.
#[derive(Debug, Default)]
pub struct Chunked {
    state: ChunkState,
    trailer_bytes: usize,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum ChunkState {
    /// A chunk-size line is next.
    #[default]
    Size,
    /// This many bytes of the current chunk are left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines, up to an empty one.
    Trailers,
    Done,
}

impl Chunked {
    fn step(&mut self, buf: &mut BytesMut) -> Result<Step, FramingError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(Step::End),
                ChunkState::Size => {
                    let Some(line) = take_line(buf)? else { return Ok(Step::More) };
                    let size = chunk_size(&line)?;
                    self.state = if size == 0 { ChunkState::Trailers } else { ChunkState::Data(size) };
                }
                ChunkState::Data(left) => {
                    if buf.is_empty() {
                        return Ok(Step::More);
                    }
                    let take = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
                    let left = left - take as u64;
                    self.state = if left == 0 { ChunkState::DataEnd } else { ChunkState::Data(left) };
                    return Ok(Step::Data(buf.split_to(take).freeze()));
                }
                ChunkState::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Step::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(FramingError::Chunk("no CRLF after a chunk's data"));
                    }
                    let _ = buf.split_to(2);
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some(line) = take_line(buf)? else { return Ok(Step::More) };
                    if line.is_empty() {
                        self.state = ChunkState::Done;
                    } else {
                        self.trailer_bytes += line.len();
                        if self.trailer_bytes > MAX_TRAILER_BYTES {
                            return Err(FramingError::Chunk("trailers too large"));
                        }
                    }
                }
            }
        }
    }
}

/// The line at the front of `buf` without its CRLF, removed from `buf`; `None` while no CRLF
/// has arrived.
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>, FramingError> {
    match buf.windows(2).position(|w| w == b"\r\n") {
        Some(end) if end <= MAX_LINE_BYTES => {
            let line = buf.split_to(end);
            let _ = buf.split_to(2);
            Ok(Some(line))
        }
        Some(_) => Err(FramingError::Chunk("line too long")),
        None if buf.len() > MAX_LINE_BYTES => Err(FramingError::Chunk("line too long")),
        None => Ok(None),
    }
}

/// A chunk-size line's size: hex digits, then optional whitespace and `;extensions`.
fn chunk_size(line: &[u8]) -> Result<u64, FramingError> {
    let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits == 0 {
        return Err(FramingError::Chunk("no chunk size"));
    }
    if digits > 15 {
        return Err(FramingError::Chunk("chunk size too large"));
    }
    let rest = &line[digits..];
    let rest = &rest[rest.iter().take_while(|b| **b == b' ' || **b == b'\t').count()..];
    if !rest.is_empty() && rest[0] != b';' {
        return Err(FramingError::Chunk("junk after the chunk size"));
    }
    let text = std::str::from_utf8(&line[..digits]).map_err(|_| FramingError::Chunk("no chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| FramingError::Chunk("chunk size too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head of `text` and the length it took.
    fn head(text: &str) -> Result<Option<(Head, usize)>, FramingError> {
        let mut buf = BytesMut::from(text.as_bytes());
        Ok(take_head(&mut buf, &Method::POST)?.map(|h| (h, text.len() - buf.len())))
    }

    /// Feeds `wire` to `framing` in pieces of `piece` bytes; the body and what followed it.
    fn decode(mut framing: Framing, wire: &[u8], piece: usize) -> Result<(Vec<u8>, Vec<u8>), FramingError> {
        let mut buf = BytesMut::new();
        let mut body = Vec::new();
        let mut fed = 0;
        loop {
            match framing.step(&mut buf)? {
                Step::Data(d) => body.extend_from_slice(&d),
                Step::End => return Ok((body, buf.to_vec())),
                Step::More if fed == wire.len() => {
                    framing.at_close()?;
                    return Ok((body, buf.to_vec()));
                }
                Step::More => {
                    let next = (fed + piece).min(wire.len());
                    buf.extend_from_slice(&wire[fed..next]);
                    fed = next;
                }
            }
        }
    }

    #[test]
    fn heads_give_status_headers_framing_and_reuse() {
        let (h, len) = head("HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\n\r\nhello").unwrap().unwrap();
        assert_eq!((h.status, h.version, len), (StatusCode::OK, Version::HTTP_11, 46));
        assert_eq!(h.headers["x-a"], "1");
        assert_eq!(h.framing.remaining(), Some(5));
        assert!(h.keep_alive);

        let (h, _) = head("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n").unwrap().unwrap();
        assert!(matches!(h.framing, Framing::Chunked(_)) && h.keep_alive);
        let (h, _) = head("HTTP/1.1 200 OK\r\nconnection: Close\r\ncontent-length: 0\r\n\r\n").unwrap().unwrap();
        assert!(!h.keep_alive);
        let (h, _) = head("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n").unwrap().unwrap();
        assert!(!h.keep_alive);
        let (h, _) = head("HTTP/1.1 200 OK\r\n\r\n").unwrap().unwrap();
        assert!(matches!(h.framing, Framing::UntilClose) && !h.keep_alive);
        let (h, _) = head("HTTP/1.1 204 No Content\r\n\r\n").unwrap().unwrap();
        assert!(h.framing.is_done() && h.keep_alive);
        let mut wire = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n"[..]);
        let h = take_head(&mut wire, &Method::HEAD).unwrap().unwrap();
        assert!(h.framing.is_done());
        let (h, _) = head("HTTP/1.1 100 Continue\r\n\r\n").unwrap().unwrap();
        assert!(h.status.is_informational());
        // Both: chunked wins, and the connection is not reused.
        let (h, _) =
            head("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n").unwrap().unwrap();
        assert!(matches!(h.framing, Framing::Chunked(_)) && !h.keep_alive);
        // Repeated equal lengths are one length.
        let (h, _) = head("HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\ncontent-length: 3\r\n\r\n").unwrap().unwrap();
        assert_eq!(h.framing.remaining(), Some(3));
    }

    #[test]
    fn bad_heads_are_refused_and_partial_ones_wait() {
        let mut partial = BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-le"[..]);
        assert!(take_head(&mut partial, &Method::GET).unwrap().is_none());
        assert_eq!(&partial[..], b"HTTP/1.1 200 OK\r\ncontent-le", "an incomplete head stays");
        assert!(head("").unwrap().is_none());
        for bad in [
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: +1\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999999\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: \r\n\r\n",
        ] {
            assert_eq!(head(bad).unwrap_err(), FramingError::ContentLength, "{bad:?}");
        }
        assert!(matches!(head("HTTQ/1.1 200 OK\r\n\r\n"), Err(FramingError::Head(_))));
        assert!(matches!(head("HTTP/1.1 2000 OK\r\n\r\n"), Err(FramingError::Head(_))));
        assert!(matches!(head("HTTP/1.1 200 OK\r\nbad header\r\n\r\n"), Err(FramingError::Head(_))));
        assert_eq!(head("HTTP/1.1 101 Switching\r\n\r\n").unwrap_err(), FramingError::SwitchingProtocols);
        let many: String = (0..200).map(|i| format!("x-{i}: v\r\n")).collect();
        assert!(matches!(head(&format!("HTTP/1.1 200 OK\r\n{many}\r\n")), Err(FramingError::Head(_))));
        let huge = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(MAX_HEAD_BYTES));
        assert_eq!(head(&huge).unwrap_err(), FramingError::HeadTooLarge);
    }

    #[test]
    fn bodies_decode_whatever_the_pieces() {
        let chunked = b"5\r\nhello\r\n1;ext=1\r\n \r\n6 \r\nworld!\r\n0\r\nx-trailer: t\r\n\r\nNEXT";
        for piece in [1, 2, 3, 7, 64, 4096] {
            let (body, _) = decode(Framing::Chunked(Chunked::default()), chunked, piece).unwrap();
            assert_eq!(body, b"hello world!", "piece {piece}");
            let (body, _) = decode(Framing::Length(4), b"abcdNEXT", piece).unwrap();
            assert_eq!(body, b"abcd");
            let (body, _) = decode(Framing::UntilClose, b"all of it", piece).unwrap();
            assert_eq!(body, b"all of it");
        }
        // What follows the end stays in the buffer.
        let mut buf = BytesMut::from(&b"0\r\n\r\nHTTP/1.1"[..]);
        let mut framing = Framing::Chunked(Chunked::default());
        assert_eq!(framing.step(&mut buf).unwrap(), Step::End);
        assert!(framing.is_done());
        assert_eq!(&buf[..], b"HTTP/1.1");
    }

    #[test]
    fn broken_bodies_are_errors() {
        let chunked = |wire: &[u8]| decode(Framing::Chunked(Chunked::default()), wire, 3);
        assert_eq!(chunked(b"zz\r\n").unwrap_err(), FramingError::Chunk("no chunk size"));
        assert_eq!(chunked(b"5x\r\nhello\r\n").unwrap_err(), FramingError::Chunk("junk after the chunk size"));
        assert_eq!(chunked(b"fffffffffffffffff\r\n").unwrap_err(), FramingError::Chunk("chunk size too large"));
        assert_eq!(chunked(b"5\r\nhelloXX0\r\n\r\n").unwrap_err(), FramingError::Chunk("no CRLF after a chunk's data"));
        assert_eq!(chunked(&[b'1'; MAX_LINE_BYTES + 10]).unwrap_err(), FramingError::Chunk("line too long"));
        let trailers = format!("0\r\n{}", "x-t: v\r\n".repeat(MAX_TRAILER_BYTES / 5));
        assert_eq!(chunked(trailers.as_bytes()).unwrap_err(), FramingError::Chunk("trailers too large"));
        assert!(matches!(chunked(b"5\r\nhel"), Err(FramingError::Truncated(_))));
        assert!(matches!(chunked(b"5\r\nhello\r\n"), Err(FramingError::Truncated(_))));
        assert!(matches!(decode(Framing::Length(10), b"short", 2), Err(FramingError::Truncated(_))));
    }
}
