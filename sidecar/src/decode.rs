//! The decode leg on the local engine: pick a rank (another one if the first cannot be reached),
//! wait — bounded — for the response head and its first body byte, then relay the body to the
//! client frame by frame, cutting a stream that goes idle. The release guard of the prefill's
//! blocks is disarmed only once the decode produced output (it then has pulled them).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{self, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response, StatusCode};
use http_body::{Body as HttpBody, Frame, SizeHint};

use crate::context::Context;
use crate::engines::{EnginePool, RankGuard};
use crate::errors::{ApiError, LegError, UpstreamError};
use crate::finish::Finish;
use crate::metrics::{inc, Metrics, Outcome, Phase};
use crate::upstream::{self, LegHeaders, UpstreamBody};

/// One decode call.
#[derive(Debug)]
pub struct DecodeCall<'a> {
    /// Path and query, as the client sent them.
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    pub request_id: &'a str,
    pub body: Bytes,
    /// The body differs from the client's (content-length must be recomputed).
    pub rewritten: bool,
    /// When the prefill answered (times the KV handoff).
    pub prefilled_at: Option<Instant>,
}

/// The decode's response head and first body frame.
#[derive(Debug)]
pub struct Opened {
    /// The engine rank, busy until the body is relayed (none for a redirected request).
    pub rank: Option<RankGuard>,
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub incoming: UpstreamBody,
    pub first: Option<Frame<Bytes>>,
    pub sse: bool,
}

/// Sends the decode call (another rank when one cannot be reached) and waits, within the
/// first-byte timeout, for the head and the first body frame.
pub async fn open(ctx: &Context, engines: &EnginePool, call: &DecodeCall<'_>) -> Result<Opened, LegError> {
    let started = Instant::now();
    let first_byte = ctx.cfg.decode_first_byte_timeout;
    let leg = LegHeaders {
        request_id: call.request_id,
        authorization: ctx.upstream_authorization(),
        rewritten: call.rewritten,
        identity: false,
    };
    let mut tried = Vec::new();
    let (resp, rank) = loop {
        let Some(rank) = engines.pick(&tried) else {
            return Err(LegError::DecodeUnavailable(String::new()));
        };
        let target = engines.rank(rank.index);
        // Built per attempt: another attempt is rare, and hyper takes the map it is given.
        let headers = upstream::leg_headers(call.headers, leg, &[]);
        let req = upstream::post(target, call.path, headers, call.body.clone());
        let left = first_byte.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
        match upstream::send(&ctx.client, target, req, left).await {
            Ok(r) => break (r, rank),
            Err(e @ UpstreamError::Connect { .. }) => {
                tried.push(rank.index);
                if tried.len() < engines.len() {
                    inc(&ctx.metrics.decode_rank_failovers);
                    tracing::warn!(engine = %target.base, %e, "decode rank unreachable; trying another");
                    continue;
                }
                tracing::error!(engine = %target.base, %e, "decode engine unreachable");
                return Err(LegError::DecodeUnavailable(e.to_string()));
            }
            Err(e @ UpstreamError::Timeout { .. }) => {
                return Err(LegError::DecodeTimeout { secs: first_byte.as_secs_f64(), source: e });
            }
            Err(e) => return Err(LegError::DecodeFailed(e)),
        }
    };
    if let Some(at) = call.prefilled_at {
        ctx.metrics.phase(Phase::KvHandoff).since(at);
    }
    let opened = first_frame(resp, Some(rank), "the decode engine", started, first_byte).await?;
    ctx.metrics.phase(Phase::DecodeFirstByte).since(started);
    Ok(opened)
}

/// Waits for the first body frame of `resp` until `limit` after `started` (a 504 when late, a
/// 502 when the body breaks off); `what` names the peer in those errors.
pub async fn first_frame(
    resp: Response<UpstreamBody>,
    rank: Option<RankGuard>,
    what: &str,
    started: Instant,
    limit: Duration,
) -> Result<Opened, LegError> {
    let status = resp.status();
    let (parts, mut incoming) = resp.into_parts();
    let headers = upstream::response_headers(&parts.headers);
    let sse = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let left = limit.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
    let first = match tokio::time::timeout(left, next_data_frame(&mut incoming)).await {
        Err(_) => return Err(LegError::NoOutput { what: what.to_string(), secs: limit.as_secs_f64() }),
        Ok(Err(e)) => return Err(LegError::BrokeOff { what: what.to_string(), reason: e.to_string() }),
        Ok(Ok(frame)) => frame,
    };
    Ok(Opened { rank, status, headers, incoming, first, sse })
}

/// The outcome a decode answer's status counts as.
pub fn outcome_of(status: StatusCode) -> Outcome {
    if status.is_success() {
        Outcome::Ok
    } else if status.is_client_error() {
        Outcome::ClientError
    } else {
        Outcome::EngineError
    }
}

