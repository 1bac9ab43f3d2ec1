//! Where a request's prompt is computed: on its decode engine, or on a prefill engine whose KV
//! the decode then pulls. Decided from times the coordinator observes itself, with no flags:
//!
//! - prefill leg: from the pairing to the sidecar's `prefill_done`, against the tokens the
//!   prefill engine computed;
//! - handoff: from `prefill_done` to `decode_started` (the decode's first output), against the
//!   tokens the decode pulled;
//! - local prefill: from the pairing to `decode_started`, against the tokens the decode computed.
//!
//! Each is a line `ms = overhead + per_token × tokens + per_queued × queued` fitted to recent
//! observations, `queued` being the ms of prompts routed to the same engine before it that were
//! still to be computed when it was routed (by their own predictions). An engine that computes
//! one prompt at a time, as one GPU does, makes a prompt wait for those (`per_queued` near 1);
//! one that computes them side by side does not (near 0, the prior). A prompt
//! computed on an engine also stalls that engine's decodes for its compute time (a prefill
//! shares their batches), so each option costs its time to first token `t` plus the stalls it
//! causes where the prompt is computed (`stalled`, of its compute time `stall = per_token × u`)
//! and the stall it suffers where it decodes (`rest`):
//!
//! - local: `t = local(u_d)`, `t + stalled_d(stall(u_d)) + rest_d(t)`;
//! - disaggregated to `p`: `t = prefill(u_p) + handoff(u_d)`, `t + stalled_p(stall(u_p)) +
//!   rest_d(t)`;
//! - moved whole to `e`, an engine that can decode too: `t = handoff(0) + local(u_e)`, `t +
//!   stalled_e(stall(u_e)) + rest_e(t)` (a hop, then a local prefill there; no pull, the blocks
//!   in one cache).
//!
//! `stalled` sums over the decodes the compute would stall: each decoding there now loses all of
//! it; each bound there that has not started (its prompt computed there or elsewhere) and is
//! predicted to start within the compute loses what is left of it, one predicted to start after
//! nothing; so does each routed to it during the compute, at the rate requests reached it lately,
//! spread evenly over the compute and starting at the soonest any request can (the lines' time to
//! first output of an empty prompt): `rate × (stall − soonest)² / 2` in all (an idle decode that
//! takes a long prompt is not idle for long). `rest(t)`
//! is what is left, `t` from now, of each prompt computed where the request decodes: it decodes
//! beside them. The predictions are the lines' own, made when each request was routed. Both err
//! towards the decodes: a stall lands in their token gaps (the ITL tail), a transfer only in one
//! request's time to first token.
//!
//! The decode keeps the prompt when local costs no more (affinity first); it is disaggregated
//! only where the interference avoided outweighs the transfer. Until the lines the options need
//! have a few observations of their own (all three with a prefill-only engine among them, the
//! local line alone where every other engine can decode: nothing is disaggregated there, so the
//! other two never warm), the fixed [`LocalPrefillPolicy`] decides (it disaggregates long
//! uncached prompts, so both kinds get observed), except that a prompt it keeps local goes to a
//! prefill-only engine holding as much of it when decodes are bound to the decode; an
//! operator's explicit thresholds always decide.

use std::time::{Duration, Instant};

use crate::pairing::LocalPrefillPolicy;

/// Observations a line needs before it decides.
pub const WARM_SAMPLES: u64 = 4;
/// Each observation weighs this much less than the next one (about the last 20 count).
const FORGET: f64 = 0.95;
/// Weight of the prior line, never forgotten: it keeps the slope defined when every recent
/// observation had the same length.
const PRIOR_WEIGHT: f64 = 0.05;

/// `ms = overhead + per_token × tokens + per_queued × queued_ms`, least squares over
/// exponentially weighted observations plus a fixed prior (`per_queued` 0: prompts do not wait
/// for each other until observations say so).
#[derive(Clone, Debug, PartialEq)]
pub struct TimeFit {
    /// Weighted sums of the products of (1, x, z, y) (x tokens, z queued ms, y ms):
    /// 11, 1x, 1z, 1y, xx, xz, xy, zz, zy.
    sums: [f64; 9],
    prior: [f64; 9],
    samples: u64,
}

/// A fitted [`TimeFit`], all three non-negative, `per_queued` at most 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Line {
    pub overhead: f64,
    pub per_token: f64,
    pub per_queued: f64,
}

