//! SGLang's bootstrap protocol (PROTOCOLS.md §4): the same body, with `bootstrap_host`,
//! `bootstrap_port` and a fresh `bootstrap_room`, goes to the prefill and to the local decode at
//! once. A prefill that fails before the decode produced output cancels the decode (the error
//! reaches the client, or the next candidate is tried with a new room); with `return_logprob`
//! the prefill's input logprobs are put in front of the decode's.

use std::sync::Arc;

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, Response, StatusCode};
use http_body_util::BodyExt;
use tokio::task::JoinHandle;

use crate::context::Context;
use crate::decode::{self, DecodeCall, Opened};
use crate::errors::LegError;
use crate::finish::Finish;
use crate::handoff::AttemptFailure;
use crate::ids::Ids;
use crate::json::Object;
use crate::legs::{Attempted, Legged};
use crate::metrics::{inc, LocalReason, Outcome};
use crate::proxy::{Disaggregation, Routed};
use crate::rewrite::{self, Api};
use crate::target::Target;
use crate::upstream::{self, LegHeaders};
use crate::App;

/// Largest prefill answer read (non-streamed answers carry the whole completion).
const MAX_PREFILL_BODY: usize = 64 << 20;

/// How an attempt whose prefill did not fail ended the leg.
enum Ended {
    /// The decode answered (head and first frame); the prefill may still run.
    Opened { opened: Box<Opened>, prefill: AbortOnDrop, prefill_ok: Option<Bytes> },
    /// The decode could not be opened.
    Decode(LegError),
    /// The prefill answered a 4xx.
    ClientError(Response<Body>),
    /// The prefill failed in a way no other candidate is asked to fix.
    Failed(LegError),
}

/// Aborts the task when dropped, unless detached.
struct AbortOnDrop(Option<JoinHandle<Attempted>>);

impl AbortOnDrop {
    fn detach(mut self) {
        self.0 = None;
    }
}

