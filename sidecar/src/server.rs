//! The HTTP surface: routes, the bearer-token check, the flow a generation request takes (vLLM
//! or SGLang, by `--mode`), pass-through to the engine, health, readiness, metrics,
//! `/pd/release`; and the accept loop (plain or TLS) with graceful drain.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State as AxState};
use axum::middleware::{self, Next};
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode, Uri};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use crate::config::Mode;
use crate::context::Context;
use crate::errors::ApiError;
use crate::finish::Finish;
use crate::metrics::{inc, Outcome};
use crate::proxy;
use crate::release::ReleaseRequest;
use crate::rewrite::Api;
use crate::sglang;
use crate::upstream::{self, LegHeaders};
use crate::App;

type Shared = Arc<App>;

pub fn router(app: Shared) -> Router {
    let ctx = Arc::clone(&app.ctx);
    let mut r = Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/engine/metrics", get(engine_metrics))
        .route("/pd/release", post(pd_release))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat));
    if ctx.cfg.mode == Mode::Sglang {
        r = r.route("/generate", post(generate));
    }
    r.fallback(passthrough)
        .layer(DefaultBodyLimit::max(ctx.cfg.max_body_bytes))
        .layer(middleware::from_fn_with_state(Arc::clone(&ctx), auth))
        .with_state(app)
}

/// Equal-length comparison whose time does not depend on where the inputs differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(AxState(ctx): AxState<Arc<Context>>, req: Request, next: Next) -> Response<Body> {
    if let Some(expected) = &ctx.auth.expected {
        let path = req.uri().path();
        let open = matches!(path, "/health" | "/ready" | "/metrics");
        let given = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes).unwrap_or_default();
        if !open && !same(given, expected.as_bytes()) {
            if Api::from_path(path).is_some() {
                crate::metrics::Tracker::new(&ctx.metrics).finish(Outcome::Unauthorized);
            }
            return ApiError::new(StatusCode::UNAUTHORIZED, "missing or invalid bearer token").response();
        }
    }
    next.run(req).await
}

fn path_and_query(uri: &Uri) -> String {
    uri.path_and_query().map_or_else(|| uri.path().to_string(), |p| p.as_str().to_string())
}

async fn completions(AxState(app): AxState<Shared>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response<Body> {
    generation(app, Api::Completions, path_and_query(&uri), headers, body).await
}

async fn chat(AxState(app): AxState<Shared>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response<Body> {
    generation(app, Api::Chat, path_and_query(&uri), headers, body).await
}

async fn generate(AxState(app): AxState<Shared>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response<Body> {
    generation(app, Api::Generate, path_and_query(&uri), headers, body).await
}

/// A generation request: its id, its span and its [`Finish`], then the mode's flow.
async fn generation(app: Shared, api: Api, path: String, headers: HeaderMap, body: Bytes) -> Response<Body> {
    let rid = proxy::request_id(&app.ids, &headers);
    let span = tracing::info_span!("request", request_id = %rid, api = api.name(), redirect = tracing::field::Empty);
    async {
        let fin = Finish::new(&app.ctx.metrics, app.coordinator.as_ref(), &rid);
        if app.ctx.cfg.mode == Mode::Sglang {
            return sglang::run(&app, api, &path, &headers, &rid, body, fin).await;
        }
        proxy::vllm(&app, api, &path, &headers, &rid, body, fin).await
    }
    .instrument(span)
    .await
}

async fn metrics(AxState(app): AxState<Shared>) -> Response<Body> {
    let mut r = Response::new(Body::from(app.ctx.metrics.render()));
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

/// Ready when every engine rank's `/health` answers 2xx.
async fn ready(AxState(app): AxState<Shared>) -> Response<Body> {
    let checks = app.engines.all().iter().map(|t| {
        let ctx = Arc::clone(&app.ctx);
        let t = t.clone();
        async move {
            let req = upstream::json_request(Method::GET, &t.url("/health"), None).ok()?;
            let resp = upstream::send(&ctx.client, &t, req, Duration::from_secs(2)).await.ok()?;
            let ok = resp.status().is_success();
            let _ = upstream::collect(&t, resp.into_body(), 64 << 10, Duration::from_secs(1)).await;
            Some(ok)
        }
    });
    let results = futures_util::future::join_all(checks).await;
    let ready = results.iter().all(|r| *r == Some(true));
    let engines: Vec<serde_json::Value> = app
        .engines
        .all()
        .iter()
        .zip(&results)
        .map(|(t, r)| serde_json::json!({"engine": t.base, "healthy": *r == Some(true)}))
        .collect();
    let body = serde_json::json!({"ready": ready, "engines": engines});
    let mut r = Response::new(Body::from(body.to_string()));
    *r.status_mut() = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

async fn engine_metrics(AxState(app): AxState<Shared>, headers: HeaderMap) -> Response<Body> {
    forward(&app, Method::GET, "/metrics".into(), &headers, Body::empty()).await
}

/// `POST /pd/release {"request_id", "kv_transfer_params"}`: frees held blocks now.
async fn pd_release(AxState(app): AxState<Shared>, body: Bytes) -> Response<Body> {
    let req: ReleaseRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::new(StatusCode::BAD_REQUEST, format!("invalid release request: {e}")).response(),
    };
    if !req.kv_transfer_params.get().trim_start().starts_with('{') {
        return ApiError::new(StatusCode::BAD_REQUEST, "kv_transfer_params must be an object").response();
    }
    match app.releaser.release(&req.request_id, req.kv_transfer_params.get(), None, None).await {
        Ok(method) => {
            let mut r = Response::new(Body::from(format!("{{\"released\":true,\"method\":\"{method}\"}}")));
            r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            r
        }
        Err(e) => ApiError::bad_gateway(format!("release failed: {e}")).response(),
    }
}

/// Any other path goes to the engine's first rank untouched (routing headers stripped).
async fn passthrough(AxState(app): AxState<Shared>, req: Request) -> Response<Body> {
    let (parts, body) = req.into_parts();
    inc(&app.ctx.metrics.passthrough);
    forward(&app, parts.method, path_and_query(&parts.uri), &parts.headers, body).await
}

async fn forward(app: &App, method: Method, path: String, headers: &HeaderMap, body: Body) -> Response<Body> {
    let (ctx, rid) = (&app.ctx, proxy::request_id(&app.ids, headers));
    let target = app.engines.primary();
    let mut req = http::Request::new(body);
    *req.method_mut() = method;
    *req.uri_mut() = match target.url(&path).parse() {
        Ok(u) => u,
        Err(_) => return ApiError::new(StatusCode::BAD_REQUEST, "invalid path").response(),
    };
    *req.headers_mut() = upstream::leg_headers(
        headers,
        LegHeaders { request_id: &rid, authorization: ctx.auth.upstream.as_ref(), rewritten: false, identity: false },
        &[],
    );
    match upstream::send(&ctx.client, target, req, ctx.cfg.decode_first_byte_timeout).await {
        Ok(resp) => {
            let (parts, incoming) = resp.into_parts();
            crate::decode::passthrough(parts.status, &parts.headers, incoming)
        }
        Err(e) if e.is_connect() => ApiError::unavailable(format!("the engine is unavailable: {e}")).response(),
        Err(e) => ApiError::bad_gateway(e.to_string()).response(),
    }
}

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
