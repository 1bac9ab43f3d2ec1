//! The prefill-leg executor both flows share. It sends one attempt and classifies what came back
//! into one [`Attempted`] (connect errors, timeouts, a coordinator's death notice, failover
//! statuses, client errors, other statuses), counts the attempt, and drives the candidates
//! through the pure failover policy ([`crate::handoff::Failover`]): backoff, attempt limit, the
//! "every candidate unreachable" rule. vLLM and SGLang differ only in the body each attempt
//! sends and in what an attempt does with the answer (in series with the decode, or beside it).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response, StatusCode};

use crate::context::Context;
use crate::engine_kind::EngineKind;
use crate::engines::DeadSet;
use crate::errors::{LegError, UpstreamError};
use crate::handoff::{AttemptFailure, Attempts, Failover, Next, PrefillExhausted};
use crate::ids::Ids;
use crate::metrics::{inc, Attempt, Metrics, Phase};
use crate::target::Target;
use crate::upstream;

/// What one attempt came to.
#[derive(Debug)]
pub enum Attempted {
    /// A 2xx answer's body.
    Answer(Bytes),
    /// Another candidate may do better.
    Retry(AttemptFailure),
    /// A 4xx, returned to the client unchanged (status, headers, body).
    ClientError(Response<Body>),
    /// No other candidate is tried.
    Failed(LegError),
}

/// How the leg ended.
#[derive(Debug)]
pub enum Legged<T> {
    /// An attempt ended the leg with `T`.
    Done(T),
    /// No candidate answered; the policy says compute the prompt here.
    Fallback(PrefillExhausted),
    /// No candidate answered; the policy says fail.
    Fail(PrefillExhausted),
}

/// The executor: the context, plus the two things only prefill legs use — the coordinator's
/// death notices (they end a wait early) and the jitter of the backoff.
#[derive(Debug)]
pub struct Legs {
    pub ctx: Arc<Context>,
    dead: Arc<DeadSet>,
    ids: Arc<Ids>,
    kind: Arc<EngineKind>,
}

impl Legs {
    pub fn new(ctx: &Arc<Context>, dead: &Arc<DeadSet>, ids: &Arc<Ids>, kind: &Arc<EngineKind>) -> Legs {
        Legs { ctx: Arc::clone(ctx), dead: Arc::clone(dead), ids: Arc::clone(ids), kind: Arc::clone(kind) }
    }

    /// The policy the configuration sets, for the local engine's kind.
    pub fn policy(&self) -> Failover {
        let cfg = &self.ctx.cfg;
        Failover {
            max_attempts: cfg.max_prefill_attempts,
            backoff: cfg.failover_backoff,
            backoff_max: cfg.failover_backoff_max,
            fallback: cfg.fallback,
        }
        .for_engine(self.kind.known())
    }

