//! Which prefill a request goes to, in order of authority: the `x-prefiller-host-port` header
//! of an upstream router (only targets the allowlist or the coordinator's view accept), the
//! coordinator's pairing, the coordinator's last view, the static list (round robin). Short
//! prompts skip the prefill leg. When the coordinator pairs the request with another decode
//! engine, the request is redirected to that engine's sidecar with the decision in headers.

use http::HeaderMap;

use crate::allowlist::validate_header;
use crate::coordinator::{Pairing, RemoteDecode};
use crate::json::Object;
use crate::metrics::{inc, LocalReason, RedirectOutcome};
use crate::rewrite::{self, Api};
use crate::state::State;
use crate::target::Target;
use crate::upstream::{REDIRECT_HEADER, ROUTING_HEADER};

/// Where one request is served.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    /// Here, on the local engine.
    Here(Plan),
    /// Handed to the sidecar of the decode engine the coordinator chose.
    Redirect(Redirect),
}

/// How a request is served on the local engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Decode locally without a prefill leg.
    Local(LocalReason),
    /// Prefill candidates in the order to try them.
    Prefill(Vec<Target>),
}

/// Where a redirected request goes and what it carries.
#[derive(Debug, Clone, PartialEq)]
pub struct Redirect {
    /// The chosen decode engine's sidecar.
    pub sidecar: Target,
    /// The chosen decode engine's id.
    pub decode: String,
    /// The chosen prefill; `None`: the decode engine computes the prompt itself.
    pub prefill: Option<Target>,
}

/// The decision a redirecting sidecar passed along ([`REDIRECT_HEADER`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirected {
    /// Decode without a prefill leg.
    Local,
    /// Prefill on the engine named by [`ROUTING_HEADER`] (any other value reads as this too).
    Prefill,
}

impl Redirected {
    pub fn of(headers: &HeaderMap) -> Option<Redirected> {
        let v = headers.get(REDIRECT_HEADER)?;
        Some(if v.as_bytes() == b"local" { Redirected::Local } else { Redirected::Prefill })
    }

    pub fn value(self) -> &'static str {
        match self {
            Redirected::Local => "local",
            Redirected::Prefill => "prefill",
        }
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

/// Appends `more` to `list` without duplicates (by base URL) or engines known dead.
fn extend_unique(state: &State, list: &mut Vec<Target>, more: impl IntoIterator<Item = Target>) {
    for t in more {
        if !state.dead.is_dead(&t) && !list.iter().any(|l| l.base == t.base) {
            list.push(t);
        }
    }
}

pub async fn plan(state: &State, headers: &HeaderMap, body: &Object<'_>, api: Api, request_id: &str) -> Route {
    let threshold = state.cfg.local_prefill_below_tokens;
    let redirected = Redirected::of(headers);
    if redirected.is_some() {
        state.metrics.redirect(RedirectOutcome::Received);
        tracing::Span::current().record("redirect", "received");
    }
    let header = header_targets(state, headers);
    // A redirected request was paired by the sidecar that sent it: never pair it twice.
    let coordinator = state.coordinator.as_ref().filter(|_| header.is_empty() && redirected.is_none());
    let prompt = if threshold > 0 || coordinator.is_some() { rewrite::prompt(body, api) } else { None };
    if threshold > 0 {
        if let Some(p) = &prompt {
            if p.estimated_tokens(state.cfg.chars_per_token) < threshold {
                return Route::Here(Plan::Local(LocalReason::Threshold));
            }
        }
    }
    if redirected == Some(Redirected::Local) {
        return Route::Here(Plan::Local(LocalReason::Coordinator));
    }
    let mut candidates = Vec::with_capacity(state.prefills.len() + header.len() + 1);
    extend_unique(state, &mut candidates, header);
    if let Some(c) = coordinator {
        let model: Option<String> = body.parsed("model");
        match c.pair(state, request_id, model.as_deref(), prompt.as_ref()).await {
            Some(Pairing { prefill, remote_decode: Some(RemoteDecode { id, sidecar: Some(sidecar) }) }) => {
                return Route::Redirect(Redirect { sidecar, decode: id, prefill });
            }
            Some(Pairing { prefill, remote_decode: Some(RemoteDecode { id, sidecar: None }) }) => {
                state.metrics.redirect(RedirectOutcome::NoSidecarUrl);
                tracing::debug!(decode = %id, "the chosen decode has no sidecar_url; decoding here");
                return Route::Here(fallback(state, prefill));
            }
            Some(Pairing { prefill: None, remote_decode: None }) => {
                return Route::Here(Plan::Local(LocalReason::Coordinator))
            }
            Some(Pairing { prefill: Some(t), remote_decode: None }) => extend_unique(state, &mut candidates, [t]),
            None => extend_unique(state, &mut candidates, c.view()),
        }
    } else if let (Some(c), Some(_)) = (&state.coordinator, redirected) {
        // Redirected, but the named prefill was not accepted: the coordinator's view.
        extend_unique(state, &mut candidates, c.view());
    }
    extend_unique(state, &mut candidates, state.static_prefills());
    Route::Here(candidates_plan(candidates))
}

fn candidates_plan(candidates: Vec<Target>) -> Plan {
    if candidates.is_empty() {
        Plan::Local(LocalReason::NoCandidate)
    } else {
        Plan::Prefill(candidates)
    }
}

/// Serving here a request paired with another decode engine: its prefill when it had one, then
/// the coordinator's view and the static list. Never the whole prompt on this engine because
/// the other engine had it cached (`local_prefill` there says nothing about this cache).
pub fn fallback(state: &State, prefill: Option<Target>) -> Plan {
    let mut candidates = Vec::with_capacity(state.prefills.len() + 1);
    extend_unique(state, &mut candidates, prefill);
    if let Some(c) = &state.coordinator {
        extend_unique(state, &mut candidates, c.view());
    }
    extend_unique(state, &mut candidates, state.static_prefills());
    candidates_plan(candidates)
}
