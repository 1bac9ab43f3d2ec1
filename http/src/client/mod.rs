//! A lean HTTP/1.1 client for the sidecar's upstream calls: pooled keep-alive connections
//! (plain or rustls), one request at a time per connection, and the response read by the task
//! that awaits it. hyper's client hands every request and every body frame between the caller
//! and a connection task; here the caller writes the request and reads the answer itself, so an
//! exchange costs its system calls and little more.
//!
//! A request's body is sent whole before its answer is read. An idle connection is reused only
//! while nothing (not even its close) has arrived on it. A request on a reused connection is sent
//! once more, on a new connection, where the server cannot have acted on it: writing it failed,
//! or the connection had been idle long enough for the server's keep-alive timeout to close it
//! under the request and it ended before any byte of the answer. One idle for less than that
//! which ends unanswered is an error: its server may have read the request (a prefill) and died.

mod body;
mod conn;
pub mod framing;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, TRANSFER_ENCODING};
use http::{HeaderMap, Method, Request, Response, Uri};
use http_body::Body as HttpBody;
use http_body_util::BodyExt;
use rustls_pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub use body::Body;
use conn::{Origin, Pool, Stream};
use framing::FramingError;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body sent in one write with its head at most this large; a larger one follows the
/// head in a write of its own, without a copy.
const JOIN_BODY_BYTES: usize = 64 << 10;
/// A reused connection that ends before any byte of the answer was idle at least this long
/// before its request is taken to have been closed by the server's keep-alive timeout (uvicorn's
/// default, vLLM's and SGLang's, is 5 s), so the request is sent again.
const RESEND_AFTER_IDLE: Duration = Duration::from_secs(1);
/// The read buffer grows by at least this much.
const READ_BYTES: usize = 16 << 10;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid request URI {uri:?}: {reason}")]
    Uri { uri: String, reason: &'static str },
    #[error("cannot connect to {origin}: {error}")]
    Connect { origin: String, error: io::Error },
    #[error("connecting to {origin} took over {secs} s")]
    ConnectTimeout { origin: String, secs: f64 },
    #[error("TLS handshake with {origin}: {error}")]
    Tls { origin: String, error: io::Error },
    #[error("the request's body: {0}")]
    RequestBody(BoxError),
    #[error("connection to {origin}: {error}")]
    Io { origin: String, error: io::Error },
    #[error("{origin}: {error}")]
    Response { origin: String, error: FramingError },
}

impl ClientError {
    /// No connection was made: nothing reached the server.
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Connect { .. } | ClientError::ConnectTimeout { .. } | ClientError::Tls { .. })
    }
}

/// Settings of a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub connect_timeout: Duration,
    pub tcp_keepalive: Option<Duration>,
    /// An idle connection is closed after this long.
    pub idle_timeout: Duration,
    pub max_idle_per_origin: usize,
    pub tls: Arc<rustls::ClientConfig>,
}

/// The client; clones share the pool.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: ClientConfig,
    pool: Arc<Pool>,
    tls: tokio_rustls::TlsConnector,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("idle_connections", &self.idle_connections()).finish_non_exhaustive()
    }
}

impl Client {
    pub fn new(cfg: ClientConfig) -> Client {
        let pool = Pool::new(cfg.idle_timeout, cfg.max_idle_per_origin);
        let tls = tokio_rustls::TlsConnector::from(Arc::clone(&cfg.tls));
        Client { inner: Arc::new(Inner { cfg, pool, tls }) }
    }

    /// Idle connections in the pool now.
    pub fn idle_connections(&self) -> usize {
        self.inner.pool.idle_count()
    }

