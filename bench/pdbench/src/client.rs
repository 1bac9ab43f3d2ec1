//! Sending one request to a target and timing it: TTFT, inter-token gaps, end-to-end, tokens,
//! and the kind of error when it fails. A target is one endpoint, a round-robin set, or a P/D
//! pair driven by pdbench itself (prefill call, then decode call with the prefill's
//! `kv_transfer_params`, as PROTOCOLS.md §1 describes).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::Serialize;
use serde_json::Value;

use crate::sse::SseParser;
use crate::workload::{Api, Request};

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Could not connect.
    Connect,
    /// No answer (or no next chunk) in time.
    Timeout,
    /// A non-2xx status.
    Status(u16),
    /// A 2xx answer whose body was not what OpenAI sends (or broke off).
    BadBody,
    /// The P/D prefill leg answered without usable `kv_transfer_params`.
    NoKvParams,
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ErrorKind::Connect => f.write_str("connect"),
            ErrorKind::Timeout => f.write_str("timeout"),
            ErrorKind::Status(s) => write!(f, "http_{s}"),
            ErrorKind::BadBody => f.write_str("bad_body"),
            ErrorKind::NoKvParams => f.write_str("no_kv_params"),
        }
    }
}

/// The measurement of one request.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub error: Option<ErrorKind>,
    /// Time to the first token (for non-streaming requests: the whole request).
    pub ttft: Option<Duration>,
    /// Gaps between successive streamed chunks carrying text.
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub text: String,
    /// The request went prefill → decode (true) or to one engine (false).
    pub disaggregated: bool,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }

    /// Mean inter-token latency (time per output token after the first).
    pub fn mean_itl(&self) -> Option<Duration> {
        if self.itl.is_empty() {
            None
        } else {
            Some(self.itl.iter().sum::<Duration>() / self.itl.len() as u32)
        }
    }

    fn failed(kind: ErrorKind, started: Instant) -> Self {
        Outcome { error: Some(kind), e2e: started.elapsed(), ..Default::default() }
    }
}

/// Timeouts of one request.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// Whole request (both legs for P/D).
    pub request: Duration,
    /// Longest gap between two streamed chunks.
    pub idle: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts { request: Duration::from_secs(60), idle: Duration::from_secs(30) }
    }
}

/// Where requests go.
#[derive(Debug)]
pub enum Target {
    /// Base URLs (`http://host:port`), used in turn.
    RoundRobin { urls: Vec<String>, next: AtomicUsize },
    /// pdbench as the P/D proxy: a prefill call to one of `prefills`, then the decode call to one
    /// of `decodes` with the returned `kv_transfer_params`.
    DirectPd {
        prefills: Vec<String>,
        decodes: Vec<String>,
        /// Prefill chosen by the request's shared-prefix id (so a prefix always lands on the engine
        /// that cached it) instead of in turn.
        prefix_affinity: bool,
        /// Prompts shorter than this (words) are served by the decode alone ("local prefill").
        local_below: usize,
        next_p: AtomicUsize,
        next_d: AtomicUsize,
        ids: AtomicU64,
    },
}

impl Target {
    pub fn round_robin(urls: Vec<String>) -> Self {
        Target::RoundRobin { urls: urls.into_iter().map(trim_url).collect(), next: AtomicUsize::new(0) }
    }

    pub fn direct_pd(prefills: Vec<String>, decodes: Vec<String>, prefix_affinity: bool, local_below: usize) -> Self {
        Target::DirectPd {
            prefills: prefills.into_iter().map(trim_url).collect(),
            decodes: decodes.into_iter().map(trim_url).collect(),
            prefix_affinity,
            local_below,
            next_p: AtomicUsize::new(0),
            next_d: AtomicUsize::new(0),
            ids: AtomicU64::new(0),
        }
    }

    /// Sends one request and measures it.
    pub async fn send(&self, http: &reqwest::Client, req: &Request, stream: bool, t: Timeouts) -> Outcome {
        let started = Instant::now();
        match tokio::time::timeout(t.request, self.send_inner(http, req, stream, t, started)).await {
            Ok(o) => o,
            Err(_) => Outcome::failed(ErrorKind::Timeout, started),
        }
    }

