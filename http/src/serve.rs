//! The accept loop: HTTP/1.1, plain or TLS, until shutdown; then a bounded drain.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};

/// Counts open connections so a shutdown can wait for them.
#[derive(Debug, Default)]
struct Connections {
    open: AtomicUsize,
    closed: Notify,
}

struct ConnGuard(Arc<Connections>);

impl Drop for ConnGuard {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Relaxed) == 1 {
            self.0.closed.notify_waiters();
        }
    }
}

/// Serves `app` on `listener` (TLS when `tls` is set) until `shutdown` resolves, then lets
/// open connections finish their requests for up to `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: impl Future<Output = ()>,
    drain: Duration,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let conns = Arc::new(Connections::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // Out of descriptors and the like: pause instead of spinning.
                    tracing::warn!(%e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let acceptor = acceptor.clone();
        let mut stop = stop_rx.clone();
        conns.open.fetch_add(1, Relaxed);
        let guard = ConnGuard(Arc::clone(&conns));
        tokio::spawn(async move {
            let _guard = guard;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(Duration::from_secs(30)).keep_alive(true);
            macro_rules! drive {
                ($io:expr) => {{
                    let conn = builder.serve_connection(TokioIo::new($io), service);
                    tokio::pin!(conn);
                    tokio::select! {
                        r = conn.as_mut() => r,
                        _ = async { let _ = stop.wait_for(|s| *s).await.map(drop); } => {
                            conn.as_mut().graceful_shutdown();
                            conn.await
                        }
                    }
                }};
            }
            let result = match acceptor {
                None => drive!(stream),
                Some(acceptor) => match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => drive!(tls),
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            if let Err(e) = result {
                tracing::debug!(%peer, %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    let wait = async {
        loop {
            let closed = conns.closed.notified();
            if conns.open.load(Relaxed) == 0 {
                return;
            }
            closed.await;
        }
    };
    if tokio::time::timeout(drain, wait).await.is_err() {
        tracing::warn!(open = conns.open.load(Relaxed), "drain timeout; closing the remaining connections");
    }
}
