//! The coordinator's whole state without I/O: engines, their KV index per model, the handoffs
//! in flight, the pairing decision that ties them together, and what deaths leave behind
//! (releases, notices). Changes return [`Action`]s: the I/O the daemon carries out.

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use pd_api::{Notices, ReleaseNotice};
use pd_protocols::kv_events::{EventBatch, KvEvent};
use serde_json::value::RawValue;

use crate::cleanup::Cleanup;
use crate::handoff::{self, Handoffs};
use crate::index::{PrefixIndex, Probes};
use crate::membership::{EngineSpec, Membership, Registered, Role};
use crate::pairing::{choose, cost, Candidate, Load, TierWeights, Weights};
use crate::placement::{ms_after, Placement, Site, Timings};
use crate::ranks::{self, UndeclaredRank};
use crate::rekey::Rekeyer;

#[derive(Clone, Debug)]
pub struct Settings {
    pub lease: Duration,
    pub weights: Weights,
    pub tier_weights: TierWeights,
    /// Whether the decode computes a prompt itself (`crate::placement`).
    pub placement: Placement,
    /// A handoff older than this is phantom load.
    pub handoff_max_age: Duration,
    /// How long a routing decision counts as "the decode now holds this prefix" before the
    /// engine's own events confirm it.
    pub speculative_ttl: Duration,
    /// Re-key adapter blocks as SGLang publishes them ([`crate::rekey`]): on with
    /// `--block-hash sglang`.
    pub rekey_sglang_adapters: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lease: Duration::from_secs(3),
            weights: Weights::default(),
            tier_weights: TierWeights::default(),
            placement: Placement::default(),
            handoff_max_age: Duration::from_secs(120),
            speculative_ttl: Duration::from_secs(2),
            rekey_sglang_adapters: false,
        }
    }
}

/// A request to place.
#[derive(Clone, Copy, Debug)]
pub struct PairRequest<'a> {
    pub request_id: &'a str,
    pub model: &'a str,
    /// The prompt's block hashes (integer form), in order.
    pub block_hashes: &'a [u64],
    pub prompt_tokens: u64,
    pub block_size: u32,
    /// The LoRA adapter it runs under (`None`: the base model).
    pub lora_name: Option<&'a str>,
}

impl PairRequest<'_> {
    fn index_key(&self) -> Cow<'_, str> {
        adapter_key(self.model, self.lora_name, None)
    }
}

/// Separates a model's name from an adapter's in the key of an adapter's index.
const LORA_NAME_MARK: &str = "#lora=";
/// The same for an adapter an event names by number only (SGLang's `lora_id`).
const LORA_ID_MARK: &str = "#lora_id=";

/// The key of the index holding `model`'s blocks under an adapter: the model's own name for the
/// base model, else the model and the adapter, so that one adapter's blocks never answer
/// another's (or the base model's) lookups, whatever their hashes.
pub fn adapter_key<'a>(model: &'a str, lora_name: Option<&str>, lora_id: Option<i64>) -> Cow<'a, str> {
    match (lora_name, lora_id) {
        (Some(name), _) => Cow::Owned(format!("{model}{LORA_NAME_MARK}{name}")),
        (None, Some(id)) => Cow::Owned(format!("{model}{LORA_ID_MARK}{id}")),
        (None, None) => Cow::Borrowed(model),
    }
}

/// The model an index key belongs to.
pub fn key_model(key: &str) -> &str {
    match key.find(LORA_NAME_MARK).or_else(|| key.find(LORA_ID_MARK)) {
        Some(at) => &key[..at],
        None => key,
    }
}

/// The caller's own engine (a sidecar's), taken as decode unless its cost exceeds
/// `max_cost_ratio` × the best decode's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preference {
    pub engine: usize,
    pub max_cost_ratio: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    pub decode: usize,
    /// `None`: the decode engine computes the prompt itself.
    pub prefill: Option<usize>,
    pub decode_overlap_blocks: u64,
    pub prefill_overlap_blocks: u64,
    /// The decode engine's data-parallel rank holding the prefix ([`crate::ranks`]).
    pub decode_rank: Option<u32>,
    pub prefill_rank: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PairError {
    #[error("no live decode engine serves model {0:?}")]
    NoDecode(String),
}

/// What the daemon must do after a change.
#[derive(Debug)]
pub enum Action {
    /// `engine` left pairing on the cluster's own account (its lease ran out): stop what the
    /// daemon runs for it (event ingestion) and count the death.
    Died { engine: usize },
    /// Free the blocks a prefill holds: POST `notice` to `{sidecar_url}/pd/release`. When that
    /// fails, or there is no sidecar, hand it back through [`Cluster::release_failed`].
    Release { notice: ReleaseNotice, sidecar_url: Option<String> },
    /// The prefill `dead` died under `request`; the decode's sidecar learns of it from its
    /// heartbeat notices, so there is nothing to send.
    PrefillDied { request: String, dead: String },
}

#[derive(Debug)]
pub struct Cluster {
    settings: Settings,
    pub membership: Membership,
    indexes: HashMap<String, PrefixIndex>,
    pub handoffs: Handoffs,
    /// Load reported by the engines themselves (heartbeats), by engine number.
    reported: Vec<Option<Load>>,
    /// Buffers every decision reuses (pairing allocates nothing in the steady state but the
    /// placement's few sites, which borrow the handoffs' lists).
    scratch: Scratch,
    cleanup: Cleanup,
    rekeyer: Rekeyer,
    /// Prefill, handoff and local-prefill times seen so far.
    timings: Timings,
}

#[derive(Debug, Default)]
struct Scratch {
    /// (holder, blocks) of the lookup.
    overlaps: Vec<(usize, usize)>,
    /// Each engine's best rank's overlap, by engine number, zero elsewhere (the next decision
    /// clears what it set).
    overlap_of: Vec<Overlap>,
    decodes: Vec<Candidate>,
    prefills: Vec<Candidate>,
    /// The slots the lookup found, so that the speculative insert after it does not probe
    /// for them again (most of a decision's time is those probes' cache misses).
    probes: Probes,
}

/// What one engine (its best rank) holds of a request's prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Overlap {
    blocks: u64,
    /// The blocks each counted at its tier's weight.
    weight: f64,
    rank: u32,
}