    async fn send_inner(
        &self,
        http: &reqwest::Client,
        req: &Request,
        stream: bool,
        t: Timeouts,
        started: Instant,
    ) -> Outcome {
        match self {
            Target::RoundRobin { urls, next } => {
                let url = &urls[next.fetch_add(1, Relaxed) % urls.len()];
                let body = req.body(stream);
                let rid = format!("pdbench-{}-{}", req.conversation, req.turn);
                call(http, &format!("{url}{}", req.api.path()), &body, &rid, req.api, stream, t, started).await
            }
            Target::DirectPd { prefills, decodes, prefix_affinity, local_below, next_p, next_d, ids } => {
                let decode = &decodes[next_d.fetch_add(1, Relaxed) % decodes.len()];
                let rid = format!("pdbench-{}", ids.fetch_add(1, Relaxed));
                let mut body = req.body(stream);
                if req.prompt_words < *local_below {
                    return call(
                        http,
                        &format!("{decode}{}", req.api.path()),
                        &body,
                        &rid,
                        req.api,
                        stream,
                        t,
                        started,
                    )
                    .await;
                }
                let prefill = match (prefix_affinity, req.prefix_id) {
                    (true, Some(p)) => &prefills[p % prefills.len()],
                    _ => &prefills[next_p.fetch_add(1, Relaxed) % prefills.len()],
                };
                let params = match prefill_leg(http, &format!("{prefill}{}", req.api.path()), &body, &rid, t).await {
                    Ok(p) => p,
                    Err(kind) => return Outcome { disaggregated: true, ..Outcome::failed(kind, started) },
                };
                body["kv_transfer_params"] = params;
                let mut o =
                    call(http, &format!("{decode}{}", req.api.path()), &body, &rid, req.api, stream, t, started).await;
                o.disaggregated = true;
                o
            }
        }
    }
}

fn trim_url(u: String) -> String {
    u.trim_end_matches('/').to_string()
}

fn classify(e: &reqwest::Error) -> ErrorKind {
    if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_connect() {
        ErrorKind::Connect
    } else if let Some(s) = e.status() {
        ErrorKind::Status(s.as_u16())
    } else {
        ErrorKind::BadBody
    }
}

/// The prefill call: max_tokens 1, not streamed, `do_remote_decode`; returns the answer's
/// `kv_transfer_params` verbatim.
async fn prefill_leg(
    http: &reqwest::Client,
    url: &str,
    client_body: &Value,
    rid: &str,
    t: Timeouts,
) -> Result<Value, ErrorKind> {
    let mut body = client_body.clone();
    if let Some(o) = body.as_object_mut() {
        o.insert("max_tokens".into(), 1.into());
        if o.contains_key("max_completion_tokens") {
            o.insert("max_completion_tokens".into(), 1.into());
        }
        o.remove("min_tokens");
        o.remove("min_completion_tokens");
        o.remove("stream_options");
        o.insert("stream".into(), false.into());
        o.insert("kv_transfer_params".into(), pd_protocols::kv_params::prefill_request());
    }
    let resp = http.post(url).header("x-request-id", rid).timeout(t.request).json(&body).send().await;
    let resp = resp.map_err(|e| classify(&e))?;
    if !resp.status().is_success() {
        return Err(ErrorKind::Status(resp.status().as_u16()));
    }
    let v: Value =
        resp.json().await.map_err(|e| if e.is_timeout() { ErrorKind::Timeout } else { ErrorKind::BadBody })?;
    match v.get("kv_transfer_params") {
        Some(p) if p.is_object() => Ok(p.clone()),
        _ => Err(ErrorKind::NoKvParams),
    }
}

