//! The handoff core: where a request is served, and what a failed prefill attempt leads to.
//! Pure — no I/O, no clock, no randomness of its own: the edge ([`crate::routing`], the leg
//! executor [`crate::legs`]) gathers the inputs, asks here, and carries out the answer.
//!
//! Order of authority for the prefill: the routing header of an upstream router (already
//! validated by the edge), the coordinator's pairing, the coordinator's last view (when pairing
//! failed, or a redirected request's prefill was refused), the static list. Short prompts and
//! the coordinator's `local_prefill` skip the prefill leg; a pairing with another decode engine
//! redirects the request to that engine's sidecar. A local engine that cannot compute a prompt
//! (a decode-mode SGLang, [`LocalEngine::DecodeOnly`]) never gets a request without a prefill
//! leg: a local decision becomes a prefill leg over every prefill known, or a clear error.

use std::time::Duration;

use crate::config::Fallback;
use crate::metrics::LocalReason;
use crate::target::Target;

/// The decision a redirecting sidecar passed along (`x-pd-redirected`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redirected {
    /// Decode without a prefill leg.
    Local,
    /// Prefill on the engine the routing header names.
    Prefill,
}

/// What the sidecar takes from a pairing decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Pairing {
    /// The prefill; `None`: the decode engine computes the prompt itself (`local_prefill`: the
    /// uncached part is short, or no prefill is worth it).
    pub prefill: Option<Target>,
    /// The decode engine the coordinator chose when it is another than this sidecar's.
    pub remote_decode: Option<RemoteDecode>,
    /// The decode engine's data-parallel rank holding the prompt, when the coordinator named one.
    pub decode_rank: Option<u32>,
}

/// Another engine chosen as decode, and its sidecar (where the request can be redirected).
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteDecode {
    pub id: String,
    /// `None` when it registered no (usable) `sidecar_url`.
    pub sidecar: Option<Target>,
}

/// What the coordinator's pairing came to.
#[derive(Debug, Clone, PartialEq)]
pub enum PairingAnswer {
    /// Not asked (no coordinator, or [`wants_pairing`] said no).
    NotAsked,
    /// Asked, no decision (pairing off, coordinator down or without an answer).
    Unavailable,
    /// (boxed: a decision is much larger than the other answers)
    Decided(Box<Pairing>),
}

/// What the local engine does with a request that comes without a prefill leg.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LocalEngine {
    /// It computes the prompt itself (vLLM, a plain SGLang, pd-sim).
    #[default]
    ComputesPrompts,
    /// It only decodes: SGLang started with `--disaggregation-mode decode` refuses (400) a body
    /// without `bootstrap_room`, so every request it serves needs a prefill leg.
    DecodeOnly,
}

/// Everything a route is decided from, gathered by the edge.
#[derive(Debug, Clone, PartialEq)]
pub struct Inputs {
    pub redirected: Option<Redirected>,
    /// The routing header's targets, when the allowlist (or the view) accepted all of them.
    pub header: Vec<Target>,
    /// The prompt's estimated size, when it was estimated.
    pub prompt_tokens: Option<u64>,
    /// `--local-prefill-below-tokens` (0: always disaggregate).
    pub local_below_tokens: u64,
    pub pairing: PairingAnswer,
    /// Prefill engines of the coordinator's last view (empty without a coordinator).
    pub view: Vec<Target>,
    /// The static list from its round-robin position.
    pub statics: Vec<Target>,
    /// Ids and base URLs of engines the coordinator reported dead: never candidates.
    pub dead: Vec<String>,
    pub local: LocalEngine,
}

/// Where one request is served.
#[derive(Debug, Clone, PartialEq)]
pub enum Route {
    /// Here, on the local engine.
    Here(Plan),
    /// Handed to the sidecar of the decode engine the coordinator chose.
    Redirect(Redirect),
    /// The coordinator chose another decode engine, which registered no sidecar to redirect to.
    NoSidecar { decode: String, plan: Plan },
}

/// How a request is served on the local engine.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    /// Decode locally without a prefill leg.
    Local(LocalReason),
    /// Prefill candidates in the order to try them.
    Prefill(Vec<Target>),
    /// Decode locally was decided (for this reason), but the local engine is
    /// [`LocalEngine::DecodeOnly`] and no prefill is known: the client gets an error.
    NoPrefillForDecodeOnly(LocalReason),
}