impl TimeFit {
    /// A prior line, as points at 0 and 1000 tokens with nothing queued, and one with 10 ms
    /// queued that costs nothing (near enough to weigh little against observations of queues).
    pub fn new(overhead_ms: f64, per_token_ms: f64) -> TimeFit {
        let mut prior = [0.0; 9];
        for (x, z) in [(0.0, 0.0), (1000.0, 0.0), (0.0, 10.0)] {
            add(&mut prior, x, z, overhead_ms + per_token_ms * x, PRIOR_WEIGHT);
        }
        TimeFit { sums: [0.0; 9], prior, samples: 0 }
    }

    pub fn observe(&mut self, tokens: u64, queued_ms: f64, took: Duration) {
        let (x, z, y) = (tokens as f64, queued_ms, took.as_secs_f64() * 1e3);
        if !(x.is_finite() && z.is_finite() && z >= 0.0 && y.is_finite()) {
            return;
        }
        for s in &mut self.sums {
            *s *= FORGET;
        }
        add(&mut self.sums, x, z, y, 1.0);
        self.samples += 1;
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    pub fn line(&self) -> Line {
        let mut s = [0.0; 9];
        for ((t, a), b) in s.iter_mut().zip(&self.sums).zip(&self.prior) {
            *t = a + b;
        }
        let [w, sx, sz, sy, sxx, sxz, sxy, szz, szy] = s;
        // per_queued from the three normal equations (Cramer's rule), clamped to [0, 1]; then
        // overhead and per_token refitted with it fixed, per_token clamped at 0.
        let det3 = |m: [[f64; 3]; 3]| {
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
                + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        };
        let m = [[w, sx, sz], [sx, sxx, sxz], [sz, sxz, szz]];
        let det = det3(m);
        let free_per_queued =
            if det.abs() > 1e-9 { det3([[w, sx, sy], [sx, sxx, sxy], [sz, sxz, szy]]) / det } else { 0.0 };
        let per_queued = if free_per_queued.is_finite() { free_per_queued.clamp(0.0, 1.0) } else { 0.0 };
        // With per_queued fixed: y - per_queued × z against x.
        let (sy, sxy) = (sy - per_queued * sz, sxy - per_queued * sxz);
        let det2 = w * sxx - sx * sx;
        let per_token = if det2 > 1e-9 { ((w * sxy - sx * sy) / det2).max(0.0) } else { 0.0 };
        let overhead = ((sy - per_token * sx) / w).max(0.0);
        if [overhead, per_token, per_queued].iter().all(|v| v.is_finite()) {
            Line { overhead, per_token, per_queued }
        } else {
            Line { overhead: 0.0, per_token: 0.0, per_queued: 0.0 }
        }
    }

    pub fn predict_ms(&self, tokens: u64, queued_ms: f64) -> f64 {
        let line = self.line();
        let queued = if queued_ms.is_finite() { queued_ms.max(0.0) } else { 0.0 };
        line.overhead + line.per_token * tokens as f64 + line.per_queued * queued
    }
}

fn add(sums: &mut [f64; 9], x: f64, z: f64, y: f64, w: f64) {
    for (s, v) in sums.iter_mut().zip([1.0, x, z, y, x * x, x * z, x * y, z * z, z * y]) {
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

/// An observation, from the handoffs' timestamps; `queued_ms` is what was queued ahead of the
/// prompt where it was computed when it was routed ([`Site::queued_ms`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sample {
    Prefill { tokens: u64, queued_ms: f64, took: Duration },
    Handoff { tokens: u64, took: Duration },
    Local { tokens: u64, queued_ms: f64, took: Duration },
}

/// One engine the prompt could be computed on.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Site<'a> {
    /// Prompt tokens it does not hold.
    pub uncached_tokens: u64,
    /// Requests bound to decode on it now: decoding, or computing their prompt (there or
    /// elsewhere) to decode there.
    pub bound: u64,
    /// When those of them that have not started decoding are predicted to.
    pub starting: &'a [Instant],
    /// When the prompts computed on it now are predicted to be done.
    pub computing: &'a [Instant],
    /// Requests per ms routed to decode on it lately.
    pub arrivals_per_ms: f64,
    /// It can decode as well: the request would move there whole (no pull), so it costs what
    /// a local prefill there costs, plus a hop.
    pub decodes: bool,
}

/// Milliseconds from `now` until `at`, 0 when past.
fn ms_until(now: Instant, at: Instant) -> f64 {
    at.saturating_duration_since(now).as_secs_f64() * 1e3
}

/// The instant `ms` after `now` (a prediction; at most an hour ahead, never NaN).
pub fn ms_after(now: Instant, ms: f64) -> Instant {
    let ms = if ms.is_finite() { ms.clamp(0.0, 3_600_000.0) } else { 0.0 };
    now.checked_add(Duration::from_secs_f64(ms / 1e3)).unwrap_or(now)
}

impl Site<'_> {
    /// The ms of prompts computed here still to go (by their predictions): what a prompt routed
    /// here now waits for where the engine computes one at a time.
    pub fn queued_ms(&self, now: Instant) -> f64 {
        self.computing.iter().map(|&at| ms_until(now, at)).fold(0.0, f64::max)
    }

