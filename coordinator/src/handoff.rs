//! P→D handoffs in flight and the load they put on engines: so pairing sees queued prefill and
//! active decode work, and so blocks a prefill holds for a decode that died are released
//! through the prefill's sidecar instead of waiting out the engine's lease.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::pairing::Load;
use crate::placement::Sample;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Routed; the prefill computes the prompt.
    Prefilling,
    /// The prefill returned params and holds `blocks` for the decode to pull.
    Held,
    /// The decode pulled and is generating.
    Decoding,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Handoff {
    pub prefill: Option<usize>,
    pub decode: usize,
    pub blocks: u64,
    pub stage: Stage,
    pub deadline: Instant,
    pub routed_at: Instant,
    pub prefill_done_at: Option<Instant>,
    /// `decode_started` was reported (its time measured).
    pub decode_seen: bool,
    /// Prompt tokens the engine computing the prompt lacks, and those the decode lacks (what it
    /// pulls when disaggregated): what the observed times are per ([`Handoffs::measure`]).
    pub computed_tokens: u64,
    pub pulled_tokens: u64,
    /// The ms of prompts queued ahead of it where it is computed, when it was routed.
    pub queued_ms: f64,
    /// When its prompt is predicted to be computed, and its decode to start (the same instant
    /// for a local prefill): placement's view of the prompts running on each engine and of the
    /// decodes about to start ([`Handoffs::forecast`]). `routed_at` until forecast: due now.
    pub computed_at: Instant,
    pub decoding_at: Instant,
}

/// What the caller must do after a change.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    /// Free the blocks `prefill` holds for `request` (through its sidecar).
    Release { request: String, prefill: usize },
    /// Tell the sidecar in charge of `request` that an engine it uses died, so it fails over.
    Notify { request: String, decode: usize, dead: usize },
}

#[derive(Debug)]
pub struct Handoffs {
    /// After this long a handoff that never finished is phantom load and is dropped.
    max_age: Duration,
    live: HashMap<String, Handoff>,
    /// What `live` adds up to per engine (by engine id), kept as handoffs change: pairing asks
    /// for every candidate's load on every decision.
    loads: Loads,
    /// How often each engine is named as decode, by engine id.
    arrivals: Vec<Arrivals>,
}

/// Per engine: blocks queued and decoding, and requests bound to decode there, in any stage
/// (one prefilling elsewhere pulls and decodes there soon); when each prompt computed there is
/// predicted to be done, and when each request bound there that has not started decoding is
/// predicted to start.
#[derive(Debug, Default)]
struct Loads {
    blocks: Vec<Load>,
    bound: Vec<u64>,
    computing: Vec<Vec<Instant>>,
    starting: Vec<Vec<Instant>>,
}

/// The rate at which requests are routed to one decode engine: an exponentially weighted mean
/// of the gaps between them (about the last 10), so that placement can tell how many requests
/// will start decoding there while a prompt is computed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Arrivals {
    last: Option<Instant>,
    /// Mean gap in ms; `None` until two arrivals were seen.
    mean_gap_ms: Option<f64>,
}

/// Weight of the newest gap in the mean.
const GAP_WEIGHT: f64 = 0.1;

impl Arrivals {
    pub fn arrived(&mut self, now: Instant) {
        if let Some(last) = self.last {
            let gap = now.saturating_duration_since(last).as_secs_f64() * 1e3;
            self.mean_gap_ms = Some(match self.mean_gap_ms {
                Some(mean) => mean + GAP_WEIGHT * (gap - mean),
                None => gap,
            });
        }
        self.last = Some(now.max(self.last.unwrap_or(now)));
    }

    /// Requests per ms; a quiet spell longer than the mean gap lowers it at once.
    pub fn per_ms(&self, now: Instant) -> f64 {
        let (Some(last), Some(mean)) = (self.last, self.mean_gap_ms) else { return 0.0 };
        let since = now.saturating_duration_since(last).as_secs_f64() * 1e3;
        let gap = mean.max(since);
        if gap > 0.0 && gap.is_finite() {
            1.0 / gap
        } else {
            // Arrivals in the same instant: as many as a millisecond could hold is plenty.
            1.0
        }
    }
}

