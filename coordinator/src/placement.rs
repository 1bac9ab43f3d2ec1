//! Where a request's prompt is computed: on its decode engine, or on a prefill engine whose KV
//! the decode then pulls. Decided from times the coordinator observes itself, with no flags:
//!
//! - prefill leg: from the pairing to the sidecar's `prefill_done`, against the tokens the
//!   prefill engine computed;
//! - handoff: from `prefill_done` to `decode_started` (the decode's first output), against the
//!   tokens the decode pulled;
//! - local prefill: from the pairing to `decode_started`, against the tokens the decode computed.
//!
//! Each is a line `ms = overhead + per_token × tokens` fitted to recent observations. A prompt
//! computed on an engine also stalls that engine's running decodes for its compute time (a
//! prefill shares their batches), so each option costs its time to first token plus, per decode
//! running where the prompt is computed, the prefill's compute time:
//!
//! - local: `local(u_d) + running_d × per_token × u_d`;
//! - disaggregated to `p`: `prefill(u_p) + handoff(u_d) + running_p × per_token × u_p`.
//!
//! The decode keeps the prompt when local costs no more (affinity first); it is disaggregated
//! only where the interference avoided outweighs the transfer, and where the better engine can
//! decode as well, the request moves there whole instead (the caller's part: `cluster.rs`). Until every line has a few
//! observations of its own, the fixed [`LocalPrefillPolicy`] decides (it disaggregates long
//! uncached prompts, so both kinds get observed); an operator's explicit thresholds always
//! decide.

use std::time::Duration;

use crate::pairing::LocalPrefillPolicy;

/// Observations a line needs before it decides.
pub const WARM_SAMPLES: u64 = 4;
/// Each observation weighs this much less than the next one (about the last 20 count).
const FORGET: f64 = 0.95;
/// Weight of the prior line, never forgotten: it keeps the slope defined when every recent
/// observation had the same length.
const PRIOR_WEIGHT: f64 = 0.05;

/// `ms = overhead + per_token × tokens`, least squares over exponentially weighted observations
/// plus a fixed prior.
#[derive(Clone, Debug, PartialEq)]
pub struct TimeFit {
    /// Weighted sums of 1, x, y, x², xy (x tokens, y ms).
    sums: [f64; 5],
    prior: [f64; 5],
    samples: u64,
}

impl TimeFit {
    /// A prior line, as two points at 0 and 1000 tokens.
    pub fn new(overhead_ms: f64, per_token_ms: f64) -> TimeFit {
        let mut prior = [0.0; 5];
        for x in [0.0, 1000.0] {
            add(&mut prior, x, overhead_ms + per_token_ms * x, PRIOR_WEIGHT);
        }
        TimeFit { sums: [0.0; 5], prior, samples: 0 }
    }

    pub fn observe(&mut self, tokens: u64, took: Duration) {
        let (x, y) = (tokens as f64, took.as_secs_f64() * 1e3);
        if !(x.is_finite() && y.is_finite()) {
            return;
        }
        for s in &mut self.sums {
            *s *= FORGET;
        }
        add(&mut self.sums, x, y, 1.0);
        self.samples += 1;
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// (overhead ms, ms per token), both non-negative.
    pub fn line(&self) -> (f64, f64) {
        let s: Vec<f64> = self.sums.iter().zip(&self.prior).map(|(a, b)| a + b).collect();
        let (w, sx, sy, sxx, sxy) = (s[0], s[1], s[2], s[3], s[4]);
        let det = w * sxx - sx * sx;
        let slope = if det > 1e-9 { ((w * sxy - sx * sy) / det).max(0.0) } else { 0.0 };
        let overhead = ((sy - slope * sx) / w).max(0.0);
        if overhead.is_finite() && slope.is_finite() {
            (overhead, slope)
        } else {
            (0.0, 0.0)
        }
    }

    pub fn predict_ms(&self, tokens: u64) -> f64 {
        let (overhead, slope) = self.line();
        overhead + slope * tokens as f64
    }
}

fn add(sums: &mut [f64; 5], x: f64, y: f64, w: f64) {
    for (s, v) in sums.iter_mut().zip([1.0, x, y, x * x, x * y]) {
        *s += w * v;
    }
}

/// What the coordinator has seen of its engines' times.
#[derive(Clone, Debug, PartialEq)]
pub struct Timings {
    pub prefill: TimeFit,
    pub handoff: TimeFit,
    pub local: TimeFit,
}

/// Priors: a few ms per leg; 0.1 ms per prefill token (a mid-size model on one GPU), 0.01 ms per
/// pulled token. Observations replace them within a few requests.
impl Default for Timings {
    fn default() -> Self {
        Timings { prefill: TimeFit::new(2.0, 0.1), handoff: TimeFit::new(2.0, 0.01), local: TimeFit::new(2.0, 0.1) }
    }
}

/// An observation, from the handoffs' timestamps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sample {
    Prefill { tokens: u64, took: Duration },
    Handoff { tokens: u64, took: Duration },
    Local { tokens: u64, took: Duration },
}

