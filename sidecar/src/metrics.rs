//! Prometheus metrics: a handful of atomics rendered as text exposition, and the per-request
//! [`Tracker`] that records an outcome exactly once (a request dropped unfinished — the client
//! left — counts as `cancelled`).

use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
];

#[derive(Debug)]
pub struct Histogram {
    counts: Vec<AtomicU64>,
    sum_nanos: AtomicU64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { counts: (0..=BUCKETS.len()).map(|_| AtomicU64::new(0)).collect(), sum_nanos: AtomicU64::new(0) }
    }
}

impl Histogram {
    pub fn observe(&self, secs: f64) {
        let i = BUCKETS.iter().position(|&b| secs <= b).unwrap_or(BUCKETS.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_nanos.fetch_add((secs * 1e9) as u64, Relaxed);
    }

    pub fn since(&self, start: Instant) {
        self.observe(start.elapsed().as_secs_f64());
    }

    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (i, bound) in BUCKETS.iter().enumerate() {
            cumulative += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.counts[BUCKETS.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_nanos.load(Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

/// How a proxied generation request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The decode answered 2xx and its body was delivered.
    Ok,
    /// A 4xx went back to the client (from the prefill unchanged, or from the decode).
    ClientError,
    /// The decode engine answered an error status (passed back).
    EngineError,
    /// No prefill could be used and the policy is to fail (502/503).
    PrefillFailed,
    /// The decode engine could not be reached (503).
    DecodeUnavailable,
    /// A leg exceeded its timeout (504, or a stream cut after going idle).
    Timeout,
    /// The client went away first.
    Cancelled,
    /// Missing or wrong bearer token.
    Unauthorized,
}

impl Outcome {
    const ALL: [Outcome; 8] = [
        Outcome::Ok,
        Outcome::ClientError,
        Outcome::EngineError,
        Outcome::PrefillFailed,
        Outcome::DecodeUnavailable,
        Outcome::Timeout,
        Outcome::Cancelled,
        Outcome::Unauthorized,
    ];

    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::ClientError => "client_error",
            Outcome::EngineError => "engine_error",
            Outcome::PrefillFailed => "prefill_failed",
            Outcome::DecodeUnavailable => "decode_unavailable",
            Outcome::Timeout => "timeout",
            Outcome::Cancelled => "cancelled",
            Outcome::Unauthorized => "unauthorized",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The phases timed per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The coordinator's pairing call, answered or not (what routing through the coordinator
    /// adds before a request's first leg).
    Pairing,
    /// The prefill call (all attempts).
    Prefill,
    /// From the prefill's answer to the decode's response headers (the engine's pull and
    /// queueing), or the sidecar's own pull in pull mode.
    KvHandoff,
    /// From sending the decode call to its first body byte.
    DecodeFirstByte,
    /// From the request's arrival to the end of the response body.
    EndToEnd,
}

impl Phase {
    const ALL: [Phase; 5] = [Phase::Pairing, Phase::Prefill, Phase::KvHandoff, Phase::DecodeFirstByte, Phase::EndToEnd];
    fn label(self) -> &'static str {
        match self {
            Phase::Pairing => "pairing",
            Phase::Prefill => "prefill",
            Phase::KvHandoff => "kv_handoff",
            Phase::DecodeFirstByte => "decode_first_byte",
            Phase::EndToEnd => "end_to_end",
        }
    }
}

/// Why a request ran without a prefill leg.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalReason {
    /// Short prompt (--local-prefill-below-tokens).
    Threshold,
    /// The coordinator's pairing said so.
    Coordinator,
    /// Every prefill candidate failed; policy `local`.
    PrefillFailed,
    /// The prefill returned `kv_transfer_params: null`; policy `local`.
    NullParams,
    /// No prefill candidate at all.
    NoCandidate,
}

impl LocalReason {
    const ALL: [LocalReason; 5] = [
        LocalReason::Threshold,
        LocalReason::Coordinator,
        LocalReason::PrefillFailed,
        LocalReason::NullParams,
        LocalReason::NoCandidate,
    ];
    fn label(self) -> &'static str {
        match self {
            LocalReason::Threshold => "threshold",
            LocalReason::Coordinator => "coordinator",
            LocalReason::PrefillFailed => "prefill_failed",
            LocalReason::NullParams => "null_params",
            LocalReason::NoCandidate => "no_candidate",
        }
    }
}

/// What became of a pairing with another decode engine, or of a redirected request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedirectOutcome {
    /// Handed to the chosen decode's sidecar, which answered.
    Ok,
    /// The chosen decode's sidecar could not be reached; served here.
    FallbackUnreachable,
    /// It did not answer in time; served here.
    FallbackTimeout,
    /// It answered a 5xx before any output; served here.
    FallbackErrorStatus,
    /// The chosen decode registered no `sidecar_url`; decoded here.
    NoSidecarUrl,
    /// A request another sidecar redirected here (served without pairing).
    Received,
}

