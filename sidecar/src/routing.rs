//! The routing edge: gathers what [`crate::handoff::plan`] decides from — the validated
//! `x-prefiller-host-port` header (only targets the allowlist or the coordinator's view accept)
//! and the redirect mark, the prompt-size estimate, the coordinator's pairing, its last view and
//! the static list — and hands back the route. The decision itself is made in `handoff`.

use http::HeaderMap;

use crate::allowlist::validate_header;
use crate::context::Context;
use crate::coordinator::Coordinator;
use crate::engines::Prefills;
use crate::handoff::{self, Inputs, LocalEngine, PairingAnswer, Redirected, Route};
use crate::json::Object;
use crate::metrics::{inc, RedirectOutcome};
use crate::rewrite::{self, Api};
use crate::target::Target;
use crate::upstream::{PREFILL_DP_RANK_HEADER, REDIRECT_HEADER, ROUTING_HEADER};

/// Reads the redirect mark ([`REDIRECT_HEADER`]): `local`, anything else reads as `prefill`.
pub fn redirected(headers: &HeaderMap) -> Option<Redirected> {
    let v = headers.get(REDIRECT_HEADER)?;
    Some(if v.as_bytes() == b"local" { Redirected::Local } else { Redirected::Prefill })
}

/// The mark's header value.
pub fn redirect_mark(r: Redirected) -> &'static str {
    match r {
        Redirected::Local => "local",
        Redirected::Prefill => "prefill",
    }
}

/// The header's targets when present and valid; an invalid header is counted and ignored. A
/// target is valid when the allowlist accepts it or the coordinator's last view lists it as a
/// prefill engine (the pairing decisions a redirecting sidecar passes along name those).
pub fn header_targets(
    ctx: &Context,
    prefills: &Prefills,
    coordinator: Option<&Coordinator>,
    headers: &HeaderMap,
) -> Vec<Target> {
    let cfg = &ctx.cfg;
    if cfg.ignore_routing_header {
        return Vec::new();
    }
    let Some(value) = headers.get(ROUTING_HEADER) else { return Vec::new() };
    let text = value.to_str().unwrap_or_default();
    let vouched = |hp: &_| coordinator.and_then(|c| c.view_target(hp));
    // A redirecting sidecar names the one prefill's data-parallel rank beside it.
    let rank =
        redirected(headers).and(headers.get(PREFILL_DP_RANK_HEADER)).and_then(|v| v.to_str().ok()?.parse::<u32>().ok());
    match validate_header(text, |hp| prefills.allowlist.allows(hp) || vouched(hp).is_some()) {
        Ok(targets) => {
            let single = targets.len() == 1;
            targets
                .into_iter()
                .map(|hp| {
                    // A listed static entry keeps its scheme and bootstrap port; a view entry its id.
                    let listed = prefills.listed(&hp);
                    let mut target = listed
                        .or_else(|| vouched(&hp))
                        .unwrap_or_else(|| Target::from_host_port(hp, &cfg.prefill_scheme, Some(cfg.bootstrap_port)));
                    target.dp_rank = rank.filter(|_| single);
                    target
                })
                .collect()
        }
        Err(e) => {
            inc(&ctx.metrics.routing_header_rejected);
            tracing::warn!(%e, "ignoring a routing header the allowlist refuses");
            Vec::new()
        }
    }
}

