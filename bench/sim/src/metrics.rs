//! Prometheus metrics under vLLM's names (gauges filled in at scrape time), plus the
//! simulator's transfer and leak counters. Hand-written text exposition: a handful of atomics.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// vLLM's TTFT buckets, seconds.
const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const XFER_BUCKETS: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_micros: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        let i = self.bounds.iter().position(|&b| secs <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((secs * 1e6) as u64, Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0;
        for (i, bound) in self.bounds.iter().enumerate() {
            cumulative += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound}\"}} {cumulative}");
        }
        cumulative += self.counts[self.bounds.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum_micros.load(Relaxed) as f64 / 1e6);
        let _ = writeln!(out, "{name}_count{{{labels}}} {cumulative}");
    }
}

#[derive(Debug)]
pub struct Metrics {
    pub requests_ok: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub prefix_cache_queries: AtomicU64,
    pub prefix_cache_hits: AtomicU64,
    pub prompt_tokens_local: AtomicU64,
    pub prompt_tokens_cached: AtomicU64,
    pub prompt_tokens_transferred: AtomicU64,
    pub ttft: Histogram,
    pub xfer_time: Histogram,
    pub bytes_pulled: AtomicU64,
    pub pulls_ok: AtomicU64,
    /// Decode side: pulls that read under the prefill's grant (a subset of `pulls_ok`).
    pub granted_pulls: AtomicU64,
    pub failed_pulls: AtomicU64,
    pub verification_failures: AtomicU64,
    pub invalid_params: AtomicU64,
    pub recomputed: AtomicU64,
    pub leases_started: AtomicU64,
    pub leases_done: AtomicU64,
    pub expired_leases: AtomicU64,
    pub heartbeats_sent: AtomicU64,
    pub heartbeats_received: AtomicU64,
    pub rooms_timed_out: AtomicU64,
    pub rooms_rejected: AtomicU64,
    pub injected_errors: AtomicU64,
    pub grants_issued: AtomicU64,
    pub grants_revoked: AtomicU64,
    /// Decode side: reads the prefill refused because it had revoked the grant.
    pub late_reads_refused: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        let z = || AtomicU64::new(0);
        Metrics {
            requests_ok: z(),
            requests_failed: z(),
            prompt_tokens: z(),
            generation_tokens: z(),
            prefix_cache_queries: z(),
            prefix_cache_hits: z(),
            prompt_tokens_local: z(),
            prompt_tokens_cached: z(),
            prompt_tokens_transferred: z(),
            ttft: Histogram::new(TTFT_BUCKETS),
            xfer_time: Histogram::new(XFER_BUCKETS),
            bytes_pulled: z(),
            pulls_ok: z(),
            granted_pulls: z(),
            failed_pulls: z(),
            verification_failures: z(),
            invalid_params: z(),
            recomputed: z(),
            leases_started: z(),
            leases_done: z(),
            expired_leases: z(),
            heartbeats_sent: z(),
            heartbeats_received: z(),
            rooms_timed_out: z(),
            rooms_rejected: z(),
            injected_errors: z(),
            grants_issued: z(),
            grants_revoked: z(),
            late_reads_refused: z(),
        }
    }
}

/// Values read from the engine at scrape time.
#[derive(Debug, Default)]
pub struct Gauges {
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub held_blocks: usize,
    pub leases: usize,
    pub rooms: usize,
    pub block_size: usize,
}

pub fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Relaxed);
}

impl Metrics {
    pub fn render(&self, model: &str, engine: &str, g: &Gauges) -> String {
        let labels = format!("model_name=\"{model}\",engine=\"{engine}\"");
        let mut out = String::with_capacity(8192);
        let mut gauge = |name: &str, v: f64| {
            let _ = writeln!(out, "# TYPE {name} gauge\n{name}{{{labels}}} {v}");
        };
        gauge("vllm:num_requests_running", g.running as f64);
        gauge("vllm:num_requests_waiting", g.waiting as f64);
        gauge("vllm:kv_cache_usage_perc", g.kv_usage);
        gauge("pdsim:held_blocks", g.held_blocks as f64);
        gauge("pdsim:active_leases", g.leases as f64);
        gauge("pdsim:active_rooms", g.rooms as f64);
        let _ = writeln!(
            out,
            "# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\"}} 1",
            g.block_size
        );
        let counters: [(&str, &AtomicU64); 24] = [
            ("vllm:request_success", &self.requests_ok),
            ("pdsim:request_failed", &self.requests_failed),
            ("vllm:prompt_tokens", &self.prompt_tokens),
            ("vllm:generation_tokens", &self.generation_tokens),
            ("vllm:prefix_cache_queries", &self.prefix_cache_queries),
            ("vllm:prefix_cache_hits", &self.prefix_cache_hits),
            ("vllm:nixl_bytes_transferred", &self.bytes_pulled),
            ("vllm:nixl_num_failed_transfers", &self.failed_pulls),
            ("vllm:nixl_num_kv_expired_reqs", &self.expired_leases),
            ("pdsim:pulls", &self.pulls_ok),
            ("pdsim:granted_pulls", &self.granted_pulls),
            ("pdsim:verification_failures", &self.verification_failures),
            ("pdsim:invalid_kv_transfer_params", &self.invalid_params),
            ("pdsim:recomputed_prompts", &self.recomputed),
            ("pdsim:leases_started", &self.leases_started),
            ("pdsim:leases_done", &self.leases_done),
            ("pdsim:heartbeats_sent", &self.heartbeats_sent),
            ("pdsim:heartbeats_received", &self.heartbeats_received),
            ("pdsim:rooms_timed_out", &self.rooms_timed_out),
            ("pdsim:rooms_rejected", &self.rooms_rejected),
            ("pdsim:injected_errors", &self.injected_errors),
            ("pdsim:grants_issued", &self.grants_issued),
            ("pdsim:grants_revoked", &self.grants_revoked),
            ("pdsim:late_reads_refused", &self.late_reads_refused),
        ];
        for (name, c) in counters {
            let _ = writeln!(out, "# TYPE {name} counter\n{name}_total{{{labels}}} {}", c.load(Relaxed));
        }
        let _ = writeln!(out, "# TYPE vllm:prompt_tokens_by_source counter");
        for (source, c) in [
            ("local_compute", &self.prompt_tokens_local),
            ("local_cache_hit", &self.prompt_tokens_cached),
            ("external_kv_transfer", &self.prompt_tokens_transferred),
        ] {
            let _ =
                writeln!(out, "vllm:prompt_tokens_by_source_total{{{labels},source=\"{source}\"}} {}", c.load(Relaxed));
        }
        self.ttft.render(&mut out, "vllm:time_to_first_token_seconds", &labels);
        self.xfer_time.render(&mut out, "vllm:nixl_xfer_time_seconds", &labels);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_names_and_histogram() {
        let m = Metrics::default();
        m.ttft.observe(0.003);
        m.ttft.observe(100.0);
        add(&m.prefix_cache_hits, 32);
        let text = m.render("m", "e", &Gauges { running: 2, kv_usage: 0.5, block_size: 16, ..Default::default() });
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\",engine=\"e\"} 2\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"e\"} 0.5\n"));
        assert!(text.contains("vllm:prefix_cache_hits_total{model_name=\"m\",engine=\"e\"} 32\n"));
        assert!(
            text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",engine=\"e\",le=\"0.005\"} 1\n")
        );
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\",engine=\"e\"} 2\n"));
    }
}