impl Overlap {
    /// The better of two ranks' overlaps: more weight, then more blocks, then the lower rank.
    fn beats(&self, other: &Overlap) -> bool {
        self.weight
            .total_cmp(&other.weight)
            .then(self.blocks.cmp(&other.blocks))
            .then(other.rank.cmp(&self.rank))
            .is_gt()
    }
}

impl Cluster {
    pub fn new(settings: Settings) -> Self {
        Cluster {
            membership: Membership::new(settings.lease),
            handoffs: Handoffs::new(settings.handoff_max_age),
            indexes: HashMap::new(),
            reported: Vec::new(),
            scratch: Scratch::default(),
            cleanup: Cleanup::default(),
            rekeyer: Rekeyer::default(),
            timings: Timings::default(),
            settings,
        }
    }

    /// Registers (or renews) an engine; a changed or revived engine starts with an empty index,
    /// since what it cached before is gone.
    pub fn register(&mut self, spec: EngineSpec, now: Instant) -> Registered {
        let model = spec.model.clone();
        let registered = self.membership.register(spec, now);
        match registered {
            Registered::New(engine) => self.cleanup.fresh(engine),
            Registered::Renewed { engine, changed: true, .. } | Registered::Renewed { engine, was_dead: true, .. } => {
                self.reset_index(engine);
                self.cleanup.fresh(engine);
            }
            Registered::Renewed { .. } => {}
        }
        self.indexes.entry(model).or_default();
        registered
    }

    /// Indexes a batch of `engine`'s events that came on rank `stream_rank`'s stream (0 for an
    /// engine without data parallel, and in collector mode); see [`ranks::batch_rank`].
    pub fn apply_events(&mut self, engine: usize, stream_rank: u32, batch: &EventBatch) -> Result<(), UndeclaredRank> {
        let Some(spec) = self.membership.get(engine).map(|e| &e.spec) else { return Ok(()) };
        let holder = ranks::holder(engine, ranks::batch_rank(spec.ranks(), stream_rank, batch.dp_rank)?);
        let model = spec.model.clone();
        let rekey = self.settings.rekey_sglang_adapters;
        let mut at = 0;
        while let Some(event) = batch.events.get(at) {
            at += 1;
            match event {
                // An adapter's blocks go to its own index; removals and clears name no adapter,
                // so they reach every index of the model (hashes differ between adapters).
                KvEvent::BlockStored { lora_name: Some(name), .. } if rekey => {
                    let key = adapter_key(&model, Some(name), None);
                    match self.rekeyer.store(holder, &key, event) {
                        Ok(rekeyed) => match self.indexes.get_mut(key.as_ref()) {
                            Some(index) => index.apply(holder, &rekeyed),
                            None => self.indexes.entry(key.into_owned()).or_default().apply(holder, &rekeyed),
                        },
                        Err(e) => tracing::debug!(engine, %e, "SGLang adapter blocks left out of the index"),
                    }
                }
                KvEvent::BlockStored { lora_name, lora_id, .. } => {
                    let key = adapter_key(&model, lora_name.as_deref(), *lora_id);
                    match self.indexes.get_mut(key.as_ref()) {
                        Some(index) => index.apply(holder, event),
                        None => self.indexes.entry(key.into_owned()).or_default().apply(holder, event),
                    }
                }
                KvEvent::BlockRemoved { block_hashes, medium } if rekey => {
                    let removal = self.rekeyer.remove(holder, block_hashes);
                    for (key, block_hashes) in removal.rekeyed {
                        if let Some(index) = self.indexes.get_mut(&*key) {
                            index.apply(holder, &KvEvent::BlockRemoved { block_hashes, medium: medium.clone() });
                        }
                    }
                    if !removal.published.is_empty() {
                        let rest = KvEvent::BlockRemoved { block_hashes: removal.published, medium: medium.clone() };
                        self.apply_to_model(&model, holder, std::slice::from_ref(&rest));
                    }
                }
                // A run of removals (engines evict one block per event) in one batch, so that
                // the index loads their slots together.
                KvEvent::BlockRemoved { .. } => {
                    let start = at - 1;
                    while matches!(batch.events.get(at), Some(KvEvent::BlockRemoved { .. })) {
                        at += 1;
                    }
                    self.apply_to_model(&model, holder, &batch.events[start..at]);
                }
                _ => {
                    if matches!(event, KvEvent::AllBlocksCleared) {
                        self.rekeyer.clear(holder);
                    }
                    self.apply_to_model(&model, holder, std::slice::from_ref(event));
                }
            }
        }
        Ok(())
    }

    fn apply_to_model(&mut self, model: &str, holder: usize, events: &[KvEvent]) {
        for (_, index) in self.indexes.iter_mut().filter(|(key, _)| key_model(key) == model) {
            index.apply_batch(holder, events);
        }
    }

    /// Forgets an engine's index entries, every rank's.
    pub fn reset_index(&mut self, engine: usize) {
        self.rekeyer.clear_engine(engine);
        for index in self.indexes.values_mut() {
            for holder in ranks::holders_of(index, engine) {
                index.remove_engine(holder);
            }
        }
    }

    /// Forgets one rank's index entries (a sequence gap on its stream that replay could not
    /// fill); the engine's other ranks keep theirs.
    pub fn reset_rank(&mut self, engine: usize, rank: u32) {
        self.rekeyer.clear(ranks::holder(engine, rank));
        for index in self.indexes.values_mut() {
            index.remove_engine(ranks::holder(engine, rank));
        }
    }

    pub fn report_load(&mut self, engine: usize, load: Load) {
        if self.reported.len() <= engine {
            self.reported.resize(engine + 1, None);
        }
        self.reported[engine] = Some(load);
    }

    fn load(&self, engine: usize) -> Load {
        let own = self.handoffs.load(engine);
        let reported = self.reported.get(engine).copied().flatten().unwrap_or_default();
        // The engine's own figures lag; the coordinator's in-flight accounting is immediate.
        Load {
            active_decode_blocks: own.active_decode_blocks.max(reported.active_decode_blocks),
            queued_prefill_blocks: own.queued_prefill_blocks.max(reported.queued_prefill_blocks),
        }
    }