impl RedirectOutcome {
    const ALL: [RedirectOutcome; 6] = [
        RedirectOutcome::Ok,
        RedirectOutcome::FallbackUnreachable,
        RedirectOutcome::FallbackTimeout,
        RedirectOutcome::FallbackErrorStatus,
        RedirectOutcome::NoSidecarUrl,
        RedirectOutcome::Received,
    ];

    pub fn label(self) -> &'static str {
        match self {
            RedirectOutcome::Ok => "ok",
            RedirectOutcome::FallbackUnreachable => "fallback_unreachable",
            RedirectOutcome::FallbackTimeout => "fallback_timeout",
            RedirectOutcome::FallbackErrorStatus => "fallback_error_status",
            RedirectOutcome::NoSidecarUrl => "no_sidecar_url",
            RedirectOutcome::Received => "received",
        }
    }
}

/// What one prefill attempt came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attempt {
    Ok,
    Connect,
    Timeout,
    FailoverStatus,
    OtherStatus,
    ClientError,
    BadBody,
    NullParams,
}

impl Attempt {
    const ALL: [Attempt; 8] = [
        Attempt::Ok,
        Attempt::Connect,
        Attempt::Timeout,
        Attempt::FailoverStatus,
        Attempt::OtherStatus,
        Attempt::ClientError,
        Attempt::BadBody,
        Attempt::NullParams,
    ];
    fn label(self) -> &'static str {
        match self {
            Attempt::Ok => "ok",
            Attempt::Connect => "connect_error",
            Attempt::Timeout => "timeout",
            Attempt::FailoverStatus => "failover_status",
            Attempt::OtherStatus => "other_status",
            Attempt::ClientError => "client_error",
            Attempt::BadBody => "bad_body",
            Attempt::NullParams => "null_params",
        }
    }
}

fn counters(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}

#[derive(Debug)]
pub struct Metrics {
    requests: Vec<AtomicU64>,
    phases: Vec<Histogram>,
    local: Vec<AtomicU64>,
    attempts: Vec<AtomicU64>,
    redirects: Vec<AtomicU64>,
    pub in_flight: AtomicI64,
    pub disaggregated: AtomicU64,
    pub offloaded: AtomicU64,
    pub failovers: AtomicU64,
    pub passthrough: AtomicU64,
    pub routing_header_rejected: AtomicU64,
    pub client_kv_params_dropped: AtomicU64,
    pub releases_ok: AtomicU64,
    pub releases_failed: AtomicU64,
    pub stream_idle_timeouts: AtomicU64,
    pub decode_rank_failovers: AtomicU64,
    pub pairings: AtomicU64,
    pub coordinator_errors: AtomicU64,
    pub reports_dropped: AtomicU64,
    pub notices_dead_engines: AtomicU64,
    pub pulls_ok: AtomicU64,
    pub pulls_failed: AtomicU64,
    pub pull_bytes: AtomicU64,
    pub sglang_prefill_failures: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        Metrics {
            requests: counters(Outcome::ALL.len()),
            phases: Phase::ALL.iter().map(|_| Histogram::default()).collect(),
            local: counters(LocalReason::ALL.len()),
            attempts: counters(Attempt::ALL.len()),
            redirects: counters(RedirectOutcome::ALL.len()),
            in_flight: AtomicI64::new(0),
            disaggregated: z(),
            offloaded: z(),
            failovers: z(),
            passthrough: z(),
            routing_header_rejected: z(),
            client_kv_params_dropped: z(),
            releases_ok: z(),
            releases_failed: z(),
            stream_idle_timeouts: z(),
            decode_rank_failovers: z(),
            pairings: z(),
            coordinator_errors: z(),
            reports_dropped: z(),
            notices_dead_engines: z(),
            pulls_ok: z(),
            pulls_failed: z(),
            pull_bytes: z(),
            sglang_prefill_failures: z(),
        }
    }
}

