//! The daemon's counters and their Prometheus text form. Gauges (engines, handoffs, index
//! sizes) are read from the state when `/metrics` is scraped.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the pair-latency histogram, seconds.
const LATENCY_BUCKETS: [f64; 12] =
    [25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3];

#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(elapsed.as_nanos().min(u128::from(u64::MAX)) as u64, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let _ = writeln!(out, "{name}_sum {}", self.sum_ns.load(Ordering::Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_count {count}");
    }
}

/// Why an engine left.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeathCause {
    Lease,
    Health,
    Deregistered,
    Store,
    /// Its node was reported down (`POST /v1/nodes/{node}/down`).
    Node,
}

impl DeathCause {
    const ALL: [DeathCause; 5] =
        [DeathCause::Lease, DeathCause::Health, DeathCause::Deregistered, DeathCause::Store, DeathCause::Node];

    pub fn as_str(self) -> &'static str {
        match self {
            DeathCause::Lease => "lease",
            DeathCause::Health => "health",
            DeathCause::Deregistered => "deregistered",
            DeathCause::Store => "store",
            DeathCause::Node => "node",
        }
    }
}

/// What happened to a release of held blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// POST {sidecar}/pd/release answered 2xx.
    Posted,
    /// The call failed; the release waits in the prefill sidecar's heartbeat notices.
    Noticed,
    /// The prefill has no sidecar: its engine's own lease frees the blocks.
    NoSidecar,
}

impl ReleaseOutcome {
    const ALL: [ReleaseOutcome; 3] = [ReleaseOutcome::Posted, ReleaseOutcome::Noticed, ReleaseOutcome::NoSidecar];

    fn as_str(self) -> &'static str {
        match self {
            ReleaseOutcome::Posted => "posted",
            ReleaseOutcome::Noticed => "noticed",
            ReleaseOutcome::NoSidecar => "no_sidecar",
        }
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub registrations: AtomicU64,
    pub heartbeats: AtomicU64,
    pub pair_disaggregated: AtomicU64,
    pub pair_local_prefill: AtomicU64,
    /// Answers naming a decode other than the asking sidecar's engine (the request moves there).
    pub pair_moved: AtomicU64,
    pub pair_no_decode: AtomicU64,
    pub pair_invalid: AtomicU64,
    pub pair_latency: Histogram,
    pub reports: AtomicU64,
    pub event_batches: AtomicU64,
    pub events: AtomicU64,
    pub block_events: AtomicU64,
    pub events_malformed: AtomicU64,
    pub events_unknown_topic: AtomicU64,
    pub event_gaps: AtomicU64,
    pub event_replays: AtomicU64,
    pub event_replayed_batches: AtomicU64,
    pub event_resets: AtomicU64,
    pub health_failures: AtomicU64,
    deaths: [AtomicU64; 5],
    /// Dead engines removed from membership after `--forget-dead-after-secs`.
    pub forgotten: AtomicU64,
    releases: [AtomicU64; 3],
    pub store_errors: AtomicU64,
}

/// Values read from the state at scrape time.
#[derive(Clone, Debug, Default)]
pub struct Gauges {
    pub engines_alive: u64,
    pub engines_dead: u64,
    pub handoffs_in_flight: u64,
    pub pending_releases: u64,
    /// (model, blocks, entries)
    pub index: Vec<(String, u64, u64)>,
}

