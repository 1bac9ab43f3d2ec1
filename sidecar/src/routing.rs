//! The routing edge: gathers what [`crate::handoff::plan`] decides from — the validated
//! `x-prefiller-host-port` header (only targets the allowlist or the coordinator's view accept)
//! and the redirect mark, the prompt-size estimate, the coordinator's pairing, its last view and
//! the static list — and hands back the route. The decision itself is made in `handoff`.

use http::HeaderMap;

use crate::allowlist::validate_header;
use crate::coordinator::Coordinator;
use crate::handoff::{self, Inputs, PairingAnswer, Redirected, Route};
use crate::json::Object;
use crate::metrics::{inc, RedirectOutcome};
use crate::rewrite::{self, Api};
use crate::state::State;
use crate::target::Target;
use crate::upstream::{REDIRECT_HEADER, ROUTING_HEADER};

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
pub fn header_targets(state: &State, headers: &HeaderMap) -> Vec<Target> {
    if state.cfg.ignore_routing_header {
        return Vec::new();
    }
    let Some(value) = headers.get(ROUTING_HEADER) else { return Vec::new() };
    let text = value.to_str().unwrap_or_default();
    let coordinator = state.coordinator.as_deref();
    let vouched = |hp: &_| coordinator.and_then(|c| c.view_target(hp));
    match validate_header(text, |hp| state.resolved.allowlist.allows(hp) || vouched(hp).is_some()) {
        Ok(targets) => targets
            .into_iter()
            .map(|hp| {
                // A listed static entry keeps its scheme and bootstrap port; a view entry its id.
                let listed = state.prefills.iter().find(|p| p.host_port == hp).cloned();
                listed.or_else(|| vouched(&hp)).unwrap_or_else(|| {
                    Target::from_host_port(hp, &state.cfg.prefill_scheme, Some(state.cfg.bootstrap_port))
                })
            })
            .collect(),
        Err(e) => {
            inc(&state.metrics.routing_header_rejected);
            tracing::warn!(%e, "ignoring a routing header the allowlist refuses");
            Vec::new()
        }
    }
}

/// Gathers the inputs of [`handoff::plan`] — asking the coordinator to pair when the core
/// wants it — and returns its route.
pub async fn route(state: &State, headers: &HeaderMap, body: &Object<'_>, api: Api, request_id: &str) -> Route {
    let threshold = state.cfg.local_prefill_below_tokens;
    let redirected = redirected(headers);
    if redirected.is_some() {
        state.metrics.redirect(RedirectOutcome::Received);
        tracing::Span::current().record("redirect", "received");
    }
    let coordinator = state.coordinator.as_deref();
    let prompt = if threshold > 0 || coordinator.is_some() { rewrite::prompt(body, api) } else { None };
    let mut inputs = Inputs {
        redirected,
        header: header_targets(state, headers),
        prompt_tokens: prompt.as_ref().map(|p| p.estimated_tokens(state.cfg.chars_per_token)),
        local_below_tokens: threshold,
        pairing: PairingAnswer::NotAsked,
        view: coordinator.map(Coordinator::view).unwrap_or_default(),
        statics: state.static_prefills(),
        dead: state.dead.snapshot(),
    };
    if let Some(c) = coordinator.filter(|_| handoff::wants_pairing(&inputs)) {
        let model: Option<String> = body.parsed("model");
        inputs.pairing = match c.pair(state, request_id, model.as_deref(), prompt.as_ref()).await {
            Some(pairing) => PairingAnswer::Decided(pairing),
            None => PairingAnswer::Unavailable,
        };
    }
    let route = handoff::plan(&inputs);
    if let Route::NoSidecar { decode, .. } = &route {
        state.metrics.redirect(RedirectOutcome::NoSidecarUrl);
        tracing::debug!(%decode, "the chosen decode has no sidecar_url; decoding here");
    }
    route
}