    /// Picks the decode engine, and the prefill engine unless the uncached part is short.
    /// `uniform` are two random numbers in `[0, 1)` for the softmax sampling.
    pub fn pair(&mut self, req: PairRequest<'_>, now: Instant, uniform: [f64; 2]) -> Result<Decision, PairError> {
        self.pair_preferring(req, None, now, uniform)
    }

    /// [`Cluster::pair`], keeping `prefer` as decode unless it is dead or much worse.
    pub fn pair_preferring(
        &mut self,
        req: PairRequest<'_>,
        prefer: Option<Preference>,
        now: Instant,
        uniform: [f64; 2],
    ) -> Result<Decision, PairError> {
        let mut scratch = std::mem::take(&mut self.scratch);
        let decision = self.decide(req, prefer, now, uniform, &mut scratch);
        self.scratch = scratch;
        decision
    }

    fn decide(
        &mut self,
        req: PairRequest<'_>,
        prefer: Option<Preference>,
        now: Instant,
        uniform: [f64; 2],
        scratch: &mut Scratch,
    ) -> Result<Decision, PairError> {
        let Scratch { overlaps, overlap_of, decodes, prefills, probes } = scratch;
        for &(holder, _) in overlaps.iter() {
            if let Some(overlap) = overlap_of.get_mut(ranks::engine_of(holder)) {
                *overlap = Overlap::default(); // the previous decision's
            }
        }
        let key = req.index_key();
        let index = self.indexes.get(key.as_ref());
        match index {
            Some(index) => index.prefix_matches_probed(req.block_hashes, now, overlaps, probes),
            None => overlaps.clear(),
        }
        for &(holder, blocks) in overlaps.iter() {
            let engine = ranks::engine_of(holder);
            if overlap_of.len() <= engine {
                overlap_of.resize(engine + 1, Overlap::default());
            }
            let held = &req.block_hashes[..blocks.min(req.block_hashes.len())];
            let weight = index.map_or(blocks as f64, |i| i.tier_weighted(holder, held, &self.settings.tier_weights));
            let overlap = Overlap { blocks: blocks as u64, weight, rank: ranks::rank_of(holder) };
            if overlap.beats(&overlap_of[engine]) {
                overlap_of[engine] = overlap;
            }
        }
        let new_blocks = req.block_hashes.len() as u64;
        let overlap_of = &*overlap_of;
        let candidate = |engine: usize| {
            let Overlap { blocks, weight, .. } = overlap_of.get(engine).copied().unwrap_or_default();
            Candidate { engine, overlap_blocks: blocks, overlap_weight: weight, load: self.load(engine) }
        };
        // The rank to name: the one holding the engine's overlap, on an engine with ranks; none
        // when no rank holds any of the prompt (the engine balances its ranks itself).
        let rank_of = |c: &Candidate| {
            let has_ranks = self.membership.get(c.engine).is_some_and(|e| e.spec.has_ranks());
            let overlap = overlap_of.get(c.engine).filter(|o| o.blocks > 0);
            overlap.filter(|_| has_ranks).map(|o| o.rank)
        };
        decodes.clear();
        decodes.extend(self.membership.live_iter(req.model, Role::decodes).map(candidate));
        let weights = &self.settings.weights;
        let mut chosen =
            choose(decodes, new_blocks, weights, uniform[0]).ok_or_else(|| PairError::NoDecode(req.model.into()))?;
        if let Some(p) = prefer {
            if let Some(mine) = decodes.iter().position(|c| c.engine == p.engine) {
                let best = cost(&decodes[chosen], new_blocks, weights);
                if cost(&decodes[mine], new_blocks, weights) <= best * p.max_cost_ratio {
                    chosen = mine;
                }
            }
        }
        let decode = decodes[chosen];
        let block_size = u64::from(req.block_size);
        let site = |c: &Candidate| Site {
            uncached_tokens: req.prompt_tokens.saturating_sub(c.overlap_blocks.saturating_mul(block_size)),
            bound: self.handoffs.bound(c.engine),
            starting: self.handoffs.starting(c.engine),
            computing: self.handoffs.computing(c.engine),
            arrivals_per_ms: self.handoffs.arrivals_per_ms(c.engine, now),
            decodes: decodes.iter().any(|d| d.engine == c.engine),
        };
        prefills.clear();
        prefills.extend(
            self.membership.live_iter(req.model, Role::prefills).filter(|&e| e != decode.engine).map(candidate),
        );
        // Best first by affinity and load, the fixed policy's pick.
        if let Some(best) = choose(prefills, new_blocks, weights, uniform[1]) {
            prefills.swap(0, best);
        }
        let sites: Vec<Site<'_>> = prefills.iter().map(site).collect();
        let decode_site = site(&decode);
        let verdict = self.settings.placement.decide(&self.timings, req.prompt_tokens, decode_site, &sites, now);
        // What placement weighed, for reading its decisions back from a run's log.
        tracing::debug!(
            request = req.request_id,
            decode = decode.engine,
            ?decode_site,
            elsewhere = ?sites,
            local_ms = self.timings.local_cost_ms(decode_site, now),
            first_elsewhere_ms = ?sites.first().map(|&p| self.timings.elsewhere_cost_ms(decode_site, p, now)),
            ?verdict,
            "placement"
        );
        let (decode, prefill) = match verdict.and_then_prefill(prefills) {
            None => (decode, None),
            // An engine that can decode as well keeps what it would compute: the same stall
            // there without the pull, and the prompt's blocks in one cache instead of two.
            Some(p) => match decodes.iter().find(|c| c.engine == p.engine) {
                Some(&there) if matches!(self.settings.placement, Placement::Adaptive { .. }) => (there, None),
                _ => (decode, Some(p)),
            },
        };
        let decision = Decision {
            decode: decode.engine,
            prefill: prefill.map(|p| p.engine),
            decode_overlap_blocks: decode.overlap_blocks,
            prefill_overlap_blocks: prefill.map_or(0, |p| p.overlap_blocks),
            decode_rank: rank_of(&decode),
            prefill_rank: prefill.as_ref().and_then(rank_of),
        };
        let uncached = new_blocks.saturating_sub(decision.prefill_overlap_blocks.max(decision.decode_overlap_blocks));
        let computed_on = site(prefill.as_ref().unwrap_or(&decode));
        let (computed, queued_ms) = (computed_on.uncached_tokens, computed_on.queued_ms(now));
        let pulled = site(&decode).uncached_tokens;
        let (computed_in, decoding_in) = self.timings.forecast_ms(computed, queued_ms, prefill.map(|_| pulled));
        self.handoffs.routed(req.request_id, decision.prefill, decision.decode, uncached, now);
        self.handoffs.measure(req.request_id, computed, pulled, queued_ms);
        self.handoffs.forecast(req.request_id, ms_after(now, computed_in), ms_after(now, decoding_in));
        // Both engines will hold the prefix shortly; say so until their events confirm it. An
        // engine that publishes events confirms what it holds, so its matched prefix needs no
        // guess; one without events keeps its routed prefix fresh (TTL).
        let speculative_until = now + self.settings.speculative_ttl;
        let hashes = req.block_hashes.len();
        // (holder, first block to guess); none for an engine with ranks when no rank was named:
        // the rank it picks itself is unknown here.
        let guess = |engine: usize, rank: Option<u32>, overlap: u64| {
            let spec = &self.membership.get(engine)?.spec;
            if spec.has_ranks() && rank.is_none() {
                return None;
            }
            let first = if spec.publishes_events() { (overlap as usize).min(hashes) } else { 0 };
            Some((ranks::holder(engine, rank.unwrap_or(0)), first))
        };
        let mut guesses = [(0, 0); 2];
        let mut n = 0;
        let decode_guess = guess(decision.decode, decision.decode_rank, decision.decode_overlap_blocks);
        let prefill_guess = prefill.and_then(|p| guess(p.engine, decision.prefill_rank, p.overlap_blocks));
        for g in decode_guess.into_iter().chain(prefill_guess) {
            guesses[n] = g;
            n += 1;
        }
        if guesses[..n].iter().any(|&(_, first)| first < hashes) {
            if !self.indexes.contains_key(key.as_ref()) {
                self.indexes.insert(key.to_string(), PrefixIndex::default());
            }
            let index = self.indexes.get_mut(key.as_ref()).expect("just made sure");
            index.insert_speculative_probed(&guesses[..n], req.block_hashes, speculative_until, probes);
        }
        Ok(decision)
    }

