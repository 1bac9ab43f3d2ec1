//! The vLLM flow, in the decode-first shape: route the request, run the prefill leg, optionally
//! pull the blocks ourselves (pull mode), run the decode leg on the local engine and relay its
//! body; failures follow the configured policy. Routing a request and the local decode are
//! shared with the SGLang flow ([`crate::sglang`]); [`crate::server`] picks the flow.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response};
use tracing::Instrument;

use crate::config::Fallback;
use crate::decode::{self, DecodeCall};
use crate::errors::LegError;
use crate::finish::Finish;
use crate::handoff::{Plan, Route};
use crate::ids::Ids;
use crate::json::Object;
use crate::legs::Legged;
use crate::metrics::{inc, LocalReason};
use crate::prefill::{self, Prefilled};
use crate::redirect;
use crate::release::{ReleaseGuard, Releaser};
use crate::rewrite::{self, Api};
use crate::routing;
use crate::target::Target;
use crate::upstream::{self, REQUEST_ID};
use crate::App;

/// The client's `X-Request-Id` when it is usable, else a fresh one.
pub fn request_id(ids: &Ids, headers: &HeaderMap) -> String {
    headers
        .get(REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(String::from)
        .unwrap_or_else(|| ids.request_id())
}

/// What routing did with a request (both flows).
pub(crate) enum Routed<'a> {
    /// It needed no prefill leg from here — a body that is not a JSON object (the engine
    /// explains the problem to the client), a local plan, a redirect to another sidecar — and
    /// was served.
    Served(Response<Body>),
    /// It is this sidecar's to disaggregate.
    Disaggregate(Disaggregation<'a>),
}

/// A request that routing left to this sidecar to disaggregate.
pub(crate) struct Disaggregation<'a> {
    pub object: Object<'a>,
    /// Prefill candidates in the order to try them.
    pub candidates: Vec<Target>,
    pub fin: Finish,
    /// The local engine's data-parallel rank the coordinator named for the decode leg.
    pub decode_rank: Option<u32>,
}

/// The client's headers with the decode leg's data-parallel rank, when the coordinator named one.
fn with_decode_rank(headers: &HeaderMap, rank: Option<u32>) -> std::borrow::Cow<'_, HeaderMap> {
    match rank {
        Some(rank) => {
            let mut ranked = headers.clone();
            upstream::set_dp_rank(&mut ranked, Some(rank));
            std::borrow::Cow::Owned(ranked)
        }
        None => std::borrow::Cow::Borrowed(headers),
    }
}

/// Parses the body, routes the request, and serves it when no prefill leg is needed here.
pub(crate) async fn route<'a>(
    app: &App,
    api: Api,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    body: &'a Bytes,
    fin: Finish,
) -> Routed<'a> {
    let Ok(object) = Object::parse(body) else {
        return Routed::Served(local(app, path, headers, rid, body, None, fin, None).await);
    };
    let coordinator = app.coordinator.as_deref();
    let engine_kind = app.engine_kind.get(&app.ctx, app.engines.primary()).await;
    let (route, decode_rank) =
        routing::route(&app.ctx, engine_kind, &app.prefills, coordinator, headers, &object, api, rid).await;
    let plan = match route {
        Route::Here(plan) | Route::NoSidecar { plan, .. } => plan,
        Route::Redirect(r) => match redirect::open(&app.ctx, &r, path, headers, rid, body).await {
            Ok(opened) => return Routed::Served(redirect::relay(&app.ctx, opened, fin).await),
            Err(fallback) => fallback,
        },
    };
    match plan {
        Plan::Local(reason) => {
            let headers = with_decode_rank(headers, decode_rank);
            Routed::Served(local(app, path, &headers, rid, body, Some(&object), fin, Some(reason)).await)
        }
        Plan::Prefill(candidates) => Routed::Disaggregate(Disaggregation { object, candidates, fin, decode_rank }),
        Plan::NoPrefillForDecodeOnly(decided) => {
            Routed::Served(fin.leg_failed(&LegError::NoPrefillForDecodeOnly { decided }))
        }
    }
}

