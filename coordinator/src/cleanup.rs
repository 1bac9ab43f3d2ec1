//! What deaths leave behind, without I/O: the deaths each sidecar has yet to hear of, the
//! `kv_transfer_params` a prefill reported (needed to release its blocks), and releases whose
//! call failed, owed to the prefill's next heartbeat. [`crate::cluster::Cluster`] owns it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use pd_api::ReleaseNotice;
use serde_json::value::RawValue;

/// Deaths and owed releases older than this are forgotten.
pub const NOTICE_MAX_AGE: Duration = Duration::from_secs(600);
/// Params outlive their handoff's deadline by this much, so its expiry still releases with them.
const PARAMS_GRACE: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct Death {
    seq: u64,
    id: String,
    at: Instant,
}

#[derive(Debug, Default)]
pub struct Cleanup {
    deaths: VecDeque<Death>,
    death_seq: u64,
    /// Deaths up to this sequence were told to the engine's sidecar, by engine number.
    told: Vec<u64>,
    /// By request: the params its prefill reported, and when.
    params: HashMap<String, (Held, Instant)>,
    /// By prefill id: releases for its next heartbeat answer, and since when.
    owed: HashMap<String, Vec<(ReleaseNotice, Instant)>>,
}

/// What a request's prefill reports left.
#[derive(Debug)]
enum Held {
    Params(Box<RawValue>),
    /// Two attempts under one request id reported different params (a sidecar served a failed
    /// redirect itself): a release could free the blocks the live attempt's decode is reading,
    /// so none is sent and the engines' leases free both.
    Contested,
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

impl Cleanup {
    /// A new or restarted engine's sidecar needs no word of earlier deaths.
    pub fn fresh(&mut self, engine: usize) {
        if self.told.len() <= engine {
            self.told.resize(engine + 1, 0);
        }
        self.told[engine] = self.death_seq;
    }

    pub fn died(&mut self, id: &str, now: Instant) {
        self.death_seq += 1;
        self.deaths.push_back(Death { seq: self.death_seq, id: id.to_string(), at: now });
    }

    /// The deaths `engine` (named `id`) has not heard of, each once; they count as told.
    pub fn untold_deaths(&mut self, engine: usize, id: &str) -> Vec<String> {
        let seen = self.told.get(engine).copied().unwrap_or(0);
        let mut once = HashSet::new();
        let dead = self
            .deaths
            .iter()
            .filter(|d| d.seq > seen && d.id != id && once.insert(d.id.as_str()))
            .map(|d| d.id.clone())
            .collect();
        self.fresh(engine);
        dead
    }

    pub fn hold(&mut self, request: String, params: Box<RawValue>, now: Instant) {
        let held = match self.params.get(&request) {
            Some((Held::Params(earlier), _)) if earlier.get() != params.get() => Held::Contested,
            Some((Held::Contested, _)) => Held::Contested,
            _ => Held::Params(params),
        };
        self.params.insert(request, (held, now));
    }

    /// Whether a prefill reported params for `request` (contested or not).
    pub fn has_params(&self, request: &str) -> bool {
        self.params.contains_key(request)
    }

    /// Whether `params` are the ones held for `request` (one attempt's, not contested).
    pub fn holds(&self, request: &str, params: &RawValue) -> bool {
        matches!(self.params.get(request), Some((Held::Params(held), _)) if held.get() == params.get())
    }

    pub fn drop_params(&mut self, request: &str) {
        self.params.remove(request);
    }

    /// The notice that frees what `prefill` holds for `request`, with the params it reported
    /// (`null` when it reported none); `None` when attempts contested the request.
    pub fn release(&mut self, request: String, prefill: &str) -> Option<ReleaseNotice> {
        let params = match self.params.remove(&request) {
            Some((Held::Contested, _)) => return None,
            Some((Held::Params(params), _)) => params,
            None => null(),
        };
        Some(ReleaseNotice { request_id: request, prefill: prefill.to_string(), kv_transfer_params: params })
    }

    /// A release that could not be delivered now waits for the prefill's heartbeat.
    pub fn owe(&mut self, notice: ReleaseNotice, now: Instant) {
        self.owed.entry(notice.prefill.clone()).or_default().push((notice, now));
    }

    pub fn take_owed(&mut self, prefill: &str) -> Vec<ReleaseNotice> {
        self.owed.remove(prefill).unwrap_or_default().into_iter().map(|(n, _)| n).collect()
    }