    /// The stall computing `stall_ms` of prompt here from `now` causes, summed over the decodes it
    /// reaches: all of it for each decoding now, what is left of it for each that starts
    /// meanwhile. Those are the requests bound here that have not started yet, and those routed
    /// here during the compute (at the recent rate, evenly spread), each starting `lead_ms` after
    /// it is routed at the soonest. Never NaN.
    fn stalled_ms(&self, stall_ms: f64, lead_ms: f64, now: Instant) -> f64 {
        let decoding = self.bound.saturating_sub(self.starting.len() as u64) as f64;
        let joining: f64 = self.starting.iter().map(|&at| (stall_ms - ms_until(now, at)).max(0.0)).sum();
        let exposed = (stall_ms - lead_ms).max(0.0);
        let arriving = self.arrivals_per_ms * exposed * exposed / 2.0;
        let arriving = if arriving.is_finite() && arriving > 0.0 { arriving } else { 0.0 };
        decoding * stall_ms + joining + arriving
    }

    /// What a request that starts decoding here `start_ms` from `now` loses to the prompts
    /// computed here: the rest of each.
    fn rest_ms(&self, start_ms: f64, now: Instant) -> f64 {
        self.computing.iter().map(|&at| (ms_until(now, at) - start_ms).max(0.0)).sum()
    }
}

impl Timings {
    pub fn observe(&mut self, sample: Sample) {
        match sample {
            Sample::Prefill { tokens, queued_ms, took } => self.prefill.observe(tokens, queued_ms, took),
            Sample::Handoff { tokens, took } => self.handoff.observe(tokens, 0.0, took),
            Sample::Local { tokens, queued_ms, took } => self.local.observe(tokens, queued_ms, took),
        }
    }

    pub fn warm(&self) -> bool {
        [&self.prefill, &self.handoff, &self.local].iter().all(|f| f.samples() >= WARM_SAMPLES)
    }

    /// What computing `tokens` on an engine costs each decode running there.
    fn stall_ms(&self, tokens: u64) -> f64 {
        self.prefill.line().per_token * tokens as f64
    }

    /// The soonest any request gets its first output, by the lines: an empty prompt, nothing
    /// queued, computed where it decodes or disaggregated.
    fn soonest_first_ms(&self) -> f64 {
        let local = self.local.predict_ms(0, 0.0);
        let disaggregated = self.prefill.predict_ms(0, 0.0) + self.handoff.predict_ms(0, 0.0);
        local.min(disaggregated)
    }

    /// The stall computing the prompt on `site` causes its decodes, summed over them.
    fn caused_ms(&self, site: Site, now: Instant) -> f64 {
        site.stalled_ms(self.stall_ms(site.uncached_tokens), self.soonest_first_ms(), now)
    }

    /// A request's time to first output `first_ms`, plus the stall its prompt computed on
    /// `computed_on` causes there and the stall it suffers decoding on `decode`.
    fn cost_ms(&self, first_ms: f64, computed_on: Site, decode: Site, now: Instant) -> f64 {
        first_ms + self.caused_ms(computed_on, now) + decode.rest_ms(first_ms, now)
    }

    pub fn local_cost_ms(&self, decode: Site, now: Instant) -> f64 {
        self.cost_ms(self.local.predict_ms(decode.uncached_tokens, decode.queued_ms(now)), decode, decode, now)
    }

    /// The cost of computing the prompt on `other`: moved there whole when it can decode (the
    /// hop costs about a handoff's fixed part), else disaggregated.
    pub fn elsewhere_cost_ms(&self, decode: Site, other: Site, now: Instant) -> f64 {
        if other.decodes {
            let first =
                self.handoff.predict_ms(0, 0.0) + self.local.predict_ms(other.uncached_tokens, other.queued_ms(now));
            self.cost_ms(first, other, other, now)
        } else {
            self.disaggregated_cost_ms(decode, other, now)
        }
    }