pub(crate) async fn vllm(
    app: &App,
    api: Api,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    body: Bytes,
    fin: Finish,
) -> Response<Body> {
    let Disaggregation { object, candidates, mut fin, decode_rank } =
        match route(app, api, path, headers, rid, &body, fin).await {
            Routed::Disaggregate(d) => d,
            Routed::Served(response) => return response,
        };
    let headers = &*with_decode_rank(headers, decode_rank);
    let cfg = &app.ctx.cfg;
    let prefilled = prefill_detached(app, candidates, path, headers, rid, &object, &body).await;
    let prefilled_at = Instant::now();
    // Ok: the prefill's params; Err: the reason to compute the prompt here after all.
    let handed_off = match prefilled {
        Legged::Done(Prefilled::Params { params, target }) => Ok((params, target)),
        Legged::Done(Prefilled::ClientError(resp)) => return fin.client_error(resp),
        Legged::Done(Prefilled::NullParams { target }) => {
            tracing::warn!(prefill = %target.name(), "prefill returned kv_transfer_params: null");
            if cfg.null_params != Fallback::Local {
                return fin.leg_failed(&LegError::NullParams { prefill: target.name().to_string() });
            }
            Err(LocalReason::NullParams)
        }
        // Another 5xx follows --fallback; a body that is not JSON never does.
        Legged::Done(Prefilled::Failed(e)) => {
            if cfg.fallback != Fallback::Local || !matches!(e, LegError::PrefillStatus { .. }) {
                return fin.leg_failed(&e);
            }
            tracing::warn!(error = %e, "no prefill; computing the prompt locally");
            Err(LocalReason::PrefillFailed)
        }
        Legged::Fallback(e) => {
            tracing::warn!(error = %e, "no prefill; computing the prompt locally");
            Err(LocalReason::PrefillFailed)
        }
        Legged::Fail(e) => return fin.leg_failed(&LegError::from(e)),
    };
    let (params, target) = match handed_off {
        Ok(handed_off) => handed_off,
        Err(reason) => return local(app, path, headers, rid, &body, Some(&object), fin, Some(reason)).await,
    };
    inc(&app.ctx.metrics.disaggregated);
    fin.prefill_done(target.id.as_deref(), &params);
    fin.hold(ReleaseGuard::new(&app.releaser, rid, &params, body.clone(), path));
    let mut decode_params = params;
    if let Some(puller) = &app.puller {
        let span = tracing::info_span!("pull");
        match crate::pull::run(&app.ctx, puller, &object, path, rid, &decode_params).instrument(span).await {
            Ok(reservation) => {
                // The prefill was told we are done; now the reservation is what is held.
                fin.hold(ReleaseGuard::new(&app.releaser, rid, &reservation, body.clone(), path).decode_only());
                decode_params = reservation;
            }
            Err(e) => tracing::warn!(%e, "sidecar pull failed; the engine pulls itself"),
        }
    }
    let decode_body = Bytes::from(rewrite::decode_body(&object, &decode_params));
    let call = DecodeCall {
        path,
        headers,
        request_id: rid,
        body: decode_body,
        rewritten: true,
        prefilled_at: Some(prefilled_at),
    };
    decode::run(&app.ctx, &app.engines, call, fin).instrument(tracing::info_span!("decode")).await
}