    /// Sends `req` (an absolute `http` or `https` URI) and reads the response head. The body is
    /// collected whole first, so callers bound its size; nothing is bounded in time but
    /// connecting, so callers bound the whole.
    pub async fn request<B>(&self, req: Request<B>) -> Result<Response<Body>, ClientError>
    where
        B: HttpBody<Data = Bytes> + Unpin,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = req.into_parts();
        let target = Target::of(&parts.uri)?;
        let body = body.collect().await.map_err(|e| ClientError::RequestBody(e.into()))?.to_bytes();
        let message = encode_request(&parts.method, &target, &parts.headers, &body);
        // A body too large to join the head follows it in a write of its own.
        let rest = (body.len() > JOIN_BODY_BYTES).then_some(&body);
        let pooled = self.inner.pool.take(&target.origin, Instant::now());
        let idle_for = pooled.as_ref().map(|&(_, idle_for)| idle_for);
        let stream = match pooled {
            Some((s, _)) => s,
            None => self.connect(&target.origin).await?,
        };
        let resend = |f: &Failure| match (idle_for, f.stage) {
            (None, _) | (_, Stage::Answered) => false,
            (Some(_), Stage::Sending) => true,
            (Some(idle_for), Stage::Unanswered) => idle_for >= RESEND_AFTER_IDLE,
        };
        match self.exchange(stream, &target.origin, &parts.method, &message, rest).await {
            Err(f) if resend(&f) => {
                tracing::debug!(origin = %target.origin, "a kept connection was closed under the request; sending again");
                let stream = self.connect(&target.origin).await?;
                self.exchange(stream, &target.origin, &parts.method, &message, rest).await.map_err(|f| f.error)
            }
            result => result.map_err(|f| f.error),
        }
    }

    async fn exchange(
        &self,
        mut stream: Stream,
        origin: &Origin,
        method: &Method,
        message: &[u8],
        rest: Option<&Bytes>,
    ) -> Result<Response<Body>, Failure> {
        let io_error = |error: io::Error, stage: Stage| Failure {
            stage,
            error: ClientError::Io { origin: origin.to_string(), error },
        };
        stream.write_all(message).await.map_err(|e| io_error(e, Stage::Sending))?;
        if let Some(rest) = rest {
            stream.write_all(rest).await.map_err(|e| io_error(e, Stage::Sending))?;
        }
        stream.flush().await.map_err(|e| io_error(e, Stage::Sending))?;

        let mut buf = BytesMut::with_capacity(READ_BYTES);
        let mut answered = false;
        loop {
            if buf.capacity() - buf.len() < 1024 {
                buf.reserve(READ_BYTES);
            }
            let read = stream.read_buf(&mut buf).await;
            let stage = if answered { Stage::Answered } else { Stage::Unanswered };
            let n = read.map_err(|e| io_error(e, stage))?;
            answered |= n > 0;
            if n == 0 {
                let error = FramingError::Truncated("before the response head");
                return Err(Failure { stage, error: ClientError::Response { origin: origin.to_string(), error } });
            }
            // Interim answers (100 Continue, 103) are skipped.
            while let Some(head) = framing::take_head(&mut buf, method).map_err(|error| Failure {
                stage: Stage::Answered,
                error: ClientError::Response { origin: origin.to_string(), error },
            })? {
                if head.status.is_informational() {
                    continue;
                }
                let framing::Head { status, version, headers, framing, keep_alive } = head;
                let pool = keep_alive.then(|| Arc::clone(&self.inner.pool));
                let body = Body::new(stream, buf, framing, origin.clone(), pool);
                let mut response = Response::new(body);
                *response.status_mut() = status;
                *response.version_mut() = version;
                *response.headers_mut() = headers;
                return Ok(response);
            }
        }
    }

    async fn connect(&self, origin: &Origin) -> Result<Stream, ClientError> {
        let cfg = &self.inner.cfg;
        let timed_out =
            || ClientError::ConnectTimeout { origin: origin.to_string(), secs: cfg.connect_timeout.as_secs_f64() };
        let connect_error = |error| ClientError::Connect { origin: origin.to_string(), error };
        let deadline = tokio::time::Instant::now() + cfg.connect_timeout;
        let tcp = match origin.host.parse::<std::net::IpAddr>() {
            Ok(ip) => tokio::time::timeout_at(deadline, TcpStream::connect(SocketAddr::new(ip, origin.port))).await,
            Err(_) => tokio::time::timeout_at(deadline, TcpStream::connect((origin.host.as_str(), origin.port))).await,
        }
        .map_err(|_| timed_out())?
        .map_err(connect_error)?;
        tcp.set_nodelay(true).map_err(connect_error)?;
        if let Some(idle) = cfg.tcp_keepalive {
            socket2::SockRef::from(&tcp)
                .set_tcp_keepalive(&socket2::TcpKeepalive::new().with_time(idle))
                .map_err(connect_error)?;
        }
        if !origin.tls {
            return Ok(Stream::Plain(tcp));
        }
        let name = ServerName::try_from(origin.host.clone()).map_err(|_| ClientError::Tls {
            origin: origin.to_string(),
            error: io::Error::new(io::ErrorKind::InvalidInput, "not a valid server name"),
        })?;
        let tls = tokio::time::timeout_at(deadline, self.inner.tls.connect(name, tcp))
            .await
            .map_err(|_| timed_out())?
            .map_err(|error| ClientError::Tls { origin: origin.to_string(), error })?;
        Ok(Stream::Tls(Box::new(tls)))
    }
}