pub fn inc(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

impl Metrics {
    pub fn death(&self, cause: DeathCause) {
        inc(&self.deaths[cause as usize]);
    }

    pub fn release(&self, outcome: ReleaseOutcome) {
        inc(&self.releases[outcome as usize]);
    }

    pub fn render(&self, gauges: &Gauges) -> String {
        let mut out = String::with_capacity(4096);
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut family = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(out, "# HELP pd_coordinator_{name} {help}\n# TYPE pd_coordinator_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "pd_coordinator_{name}{labels} {value}");
            }
        };
        family(
            "engines",
            "gauge",
            "Engines known, by liveness.",
            &[("{state=\"alive\"}", gauges.engines_alive), ("{state=\"dead\"}", gauges.engines_dead)],
        );
        family(
            "registrations_total",
            "counter",
            "Engine registrations and renewals.",
            &[("", get(&self.registrations))],
        );
        family("heartbeats_total", "counter", "Heartbeats accepted.", &[("", get(&self.heartbeats))]);
        let deaths: Vec<(String, u64)> = DeathCause::ALL
            .iter()
            .map(|c| (format!("{{cause=\"{}\"}}", c.as_str()), get(&self.deaths[*c as usize])))
            .collect();
        let deaths: Vec<(&str, u64)> = deaths.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        family("engine_deaths_total", "counter", "Engines that left pairing, by cause.", &deaths);
        family(
            "engines_forgotten_total",
            "counter",
            "Dead engines removed from membership (dead longer than --forget-dead-after-secs).",
            &[("", get(&self.forgotten))],
        );
        family(
            "health_check_failures_total",
            "counter",
            "Failed engine /health checks.",
            &[("", get(&self.health_failures))],
        );
        family(
            "pair_decisions_total",
            "counter",
            "Pairing answers, by reason.",
            &[
                ("{reason=\"disaggregated\"}", get(&self.pair_disaggregated)),
                ("{reason=\"local_prefill\"}", get(&self.pair_local_prefill)),
                ("{reason=\"no_decode\"}", get(&self.pair_no_decode)),
                ("{reason=\"invalid\"}", get(&self.pair_invalid)),
            ],
        );
        family(
            "pair_moved_total",
            "counter",
            "Pairing answers whose decode is not the asking sidecar's engine (the request moves there).",
            &[("", get(&self.pair_moved))],
        );
        family(
            "reports_total",
            "counter",
            "Request progress reports (a final report carrying decode_started counts as two).",
            &[("", get(&self.reports))],
        );
        family("kv_event_batches_total", "counter", "KV-event batches ingested.", &[("", get(&self.event_batches))]);
        family("kv_events_total", "counter", "KV events ingested.", &[("", get(&self.events))]);
        family(
            "kv_block_events_total",
            "counter",
            "Blocks stored or removed by ingested events.",
            &[("", get(&self.block_events))],
        );
        family(
            "kv_events_malformed_total",
            "counter",
            "Event messages that did not decode.",
            &[("", get(&self.events_malformed))],
        );
        family(
            "kv_events_unknown_topic_total",
            "counter",
            "Messages on the --kv-events-listen socket whose topic names no registered engine.",
            &[("", get(&self.events_unknown_topic))],
        );
        family(
            "kv_event_gaps_total",
            "counter",
            "Sequence gaps seen on event subscriptions.",
            &[("", get(&self.event_gaps))],
        );
        family(
            "kv_event_replays_total",
            "counter",
            "Replay requests sent to engines.",
            &[("", get(&self.event_replays))],
        );
        family(
            "kv_event_replayed_batches_total",
            "counter",
            "Batches received through replay.",
            &[("", get(&self.event_replayed_batches))],
        );
        family(
            "kv_event_resets_total",
            "counter",
            "Times an engine's index entries were dropped (lost history, publisher restart).",
            &[("", get(&self.event_resets))],
        );
        family("handoffs_in_flight", "gauge", "Routed requests not yet finished.", &[("", gauges.handoffs_in_flight)]);
        let releases: Vec<(String, u64)> = ReleaseOutcome::ALL
            .iter()
            .map(|o| (format!("{{outcome=\"{}\"}}", o.as_str()), get(&self.releases[*o as usize])))
            .collect();
        let releases: Vec<(&str, u64)> = releases.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        family("releases_total", "counter", "Releases of blocks held for a dead decode, by outcome.", &releases);
        family(
            "pending_releases",
            "gauge",
            "Releases waiting for the prefill sidecar's heartbeat.",
            &[("", gauges.pending_releases)],
        );
        family(
            "store_errors_total",
            "counter",
            "Failed calls to the membership store (etcd).",
            &[("", get(&self.store_errors))],
        );
        let labels: Vec<(String, u64, u64)> = gauges
            .index
            .iter()
            .map(|(model, blocks, entries)| (format!("{{model=\"{}\"}}", escape(model)), *blocks, *entries))
            .collect();
        let blocks: Vec<(&str, u64)> = labels.iter().map(|(l, b, _)| (l.as_str(), *b)).collect();
        family("index_blocks", "gauge", "Distinct blocks indexed, per model.", &blocks);
        let entries: Vec<(&str, u64)> = labels.iter().map(|(l, _, e)| (l.as_str(), *e)).collect();
        family("index_entries", "gauge", "(block, engine) entries indexed, per model.", &entries);
        self.pair_latency.render(
            &mut out,
            "pd_coordinator_pair_latency_seconds",
            "Time to answer a pair request (hashing included).",
        );
        out
    }
}

fn escape(label: &str) -> String {
    label.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        inc(&m.pair_disaggregated);
        m.death(DeathCause::Health);
        m.release(ReleaseOutcome::Posted);
        m.pair_latency.observe(Duration::from_micros(70));
        let text = m.render(&Gauges { engines_alive: 3, index: vec![("m\"x".into(), 5, 7)], ..Gauges::default() });
        assert!(text.contains("pd_coordinator_engines{state=\"alive\"} 3"));
        assert!(text.contains("pd_coordinator_pair_decisions_total{reason=\"disaggregated\"} 1"));
        assert!(text.contains("pd_coordinator_engine_deaths_total{cause=\"health\"} 1"));
        assert!(text.contains("pd_coordinator_releases_total{outcome=\"posted\"} 1"));
        assert!(text.contains("pd_coordinator_index_blocks{model=\"m\\\"x\"} 5"));
        assert!(text.contains("pd_coordinator_pair_latency_seconds_bucket{le=\"0.0001\"} 1"));
        assert!(text.contains("pd_coordinator_pair_latency_seconds_count 1"));
    }
}
