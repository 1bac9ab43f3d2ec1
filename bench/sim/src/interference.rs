//! Prefill/decode interference: a prefill computed on an engine slows that engine's running
//! decodes, as a prompt's chunks share a batch with them under chunked prefill.
//!
//! The law: a decode step that starts at `now`, after the step that started at `since`, takes
//!
//! `decode_us + factor × prefill_us_per_token × min(P(since, now), budget)`
//!
//! where `P(since, now)` is the prefill tokens the engine computed between the two steps (each
//! prefill's tokens spread evenly over its run) and `budget` the tokens one step may carry
//! (`--step-token-budget`, vLLM's `max_num_batched_tokens`). With factor 1 a decode running beside
//! a prefill loses that prefill's whole compute time, in steps of at most a budget's worth;
//! factor 0 turns the law off. Prefill itself is not slowed by decodes (a decode token costs
//! what `--decode-us-per-token` says, prefill tokens dominate a mixed step).
//!
//! With `--prefill-queue fifo` prompts are computed one at a time in arrival order
//! ([`PrefillQueue`]), so each runs over its own slot of the engine's time and the log's spans
//! do not overlap.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Prefills older than this cannot fall in any decode step still to come (a step waits at
/// most a budget's worth of prefill), so they are dropped.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// The log's bound, whatever the clock says.
const MAX_SPANS: usize = 65_536;

/// The law's parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Law {
    pub decode_us: f64,
    pub prefill_us_per_token: f64,
    /// Share of a prefill token's time a decode step in the same batch pays (0 = no interference).
    pub factor: f64,
    /// Prefill tokens one step carries at most.
    pub budget_tokens: u64,
}

impl Law {
    /// One decode step's time given the prefill tokens computed since the previous step.
    pub fn step_us(&self, prefill_tokens: f64) -> f64 {
        // NaN or negative counts as none.
        let scheduled = if prefill_tokens > 0.0 { prefill_tokens.min(self.budget_tokens as f64) } else { 0.0 };
        self.decode_us + self.factor * self.prefill_us_per_token * scheduled
    }
}

/// One prefill's run on the engine.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Span {
    start: Instant,
    end: Instant,
    tokens: u64,
}

/// The prefills an engine ran recently: what decode steps are charged with.
#[derive(Debug, Default)]
pub struct PrefillLog {
    spans: VecDeque<Span>,
}

impl PrefillLog {
    /// A prefill of `tokens` runs over `[start, start + took)`; older entries are forgotten.
    pub fn record(&mut self, start: Instant, took: Duration, tokens: u64) {
        if tokens == 0 {
            return;
        }
        while self.spans.front().is_some_and(|s| s.end + FORGET_AFTER < start) || self.spans.len() >= MAX_SPANS {
            self.spans.pop_front();
        }
        self.spans.push_back(Span { start, end: start + took, tokens });
    }

    /// Prefill tokens computed within `[from, to)`: each prefill's share of the window (all of
    /// it for an instantaneous one that started inside).
    pub fn tokens_between(&self, from: Instant, to: Instant) -> f64 {
        if to <= from {
            return 0.0;
        }
        self.spans
            .iter()
            .map(|s| {
                if s.end <= s.start {
                    return if (from..to).contains(&s.start) { s.tokens as f64 } else { 0.0 };
                }
                let overlap = s.end.min(to).saturating_duration_since(s.start.max(from));
                s.tokens as f64 * overlap.as_secs_f64() / (s.end - s.start).as_secs_f64()
            })
            .sum()
    }

    pub fn len(&self) -> usize {
        self.spans.len()
    }

    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }
}

/// An engine computing one prompt at a time, in arrival order: when each prompt runs.
#[derive(Debug, Default)]
pub struct PrefillQueue {
    /// When the last prompt admitted is done.
    busy_until: Option<Instant>,
}

impl PrefillQueue {
    /// Admits a prompt taking `took` at `now`: it runs over the returned `(start, end)`, after
    /// every prompt admitted before it.
    pub fn admit(&mut self, now: Instant, took: Duration) -> (Instant, Instant) {
        let start = self.busy_until.map_or(now, |busy| busy.max(now));
        let end = start + took;
        self.busy_until = Some(end);
        (start, end)
    }