    pub fn disaggregated_cost_ms(&self, decode: Site, prefill: Site, now: Instant) -> f64 {
        let first = self.prefill.predict_ms(prefill.uncached_tokens, prefill.queued_ms(now))
            + self.handoff.predict_ms(decode.uncached_tokens, 0.0);
        self.cost_ms(first, prefill, decode, now)
    }

    /// When a routed request's prompt will be computed and its decode start, in ms from now,
    /// by the lines: `queued_ms` is what is queued where it is computed, `pulled_tokens` is
    /// `Some` when it is disaggregated.
    pub fn forecast_ms(&self, computed_tokens: u64, queued_ms: f64, pulled_tokens: Option<u64>) -> (f64, f64) {
        match pulled_tokens {
            Some(pulled) => {
                let computed = self.prefill.predict_ms(computed_tokens, queued_ms);
                (computed, computed + self.handoff.predict_ms(pulled, 0.0))
            }
            None => {
                let computed = self.local.predict_ms(computed_tokens, queued_ms);
                (computed, computed)
            }
        }
    }
}

/// How the decision is made: learned, or thresholds an operator fixed.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// Learned from observed times; `cold` decides until they are warm.
    Adaptive {
        cold: LocalPrefillPolicy,
        /// An operator's bound on the stall a prompt may cause the decodes where it is computed
        /// (ms, summed over them, as the fitted lines predict it): a prompt that would
        /// stall them more goes to a prefill-only engine, when there is one. `None`: the stall
        /// is only weighed against the time to first token.
        max_decode_stall_ms: Option<f64>,
    },
    Fixed(LocalPrefillPolicy),
}

