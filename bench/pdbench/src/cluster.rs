//! A local simulated P/D cluster: `pd-sim` engines on free ports (each in its own process
//! group, stopped when the cluster drops), and the measurements scraped from their `/metrics`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde::Serialize;

use crate::metrics;
use crate::procs::{free_port, Group, Proc, ProcError};

/// An engine of the cluster.
#[derive(Debug, Clone, Serialize)]
pub struct Engine {
    pub name: String,
    /// "prefill", "decode" or "both".
    pub role: String,
    pub url: String,
    /// None for engines pdbench did not start (`--vllm`).
    pub pid: Option<u32>,
    /// Where its KV-event publisher can be reached (`tcp://127.0.0.1:port`), when it has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
}

/// How to start simulated engines.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub bin: PathBuf,
    /// Extra flags for every `pd-sim`.
    pub args: Vec<String>,
    pub prefill_us_per_token: u64,
    pub decode_us_per_token: u64,
    /// Each engine publishes KV events on a free port (for a coordinator).
    pub kv_events: bool,
    /// Keep each engine's KV pool in a shared-memory file in this directory (for sidecar pull).
    pub shm_dir: Option<PathBuf>,
    pub startup_timeout: Duration,
}

/// Running engines; dropping this stops them.
#[derive(Debug)]
pub struct SimCluster {
    pub engines: Vec<Engine>,
    pub group: Group,
    pub log_dir: PathBuf,
    /// Shared-memory pool files, removed once the engines are stopped.
    shm_files: Vec<PathBuf>,
}

impl Drop for SimCluster {
    fn drop(&mut self) {
        self.group.stop();
        for f in &self.shm_files {
            let _ = std::fs::remove_file(f);
        }
    }
}

impl SimCluster {
    /// Starts one `pd-sim` per `(name, role)` and waits until each answers `/health`.
    pub async fn start(
        names: &[(String, &str)],
        opts: &SimOptions,
        log_dir: &Path,
        http: &reqwest::Client,
    ) -> Result<SimCluster, ProcError> {
        let mut cluster = SimCluster {
            engines: Vec::new(),
            group: Group::default(),
            log_dir: log_dir.to_path_buf(),
            shm_files: Vec::new(),
        };
        // Spawn all, then wait for all: startups overlap.
        let mut pending = Vec::new();
        for (name, role) in names {
            let port = free_port()?;
            let mut cmd = Command::new(&opts.bin);
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--engine-id", name])
                .args(["--prefill-us-per-token", &opts.prefill_us_per_token.to_string()])
                .args(["--decode-us-per-token", &opts.decode_us_per_token.to_string()])
                .args(["--workers", "1"])
                .env_remove("VLLM_HOST_IP")
                .env_remove("VLLM_NIXL_SIDE_CHANNEL_PORT")
                .env_remove("PD_SIM_PORT")
                .env_remove("PD_SIM_HOST")
                .env_remove("PD_SIM_CONFIG")
                .env("RUST_LOG", std::env::var("PDBENCH_CHILD_LOG").unwrap_or_else(|_| "warn".into()));
            let kv_events = if opts.kv_events {
                let port = free_port()?;
                cmd.args(["--kv-events-endpoint", &format!("tcp://*:{port}")]);
                Some(format!("tcp://127.0.0.1:{port}"))
            } else {
                None
            };
            if let Some(dir) = &opts.shm_dir {
                let f = dir.join(format!("pdbench-{}-{name}", std::process::id()));
                cmd.arg("--shm-path").arg(&f);
                cluster.shm_files.push(f);
            }
            cmd.args(&opts.args);
            let p = Proc::spawn(name, cmd, log_dir)?;
            tracing::debug!(name, bin = %opts.bin.display(), "engine started");
            let url = format!("http://127.0.0.1:{port}");
            cluster.engines.push(Engine {
                name: name.clone(),
                role: role.to_string(),
                url: url.clone(),
                pid: Some(p.pid()),
                kv_events,
            });
            cluster.group.push(p);
            pending.push(url);
        }
        for (i, url) in pending.iter().enumerate() {
            cluster.group.proc_mut(i).wait_healthy(http, &format!("{url}/health"), opts.startup_timeout).await?;
        }
        Ok(cluster)
    }

    pub fn urls(&self, role: &str) -> Vec<String> {
        self.engines.iter().filter(|e| e.role == role).map(|e| e.url.clone()).collect()
    }
}

/// Counters summed over engines at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Counters {
    pub kv_bytes: f64,
    pub kv_xfer_seconds: f64,
    pub kv_transfers: f64,
    pub kv_failed_transfers: f64,
    pub prefix_hits: f64,
    pub prefix_queries: f64,
}