/// Relays an opened decode response to the client; `fin` settles when the body ends or the
/// client leaves. What the engine sent right behind the first frame is gathered first, so the
/// head, that burst and, for an answer already complete, the body's end leave in one write.
pub async fn relay(ctx: &Context, opened: Opened, fin: Finish) -> Response<Body> {
    let mut relay = Relay {
        _rank: opened.rank,
        ready: None,
        inner: opened.incoming,
        gathered: Gathered::default(),
        after: None,
        idle: ctx.cfg.stream_idle_timeout,
        last_activity: Instant::now(),
        timer: None,
        sse: opened.sse,
        outcome: outcome_of(opened.status),
        fin: Some(fin),
        metrics: Arc::clone(&ctx.metrics),
        ended: false,
    };
    match opened.first.map(Frame::into_data) {
        Some(Ok(data)) => {
            relay.gathered.push(data);
            // With data gathered the relay never waits for the engine.
            relay.ready = std::future::poll_fn(|cx| Pin::new(&mut relay).poll_frame(cx)).await;
        }
        Some(Err(trailers)) => relay.ready = Some(Ok(trailers)),
        None => {}
    }
    let mut r = Response::new(Body::new(relay));
    *r.status_mut() = opened.status;
    *r.headers_mut() = opened.headers;
    r
}

/// The whole decode leg of a vLLM-style request.
pub async fn run(ctx: &Context, engines: &EnginePool, call: DecodeCall<'_>, mut fin: Finish) -> Response<Body> {
    let opened = match open(ctx, engines, &call).await {
        Ok(o) => o,
        Err(e) => return fin.leg_failed(&e),
    };
    if opened.status.is_success() {
        // Output exists, so the engine has the KV: the prefill's blocks are its business now.
        fin.blocks_taken();
        fin.decode_started(opened.first.is_none() || opened.incoming.is_end_stream());
    } else {
        tracing::warn!(status = %opened.status, "decode engine answered an error");
        fin.release_now();
    }
    relay(ctx, opened, fin).await
}

/// The next frame carrying data (trailers pass as frames too), or `None` at the end.
async fn next_data_frame(body: &mut UpstreamBody) -> Result<Option<Frame<Bytes>>, pd_http::client::ClientError> {
    loop {
        match std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await {
            None => return Ok(None),
            Some(Err(e)) => return Err(e),
            Some(Ok(f)) => {
                if f.data_ref().is_some_and(Bytes::is_empty) {
                    continue;
                }
                return Ok(Some(f));
            }
        }
    }
}

/// A burst of the engine's output is joined for the client until this many bytes.
const MAX_GATHERED: usize = 16 << 10;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The decode's body on its way to the client: bytes pass unchanged; silence longer than
/// `idle` ends it (with an SSE error event when streaming); its end or its drop (the client
/// left) settles the request's outcome and reports.
///
/// The engine's body hands over everything its connection has read as one frame, so a burst of
/// SSE events read in one system call leaves in one `writev`; output that has not arrived yet
/// is never waited for. The first burst is gathered before the response head is handed to the
/// server (see `relay`), so the head and the start of the body leave together.
struct Relay {
    _rank: Option<RankGuard>,
    /// The first burst, gathered before the response head went out.
    ready: Option<Result<Frame<Bytes>, BoxError>>,
    inner: UpstreamBody,
    /// Data read from the engine and not yet given to the client.
    gathered: Gathered,
    /// What follows the gathered data: a trailers frame or the engine's error.
    after: Option<Result<Frame<Bytes>, BoxError>>,
    idle: Duration,
    last_activity: Instant,
    /// Armed the first time the engine keeps the client waiting: a body that is there at once
    /// (a non-streaming answer) never needs one.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    sse: bool,
    outcome: Outcome,
    fin: Option<Finish>,
    metrics: Arc<Metrics>,
    ended: bool,
}

/// Bytes joined from frames; one frame stays as it came (no copy).
#[derive(Default)]
struct Gathered {
    one: Option<Bytes>,
    joined: BytesMut,
}

impl Gathered {
    fn push(&mut self, data: Bytes) {
        if self.joined.is_empty() {
            match self.one.take() {
                None => {
                    self.one = Some(data);
                    return;
                }
                Some(first) => {
                    self.joined.reserve(first.len() + data.len());
                    self.joined.extend_from_slice(&first);
                }
            }
        }
        self.joined.extend_from_slice(&data);
    }

    fn len(&self) -> usize {
        self.one.as_ref().map_or(self.joined.len(), Bytes::len)
    }

    fn is_empty(&self) -> bool {
        self.one.is_none() && self.joined.is_empty()
    }

    fn take(&mut self) -> Option<Frame<Bytes>> {
        let data = match self.one.take() {
            Some(one) => one,
            None if self.joined.is_empty() => return None,
            None => self.joined.split().freeze(),
        };
        Some(Frame::data(data))
    }
}

impl Relay {
    /// A body of known length may not be polled to its end: settle on its last frame.
    fn settle_if_done(&mut self) {
        if !self.ended && self.inner.is_end_stream() {
            let outcome = self.outcome;
            self.settle(outcome, None);
        }
    }

    fn settle(&mut self, outcome: Outcome, error: Option<&str>) {
        self.ended = true;
        if let Some(fin) = self.fin.take() {
            fin.end(outcome, error);
        }
    }