/// Gathers the inputs of [`handoff::plan`] — asking the coordinator to pair when the core
/// wants it — and returns its route, with the local engine's data-parallel rank when the
/// coordinator kept the decode here and named one.
#[allow(clippy::too_many_arguments)]
pub async fn route(
    ctx: &Context,
    local: LocalEngine,
    prefills: &Prefills,
    coordinator: Option<&Coordinator>,
    headers: &HeaderMap,
    body: &Object<'_>,
    api: Api,
    request_id: &str,
) -> (Route, Option<u32>) {
    let threshold = ctx.cfg.local_prefill_below_tokens;
    let redirected = redirected(headers);
    if redirected.is_some() {
        ctx.metrics.redirect(RedirectOutcome::Received);
        tracing::Span::current().record("redirect", "received");
    }
    let prompt = if threshold > 0 || coordinator.is_some() { rewrite::prompt(body, api) } else { None };
    let mut inputs = Inputs {
        redirected,
        header: header_targets(ctx, prefills, coordinator, headers),
        prompt_tokens: prompt.as_ref().map(|p| p.estimated_tokens(ctx.cfg.chars_per_token)),
        local_below_tokens: threshold,
        pairing: PairingAnswer::NotAsked,
        view: coordinator.map(Coordinator::view).unwrap_or_default(),
        statics: prefills.rotation(),
        dead: prefills.dead.snapshot(),
        local,
    };
    if let Some(c) = coordinator.filter(|_| handoff::wants_pairing(&inputs)) {
        let model: Option<String> = body.parsed("model");
        inputs.pairing = match c.pair(&ctx.client, &ctx.metrics, request_id, model.as_deref(), prompt.as_ref()).await {
            Some(pairing) => PairingAnswer::Decided(Box::new(pairing)),
            None => PairingAnswer::Unavailable,
        };
    }
    let route = handoff::plan(&inputs);
    if let Route::NoSidecar { decode, .. } = &route {
        ctx.metrics.redirect(RedirectOutcome::NoSidecarUrl);
        tracing::debug!(%decode, "the chosen decode has no sidecar_url; decoding here");
    }
    let own_rank = match &inputs.pairing {
        PairingAnswer::Decided(p) if p.remote_decode.is_none() => p.decode_rank,
        _ => None,
    };
    (route, own_rank)
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use http::HeaderValue;

    use super::*;
    use crate::handoff::Plan;
    use crate::metrics::LocalReason;

    fn app(flags: &[&str]) -> crate::App {
        let args = ["pd-sidecar", "--engine", "127.0.0.1:1"].iter().chain(flags);
        crate::build(crate::config::Config::try_parse_from(args).unwrap()).unwrap()
    }

    fn with(name: &'static str, value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn the_redirect_mark() {
        assert_eq!(redirected(&HeaderMap::new()), None);
        for (value, mark) in
            [("local", Redirected::Local), ("prefill", Redirected::Prefill), ("x", Redirected::Prefill)]
        {
            assert_eq!(redirected(&with(REDIRECT_HEADER, value)), Some(mark), "{value}");
        }
        for mark in [Redirected::Local, Redirected::Prefill] {
            assert_eq!(redirected(&with(REDIRECT_HEADER, redirect_mark(mark))), Some(mark));
        }
    }

    #[test]
    fn routing_header_targets() {
        let s = app(&["--prefill", "10.0.0.1:8100#bootstrap=9000", "--allow", "10.9.0.0/16"]);
        let listed = header_targets(&s.ctx, &s.prefills, None, &with(ROUTING_HEADER, "10.0.0.1:8100"));
        assert_eq!((listed[0].base.as_str(), listed[0].bootstrap_port), ("http://10.0.0.1:8100", Some(9000)));
        let allowed = header_targets(&s.ctx, &s.prefills, None, &with(ROUTING_HEADER, "10.9.1.2:7000, 10.0.0.1:8100"));
        let bases: Vec<_> = allowed.iter().map(|t| t.base.as_str()).collect();
        assert_eq!(bases, ["http://10.9.1.2:7000", "http://10.0.0.1:8100"]);
        assert!(header_targets(&s.ctx, &s.prefills, None, &HeaderMap::new()).is_empty());
        // One refused target refuses the header, counted.
        assert!(header_targets(&s.ctx, &s.prefills, None, &with(ROUTING_HEADER, "10.9.1.2:7000,1.2.3.4:1")).is_empty());
        assert_eq!(s.ctx.metrics.routing_header_rejected.load(std::sync::atomic::Ordering::Relaxed), 1);
        // A redirecting sidecar's rank for the one prefill it names; a client's is not read.
        let mut named = with(ROUTING_HEADER, "10.0.0.1:8100");
        named.insert(PREFILL_DP_RANK_HEADER, HeaderValue::from_static("2"));
        assert_eq!(header_targets(&s.ctx, &s.prefills, None, &named)[0].dp_rank, None);
        named.insert(REDIRECT_HEADER, HeaderValue::from_static("prefill"));
        assert_eq!(header_targets(&s.ctx, &s.prefills, None, &named)[0].dp_rank, Some(2));
        let ignoring = app(&["--prefill", "10.0.0.1:8100", "--ignore-routing-header"]);
        assert!(
            header_targets(&ignoring.ctx, &ignoring.prefills, None, &with(ROUTING_HEADER, "10.0.0.1:8100")).is_empty()
        );
    }

    #[tokio::test]
    async fn the_edge_hands_the_core_its_inputs() {
        let s = app(&["--prefill", "10.0.0.1:8100", "--local-prefill-below-tokens", "10"]);
        let body = Object::parse(br#"{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "max_tokens": 1}"#).unwrap();
        let Route::Here(Plan::Prefill(c)) = route(
            &s.ctx,
            LocalEngine::ComputesPrompts,
            &s.prefills,
            None,
            &HeaderMap::new(),
            &body,
            Api::Completions,
            "r",
        )
        .await
        .0
        else {
            panic!("expected the static prefill")
        };
        assert_eq!(c[0].base, "http://10.0.0.1:8100");
        let short = Object::parse(br#"{"prompt": [1, 2, 3], "max_tokens": 1}"#).unwrap();
        let (short_route, _) = route(
            &s.ctx,
            LocalEngine::ComputesPrompts,
            &s.prefills,
            None,
            &HeaderMap::new(),
            &short,
            Api::Completions,
            "r",
        )
        .await;
        assert_eq!(short_route, Route::Here(Plan::Local(LocalReason::Threshold)));
        let received = with(REDIRECT_HEADER, "local");
        let body =
            Object::parse(br#"{"prompt": "a much longer prompt than ten tokens, surely", "max_tokens": 1}"#).unwrap();
        let (marked, _) =
            route(&s.ctx, LocalEngine::ComputesPrompts, &s.prefills, None, &received, &body, Api::Completions, "r")
                .await;
        assert_eq!(marked, Route::Here(Plan::Local(LocalReason::Coordinator)));
    }
}