    /// The index of one model (created empty on first use), or of one of its adapters with a
    /// key from [`adapter_key`].
    pub fn model_index_mut(&mut self, key: &str) -> &mut PrefixIndex {
        self.indexes.entry(key.to_string()).or_default()
    }

    /// Every index: models' by model name, adapters' by [`adapter_key`].
    pub fn indexes(&self) -> impl Iterator<Item = (&str, &PrefixIndex)> {
        self.indexes.iter().map(|(model, index)| (model.as_str(), index))
    }

    /// An engine is gone: out of pairing and the index at once; every other sidecar is told in
    /// its next heartbeat answer. Returns what to clean up.
    pub fn engine_died(&mut self, engine: usize, now: Instant) -> Vec<Action> {
        let Some(id) = self.membership.get(engine).map(|e| e.spec.id.clone()) else { return Vec::new() };
        self.membership.mark_dead(engine, now);
        self.reset_index(engine);
        if let Some(load) = self.reported.get_mut(engine) {
            *load = None;
        }
        self.cleanup.died(&id, now);
        let cleanup = self.handoffs.engine_died(engine);
        self.resolve(cleanup)
    }

    /// Turns the handoffs' cleanup into actions: a release carries the params the prefill
    /// reported, and goes to its sidecar.
    fn resolve(&mut self, cleanup: Vec<handoff::Action>) -> Vec<Action> {
        let name = |engine: usize| self.membership.get(engine).map(|e| &e.spec);
        let mut actions = Vec::with_capacity(cleanup.len());
        for step in cleanup {
            match step {
                handoff::Action::Release { request, prefill } => {
                    let Some(spec) = name(prefill) else { continue };
                    let sidecar_url = spec.sidecar_url.clone();
                    let Some(notice) = self.cleanup.release(request, &spec.id) else { continue };
                    actions.push(Action::Release { notice, sidecar_url });
                }
                handoff::Action::Notify { request, dead, .. } => {
                    let dead = name(dead).map_or_else(|| "?".to_string(), |s| s.id.clone());
                    actions.push(Action::PrefillDied { request, dead });
                }
            }
        }
        actions
    }

    /// Removes a dead engine for good (it stayed dead too long): its id is unknown from now on,
    /// and its number (membership, index bitsets, load slots) goes to the next new engine.
    /// Returns it, or `None` when it is alive or unknown.
    pub fn forget(&mut self, engine: usize) -> Option<crate::membership::Engine> {
        let forgotten = self.membership.forget(engine)?;
        for index in self.indexes.values_mut() {
            for holder in ranks::holders_of(index, engine) {
                index.forget_engine(holder);
            }
        }
        if let Some(load) = self.reported.get_mut(engine) {
            *load = None;
        }
        self.handoffs.forget_engine(engine);
        self.cleanup.forget(&forgotten.spec.id);
        Some(forgotten)
    }

    /// Leases that ran out: each engine's [`Action::Died`], then its cleanup.
    pub fn expire(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = Vec::new();
        for engine in self.membership.expire(now) {
            actions.push(Action::Died { engine });
            actions.extend(self.engine_died(engine, now));
        }
        actions
    }