impl Default for Placement {
    fn default() -> Self {
        Placement::Adaptive { cold: LocalPrefillPolicy::default(), max_decode_stall_ms: None }
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
    pub fn decide(
        &self,
        timings: &Timings,
        prompt_tokens: u64,
        decode: Site,
        prefills: &[Site],
        now: Instant,
    ) -> Verdict {
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
        let (policy, budget) = match self {
            Placement::Fixed(policy) => return fixed(policy),
            Placement::Adaptive { cold, max_decode_stall_ms } => (cold, *max_decode_stall_ms),
        };
        let verdict = if warm {
            let local = timings.local_cost_ms(decode, now);
            let best = prefills
                .iter()
                .map(|&p| timings.elsewhere_cost_ms(decode, p, now))
                .enumerate()
                .min_by(|a, b| a.1.total_cmp(&b.1));
            match best {
                Some((i, cost)) if cost < local => Verdict::Disaggregate(i),
                _ => Verdict::Local,
            }
        } else {
            cold(policy)
        };
        let Some(budget) = budget else { return verdict };
        // Where the verdict computes the prompt beside decodes, over the budget, the cheapest
        // prefill-only engine takes it: it stalls nobody. Without one the verdict stands.
        let computed_on = match verdict {
            Verdict::Local => decode,
            Verdict::Disaggregate(i) => match prefills.get(i) {
                Some(&there) if there.decodes => there,
                _ => return verdict,
            },
        };
        if timings.caused_ms(computed_on, now) <= budget {
            return verdict;
        }
        prefills
            .iter()
            .enumerate()
            .filter(|(_, p)| !p.decodes)
            .map(|(i, &p)| (i, timings.disaggregated_cost_ms(decode, p, now)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(verdict, |(i, _)| Verdict::Disaggregate(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// A prefill-only site with `bound` decodes and no arrivals.
    fn site(uncached_tokens: u64, bound: u64) -> Site<'static> {
        Site { uncached_tokens, bound, starting: &[], computing: &[], arrivals_per_ms: 0.0, decodes: false }
    }

    /// Timings of an engine computing 0.1 ms per token, pulls of 0.01 ms per token, 3 ms a leg.
    fn warm() -> Timings {
        let mut t =
            Timings { prefill: TimeFit::new(0.0, 0.0), handoff: TimeFit::new(0.0, 0.0), local: TimeFit::new(0.0, 0.0) };
        for tokens in [100, 500, 1000, 2000, 64, 1088] {
            t.observe(Sample::Prefill { tokens, queued_ms: 0.0, took: Duration::from_micros(3000 + 100 * tokens) });
            t.observe(Sample::Handoff { tokens, took: Duration::from_micros(3000 + 10 * tokens) });
            t.observe(Sample::Local { tokens, queued_ms: 0.0, took: Duration::from_micros(3000 + 100 * tokens) });
        }
        t
    }

    #[test]
    fn the_fit_finds_the_line_and_forgets_the_old_one() {
        let mut f = TimeFit::new(2.0, 0.1);
        assert_eq!(f.samples(), 0);
        let l = f.line();
        assert!((l.overhead - 2.0).abs() < 1e-9 && (l.per_token - 0.1).abs() < 1e-9, "the prior alone: {l:?}");
        assert!(l.per_queued.abs() < 1e-9, "prompts do not wait for each other until seen to: {l:?}");
        for i in 0..200u64 {
            let tokens = 100 + (i * 37) % 1000;
            f.observe(tokens, 0.0, Duration::from_micros(5000 + 50 * tokens));
        }
        let l = f.line();
        assert!((l.overhead - 5.0).abs() < 0.5 && (l.per_token - 0.05).abs() < 0.003, "{l:?}");
        // All recent observations the same length: still a line, between prior and data.
        for _ in 0..200 {
            f.observe(1000, 0.0, ms(20));
        }
        assert!((f.predict_ms(1000, 0.0) - 20.0).abs() < 1.0, "{}", f.predict_ms(1000, 0.0));
        assert!(f.predict_ms(0, 0.0) >= 0.0 && f.line().per_token >= 0.0);
        // Garbage never makes NaN.
        f.observe(u64::MAX, f64::NAN, Duration::MAX);
        f.observe(5, -1.0, ms(1));
        assert!(f.predict_ms(10, f64::INFINITY).is_finite() && f.predict_ms(10, f64::NAN).is_finite());
    }

    #[test]
    fn the_fit_learns_whether_prompts_wait_for_the_ones_queued_before_them() {
        let observe = |waits: f64| {
            let mut f = TimeFit::new(2.0, 0.1);
            for i in 0..60u64 {
                let (tokens, queued) = (100 + (i * 37) % 1000, ((i * 53) % 7) as f64 * 40.0);
                let took = 3.0 + 0.1 * tokens as f64 + waits * queued;
                f.observe(tokens, queued, Duration::from_secs_f64(took / 1e3));
            }
            f.line()
        };
        // One prompt at a time: each waits for all that is queued.
        let serial = observe(1.0);
        assert!((serial.per_queued - 1.0).abs() < 0.02 && (serial.per_token - 0.1).abs() < 0.005, "{serial:?}");
        // Side by side: nothing queued makes a prompt slower.
        let parallel = observe(0.0);
        assert!(parallel.per_queued < 0.02 && (parallel.per_token - 0.1).abs() < 0.005, "{parallel:?}");
        // Never more than all of it, whatever the observations say.
        assert!(observe(3.0).per_queued <= 1.0);
    }

    #[test]
    fn a_queue_ahead_counts_where_prompts_wait_for_it() {
        let now = Instant::now();
        let mut t = warm();
        let busy_until = [now + ms(300)];
        let queued = Site { computing: &busy_until, ..site(1000, 0) };
        assert!((queued.queued_ms(now) - 300.0).abs() < 1e-6);
        assert_eq!(site(1000, 0).queued_ms(now), 0.0);
        // Prompts seen waiting for what was queued: the queued engine is 300 ms dearer.
        for tokens in [100u64, 500, 1000, 2000, 64, 1088] {
            for queued_ms in [0.0, 200.0] {
                let took = Duration::from_micros(3000 + 100 * tokens + (queued_ms * 1e3) as u64);
                t.observe(Sample::Prefill { tokens, queued_ms, took });
            }
        }
        let d = site(1088, 4);
        let (with_queue, without) =
            (t.disaggregated_cost_ms(d, queued, now), t.disaggregated_cost_ms(d, site(1000, 0), now));
        assert!((with_queue - without - 300.0).abs() < 10.0, "{with_queue} {without}");
        assert_eq!(Placement::default().decide(&t, 1088, d, &[queued, site(1000, 0)], now), Verdict::Disaggregate(1));
    }

    #[test]
    fn affinity_first_when_the_decode_is_idle() {
        let now = Instant::now();
        let t = warm();
        let p = Placement::default();
        // Nothing cached anywhere, nobody decoding: a pull only adds its time.
        let d = site(1088, 0);
        let idle_prefill = site(1088, 0);
        assert_eq!(p.decide(&t, 1088, d, &[idle_prefill], now), Verdict::Local);
        // The decode holds the prefix and the prefill does not: local, even under some load.
        let hit = site(64, 3);
        assert_eq!(p.decide(&t, 1088, hit, &[idle_prefill], now), Verdict::Local);
    }

    #[test]
    fn disaggregate_where_the_interference_avoided_outweighs_the_transfer() {
        let now = Instant::now();
        let t = warm();
        let p = Placement::default();
        // 4 decodes running would each lose 108.8 ms to a local 1088-token prefill; the pull
        // costs 3 + 10.9 ms.
        let busy = site(1088, 4);
        let dedicated = site(1088, 0);
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated], now), Verdict::Disaggregate(0));
        // A prefill engine that holds the prefix is the better of two.
        let holder = site(64, 0);
        assert_eq!(p.decide(&t, 1088, busy, &[dedicated, holder], now), Verdict::Disaggregate(1));
        // Colocated: the other engine is as busy, so the stall only moves; stay.
        let as_busy = site(1088, 4);
        assert_eq!(p.decide(&t, 1088, busy, &[as_busy], now), Verdict::Local);
        // A slow network makes the pull dearer than the stall it avoids.
        let mut slow = warm();
        for _ in 0..50 {
            slow.observe(Sample::Handoff { tokens: 1088, took: ms(2000) });
        }
        assert_eq!(p.decide(&slow, 1088, busy, &[dedicated], now), Verdict::Local);
        assert_eq!(p.decide(&t, 1088, busy, &[], now), Verdict::Local, "no prefill engine");
    }

    #[test]
    fn an_idle_decode_that_requests_keep_reaching_is_not_idle_for_long() {
        let now = Instant::now();
        let t = warm();
        let p = Placement::default();
        let dedicated = site(1088, 0);
        // Nothing bound, but one request every 20 ms: about 5 start decoding during a
        // 108.8 ms prefill and each loses what is left of it.
        let reached = Site { arrivals_per_ms: 0.05, ..site(1088, 0) };
        assert_eq!(p.decide(&t, 1088, reached, &[dedicated], now), Verdict::Disaggregate(0));
        // Quiet: the pull only adds its time.
        let quiet = Site { arrivals_per_ms: 0.001, ..reached };
        assert_eq!(p.decide(&t, 1088, quiet, &[dedicated], now), Verdict::Local);
        // A short uncached part stalls too briefly for arrivals to matter.
        let hit = Site { uncached_tokens: 64, ..reached };
        assert_eq!(p.decide(&t, 1088, hit, &[dedicated], now), Verdict::Local);
        // Odd rates never make the cost NaN.
        for rate in [f64::NAN, f64::INFINITY, -1.0] {
            let odd = Site { arrivals_per_ms: rate, ..reached };
            assert!(t.local_cost_ms(odd, now).is_finite(), "{rate}");
        }
    }

    #[test]
    fn colocated_the_request_moves_whole_to_the_least_exposed_engine() {
        let now = Instant::now();
        // Only the local line observed, as where every engine prefills what it decodes.
        let mut t = Timings::default();
        for tokens in [100, 500, 1000, 2000] {
            t.observe(Sample::Local { tokens, queued_ms: 0.0, took: Duration::from_micros(3000 + 100 * tokens) });
        }
        assert!(!t.warm(), "prefill and handoff never observed");
        let p = Placement::default();
        let both = |uncached_tokens, bound| Site { decodes: true, ..site(uncached_tokens, bound) };
        // A fresh prompt on an engine with 3 decodes goes to the one with 1.
        assert_eq!(p.decide(&t, 1088, both(1088, 3), &[both(1088, 2), both(1088, 1)], now), Verdict::Disaggregate(1));
        // As exposed everywhere: stay (the hop buys nothing).
        assert_eq!(p.decide(&t, 1088, both(1088, 1), &[both(1088, 1)], now), Verdict::Local);
        // A hit stays where its prompt is, though another engine is idle.
        assert_eq!(p.decide(&t, 1088, both(64, 3), &[both(1088, 0)], now), Verdict::Local);
        // The same timings with a prefill-only engine among the candidates: cold, the fixed rule.
        assert_eq!(p.decide(&t, 1088, both(1088, 3), &[site(1088, 0)], now), Verdict::Disaggregate(0));
        assert_eq!(p.decide(&t, 1088, both(1088, 0), &[site(1088, 3)], now), Verdict::Disaggregate(0));
    }

    /// Prompts in flight count by when they end: a request decodes beside what is left of those
    /// computed where it decodes, and one bound there that starts decoding only after a prompt
    /// is done is not stalled by it.
    #[test]
    fn prompts_in_flight_stall_by_when_they_end() {
        let now = Instant::now();
        let at = |n| now + ms(n);
        // Local prefills observed only: 3 ms + 0.1 ms a token; the hop is the prior's 2 ms.
        let mut t = Timings::default();
        for tokens in [100, 500, 1000, 2000] {
            t.observe(Sample::Local { tokens, queued_ms: 0.0, took: Duration::from_micros(3000 + 100 * tokens) });
        }
        let p = Placement::default();
        let both = |uncached_tokens, bound| Site { decodes: true, ..site(uncached_tokens, bound) };
        // The entry engine computes a local prompt for 400 ms more: a hit (9.4 ms to its first
        // output) would decode beside the other 390 ms; an engine with one request decoding
        // loses only the hit's 6.4 ms. One bound request each, as counted before: it stayed.
        let long = [at(400)];
        let computing_long = Site { starting: &long, computing: &long, ..both(64, 1) };
        assert_eq!(p.decide(&t, 1088, computing_long, &[both(64, 1)], now), Verdict::Disaggregate(0));
        // A request prefilling elsewhere that starts decoding here after a fresh prompt's 109 ms:
        // nobody is stalled, so the prompt stays rather than hop to an idle engine.
        let after = [at(300)];
        let bound_later = Site { starting: &after, ..both(1088, 1) };
        assert_eq!(p.decide(&t, 1088, bound_later, &[both(1088, 0)], now), Verdict::Local);
        // Starting within it, it loses the rest (59 ms): the idle engine is better.
        let within = [at(50)];
        let bound_sooner = Site { starting: &within, ..both(1088, 1) };
        assert_eq!(p.decide(&t, 1088, bound_sooner, &[both(1088, 0)], now), Verdict::Disaggregate(0));
        // Predictions past are due now: as decoding.
        let past = [now];
        let due = Site { starting: &past, computing: &past, ..both(1088, 1) };
        assert!((t.local_cost_ms(due, now) - t.local_cost_ms(both(1088, 1), now)).abs() < 1e-9);
    }

    #[test]
    fn forecasts_follow_the_lines_and_stay_in_range() {
        let now = Instant::now();
        let t = warm();
        // About 102 ms to compute 1000 tokens, 13 ms to pull them (the priors pull a little).
        let (computed, started) = t.forecast_ms(1000, 0.0, Some(1000));
        assert_eq!((computed, started), (t.prefill.predict_ms(1000, 0.0), computed + t.handoff.predict_ms(1000, 0.0)));
        assert!((100.0..105.0).contains(&computed) && (12.0..15.0).contains(&(started - computed)));
        let (computed, started) = t.forecast_ms(1000, 0.0, None);
        assert_eq!((computed, started), (t.local.predict_ms(1000, 0.0), computed));
        assert_eq!(ms_after(now, 250.0), now + ms(250));
        for odd in [f64::NAN, -5.0, f64::NEG_INFINITY] {
            assert_eq!(ms_after(now, odd), now, "{odd}");
        }
        assert_eq!(ms_after(now, f64::INFINITY), now, "not finite");
        assert_eq!(ms_after(now, 1e300), now + Duration::from_secs(3600));
    }

    #[test]
    fn requests_routed_during_a_stall_lose_what_is_left_of_it_once_they_start() {
        let now = Instant::now();
        // One request every 10 ms, starting at once: over a 100 ms stall 10 arrive, evenly
        // spread, and each loses what is left of it, 50 ms on average: 500 ms (0.1 × 100² / 2).
        let reached = Site { arrivals_per_ms: 0.1, ..site(0, 0) };
        assert!((reached.stalled_ms(100.0, 0.0, now) - 500.0).abs() < 1e-9);
        // Starting 20 ms after they are routed at the soonest: only the first 80 ms count.
        assert!((reached.stalled_ms(100.0, 20.0, now) - 320.0).abs() < 1e-9);
        assert_eq!(reached.stalled_ms(100.0, 150.0, now), 0.0, "none starts before it ends");
        // Each decoding now loses all of it, beside the arrivals.
        let busy = Site { bound: 2, ..reached };
        assert!((busy.stalled_ms(100.0, 0.0, now) - 700.0).abs() < 1e-9);
    }

    #[test]
    fn a_stall_budget_sends_prompts_that_would_exceed_it_to_a_prefill_engine() {
        let now = Instant::now();
        let t = warm();
        let budgeted = |ms| Placement::Adaptive { cold: LocalPrefillPolicy::default(), max_decode_stall_ms: Some(ms) };
        // A hit (64 uncached tokens, 6.4 ms of compute) on a decode with one request decoding:
        // cheaper computed there than pulled from a prefill engine that misses it (1088 tokens).
        let hit = Site { decodes: true, ..site(64, 1) };
        let missing = site(1088, 0);
        assert_eq!(Placement::default().decide(&t, 1088, hit, &[missing], now), Verdict::Local);
        assert!((t.caused_ms(hit, now) - 6.4).abs() < 0.5, "{}", t.caused_ms(hit, now));
        assert_eq!(budgeted(10.0).decide(&t, 1088, hit, &[missing], now), Verdict::Local, "within the budget");
        assert_eq!(budgeted(3.0).decide(&t, 1088, hit, &[missing], now), Verdict::Disaggregate(0));
        // The cheapest prefill-only engine takes it, not one that can decode too.
        let other_decode = Site { decodes: true, ..site(64, 2) };
        let holder = site(64, 0);
        assert_eq!(
            budgeted(3.0).decide(&t, 1088, hit, &[other_decode, missing, holder], now),
            Verdict::Disaggregate(2)
        );
        // Moving it whole to another engine that decodes is held to the budget too.
        let idle_decode = Site { decodes: true, ..site(64, 0) };
        assert_eq!(budgeted(3.0).decide(&t, 1088, hit, &[idle_decode, missing], now), Verdict::Disaggregate(0));
        assert_eq!(
            budgeted(3.0).decide(&t, 1088, site(1088, 3), &[other_decode, missing], now),
            Verdict::Disaggregate(1)
        );
        // An idle decode stalls nobody; with no prefill-only engine (colocated) the verdict stands.
        assert_eq!(
            budgeted(0.0).decide(&t, 1088, Site { decodes: true, ..site(64, 0) }, &[missing], now),
            Verdict::Local
        );
        assert_eq!(budgeted(0.0).decide(&t, 1088, hit, &[other_decode], now), Verdict::Local);
        // Cold too: the fixed rule keeps this hit local, the budget does not.
        let cold = Timings::default();
        assert_eq!(Placement::default().decide(&cold, 1088, hit, &[missing], now), Verdict::Local);
        assert_eq!(budgeted(3.0).decide(&cold, 1088, hit, &[missing], now), Verdict::Disaggregate(0));
    }

    #[test]
    fn cold_or_fixed_the_thresholds_decide() {
        let now = Instant::now();
        let cold = Timings::default();
        assert!(!cold.warm() && warm().warm());
        let p = Placement::default();
        let idle = site(1088, 0);
        // Cold: everything uncached is disaggregated (ratio 1.0 ≥ 0.7), as the fixed policy says.
        assert_eq!(p.decide(&cold, 1088, idle, &[idle], now), Verdict::Disaggregate(0));
        assert_eq!(p.decide(&cold, 1088, site(64, 0), &[idle], now), Verdict::Local);
        // Cold with decodes bound there: a prefill engine holding as much computes it instead.
        let holder = site(64, 0);
        assert_eq!(p.decide(&cold, 1088, site(64, 2), &[idle, holder], now), Verdict::Disaggregate(1));
        assert_eq!(p.decide(&cold, 1088, site(64, 2), &[idle], now), Verdict::Local, "only the decode holds it");
        let both = Site { decodes: true, ..holder };
        assert_eq!(
            p.decide(&cold, 1088, site(64, 2), &[both], now),
            Verdict::Local,
            "an engine that can decode: the rule as it is"
        );
        let fixed = Placement::Fixed(LocalPrefillPolicy { max_uncached_tokens: 100, max_uncached_ratio: 1.0 });
        assert_eq!(fixed.decide(&warm(), 1088, idle, &[idle], now), Verdict::Disaggregate(0), "warm, but fixed");
        assert_eq!(fixed.decide(&warm(), 1088, site(64, 9), &[idle], now), Verdict::Local);
        assert_eq!(
            fixed.decide(&cold, 1088, site(64, 9), &[holder], now),
            Verdict::Local,
            "an operator's rule is kept"
        );
    }
}
