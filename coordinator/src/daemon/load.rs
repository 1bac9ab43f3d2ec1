//! Turning what a sidecar reports about its engine (request counts, KV usage, or block figures)
//! into the pairing model's [`Load`], by the engine's role.

use crate::api::LoadJson;
use crate::membership::Role;
use crate::pairing::Load;

/// Reported load is clamped so that cost arithmetic on it cannot overflow.
const MAX_REPORTED_BLOCKS: u64 = 1 << 40;

/// What the coordinator knows of an engine when it reads a report.
#[derive(Clone, Copy, Debug)]
pub struct EngineFacts {
    pub role: Role,
    pub capacity_blocks: Option<u64>,
    pub sizes: RequestSizes,
}

/// Moving averages over pair requests, to turn reported request counts into blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestSizes {
    /// Prompt blocks: what a decoding request holds.
    pub prompt_blocks: f64,
    /// Prompt blocks the chosen engines did not hold: what a request waiting for (or in)
    /// prefill computes. Counting whole prompts instead made an engine busy with cache hits
    /// look as loaded as one computing misses.
    pub uncached_blocks: f64,
}

impl Default for RequestSizes {
    fn default() -> Self {
        RequestSizes { prompt_blocks: 16.0, uncached_blocks: 16.0 }
    }
}

impl RequestSizes {
    /// One more decision: a prompt of `prompt` blocks, `uncached` of them computed.
    pub fn observe(&mut self, prompt: u64, uncached: u64) {
        self.prompt_blocks = 0.95 * self.prompt_blocks + 0.05 * prompt as f64;
        self.uncached_blocks = 0.95 * self.uncached_blocks + 0.05 * uncached.min(prompt) as f64;
    }
}

/// The load a report stands for, or `None` when it says nothing usable.
///
/// Explicit block figures win. Otherwise, on an engine that decodes, running requests (or KV
/// usage × capacity) are decode load, of an average prompt's blocks each, and waiting ones
/// queued prefill, of an average request's uncached blocks each. On a prefill-only engine every
/// running request is a prompt being prefilled (vLLM runs them with `max_tokens` 1), so running
/// and waiting both count as queued prefill; its KV usage is blocks held for decodes to pull,
/// not decode work.
pub fn reported_load(report: &LoadJson, engine: EngineFacts) -> Option<Load> {
    let blocks = |requests: Option<u64>, each: f64| requests.map(|n| (n as f64 * each.max(1.0)) as u64);
    let decoding = |requests| blocks(requests, engine.sizes.prompt_blocks);
    let prefilling = |requests| blocks(requests, engine.sizes.uncached_blocks);
    let (active, queued) = match engine.role {
        Role::Prefill => {
            let requests = match (report.running, report.waiting) {
                (None, None) => None,
                (running, waiting) => Some(running.unwrap_or(0).saturating_add(waiting.unwrap_or(0))),
            };
            (report.active_decode_blocks, report.queued_prefill_blocks.or_else(|| prefilling(requests)))
        }
        Role::Decode | Role::Both => {
            let active = report.active_decode_blocks.or_else(|| match (report.kv_usage, engine.capacity_blocks) {
                (Some(usage), Some(capacity)) if usage.is_finite() => {
                    Some((usage.clamp(0.0, 1.0) * capacity as f64) as u64)
                }
                _ => decoding(report.running),
            });
            (active, report.queued_prefill_blocks.or_else(|| prefilling(report.waiting)))
        }
    };
    if active.is_none() && queued.is_none() {
        return None;
    }
    Some(Load {
        active_decode_blocks: active.unwrap_or(0).min(MAX_REPORTED_BLOCKS),
        queued_prefill_blocks: queued.unwrap_or(0).min(MAX_REPORTED_BLOCKS),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(role: Role) -> EngineFacts {
        EngineFacts {
            role,
            capacity_blocks: Some(1000),
            sizes: RequestSizes { prompt_blocks: 10.0, uncached_blocks: 10.0 },
        }
    }

    fn report(running: Option<u64>, waiting: Option<u64>, kv_usage: Option<f64>) -> LoadJson {
        LoadJson { running, waiting, kv_usage, ..LoadJson::default() }
    }

    #[test]
    fn a_prefill_engines_running_requests_are_queued_prefill_not_decode_load() {
        let load = reported_load(&report(Some(3), Some(2), Some(0.5)), facts(Role::Prefill)).expect("load");
        assert_eq!(load, Load { active_decode_blocks: 0, queued_prefill_blocks: 50 });
        let load = reported_load(&report(Some(4), None, None), facts(Role::Prefill)).expect("load");
        assert_eq!(load.queued_prefill_blocks, 40);
    }

    #[test]
    fn a_decode_engines_running_requests_and_kv_usage_are_decode_load() {
        let load = reported_load(&report(Some(3), Some(2), Some(0.5)), facts(Role::Decode)).expect("load");
        assert_eq!(load, Load { active_decode_blocks: 500, queued_prefill_blocks: 20 });
        let load = reported_load(&report(Some(3), None, None), facts(Role::Both)).expect("load");
        assert_eq!(load, Load { active_decode_blocks: 30, queued_prefill_blocks: 0 });
        let nan = reported_load(&report(Some(1), None, Some(f64::NAN)), facts(Role::Decode)).expect("load");
        assert_eq!(nan.active_decode_blocks, 10, "a NaN usage falls back to the request count");
    }

    #[test]
    fn waiting_requests_count_the_average_uncached_part() {
        let mut sizes = RequestSizes::default();
        for _ in 0..200 {
            sizes.observe(68, 4); // cache hits: 4 of 68 blocks computed
        }
        assert!((sizes.prompt_blocks - 68.0).abs() < 0.1 && (sizes.uncached_blocks - 4.0).abs() < 0.1, "{sizes:?}");
        let facts = EngineFacts { role: Role::Both, capacity_blocks: None, sizes };
        let load = reported_load(&report(Some(2), Some(3), None), facts).expect("load");
        assert_eq!(load, Load { active_decode_blocks: 135, queued_prefill_blocks: 12 });
        let prefill = reported_load(&report(Some(2), Some(3), None), EngineFacts { role: Role::Prefill, ..facts });
        assert_eq!(prefill.map(|l| l.queued_prefill_blocks), Some(20));
        sizes.observe(10, 50);
        assert!(sizes.uncached_blocks <= sizes.prompt_blocks, "uncached is capped by the prompt");
    }

    #[test]
    fn explicit_block_figures_win_and_are_clamped() {
        let explicit = LoadJson {
            running: Some(100),
            waiting: Some(100),
            active_decode_blocks: Some(7),
            queued_prefill_blocks: Some(u64::MAX),
            ..LoadJson::default()
        };
        for role in [Role::Prefill, Role::Decode, Role::Both] {
            let load = reported_load(&explicit, facts(role)).expect("load");
            assert_eq!(load, Load { active_decode_blocks: 7, queued_prefill_blocks: MAX_REPORTED_BLOCKS });
        }
    }

    #[test]
    fn a_report_without_figures_changes_nothing() {
        for role in [Role::Prefill, Role::Decode, Role::Both] {
            assert_eq!(reported_load(&LoadJson::default(), facts(role)), None);
        }
        let saturated = reported_load(&report(Some(u64::MAX), Some(u64::MAX), None), facts(Role::Prefill));
        assert_eq!(saturated.map(|l| l.queued_prefill_blocks), Some(MAX_REPORTED_BLOCKS));
    }
}