/// One engine the prompt could be computed on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Site {
    /// Prompt tokens it does not hold.
    pub uncached_tokens: u64,
    /// Requests decoding on it now.
    pub running: u64,
}

impl Timings {
    pub fn observe(&mut self, sample: Sample) {
        match sample {
            Sample::Prefill { tokens, took } => self.prefill.observe(tokens, took),
            Sample::Handoff { tokens, took } => self.handoff.observe(tokens, took),
            Sample::Local { tokens, took } => self.local.observe(tokens, took),
        }
    }

    pub fn warm(&self) -> bool {
        [&self.prefill, &self.handoff, &self.local].iter().all(|f| f.samples() >= WARM_SAMPLES)
    }

    /// What computing `tokens` on an engine costs each decode running there.
    fn stall_ms(&self, tokens: u64) -> f64 {
        self.prefill.line().1 * tokens as f64
    }

    pub fn local_cost_ms(&self, decode: Site) -> f64 {
        self.local.predict_ms(decode.uncached_tokens) + decode.running as f64 * self.stall_ms(decode.uncached_tokens)
    }

    pub fn disaggregated_cost_ms(&self, decode: Site, prefill: Site) -> f64 {
        self.prefill.predict_ms(prefill.uncached_tokens)
            + self.handoff.predict_ms(decode.uncached_tokens)
            + prefill.running as f64 * self.stall_ms(prefill.uncached_tokens)
    }
}

/// How the decision is made: learned, or thresholds an operator fixed.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// Learned from observed times; `cold` decides until they are warm.
    Adaptive {
        cold: LocalPrefillPolicy,
    },
    Fixed(LocalPrefillPolicy),
}

impl Default for Placement {
    fn default() -> Self {
        Placement::Adaptive { cold: LocalPrefillPolicy::default() }
    }
}

/// The verdict for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Local,
    /// Computed on `prefills[i]`.
    Disaggregate(usize),
}

impl Verdict {
    /// The prefill engine it names among `prefills`.
    pub fn and_then_prefill<T: Copy>(self, prefills: &[T]) -> Option<T> {
        match self {
            Verdict::Local => None,
            Verdict::Disaggregate(i) => prefills.get(i).copied(),
        }
    }
}

