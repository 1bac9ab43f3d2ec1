//! The HTTP/JSON edge (axum): routes of API.md onto the [`Coordinator`]'s operations. Bodies
//! are parsed here so that every malformed one gets an OpenAI-style 400.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use crate::api::{ApiError, EngineSpecJson, Heartbeat, PairRequestJson, ReportJson};
use crate::daemon::Coordinator;

/// Largest request body accepted (a long prompt's token ids fit).
const MAX_BODY: usize = 16 << 20;
/// A pairing body from this size on is joined and parsed off the runtime, as long prompts are
/// hashed: four 16 MiB bodies of token ids held /health for 77-123 ms on the two workers
/// parsing them (coordinator/README.md).
const INLINE_PAIR_BODY: usize = 256 << 10;

type Shared = State<Arc<Coordinator>>;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.body())).into_response()
    }
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// A request body as it arrived, in frames, up to [`MAX_BODY`] bytes in all. The frames are
/// joined only where the body is used: joining copies every byte, some milliseconds for the
/// largest body, which a large pairing does off the runtime.
struct Body {
    frames: Vec<Bytes>,
    len: usize,
}

impl<S: Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(request: Request, _: &S) -> Result<Self, ApiError> {
        let mut data = request.into_body().into_data_stream();
        let mut body = Body { frames: Vec::new(), len: 0 };
        while let Some(frame) = data.next().await {
            let frame = frame.map_err(|e| ApiError::BadRequest(format!("reading the request body: {e}")))?;
            body.len += frame.len();
            if body.len > MAX_BODY {
                return Err(ApiError::TooLarge(MAX_BODY));
            }
            body.frames.push(frame);
        }
        Ok(body)
    }
}

impl Body {
    fn join(mut self) -> Bytes {
        if self.frames.len() == 1 {
            return self.frames.swap_remove(0);
        }
        let mut joined = Vec::with_capacity(self.len);
        for frame in &self.frames {
            joined.extend_from_slice(frame);
        }
        joined.into()
    }
}

pub fn router(coordinator: Arc<Coordinator>) -> Router {
    Router::new()
        .route("/v1/engines", post(register).get(list))
        .route("/v1/engines/{id}", axum::routing::delete(deregister))
        .route("/v1/engines/{id}/heartbeat", post(heartbeat))
        .route("/v1/nodes/{node}/down", post(node_down))
        .route("/v1/pair", post(pair))
        .route("/v1/report", post(report))
        .route("/v1/index/stats", get(index_stats))
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::NotFound("no such route".into()) })
        .method_not_allowed_fallback(|| async {
            let error = ApiError::BadRequest("method not allowed".into());
            let mut body = error.body();
            body["error"]["code"] = 405.into();
            (StatusCode::METHOD_NOT_ALLOWED, Json(body))
        })
        .layer(middleware::from_fn_with_state(Arc::clone(&coordinator), authorize))
        .with_state(coordinator)
}

/// With `--auth-token`, every route but /health and /metrics needs the bearer token.
async fn authorize(State(c): Shared, request: Request, next: Next) -> Response {
    if let Some(token) = &c.config.auth_token {
        let open = matches!(request.uri().path(), "/health" | "/metrics");
        if !open && !token.admits(request.headers()) {
            let mut response = ApiError::Unauthorized.into_response();
            response.headers_mut().insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            return response;
        }
    }
    next.run(request).await
}

async fn register(State(c): Shared, body: Body) -> Result<impl IntoResponse, ApiError> {
    let spec: EngineSpecJson = parse(&body.join())?;
    Ok(Json(c.register(spec).await?))
}

async fn heartbeat(State(c): Shared, Path(id): Path<String>, body: Body) -> Result<impl IntoResponse, ApiError> {
    let body = body.join();
    let body: Heartbeat = if body.iter().all(u8::is_ascii_whitespace) { Heartbeat::default() } else { parse(&body)? };
    Ok(Json(c.heartbeat(&id, body.load).await?))
}

async fn deregister(State(c): Shared, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    c.deregister(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn node_down(State(c): Shared, Path(node): Path<String>) -> Result<impl IntoResponse, ApiError> {
    Ok(Json(c.node_down(&node).await?))
}

async fn list(State(c): Shared) -> impl IntoResponse {
    Json(c.list())
}

async fn pair(State(c): Shared, body: Body) -> Result<impl IntoResponse, ApiError> {
    let decision = if body.len >= INLINE_PAIR_BODY {
        c.off_runtime(body.len, move |c| c.pair(parse_pair(c, &body.join())?)).await?
    } else {
        c.pair_without_blocking(parse_pair(&c, &body.join())?).await?
    };
    Ok(Json(decision))
}

fn parse_pair(c: &Coordinator, body: &[u8]) -> Result<PairRequestJson, ApiError> {
    parse(body).inspect_err(|_| crate::metrics::inc(&c.metrics.pair_invalid))
}

async fn report(State(c): Shared, body: Body) -> Result<StatusCode, ApiError> {
    let report: ReportJson = parse(&body.join())?;
    c.report(report)?;
    Ok(StatusCode::NO_CONTENT)
}

async fn index_stats(State(c): Shared) -> impl IntoResponse {
    Json(c.index_stats())
}

async fn metrics(State(c): Shared) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], c.render_metrics())
}
