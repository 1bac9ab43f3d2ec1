//! vLLM's render endpoints, `POST /v1/completions/render` and `POST /v1/chat/completions/render`:
//! a generation request turned into what the engine would run — its prompt token ids and
//! sampling parameters — without running it. Routers use them to route on tokens
//! (vllm-router's cache-aware policy asks every worker; without them it routes blind).
//! Shapes follow vLLM 0.32's `GenerateRequest`: a list of them for completions (one per
//! prompt), one object for chat.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::engine::Engine;
use crate::openai::{ApiError, Endpoint, GenRequest};
use crate::serve::{check_model, prompt_tokens, request_base};

pub async fn handle(engine: Arc<Engine>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    match render(&engine, endpoint, &headers, &body) {
        Ok(rendered) => Json(rendered).into_response(),
        Err(err) => err.into_response(),
    }
}

fn render(engine: &Engine, endpoint: Endpoint, headers: &HeaderMap, body: &[u8]) -> Result<Value, ApiError> {
    let req = GenRequest::parse(endpoint, body)?;
    check_model(engine, &req)?;
    let (tokens, max_tokens) = prompt_tokens(engine, &req)?;
    let prefix = endpoint.id_prefix();
    let generate = json!({
        "request_id": format!("{prefix}-{}", request_base(headers)),
        "token_ids": tokens,
        "sampling_params": {"max_tokens": max_tokens, "n": 1},
        "model": engine.cfg.model,
        "stream": req.stream,
    });
    Ok(match endpoint {
        Endpoint::Completions => Value::Array(vec![generate]),
        Endpoint::Chat => generate,
    })
}
