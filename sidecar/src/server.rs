//! The HTTP surface: routes, the bearer-token check, the flow a generation request takes (vLLM
//! or SGLang, by `--mode`), pass-through to the engine, health, readiness, metrics,
//! `/pd/release`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, FromRequest, Request, State as AxState};
use axum::middleware::{self, Next};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, Method, Response, StatusCode, Uri};
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
    let r = r.fallback(passthrough).layer(DefaultBodyLimit::max(ctx.cfg.max_body_bytes));
    // Without a token there is nothing to check: no layer (it costs a boxed future per request).
    let r = match ctx.cfg.auth_token {
        Some(_) => r.layer(middleware::from_fn_with_state(Arc::clone(&ctx), auth)),
        None => r,
    };
    r.with_state(app)
}

async fn auth(AxState(ctx): AxState<Arc<Context>>, req: Request, next: Next) -> Response<Body> {
    if let Some(expected) = &ctx.cfg.auth_token {
        let path = req.uri().path();
        let open = matches!(path, "/health" | "/ready" | "/metrics");
        if !open && !expected.admits(req.headers()) {
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

async fn completions(AxState(app): AxState<Shared>, req: Request) -> Response<Body> {
    generation(app, Api::Completions, req).await
}

async fn chat(AxState(app): AxState<Shared>, req: Request) -> Response<Body> {
    generation(app, Api::Chat, req).await
}

async fn generate(AxState(app): AxState<Shared>, req: Request) -> Response<Body> {
    generation(app, Api::Generate, req).await
}

/// Requests with large bodies that may run off the runtime at once (`--offload-body-bytes`).
pub(crate) const OFFLOADS_AT_ONCE: usize = 4;

/// A generation request, on a thread of its own when its body is large
/// (`--offload-body-bytes`) and a permit is free, else on the runtime. The size is judged
/// before the body is read, so that the read's copies move too: by its `Content-Length`, and a
/// body sent in chunks (no length given; rare from HTTP clients) counts as large.
async fn generation(app: Shared, api: Api, req: Request) -> Response<Body> {
    let headers = req.headers();
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let large = match declared {
        Some(len) => len >= app.ctx.cfg.offload_body_bytes,
        None => headers.contains_key(header::TRANSFER_ENCODING),
    };
    if large {
        if let Some(permit) = offload_permit(&app) {
            return offloaded(permit, flow(app, api, req)).await;
        }
    }
    flow(app, api, req).await
}

/// A permit to run a request off the runtime, counted, if one is free.
fn offload_permit(app: &App) -> Option<tokio::sync::OwnedSemaphorePermit> {
    let permit = Arc::clone(&app.offloads).try_acquire_owned().ok()?;
    inc(&app.ctx.metrics.offloaded);
    Some(permit)
}

/// Runs `flow` on a blocking-pool thread whose I/O this runtime still drives: the CPU a large
/// body costs (the read's copies, the parse, the rewrites) is spent there, not on the runtime's
/// thread. Dropping this future (the client left) drops the flow there too, as it would have
/// been dropped here.
async fn offloaded(
    permit: tokio::sync::OwnedSemaphorePermit,
    flow: impl Future<Output = Response<Body>> + Send + 'static,
) -> Response<Body> {
    let runtime = tokio::runtime::Handle::current();
    let (_client_waits, client_left) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        runtime.block_on(async move {
            tokio::select! {
                // A client gone (or the connection closed by a shutdown) wins over a flow that
                // became ready in the same wake-up, as the flow would have been dropped inline.
                biased;
                _ = client_left => None,
                response = flow => Some(response),
            }
        })
    });
    match task.await {
        Ok(Some(response)) => response,
        // A panic in the flow (the sender lives as long as this future, so not a client that left).
        _ => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "the request failed inside the sidecar").response(),
    }
}

/// A generation request: its id, its span and its [`Finish`], then the mode's flow.
async fn flow(app: Shared, api: Api, req: Request) -> Response<Body> {
    // The headers are moved out rather than cloned (what the `HeaderMap` extractor does); the
    // body is read by the `Bytes` extractor, which keeps `DefaultBodyLimit` and its 413.
    let (mut parts, body) = req.into_parts();
    let headers = std::mem::take(&mut parts.headers);
    let path = path_and_query(&parts.uri);
    let body = match Bytes::from_request(Request::from_parts(parts, body), &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
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
    forward(&app, Method::GET, "/metrics".into(), &headers, Bytes::new()).await
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

/// Any other path goes to the engine's first rank untouched (routing headers stripped). The
/// upstream client sends a body whole, so it is read first, within `--max-body-bytes` (413 beyond).
async fn passthrough(AxState(app): AxState<Shared>, req: Request) -> Response<Body> {
    let (mut parts, body) = req.into_parts();
    inc(&app.ctx.metrics.passthrough);
    let (method, path, headers) =
        (parts.method.clone(), path_and_query(&parts.uri), std::mem::take(&mut parts.headers));
    let body = match Bytes::from_request(Request::from_parts(parts, body), &()).await {
        Ok(b) => b,
        Err(rejection) => return rejection.into_response(),
    };
    forward(&app, method, path, &headers, body).await
}

async fn forward(app: &App, method: Method, path: String, headers: &HeaderMap, body: Bytes) -> Response<Body> {
    let (ctx, rid) = (&app.ctx, proxy::request_id(&app.ids, headers));
    let target = app.engines.primary();
    let mut req = http::Request::new(Body::from(body));
    *req.method_mut() = method;
    *req.uri_mut() = match target.url(&path).parse() {
        Ok(u) => u,
        Err(_) => return ApiError::new(StatusCode::BAD_REQUEST, "invalid path").response(),
    };
    *req.headers_mut() = upstream::leg_headers(
        headers,
        LegHeaders { request_id: &rid, authorization: ctx.upstream_authorization(), rewritten: false, identity: false },
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
