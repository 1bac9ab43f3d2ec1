//! SGLang's bootstrap protocol (PROTOCOLS.md §4): the same body, with `bootstrap_host`,
//! `bootstrap_port` and a fresh `bootstrap_room`, goes to the prefill and to the local decode at
//! once. A prefill that fails before the decode produced output cancels the decode (the error
//! reaches the client, or the next candidate is tried with a new room); with `return_logprob`
//! the prefill's input logprobs are put in front of the decode's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::task::JoinHandle;

use crate::config::Fallback;
use crate::coordinator::Reporter;
use crate::decode::{self, DecodeCall, Finish, Opened};
use crate::errors::{ApiError, UpstreamError};
use crate::metrics::{inc, LocalReason, Outcome, Phase, Tracker};
use crate::proxy::{fail, Disaggregation};
use crate::rewrite::{self, Api};
use crate::state::State;
use crate::target::Target;
use crate::upstream::{self, LegHeaders};

/// What the prefill leg came to.
#[derive(Debug)]
enum Leg {
    Ok(Bytes),
    ClientError(Response<Body>),
    /// Try another prefill (`true`: it could not be reached at all).
    Retry(String, bool),
    Failed(ApiError),
}

/// Aborts the task when dropped, unless detached.
struct AbortOnDrop(Option<JoinHandle<Leg>>);

impl AbortOnDrop {
    fn detach(mut self) {
        self.0 = None;
    }
}

impl std::future::Future for AbortOnDrop {
    type Output = Result<Leg, tokio::task::JoinError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(self.0.as_mut().expect("polled after detach")).poll(cx)
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.abort();
        }
    }
}

async fn prefill_leg(state: Arc<State>, target: Target, path: String, headers: HeaderMap, body: Bytes) -> Leg {
    let started = Instant::now();
    let timeout = state.cfg.prefill_timeout;
    let req = upstream::post(&target, &path, headers, body);
    let resp = match upstream::send(&state.client, &target, req, timeout).await {
        Ok(r) => r,
        Err(e) => return Leg::Retry(e.to_string(), e.is_connect()),
    };
    let status = resp.status();
    let (parts, incoming) = resp.into_parts();
    let left = timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
    let bytes = match upstream::collect(&target, incoming, 64 << 20, left).await {
        Ok(b) => b,
        Err(e @ UpstreamError::TooLarge { .. }) => return Leg::Failed(ApiError::bad_gateway(e.to_string())),
        Err(e) => return Leg::Retry(e.to_string(), false),
    };
    state.metrics.phase(Phase::Prefill).since(started);
    if state.cfg.failover_status.contains(&status.as_u16()) {
        return Leg::Retry(format!("{} answered {status}", target.name()), status == StatusCode::SERVICE_UNAVAILABLE);
    }
    if status.is_client_error() {
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        *r.headers_mut() = upstream::response_headers(&parts.headers);
        return Leg::ClientError(r);
    }
    if !status.is_success() {
        return Leg::Failed(ApiError::bad_gateway(format!(
            "the prefill {} failed with {status}: {}",
            target.name(),
            String::from_utf8_lossy(&bytes[..bytes.len().min(300)])
        )));
    }
    Leg::Ok(bytes)
}