impl std::future::Future for AbortOnDrop {
    type Output = Result<Attempted, tokio::task::JoinError>;

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

pub async fn run(
    app: &App,
    api: Api,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    body: Bytes,
    fin: Finish,
) -> Response<Body> {
    let Disaggregation { object, candidates, fin, .. } =
        match crate::proxy::route(app, api, path, headers, rid, &body, fin).await {
            Routed::Disaggregate(d) => d,
            Routed::Served(response) => return response,
        };
    let ctx = &app.ctx;
    let merge_logprobs = merges_logprobs(&object);
    let items = rewrite::batch_size(&object, api);
    let prefill_headers = upstream::leg_headers(
        headers,
        LegHeaders { request_id: rid, authorization: ctx.upstream_authorization(), rewritten: true, identity: true },
        &[],
    );
    let legged = app
        .legs
        .run(&candidates, |target| {
            let (object, prefill_headers) = (&object, prefill_headers.clone());
            async move {
                let (leg_body, room) = leg_body(object, target, ctx.cfg.bootstrap_port, &app.ids, items);
                tracing::debug!(prefill = %target.name(), room, "SGLang legs");
                let (legs, task_target, task_path, task_body) =
                    (Arc::clone(&app.legs), target.clone(), path.to_string(), leg_body.clone());
                let mut prefill = AbortOnDrop(Some(tokio::spawn(async move {
                    legs.attempt(&task_target, &task_path, prefill_headers, task_body, MAX_PREFILL_BODY).await
                })));
                let call =
                    DecodeCall { path, headers, request_id: rid, body: leg_body, rewritten: true, prefilled_at: None };
                let mut prefill_ok: Option<Bytes> = None;
                let decode = decode::open(ctx, &app.engines, &call);
                tokio::pin!(decode);
                // Both legs at once; a prefill that fails first cancels the decode.
                let failed = loop {
                    tokio::select! {
                        biased;
                        leg = &mut prefill, if prefill_ok.is_none() => {
                            match leg.unwrap_or_else(|e| Attempted::Failed(e.into())) {
                                Attempted::Answer(b) => prefill_ok = Some(b),
                                other => break other,
                            }
                        }
                        d = &mut decode => {
                            return Ok(match d {
                                Ok(opened) => Ended::Opened { opened: Box::new(opened), prefill, prefill_ok },
                                Err(e) => Ended::Decode(e),
                            });
                        }
                    }
                };
                inc(&ctx.metrics.sglang_prefill_failures);
                prefill_failed(failed)
            }
        })
        .await;
    match legged {
        Legged::Done(Ended::ClientError(resp)) => fin.client_error(resp),
        Legged::Done(Ended::Failed(e)) => fin.leg_failed(&e),
        Legged::Done(Ended::Decode(e)) => fin.leg_failed(&e),
        Legged::Done(Ended::Opened { opened, prefill, prefill_ok }) => {
            inc(&ctx.metrics.disaggregated);
            match after_decode(merge_logprobs, opened.status) {
                AfterDecode::Merge => merged(ctx, *opened, prefill, prefill_ok, fin).await,
                AfterDecode::Relay { detach_prefill } => {
                    if detach_prefill {
                        // The decode has its KV; let the prefill's call end on its own.
                        prefill.detach();
                    }
                    decode::relay(ctx, *opened, fin).await
                }
            }
        }
        Legged::Fallback(e) => {
            tracing::warn!(error = %e, "no prefill; computing the prompt locally");
            let reason = Some(LocalReason::PrefillFailed);
            crate::proxy::local(app, path, headers, rid, &body, Some(&object), fin, reason).await
        }
        Legged::Fail(e) => fin.leg_failed(&LegError::from(e)),
    }
}

/// Whether the answer is the prefill's input logprobs put in front of the decode's: asked for
/// (`return_logprob`) and not streamed.
fn merges_logprobs(object: &Object<'_>) -> bool {
    object.bool("return_logprob") == Some(true) && object.bool("stream") != Some(true)
}

/// The body both legs get for `target`: its host, its bootstrap port (else `default_port`) and a
/// fresh room per batch item; also the first room, for the log.
fn leg_body(object: &Object<'_>, target: &Target, default_port: u16, ids: &Ids, items: usize) -> (Bytes, i64) {
    let rooms: Vec<i64> = (0..items.max(1)).map(|_| ids.room()).collect();
    let port = target.bootstrap_port.unwrap_or(default_port);
    (Bytes::from(rewrite::sglang_body(object, &target.host_port.host, Some(port), &rooms)), rooms[0])
}

/// An attempt whose prefill failed before the decode answered: another candidate may do
/// better (`Err`), or the leg ends.
fn prefill_failed(failed: Attempted) -> Result<Ended, AttemptFailure> {
    match failed {
        Attempted::Retry(failure) => Err(failure),
        Attempted::ClientError(resp) => Ok(Ended::ClientError(resp)),
        Attempted::Failed(e) => Ok(Ended::Failed(e)),
        Attempted::Answer(_) => unreachable!("a successful prefill does not end the wait"),
    }
}

/// What follows an opened decode.
#[derive(Debug, PartialEq)]
enum AfterDecode {
    /// Wait for both bodies and answer the merged one.
    Merge,
    /// Relay the decode; a decode that succeeded has its KV, so the prefill's call may end on its
    /// own instead of being cancelled.
    Relay { detach_prefill: bool },
}

fn after_decode(merge_logprobs: bool, status: StatusCode) -> AfterDecode {
    match (merge_logprobs, status.is_success()) {
        (true, true) => AfterDecode::Merge,
        (_, ok) => AfterDecode::Relay { detach_prefill: ok },
    }
}

/// Non-streamed `return_logprob`: waits for both bodies and answers the merged one.
async fn merged(
    ctx: &Context,
    opened: Opened,
    mut prefill: AbortOnDrop,
    prefill_ok: Option<Bytes>,
    fin: Finish,
) -> Response<Body> {
    let cfg = &ctx.cfg;
    let timeout = cfg.decode_first_byte_timeout.max(cfg.stream_idle_timeout);
    let mut decode_body = BytesMut::new();
    if let Some(d) = opened.first.as_ref().and_then(|f| f.data_ref()) {
        decode_body.extend_from_slice(d);
    }
    match tokio::time::timeout(timeout, opened.incoming.collect()).await {
        Ok(Ok(rest)) => decode_body.extend_from_slice(&rest.to_bytes()),
        _ => return fin.leg_failed(&LegError::DecodeIncomplete),
    }
    let prefill_body = match prefill_ok {
        Some(b) => b,
        None => match tokio::time::timeout(cfg.prefill_timeout, &mut prefill).await {
            Ok(Ok(Attempted::Answer(b))) => b,
            _ => Bytes::new(),
        },
    };
    let r = combined(opened.status, opened.headers, &prefill_body, &decode_body);
    fin.end(Outcome::Ok, None);
    r
}

/// The merged answer: the decode's status and headers (its length no longer holds) around the
/// merged body, or the decode's own body when the two do not merge (no prefill body, a shape
/// the merge does not know).
fn combined(status: StatusCode, mut headers: HeaderMap, prefill: &[u8], decode: &[u8]) -> Response<Body> {
    let body = rewrite::merge_input_logprobs(prefill, decode).unwrap_or_else(|| decode.to_vec());
    headers.remove(header::CONTENT_LENGTH);
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    *r.headers_mut() = headers;
    r
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    #[test]
    fn logprobs_are_merged_only_when_asked_and_not_streamed() {
        for (body, merges) in [
            (r#"{"return_logprob": true}"#, true),
            (r#"{"return_logprob": true, "stream": false}"#, true),
            (r#"{"return_logprob": true, "stream": true}"#, false),
            (r#"{"return_logprob": false}"#, false),
            (r#"{"return_logprob": "yes"}"#, false),
            (r#"{"stream": false}"#, false),
        ] {
            assert_eq!(merges_logprobs(&Object::parse(body.as_bytes()).unwrap()), merges, "{body}");
        }
    }

    #[test]
    fn each_attempt_gets_the_targets_bootstrap_and_fresh_rooms() {
        let ids = Ids::with_seed(7, 1000);
        let own = Target::parse("10.0.0.1:8100#bootstrap=9000", "http", None).unwrap();
        let plain = Target::parse("10.0.0.2:8100", "http", None).unwrap();
        let single = Object::parse(br#"{"text": "a", "bootstrap_room": 1}"#).unwrap();
        let batch = Object::parse(br#"{"text": ["a", "b"]}"#).unwrap();
        let mut rooms = Vec::new();
        for (object, target, items, host, port) in [
            (&single, &own, 1, "10.0.0.1", 9000),
            (&single, &plain, 1, "10.0.0.2", 8998),
            (&batch, &plain, 2, "10.0.0.2", 8998),
        ] {
            let (body, first) = leg_body(object, target, 8998, &ids, items);
            let v: Value = serde_json::from_slice(&body).unwrap();
            let one = |field: &str| if items == 1 { v[field].clone() } else { v[field][items - 1].clone() };
            assert_eq!((one("bootstrap_host"), one("bootstrap_port")), (host.into(), port.into()), "{v}");
            let room = if items == 1 { &v["bootstrap_room"] } else { &v["bootstrap_room"][0] };
            assert_eq!(room.as_i64(), Some(first), "{v}");
            rooms.push(first);
        }
        rooms.sort_unstable();
        rooms.dedup();
        assert_eq!(rooms.len(), 3, "no two attempts share a room");
    }

    #[test]
    fn a_failed_prefill_retries_or_ends_the_leg() {
        let retry = prefill_failed(Attempted::Retry(AttemptFailure::Unreachable("down".into())));
        assert!(matches!(retry, Err(AttemptFailure::Unreachable(_))));
        let mut four = Response::new(Body::empty());
        *four.status_mut() = StatusCode::BAD_REQUEST;
        assert!(matches!(prefill_failed(Attempted::ClientError(four)), Ok(Ended::ClientError(r)) if r.status() == 400));
        let failed = prefill_failed(Attempted::Failed(LegError::NoCandidate));
        assert!(matches!(failed, Ok(Ended::Failed(LegError::NoCandidate))));
    }

    #[test]
    fn what_follows_the_decode() {
        use AfterDecode::{Merge, Relay};
        for (merge, status, then) in [
            (true, StatusCode::OK, Merge),
            (true, StatusCode::INTERNAL_SERVER_ERROR, Relay { detach_prefill: false }),
            (false, StatusCode::OK, Relay { detach_prefill: true }),
            (false, StatusCode::SERVICE_UNAVAILABLE, Relay { detach_prefill: false }),
            (false, StatusCode::BAD_REQUEST, Relay { detach_prefill: false }),
        ] {
            assert_eq!(after_decode(merge, status), then, "{merge} {status}");
        }
    }

    #[tokio::test]
    async fn the_combined_answer() {
        let pre = br#"{"meta_info": {"input_token_logprobs": [[-0.5, 1, null]]}}"#;
        let dec = br#"{"text": "y", "meta_info": {"input_token_logprobs": [[-2.0, 3, null]]}}"#;
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, http::HeaderValue::from(dec.len()));
        headers.insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        for (prefill, merged) in [(&pre[..], true), (&b""[..], false), (&b"not json"[..], false)] {
            let r = combined(StatusCode::OK, headers.clone(), prefill, dec);
            assert_eq!(r.status(), StatusCode::OK);
            assert!(r.headers().get(header::CONTENT_LENGTH).is_none(), "the merged body has another length");
            assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
            let body = r.into_body().collect().await.unwrap().to_bytes();
            let v: Value = serde_json::from_slice(&body).unwrap();
            let logprobs = v["meta_info"]["input_token_logprobs"].as_array().unwrap().len();
            assert_eq!((v["text"].as_str(), logprobs), (Some("y"), if merged { 2 } else { 1 }), "{v}");
        }
    }
}