pub fn inc(c: &AtomicU64) {
    c.fetch_add(1, Relaxed);
}

impl Metrics {
    pub fn phase(&self, p: Phase) -> &Histogram {
        &self.phases[p as usize]
    }

    pub fn local(&self, r: LocalReason) {
        inc(&self.local[r as usize]);
    }

    pub fn attempt(&self, a: Attempt) {
        inc(&self.attempts[a as usize]);
    }

    pub fn redirect(&self, r: RedirectOutcome) {
        inc(&self.redirects[r as usize]);
    }

    pub fn redirects(&self, r: RedirectOutcome) -> u64 {
        self.redirects[r as usize].load(Relaxed)
    }

    pub fn requests(&self, o: Outcome) -> u64 {
        self.requests[o.index()].load(Relaxed)
    }

    pub fn locals(&self, r: LocalReason) -> u64 {
        self.local[r as usize].load(Relaxed)
    }

    pub fn attempts(&self, a: Attempt) -> u64 {
        self.attempts[a as usize].load(Relaxed)
    }

    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        let help = |out: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        };
        help(&mut out, "pd_sidecar_requests_total", "counter", "Generation requests by outcome.");
        for o in Outcome::ALL {
            let _ = writeln!(out, "pd_sidecar_requests_total{{outcome=\"{}\"}} {}", o.label(), self.requests(o));
        }
        help(&mut out, "pd_sidecar_phase_seconds", "histogram", "Latency of each request phase.");
        for p in Phase::ALL {
            self.phase(p).render(&mut out, "pd_sidecar_phase_seconds", &format!("phase=\"{}\"", p.label()));
        }
        help(
            &mut out,
            "pd_sidecar_local_decode_total",
            "counter",
            "Requests decoded without a prefill leg, by reason.",
        );
        for r in LocalReason::ALL {
            let _ = writeln!(out, "pd_sidecar_local_decode_total{{reason=\"{}\"}} {}", r.label(), self.locals(r));
        }
        help(&mut out, "pd_sidecar_prefill_attempts_total", "counter", "Prefill calls by result.");
        for a in Attempt::ALL {
            let _ = writeln!(out, "pd_sidecar_prefill_attempts_total{{result=\"{}\"}} {}", a.label(), self.attempts(a));
        }
        help(
            &mut out,
            "pd_sidecar_redirects_total",
            "counter",
            "Pairings with another decode engine (redirects) and redirected requests received, by outcome.",
        );
        for r in RedirectOutcome::ALL {
            let _ = writeln!(out, "pd_sidecar_redirects_total{{outcome=\"{}\"}} {}", r.label(), self.redirects(r));
        }
        help(&mut out, "pd_sidecar_in_flight", "gauge", "Generation requests in flight.");
        let _ = writeln!(out, "pd_sidecar_in_flight {}", self.in_flight.load(Relaxed).max(0));
        let plain: [(&str, &str, &AtomicU64); 18] = [
            (
                "pd_sidecar_disaggregated_total",
                "Requests whose decode got the prefill's KV params.",
                &self.disaggregated,
            ),
            (
                "pd_sidecar_offloaded_total",
                "Requests with large bodies run on a thread of their own (--offload-body-bytes).",
                &self.offloaded,
            ),
            ("pd_sidecar_failovers_total", "Moves to the next prefill candidate.", &self.failovers),
            ("pd_sidecar_passthrough_total", "Requests forwarded untouched to the engine.", &self.passthrough),
            (
                "pd_sidecar_routing_header_rejected_total",
                "x-prefiller-host-port values refused by the allowlist.",
                &self.routing_header_rejected,
            ),
            (
                "pd_sidecar_client_kv_params_dropped_total",
                "Client-sent kv_transfer_params/bootstrap fields dropped.",
                &self.client_kv_params_dropped,
            ),
            ("pd_sidecar_releases_ok_total", "Held prefill blocks released.", &self.releases_ok),
            ("pd_sidecar_releases_failed_total", "Release attempts that failed.", &self.releases_failed),
            (
                "pd_sidecar_stream_idle_timeouts_total",
                "Decode streams cut after going idle.",
                &self.stream_idle_timeouts,
            ),
            (
                "pd_sidecar_decode_rank_failovers_total",
                "Decode calls moved to another data-parallel rank.",
                &self.decode_rank_failovers,
            ),
            ("pd_sidecar_pairings_total", "Pairing decisions received from the coordinator.", &self.pairings),
            ("pd_sidecar_coordinator_errors_total", "Failed coordinator calls.", &self.coordinator_errors),
            ("pd_sidecar_reports_dropped_total", "Coordinator reports dropped (queue full).", &self.reports_dropped),
            (
                "pd_sidecar_dead_engine_notices_total",
                "Engines the coordinator reported dead.",
                &self.notices_dead_engines,
            ),
            ("pd_sidecar_pulls_ok_total", "Sidecar pulls completed.", &self.pulls_ok),
            ("pd_sidecar_pulls_failed_total", "Sidecar pulls failed.", &self.pulls_failed),
            ("pd_sidecar_pull_bytes_total", "Bytes pulled by the sidecar.", &self.pull_bytes),
            (
                "pd_sidecar_sglang_prefill_failures_total",
                "SGLang prefill legs that failed.",
                &self.sglang_prefill_failures,
            ),
        ];
        for (name, text, c) in plain {
            help(&mut out, name, "counter", text);
            let _ = writeln!(out, "{name} {}", c.load(Relaxed));
        }
        out
    }
}