    pub fn owed_len(&self) -> usize {
        self.owed.values().map(Vec::len).sum()
    }

    /// A forgotten engine is owed nothing (its id may come back as a new engine).
    pub fn forget(&mut self, id: &str) {
        self.owed.remove(id);
    }

    /// Drops what is too old to matter; `handoff_max_age` bounds the params.
    pub fn age(&mut self, handoff_max_age: Duration, now: Instant) {
        let params_age = handoff_max_age + PARAMS_GRACE;
        self.params.retain(|_, (_, at)| now.duration_since(*at) < params_age);
        self.owed.retain(|_, list| {
            list.retain(|(_, at)| now.duration_since(*at) < NOTICE_MAX_AGE);
            !list.is_empty()
        });
        while self.deaths.front().is_some_and(|d| now.duration_since(d.at) >= NOTICE_MAX_AGE) {
            self.deaths.pop_front();
        }
    }
}

/// The cluster's side of deaths, as tables: what each death returns, what heartbeats are told.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Action, Cluster, PairRequest, Settings};
    use crate::membership::{EngineSpec, Role};

    const P: usize = 0;
    const D: usize = 1;
    const OTHER: usize = 2;
    /// Long enough that no lease runs out unless a test lets it.
    const LEASE: Duration = Duration::from_secs(3600);

    fn spec(id: &str, role: Role) -> EngineSpec {
        EngineSpec {
            id: id.into(),
            role,
            node: "n".into(),
            model: "m".into(),
            engine_url: String::new(),
            sidecar_url: Some(format!("http://{id}-sidecar")),
            kv_events: None,
            kv_events_topic: None,
            replay: None,
            xfer_side_channel: None,
            block_size: 16,
            capacity_blocks: None,
            data_parallel_size: None,
        }
    }

    /// A prefill `p`, a decode `d` and a bystander decode `other` (registered last, so pairing
    /// at `uniform` 0 picks `d`).
    fn cluster(now: Instant) -> Cluster {
        let mut c = Cluster::new(Settings { lease: LEASE, ..Settings::default() });
        c.register(spec("p", Role::Prefill), now);
        c.register(spec("d", Role::Decode), now);
        c.register(spec("other", Role::Decode), now);
        c
    }

    fn route(c: &mut Cluster, request: &str, now: Instant) {
        let hashes: Vec<u64> = (1..=200).collect();
        let req = PairRequest {
            request_id: request,
            model: "m",
            block_hashes: &hashes,
            prompt_tokens: 3200,
            block_size: 16,
            lora_name: None,
        };
        let d = c.pair(req, now, [0.0; 2]).expect("a decode");
        assert_eq!((d.prefill, d.decode), (Some(P), D));
    }