/// One OpenAI call, streamed or not, timed from `started`.
#[allow(clippy::too_many_arguments)]
async fn call(
    http: &reqwest::Client,
    url: &str,
    body: &Value,
    rid: &str,
    api: Api,
    stream: bool,
    t: Timeouts,
    started: Instant,
) -> Outcome {
    let resp = match http.post(url).header("x-request-id", rid).json(body).send().await {
        Ok(r) => r,
        Err(e) => return Outcome::failed(classify(&e), started),
    };
    if !resp.status().is_success() {
        return Outcome::failed(ErrorKind::Status(resp.status().as_u16()), started);
    }
    if !stream {
        let v: Value = match resp.json().await {
            Ok(v) => v,
            Err(e) => {
                return Outcome::failed(if e.is_timeout() { ErrorKind::Timeout } else { ErrorKind::BadBody }, started)
            }
        };
        let Some(text) = choice_text(&v, api, false) else {
            return Outcome::failed(ErrorKind::BadBody, started);
        };
        let e2e = started.elapsed();
        let usage = |k: &str| v["usage"][k].as_u64().unwrap_or(0);
        return Outcome {
            error: None,
            ttft: Some(e2e),
            itl: Vec::new(),
            e2e,
            prompt_tokens: usage("prompt_tokens"),
            output_tokens: usage("completion_tokens"),
            text: text.to_string(),
            disaggregated: false,
        };
    }
    let mut out = Outcome::default();
    let mut parser = SseParser::new();
    let mut body = resp.bytes_stream();
    let mut last: Option<Instant> = None;
    let mut chunks = 0u64;
    let mut done = false;
    while !done {
        let next = match tokio::time::timeout(t.idle, body.next()).await {
            Err(_) => return Outcome::failed(ErrorKind::Timeout, started),
            Ok(None) => break,
            Ok(Some(Err(e))) => {
                return Outcome::failed(if e.is_timeout() { ErrorKind::Timeout } else { ErrorKind::BadBody }, started)
            }
            Ok(Some(Ok(b))) => b,
        };
        let events = match parser.push(&next) {
            Ok(ev) => ev,
            Err(_) => return Outcome::failed(ErrorKind::BadBody, started),
        };
        for data in events {
            if data.trim() == "[DONE]" {
                done = true;
                break;
            }
            let Ok(v) = serde_json::from_str::<Value>(&data) else {
                return Outcome::failed(ErrorKind::BadBody, started);
            };
            if v.get("error").is_some() {
                return Outcome::failed(ErrorKind::BadBody, started);
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(out.prompt_tokens);
                out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(out.output_tokens);
            }
            if let Some(text) = choice_text(&v, api, true) {
                if text.is_empty() {
                    continue;
                }
                let now = Instant::now();
                match last {
                    None => out.ttft = Some(now - started),
                    Some(prev) => out.itl.push(now - prev),
                }
                last = Some(now);
                chunks += 1;
                out.text.push_str(text);
            }
        }
    }
    if !done || out.ttft.is_none() {
        return Outcome::failed(ErrorKind::BadBody, started);
    }
    if out.output_tokens == 0 {
        out.output_tokens = chunks;
    }
    out.e2e = started.elapsed();
    out
}

/// The text of `choices[0]`: `text` (completions) or `message.content` / `delta.content` (chat).
fn choice_text(v: &Value, api: Api, stream: bool) -> Option<&str> {
    let c = v.get("choices")?.get(0)?;
    match (api, stream) {
        (Api::Completions, _) => c.get("text")?.as_str(),
        (Api::Chat, false) => c.get("message")?.get("content")?.as_str(),
        (Api::Chat, true) => Some(c.get("delta")?.get("content").and_then(Value::as_str).unwrap_or("")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn extracts_text_per_api() {
        let c = json!({"choices": [{"text": "ab"}]});
        assert_eq!(choice_text(&c, Api::Completions, true), Some("ab"));
        let m = json!({"choices": [{"message": {"content": "hi"}}]});
        assert_eq!(choice_text(&m, Api::Chat, false), Some("hi"));
        let d = json!({"choices": [{"delta": {"role": "assistant"}}]});
        assert_eq!(choice_text(&d, Api::Chat, true), Some(""));
        let usage_only = json!({"choices": [], "usage": {"completion_tokens": 3}});
        assert_eq!(choice_text(&usage_only, Api::Chat, true), None);
        assert_eq!(ErrorKind::Status(503).to_string(), "http_503");
    }

    #[test]
    fn mean_itl() {
        let o = Outcome { itl: vec![Duration::from_millis(2), Duration::from_millis(4)], ..Default::default() };
        assert_eq!(o.mean_itl(), Some(Duration::from_millis(3)));
        assert_eq!(Outcome::default().mean_itl(), None);
    }
}