pub async fn run(
    state: &Arc<State>,
    api: Api,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    body: Bytes,
    tracker: Tracker,
) -> Response<Body> {
    let Disaggregation { object, candidates, tracker, reporter } =
        match crate::proxy::route(state, api, path, headers, rid, &body, tracker).await {
            Ok(d) => d,
            Err(served) => return served,
        };
    let merge_logprobs = object.bool("return_logprob") == Some(true) && object.bool("stream") != Some(true);
    let items = rewrite::batch_size(&object, api);
    let prefill_headers = upstream::leg_headers(
        headers,
        LegHeaders { request_id: rid, authorization: state.upstream_auth.as_ref(), rewritten: true, identity: true },
        &[],
    );
    let mut last = ApiError::unavailable("no prefill engine available");
    let mut all_unreachable = true;
    let attempts = candidates.len().min(state.cfg.max_prefill_attempts);
    for (i, target) in candidates.iter().take(attempts).enumerate() {
        if i > 0 {
            inc(&state.metrics.failovers);
            tokio::time::sleep(crate::prefill::backoff(state, i as u32 - 1)).await;
        }
        let rooms: Vec<i64> = (0..items).map(|_| state.ids.room()).collect();
        let port = target.bootstrap_port.unwrap_or(state.cfg.bootstrap_port);
        let leg_body = Bytes::from(rewrite::sglang_body(&object, &target.host_port.host, Some(port), &rooms));
        tracing::debug!(prefill = %target.name(), room = rooms[0], "SGLang legs");
        let prefill = AbortOnDrop(Some(tokio::spawn(prefill_leg(
            Arc::clone(state),
            target.clone(),
            path.to_string(),
            prefill_headers.clone(),
            leg_body.clone(),
        ))));
        let call = DecodeCall { path, headers, request_id: rid, body: leg_body, rewritten: true, prefilled_at: None };
        let mut prefill = prefill;
        let mut prefill_ok: Option<Bytes> = None;
        let opened = {
            let decode = decode::open(state, &call);
            tokio::pin!(decode);
            loop {
                tokio::select! {
                    biased;
                    leg = &mut prefill, if prefill_ok.is_none() => {
                        match leg.unwrap_or_else(|e| Leg::Failed(ApiError::bad_gateway(format!("prefill task: {e}")))) {
                            Leg::Ok(b) => prefill_ok = Some(b),
                            other => break Err(other),
                        }
                    }
                    d = &mut decode => break Ok(d),
                }
            }
        };
        match opened {
            Err(Leg::Retry(why, unreachable)) => {
                inc(&state.metrics.sglang_prefill_failures);
                tracing::warn!(prefill = %target.name(), attempt = i + 1, reason = %why, "SGLang prefill failed; decode cancelled");
                all_unreachable &= unreachable;
                last = ApiError::bad_gateway(format!("prefill failed: {why}"));
            }
            Err(Leg::ClientError(resp)) => {
                inc(&state.metrics.sglang_prefill_failures);
                if let Some(r) = reporter {
                    r.failed(&format!("prefill answered {}", resp.status()));
                }
                tracker.finish(Outcome::ClientError);
                return resp;
            }
            Err(Leg::Failed(e)) => {
                inc(&state.metrics.sglang_prefill_failures);
                return fail(e, tracker, reporter);
            }
            Err(Leg::Ok(_)) => unreachable!("a successful prefill does not end the wait"),
            Ok(Err(e)) => return fail(e, tracker, reporter),
            Ok(Ok(opened)) => {
                inc(&state.metrics.disaggregated);
                if merge_logprobs && opened.status.is_success() {
                    return merged(state, opened, prefill, prefill_ok, tracker, reporter).await;
                }
                if opened.status.is_success() {
                    // The decode has its KV; let the prefill's call end on its own.
                    prefill.detach();
                }
                let fin = Finish { tracker, release: None, reporter };
                return decode::relay(state, opened, fin);
            }
        }
    }
    if all_unreachable {
        last = ApiError::unavailable(format!("no prefill engine available: {}", last.message));
    }
    if state.cfg.fallback == Fallback::Local {
        return crate::proxy::local(
            state,
            path,
            headers,
            rid,
            &body,
            Some(&object),
            tracker,
            reporter,
            Some(LocalReason::PrefillFailed),
        )
        .await;
    }
    fail(last, tracker, reporter)
}

/// Non-streamed `return_logprob`: waits for both bodies and answers the merged one.
async fn merged(
    state: &Arc<State>,
    opened: Opened,
    mut prefill: AbortOnDrop,
    prefill_ok: Option<Bytes>,
    tracker: Tracker,
    reporter: Option<Reporter>,
) -> Response<Body> {
    let timeout = state.cfg.decode_first_byte_timeout.max(state.cfg.stream_idle_timeout);
    let mut decode_body = BytesMut::new();
    if let Some(d) = opened.first.as_ref().and_then(|f| f.data_ref()) {
        decode_body.extend_from_slice(d);
    }
    match tokio::time::timeout(timeout, opened.incoming.collect()).await {
        Ok(Ok(rest)) => decode_body.extend_from_slice(&rest.to_bytes()),
        _ => return fail(ApiError::bad_gateway("the decode response did not complete"), tracker, reporter),
    }
    let prefill_body = match prefill_ok {
        Some(b) => b,
        None => match tokio::time::timeout(state.cfg.prefill_timeout, &mut prefill).await {
            Ok(Ok(Leg::Ok(b))) => b,
            _ => Bytes::new(),
        },
    };
    let body = rewrite::merge_input_logprobs(&prefill_body, &decode_body).unwrap_or_else(|| decode_body.to_vec());
    let mut headers = opened.headers;
    headers.remove(header::CONTENT_LENGTH);
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = opened.status;
    *r.headers_mut() = headers;
    if let Some(rep) = reporter {
        rep.finished();
    }
    tracker.finish(Outcome::Ok);
    r
}
