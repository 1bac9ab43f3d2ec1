//! Redirecting a request to the sidecar of the decode engine the coordinator chose (llm-d
//! style): the client's request goes there unchanged (same path, body bytes and request id,
//! minus hop-by-hop headers) with the pairing decision in headers, and the answer streams back
//! through the decode relay. That sidecar serves it without pairing again and owns its reports.
//! If it cannot be reached, answers a 5xx or stays silent (bounded), the request is served here.

use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};

use crate::context::Context;
use crate::decode::{self, Opened};
use crate::errors::{LegError, UpstreamError};
use crate::finish::Finish;
use crate::handoff::{Plan, Redirect, Redirected};
use crate::metrics::RedirectOutcome;
use crate::routing::redirect_mark;
use crate::upstream::{self, LegHeaders, PREFILL_DP_RANK_HEADER, REDIRECT_HEADER, ROUTING_HEADER};

/// The headers of the redirected leg: the client's (routing headers it sent stripped), the
/// request id, and the decision.
fn headers(client: &HeaderMap, request_id: &str, r: &Redirect) -> HeaderMap {
    let leg = LegHeaders { request_id, authorization: None, rewritten: false, identity: false };
    let mut out = upstream::leg_headers(client, leg, &[]);
    let (mark, prefill) = match &r.prefill {
        Some(p) => (Redirected::Prefill, HeaderValue::from_str(&p.host_port.authority()).ok()),
        None => (Redirected::Local, None),
    };
    out.insert(HeaderName::from_static(REDIRECT_HEADER), HeaderValue::from_static(redirect_mark(mark)));
    if let Some(p) = prefill {
        out.insert(HeaderName::from_static(ROUTING_HEADER), p);
    }
    // The ranks named for the other sidecar's engine and its prefill; the client's rank header
    // named one of this engine's.
    upstream::set_dp_rank(&mut out, r.decode_rank);
    if let Some(rank) = r.prefill.as_ref().and_then(|p| p.dp_rank) {
        out.insert(HeaderName::from_static(PREFILL_DP_RANK_HEADER), HeaderValue::from(rank));
    }
    out
}

/// Sends the request to the chosen decode's sidecar and waits — at most the prefill timeout plus
/// the decode first-byte timeout — for its head and first body frame. `Err` carries the plan to
/// serve the request here instead.
pub async fn open(
    ctx: &Context,
    r: &Redirect,
    path: &str,
    client_headers: &HeaderMap,
    request_id: &str,
    body: &Bytes,
) -> Result<Opened, Plan> {
    tracing::Span::current().record("redirect", r.decode.as_str());
    let started = Instant::now();
    let limit = ctx.cfg.prefill_timeout + ctx.cfg.decode_first_byte_timeout;
    let req = upstream::post(&r.sidecar, path, headers(client_headers, request_id, r), body.clone());
    let what = format!("the decode sidecar {}", r.sidecar.base);
    let outcome = match upstream::send(&ctx.client, &r.sidecar, req, limit).await {
        Ok(resp) if resp.status().is_server_error() => {
            Err((RedirectOutcome::FallbackErrorStatus, format!("{what} answered {}", resp.status())))
        }
        Ok(resp) => decode::first_frame(resp, None, &what, started, limit).await.map_err(|e| {
            let o = match e {
                LegError::NoOutput { .. } => RedirectOutcome::FallbackTimeout,
                _ => RedirectOutcome::FallbackUnreachable,
            };
            (o, e.to_string())
        }),
        Err(e @ UpstreamError::Timeout { .. }) => Err((RedirectOutcome::FallbackTimeout, e.to_string())),
        Err(e) => Err((RedirectOutcome::FallbackUnreachable, e.to_string())),
    };
    match outcome {
        Ok(opened) => {
            ctx.metrics.redirect(RedirectOutcome::Ok);
            Ok(opened)
        }
        Err((o, why)) => {
            ctx.metrics.redirect(o);
            tracing::warn!(decode = %r.decode, %why, "redirect failed; serving the request here");
            Err(r.fallback.clone())
        }
    }
}

/// Relays the redirected answer; the other sidecar reports on the request, so this one does not.
pub async fn relay(ctx: &Context, opened: Opened, mut fin: Finish) -> Response<Body> {
    fin.disown();
    decode::relay(ctx, opened, fin).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::handoff::Plan;
    use crate::metrics::LocalReason;
    use crate::target::Target;
    use crate::upstream::DP_RANK_HEADER;

    fn redirect(prefill: Option<&str>) -> Redirect {
        Redirect {
            sidecar: Target::parse("d:8000", "http", None).unwrap(),
            decode: "d1".into(),
            decode_rank: None,
            prefill: prefill.map(|p| Target::parse(p, "http", None).unwrap()),
            fallback: Plan::Local(LocalReason::NoCandidate),
        }
    }

    #[test]
    fn the_decision_travels_in_headers() {
        let mut client = HeaderMap::new();
        client.insert(ROUTING_HEADER, HeaderValue::from_static("10.6.6.6:1"));
        client.insert(REDIRECT_HEADER, HeaderValue::from_static("local"));
        client.insert("authorization", HeaderValue::from_static("Bearer t"));
        let out = headers(&client, "r1", &redirect(Some("10.0.0.5:8100")));
        assert_eq!(out[REDIRECT_HEADER], "prefill");
        assert_eq!(out[ROUTING_HEADER], "10.0.0.5:8100");
        assert_eq!(out["x-request-id"], "r1");
        assert_eq!(out["authorization"], "Bearer t", "the client's authorization passes");
        assert!(out.get(DP_RANK_HEADER).is_none() && out.get(PREFILL_DP_RANK_HEADER).is_none());
        let out = headers(&client, "r1", &redirect(None));
        assert_eq!(out[REDIRECT_HEADER], "local");
        assert!(out.get(ROUTING_HEADER).is_none(), "the client's routing header never passes");
        // Ranks named by the coordinator travel; the client's own rank header does not.
        client.insert(DP_RANK_HEADER, HeaderValue::from_static("3"));
        assert!(headers(&client, "r1", &redirect(None)).get(DP_RANK_HEADER).is_none());
        let mut ranked = redirect(Some("10.0.0.5:8100"));
        ranked.decode_rank = Some(1);
        ranked.prefill.as_mut().unwrap().dp_rank = Some(2);
        let out = headers(&client, "r1", &ranked);
        assert_eq!((out[DP_RANK_HEADER].to_str().unwrap(), out[PREFILL_DP_RANK_HEADER].to_str().unwrap()), ("1", "2"));
    }
}