/// Adds (`add`) or takes back a handoff's share of its engines' load.
fn account(loads: &mut Loads, h: &Handoff, add: bool) {
    let engines = h.decode.max(h.prefill.unwrap_or(0)) + 1;
    if loads.blocks.len() < engines {
        loads.blocks.resize(engines, Load::default());
        loads.bound.resize(engines, 0);
        loads.computing.resize(engines, Vec::new());
        loads.starting.resize(engines, Vec::new());
    }
    let change = |value: &mut u64, by: u64| {
        *value = if add { value.saturating_add(by) } else { value.saturating_sub(by) };
    };
    match (h.stage, h.prefill) {
        (Stage::Prefilling, Some(prefill)) => change(&mut loads.blocks[prefill].queued_prefill_blocks, h.blocks),
        (Stage::Decoding, _) => change(&mut loads.blocks[h.decode].active_decode_blocks, h.blocks),
        _ => {}
    }
    change(&mut loads.bound[h.decode], 1);
    // A local prefill is computed until the decode's first output.
    let computed_on = match (h.stage, h.prefill) {
        (Stage::Prefilling, Some(prefill)) => Some(prefill),
        (_, None) if !h.decode_seen => Some(h.decode),
        _ => None,
    };
    if let Some(engine) = computed_on {
        toggle(&mut loads.computing[engine], h.computed_at, add);
    }
    if !h.decode_seen {
        toggle(&mut loads.starting[h.decode], h.decoding_at, add);
    }
}

/// Adds `at` to `list`, or takes one equal to it back (equal instants are interchangeable).
fn toggle(list: &mut Vec<Instant>, at: Instant, add: bool) {
    if add {
        list.push(at);
    } else if let Some(i) = list.iter().position(|&x| x == at) {
        list.swap_remove(i);
    }
}

impl Handoffs {
    pub fn new(max_age: Duration) -> Self {
        Handoffs { max_age, live: HashMap::new(), loads: Loads::default(), arrivals: Vec::new() }
    }

    /// A routing decision: `prefill` is `None` when the decode prefills locally.
    pub fn routed(&mut self, request: &str, prefill: Option<usize>, decode: usize, blocks: u64, now: Instant) {
        let stage = if prefill.is_some() { Stage::Prefilling } else { Stage::Decoding };
        let handoff = Handoff {
            prefill,
            decode,
            blocks,
            stage,
            deadline: now + self.max_age,
            routed_at: now,
            prefill_done_at: None,
            decode_seen: false,
            computed_tokens: 0,
            pulled_tokens: 0,
            queued_ms: 0.0,
            computed_at: now,
            decoding_at: now,
        };
        account(&mut self.loads, &handoff, true);
        if self.arrivals.len() <= decode {
            self.arrivals.resize(decode + 1, Arrivals::default());
        }
        self.arrivals[decode].arrived(now);
        if let Some(old) = self.live.insert(request.to_string(), handoff) {
            account(&mut self.loads, &old, false);
        }
    }

    /// The tokens a routed request's times are measured against, and what was queued ahead of
    /// its prompt.
    pub fn measure(&mut self, request: &str, computed_tokens: u64, pulled_tokens: u64, queued_ms: f64) {
        if let Some(h) = self.live.get_mut(request) {
            (h.computed_tokens, h.pulled_tokens, h.queued_ms) = (computed_tokens, pulled_tokens, queued_ms);
        }
    }

    /// When a routed request's prompt is predicted to be computed and its decode to start.
    pub fn forecast(&mut self, request: &str, computed_at: Instant, decoding_at: Instant) {
        if let Some(h) = self.live.get_mut(request) {
            account(&mut self.loads, h, false);
            (h.computed_at, h.decoding_at) = (computed_at, decoding_at);
            account(&mut self.loads, h, true);
        }
    }

    /// The prefill holds the KV; returns how long its leg took.
    pub fn prefill_done(&mut self, request: &str, now: Instant) -> Option<Sample> {
        let h = self.live.get_mut(request)?;
        if h.stage != Stage::Prefilling {
            return None;
        }
        account(&mut self.loads, h, false);
        h.stage = Stage::Held;
        account(&mut self.loads, h, true);
        h.prefill_done_at = Some(now);
        let took = now.saturating_duration_since(h.routed_at);
        Some(Sample::Prefill { tokens: h.computed_tokens, queued_ms: h.queued_ms, took })
    }