/// An exchange that failed, and how far it had got.
struct Failure {
    stage: Stage,
    error: ClientError,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Writing the request failed.
    Sending,
    /// The request was written; no byte of an answer arrived.
    Unanswered,
    /// Part of an answer arrived.
    Answered,
}

/// The parts of a request URI the client uses.
struct Target<'a> {
    origin: Origin,
    authority: &'a str,
    path: &'a str,
}

impl<'a> Target<'a> {
    fn of(uri: &'a Uri) -> Result<Target<'a>, ClientError> {
        let bad = |reason| ClientError::Uri { uri: uri.to_string(), reason };
        let tls = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            Some(_) => return Err(bad("the scheme is neither http nor https")),
            None => return Err(bad("not an absolute URI")),
        };
        let authority = uri.authority().ok_or_else(|| bad("no host"))?;
        let host = authority.host();
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        let port = authority.port_u16().unwrap_or(if tls { 443 } else { 80 });
        let path = uri.path_and_query().map_or("/", |p| p.as_str());
        Ok(Target { origin: Origin { tls, host: host.to_string(), port }, authority: authority.as_str(), path })
    }
}

/// The request's head, then its body when that is at most [`JOIN_BODY_BYTES`]. The client
/// frames the body itself, so the caller's framing and connection headers are not sent.
fn encode_request(method: &Method, target: &Target<'_>, headers: &HeaderMap, body: &Bytes) -> Vec<u8> {
    use std::io::Write;
    let joined = if body.len() <= JOIN_BODY_BYTES { body.len() } else { 0 };
    let mut head = Vec::with_capacity(256 + headers.len() * 64 + joined);
    head.extend_from_slice(method.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.path.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    if !headers.contains_key(HOST) {
        head.extend_from_slice(b"host: ");
        head.extend_from_slice(target.authority.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    for (name, value) in headers {
        if name == CONTENT_LENGTH || name == TRANSFER_ENCODING || name == CONNECTION {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    // A request without a body says so only where one is expected.
    let bodiless = matches!(*method, Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE);
    if !body.is_empty() || !bodiless {
        // Writing to a Vec cannot fail.
        let _ = write!(head, "content-length: {}\r\n", body.len());
    }
    head.extend_from_slice(b"\r\n");
    if joined > 0 {
        head.extend_from_slice(body);
    }
    head
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_frame_the_body_themselves() {
        let uri: Uri = "http://127.0.0.1:8000/v1/completions?x=1".parse().unwrap();
        let target = Target::of(&uri).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-request-id", "r1".parse().unwrap());
        headers.insert("content-length", "999".parse().unwrap());
        headers.insert("transfer-encoding", "chunked".parse().unwrap());
        headers.insert("connection", "close".parse().unwrap());
        let encode = |method: &Method, headers: &HeaderMap, body: &Bytes| {
            String::from_utf8(encode_request(method, &target, headers, body)).unwrap()
        };
        assert_eq!(
            encode(&Method::POST, &headers, &Bytes::from_static(b"hello")),
            "POST /v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nx-request-id: r1\r\ncontent-length: 5\r\n\r\nhello"
        );
        let empty = Bytes::new();
        assert_eq!(
            encode(&Method::GET, &HeaderMap::new(), &empty),
            "GET /v1/completions?x=1 HTTP/1.1\r\nhost: 127.0.0.1:8000\r\n\r\n"
        );
        assert!(encode(&Method::POST, &HeaderMap::new(), &empty).ends_with("content-length: 0\r\n\r\n"));
        // A large body is not joined: it follows the head in a write of its own.
        let large = Bytes::from(vec![b'x'; JOIN_BODY_BYTES + 1]);
        let head = encode(&Method::POST, &HeaderMap::new(), &large);
        assert!(head.ends_with(&format!("content-length: {}\r\n\r\n", JOIN_BODY_BYTES + 1)), "{head}");
    }

    #[test]
    fn targets_need_an_absolute_http_uri() {
        let t = |s: &str| Target::of(&s.parse::<Uri>().unwrap()).map(|t| (t.origin, t.path.to_string()));
        let o = |tls, host: &str, port| Origin { tls, host: host.into(), port };
        assert_eq!(t("http://a:1/p").unwrap(), (o(false, "a", 1), "/p".into()));
        assert_eq!(t("https://a").unwrap(), (o(true, "a", 443), "/".into()));
        assert_eq!(t("http://[::1]:9/").unwrap(), (o(false, "::1", 9), "/".into()));
        assert!(matches!(t("/relative"), Err(ClientError::Uri { .. })));
        assert!(matches!(t("ftp://a/"), Err(ClientError::Uri { .. })));
    }
}
