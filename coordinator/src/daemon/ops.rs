//! The API operations both edges (HTTP, gRPC) call: register, heartbeat, deregister, list,
//! pair, report, index stats, metrics.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::{
    ApiError, EngineSpecJson, EngineView, IndexStats, LoadJson, ModelStats, NodeDownJson, Notices, PairDecisionJson,
    PairReason, PairRequestJson, Registration, ReportEvent, ReportJson,
};
use crate::cluster::{adapter_key, key_model, PairError, PairRequest, Preference};
use crate::membership::EngineSpec;
use crate::metrics::{inc, DeathCause, Gauges};
use crate::prompt::Precision;
use crate::ranks;

use super::load::{reported_load, EngineFacts};
use super::state::{endpoint, engines, Coordinator, Origin};

/// Longest request id accepted, bytes.
const MAX_REQUEST_ID: usize = 512;
/// Only a prompt's first blocks are hashed: prefixes longer than this are not worth telling
/// apart, and hashing stays bounded.
const MAX_HASHED_BLOCKS: usize = 16_384;
/// Prompt text up to this many bytes is tokenized on the runtime worker that took the request
/// (about a millisecond of work); longer text, and token ids beyond [`INLINE_TOKEN_IDS`], are
/// hashed on a blocking thread, so that heartbeats, KV events and other pairings do not wait
/// behind them.
const INLINE_PROMPT_BYTES: usize = 8 << 10;
const INLINE_TOKEN_IDS: usize = 1 << 16;
/// Prompt text tokenized off the runtime at once, KiB: tokenizing holds about 50 bytes per byte
/// of text (HF `tokenizers` keeps offsets per byte; coordinator/README.md), so 32 MiB of it, two
/// of the largest bodies accepted, is about 1.7 GB.
pub(crate) const LONG_HASHING_KIB: usize = 32 << 10;

/// The KiB of [`LONG_HASHING_KIB`] a job off the runtime takes: its text or body, and at
/// least a worker's share, so that no more of them run at once than there are workers.
fn long_hashing_permits(bytes: usize, workers: usize) -> u32 {
    let kib = (bytes >> 10).clamp(LONG_HASHING_KIB / workers.max(1), LONG_HASHING_KIB);
    u32::try_from(kib).unwrap_or(u32::MAX)
}

impl Coordinator {
    pub async fn register(self: &Arc<Self>, spec: EngineSpecJson) -> Result<Registration, ApiError> {
        spec.validate().map_err(|e| ApiError::BadRequest(e.to_string()))?;
        let spec = EngineSpec::from(&spec);
        let lease_id = match &self.store {
            Some(store) => match store.register(&spec).await {
                Ok(lease) => Some(lease),
                Err(err) => {
                    inc(&self.metrics.store_errors);
                    tracing::warn!(%err, engine = %spec.id, "etcd: registration kept locally only");
                    None
                }
            },
            None => None,
        };
        let id = spec.id.clone();
        {
            let mut inner = self.inner.lock();
            self.apply_register(&mut inner, spec, Origin::Registered, lease_id, Instant::now());
        }
        inc(&self.metrics.registrations);
        tracing::info!(engine = %id, "registered");
        Ok(Registration {
            engine: id,
            lease_ms: self.config.lease_ms,
            heartbeat_ms: self.config.heartbeat_ms,
            decode_started_on_end: true,
        })
    }

