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
//! computed on an engine also stalls that engine's decodes for its compute time (a prefill
//! shares their batches), so each option costs its time to first token plus, per decode exposed
//! where the prompt is computed, the prefill's compute time `stall = per_token × u`:
//!
//! - local: `local(u_d) + exposed_d × stall(u_d)`;
//! - disaggregated to `p`: `prefill(u_p) + handoff(u_d) + exposed_p × stall(u_p)`;
//! - moved whole to `e`, an engine that can decode too: `handoff(0) + local(u_e) + exposed_e ×
//!   stall(u_e)` (a hop, then a local prefill there; no pull, the blocks in one cache).
//!
//! The decodes exposed are those bound to the engine now (decoding, or prefilling elsewhere to
//! pull and decode there: a short prefill ends within the compute) plus those routed to it
//! during the compute, `rate × stall` at the rate requests reached it lately: an idle decode
//! that takes a long prompt is not idle for long, and every request that starts decoding beside
//! the prompt loses what is left of it. Counting every bound request errs towards the running
//! decodes: a stall lands in their token gaps (the ITL tail), a transfer only in one request's
//! time to first token.
//!
//! The decode keeps the prompt when local costs no more (affinity first); it is disaggregated
//! only where the interference avoided outweighs the transfer. Until the lines the options need
//! have a few observations of their own (all three with a prefill-only engine among them, the
//! local line alone where every other engine can decode: nothing is disaggregated there, so the
//! other two never warm), the fixed [`LocalPrefillPolicy`] decides (it disaggregates long
//! uncached prompts, so both kinds get observed), except that a prompt it keeps local goes to a
//! prefill-only engine holding as much of it when decodes are bound to the decode; an
//! operator's explicit thresholds always decide.

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
    /// Requests bound to decode on it now: decoding, or computing their prompt (there or
    /// elsewhere) to decode there.
    pub bound: u64,
    /// Requests per ms routed to decode on it lately.
    pub arrivals_per_ms: f64,
    /// It can decode as well: the request would move there whole (no pull), so it costs what
    /// a local prefill there costs, plus a hop.
    pub decodes: bool,
}

impl Site {
    /// Decodes that computing `stall_ms` of prompt here would stall: those bound now and those
    /// arriving meanwhile. Never NaN.
    fn exposed(&self, stall_ms: f64) -> f64 {
        let arriving = self.arrivals_per_ms * stall_ms;
        self.bound as f64 + if arriving.is_finite() && arriving > 0.0 { arriving } else { 0.0 }
    }
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

    /// The stall of computing `site`'s uncached part there, summed over the decodes exposed.
    fn interference_ms(&self, site: Site) -> f64 {
        let stall = self.stall_ms(site.uncached_tokens);
        site.exposed(stall) * stall
    }

    pub fn local_cost_ms(&self, decode: Site) -> f64 {
        self.local.predict_ms(decode.uncached_tokens) + self.interference_ms(decode)
    }

    /// The cost of computing the prompt on `other`: moved there whole when it can decode (the
    /// hop costs about a handoff's fixed part), else disaggregated.
    pub fn elsewhere_cost_ms(&self, decode: Site, other: Site) -> f64 {
        if other.decodes {
            self.handoff.predict_ms(0) + self.local_cost_ms(other)
        } else {
            self.disaggregated_cost_ms(decode, other)
        }
    }