/// One generation request's bookkeeping: in-flight gauge, outcome, end-to-end latency.
#[derive(Debug)]
pub struct Tracker {
    metrics: Arc<Metrics>,
    pub started: Instant,
    done: bool,
}

impl Tracker {
    pub fn new(metrics: &Arc<Metrics>) -> Tracker {
        metrics.in_flight.fetch_add(1, Relaxed);
        Tracker { metrics: Arc::clone(metrics), started: Instant::now(), done: false }
    }

    pub fn finish(mut self, outcome: Outcome) {
        self.record(outcome);
    }

    fn record(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            inc(&self.metrics.requests[outcome.index()]);
            self.metrics.phase(Phase::EndToEnd).since(self.started);
        }
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        self.record(Outcome::Cancelled);
        self.metrics.in_flight.fetch_sub(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracker_and_rendering() {
        let m = Arc::new(Metrics::default());
        Tracker::new(&m).finish(Outcome::Ok);
        drop(Tracker::new(&m));
        let t = Tracker::new(&m);
        assert_eq!(m.in_flight.load(Relaxed), 1);
        m.local(LocalReason::Threshold);
        m.attempt(Attempt::Timeout);
        m.redirect(RedirectOutcome::NoSidecarUrl);
        m.phase(Phase::Prefill).observe(0.003);
        let text = m.render();
        assert!(text.contains("pd_sidecar_requests_total{outcome=\"ok\"} 1\n"), "{text}");
        assert!(text.contains("pd_sidecar_requests_total{outcome=\"cancelled\"} 1\n"));
        assert!(text.contains("pd_sidecar_in_flight 1\n"));
        assert!(text.contains("pd_sidecar_local_decode_total{reason=\"threshold\"} 1\n"));
        assert!(text.contains("pd_sidecar_prefill_attempts_total{result=\"timeout\"} 1\n"));
        assert!(text.contains("pd_sidecar_redirects_total{outcome=\"no_sidecar_url\"} 1\n"));
        assert!(text.contains("pd_sidecar_redirects_total{outcome=\"ok\"} 0\n"));
        assert!(text.contains("pd_sidecar_phase_seconds_bucket{phase=\"prefill\",le=\"0.0025\"} 0\n"));
        assert!(text.contains("pd_sidecar_phase_seconds_bucket{phase=\"prefill\",le=\"0.005\"} 1\n"));
        assert!(text.contains("pd_sidecar_phase_seconds_count{phase=\"end_to_end\"} 2\n"));
        drop(t);
        assert_eq!(m.in_flight.load(Relaxed), 0);
        assert_eq!(m.requests(Outcome::Cancelled), 2);
    }
}