impl Placement {
    /// Local or one of `prefills` (already ordered best first by affinity and load: the first is
    /// the fixed policy's choice). `prompt_tokens` is the whole prompt.
    pub fn decide(&self, timings: &Timings, prompt_tokens: u64, decode: Site, prefills: &[Site]) -> Verdict {
        let fixed = |policy: &LocalPrefillPolicy| {
            let cached = prompt_tokens.saturating_sub(decode.uncached_tokens);
            if policy.prefill_locally(prompt_tokens, cached) || prefills.is_empty() {
                Verdict::Local
            } else {
                Verdict::Disaggregate(0)
            }
        };
        match self {
            Placement::Fixed(policy) => fixed(policy),
            Placement::Adaptive { cold } if !timings.warm() => fixed(cold),
            Placement::Adaptive { .. } => {
                let local = timings.local_cost_ms(decode);
                let best = prefills
                    .iter()
                    .map(|&p| timings.disaggregated_cost_ms(decode, p))
                    .enumerate()
                    .min_by(|a, b| a.1.total_cmp(&b.1));
                match best {
                    Some((i, cost)) if cost < local => Verdict::Disaggregate(i),
                    _ => Verdict::Local,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Timings of an engine computing 0.1 ms per token, pulls of 0.01 ms per token, 3 ms a leg.
    fn warm() -> Timings {
        let mut t =
            Timings { prefill: TimeFit::new(0.0, 0.0), handoff: TimeFit::new(0.0, 0.0), local: TimeFit::new(0.0, 0.0) };
        for tokens in [100, 500, 1000, 2000, 64, 1088] {
            t.observe(Sample::Prefill { tokens, took: Duration::from_micros(3000 + 100 * tokens) });
            t.observe(Sample::Handoff { tokens, took: Duration::from_micros(3000 + 10 * tokens) });
            t.observe(Sample::Local { tokens, took: Duration::from_micros(3000 + 100 * tokens) });
        }
        t
    }

    #[test]
    fn the_fit_finds_the_line_and_forgets_the_old_one() {
        let mut f = TimeFit::new(2.0, 0.1);
        assert_eq!(f.samples(), 0);
        let (o, s) = f.line();
        assert!((o - 2.0).abs() < 1e-9 && (s - 0.1).abs() < 1e-9, "the prior alone: {o} {s}");
        for i in 0..200u64 {
            let tokens = 100 + (i * 37) % 1000;
            f.observe(tokens, Duration::from_micros(5000 + 50 * tokens));
        }
        let (o, s) = f.line();
        assert!((o - 5.0).abs() < 0.5 && (s - 0.05).abs() < 0.003, "{o} {s}");
        // All recent observations the same length: still a line, between prior and data.
        for _ in 0..200 {
            f.observe(1000, ms(20));
        }
        assert!((f.predict_ms(1000) - 20.0).abs() < 1.0, "{}", f.predict_ms(1000));
        assert!(f.predict_ms(0) >= 0.0 && f.line().1 >= 0.0);
        // Garbage never makes NaN.
        f.observe(u64::MAX, Duration::MAX);
        assert!(f.predict_ms(10).is_finite());
    }

    #[test]
    fn affinity_first_when_the_decode_is_idle() {
        let t = warm();
        let p = Placement::default();
        // Nothing cached anywhere, nobody decoding: a pull only adds its time.
        let d = Site { uncached_tokens: 1088, running: 0 };
        let idle_prefill = Site { uncached_tokens: 1088, running: 0 };
        assert_eq!(p.decide(&t, 1088, d, &[idle_prefill]), Verdict::Local);
        // The decode holds the prefix and the prefill does not: local, even under some load.
        let hit = Site { uncached_tokens: 64, running: 3 };
        assert_eq!(p.decide(&t, 1088, hit, &[idle_prefill]), Verdict::Local);
    }

    #[test]
    fn disaggregate_where_the_interference_avoided_outweighs_the_transfer() {
        let t = warm();
        let p = Placement::default();
        // 4 decodes running would each lose 108.8 ms to a local 1088-token prefill; the pull
        // costs 3 + 10.9 ms.
        let busy = Site { uncached_tokens: 1088, running: 4 };
        let dedicated = Site { uncached_tokens: 1088, running: 0 };
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated]), Verdict::Disaggregate(0));
        // A prefill engine that holds the prefix is the better of two.
        let holder = Site { uncached_tokens: 64, running: 0 };
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated, holder]), Verdict::Disaggregate(1));
        // Colocated: the other engine is as busy, so the stall only moves; stay.
        let as_busy = Site { uncached_tokens: 1088, running: 4 };
        assert_eq!(p.decide(&t, 1088, busy, &[as_busy]), Verdict::Local);
        // A slow network makes the pull dearer than the stall it avoids.
        let mut slow = warm();
        for _ in 0..50 {
            slow.observe(Sample::Handoff { tokens: 1088, took: ms(2000) });
        }
        assert_eq!(p.decide(&slow, 1088, busy, &[dedicated]), Verdict::Local);
        assert_eq!(p.decide(&t, 1088, busy, &[]), Verdict::Local, "no prefill engine");
    }

    #[test]
    fn cold_or_fixed_the_thresholds_decide() {
        let cold = Timings::default();
        assert!(!cold.warm() && warm().warm());
        let p = Placement::default();
        let idle = Site { uncached_tokens: 1088, running: 0 };
        // Cold: everything uncached is disaggregated (ratio 1.0 ≥ 0.7), as the fixed policy says.
        assert_eq!(p.decide(&cold, 1088, idle, &[idle]), Verdict::Disaggregate(0));
        assert_eq!(p.decide(&cold, 1088, Site { uncached_tokens: 64, running: 0 }, &[idle]), Verdict::Local);
        let fixed = Placement::Fixed(LocalPrefillPolicy { max_uncached_tokens: 100, max_uncached_ratio: 1.0 });
        assert_eq!(fixed.decide(&warm(), 1088, idle, &[idle]), Verdict::Disaggregate(0), "warm, but fixed");
        assert_eq!(fixed.decide(&warm(), 1088, Site { uncached_tokens: 64, running: 9 }, &[idle]), Verdict::Local);
    }
}
