//! The pairing cost model: which engine should take a request, given how much of its prompt each
//! engine already caches and how loaded each is; and whether to skip the prefill leg.
//!
//! Cost of an engine for a request of `new` blocks (Dynamo's KV-router form):
//! `prefill_scale × max(0, queued_prefill + new − credit × overlap) + (active_decode + new)`,
//! where each cached block of the overlap counts at its tier's weight (GPU 1; a copy in host
//! memory or on disk must be loaded back first, so it saves less), as llm-d's scorer weighs
//! KV-cache media.
//! Temperature 0 picks the cheapest; above 0 samples a softmax over costs normalised to 0..1,
//! so near-best engines share the load.

use crate::index::Tier;

/// An engine's load, from its metrics and the coordinator's own in-flight accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Load {
    /// Blocks of requests decoding on the engine.
    pub active_decode_blocks: u64,
    /// Uncached prompt blocks waiting for prefill on the engine.
    pub queued_prefill_blocks: u64,
}

/// One engine able to serve the request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub engine: usize,
    /// Leading blocks of the prompt the engine already holds.
    pub overlap_blocks: u64,
    /// Those blocks each counted at its tier's weight ([`TierWeights`]); `overlap_blocks` when
    /// all are on GPU.
    pub overlap_weight: f64,
    pub load: Load,
}

/// What a cached block is worth by where it is, against one on GPU (1.0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TierWeights {
    pub cpu: f64,
    /// Disk and any other slower medium.
    pub disk: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        TierWeights { cpu: 0.8, disk: 0.5 }
    }
}