    /// Tries `candidates` in order with `attempt` until one ends the leg (`Ok`) or the policy gives
    /// up; `Err` from an attempt is a failure another candidate may fix.
    pub async fn run<'c, T, F, Fut>(&self, candidates: &'c [Target], mut attempt: F) -> Legged<T>
    where
        F: FnMut(&'c Target) -> Fut,
        Fut: Future<Output = Result<T, AttemptFailure>>,
    {
        let started = Instant::now();
        let policy = self.policy();
        let metrics = &self.ctx.metrics;
        let mut attempts = Attempts::default();
        let Some(mut target) = candidates.first() else {
            return give_up(policy.give_up(&attempts, "no prefill candidate"));
        };
        loop {
            let failure = match attempt(target).await {
                Ok(done) => {
                    metrics.phase(Phase::Prefill).since(started);
                    return Legged::Done(done);
                }
                Err(failure) => failure,
            };
            tracing::warn!(prefill = %target.name(), attempt = attempts.made + 1, ?failure, "prefill attempt failed");
            match policy.next(candidates, &mut attempts, &failure, self.ids.jitter()) {
                Next::Retry { target: next, after } => {
                    inc(&metrics.failovers);
                    tokio::time::sleep(after).await;
                    target = next;
                }
                end => {
                    metrics.phase(Phase::Prefill).since(started);
                    return give_up(end);
                }
            }
        }
    }

    /// Sends one prefill call and classifies the answer, within `--prefill-timeout`; a coordinator
    /// notice that the engine died ends the wait early.
    pub async fn attempt(
        &self,
        target: &Target,
        path: &str,
        headers: HeaderMap,
        body: Bytes,
        max_body: usize,
    ) -> Attempted {
        let Context { cfg, client, metrics, .. } = &*self.ctx;
        let timeout = cfg.prefill_timeout;
        let deadline = Instant::now() + timeout;
        let req = upstream::post(target, path, headers, body);
        let sent = upstream::send(client, target, req, timeout);
        let resp = tokio::select! {
            r = sent => r,
            () = self.dead.wait_dead(target) => {
                metrics.attempt(Attempt::Connect);
                return Attempted::Retry(AttemptFailure::Unreachable(format!("{} reported dead by the coordinator", target.name())));
            }
        };
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return Attempted::Retry(upstream_failure(metrics, &e, e.is_connect())),
        };
        let status = resp.status();
        let (parts, incoming) = resp.into_parts();
        let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let bytes = match upstream::collect(target, incoming, max_body, left).await {
            Ok(b) => b,
            Err(e) => return Attempted::Retry(upstream_failure(metrics, &e, false)),
        };
        if cfg.failover_status.contains(&status.as_u16()) {
            metrics.attempt(Attempt::FailoverStatus);
            let why = format!("{} answered {status}", target.name());
            // A 503 is an engine refusing work: as unreachable as a refused connection.
            return Attempted::Retry(if status == StatusCode::SERVICE_UNAVAILABLE {
                AttemptFailure::Unreachable(why)
            } else {
                AttemptFailure::Failed(why)
            });
        }
        if status.is_client_error() {
            metrics.attempt(Attempt::ClientError);
            let mut r = Response::new(Body::from(bytes));
            *r.status_mut() = status;
            *r.headers_mut() = upstream::response_headers(&parts.headers);
            return Attempted::ClientError(r);
        }
        if !status.is_success() {
            metrics.attempt(Attempt::OtherStatus);
            return Attempted::Failed(LegError::PrefillStatus {
                prefill: target.name().to_string(),
                status,
                detail: error_detail(&bytes),
            });
        }
        Attempted::Answer(bytes)
    }
}

fn give_up<T>(next: Next<'_>) -> Legged<T> {
    match next {
        Next::Fallback(e) => Legged::Fallback(e),
        Next::Fail(e) => Legged::Fail(e),
        Next::Retry { .. } => unreachable!("give_up is called once the policy stopped retrying"),
    }
}

/// Counts a failed send or body read and says how it failed.
fn upstream_failure(metrics: &Metrics, e: &UpstreamError, unreachable: bool) -> AttemptFailure {
    let timed_out = matches!(e, UpstreamError::Timeout { .. });
    metrics.attempt(if timed_out { Attempt::Timeout } else { Attempt::Connect });
    if unreachable {
        AttemptFailure::Unreachable(e.to_string())
    } else {
        AttemptFailure::Failed(e.to_string())
    }
}

/// What an error answer says: the message of an OpenAI-style body, else the body's start.
fn error_detail(body: &[u8]) -> String {
    let message = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("error")?.get("message")?.as_str().map(String::from));
    let text = message.unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    text.chars().take(300).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_details() {
        assert_eq!(error_detail(br#"{"error": {"message": "engine crashed"}}"#), "engine crashed");
        assert_eq!(error_detail(b"injected failure"), "injected failure");
        assert_eq!(error_detail(&[b'x'; 400]).len(), 300);
        assert_eq!(error_detail(b""), "");
    }
}
