//! A connection to an upstream (plain TCP or TLS over it), and the idle ones kept per origin.

use std::collections::HashMap;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// Where a connection goes: scheme, host and port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Origin {
    pub tls: bool,
    pub host: String,
    pub port: u16,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls { "https" } else { "http" };
        write!(f, "{scheme}://{}:{}", self.host, self.port)
    }
}

pub enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }

    /// Whether an idle connection is still usable: nothing has arrived on it, not even its end.
    /// Checked from the runtime's readiness first, so a quiet connection costs no system call.
    fn is_quiet(&self) -> bool {
        let mut byte = [0u8; 1];
        let mut buf = ReadBuf::new(&mut byte);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        matches!(self.tcp().poll_peek(&mut cx, &mut buf), Poll::Pending)
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

struct Idle {
    stream: Stream,
    since: Instant,
}

/// Idle keep-alive connections per origin, newest last. Connections idle longer than the
/// timeout are closed: when their origin is next used, and by a sweep that runs while any
/// connection is idle.
pub struct Pool {
    idle: Mutex<HashMap<Origin, Vec<Idle>>>,
    idle_timeout: Duration,
    max_idle_per_origin: usize,
    sweeping: std::sync::atomic::AtomicBool,
}

impl Pool {
    pub fn new(idle_timeout: Duration, max_idle_per_origin: usize) -> Arc<Pool> {
        Arc::new(Pool {
            idle: Mutex::new(HashMap::new()),
            idle_timeout,
            max_idle_per_origin,
            sweeping: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The most recently used connection to `origin` that is still quiet, and how long it was
    /// idle.
    pub fn take(&self, origin: &Origin, now: Instant) -> Option<(Stream, Duration)> {
        let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        let list = idle.get_mut(origin)?;
        while let Some(conn) = list.pop() {
            let idle_for = now.duration_since(conn.since);
            if idle_for < self.idle_timeout && conn.stream.is_quiet() {
                return Some((conn.stream, idle_for));
            }
        }
        None
    }

    /// Keeps `stream` for the next request to `origin`.
    pub fn put(self: &Arc<Self>, origin: &Origin, stream: Stream, now: Instant) {
        {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let list = idle.entry(origin.clone()).or_default();
            if list.len() >= self.max_idle_per_origin {
                return;
            }
            list.push(Idle { stream, since: now });
        }
        self.start_sweeping();
    }

    /// Idle connections now.
    pub fn idle_count(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).values().map(Vec::len).sum()
    }

    fn start_sweeping(self: &Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.sweeping.load(Ordering::Relaxed) || self.sweeping.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.sweeping.store(false, Ordering::Release);
            return;
        };
        let pool = Arc::downgrade(self);
        let every = (self.idle_timeout / 2).max(Duration::from_millis(10));
        runtime.spawn(sweep(pool, every));
    }
}

/// Closes expired idle connections every `every` until none is left (or the pool is gone).
async fn sweep(pool: Weak<Pool>, every: Duration) {
    use std::sync::atomic::Ordering;
    loop {
        tokio::time::sleep(every).await;
        let Some(pool) = pool.upgrade() else { return };
        let now = Instant::now();
        let mut idle = pool.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.retain(|_, list| {
            list.retain(|c| now.duration_since(c.since) < pool.idle_timeout);
            !list.is_empty()
        });
        if idle.is_empty() {
            pool.sweeping.store(false, Ordering::Release);
            return;
        }
    }
}