impl Counters {
    pub fn from_text(text: &str) -> Counters {
        Counters {
            // The simulator (and newer clients) expose `_total`; vLLM's may be a histogram.
            kv_bytes: metrics::sum_any(
                text,
                &[
                    "vllm:nixl_bytes_transferred_total",
                    "vllm:nixl_bytes_transferred_sum",
                    "vllm:nixl_bytes_transferred",
                ],
            ),
            kv_xfer_seconds: metrics::sum(text, "vllm:nixl_xfer_time_seconds_sum"),
            kv_transfers: metrics::sum(text, "vllm:nixl_xfer_time_seconds_count"),
            kv_failed_transfers: metrics::sum_any(
                text,
                &["vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_transfers"],
            ),
            prefix_hits: metrics::sum_any(text, &["vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"]),
            prefix_queries: metrics::sum_any(text, &["vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries"]),
        }
    }

    pub fn plus(self, o: Counters) -> Counters {
        Counters {
            kv_bytes: self.kv_bytes + o.kv_bytes,
            kv_xfer_seconds: self.kv_xfer_seconds + o.kv_xfer_seconds,
            kv_transfers: self.kv_transfers + o.kv_transfers,
            kv_failed_transfers: self.kv_failed_transfers + o.kv_failed_transfers,
            prefix_hits: self.prefix_hits + o.prefix_hits,
            prefix_queries: self.prefix_queries + o.prefix_queries,
        }
    }

    pub fn since(self, before: Counters) -> Counters {
        Counters {
            kv_bytes: self.kv_bytes - before.kv_bytes,
            kv_xfer_seconds: self.kv_xfer_seconds - before.kv_xfer_seconds,
            kv_transfers: self.kv_transfers - before.kv_transfers,
            kv_failed_transfers: self.kv_failed_transfers - before.kv_failed_transfers,
            prefix_hits: self.prefix_hits - before.prefix_hits,
            prefix_queries: self.prefix_queries - before.prefix_queries,
        }
    }
}

/// Scrapes every engine's `/metrics` and sums the counters (an unreachable engine counts 0 and
/// is named in the returned list).
pub async fn scrape(http: &reqwest::Client, engines: &[Engine]) -> (Counters, Vec<String>) {
    let mut total = Counters::default();
    let mut unreachable = Vec::new();
    for e in engines {
        let text = match http.get(format!("{}/metrics", e.url)).timeout(Duration::from_secs(5)).send().await {
            Ok(r) if r.status().is_success() => r.text().await.ok(),
            _ => None,
        };
        match text {
            Some(t) => total = total.plus(Counters::from_text(&t)),
            None => unreachable.push(e.name.clone()),
        }
    }
    (total, unreachable)
}

/// Clears every engine's prefix cache (`POST /reset_prefix_cache`), so that runs compared
/// side by side start cold.
pub async fn reset_prefix_caches(http: &reqwest::Client, engines: &[Engine]) -> anyhow::Result<()> {
    for e in engines {
        let r = http.post(format!("{}/reset_prefix_cache", e.url)).timeout(Duration::from_secs(5)).send().await?;
        anyhow::ensure!(r.status().is_success(), "{}: reset_prefix_cache answered {}", e.name, r.status());
    }
    Ok(())
}

/// KV movement and prefix caching over a run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct KvReport {
    pub bytes: f64,
    pub transfers: f64,
    pub failed_transfers: f64,
    pub xfer_seconds: f64,
    /// bytes / xfer_seconds, in 10^9 bytes per second (0 when nothing moved).
    pub gb_per_s: f64,
    pub prefix_hits: f64,
    pub prefix_queries: f64,
    pub prefix_hit_rate: f64,
}

impl From<Counters> for KvReport {
    fn from(c: Counters) -> Self {
        KvReport {
            bytes: c.kv_bytes,
            transfers: c.kv_transfers,
            failed_transfers: c.kv_failed_transfers,
            xfer_seconds: c.kv_xfer_seconds,
            gb_per_s: if c.kv_xfer_seconds > 0.0 { c.kv_bytes / c.kv_xfer_seconds / 1e9 } else { 0.0 },
            prefix_hits: c.prefix_hits,
            prefix_queries: c.prefix_queries,
            prefix_hit_rate: if c.prefix_queries > 0.0 { c.prefix_hits / c.prefix_queries } else { 0.0 },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_from_metrics_and_deltas() {
        let text = "vllm:nixl_bytes_transferred_total{engine=\"d\"} 4096\nvllm:nixl_xfer_time_seconds_sum 0.002\nvllm:nixl_xfer_time_seconds_count 2\nvllm:prefix_cache_hits_total 30\nvllm:prefix_cache_queries_total 120\n";
        let c = Counters::from_text(text);
        assert_eq!((c.kv_bytes, c.kv_transfers, c.prefix_hits, c.prefix_queries), (4096.0, 2.0, 30.0, 120.0));
        let r = KvReport::from(c.since(Counters { kv_bytes: 96.0, ..Default::default() }));
        assert_eq!(r.bytes, 4000.0);
        assert!((r.gb_per_s - 0.002).abs() < 1e-12);
        assert!((r.prefix_hit_rate - 0.25).abs() < 1e-12);
        // vLLM's histogram form.
        assert_eq!(Counters::from_text("vllm:nixl_bytes_transferred_sum 10\n").kv_bytes, 10.0);
    }
}