/// Runs the prefill leg so that a client leaving mid-prefill does not strand the blocks the
/// prefill is about to hold: if this future is dropped unfinished, the call moves to a task of
/// its own (bounded by the prefill timeout) which, finding nobody waiting, releases what it got.
/// The common path spawns nothing.
async fn prefill_detached(
    app: &App,
    candidates: Vec<Target>,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    object: &Object<'_>,
    body: &Bytes,
) -> Legged<Prefilled> {
    let reader = match &app.puller {
        Some(puller) => puller.granted_reader(),
        None => app.ctx.cfg.engine_xfer_agent.as_deref(),
    };
    let prefill_body = Bytes::from(rewrite::prefill_body(object, reader));
    let releaser = Arc::clone(&app.releaser);
    let orphan = Orphan { releaser, rid: rid.to_string(), path: path.to_string(), body: body.clone() };
    let (legs, headers) = (Arc::clone(&app.legs), headers.clone());
    let span = tracing::info_span!("prefill", candidates = candidates.len());
    // The leg owns what an orphan needs and reads the request id and path from it.
    let leg = async move {
        let o = orphan;
        (prefill::run(&legs, &candidates, &o.path, &headers, &o.rid, prefill_body).await, o)
    };
    Orphanable { leg: Some(Box::pin(leg.instrument(span))) }.await
}

type Leg = std::pin::Pin<Box<dyn std::future::Future<Output = (Legged<Prefilled>, Orphan)> + Send>>;

/// What an abandoned prefill needs to release its blocks.
struct Orphan {
    releaser: Arc<Releaser>,
    rid: String,
    path: String,
    body: Bytes,
}

/// The prefill leg; dropped before it finished, it finishes in the background.
struct Orphanable {
    leg: Option<Leg>,
}

impl std::future::Future for Orphanable {
    type Output = Legged<Prefilled>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Legged<Prefilled>> {
        let leg = self.leg.as_mut().expect("polled after completion");
        let (out, _) = std::task::ready!(leg.as_mut().poll(cx));
        self.leg = None;
        std::task::Poll::Ready(out)
    }
}

impl Drop for Orphanable {
    fn drop(&mut self) {
        let Some(leg) = self.leg.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        rt.spawn(async move {
            let (out, o) = leg.await;
            if let Legged::Done(Prefilled::Params { params, .. }) = out {
                tracing::info!(request_id = %o.rid, "client left during the prefill; releasing its blocks");
                drop(ReleaseGuard::new(&o.releaser, &o.rid, &params, o.body, &o.path));
            }
        });
    }
}

/// Decodes on the local engine without a prefill leg (the engine computes the prompt).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn local(
    app: &App,
    path: &str,
    headers: &HeaderMap,
    rid: &str,
    body: &Bytes,
    object: Option<&Object<'_>>,
    fin: Finish,
    reason: Option<LocalReason>,
) -> Response<Body> {
    let ctx = &app.ctx;
    if let Some(r) = reason {
        ctx.metrics.local(r);
        if r == LocalReason::NoCandidate && ctx.cfg.fallback == Fallback::Fail {
            return fin.leg_failed(&LegError::NoCandidate);
        }
    }
    let rewritten = match object.filter(|_| !ctx.cfg.trust_client_kv_params).and_then(rewrite::local_body) {
        Some(b) => {
            inc(&ctx.metrics.client_kv_params_dropped);
            Some(Bytes::from(b))
        }
        None => None,
    };
    let call = DecodeCall {
        path,
        headers,
        request_id: rid,
        rewritten: rewritten.is_some(),
        body: rewritten.unwrap_or_else(|| body.clone()),
        prefilled_at: None,
    };
    decode::run(ctx, &app.engines, call, fin).instrument(tracing::info_span!("decode", local = true)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clients_request_id_when_usable() {
        let ids = Ids::default();
        let long = "x".repeat(257);
        for (sent, kept) in [
            ("abc-1", true),
            ("", false),
            ("a b", false),
            ("\u{e9}", false),
            (long.as_str(), false),
            (&long[1..], true),
        ] {
            let mut h = HeaderMap::new();
            if let Ok(v) = http::HeaderValue::from_str(sent) {
                h.insert(REQUEST_ID, v);
            }
            let id = request_id(&ids, &h);
            assert_eq!(id == sent, kept, "{sent:?}");
            assert!(!id.is_empty());
        }
    }
}