    /// The decode's first output; returns how long the handoff took (disaggregated) or the
    /// local prefill, once per request.
    pub fn decode_started(&mut self, request: &str, now: Instant) -> Option<Sample> {
        let h = self.live.get_mut(request)?;
        account(&mut self.loads, h, false);
        h.stage = Stage::Decoding;
        let seen = std::mem::replace(&mut h.decode_seen, true);
        account(&mut self.loads, h, true);
        if seen {
            return None;
        }
        match (h.prefill, h.prefill_done_at) {
            (Some(_), Some(done)) => {
                Some(Sample::Handoff { tokens: h.pulled_tokens, took: now.saturating_duration_since(done) })
            }
            (None, _) => {
                let took = now.saturating_duration_since(h.routed_at);
                Some(Sample::Local { tokens: h.computed_tokens, queued_ms: h.queued_ms, took })
            }
            (Some(_), None) => None,
        }
    }

    /// The request ended (any outcome); its load is gone.
    pub fn finished(&mut self, request: &str) -> Option<Handoff> {
        let handoff = self.live.remove(request)?;
        account(&mut self.loads, &handoff, false);
        Some(handoff)
    }

    /// The request failed (its decode died or answered an error): it ends like
    /// [`Handoffs::finished`], and blocks its prefill still holds are released, since the decode
    /// may never have pulled them. Releasing blocks it did pull frees nothing at the prefill.
    pub fn failed(&mut self, request: &str) -> Vec<Action> {
        match self.finished(request) {
            Some(Handoff { prefill: Some(prefill), stage: Stage::Held, .. }) => {
                vec![Action::Release { request: request.to_string(), prefill }]
            }
            _ => Vec::new(),
        }
    }

    /// An engine died: handoffs touching it end; blocks held for a dead decode are released;
    /// sidecars of requests whose prefill died are told.
    pub fn engine_died(&mut self, dead: usize) -> Vec<Action> {
        let mut actions = Vec::new();
        let loads = &mut self.loads;
        self.live.retain(|request, h| {
            let decode_died = h.decode == dead;
            let prefill_died = h.prefill == Some(dead);
            if decode_died {
                if let (Some(prefill), Stage::Held) = (h.prefill, h.stage) {
                    actions.push(Action::Release { request: request.clone(), prefill });
                }
            } else if prefill_died && h.stage != Stage::Decoding {
                actions.push(Action::Notify { request: request.clone(), decode: h.decode, dead });
            }
            let keep = !(decode_died || prefill_died && h.stage != Stage::Decoding);
            if !keep {
                account(loads, h, false);
            }
            keep
        });
        actions.sort();
        actions
    }

    /// A dead engine's number is about to be reused: no handoff may name it any more (those
    /// that still do decode elsewhere and keep only their decode), and its load starts at zero.
    pub fn forget_engine(&mut self, engine: usize) {
        let loads = &mut self.loads;
        self.live.retain(|_, h| {
            if h.decode == engine {
                account(loads, h, false);
                return false;
            }
            if h.prefill == Some(engine) {
                account(loads, h, false);
                h.prefill = None;
                account(loads, h, true);
            }
            true
        });
        if let Some(load) = self.loads.blocks.get_mut(engine) {
            *load = Load::default();
        }
        if let Some(bound) = self.loads.bound.get_mut(engine) {
            *bound = 0;
        }
        for lists in [&mut self.loads.computing, &mut self.loads.starting] {
            if let Some(list) = lists.get_mut(engine) {
                list.clear();
            }
        }
        if let Some(arrivals) = self.arrivals.get_mut(engine) {
            *arrivals = Arrivals::default();
        }
    }

    /// Drops handoffs past their deadline (phantom load); held blocks are released.
    pub fn expire(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        let loads = &mut self.loads;
        self.live.retain(|request, h| {
            let keep = h.deadline > now;
            if !keep {
                account(loads, h, false);
                if let (Some(prefill), Stage::Held) = (h.prefill, h.stage) {
                    actions.push(Action::Release { request: request.clone(), prefill });
                }
            }
            keep
        });
        actions.sort();
        actions
    }

    /// The load the coordinator itself put on an engine.
    pub fn load(&self, engine: usize) -> Load {
        self.loads.blocks.get(engine).copied().unwrap_or_default()
    }

    /// Requests routed to decode on `engine` and not finished, in any stage.
    pub fn bound(&self, engine: usize) -> u64 {
        self.loads.bound.get(engine).copied().unwrap_or(0)
    }

    /// When each prompt computed on `engine` now is predicted to be done.
    pub fn computing(&self, engine: usize) -> &[Instant] {
        self.loads.computing.get(engine).map_or(&[], Vec::as_slice)
    }

    /// When each request bound to decode on `engine` that has not started is predicted to.
    pub fn starting(&self, engine: usize) -> &[Instant] {
        self.loads.starting.get(engine).map_or(&[], Vec::as_slice)
    }