    /// Periodic upkeep: expired leases, phantom handoffs (their held blocks are released),
    /// stale approximate entries, old notices and params.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        let mut actions = self.expire(now);
        let phantoms = self.handoffs.expire(now);
        actions.extend(self.resolve(phantoms));
        for index in self.indexes.values_mut() {
            index.expire(now);
        }
        self.cleanup.age(self.settings.handoff_max_age, now);
        actions
    }

    /// The prefill computed `request`; `params` are what its decode pulls with, kept to
    /// release the blocks should the decode never come.
    pub fn prefill_done(&mut self, request: &str, params: Option<Box<RawValue>>, now: Instant) {
        if let Some(sample) = self.handoffs.prefill_done(request, now) {
            self.timings.observe(sample);
        }
        if let Some(params) = params {
            self.cleanup.hold(request.to_string(), params, now);
        }
    }

    pub fn decode_started(&mut self, request: &str, now: Instant) {
        if let Some(sample) = self.handoffs.decode_started(request, now) {
            self.timings.observe(sample);
        }
    }

    /// What the placement has learned.
    pub fn timings(&self) -> &Timings {
        &self.timings
    }

    /// The request ended (any outcome): nothing is held for it any more.
    pub fn finished(&mut self, request: &str) {
        self.handoffs.finished(request);
        self.cleanup.drop_params(request);
    }

    /// The request failed: nothing is held for it any more once the blocks its prefill still
    /// holds are released (the returned actions). Only a report carrying the params held for the
    /// request releases: a failed attempt under the same id as a live one must not free the live
    /// one's blocks.
    pub fn failed(&mut self, request: &str, params: Option<&RawValue>, now: Instant) -> Vec<Action> {
        // Reports travel independently: a failure with params can overtake its prefill_done.
        if let Some(params) = params.filter(|_| !self.cleanup.has_params(request)) {
            self.prefill_done(request, Some(params.to_owned()), now);
        }
        let same_attempt = params.is_some_and(|params| self.cleanup.holds(request, params));
        let cleanup = self.handoffs.failed(request);
        let actions = if same_attempt { self.resolve(cleanup) } else { Vec::new() };
        self.cleanup.drop_params(request);
        actions
    }

    /// An [`Action::Release`] that could not be delivered: the prefill's next heartbeat carries it.
    pub fn release_failed(&mut self, notice: ReleaseNotice, now: Instant) {
        self.cleanup.owe(notice, now);
    }

    /// What a heartbeat answers `engine`: deaths its sidecar has not heard of (each once, never
    /// its own), and the releases owed to it.
    pub fn notices(&mut self, engine: usize) -> Notices {
        let Some(id) = self.membership.get(engine).map(|e| e.spec.id.clone()) else { return Notices::default() };
        Notices { dead_engines: self.cleanup.untold_deaths(engine, &id), release: self.cleanup.take_owed(&id) }
    }

    /// Releases waiting for a heartbeat.
    pub fn owed_releases(&self) -> usize {
        self.cleanup.owed_len()
    }
}

#[cfg(test)]
mod tests {
    use pd_protocols::kv_events::{BlockHash, KvEvent};

    use super::*;
    use crate::placement::WARM_SAMPLES as WARM;

    fn spec(id: &str, role: Role) -> EngineSpec {
        EngineSpec {
            id: id.into(),
            role,
            node: "n".into(),
            model: "m".into(),
            engine_url: String::new(),
            sidecar_url: None,
            kv_events: None,
            kv_events_topic: None,
            replay: None,
            xfer_side_channel: None,
            block_size: 16,
            capacity_blocks: None,
            data_parallel_size: None,
        }
    }

