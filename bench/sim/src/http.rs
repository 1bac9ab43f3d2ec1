//! The HTTP surface: OpenAI-compatible generation, vLLM's operational endpoints, and the
//! simulator's admin endpoints (failure injection, leak report, pool layout).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use serde_json::json;

use crate::engine::Engine;
use crate::faults::FaultSettings;
use crate::openai::{ApiError, Endpoint};
use crate::serve;

pub fn router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions/render", post(render_completions))
        .route("/v1/chat/completions/render", post(render_chat))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/version", get(|| async { Json(json!({"version": "0.32.0+pdsim"})) }))
        .route("/metrics", get(metrics))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/admin/faults", get(get_faults).post(set_faults))
        .route("/admin/leaks", get(leaks))
        .route("/admin/pool", get(pool))
        .route("/admin/reserve", post(reserve))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "Not Found") })
        .with_state(engine)
}

async fn completions(State(engine): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    serve::handle(engine, Endpoint::Completions, headers, body).await
}

async fn chat(State(engine): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    serve::handle(engine, Endpoint::Chat, headers, body).await
}

async fn render_completions(State(engine): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    crate::render::handle(engine, Endpoint::Completions, headers, body).await
}

async fn render_chat(State(engine): State<Arc<Engine>>, headers: HeaderMap, body: Bytes) -> Response {
    crate::render::handle(engine, Endpoint::Chat, headers, body).await
}

/// SGLang's server info, the field a sidecar reads: the simulator computes every prompt itself
/// (SGLang's plain `"null"` mode), also when it serves bootstrap rooms.
async fn server_info(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    Json(
        json!({"disaggregation_mode": "null", "served_model_name": engine.cfg.model, "page_size": engine.cfg.block_size}),
    )
}

async fn models(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    let created = engine.started.elapsed().as_secs();
    let model = &engine.cfg.model;
    Json(json!({"object": "list", "data": [{
        "id": model, "object": "model", "created": crate::respond::unix_now() - created, "owned_by": "vllm",
        "root": model, "parent": null, "max_model_len": engine.cfg.max_model_len, "permission": []
    }]}))
}

async fn metrics(State(engine): State<Arc<Engine>>) -> Response {
    let text = engine.metrics.render(&engine.cfg.model, &engine.engine_id, &engine.gauges());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn reset_prefix_cache(State(engine): State<Arc<Engine>>) -> StatusCode {
    engine.reset_prefix_cache();
    StatusCode::OK
}

async fn get_faults(State(engine): State<Arc<Engine>>) -> Json<FaultSettings> {
    Json(engine.faults.settings())
}

async fn set_faults(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let settings: FaultSettings = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return ApiError::bad_request(format!("invalid fault settings: {e}"), None).into_response(),
    };
    if settings.crash == Some(true) {
        tracing::error!("crash injected through the admin endpoint");
        // Like a killed engine: no cleanup, no answer.
        std::process::exit(70);
    }
    match engine.faults.apply(&settings) {
        Ok(()) => Json(engine.faults.settings()).into_response(),
        Err(e) => ApiError::bad_request(e.to_string(), None).into_response(),
    }
}

/// Everything a test asserts on to show that nothing leaked.
#[derive(Debug, Serialize)]
pub struct LeakReport {
    pub used_blocks: usize,
    pub held_blocks: usize,
    pub active_leases: usize,
    pub active_rooms: usize,
    pub running: usize,
    pub waiting: usize,
    pub leases_started: u64,
    pub leases_done: u64,
    pub expired_leases: u64,
    pub failed_pulls: u64,
    pub verification_failures: u64,
    pub invalid_params: u64,
    pub recomputed: u64,
    pub pulls: u64,
    pub granted_pulls: u64,
    pub bytes_pulled: u64,
    pub heartbeats_sent: u64,
    pub heartbeats_received: u64,
    pub rooms_timed_out: u64,
    pub rooms_rejected: u64,
    pub grants_issued: u64,
    pub grants_revoked: u64,
    pub late_reads_refused: u64,
}

async fn leaks(State(engine): State<Arc<Engine>>) -> Json<LeakReport> {
    let g = engine.gauges();
    let used_blocks = engine.state.lock().pool.used();
    let m = &engine.metrics;
    Json(LeakReport {
        used_blocks,
        held_blocks: g.held_blocks,
        active_leases: g.leases,
        active_rooms: g.rooms,
        running: g.running,
        waiting: g.waiting,
        leases_started: m.leases_started.load(Relaxed),
        leases_done: m.leases_done.load(Relaxed),
        expired_leases: m.expired_leases.load(Relaxed),
        failed_pulls: m.failed_pulls.load(Relaxed),
        verification_failures: m.verification_failures.load(Relaxed),
        invalid_params: m.invalid_params.load(Relaxed),
        recomputed: m.recomputed.load(Relaxed),
        pulls: m.pulls_ok.load(Relaxed),
        granted_pulls: m.granted_pulls.load(Relaxed),
        bytes_pulled: m.bytes_pulled.load(Relaxed),
        heartbeats_sent: m.heartbeats_sent.load(Relaxed),
        heartbeats_received: m.heartbeats_received.load(Relaxed),
        grants_issued: m.grants_issued.load(Relaxed),
        grants_revoked: m.grants_revoked.load(Relaxed),
        late_reads_refused: m.late_reads_refused.load(Relaxed),
        rooms_timed_out: m.rooms_timed_out.load(Relaxed),
        rooms_rejected: m.rooms_rejected.load(Relaxed),
    })
}

async fn pool(State(engine): State<Arc<Engine>>) -> Json<serde_json::Value> {
    let cfg = &engine.cfg;
    Json(json!({
        "engine_id": engine.engine_id, "block_size": cfg.block_size, "bytes_per_token": cfg.bytes_per_token,
        "block_bytes": cfg.block_bytes(), "num_blocks": cfg.num_blocks,
        "shm_path": engine.memory.shm_path().map(|p| p.display().to_string()),
        "xfer_host": cfg.host_ip, "xfer_port": engine.xfer_port,
    }))
}

#[derive(Debug, serde::Deserialize)]
struct ReserveRequest {
    num_blocks: usize,
}

/// Sidecar-pull mode: blocks for a co-located process to fill (see `/admin/pool` for where
/// they are); a decode request then names the reservation in its `kv_transfer_params`.
async fn reserve(State(engine): State<Arc<Engine>>, body: Bytes) -> Response {
    let req: ReserveRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::bad_request(format!("invalid reservation request: {e}"), None).into_response(),
    };
    if req.num_blocks == 0 || req.num_blocks > engine.cfg.num_blocks {
        return ApiError::bad_request("num_blocks out of range", Some("num_blocks")).into_response();
    }
    match engine.reserve_for_sidecar(req.num_blocks) {
        Ok((id, blocks)) => Json(json!({"reservation_id": id, "block_ids": blocks,
                                        "lease_secs": engine.cfg.kv_lease.as_secs_f64()}))
        .into_response(),
        Err(full) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, full.to_string()).into_response(),
    }
}
