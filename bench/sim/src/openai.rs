//! The OpenAI-compatible request fields the simulator reads, checked for type (wrong types are
//! a 400 with OpenAI-style error JSON, unknown fields are ignored as vLLM does), and the
//! response bodies in vLLM's shapes.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Map, Value};

/// An error for the client, as vLLM sends it: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: param.map(String::from) }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "BadRequestError",
            404 => "NotFoundError",
            408 => "TimeoutError",
            503 => "ServiceUnavailableError",
            _ => "InternalServerError",
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: u16,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorFields {
                message: &self.message,
                kind: self.kind(),
                param: self.param.as_deref(),
                code: self.status.as_u16(),
            },
        };
        (self.status, axum::Json(body)).into_response()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

impl Endpoint {
    /// vLLM's prefix of this endpoint's response and request ids (`cmpl-…`, `chatcmpl-…`).
    pub fn id_prefix(self) -> &'static str {
        match self {
            Endpoint::Completions => "cmpl",
            Endpoint::Chat => "chatcmpl",
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
}

/// SGLang's bootstrap fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bootstrap {
    pub host: String,
    pub port: Option<u16>,
    pub room: i64,
}

#[derive(Debug)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompt: PromptInput,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub kv_transfer_params: Option<Map<String, Value>>,
    pub bootstrap: Option<Bootstrap>,
}

fn opt<'a>(body: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

fn opt_bool(body: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    opt(body, key)
        .map(|v| v.as_bool().ok_or_else(|| ApiError::bad_request(format!("'{key}' must be a boolean"), Some(key))))
        .transpose()
}

fn opt_uint(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    opt(body, key)
        .map(|v| {
            v.as_u64()
                .ok_or_else(|| ApiError::bad_request(format!("'{key}' must be a non-negative integer"), Some(key)))
        })
        .transpose()
}

fn token_ids(v: &[Value]) -> Option<Vec<u32>> {
    v.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

fn prompt_input(body: &Map<String, Value>) -> Result<PromptInput, ApiError> {
    let bad = || ApiError::bad_request("'prompt' must be a string, a list of one string, or token ids", Some("prompt"));
    match opt(body, "prompt").ok_or_else(|| ApiError::bad_request("'prompt' is required", Some("prompt")))? {
        Value::String(s) => Ok(PromptInput::Text(s.clone())),
        Value::Array(items) => match items.as_slice() {
            [Value::String(s)] => Ok(PromptInput::Text(s.clone())),
            [Value::Array(ids)] => token_ids(ids).map(PromptInput::Tokens).ok_or_else(bad),
            [] => Err(ApiError::bad_request("'prompt' must not be empty", Some("prompt"))),
            ids if ids.iter().all(Value::is_number) => token_ids(ids).map(PromptInput::Tokens).ok_or_else(bad),
            _ => Err(ApiError::bad_request("batched prompts are not supported by the simulator", Some("prompt"))),
        },
        _ => Err(bad()),
    }
}

impl GenRequest {
    pub fn parse(endpoint: Endpoint, bytes: &[u8]) -> Result<GenRequest, ApiError> {
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}"), None))?;
        let Value::Object(body) = value else {
            return Err(ApiError::bad_request("request body must be a JSON object", None));
        };
        let model = match opt(&body, "model") {
            None => None,
            Some(Value::String(m)) => Some(m.clone()),
            Some(_) => return Err(ApiError::bad_request("'model' must be a string", Some("model"))),
        };
        let prompt = match endpoint {
            Endpoint::Completions => prompt_input(&body)?,
            Endpoint::Chat => {
                let messages = body.get("messages").unwrap_or(&Value::Null);
                PromptInput::Text(
                    crate::chat::render(messages)
                        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?,
                )
            }
        };
        let mut max_tokens = opt_uint(&body, "max_tokens")?;
        if endpoint == Endpoint::Chat {
            max_tokens = opt_uint(&body, "max_completion_tokens")?.or(max_tokens);
        }
        if max_tokens == Some(0) {
            return Err(ApiError::bad_request("max_tokens must be at least 1, got 0.", Some("max_tokens")));
        }
        if opt_uint(&body, "n")?.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request("the simulator supports only n=1", Some("n")));
        }
        let stream = opt_bool(&body, "stream")?.unwrap_or(false);
        let include_usage = match opt(&body, "stream_options") {
            None => false,
            Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
            Some(_) => return Err(ApiError::bad_request("'stream_options' must be an object", Some("stream_options"))),
        };
        let kv_transfer_params = match opt(&body, "kv_transfer_params") {
            None => None,
            Some(Value::Object(o)) => Some(o.clone()),
            Some(_) => {
                return Err(ApiError::bad_request("'kv_transfer_params' must be an object", Some("kv_transfer_params")))
            }
        };
        Ok(GenRequest {
            endpoint,
            model,
            prompt,
            max_tokens: max_tokens.map(|m| m.min(usize::MAX as u64) as usize),
            stream,
            include_usage,
            kv_transfer_params,
            bootstrap: bootstrap(&body)?,
        })
    }
}