    /// Requests per ms routed to decode on `engine` lately.
    pub fn arrivals_per_ms(&self, engine: usize, now: Instant) -> f64 {
        self.arrivals.get(engine).map_or(0.0, |a| a.per_ms(now))
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_follows_the_stages() {
        let now = Instant::now();
        let mut h = Handoffs::new(Duration::from_secs(60));
        h.routed("r1", Some(0), 1, 10, now);
        assert_eq!(h.load(0), Load { active_decode_blocks: 0, queued_prefill_blocks: 10 });
        h.prefill_done("r1", now);
        assert_eq!(h.load(0), Load::default());
        h.decode_started("r1", now);
        assert_eq!(h.load(1), Load { active_decode_blocks: 10, queued_prefill_blocks: 0 });
        assert!(h.finished("r1").is_some());
        assert!(h.is_empty());
    }

    /// A prompt counts as computed on its engine until its prefill is done (disaggregated) or the
    /// decode's first output (local); a request counts as starting until that first output.
    #[test]
    fn forecasts_follow_the_stages() {
        let now = Instant::now();
        let ms = |n| now + Duration::from_millis(n);
        let mut h = Handoffs::new(Duration::from_secs(60));
        h.routed("pd", Some(0), 1, 10, now);
        h.forecast("pd", ms(80), ms(90));
        h.routed("local", None, 1, 10, now);
        h.forecast("local", ms(50), ms(50));
        h.forecast("unknown", ms(1), ms(1));
        assert_eq!((h.computing(0), h.computing(1)), (&[ms(80)][..], &[ms(50)][..]));
        let mut starting = h.starting(1).to_vec();
        starting.sort();
        assert_eq!((&starting[..], h.starting(0)), (&[ms(50), ms(90)][..], &[][..]));
        h.prefill_done("pd", ms(85));
        assert_eq!((h.computing(0), h.starting(1).len()), (&[][..], 2), "pulled, not started");
        h.decode_started("pd", ms(95));
        h.decode_started("local", ms(60));
        assert_eq!((h.computing(1), h.starting(1)), (&[][..], &[][..]));
        assert_eq!(h.bound(1), 2, "both decoding");
    }

    #[test]
    fn dead_decode_releases_held_blocks_and_dead_prefill_notifies() {
        let now = Instant::now();
        let mut h = Handoffs::new(Duration::from_secs(60));
        h.routed("held", Some(0), 1, 4, now);
        h.prefill_done("held", now);
        h.routed("prefilling", Some(2), 1, 4, now);
        h.routed("other", Some(2), 3, 4, now);
        let actions = h.engine_died(1);
        assert_eq!(actions, vec![Action::Release { request: "held".into(), prefill: 0 }]);
        assert_eq!(h.len(), 1);
        let actions = h.engine_died(2);
        assert_eq!(actions, vec![Action::Notify { request: "other".into(), decode: 3, dead: 2 }]);
        assert!(h.is_empty());
    }

    #[test]
    fn a_failed_request_releases_only_blocks_still_held() {
        let now = Instant::now();
        let mut h = Handoffs::new(Duration::from_secs(60));
        h.routed("held", Some(0), 1, 4, now);
        h.prefill_done("held", now);
        h.routed("prefilling", Some(0), 1, 4, now);
        h.routed("local", None, 1, 4, now);
        h.routed("decoding", Some(0), 1, 4, now);
        h.prefill_done("decoding", now);
        h.decode_started("decoding", now);
        assert_eq!(h.failed("held"), vec![Action::Release { request: "held".into(), prefill: 0 }]);
        for nothing_held in ["prefilling", "local", "decoding", "unknown", "held"] {
            assert_eq!(h.failed(nothing_held), vec![], "{nothing_held}");
        }
        assert!(h.is_empty());
        assert_eq!((h.load(0), h.load(1)), (Load::default(), Load::default()));
    }

    #[test]
    fn phantom_load_is_purged_after_the_bound() {
        let now = Instant::now();
        let mut h = Handoffs::new(Duration::from_secs(30));
        h.routed("stuck", Some(0), 1, 8, now);
        h.prefill_done("stuck", now);
        h.routed("young", Some(0), 1, 8, now + Duration::from_secs(20));
        let actions = h.expire(now + Duration::from_secs(31));
        assert_eq!(actions, vec![Action::Release { request: "stuck".into(), prefill: 0 }]);
        assert_eq!(h.len(), 1);
    }

    #[test]
    fn arrival_rate_follows_the_gaps_and_decays_when_quiet() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut a = Arrivals::default();
        assert_eq!(a.per_ms(t0), 0.0, "nothing seen");
        a.arrived(t0);
        assert_eq!(a.per_ms(t0), 0.0, "one arrival is no rate");
        for i in 1..=50 {
            a.arrived(ms(10 * i));
        }
        assert!((a.per_ms(ms(500)) - 0.1).abs() < 1e-6, "one per 10 ms: {}", a.per_ms(ms(500)));
        assert!((a.per_ms(ms(600)) - 0.01).abs() < 1e-6, "100 ms quiet: {}", a.per_ms(ms(600)));
        // A clock that went backwards, or a burst in one instant, stays finite.
        a.arrived(t0);
        a.arrived(t0);
        assert!(a.per_ms(t0).is_finite() && a.per_ms(t0) > 0.0);
        let mut burst = Arrivals::default();
        burst.arrived(t0);
        burst.arrived(t0);
        assert_eq!(burst.per_ms(t0), 1.0);
        // Handoffs keep one per decode engine.
        let mut h = Handoffs::new(Duration::from_secs(60));
        h.routed("a", Some(0), 1, 4, t0);
        h.routed("b", None, 1, 4, ms(20));
        assert!((h.arrivals_per_ms(1, ms(20)) - 0.05).abs() < 1e-9);
        assert_eq!(h.arrivals_per_ms(0, ms(20)), 0.0, "a prefill engine is not arrived at");
        assert_eq!((h.bound(0), h.bound(1)), (0, 2), "one prefilling elsewhere is bound to its decode");
    }