/// Where a redirected request goes, what it carries, and how it is served here if that fails.
#[derive(Debug, Clone, PartialEq)]
pub struct Redirect {
    /// The chosen decode engine's sidecar.
    pub sidecar: Target,
    /// The chosen decode engine's id.
    pub decode: String,
    /// Its data-parallel rank, when the coordinator named one (passed on as the rank header).
    pub decode_rank: Option<u32>,
    /// The chosen prefill; `None`: the decode engine computes the prompt itself.
    pub prefill: Option<Target>,
    /// Serving the request here after all: its prefill, then the view and the static list —
    /// never the whole prompt here because *another* engine had it cached.
    pub fallback: Plan,
}

impl Inputs {
    fn short(&self) -> bool {
        self.local_below_tokens > 0 && self.prompt_tokens.is_some_and(|t| t < self.local_below_tokens)
    }

    fn is_dead(&self, t: &Target) -> bool {
        self.dead.iter().any(|d| *d == t.base || t.id.as_deref() == Some(d.as_str()))
    }

    /// `list` with `more` appended, without duplicates (by base URL) or dead engines.
    fn extend<'t>(&self, list: &mut Vec<Target>, more: impl IntoIterator<Item = &'t Target>) {
        for t in more {
            if !self.is_dead(t) && !list.iter().any(|l| l.base == t.base) {
                list.push(t.clone());
            }
        }
    }

    fn candidates(&self, lists: &[&[Target]]) -> Plan {
        let mut out = Vec::with_capacity(lists.iter().map(|l| l.len()).sum());
        for list in lists {
            self.extend(&mut out, list.iter());
        }
        if out.is_empty() {
            Plan::Local(LocalReason::NoCandidate)
        } else {
            Plan::Prefill(out)
        }
    }
}

/// Whether the coordinator (when there is one) is asked to pair: nothing upstream decided
/// already (a routing header, a redirect mark: a redirected request is never paired twice) and
/// the prompt is not short enough to be computed here anyway.
pub fn wants_pairing(inputs: &Inputs) -> bool {
    inputs.header.is_empty() && inputs.redirected.is_none() && !inputs.short()
}

/// Decides where a request is served.
pub fn plan(inputs: &Inputs) -> Route {
    let route = plan_for_any_engine(inputs);
    if inputs.local == LocalEngine::ComputesPrompts {
        return route;
    }
    match route {
        Route::Here(plan) => Route::Here(with_prefill(inputs, plan)),
        Route::Redirect(r) => Route::Redirect(Redirect { fallback: with_prefill(inputs, r.fallback), ..r }),
        Route::NoSidecar { decode, plan } => Route::NoSidecar { decode, plan: with_prefill(inputs, plan) },
    }
}

/// A plan a decode-only engine can serve: a local decision becomes the prefill leg over every
/// prefill known (header, the coordinator's view, the static list), or, with none, an error.
/// A short prompt or the coordinator's `local_prefill` cannot be computed there either.
fn with_prefill(inputs: &Inputs, plan: Plan) -> Plan {
    match plan {
        Plan::Local(reason) => match inputs.candidates(&[&inputs.header, &inputs.view, &inputs.statics]) {
            Plan::Prefill(list) => Plan::Prefill(list),
            _ => Plan::NoPrefillForDecodeOnly(reason),
        },
        other => other,
    }
}

fn plan_for_any_engine(inputs: &Inputs) -> Route {
    if inputs.short() {
        return Route::Here(Plan::Local(LocalReason::Threshold));
    }
    if inputs.redirected == Some(Redirected::Local) {
        return Route::Here(Plan::Local(LocalReason::Coordinator));
    }
    let header = inputs.header.as_slice();
    match &inputs.pairing {
        PairingAnswer::Decided(pairing) => follow(inputs, header, pairing),
        PairingAnswer::Unavailable => Route::Here(inputs.candidates(&[header, &inputs.view, &inputs.statics])),
        // A redirected request whose named prefill was refused: the view vouches for others.
        PairingAnswer::NotAsked if inputs.redirected.is_some() => {
            Route::Here(inputs.candidates(&[header, &inputs.view, &inputs.statics]))
        }
        PairingAnswer::NotAsked => Route::Here(inputs.candidates(&[header, &inputs.statics])),
    }
}

