//! Aggregating outcomes: latency histograms (hdrhistogram, microseconds), throughput, goodput
//! against SLOs, errors by kind, and a serialisable summary.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::client::Outcome;

/// Service-level objectives a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Slo {
    /// Time to first token, milliseconds.
    pub ttft_ms: Option<f64>,
    /// Mean inter-token latency of the request (time per output token), milliseconds.
    pub itl_ms: Option<f64>,
}

impl Slo {
    pub fn met(&self, o: &Outcome) -> bool {
        if !o.ok() {
            return false;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let ttft_ok = match (self.ttft_ms, o.ttft) {
            (None, _) => true,
            (Some(s), Some(t)) => ms(t) <= s,
            (Some(_), None) => false,
        };
        // Requests without inter-token gaps (non-streaming, one token) pass the ITL SLO.
        let itl_ok = match (self.itl_ms, o.mean_itl()) {
            (Some(s), Some(t)) => ms(t) <= s,
            _ => true,
        };
        ttft_ok && itl_ok
    }
}

/// Percentiles of one latency, milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Latency {
    fn of(h: &Histogram<u64>) -> Self {
        if h.is_empty() {
            return Latency::default();
        }
        let ms = |us: u64| us as f64 / 1e3;
        Latency {
            count: h.len(),
            mean: h.mean() / 1e3,
            min: ms(h.min()),
            p50: ms(h.value_at_quantile(0.50)),
            p90: ms(h.value_at_quantile(0.90)),
            p99: ms(h.value_at_quantile(0.99)),
            max: ms(h.max()),
        }
    }
}

/// Collects outcomes as they come.
#[derive(Debug)]
pub struct Collector {
    ttft: Histogram<u64>,
    itl: Histogram<u64>,
    e2e: Histogram<u64>,
    slo: Slo,
    ok: u64,
    good: u64,
    disaggregated: u64,
    local: u64,
    errors: BTreeMap<String, u64>,
    prompt_tokens: u64,
    output_tokens: u64,
    /// Raw samples (ms) kept for plots.
    pub ttft_samples: Vec<f64>,
    pub e2e_samples: Vec<f64>,
    pub itl_samples: Vec<f64>,
}

fn hist() -> Histogram<u64> {
    // 1 µs .. 1 hour, 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

fn us(d: Duration) -> u64 {
    (d.as_micros() as u64).clamp(1, 3_600_000_000)
}

impl Collector {
    pub fn new(slo: Slo) -> Self {
        Collector {
            ttft: hist(),
            itl: hist(),
            e2e: hist(),
            slo,
            ok: 0,
            good: 0,
            disaggregated: 0,
            local: 0,
            errors: BTreeMap::new(),
            prompt_tokens: 0,
            output_tokens: 0,
            ttft_samples: Vec::new(),
            e2e_samples: Vec::new(),
            itl_samples: Vec::new(),
        }
    }

    pub fn record(&mut self, o: &Outcome) {
        if o.disaggregated {
            self.disaggregated += 1;
        } else {
            self.local += 1;
        }
        if let Some(kind) = &o.error {
            *self.errors.entry(kind.to_string()).or_default() += 1;
            return;
        }
        self.ok += 1;
        if self.slo.met(o) {
            self.good += 1;
        }
        self.prompt_tokens += o.prompt_tokens;
        self.output_tokens += o.output_tokens;
        if let Some(t) = o.ttft {
            self.ttft.saturating_record(us(t));
            self.ttft_samples.push(t.as_secs_f64() * 1e3);
        }
        for &g in &o.itl {
            self.itl.saturating_record(us(g));
            self.itl_samples.push(g.as_secs_f64() * 1e3);
        }
        self.e2e.saturating_record(us(o.e2e));
        self.e2e_samples.push(o.e2e.as_secs_f64() * 1e3);
    }

    pub fn completed(&self) -> u64 {
        self.ok + self.errors.values().sum::<u64>()
    }

    /// The summary of a run that took `elapsed`.
    pub fn summary(&self, elapsed: Duration) -> Summary {
        let secs = elapsed.as_secs_f64().max(1e-9);
        let failed = self.errors.values().sum();
        Summary {
            requests: self.ok + failed,
            ok: self.ok,
            failed,
            errors: self.errors.clone(),
            duration_s: secs,
            request_throughput: self.ok as f64 / secs,
            output_token_throughput: self.output_tokens as f64 / secs,
            prompt_tokens: self.prompt_tokens,
            output_tokens: self.output_tokens,
            slo: self.slo,
            good: self.good,
            goodput: self.good as f64 / secs,
            disaggregated: self.disaggregated,
            local: self.local,
            ttft_ms: Latency::of(&self.ttft),
            itl_ms: Latency::of(&self.itl),
            e2e_ms: Latency::of(&self.e2e),
        }
    }
}

/// What a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub requests: u64,
    pub ok: u64,
    pub failed: u64,
    /// Failures by kind: `connect`, `timeout`, `http_<status>`, `bad_body`, `no_kv_params`.
    pub errors: BTreeMap<String, u64>,
    pub duration_s: f64,
    /// Successful requests per second.
    pub request_throughput: f64,
    pub output_token_throughput: f64,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    pub slo: Slo,
    /// Requests that succeeded within every SLO given.
    pub good: u64,
    /// `good` per second.
    pub goodput: f64,
    /// Requests sent prefill → decode, and requests served by one engine.
    pub disaggregated: u64,
    pub local: u64,
    pub ttft_ms: Latency,
    pub itl_ms: Latency,
    pub e2e_ms: Latency,
}

