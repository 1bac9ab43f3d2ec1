//! An incremental Server-Sent Events parser for OpenAI streaming responses: bytes in, `data:`
//! payloads out, whatever the chunking of the transport.

/// Buffers bytes and yields each complete event's `data` (multi-line data joined by `\n`).
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

/// Longest event we accept before calling the stream broken.
pub const MAX_EVENT_BYTES: usize = 16 << 20;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SseError {
    #[error("an SSE event is longer than {MAX_EVENT_BYTES} bytes")]
    TooLong,
    #[error("an SSE event is not UTF-8")]
    NotUtf8,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data of every event completed by them.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_boundary(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            let text = std::str::from_utf8(&event).map_err(|_| SseError::NotUtf8)?;
            let mut data: Option<String> = None;
            for line in text.split('\n') {
                let line = line.strip_suffix('\r').unwrap_or(line);
                if let Some(v) = line.strip_prefix("data:") {
                    let v = v.strip_prefix(' ').unwrap_or(v);
                    match &mut data {
                        Some(d) => {
                            d.push('\n');
                            d.push_str(v);
                        }
                        None => data = Some(v.to_string()),
                    }
                }
                // Comments (":"), `event:`, `id:`, `retry:` carry nothing we need.
            }
            if let Some(d) = data {
                out.push(d);
            }
        }
        if self.buf.len() > MAX_EVENT_BYTES {
            return Err(SseError::TooLong);
        }
        Ok(out)
    }

    /// Bytes buffered that do not yet form a complete event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// The end of the first event and the length of its separator (`\n\n`, `\r\n\r\n`, `\r\r`).
fn find_boundary(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        if buf[i..].starts_with(b"\n\n") || buf[i..].starts_with(b"\r\r") {
            return Some((i, 2));
        }
        i += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_across_arbitrary_chunking() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: {\"b\":2}\r\n\r\nevent: x\ndata: l1\ndata: l2\n\ndata: [DONE]\n\n";
        let expected = vec!["{\"a\":1}", "{\"b\":2}", "l1\nl2", "[DONE]"];
        for chunk in [1, 2, 3, 7, stream.len()] {
            let mut p = SseParser::new();
            let mut got = Vec::new();
            for c in stream.chunks(chunk) {
                got.extend(p.push(c).unwrap());
            }
            assert_eq!(got, expected, "chunk size {chunk}");
            assert_eq!(p.pending(), 0);
        }
    }

    #[test]
    fn incomplete_event_waits_and_garbage_is_bounded() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(p.push(b":1}\n\n").unwrap(), vec!["{\"a\":1}"]);
        assert_eq!(p.push(&[0xff, 0xfe, b'\n', b'\n']), Err(SseError::NotUtf8));
        let mut p = SseParser::new();
        let big = vec![b'x'; MAX_EVENT_BYTES + 1];
        assert_eq!(p.push(&big), Err(SseError::TooLong));
    }
}