    /// The running totals always equal a sum over the live handoffs.
    #[test]
    fn loads_match_a_recount() {
        let now = Instant::now();
        let mut h = Handoffs::new(Duration::from_secs(30));
        let mut x = 7u64;
        for step in 0..5000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let request = format!("r{}", x % 40);
            let at = now + Duration::from_millis(step * 20);
            match x % 9 {
                0..=2 => h.routed(
                    &request,
                    matches!(x % 3, 1 | 2).then_some((x >> 8) as usize % 5),
                    (x >> 16) as usize % 5,
                    x % 17,
                    at,
                ),
                3 => {
                    let _ = h.prefill_done(&request, at);
                }
                4 => {
                    let _ = h.decode_started(&request, at);
                }
                5 => drop(h.finished(&request)),
                6 if x.is_multiple_of(4) => {
                    let engine = (x >> 8) as usize % 5;
                    h.engine_died(engine);
                    h.forget_engine(engine);
                }
                6 => drop(h.engine_died((x >> 8) as usize % 5)),
                7 => h.forecast(&request, at + Duration::from_millis(x % 300), at + Duration::from_millis(x % 500)),
                _ => drop(h.expire(at)),
            }
            for engine in 0..5 {
                let mut want = Load::default();
                for handoff in h.live.values() {
                    if handoff.prefill == Some(engine) && handoff.stage == Stage::Prefilling {
                        want.queued_prefill_blocks += handoff.blocks;
                    }
                    if handoff.decode == engine && handoff.stage == Stage::Decoding {
                        want.active_decode_blocks += handoff.blocks;
                    }
                }
                assert_eq!(h.load(engine), want, "step {step}, engine {engine}");
                let bound = h.live.values().filter(|x| x.decode == engine).count();
                assert_eq!(h.bound(engine), bound as u64, "step {step}, engine {engine}");
                let sorted = |list: &[Instant]| {
                    let mut list = list.to_vec();
                    list.sort();
                    list
                };
                let mut computing = Vec::new();
                let mut starting = Vec::new();
                for handoff in h.live.values() {
                    let computed_on = match (handoff.stage, handoff.prefill) {
                        (Stage::Prefilling, Some(prefill)) => Some(prefill),
                        (_, None) if !handoff.decode_seen => Some(handoff.decode),
                        _ => None,
                    };
                    if computed_on == Some(engine) {
                        computing.push(handoff.computed_at);
                    }
                    if handoff.decode == engine && !handoff.decode_seen {
                        starting.push(handoff.decoding_at);
                    }
                }
                assert_eq!(sorted(h.computing(engine)), sorted(&computing), "step {step}, engine {engine}");
                assert_eq!(sorted(h.starting(engine)), sorted(&starting), "step {step}, engine {engine}");
            }
        }
    }
}
