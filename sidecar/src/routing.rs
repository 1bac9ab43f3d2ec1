//! Which prefill a request goes to, in order of authority: the `x-prefiller-host-port` header
//! of an upstream router (only targets the allowlist accepts), the coordinator's pairing, the
//! coordinator's last view, the static list (round robin). Short prompts skip the prefill leg.

use http::HeaderMap;

use crate::allowlist::validate_header;
use crate::coordinator::Pairing;
use crate::json::Object;
use crate::metrics::{inc, LocalReason};
use crate::rewrite::{self, Api};
use crate::state::State;
use crate::target::Target;
use crate::upstream::ROUTING_HEADER;

/// The plan for one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Decode locally without a prefill leg.
    Local(LocalReason),
    /// Prefill candidates in the order to try them.
    Prefill(Vec<Target>),
}

/// The header's targets when present and valid; an invalid header is counted and ignored.
pub fn header_targets(state: &State, headers: &HeaderMap) -> Vec<Target> {
    if state.cfg.ignore_routing_header {
        return Vec::new();
    }
    let Some(value) = headers.get(ROUTING_HEADER) else { return Vec::new() };
    let text = value.to_str().unwrap_or_default();
    match validate_header(text, &state.resolved.allowlist) {
        Ok(targets) => targets
            .into_iter()
            .map(|hp| {
                // A listed static entry keeps its scheme and bootstrap port.
                state.prefills.iter().find(|p| p.host_port == hp).cloned().unwrap_or_else(|| {
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

pub async fn plan(state: &State, headers: &HeaderMap, body: &Object<'_>, api: Api, request_id: &str) -> Plan {
    let threshold = state.cfg.local_prefill_below_tokens;
    let header = header_targets(state, headers);
    let coordinator = state.coordinator.as_ref().filter(|_| header.is_empty());
    let prompt = if threshold > 0 || coordinator.is_some() { rewrite::prompt(body, api) } else { None };
    if threshold > 0 {
        if let Some(p) = &prompt {
            if p.estimated_tokens(state.cfg.chars_per_token) < threshold {
                return Plan::Local(LocalReason::Threshold);
            }
        }
    }
    let mut candidates = Vec::with_capacity(state.prefills.len() + header.len() + 1);
    extend_unique(state, &mut candidates, header);
    if let Some(c) = coordinator {
        let model: Option<String> = body.parsed("model");
        match c.pair(state, request_id, model.as_deref(), prompt.as_ref()).await {
            Some(Pairing::Local) => return Plan::Local(LocalReason::Coordinator),
            Some(Pairing::Prefill(t)) => extend_unique(state, &mut candidates, [t]),
            None => extend_unique(state, &mut candidates, c.view()),
        }
    }
    extend_unique(state, &mut candidates, state.static_prefills());
    if candidates.is_empty() {
        Plan::Local(LocalReason::NoCandidate)
    } else {
        Plan::Prefill(candidates)
    }
}