    fn stored(hashes: &[u64]) -> EventBatch {
        EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored {
                block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
                parent_block_hash: None,
                token_ids: vec![],
                block_size: 16,
                lora_id: None,
                medium: None,
                lora_name: None,
                cache_salt: None,
            }],
            dp_rank: None,
        }
    }

    fn req<'a>(id: &'a str, hashes: &'a [u64]) -> PairRequest<'a> {
        PairRequest {
            request_id: id,
            model: "m",
            block_hashes: hashes,
            prompt_tokens: hashes.len() as u64 * 16,
            block_size: 16,
            lora_name: None,
        }
    }

    /// Blocks stored under an adapter (vLLM names it; SGLang may give only a number).
    fn stored_under(hashes: &[u64], lora_name: Option<&str>, lora_id: Option<i64>) -> EventBatch {
        let mut batch = stored(hashes);
        if let KvEvent::BlockStored { lora_name: name, lora_id: id, .. } = &mut batch.events[0] {
            (*name, *id) = (lora_name.map(str::to_owned), lora_id);
        }
        batch
    }

    #[test]
    fn adapters_are_indexed_apart() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("d0", Role::Decode), now);
        c.register(spec("d1", Role::Decode), now);
        c.register(spec("d2", Role::Decode), now);
        let hashes: Vec<u64> = (1..=20).collect();
        // The same ids (as if hashes collided) under adapter A on d0, the base on d1, an
        // unnamed adapter on d2.
        c.apply_events(0, 0, &stored_under(&hashes, Some("a"), None)).unwrap();
        c.apply_events(1, 0, &stored(&hashes)).unwrap();
        c.apply_events(2, 0, &stored_under(&hashes, None, Some(7))).unwrap();
        let under = |name| PairRequest { lora_name: name, ..req("r", &hashes) };
        let d = c.pair(PairRequest { request_id: "ra", ..under(Some("a")) }, now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_overlap_blocks), (0, 20));
        let d = c.pair(PairRequest { request_id: "rb", ..under(Some("b")) }, now, [0.0; 2]).unwrap();
        assert_eq!(d.decode_overlap_blocks, 0, "adapter B matches nobody's blocks: {d:?}");
        let d = c.pair(PairRequest { request_id: "rbase", ..under(None) }, now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_overlap_blocks), (1, 20));
        assert_eq!(key_model(&adapter_key("m:v1", Some("a"), None)), "m:v1");
        assert_eq!(key_model(&adapter_key("m", None, Some(7))), "m");
        // Removals name no adapter: they reach the adapter's index too.
        let removed = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(1)], medium: None }],
            dp_rank: None,
        };
        c.apply_events(0, 0, &removed).unwrap();
        let d = c.pair(PairRequest { request_id: "ra2", ..under(Some("a")) }, now, [0.0; 2]).unwrap();
        assert_eq!(d.decode_overlap_blocks, 0, "{d:?}");
    }

    /// Batches SGLang's own event recorder encoded (`ci/sglang/capture-lora-events.py`): the
    /// prompt 100..=111 under adapter `sql-lora` in two batches (8 pages, then 4 linked to
    /// them), the 4 removed, then the base model's and a cache-salted copy of the prompt.
    const SGLANG_LORA_EVENTS: &[u8] = include_bytes!("../tests/data/sglang-lora-events.msgpack");

    fn sglang_batches() -> Vec<EventBatch> {
        let mut rest = SGLANG_LORA_EVENTS;
        let mut out = Vec::new();
        while let Some((len, tail)) = rest.split_first_chunk::<4>() {
            let (payload, tail) = tail.split_at(u32::from_be_bytes(*len) as usize);
            out.push(pd_protocols::kv_events::decode_batch(payload).expect("SGLang's batch decodes"));
            rest = tail;
        }
        out
    }

    #[test]
    fn sglang_adapter_blocks_are_rekeyed_to_the_prompts_chain() {
        let now = Instant::now();
        let settings = Settings { rekey_sglang_adapters: true, ..Settings::default() };
        let mut c = Cluster::new(settings);
        c.register(EngineSpec { block_size: 1, ..spec("d0", Role::Decode) }, now);
        let prompt: Vec<u32> = (100..112).collect();
        let hasher = crate::prompt::PromptHasher::new(None, None, false, 4)
            .unwrap()
            .with_scheme(crate::prompt::BlockHashScheme::Sglang);
        let hashes = hasher.token_hashes(&prompt, 1, Some("sql-lora"));
        let held = |c: &Cluster, key: &str| -> usize {
            c.indexes()
                .find(|(k, _)| *k == key)
                .map_or(0, |(_, index)| index.overlaps(&hashes, now).get(&0).copied().unwrap_or(0))
        };
        let adapter = adapter_key("m", Some("sql-lora"), None).into_owned();
        let batches = sglang_batches();
        assert_eq!(batches.len(), 4);
        // What SGLang published is no id a router can compute from the prompt.
        let KvEvent::BlockStored { block_hashes, lora_name, lora_id, .. } = &batches[0].events[0] else { panic!() };
        assert_eq!((lora_name.as_deref(), *lora_id), (Some("sql-lora"), None));
        assert!(block_hashes.iter().all(|h| !hashes.contains(&h.as_u64())));
        c.apply_events(0, 0, &batches[0]).unwrap();
        c.apply_events(0, 0, &batches[1]).unwrap();
        assert_eq!((held(&c, &adapter), held(&c, "m")), (12, 0), "the adapter's prompt hits, the bare one does not");
        c.apply_events(0, 0, &batches[2]).unwrap();
        assert_eq!(held(&c, &adapter), 8, "the removal reached the re-keyed blocks");
        c.apply_events(0, 0, &batches[3]).unwrap();
        assert_eq!((held(&c, &adapter), held(&c, "m")), (8, 12), "the base model's copy is the base model's");
        // The salted copy went in as published: SGLang's salted chain, which no unsalted
        // lookup matches.
        let KvEvent::BlockStored { block_hashes, cache_salt, .. } = &batches[3].events[1] else { panic!() };
        let salted = pd_protocols::hash::sglang::page_hashes_from(
            Some(pd_protocols::hash::sglang::salt_root("tenant-a")),
            &prompt,
            1,
        );
        assert_eq!(cache_salt.as_deref(), Some("tenant-a"));
        let salted: Vec<u64> = salted.iter().map(pd_protocols::hash::sglang::event_id).collect();
        assert_eq!(block_hashes.iter().map(BlockHash::as_u64).collect::<Vec<_>>(), salted);
        // The engine's reset forgets what was re-keyed.
        c.reset_index(0);
        assert!(c.rekeyer.is_empty());
    }

    #[test]
    fn a_gpu_holder_beats_a_cpu_holder_until_its_copy_is_evicted() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("d0", Role::Decode), now);
        c.register(spec("d1", Role::Decode), now);
        // 20 of the prompt's 40 blocks cached: the overlap credit does not cover the prompt.
        let prompt: Vec<u64> = (1..=40).collect();
        let hashes = &prompt[..20];
        let on = |medium: &str| {
            let mut batch = stored(hashes);
            if let KvEvent::BlockStored { medium: m, .. } = &mut batch.events[0] {
                *m = Some(medium.into());
            }
            batch
        };
        c.apply_events(0, 0, &on("CPU")).unwrap();
        c.apply_events(1, 0, &on("GPU")).unwrap();
        c.apply_events(1, 0, &on("CPU")).unwrap(); // offloaded too: its GPU copy still counts
        let d = c.pair(req("r1", &prompt), now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_overlap_blocks), (1, 20));
        // d1's GPU copies are evicted (removal names the tier): both hold CPU copies only,
        // and the tie goes to the lower engine number.
        let evicted = EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockRemoved {
                block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
                medium: Some("GPU".into()),
            }],
            dp_rank: None,
        };
        c.apply_events(1, 0, &evicted).unwrap();
        c.handoffs.finished("r1");
        // After the decision's own guesses (counted as GPU) expire, within the lease.
        let later = now + Settings::default().speculative_ttl + Duration::from_millis(500);
        let d = c.pair(req("r2", &prompt), later, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_overlap_blocks), (0, 20), "{d:?}");
    }

    #[test]
    fn the_rank_holding_the_prefix_is_named() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        let publishing = |id| EngineSpec { kv_events: Some("tcp://h:5557".into()), ..spec(id, Role::Decode) };
        c.register(EngineSpec { data_parallel_size: Some(2), ..publishing("d0") }, now);
        c.register(publishing("d1"), now);
        // A prompt of 60 blocks: the overlap credit never covers it, so more cached blocks win.
        let hashes: Vec<u64> = (1..=60).collect();
        let on_rank = |rank, n| EventBatch { dp_rank: Some(rank), ..stored(&hashes[..n]) };
        // Rank 1 holds 10 blocks (told by the batch, whatever stream it came on).
        c.apply_events(0, 0, &on_rank(1, 10)).unwrap();
        let d = c.pair(req("r1", &hashes), now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_rank, d.decode_overlap_blocks), (0, Some(1), 10), "{d:?}");
        c.handoffs.finished("r1");
        // Rank 0 (its own stream, no dp_rank in the batch) comes to hold more: it is named.
        let later = now + Settings::default().speculative_ttl + Duration::from_millis(500);
        c.apply_events(0, 0, &EventBatch { dp_rank: None, ..stored(&hashes[..15]) }).unwrap();
        let d = c.pair(req("r2", &hashes), later, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_rank, d.decode_overlap_blocks), (0, Some(0), 15), "{d:?}");
        c.handoffs.finished("r2");
        // A rank the engine did not declare is refused; one rank's reset leaves the other's.
        assert_eq!(c.apply_events(0, 0, &on_rank(2, 20)), Err(UndeclaredRank { rank: 2, declared: 2 }));
        c.reset_rank(0, 0);
        let d = c.pair(req("r3", &hashes), later, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_rank, d.decode_overlap_blocks), (0, Some(1), 10), "{d:?}");
        c.handoffs.finished("r3");
        // An engine without data parallel is never given a rank, whatever its batches say.
        // (after r3's guesses on rank 1 expire)
        let later = later + Settings::default().speculative_ttl + Duration::from_millis(500);
        c.apply_events(1, 0, &on_rank(5, 20)).unwrap();
        let d = c.pair(req("r4", &hashes), later, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_rank, d.decode_overlap_blocks), (1, None, 20), "{d:?}");
        c.handoffs.finished("r4");
        // No rank holds any of a fresh prompt: none is named (the engine balances itself).
        c.engine_died(1, later);
        let fresh: Vec<u64> = (100..=120).collect();
        let d = c.pair(req("r5", &fresh), later, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.decode_rank), (0, None), "{d:?}");
    }

    #[test]
    fn prefers_the_prefill_holding_the_prefix() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("p0", Role::Prefill), now);
        c.register(spec("p1", Role::Prefill), now);
        c.register(spec("d0", Role::Decode), now);
        c.apply_events(1, 0, &stored(&[1, 2, 3])).unwrap();
        let hashes: Vec<u64> = (1..=200).collect();
        let d = c.pair(req("r1", &hashes), now, [0.0, 0.0]).unwrap();
        let expected = Decision {
            decode: 2,
            prefill: Some(1),
            decode_overlap_blocks: 0,
            prefill_overlap_blocks: 3,
            decode_rank: None,
            prefill_rank: None,
        };
        assert_eq!(d, expected);
        assert_eq!(c.handoffs.len(), 1);
    }

    /// The reports' timestamps teach the placement: once warm, an idle decode keeps a fresh
    /// prompt, and a busy one hands it to the prefill engine.
    #[test]
    fn placement_learns_from_the_reports() {
        let t0 = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("p0", Role::Prefill), t0);
        c.register(spec("d0", Role::Decode), t0);
        let ms = Duration::from_millis;
        // Cold: a fresh 1024-token prompt is disaggregated, a mostly cached one stays (the fixed
        // rule); each reports back: 100 µs a computed token, 1 ms plus 2 µs a pulled one.
        for i in 0..WARM {
            let at = t0 + ms(1000 * i);
            let fresh: Vec<u64> = (0..64).map(|b| 1000 * i + b + 10_000).collect();
            let id = format!("fresh{i}");
            let d = c.pair(req(&id, &fresh), at, [0.0; 2]).unwrap();
            assert_eq!(d.prefill, Some(0), "cold: the fixed rule disaggregates {id}");
            c.prefill_done(&id, None, at + ms(103));
            c.decode_started(&id, at + ms(103) + Duration::from_micros(1000 + 2 * 1024));
            c.finished(&id);
            // The same prompt again, now cached on the decode (its events would say so).
            c.apply_events(1, 0, &stored(&fresh[..60])).unwrap();
            let again: Vec<u64> = fresh.iter().copied().chain([1]).collect();
            let id = format!("hit{i}");
            assert_eq!(c.pair(req(&id, &again), at, [0.0; 2]).unwrap().prefill, None);
            c.decode_started(&id, at + ms(1) + Duration::from_micros(100 * 80));
            c.finished(&id);
        }
        assert!(c.timings().warm());
        assert!((c.timings().prefill.line().per_token - 0.1).abs() < 0.01, "{:?}", c.timings().prefill.line());
        // Warm, idle decode: the fresh prompt stays (the pull would only add its time).
        let at = t0 + ms(100_000);
        let fresh: Vec<u64> = (0..64).map(|b| 900_000 + b).collect();
        assert_eq!(c.pair(req("idle", &fresh), at, [0.0; 2]).unwrap().prefill, None);
        // Another fresh prompt at once would be computed beside it and both would start decoding
        // together, stalling nobody: it stays too.
        let fresh: Vec<u64> = (0..64).map(|b| 800_000 + b).collect();
        assert_eq!(c.pair(req("beside", &fresh), at, [0.0; 2]).unwrap().prefill, None);
        // Once the first decodes, it would lose ~100 ms to the next: disaggregate.
        c.decode_started("idle", at + ms(104));
        let fresh: Vec<u64> = (0..64).map(|b| 700_000 + b).collect();
        assert_eq!(c.pair(req("busy", &fresh), at + ms(105), [0.0; 2]).unwrap().prefill, Some(0));
    }

    /// Colocated, warm: a fresh prompt preferred on a busy engine moves whole to an idle one that
    /// can decode, rather than being prefilled there and pulled.
    #[test]
    fn a_better_engine_that_can_decode_takes_the_whole_request() {
        use crate::placement::Sample;
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("e0", Role::Both), now);
        c.register(spec("e1", Role::Both), now);
        for tokens in [64, 500, 1024, 2000] {
            let us = |per: u64| Duration::from_micros(3000 + per * tokens);
            c.timings.observe(Sample::Prefill { tokens, queued_ms: 0.0, took: us(100) });
            c.timings.observe(Sample::Handoff { tokens, took: us(2) });
            c.timings.observe(Sample::Local { tokens, queued_ms: 0.0, took: us(100) });
        }
        let prefer = Some(Preference { engine: 0, max_cost_ratio: f64::INFINITY });
        for i in 0..3 {
            c.handoffs.routed(&format!("busy{i}"), None, 0, 8, now);
        }
        let fresh: Vec<u64> = (0..64).map(|b| 10_000 + b).collect();
        let d = c.pair_preferring(req("fresh", &fresh), prefer, now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.prefill), (1, None), "{d:?}");
        // Fixed thresholds disaggregate it as before.
        let fixed = Settings { placement: Placement::Fixed(Default::default()), ..Settings::default() };
        let mut f = Cluster::new(fixed);
        f.register(spec("e0", Role::Both), now);
        f.register(spec("e1", Role::Both), now);
        let d = f.pair_preferring(req("fresh", &fresh), prefer, now, [0.0; 2]).unwrap();
        assert_eq!((d.decode, d.prefill), (0, Some(1)));
    }

    #[test]
    fn short_uncached_part_decodes_locally_and_no_decode_is_an_error() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("p0", Role::Prefill), now);
        assert!(matches!(c.pair(req("r0", &[1]), now, [0.0; 2]), Err(PairError::NoDecode(_))));
        c.register(spec("d0", Role::Decode), now);
        let hashes: Vec<u64> = (1..=200).collect();
        c.apply_events(1, 0, &stored(&hashes[..190])).unwrap();
        let d = c.pair(req("r1", &hashes), now, [0.0; 2]).unwrap();
        assert_eq!(d.prefill, None, "10 uncached blocks = 160 tokens, 5 %");
    }

    #[test]
    fn a_dead_decode_leaves_pairing_and_releases_held_blocks() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("p0", Role::Prefill), now);
        c.register(spec("d0", Role::Decode), now);
        c.register(spec("d1", Role::Decode), now);
        let hashes: Vec<u64> = (1..=200).collect();
        let d = c.pair(req("r1", &hashes), now, [0.0; 2]).unwrap();
        let _ = c.handoffs.prefill_done("r1", now);
        let actions = c.engine_died(d.decode, now);
        let [Action::Release { notice, .. }] = &actions[..] else { panic!("{actions:?}") };
        assert_eq!((notice.request_id.as_str(), notice.prefill.as_str()), ("r1", "p0"));
        let again = c.pair(req("r2", &hashes), now, [0.0; 2]).unwrap();
        assert_ne!(again.decode, d.decode);
        // Leases: with no heartbeats every engine dies after the lease.
        let later = now + Duration::from_secs(4);
        c.tick(later);
        assert!(c.pair(req("r3", &hashes), later, [0.0; 2]).is_err());
    }

    #[test]
    fn a_failed_attempt_releases_its_own_params_only() {
        let now = Instant::now();
        let mut c = Cluster::new(Settings::default());
        c.register(spec("p0", Role::Prefill), now);
        c.register(spec("d0", Role::Decode), now);
        let raw = |id: &str| RawValue::from_string(format!(r#"{{"remote_request_id": "{id}"}}"#)).unwrap();
        let mut prompt = 0u64;
        let mut paired = |c: &mut Cluster, request: &str| {
            prompt += 1000;
            let hashes: Vec<u64> = (prompt..prompt + 200).collect();
            assert!(c.pair(req(request, &hashes), now, [0.0; 2]).unwrap().prefill.is_some(), "{request}");
        };
        paired(&mut c, "ok");
        c.prefill_done("ok", Some(raw("ok-a")), now);
        c.finished("ok");
        assert!(c.failed("ok", Some(&raw("ok-a")), now).is_empty(), "already finished");

        paired(&mut c, "failed");
        c.prefill_done("failed", Some(raw("failed-a")), now);
        assert!(c.failed("failed", None, now).is_empty(), "a report without params is another attempt's");
        paired(&mut c, "failed");
        c.prefill_done("failed", Some(raw("failed-a")), now);
        let actions = c.failed("failed", Some(&raw("failed-a")), now);
        let [Action::Release { notice, .. }] = &actions[..] else { panic!("{actions:?}") };
        assert_eq!((notice.request_id.as_str(), notice.prefill.as_str()), ("failed", "p0"));
        assert_eq!(notice.kv_transfer_params.get(), r#"{"remote_request_id": "failed-a"}"#);

        // A redirect target's attempt fails after the redirecting sidecar prefilled the same
        // request again itself: neither attempt's blocks may be released by the coordinator.
        paired(&mut c, "redirected");
        c.prefill_done("redirected", Some(raw("redirected-a")), now);
        c.prefill_done("redirected", Some(raw("redirected-b")), now);
        assert!(c.failed("redirected", Some(&raw("redirected-a")), now).is_empty());
        assert!(c.handoffs.is_empty());
        // A failure report that overtook its prefill_done still releases.
        paired(&mut c, "overtaken");
        let actions = c.failed("overtaken", Some(&raw("overtaken-a")), now);
        assert!(matches!(&actions[..], [Action::Release { .. }]), "{actions:?}");
        // The same when the decode dies instead.
        paired(&mut c, "contested");
        c.prefill_done("contested", Some(raw("contested-a")), now);
        c.prefill_done("contested", Some(raw("contested-b")), now);
        let decode = c.membership.id_of("d0").unwrap();
        let died = c.engine_died(decode, now);
        assert!(!died.iter().any(|a| matches!(a, Action::Release { .. })), "{died:?}");
    }

    #[test]
    fn the_callers_engine_is_kept_unless_much_worse() {
        let now = Instant::now();
        // Even weights: a cached block saves one block of work, so costs stay close.
        let weights = Weights { prefill_scale: 1.0, overlap_credit: 1.0, temperature: 0.0 };
        let mut c = Cluster::new(Settings { weights, ..Settings::default() });
        c.register(spec("d0", Role::Decode), now);
        c.register(spec("d1", Role::Decode), now);
        let hashes: Vec<u64> = (1..=100).collect();
        c.apply_events(0, 0, &stored(&hashes[..20])).unwrap();
        let prefer = |engine| Some(Preference { engine, max_cost_ratio: 1.5 });
        assert_eq!(c.pair(req("r0", &hashes), now, [0.0; 2]).unwrap().decode, 0);
        assert_eq!(c.pair_preferring(req("r1", &hashes), prefer(1), now, [0.0; 2]).unwrap().decode, 1);
        c.apply_events(0, 0, &stored(&hashes)).unwrap();
        c.handoffs.finished("r0");
        c.handoffs.finished("r1");
        c.reset_index(1);
        assert_eq!(c.pair_preferring(req("r2", &hashes), prefer(1), now, [0.0; 2]).unwrap().decode, 0, "much worse");
        c.engine_died(0, now);
        assert_eq!(c.pair_preferring(req("r3", &hashes), prefer(0), now, [0.0; 2]).unwrap().decode, 1, "dead");
    }
}
