//! The vLLM prefill leg: one non-streaming, one-token call per candidate, failing over on
//! connect errors, timeouts and the failover statuses (bounded attempts, exponential backoff
//! with jitter), and reading `kv_transfer_params` out of the answer as raw JSON text.

use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};

use crate::errors::{ApiError, UpstreamError};
use crate::json::Object;
use crate::metrics::{inc, Attempt, Phase};
use crate::state::State;
use crate::target::Target;
use crate::upstream::{self, LegHeaders};

/// Largest prefill answer read (a one-token completion; logprobs can make it bigger).
const MAX_PREFILL_BODY: usize = 16 << 20;

#[derive(Debug)]
pub enum Prefilled {
    /// The prefill holds the KV; `params` is its `kv_transfer_params` exactly as sent.
    Params { params: String, target: Target },
    /// `kv_transfer_params: null` or absent (early stop, abort): nothing is held.
    NullParams { target: Target },
    /// A 4xx, returned to the client unchanged.
    ClientError(Response<Body>),
    /// The prefill answered something that is not a JSON object.
    BadBody { target: Target, reason: String },
    /// No candidate produced an answer; `error` is what the client gets if the policy fails.
    Failed(ApiError),
}

/// What one attempt came to.
enum Tried {
    Done(Prefilled),
    /// Try the next candidate.
    Next(String, bool),
}

/// The pause before failover number `attempt + 1`: exponential, capped, with jitter.
pub(crate) fn backoff(state: &State, attempt: u32) -> Duration {
    let base = state.cfg.failover_backoff.as_secs_f64();
    let capped = (base * f64::from(1u32 << attempt.min(16))).min(state.cfg.failover_backoff_max.as_secs_f64());
    // Full jitter in [capped/2, capped]: spreads retries of many requests hitting one failure.
    Duration::from_secs_f64(capped * (0.5 + state.ids.jitter() / 2.0))
}

pub async fn run(
    state: &State,
    candidates: &[Target],
    path: &str,
    client_headers: &HeaderMap,
    request_id: &str,
    body: Bytes,
) -> Prefilled {
    let started = Instant::now();
    let headers = upstream::leg_headers(
        client_headers,
        LegHeaders { request_id, authorization: state.upstream_auth.as_ref(), rewritten: true, identity: true },
        &[],
    );
    let mut last = String::from("no prefill candidate");
    let mut all_unreachable = true;
    for (i, target) in candidates.iter().take(state.cfg.max_prefill_attempts).enumerate() {
        if i > 0 {
            inc(&state.metrics.failovers);
            tokio::time::sleep(backoff(state, i as u32 - 1)).await;
        }
        let tried = attempt(state, target, path, headers.clone(), body.clone()).await;
        match tried {
            Tried::Done(done) => {
                state.metrics.phase(Phase::Prefill).since(started);
                return done;
            }
            Tried::Next(why, unreachable) => {
                tracing::warn!(prefill = %target.name(), attempt = i + 1, reason = %why, "prefill attempt failed");
                all_unreachable &= unreachable;
                last = why;
            }
        }
    }
    state.metrics.phase(Phase::Prefill).since(started);
    let n = candidates.len().min(state.cfg.max_prefill_attempts);
    Prefilled::Failed(if all_unreachable {
        ApiError::unavailable(format!("no prefill engine available ({n} tried): {last}"))
    } else {
        ApiError::bad_gateway(format!("prefill failed ({n} tried): {last}"))
    })
}

async fn attempt(state: &State, target: &Target, path: &str, headers: HeaderMap, body: Bytes) -> Tried {
    let deadline = Instant::now() + state.cfg.prefill_timeout;
    let req = upstream::post(target, path, headers, body);
    let sent = upstream::send(&state.client, target, req, state.cfg.prefill_timeout);
    // A coordinator notice that the engine died ends the wait early.
    let resp = tokio::select! {
        r = sent => r,
        () = state.dead.wait_dead(target) => {
            state.metrics.attempt(Attempt::Connect);
            return Tried::Next(format!("{} reported dead by the coordinator", target.name()), true);
        }
    };
    let resp = match resp {
        Ok(r) => r,
        Err(e) => {
            let unreachable = e.is_connect();
            state.metrics.attempt(if matches!(e, UpstreamError::Timeout { .. }) {
                Attempt::Timeout
            } else {
                Attempt::Connect
            });
            return Tried::Next(e.to_string(), unreachable);
        }
    };
    let status = resp.status();
    let (parts, incoming) = resp.into_parts();
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let bytes = match upstream::collect(target, incoming, MAX_PREFILL_BODY, left).await {
        Ok(b) => b,
        Err(e) => {
            state.metrics.attempt(if matches!(e, UpstreamError::Timeout { .. }) {
                Attempt::Timeout
            } else {
                Attempt::Connect
            });
            return Tried::Next(e.to_string(), false);
        }
    };
    if state.cfg.failover_status.contains(&status.as_u16()) {
        state.metrics.attempt(Attempt::FailoverStatus);
        return Tried::Next(format!("{} answered {status}", target.name()), status == StatusCode::SERVICE_UNAVAILABLE);
    }
    if status.is_client_error() {
        state.metrics.attempt(Attempt::ClientError);
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        *r.headers_mut() = upstream::response_headers(&parts.headers);
        return Tried::Done(Prefilled::ClientError(r));
    }
    if !status.is_success() {
        state.metrics.attempt(Attempt::OtherStatus);
        let detail = error_message(&bytes).unwrap_or_default();
        return Tried::Done(Prefilled::Failed(ApiError::bad_gateway(format!(
            "prefill {} answered {status}{}{detail}",
            target.name(),
            if detail.is_empty() { "" } else { ": " }
        ))));
    }
    let object = match Object::parse(&bytes) {
        Ok(o) => o,
        Err(e) => {
            state.metrics.attempt(Attempt::BadBody);
            return Tried::Done(Prefilled::BadBody { target: target.clone(), reason: e.to_string() });
        }
    };
    match object.get("kv_transfer_params").map(|raw| raw.get()) {
        Some(raw) if raw.trim_start().starts_with('{') => {
            state.metrics.attempt(Attempt::Ok);
            Tried::Done(Prefilled::Params { params: raw.to_string(), target: target.clone() })
        }
        Some(raw) if raw != "null" => {
            state.metrics.attempt(Attempt::BadBody);
            Tried::Done(Prefilled::BadBody {
                target: target.clone(),
                reason: "kv_transfer_params is not an object".into(),
            })
        }
        _ => {
            state.metrics.attempt(Attempt::NullParams);
            Tried::Done(Prefilled::NullParams { target: target.clone() })
        }
    }
}

/// The message of an OpenAI-style error body, if it is one.
fn error_message(body: &[u8]) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let m = v.get("error")?.get("message")?.as_str()?;
    Some(m.chars().take(300).collect())
}