    /// The gathered data as one frame (none when nothing is gathered).
    fn flush(&mut self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Poll::Ready(self.gathered.take().map(Ok))
    }
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut task::Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(f) = this.ready.take() {
            return Poll::Ready(Some(f));
        }
        loop {
            if this.gathered.is_empty() {
                if let Some(after) = this.after.take() {
                    return Poll::Ready(Some(after));
                }
            }
            this.settle_if_done();
            if this.ended || this.gathered.len() >= MAX_GATHERED {
                return this.flush();
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(f))) => {
                    this.last_activity = Instant::now();
                    match f.into_data() {
                        Ok(data) => {
                            if !data.is_empty() {
                                this.gathered.push(data);
                            }
                        }
                        Err(trailers) if this.gathered.is_empty() => return Poll::Ready(Some(Ok(trailers))),
                        Err(trailers) => {
                            this.after = Some(Ok(trailers));
                            return this.flush();
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let msg = format!("the decode engine broke off its response: {e}");
                    this.settle(Outcome::EngineError, Some(&msg));
                    // What arrived before the break still goes first.
                    this.after = Some(Err(msg.into()));
                }
                Poll::Ready(None) => {
                    let outcome = this.outcome;
                    this.settle(outcome, None);
                }
                Poll::Pending if !this.gathered.is_empty() => return this.flush(),
                Poll::Pending => {
                    // The timer is moved only when it fires early (cheaper than per frame).
                    loop {
                        let deadline = this.last_activity + this.idle;
                        let timer =
                            this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline.into())));
                        if timer.deadline().into_std() < deadline {
                            timer.as_mut().reset(deadline.into());
                        }
                        if timer.as_mut().poll(cx).is_pending() {
                            return Poll::Pending;
                        }
                        if Instant::now() >= this.last_activity + this.idle {
                            break;
                        }
                    }
                    inc(&this.metrics.stream_idle_timeouts);
                    let idle = LegError::StreamIdle { secs: this.idle.as_secs_f64() };
                    let msg = idle.to_string();
                    tracing::warn!("{msg}; cutting it");
                    this.settle(Outcome::Timeout, Some(&msg));
                    if this.sse {
                        let event = ApiError::from(&idle).body();
                        let mut chunk = Vec::with_capacity(event.len() + 8);
                        chunk.extend_from_slice(b"data: ");
                        chunk.extend_from_slice(&event);
                        chunk.extend_from_slice(b"\n\n");
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(chunk)))));
                    }
                    return Poll::Ready(Some(Err(msg.into())));
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none()
            && self.gathered.is_empty()
            && self.after.is_none()
            && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let ready = self.ready.as_ref().and_then(|f| f.as_ref().ok()).and_then(Frame::data_ref);
        let held = ready.map_or(0, Bytes::len) + self.gathered.len();
        if held == 0 {
            return inner;
        }
        let n = held as u64;
        let mut h = SizeHint::new();
        h.set_lower(inner.lower() + n);
        if let Some(u) = inner.upper() {
            h.set_upper(u + n);
        }
        h
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !self.ended {
            // The client went away mid-stream; dropping `inner` closes the engine's connection,
            // which aborts the request there.
            if let Some(fin) = self.fin.take() {
                fin.cancel("client disconnected");
            }
        }
    }
}

/// A response that streams `incoming` back unchanged (pass-through paths).
pub fn passthrough(status: StatusCode, headers: &HeaderMap, incoming: UpstreamBody) -> Response<Body> {
    let mut r = Response::new(Body::new(incoming));
    *r.status_mut() = status;
    *r.headers_mut() = upstream::response_headers(headers);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathered_frames_join_and_one_stays_as_it_came() {
        let mut g = Gathered::default();
        assert!(g.is_empty() && g.take().is_none());
        let one = Bytes::from_static(b"data: 1\n\n");
        g.push(one.clone());
        assert_eq!(g.len(), one.len());
        let taken = g.take().and_then(|f| f.into_data().ok()).unwrap();
        assert_eq!(taken.as_ptr(), one.as_ptr(), "a single frame is not copied");
        for event in ["data: 1\n\n", "data: 2\n\n", "data: [DONE]\n\n"] {
            g.push(Bytes::from_static(event.as_bytes()));
        }
        assert_eq!(g.len(), 32);
        let joined = g.take().and_then(|f| f.into_data().ok()).unwrap();
        assert_eq!(&joined[..], b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n");
        assert!(g.is_empty() && g.take().is_none());
        g.push(Bytes::from_static(b"x"));
        g.push(Bytes::from_static(b"y"));
        assert_eq!(&g.take().and_then(|f| f.into_data().ok()).unwrap()[..], b"xy", "reused after a take");
    }

    #[test]
    fn a_status_counts_as() {
        for (status, outcome) in [
            (200, Outcome::Ok),
            (204, Outcome::Ok),
            (400, Outcome::ClientError),
            (429, Outcome::ClientError),
            (500, Outcome::EngineError),
            (503, Outcome::EngineError),
            (302, Outcome::EngineError),
        ] {
            assert_eq!(outcome_of(StatusCode::from_u16(status).unwrap()), outcome, "{status}");
        }
    }
}