    pub fn disaggregated_cost_ms(&self, decode: Site, prefill: Site) -> f64 {
        self.prefill.predict_ms(prefill.uncached_tokens)
            + self.handoff.predict_ms(decode.uncached_tokens)
            + self.interference_ms(prefill)
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
        // Cold, a prompt the rule keeps local is still not computed beside decodes bound there
        // when a prefill-only engine holds as much of it: the same compute there stalls nobody.
        let cold = |policy: &LocalPrefillPolicy| match fixed(policy) {
            Verdict::Local if decode.bound > 0 => prefills
                .iter()
                .position(|p| !p.decodes && p.uncached_tokens <= decode.uncached_tokens)
                .map_or(Verdict::Local, Verdict::Disaggregate),
            verdict => verdict,
        };
        // Engines that can decode are weighed by the local line alone: where every engine can,
        // nothing is ever disaggregated and the prefill and handoff lines never warm.
        let warm =
            if prefills.iter().all(|p| p.decodes) { timings.local.samples() >= WARM_SAMPLES } else { timings.warm() };
        match self {
            Placement::Fixed(policy) => fixed(policy),
            Placement::Adaptive { cold: policy } if !warm => cold(policy),
            Placement::Adaptive { .. } => {
                let local = timings.local_cost_ms(decode);
                let best = prefills
                    .iter()
                    .map(|&p| timings.elsewhere_cost_ms(decode, p))
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

    /// A prefill-only site with `bound` decodes and no arrivals.
    fn site(uncached_tokens: u64, bound: u64) -> Site {
        Site { uncached_tokens, bound, arrivals_per_ms: 0.0, decodes: false }
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
        let d = site(1088, 0);
        let idle_prefill = site(1088, 0);
        assert_eq!(p.decide(&t, 1088, d, &[idle_prefill]), Verdict::Local);
        // The decode holds the prefix and the prefill does not: local, even under some load.
        let hit = site(64, 3);
        assert_eq!(p.decide(&t, 1088, hit, &[idle_prefill]), Verdict::Local);
    }

    #[test]
    fn disaggregate_where_the_interference_avoided_outweighs_the_transfer() {
        let t = warm();
        let p = Placement::default();
        // 4 decodes running would each lose 108.8 ms to a local 1088-token prefill; the pull
        // costs 3 + 10.9 ms.
        let busy = site(1088, 4);
        let dedicated = site(1088, 0);
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated]), Verdict::Disaggregate(0));
        // A prefill engine that holds the prefix is the better of two.
        let holder = site(64, 0);
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated, holder]), Verdict::Disaggregate(1));
        // Colocated: the other engine is as busy, so the stall only moves; stay.
        let as_busy = site(1088, 4);
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
    fn an_idle_decode_that_requests_keep_reaching_is_not_idle_for_long() {
        let t = warm();
        let p = Placement::default();
        let dedicated = site(1088, 0);
        // Nothing bound, but one request every 20 ms: about 5 start decoding during a
        // 108.8 ms prefill and each loses what is left of it.
        let reached = Site { arrivals_per_ms: 0.05, ..site(1088, 0) };
        assert_eq!(p.decide(&t, 1088, reached, &[dedicated]), Verdict::Disaggregate(0));
        // Quiet: the pull only adds its time.
        let quiet = Site { arrivals_per_ms: 0.001, ..reached };
        assert_eq!(p.decide(&t, 1088, quiet, &[dedicated]), Verdict::Local);
        // A short uncached part stalls too briefly for arrivals to matter.
        let hit = Site { uncached_tokens: 64, ..reached };
        assert_eq!(p.decide(&t, 1088, hit, &[dedicated]), Verdict::Local);
        // Odd rates never make the cost NaN.
        for rate in [f64::NAN, f64::INFINITY, -1.0] {
            let odd = Site { arrivals_per_ms: rate, ..reached };
            assert!(t.local_cost_ms(odd).is_finite(), "{rate}");
        }
    }

    #[test]
    fn colocated_the_request_moves_whole_to_the_least_exposed_engine() {
        // Only the local line observed, as where every engine prefills what it decodes.
        let mut t = Timings::default();
        for tokens in [100, 500, 1000, 2000] {
            t.observe(Sample::Local { tokens, took: Duration::from_micros(3000 + 100 * tokens) });
        }
        assert!(!t.warm(), "prefill and handoff never observed");
        let p = Placement::default();
        let both = |uncached_tokens, bound| Site { decodes: true, ..site(uncached_tokens, bound) };
        // A fresh prompt on an engine with 3 decodes goes to the one with 1.
        assert_eq!(p.decide(&t, 1088, both(1088, 3), &[both(1088, 2), both(1088, 1)]), Verdict::Disaggregate(1));
        // As exposed everywhere: stay (the hop buys nothing).
        assert_eq!(p.decide(&t, 1088, both(1088, 1), &[both(1088, 1)]), Verdict::Local);
        // A hit stays where its prompt is, though another engine is idle.
        assert_eq!(p.decide(&t, 1088, both(64, 3), &[both(1088, 0)]), Verdict::Local);
        // The same timings with a prefill-only engine among the candidates: cold, the fixed rule.
        assert_eq!(p.decide(&t, 1088, both(1088, 3), &[site(1088, 0)]), Verdict::Disaggregate(0));
        assert_eq!(p.decide(&t, 1088, both(1088, 0), &[site(1088, 3)]), Verdict::Disaggregate(0));
    }

    #[test]
    fn cold_or_fixed_the_thresholds_decide() {
        let cold = Timings::default();
        assert!(!cold.warm() && warm().warm());
        let p = Placement::default();
        let idle = site(1088, 0);
        // Cold: everything uncached is disaggregated (ratio 1.0 ≥ 0.7), as the fixed policy says.
        assert_eq!(p.decide(&cold, 1088, idle, &[idle]), Verdict::Disaggregate(0));
        assert_eq!(p.decide(&cold, 1088, site(64, 0), &[idle]), Verdict::Local);
        // Cold with decodes bound there: a prefill engine holding as much computes it instead.
        let holder = site(64, 0);
        assert_eq!(p.decide(&cold, 1088, site(64, 2), &[idle, holder]), Verdict::Disaggregate(1));
        assert_eq!(p.decide(&cold, 1088, site(64, 2), &[idle]), Verdict::Local, "only the decode holds it");
        let both = Site { decodes: true, ..holder };
        assert_eq!(
            p.decide(&cold, 1088, site(64, 2), &[both]),
            Verdict::Local,
            "an engine that can decode: the rule as it is"
        );
        let fixed = Placement::Fixed(LocalPrefillPolicy { max_uncached_tokens: 100, max_uncached_ratio: 1.0 });
        assert_eq!(fixed.decide(&warm(), 1088, idle, &[idle]), Verdict::Disaggregate(0), "warm, but fixed");
        assert_eq!(fixed.decide(&warm(), 1088, site(64, 9), &[idle]), Verdict::Local);
        assert_eq!(fixed.decide(&cold, 1088, site(64, 9), &[holder]), Verdict::Local, "an operator's rule is kept");
    }
}