    pub async fn heartbeat(self: &Arc<Self>, id: &str, load: Option<LoadJson>) -> Result<Notices, ApiError> {
        let unknown = || ApiError::NotFound(format!("unknown or dead engine {id:?}: register again"));
        if let Some(store) = &self.store {
            let known = {
                let inner = self.inner.lock();
                let engine = inner.cluster.membership.id_of(id).ok_or_else(unknown)?;
                let entry = inner.cluster.membership.get(engine).ok_or_else(unknown)?;
                if !entry.is_alive() {
                    return Err(unknown());
                }
                let meta = &inner.meta[engine];
                (engine, meta.lease_id, meta.origin, entry.spec.clone())
            };
            let known = match known {
                (engine, Some(lease), _, spec) => Some((engine, lease, spec)),
                // Registered while etcd was unreachable: store it now, so the other
                // coordinators learn of it.
                (engine, None, Origin::Registered, spec) => {
                    match store.register(&spec).await {
                        Ok(lease) => {
                            let mut inner = self.inner.lock();
                            if inner.meta[engine].lease_id.is_none() {
                                inner.meta[engine].lease_id = Some(lease);
                            }
                        }
                        Err(err) => {
                            inc(&self.metrics.store_errors);
                            tracing::warn!(%err, engine = id, "etcd: still unreachable");
                        }
                    }
                    None
                }
                (_, None, Origin::Static, _) => None,
            };
            if let Some((engine, lease, spec)) = known {
                match store.heartbeat(&spec, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        let actions = {
                            let mut inner = self.inner.lock();
                            let alive = inner.cluster.membership.get(engine).is_some_and(|e| e.is_alive());
                            if alive && inner.meta[engine].lease_id == Some(lease) {
                                self.on_died(&mut inner, engine, DeathCause::Store, Instant::now())
                            } else {
                                Vec::new()
                            }
                        };
                        self.carry_out(actions);
                        return Err(unknown());
                    }
                    Err(err) => {
                        inc(&self.metrics.store_errors);
                        tracing::warn!(%err, engine = id, "etcd: heartbeat renewed locally only");
                    }
                }
            }
        }
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let inner = &mut *inner;
        let engine = inner.cluster.membership.heartbeat(id, now).map_err(|_| unknown())?;
        inc(&self.metrics.heartbeats);
        if let Some(load) = load {
            if let Some(spec) = inner.cluster.membership.get(engine).map(|e| &e.spec) {
                let facts =
                    EngineFacts { role: spec.role, capacity_blocks: spec.capacity_blocks, sizes: inner.request_sizes };
                if let Some(reported) = reported_load(&load, facts) {
                    inner.cluster.report_load(engine, reported);
                }
            }
            inner.meta[engine].load = Some(load);
        }
        Ok(inner.cluster.notices(engine))
    }

    pub async fn deregister(self: &Arc<Self>, id: &str) -> Result<(), ApiError> {
        let (actions, lease) = {
            let mut inner = self.inner.lock();
            let inner = &mut *inner;
            let engine = inner
                .cluster
                .membership
                .id_of(id)
                .ok_or_else(|| ApiError::NotFound(format!("unknown engine {id:?}")))?;
            let alive = inner.cluster.membership.get(engine).is_some_and(|e| e.is_alive());
            let actions =
                if alive { self.on_died(inner, engine, DeathCause::Deregistered, Instant::now()) } else { Vec::new() };
            inner.meta[engine].left = true;
            (actions, inner.meta[engine].lease_id.take())
        };
        self.carry_out(actions);
        if let Some(store) = &self.store {
            if let Err(err) = store.deregister(id, lease).await {
                inc(&self.metrics.store_errors);
                tracing::warn!(%err, engine = id, "etcd: deregistration not stored");
            }
        }
        Ok(())
    }

    /// A whole node is down (an operator or orchestrator says so): every live engine on it
    /// leaves pairing and the index at once, as one death each (`cause="node"`): held blocks
    /// of their requests are released, and every other sidecar is told in its next heartbeat
    /// answer. With etcd their keys are removed, so the other coordinators see the deaths too.
    /// Engines come back by registering again (static ones when /health answers).
    pub async fn node_down(self: &Arc<Self>, node: &str) -> Result<NodeDownJson, ApiError> {
        if node.is_empty() || node.len() > 256 {
            return Err(ApiError::BadRequest("node names are 1..256 bytes".into()));
        }
        let (left, actions, revoke) = {
            let mut inner = self.inner.lock();
            let inner = &mut *inner;
            let on_node = inner.cluster.membership.on_node(node);
            if on_node.is_empty() {
                return Err(ApiError::NotFound(format!("no engine is known on node {node:?}")));
            }
            let now = Instant::now();
            let (mut left, mut actions, mut revoke) = (Vec::new(), Vec::new(), Vec::new());
            for engine in on_node {
                let Some(entry) = inner.cluster.membership.get(engine) else { continue };
                if !entry.is_alive() {
                    continue;
                }
                let id = entry.spec.id.clone();
                if let Some(lease) = inner.meta[engine].lease_id.take() {
                    revoke.push((id.clone(), lease));
                }
                actions.extend(self.on_died(inner, engine, DeathCause::Node, now));
                left.push(id);
            }
            (left, actions, revoke)
        };
        tracing::warn!(node, engines = ?left, "node reported down");
        self.carry_out(actions);
        if let Some(store) = &self.store {
            for (id, lease) in revoke {
                if let Err(err) = store.deregister(&id, Some(lease)).await {
                    inc(&self.metrics.store_errors);
                    tracing::warn!(%err, engine = %id, "etcd: cannot remove an engine of a node that is down");
                }
            }
        }
        Ok(NodeDownJson { node: node.to_string(), engines: left })
    }

    pub fn list(&self) -> Vec<EngineView> {
        let inner = self.inner.lock();
        let per_index: Vec<(&str, HashMap<usize, usize>)> =
            inner.cluster.indexes().map(|(key, index)| (key_model(key), ranks::blocks_by_engine(index))).collect();
        let indexed = |engine: usize, model: &str| {
            let of_model = per_index.iter().filter(|(m, _)| *m == model);
            of_model.map(|(_, blocks)| blocks.get(&engine).copied().unwrap_or(0) as u64).sum()
        };
        engines(&inner.cluster)
            .map(|(i, e)| EngineView {
                spec: EngineSpecJson::from(&e.spec),
                alive: e.is_alive(),
                generation: e.generation,
                origin: inner.meta[i].origin,
                load: inner.meta[i].load,
                indexed_blocks: indexed(i, &e.spec.model),
            })
            .collect()
    }

    /// [`Coordinator::pair`] for the API edges: a request whose prompt takes long to hash is
    /// decided on a blocking thread ([`Coordinator::off_runtime`]).
    pub async fn pair_without_blocking(self: &Arc<Self>, req: PairRequestJson) -> Result<PairDecisionJson, ApiError> {
        let text_bytes = req.prompt.as_ref().map_or(0, String::len);
        let long =
            text_bytes > INLINE_PROMPT_BYTES || req.token_ids.as_ref().is_some_and(|ids| ids.len() > INLINE_TOKEN_IDS);
        if !long {
            return self.pair(req);
        }
        self.off_runtime(text_bytes, move |c| c.pair(req)).await
    }

    /// Runs `work` (a pairing, with whatever parsing it needs) on a blocking thread, so that the
    /// runtime's workers are never held by it. At most one such job per runtime worker runs at
    /// a time, and at most [`LONG_HASHING_KIB`] of `bytes` (the prompt text or body it reads);
    /// the others wait their turn.
    pub async fn off_runtime<T: Send + 'static>(
        self: &Arc<Self>,
        bytes: usize,
        work: impl FnOnce(&Coordinator) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let permit = Arc::clone(&self.long_hashing)
            .acquire_many_owned(long_hashing_permits(bytes, self.workers))
            .await
            .map_err(|_| ApiError::Unavailable("the coordinator is shutting down".into()))?;
        let c = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            // Held until the work is done, even when the caller has gone.
            let _permit = permit;
            work(&c)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("pairing failed: {e}")))?
    }

    pub fn pair(&self, req: PairRequestJson) -> Result<PairDecisionJson, ApiError> {
        let start = Instant::now();
        let asked_by = req.local_engine.clone();
        let result = self.pair_inner(req);
        match &result {
            Ok(decision) => {
                inc(match decision.reason {
                    PairReason::Disaggregated => &self.metrics.pair_disaggregated,
                    PairReason::LocalPrefill => &self.metrics.pair_local_prefill,
                });
                if asked_by.is_some_and(|engine| engine != decision.decode.id) {
                    inc(&self.metrics.pair_moved);
                }
                self.metrics.pair_latency.observe(start.elapsed());
            }
            Err(ApiError::Unavailable(_)) => inc(&self.metrics.pair_no_decode),
            Err(_) => inc(&self.metrics.pair_invalid),
        }
        result
    }

    fn pair_inner(&self, req: PairRequestJson) -> Result<PairDecisionJson, ApiError> {
        if req.request_id.is_empty() || req.request_id.len() > MAX_REQUEST_ID {
            return Err(ApiError::BadRequest(format!("'request_id' must be 1..{MAX_REQUEST_ID} bytes")));
        }
        if req.model.is_empty() {
            return Err(ApiError::BadRequest("'model' must not be empty".into()));
        }
        let no_decode = || ApiError::Unavailable(format!("no live decode engine serves model {:?}", req.model));
        // The block size most of the model's live engines use keys its index.
        let block_size = {
            let inner = self.inner.lock();
            let mut sizes: HashMap<u32, usize> = HashMap::new();
            for (_, e) in engines(&inner.cluster).filter(|(_, e)| e.is_alive() && e.spec.model == req.model) {
                *sizes.entry(e.spec.block_size).or_default() += 1;
            }
            sizes
                .into_iter()
                .max_by_key(|&(size, n)| (n, std::cmp::Reverse(size)))
                .map(|(size, _)| size)
                .ok_or_else(no_decode)?
        };
        let lora = req.lora_name.as_deref();
        let (hashes, tokens, precision) = match (&req.token_ids, &req.prompt) {
            (Some(ids), _) => {
                let hashed = &ids[..ids.len().min(MAX_HASHED_BLOCKS * block_size as usize)];
                (self.hasher.token_hashes(hashed, block_size, lora), ids.len() as u64, Precision::Exact)
            }
            (None, Some(text)) => {
                let mut hashed =
                    self.hasher.text_hashes(text, block_size, lora).map_err(|e| ApiError::BadRequest(e.to_string()))?;
                hashed.hashes.truncate(MAX_HASHED_BLOCKS);
                (hashed.hashes, hashed.prompt_tokens, hashed.precision)
            }
            (None, None) => (Vec::new(), 0, Precision::Exact),
        };
        let prompt_tokens = req.prompt_tokens.unwrap_or(tokens);
        let uniform = [rand::random::<f64>(), rand::random::<f64>()];
        let now = Instant::now();
        let mut inner = self.inner.lock();
        let prefer = req
            .local_engine
            .as_deref()
            .and_then(|id| inner.cluster.membership.id_of(id))
            .map(|engine| Preference { engine, max_cost_ratio: self.config.local_decode_slack });
        let request = PairRequest {
            request_id: &req.request_id,
            model: &req.model,
            block_hashes: &hashes,
            prompt_tokens,
            block_size,
            lora_name: lora,
        };
        let decision = inner.cluster.pair_preferring(request, prefer, now, uniform).map_err(|e| match e {
            PairError::NoDecode(_) => no_decode(),
        })?;
        if !hashes.is_empty() {
            let cached = decision.decode_overlap_blocks.max(decision.prefill_overlap_blocks);
            let prompt = hashes.len() as u64;
            inner.request_sizes.observe(prompt, prompt.saturating_sub(cached));
        }
        // Where events cannot confirm what was routed, remember it for longer.
        let index_key = adapter_key(&req.model, lora, None);
        let approx_until = now + Duration::from_secs_f64(self.config.approx_ttl_secs);
        let routed = std::iter::once((decision.decode, decision.decode_rank))
            .chain(decision.prefill.map(|engine| (engine, decision.prefill_rank)));
        for (engine, rank) in routed {
            let Some(spec) = inner.cluster.membership.get(engine).map(|e| &e.spec) else { continue };
            // On an engine with ranks and none named, which rank serves it is not known here.
            if spec.has_ranks() && rank.is_none() {
                continue;
            }
            let without_events = spec.kv_events.is_none();
            if precision == Precision::Approximate || without_events {
                let holder = ranks::holder(engine, rank.unwrap_or(0));
                inner.cluster.model_index_mut(&index_key).insert_approximate(holder, &hashes, approx_until);
            }
        }
        let spec_of = |engine: usize| inner.cluster.membership.get(engine).map(|e| endpoint(&e.spec));
        let decode =
            spec_of(decision.decode).ok_or_else(|| ApiError::Internal("decision names an unknown engine".into()))?;
        let prefill = decision.prefill.and_then(spec_of);
        let reason = if prefill.is_some() { PairReason::Disaggregated } else { PairReason::LocalPrefill };
        let prefill_dp_rank = decision.prefill_rank.filter(|_| prefill.is_some());
        Ok(PairDecisionJson {
            request_id: req.request_id,
            decode,
            prefill,
            decode_overlap_blocks: decision.decode_overlap_blocks,
            prefill_overlap_blocks: decision.prefill_overlap_blocks,
            decode_dp_rank: decision.decode_rank,
            prefill_dp_rank,
            reason,
        })
    }

    pub fn report(self: &Arc<Self>, report: ReportJson) -> Result<(), ApiError> {
        if report.request_id.is_empty() || report.request_id.len() > MAX_REQUEST_ID {
            return Err(ApiError::BadRequest(format!("'request_id' must be 1..{MAX_REQUEST_ID} bytes")));
        }
        // A sidecar folds the first output of an answer that came whole into its final report;
        // one that reports it on its own sends `decode_started` (both accepted, same effect, and
        // counted alike).
        let ends = matches!(report.event, ReportEvent::Finished | ReportEvent::Failed);
        let folded = report.decode_started && ends;
        inc(&self.metrics.reports);
        if folded {
            inc(&self.metrics.reports);
        }
        let id = report.request_id;
        let actions = {
            let mut inner = self.inner.lock();
            if folded {
                inner.cluster.decode_started(&id, Instant::now());
            }
            match report.event {
                ReportEvent::PrefillDone => {
                    inner.cluster.prefill_done(&id, report.kv_transfer_params, Instant::now());
                    Vec::new()
                }
                ReportEvent::DecodeStarted => {
                    inner.cluster.decode_started(&id, Instant::now());
                    Vec::new()
                }
                ReportEvent::Finished => {
                    inner.cluster.finished(&id);
                    Vec::new()
                }
                // A decode that died leaves the prefill holding its blocks (and their grant):
                // free them now rather than at the end of the prefill's lease.
                ReportEvent::Failed => {
                    tracing::debug!(request = %id, error = report.error.as_deref().unwrap_or("-"), "request failed");
                    inner.cluster.failed(&id, report.kv_transfer_params.as_deref(), Instant::now())
                }
            }
        };
        self.carry_out(actions);
        Ok(())
    }

    pub fn index_stats(&self) -> IndexStats {
        let inner = self.inner.lock();
        let mut stats = IndexStats::default();
        for (model, index) in inner.cluster.indexes() {
            let mut entry = ModelStats { blocks: index.len() as u64, ..ModelStats::default() };
            let blocks = ranks::blocks_by_engine(index);
            for (i, e) in engines(&inner.cluster).filter(|(_, e)| e.spec.model == key_model(model)) {
                let n = blocks.get(&i).copied().unwrap_or(0) as u64;
                entry.entries += n;
                entry.engines.insert(e.spec.id.clone(), n);
            }
            stats.models.insert(model.to_string(), entry);
        }
        stats
    }

    pub fn render_metrics(&self) -> String {
        let mut gauges = Gauges::default();
        {
            let inner = self.inner.lock();
            for (_, e) in engines(&inner.cluster) {
                if e.is_alive() {
                    gauges.engines_alive += 1;
                } else {
                    gauges.engines_dead += 1;
                }
            }
            gauges.handoffs_in_flight = inner.cluster.handoffs.len() as u64;
            gauges.pending_releases = inner.cluster.owed_releases() as u64;
            for (model, index) in inner.cluster.indexes() {
                let blocks = ranks::blocks_by_engine(index);
                let entries = engines(&inner.cluster).map(|(i, _)| blocks.get(&i).copied().unwrap_or(0) as u64).sum();
                gauges.index.push((model.to_string(), index.len() as u64, entries));
            }
        }
        gauges.index.sort();
        let c = &self.ingest_counters;
        let m = &self.metrics;
        use std::sync::atomic::Ordering::Relaxed;
        m.event_gaps.store(c.gaps.load(Relaxed), Relaxed);
        m.event_replays.store(c.replays.load(Relaxed), Relaxed);
        m.event_replayed_batches.store(c.replayed_batches.load(Relaxed), Relaxed);
        m.event_resets.store(c.resets.load(Relaxed), Relaxed);
        m.render(&gauges)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_hashings_are_bounded_by_workers_and_by_text() {
        // Two workers: a prompt just over the inline limit takes half the budget, so two run at once.
        assert_eq!(long_hashing_permits(10 << 10, 2) as usize, LONG_HASHING_KIB / 2);
        // Large prompts take their size: two 16 MiB prompts at once on 64 workers, not 64.
        assert_eq!(long_hashing_permits(16 << 20, 64), 16 << 10);
        assert_eq!(long_hashing_permits(usize::MAX, 64) as usize, LONG_HASHING_KIB, "never more than the budget");
        assert_eq!(long_hashing_permits(0, 0) as usize, LONG_HASHING_KIB, "no workers counts as one");
    }
}