    /// The prompt admitted over `(start, end)` was abandoned at `now` (its client left). When it
    /// is the last one queued, the engine's time after `now` (or after its start, if it had not
    /// started) is free again. One with prompts queued behind it keeps its slot: they were given
    /// their times already, so its time is lost, as if the engine had computed it anyway.
    pub fn withdraw(&mut self, (start, end): (Instant, Instant), now: Instant) {
        if self.busy_until == Some(end) {
            self.busy_until = Some(start.max(now).min(end));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAW: Law = Law { decode_us: 1000.0, prefill_us_per_token: 100.0, factor: 1.0, budget_tokens: 512 };

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_step_pays_the_prefill_tokens_scheduled_with_it_up_to_the_budget() {
        assert_eq!(LAW.step_us(0.0), 1000.0);
        assert_eq!(LAW.step_us(10.0), 2000.0, "10 tokens × 100 µs");
        assert_eq!(LAW.step_us(5000.0), 1000.0 + 512.0 * 100.0, "capped by the budget");
        assert_eq!(Law { factor: 0.0, ..LAW }.step_us(5000.0), 1000.0, "factor 0: no interference");
        assert_eq!(Law { factor: 0.5, ..LAW }.step_us(10.0), 1500.0);
        assert_eq!(LAW.step_us(-3.0), 1000.0);
        assert_eq!(LAW.step_us(f64::NAN), 1000.0);
    }

    #[test]
    fn tokens_are_spread_over_the_prefills_run() {
        let t0 = Instant::now();
        let mut log = PrefillLog::default();
        // 1000 tokens over 100 ms, 200 tokens over [50, 70) ms.
        log.record(t0, ms(100), 1000);
        log.record(t0 + ms(50), ms(20), 200);
        assert!((log.tokens_between(t0, t0 + ms(10)) - 100.0).abs() < 1e-6);
        assert!((log.tokens_between(t0 + ms(40), t0 + ms(60)) - 300.0).abs() < 1e-6, "200 + half of 200");
        assert!((log.tokens_between(t0, t0 + ms(1000)) - 1200.0).abs() < 1e-6, "all of both");
        assert_eq!(log.tokens_between(t0 + ms(100), t0 + ms(200)), 0.0, "after both ended");
        assert_eq!(log.tokens_between(t0 + ms(60), t0 + ms(60)), 0.0, "empty window");
        assert_eq!(log.tokens_between(t0 + ms(60), t0), 0.0, "reversed window");
        // A decode beside the long prefill loses its whole compute time, step by step.
        let (mut since, mut now, mut lost_us) = (t0, t0 + ms(1), 0.0);
        while since < t0 + ms(100) {
            let step = LAW.step_us(log.tokens_between(since, now));
            lost_us += step - LAW.decode_us;
            (since, now) = (now, now + Duration::from_micros(step as u64));
        }
        assert!((lost_us - 120_000.0).abs() < 2_000.0, "{lost_us} µs: 1200 tokens × 100 µs");
    }

    #[test]
    fn queued_prompts_run_one_after_another_and_a_withdrawn_last_one_frees_its_time() {
        let t0 = Instant::now();
        let mut queue = PrefillQueue::default();
        assert_eq!(queue.admit(t0, ms(10)), (t0, t0 + ms(10)), "an idle engine starts at once");
        assert_eq!(queue.admit(t0 + ms(2), ms(5)), (t0 + ms(10), t0 + ms(15)), "after the first");
        let third = queue.admit(t0 + ms(3), ms(20));
        assert_eq!(third, (t0 + ms(15), t0 + ms(35)));
        // The third leaves before it started: the engine is free from the second's end.
        queue.withdraw(third, t0 + ms(4));
        assert_eq!(queue.admit(t0 + ms(5), ms(1)), (t0 + ms(15), t0 + ms(16)));
        // Withdrawn midway, the last one frees the rest of its time.
        let fifth = queue.admit(t0 + ms(6), ms(10));
        queue.withdraw(fifth, t0 + ms(20));
        assert_eq!(queue.admit(t0 + ms(20), ms(1)).0, t0 + ms(20));
        // One with others behind it keeps its slot.
        let (a, b) = (queue.admit(t0 + ms(30), ms(10)), queue.admit(t0 + ms(30), ms(10)));
        queue.withdraw(a, t0 + ms(30));
        assert_eq!(queue.admit(t0 + ms(30), ms(1)).0, b.1);
        // An idle engine starts a prompt when it arrives, not when the last one ended.
        assert_eq!(queue.admit(t0 + ms(500), ms(1)).0, t0 + ms(500));
    }

    #[test]
    fn instantaneous_prefills_count_once_and_old_ones_are_forgotten() {
        let t0 = Instant::now();
        let mut log = PrefillLog::default();
        log.record(t0 + ms(5), Duration::ZERO, 64);
        log.record(t0, ms(1), 0);
        assert_eq!(log.len(), 1, "nothing computed: nothing logged");
        assert_eq!(log.tokens_between(t0, t0 + ms(10)), 64.0);
        assert_eq!(log.tokens_between(t0 + ms(6), t0 + ms(10)), 0.0);
        log.record(t0 + FORGET_AFTER + ms(10), ms(1), 8);
        assert_eq!(log.len(), 1, "the first one ended over a minute before");
        assert!(!log.is_empty());
    }
}