impl Summary {
    /// A plain-text table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let errors = if self.errors.is_empty() {
            "none".to_string()
        } else {
            self.errors.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ")
        };
        s += &format!(
            "requests     {} ok, {} failed in {:.2} s (errors: {errors})\n",
            self.ok, self.failed, self.duration_s
        );
        s += &format!(
            "throughput   {:.1} req/s, {:.1} output tok/s ({} prompt, {} output tokens)\n",
            self.request_throughput, self.output_token_throughput, self.prompt_tokens, self.output_tokens
        );
        if self.slo.ttft_ms.is_some() || self.slo.itl_ms.is_some() {
            let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v} ms"));
            s += &format!(
                "goodput      {:.1} req/s ({} of {} within TTFT {} / ITL {})\n",
                self.goodput,
                self.good,
                self.requests,
                f(self.slo.ttft_ms),
                f(self.slo.itl_ms)
            );
        }
        s += "latency (ms)      mean       p50       p90       p99       max\n";
        for (name, l) in [("TTFT", &self.ttft_ms), ("ITL", &self.itl_ms), ("E2E", &self.e2e_ms)] {
            s += &format!("  {name:<8} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2}\n", l.mean, l.p50, l.p90, l.p99, l.max);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::ErrorKind;

    fn ok(ttft_ms: u64, itl_ms: &[u64]) -> Outcome {
        let itl: Vec<Duration> = itl_ms.iter().map(|&m| Duration::from_millis(m)).collect();
        let e2e = Duration::from_millis(ttft_ms) + itl.iter().sum::<Duration>();
        Outcome {
            ttft: Some(Duration::from_millis(ttft_ms)),
            itl,
            e2e,
            prompt_tokens: 10,
            output_tokens: itl_ms.len() as u64 + 1,
            disaggregated: true,
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_throughput_goodput_and_errors() {
        let mut c = Collector::new(Slo { ttft_ms: Some(50.0), itl_ms: Some(5.0) });
        for t in 1..=100 {
            c.record(&ok(t, &[2, 4]));
        }
        c.record(&ok(10, &[20, 20])); // misses the ITL SLO
        c.record(&Outcome { error: Some(ErrorKind::Timeout), ..Default::default() });
        c.record(&Outcome { error: Some(ErrorKind::Status(503)), ..Default::default() });
        c.record(&Outcome { error: Some(ErrorKind::Status(503)), ..Default::default() });
        assert_eq!(c.completed(), 104);
        let s = c.summary(Duration::from_secs(2));
        assert_eq!((s.requests, s.ok, s.failed), (104, 101, 3));
        assert_eq!(s.errors.get("http_503"), Some(&2));
        assert_eq!(s.errors.get("timeout"), Some(&1));
        assert_eq!(s.good, 50, "TTFT 1..=50 ms with ITL 3 ms");
        assert!((s.goodput - 25.0).abs() < 1e-9);
        assert!((s.request_throughput - 50.5).abs() < 1e-9);
        assert_eq!(s.output_tokens, 303);
        assert_eq!(s.disaggregated, 101);
        assert_eq!(s.local, 3);
        assert!((s.ttft_ms.p50 - 50.0).abs() < 0.1, "{:?}", s.ttft_ms);
        assert!((s.ttft_ms.p99 - 99.0).abs() < 0.1, "{:?}", s.ttft_ms);
        assert!((s.ttft_ms.max - 100.0).abs() < 0.1);
        assert_eq!(s.itl_ms.count, 202);
        assert!((s.itl_ms.min - 2.0).abs() < 0.01 && (s.itl_ms.p50 - 4.0).abs() < 0.01, "{:?}", s.itl_ms);
        assert!((s.itl_ms.max - 20.0).abs() < 0.02, "{:?}", s.itl_ms);
        assert_eq!(c.ttft_samples.len(), 101);
        let t = s.table();
        assert!(t.contains("101 ok, 3 failed") && t.contains("http_503=2") && t.contains("goodput"), "{t}");
    }

    #[test]
    fn slo_without_limits_counts_every_success() {
        let slo = Slo::default();
        assert!(slo.met(&ok(1000, &[1000])));
        assert!(!slo.met(&Outcome { error: Some(ErrorKind::Connect), ..Default::default() }));
        // Non-streaming requests have no ITL: only the TTFT SLO applies.
        let s = Slo { ttft_ms: Some(10.0), itl_ms: Some(1.0) };
        assert!(s.met(&ok(5, &[])));
        assert!(!s.met(&ok(15, &[])));
    }
}