fn bootstrap(body: &Map<String, Value>) -> Result<Option<Bootstrap>, ApiError> {
    let Some(room) = opt(body, "bootstrap_room") else { return Ok(None) };
    let room = room.as_i64().filter(|r| *r >= 0).ok_or_else(|| {
        ApiError::bad_request("'bootstrap_room' must be an integer in [0, 2^63-1]", Some("bootstrap_room"))
    })?;
    let host = match opt(body, "bootstrap_host") {
        Some(Value::String(h)) => h.clone(),
        _ => return Err(ApiError::bad_request("'bootstrap_host' must be a string", Some("bootstrap_host"))),
    };
    let port = opt_uint(body, "bootstrap_port")?
        .map(|p| {
            u16::try_from(p).map_err(|_| ApiError::bad_request("'bootstrap_port' out of range", Some("bootstrap_port")))
        })
        .transpose()?;
    Ok(Some(Bootstrap { host, port, room }))
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_tokens_details: Option<Value>,
}

impl Usage {
    pub fn new(prompt: usize, completion: usize) -> Self {
        Usage {
            prompt_tokens: prompt,
            total_tokens: prompt + completion,
            completion_tokens: completion,
            prompt_tokens_details: None,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct CompletionChoice<'a> {
    pub index: u32,
    pub text: &'a str,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<&'a str>,
    pub stop_reason: Option<Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Option<Value>>,
}

#[derive(Debug, Serialize)]
pub struct Message<'a> {
    pub role: &'static str,
    pub content: &'a str,
    pub refusal: Option<Value>,
    pub annotations: Option<Value>,
    pub audio: Option<Value>,
    pub function_call: Option<Value>,
    pub tool_calls: [Value; 0],
    pub reasoning_content: Option<Value>,
}

#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    pub message: Message<'a>,
    pub logprobs: Option<Value>,
    pub finish_reason: &'a str,
    pub stop_reason: Option<Value>,
}

/// A non-streaming response; `choices` is a completion's or a chat's.
#[derive(Debug, Serialize)]
pub struct Body<'a, C: Serialize> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: [C; 1],
    pub service_tier: Option<Value>,
    pub system_fingerprint: Option<Value>,
    pub usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Option<Value>>,
    pub kv_transfer_params: Option<&'a pd_protocols::kv_params::KvTransferParams>,
}

#[derive(Debug, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    pub content: &'a str,
}

#[derive(Debug, Serialize)]
pub struct ChatChunkChoice<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<Value>,
    pub finish_reason: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Option<Value>>,
}

/// One streamed chunk; an empty `choices` with `usage` is the final usage chunk.
#[derive(Debug, Serialize)]
pub struct Chunk<'a, C: Serialize> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(e: Endpoint, body: &str) -> Result<GenRequest, ApiError> {
        GenRequest::parse(e, body.as_bytes())
    }

    #[test]
    fn parses_prompts_limits_and_pd_fields() {
        let r = parse(
            Endpoint::Completions,
            r#"{"prompt": "a b", "max_tokens": 3, "stream": true, "unknown": 1,
            "stream_options": {"include_usage": true}, "kv_transfer_params": {"do_remote_decode": true}}"#,
        )
        .unwrap();
        assert_eq!(
            (r.prompt, r.max_tokens, r.stream, r.include_usage),
            (PromptInput::Text("a b".into()), Some(3), true, true)
        );
        assert!(r.kv_transfer_params.is_some());
        let r = parse(Endpoint::Completions, r#"{"prompt": [1, 2, 3], "model": null}"#).unwrap();
        assert_eq!(r.prompt, PromptInput::Tokens(vec![1, 2, 3]));
        let r = parse(
            Endpoint::Chat,
            r#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 2,
            "bootstrap_host": "h", "bootstrap_port": null, "bootstrap_room": 7}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(2));
        assert_eq!(r.bootstrap, Some(Bootstrap { host: "h".into(), port: None, room: 7 }));
    }

    #[test]
    fn wrong_types_are_400_with_param() {
        for (body, param) in [
            (r#"{"prompt": 5}"#, Some("prompt")),
            (r#"{"prompt": "x", "max_tokens": "3"}"#, Some("max_tokens")),
            (r#"{"prompt": "x", "max_tokens": 0}"#, Some("max_tokens")),
            (r#"{"prompt": "x", "stream": "yes"}"#, Some("stream")),
            (r#"{"prompt": "x", "model": 1}"#, Some("model")),
            (r#"{"prompt": "x", "kv_transfer_params": []}"#, Some("kv_transfer_params")),
            (r#"{"prompt": [-1]}"#, Some("prompt")),
            (r#"{"prompt": "x", "bootstrap_room": -1, "bootstrap_host": "h"}"#, Some("bootstrap_room")),
            (r#"[1]"#, None),
            (r#"{not json"#, None),
        ] {
            let err = parse(Endpoint::Completions, body).unwrap_err();
            assert_eq!((err.status, err.param.as_deref()), (StatusCode::BAD_REQUEST, param), "{body}");
        }
        assert_eq!(parse(Endpoint::Chat, r#"{"messages": 1}"#).unwrap_err().param.as_deref(), Some("messages"));
    }
}