impl TierWeights {
    pub fn of(&self, tier: Tier) -> f64 {
        match tier {
            Tier::Gpu => 1.0,
            Tier::Cpu => self.cpu,
            Tier::Other => self.disk,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// What a block of prefill costs against a block of decode load.
    pub prefill_scale: f64,
    /// How much one cached block saves (1.0 = a full block of prefill work; above 1 it also
    /// forgives as much of the engine's prefill queue).
    pub overlap_credit: f64,
    /// 0 = always the cheapest; higher spreads load among near-best engines.
    pub temperature: f64,
}

/// The defaults favour the engine holding the prompt: a block of prefill (compute-bound) costs
/// ten blocks of decode load (memory-bound), and a cached block also forgives a block of the
/// holder's queue, which is mostly hits of the same prompts, short to prefill. Dynamo's
/// weighting is (1, 1); on pdbench's shared-prefix workload it routed at 0.65-0.73 × round
/// robin's mean TTFT against 0.42-0.46 × with these (coordinator/README.md).
impl Default for Weights {
    fn default() -> Self {
        Weights { prefill_scale: 10.0, overlap_credit: 2.0, temperature: 0.0 }
    }
}

/// The candidate's cost; never NaN (a NaN from odd weights counts as +∞, the worst), and no
/// integer arithmetic that could overflow on loads a peer reported.
pub fn cost(candidate: &Candidate, new_blocks: u64, weights: &Weights) -> f64 {
    let new = new_blocks as f64;
    let prefill = candidate.load.queued_prefill_blocks as f64 + new - weights.overlap_credit * candidate.overlap_weight;
    let cost = weights.prefill_scale * prefill.max(0.0) + (candidate.load.active_decode_blocks as f64 + new);
    if cost.is_nan() {
        f64::INFINITY
    } else {
        cost
    }
}

/// The chosen candidate's position in `candidates`, or `None` when there are none. `uniform`
/// is a random number in `[0, 1)` (used only when the temperature is above 0). Allocates
/// nothing: costs are recomputed per pass (a few flops each).
pub fn choose(candidates: &[Candidate], new_blocks: u64, weights: &Weights, uniform: f64) -> Option<usize> {
    let costs = || candidates.iter().map(|c| cost(c, new_blocks, weights));
    let (cheapest, min) = costs().enumerate().fold(None, |best: Option<(usize, f64)>, (i, c)| match best {
        Some((b, bc)) if bc.total_cmp(&c).then(candidates[b].engine.cmp(&candidates[i].engine)).is_le() => {
            Some((b, bc))
        }
        _ => Some((i, c)),
    })?;
    if weights.temperature.is_nan() || weights.temperature <= 0.0 || candidates.len() == 1 || !min.is_finite() {
        return Some(cheapest);
    }
    // Softmax over the finite costs normalised to 0..1; infinite ones are never sampled.
    let max = costs().filter(|c| c.is_finite()).fold(min, f64::max);
    let span = if max > min { max - min } else { 1.0 };
    let score = |c: f64| if c.is_finite() { (-(c - min) / span / weights.temperature).exp() } else { 0.0 };
    let total: f64 = costs().map(score).sum();
    if !total.is_finite() || total <= 0.0 {
        return Some(cheapest);
    }
    let mut target = uniform.clamp(0.0, 1.0) * total;
    for (i, c) in costs().enumerate() {
        let s = score(c);
        if target < s {
            return Some(i);
        }
        target -= s;
    }
    Some(cheapest)
}

/// When to skip disaggregation and prefill on the decode engine itself.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LocalPrefillPolicy {
    /// Prefill locally when fewer uncached tokens than this remain...
    pub max_uncached_tokens: u64,
    /// ...and they are less than this share of the prompt.
    pub max_uncached_ratio: f64,
}

impl Default for LocalPrefillPolicy {
    fn default() -> Self {
        LocalPrefillPolicy { max_uncached_tokens: 2048, max_uncached_ratio: 0.7 }
    }
}

impl LocalPrefillPolicy {
    /// Whether the decode engine should compute the prompt itself, given the prompt length and
    /// how many of its leading tokens the decode engine already caches.
    pub fn prefill_locally(&self, prompt_tokens: u64, cached_on_decode: u64) -> bool {
        if prompt_tokens == 0 {
            return true;
        }
        let uncached = prompt_tokens.saturating_sub(cached_on_decode);
        uncached < self.max_uncached_tokens && (uncached as f64 / prompt_tokens as f64) < self.max_uncached_ratio
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(engine: usize, overlap: u64, active: u64, queued: u64) -> Candidate {
        Candidate {
            engine,
            overlap_blocks: overlap,
            overlap_weight: overlap as f64,
            load: Load { active_decode_blocks: active, queued_prefill_blocks: queued },
        }
    }

    /// Dynamo's weighting: a block of prefill against a block of decode load.
    const EVEN: Weights = Weights { prefill_scale: 1.0, overlap_credit: 1.0, temperature: 0.0 };

    #[test]
    fn overlap_wins_until_load_outweighs_it() {
        let w = EVEN;
        // 10 new blocks; engine 1 caches 8 of them.
        let idle = [cand(0, 0, 0, 0), cand(1, 8, 0, 0)];
        assert_eq!(choose(&idle, 10, &w, 0.0), Some(1));
        let busy = [cand(0, 0, 0, 0), cand(1, 8, 30, 0)];
        assert_eq!(choose(&busy, 10, &w, 0.0), Some(0));
        assert_eq!(cost(&cand(0, 20, 0, 0), 10, &w), 10.0, "credit never makes prefill negative");
        assert_eq!(choose(&[], 10, &w, 0.0), None);
        // The defaults keep the holder under that load (its 8 cached blocks are worth 80 decode
        // blocks, and forgive 8 queued ones) until the load outweighs them.
        let d = Weights::default();
        assert_eq!(choose(&busy, 10, &d, 0.0), Some(1));
        assert_eq!(choose(&[cand(0, 0, 0, 0), cand(1, 8, 0, 8)], 10, &d, 0.0), Some(1));
        assert_eq!(choose(&[cand(0, 0, 0, 0), cand(1, 8, 101, 0)], 10, &d, 0.0), Some(0));
    }

    #[test]
    fn ties_break_by_engine_id_and_temperature_spreads() {
        let w = EVEN;
        let tied = [cand(5, 0, 0, 0), cand(2, 0, 0, 0)];
        assert_eq!(choose(&tied, 4, &w, 0.9), Some(1));
        let warm = Weights { temperature: 1.0, ..w };
        let picks: Vec<usize> = (0..10).map(|i| choose(&tied, 4, &warm, i as f64 / 10.0).unwrap()).collect();
        assert!(picks.contains(&0) && picks.contains(&1), "{picks:?}");
        // A much worse engine is rarely chosen even when warm.
        let skewed = [cand(0, 0, 0, 0), cand(1, 0, 1000, 0)];
        let worse = (0..100).filter(|i| choose(&skewed, 4, &warm, *i as f64 / 100.0) == Some(1)).count();
        assert!(worse < 40, "{worse}");
    }

    #[test]
    fn extreme_loads_and_weights_order_sanely() {
        let w = EVEN;
        // Loads and overlaps at u64::MAX (a peer's figures): no overflow, no NaN, finite order.
        let huge = [cand(0, u64::MAX, u64::MAX, u64::MAX), cand(1, 0, 0, 0), cand(2, u64::MAX, 0, u64::MAX)];
        for c in &huge {
            assert!(!cost(c, u64::MAX, &w).is_nan());
        }
        assert_eq!(choose(&huge, u64::MAX, &w, 0.0), Some(1));
        assert_eq!(choose(&huge, 10, &w, 0.0), Some(2), "its overlap covers its queue: cost 10");
        // Weights that make every cost NaN or infinite still pick one, by engine order.
        let odd = Weights { prefill_scale: f64::INFINITY, overlap_credit: f64::INFINITY, temperature: 1.0 };
        let tied = [cand(3, 5, 0, 0), cand(1, 0, 0, 0)];
        assert!(cost(&tied[0], 10, &odd) == f64::INFINITY, "NaN counts as the worst");
        assert_eq!(choose(&tied, 10, &odd, 0.5), Some(1));
        let nan = Weights { prefill_scale: f64::NAN, overlap_credit: f64::NAN, temperature: f64::NAN };
        assert_eq!(choose(&tied, 10, &nan, 0.5), Some(1));
        // Warm sampling never picks an infinite-cost engine while a finite one exists.
        let warm = Weights { temperature: 5.0, ..w };
        let mixed = [cand(0, 0, u64::MAX, 0), cand(1, 0, 0, 0)];
        let inf = Weights { prefill_scale: f64::MAX, ..warm };
        for i in 0..100 {
            let u = i as f64 / 100.0;
            assert!(choose(&mixed, 4, &warm, u).is_some());
            assert_eq!(choose(&[cand(0, 0, 0, 1), cand(1, 4, 0, 0)], 4, &inf, u), Some(1));
        }
    }

    #[test]
    fn a_gpu_copy_beats_a_cpu_copy_beats_none() {
        let d = Weights::default();
        let tiers = TierWeights::default();
        let on = |engine, tier| Candidate { overlap_weight: 8.0 * tiers.of(tier), ..cand(engine, 8, 0, 0) };
        let (cpu, disk, gpu) = (on(0, Tier::Cpu), on(1, Tier::Other), on(2, Tier::Gpu));
        // 20 new blocks, 8 cached: the credit does not cover the whole prompt.
        assert!(cost(&gpu, 20, &d) < cost(&cpu, 20, &d) && cost(&cpu, 20, &d) < cost(&disk, 20, &d));
        assert!(cost(&disk, 20, &d) < cost(&cand(3, 0, 0, 0), 20, &d));
        assert_eq!(choose(&[cpu, disk, gpu], 20, &d, 0.0), Some(2));
        assert_eq!(choose(&[cpu, disk], 20, &d, 0.0), Some(0));
    }

    #[test]
    fn local_prefill_only_for_short_uncached_parts() {
        let policy = LocalPrefillPolicy::default();
        assert!(!policy.prefill_locally(500, 0), "everything uncached: ratio 1.0");
        assert!(policy.prefill_locally(5000, 4000), "1000 uncached tokens, 20 %");
        assert!(!policy.prefill_locally(10_000, 7000), "3000 uncached tokens");
        assert!(policy.prefill_locally(0, 0));
    }
}