    fn params(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.into()).unwrap()
    }

    fn summary(actions: &[Action]) -> Vec<String> {
        actions
            .iter()
            .map(|a| match a {
                Action::Died { engine } => format!("died {engine}"),
                Action::Release { notice, sidecar_url } => format!(
                    "release {} on {} with {} via {}",
                    notice.request_id,
                    notice.prefill,
                    notice.kv_transfer_params.get(),
                    sidecar_url.as_deref().unwrap_or("-")
                ),
                Action::PrefillDied { request, dead } => format!("{request}: prefill {dead} died"),
            })
            .collect()
    }

    #[derive(Clone, Copy)]
    enum Step {
        PrefillDone(Option<&'static str>),
        DecodeStarted,
        Finished,
    }

    #[test]
    fn deaths_return_releases_and_notices() {
        use Step::*;
        let held = "release r on p with {\"k\":1} via http://p-sidecar";
        let cases: [(&str, &[Step], usize, &[&str]); 8] = [
            ("held, decode dies", &[PrefillDone(Some(r#"{"k":1}"#))], D, &[held]),
            ("held without params", &[PrefillDone(None)], D, &["release r on p with null via http://p-sidecar"]),
            ("prefilling, decode dies", &[], D, &[]),
            ("decoding, decode dies", &[PrefillDone(Some("{}")), DecodeStarted], D, &[]),
            ("prefilling, prefill dies", &[], P, &["r: prefill p died"]),
            ("held, prefill dies", &[PrefillDone(Some("{}"))], P, &["r: prefill p died"]),
            ("decoding, prefill dies", &[PrefillDone(Some("{}")), DecodeStarted], P, &[]),
            ("finished, decode dies", &[PrefillDone(Some("{}")), Finished], D, &[]),
        ];
        for (name, steps, dies, want) in cases {
            let now = Instant::now();
            let mut c = cluster(now);
            route(&mut c, "r", now);
            for step in steps {
                match *step {
                    PrefillDone(p) => c.prefill_done("r", p.map(params), now),
                    DecodeStarted => c.decode_started("r", now),
                    Finished => c.finished("r"),
                }
            }
            assert_eq!(summary(&c.engine_died(dies, now)), want, "{name}");
        }
    }

    #[test]
    fn held_params_go_with_a_release_or_age_out() {
        let now = Instant::now();
        let max_age = Settings::default().handoff_max_age;
        // A handoff that never finishes: its held blocks are released when it expires.
        let mut c = cluster(now);
        route(&mut c, "stuck", now);
        c.prefill_done("stuck", Some(params("[1]")), now);
        assert!(summary(&c.tick(now + Duration::from_secs(1))).is_empty());
        let actions = c.tick(now + max_age + Duration::from_secs(1));
        assert_eq!(summary(&actions), ["release stuck on p with [1] via http://p-sidecar"]);
        // Params reported for a request the cluster does not track age out on their own.
        let mut c = cluster(now);
        c.prefill_done("unrouted", Some(params("[2]")), now);
        c.tick(now + max_age + PARAMS_GRACE);
        route(&mut c, "unrouted", now + max_age + PARAMS_GRACE);
        c.prefill_done("unrouted", None, now);
        let actions = c.engine_died(D, now + max_age + PARAMS_GRACE);
        assert_eq!(summary(&actions), ["release unrouted on p with null via http://p-sidecar"]);
    }

    #[test]
    fn lease_expiry_is_a_death_the_daemon_hears_of() {
        let now = Instant::now();
        let mut c = cluster(now);
        route(&mut c, "r", now);
        c.prefill_done("r", Some(params("{}")), now);
        for id in ["p", "other"] {
            c.membership.heartbeat(id, now + LEASE / 2).unwrap();
        }
        let actions = c.expire(now + LEASE + Duration::from_millis(1));
        assert_eq!(summary(&actions), ["died 1", "release r on p with {} via http://p-sidecar"]);
        assert!(c.expire(now + LEASE + Duration::from_millis(2)).is_empty(), "once");
    }

    #[test]
    fn heartbeats_are_told_each_death_once_and_owed_releases() {
        let now = Instant::now();
        let mut c = cluster(now);
        let dead = |c: &mut Cluster, engine| c.notices(engine).dead_engines;
        c.engine_died(D, now);
        c.engine_died(D, now); // a second report of the same engine
        assert_eq!(dead(&mut c, P), ["d"]);
        assert!(dead(&mut c, P).is_empty(), "told once");
        // Back and dead again: news again; its own death is never news to it.
        c.register(spec("d", Role::Decode), now);
        assert!(dead(&mut c, D).is_empty(), "a fresh engine hears nothing older");
        c.engine_died(D, now);
        assert_eq!(dead(&mut c, P), ["d"]);
        assert_eq!(dead(&mut c, OTHER), ["d"], "each engine on its own count");
        assert!(dead(&mut c, D).is_empty(), "not its own");

        // A release that could not be posted rides the prefill's next heartbeat, once.
        let notice = |request: &str| ReleaseNotice {
            request_id: request.into(),
            prefill: "p".into(),
            kv_transfer_params: params("{}"),
        };
        c.release_failed(notice("r1"), now);
        c.release_failed(notice("r2"), now);
        assert_eq!(c.owed_releases(), 2);
        assert!(c.notices(OTHER).release.is_empty(), "only the prefill's");
        let owed: Vec<String> = c.notices(P).release.into_iter().map(|n| n.request_id).collect();
        assert_eq!(owed, ["r1", "r2"]);
        assert_eq!(c.owed_releases(), 0);

        // Old news and old debts are dropped.
        c.release_failed(notice("r3"), now);
        c.engine_died(OTHER, now);
        c.tick(now + NOTICE_MAX_AGE);
        let told = c.notices(P);
        assert!(told.dead_engines.is_empty() && told.release.is_empty());

        // A forgotten engine is owed nothing, also when its id comes back.
        let now = Instant::now();
        let mut c = cluster(now);
        c.release_failed(notice("r4"), now);
        c.engine_died(P, now);
        assert!(c.forget(P).is_some());
        c.register(spec("p", Role::Prefill), now);
        assert!(c.notices(P).release.is_empty());
    }
}
