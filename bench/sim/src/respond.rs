//! Turning generated tokens into vLLM-shaped responses: one JSON body, or an SSE stream of
//! chunks ending with `data: [DONE]`.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use pd_protocols::kv_params::KvTransferParams;
use tokio::sync::mpsc;

use crate::openai::{self, ChatChoice, ChatChunkChoice, Chunk, CompletionChoice, Delta, Endpoint, Message, Usage};

/// What every response of one request shares.
#[derive(Debug)]
pub struct Meta {
    pub id: String,
    pub model: String,
    pub created: u64,
    pub endpoint: Endpoint,
    pub prompt_tokens: usize,
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn json_response(bytes: Vec<u8>) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], bytes).into_response()
}

/// The non-streaming body.
pub fn full(meta: &Meta, text: &str, completion_tokens: usize, kv: Option<&KvTransferParams>) -> Response {
    let usage = Usage::new(meta.prompt_tokens, completion_tokens);
    let bytes = match meta.endpoint {
        Endpoint::Completions => serde_json::to_vec(&openai::Body {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: [CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some("length"),
                stop_reason: None,
                prompt_logprobs: Some(None),
            }],
            service_tier: None,
            system_fingerprint: None,
            usage,
            prompt_logprobs: None,
            kv_transfer_params: kv,
        }),
        Endpoint::Chat => serde_json::to_vec(&openai::Body {
            id: &meta.id,
            object: "chat.completion",
            created: meta.created,
            model: &meta.model,
            choices: [ChatChoice {
                index: 0,
                message: Message {
                    role: "assistant",
                    content: text,
                    refusal: None,
                    annotations: None,
                    audio: None,
                    function_call: None,
                    tool_calls: [],
                    reasoning_content: None,
                },
                logprobs: None,
                finish_reason: "length",
                stop_reason: None,
            }],
            service_tier: None,
            system_fingerprint: None,
            usage,
            prompt_logprobs: Some(None),
            kv_transfer_params: kv,
        }),
    };
    json_response(bytes.expect("serialising plain structs cannot fail"))
}

fn sse(json: Vec<u8>) -> Bytes {
    let mut out = Vec::with_capacity(json.len() + 8);
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(&json);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// One streamed piece: `role_chunk` (chat's opening delta), a token's text, or the last one.
pub fn chunk(meta: &Meta, text: &str, first: bool, finish: Option<&str>) -> Bytes {
    let json = match meta.endpoint {
        Endpoint::Completions => serde_json::to_vec(&Chunk {
            id: &meta.id,
            object: "text_completion",
            created: meta.created,
            model: &meta.model,
            choices: vec![CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: finish,
                stop_reason: None,
                prompt_logprobs: None,
            }],
            usage: None,
        }),
        Endpoint::Chat => serde_json::to_vec(&Chunk {
            id: &meta.id,
            object: "chat.completion.chunk",
            created: meta.created,
            model: &meta.model,
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: Delta { role: first.then_some("assistant"), content: text },
                logprobs: None,
                finish_reason: finish,
                stop_reason: finish.map(|_| None),
            }],
            usage: None,
        }),
    };
    sse(json.expect("serialising plain structs cannot fail"))
}

pub fn usage_chunk(meta: &Meta, completion_tokens: usize) -> Bytes {
    let object = match meta.endpoint {
        Endpoint::Completions => "text_completion",
        Endpoint::Chat => "chat.completion.chunk",
    };
    let json = serde_json::to_vec(&Chunk::<CompletionChoice<'_>> {
        id: &meta.id,
        object,
        created: meta.created,
        model: &meta.model,
        choices: Vec::new(),
        usage: Some(Usage::new(meta.prompt_tokens, completion_tokens)),
    });
    sse(json.expect("serialising plain structs cannot fail"))
}

pub fn done_chunk() -> Bytes {
    Bytes::from_static(b"data: [DONE]\n\n")
}

/// A streaming response fed by `rx`; the producer stops when the client goes away.
pub fn stream(rx: mpsc::Receiver<Bytes>) -> Response {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|bytes| (Ok::<_, Infallible>(bytes), rx))
    });
    ([(header::CONTENT_TYPE, "text/event-stream"), (header::CACHE_CONTROL, "no-cache")], Body::from_stream(body))
        .into_response()
}

/// Sleeps `n × per_us` microseconds (nothing at all when zero, so the zero-time model costs
/// no timer).
pub async fn pause(n: usize, per_us: f64) {
    let us = n as f64 * per_us;
    if us >= 1.0 {
        tokio::time::sleep(Duration::from_micros(us as u64)).await;
    }
}
