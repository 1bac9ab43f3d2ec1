//! A response body, read from its connection by whoever polls it. Everything already read is
//! handed over as one frame; at its end the connection goes back to the pool when it can carry
//! another request. Dropped before its end, it closes the connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http_body::{Frame, SizeHint};

use super::conn::{Origin, Pool, Stream};
use super::framing::{Framing, Step};
use super::{ClientError, READ_BYTES};

pub struct Body {
    stream: Option<Stream>,
    buf: BytesMut,
    framing: Framing,
    origin: Origin,
    /// Where the connection goes at the end (`None`: it closes).
    pool: Option<Arc<Pool>>,
    done: bool,
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body").field("origin", &self.origin).field("done", &self.done).finish_non_exhaustive()
    }
}

impl Body {
    pub(super) fn new(
        stream: Stream,
        buf: BytesMut,
        framing: Framing,
        origin: Origin,
        pool: Option<Arc<Pool>>,
    ) -> Body {
        let mut body = Body { stream: Some(stream), buf, framing, origin, pool, done: false };
        if body.framing.is_done() {
            body.end();
        }
        body
    }

    fn end(&mut self) {
        self.done = true;
        let stream = self.stream.take();
        // Bytes past the body's end are not ours to read: that connection is not reused.
        if let (Some(stream), Some(pool), true) = (stream, self.pool.take(), self.buf.is_empty()) {
            pool.put(&self.origin, stream, Instant::now());
        }
    }

    fn origin_error(&self, source: impl Into<ErrorSource>) -> ClientError {
        let origin = self.origin.to_string();
        match source.into() {
            ErrorSource::Io(error) => ClientError::Io { origin, error },
            ErrorSource::Framing(error) => ClientError::Response { origin, error },
        }
    }
}

enum ErrorSource {
    Io(std::io::Error),
    Framing(super::framing::FramingError),
}

impl From<std::io::Error> for ErrorSource {
    fn from(e: std::io::Error) -> Self {
        ErrorSource::Io(e)
    }
}

impl From<super::framing::FramingError> for ErrorSource {
    fn from(e: super::framing::FramingError) -> Self {
        ErrorSource::Framing(e)
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = ClientError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, ClientError>>> {
        let this = &mut *self;
        loop {
            if this.done {
                return Poll::Ready(None);
            }
            // Everything decodable now leaves as one frame: a burst of SSE events read in one
            // system call reaches the caller at once.
            let mut first: Option<Bytes> = None;
            let mut joined = BytesMut::new();
            loop {
                match this.framing.step(&mut this.buf) {
                    Err(e) => {
                        this.done = true;
                        this.stream = None;
                        return Poll::Ready(Some(Err(this.origin_error(e))));
                    }
                    Ok(Step::Data(data)) => match first.take() {
                        None if joined.is_empty() => first = Some(data),
                        Some(previous) => {
                            joined.reserve(previous.len() + data.len());
                            joined.extend_from_slice(&previous);
                            joined.extend_from_slice(&data);
                        }
                        None => joined.extend_from_slice(&data),
                    },
                    Ok(Step::End) => {
                        this.end();
                        break;
                    }
                    Ok(Step::More) => break,
                }
            }
            let data = first.or_else(|| (!joined.is_empty()).then(|| joined.freeze()));
            if let Some(data) = data {
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            if this.done {
                return Poll::Ready(None);
            }
            let Some(stream) = this.stream.as_mut() else { return Poll::Ready(None) };
            if this.buf.capacity() - this.buf.len() < 1024 {
                this.buf.reserve(READ_BYTES);
            }
            match tokio_util::io::poll_read_buf(Pin::new(stream), cx, &mut this.buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => {
                    this.done = true;
                    this.stream = None;
                    return Poll::Ready(Some(Err(this.origin_error(e))));
                }
                Poll::Ready(Ok(0)) => {
                    this.done = true;
                    this.stream = None;
                    return match this.framing.at_close() {
                        Ok(()) => Poll::Ready(None),
                        Err(e) => Poll::Ready(Some(Err(this.origin_error(e)))),
                    };
                }
                Poll::Ready(Ok(_)) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing.remaining() {
            Some(n) => SizeHint::with_exact(n),
            None => SizeHint::default(),
        }
    }
}