/// The route of a coordinator's decision.
fn follow(inputs: &Inputs, header: &[Target], pairing: &Pairing) -> Route {
    match pairing {
        Pairing { prefill, remote_decode: Some(RemoteDecode { id, sidecar }), decode_rank } => {
            let prefill_list = prefill.as_slice();
            let fallback = inputs.candidates(&[prefill_list, &inputs.view, &inputs.statics]);
            match sidecar {
                Some(sidecar) => Route::Redirect(Redirect {
                    sidecar: sidecar.clone(),
                    decode: id.clone(),
                    decode_rank: *decode_rank,
                    prefill: prefill.clone(),
                    fallback,
                }),
                None => Route::NoSidecar { decode: id.clone(), plan: fallback },
            }
        }
        Pairing { prefill: None, remote_decode: None, .. } => Route::Here(Plan::Local(LocalReason::Coordinator)),
        Pairing { prefill: Some(p), remote_decode: None, .. } => {
            Route::Here(inputs.candidates(&[header, std::slice::from_ref(p), &inputs.statics]))
        }
    }
}

/// The failover policy of the prefill leg (`--max-prefill-attempts`, `--failover-backoff`,
/// `--failover-backoff-max`, `--fallback`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Failover {
    pub max_attempts: usize,
    pub backoff: Duration,
    pub backoff_max: Duration,
    pub fallback: Fallback,
}

/// How one prefill attempt failed in a way another candidate may fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptFailure {
    /// Nothing reached the engine or it refused the work (connect error, 503, reported dead).
    Unreachable(String),
    /// It was reached but did not answer usefully (timeout, a failover status, a broken body).
    Failed(String),
}

impl AttemptFailure {
    fn reason(&self) -> &str {
        match self {
            AttemptFailure::Unreachable(r) | AttemptFailure::Failed(r) => r,
        }
    }
}

/// The attempts of one request so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempts {
    pub made: usize,
    pub all_unreachable: bool,
}

impl Default for Attempts {
    fn default() -> Self {
        Attempts { made: 0, all_unreachable: true }
    }
}

/// Why the prefill leg gave up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrefillExhausted {
    /// No candidate could be reached (a 503 to the client).
    #[error("no prefill engine available ({tried} tried): {last}")]
    NothingReachable { tried: usize, last: String },
    /// Some were reached, none answered (a 502).
    #[error("prefill failed ({tried} tried): {last}")]
    AllFailed { tried: usize, last: String },
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, PartialEq)]
pub enum Next<'c> {
    /// Try `target` after the pause.
    Retry { target: &'c Target, after: Duration },
    /// Compute the prompt on the local engine (`--fallback local`).
    Fallback(PrefillExhausted),
    /// Answer the client with the error.
    Fail(PrefillExhausted),
}

impl Failover {
    /// The pause before failover number `n` (1 = the first): exponential, capped, with full
    /// jitter in [capped/2, capped] so that many requests hitting one failure spread out.
    /// `jitter` is uniform in [0, 1).
    pub fn backoff(&self, n: usize, jitter: f64) -> Duration {
        let exponent = n.saturating_sub(1).min(16) as i32;
        let capped = (self.backoff.as_secs_f64() * 2f64.powi(exponent)).min(self.backoff_max.as_secs_f64());
        Duration::from_secs_f64(capped * (0.5 + jitter.clamp(0.0, 1.0) / 2.0))
    }

    /// The policy for `local`: a decode-only engine cannot compute the prompt, so `--fallback
    /// local` fails the request there instead (its prefills were all tried).
    pub fn for_engine(self, local: LocalEngine) -> Failover {
        match local {
            LocalEngine::ComputesPrompts => self,
            LocalEngine::DecodeOnly => Failover { fallback: Fallback::Fail, ..self },
        }
    }

    /// Records the failed attempt in `attempts` and says what comes next.
    pub fn next<'c>(
        &self,
        candidates: &'c [Target],
        attempts: &mut Attempts,
        failure: &AttemptFailure,
        jitter: f64,
    ) -> Next<'c> {
        attempts.made += 1;
        attempts.all_unreachable &= matches!(failure, AttemptFailure::Unreachable(_));
        let limit = candidates.len().min(self.max_attempts);
        if attempts.made < limit {
            return Next::Retry { target: &candidates[attempts.made], after: self.backoff(attempts.made, jitter) };
        }
        self.give_up(attempts, failure.reason())
    }

    /// The end of the leg without a usable answer: the fallback, or the error.
    pub fn give_up(&self, attempts: &Attempts, last: &str) -> Next<'static> {
        let (tried, last) = (attempts.made, last.to_string());
        let exhausted = if attempts.all_unreachable {
            PrefillExhausted::NothingReachable { tried, last }
        } else {
            PrefillExhausted::AllFailed { tried, last }
        };
        match self.fallback {
            Fallback::Local => Next::Fallback(exhausted),
            Fallback::Fail => Next::Fail(exhausted),
        }
    }
}

#[cfg(test)]
mod tests;
