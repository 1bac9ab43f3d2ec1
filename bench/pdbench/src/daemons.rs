//! The suite's own daemons around simulated engines: one `pd-coordinator`, and one
//! `pd-sidecar` in front of every engine (registering it, with its KV events, at the
//! coordinator). Clients enter through the decode engines' sidecars, which ask the coordinator
//! for a prefill and do the handoff.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cluster::Engine;
use crate::metrics;
use crate::procs::{free_port, Group, Proc, ProcError};

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error("the coordinator at {url} listed {seen} of {want} engines after {secs} s")]
    NotRegistered { url: String, seen: usize, want: usize, secs: u64 },
}

/// Where the daemons' binaries are and how long they get to start.
#[derive(Debug, Clone)]
pub struct DaemonOptions {
    pub coordinator_bin: PathBuf,
    pub sidecar_bin: PathBuf,
    pub model: String,
    pub startup_timeout: Duration,
    /// Extra flags for the coordinator and for every sidecar.
    pub coordinator_args: Vec<String>,
    pub sidecar_args: Vec<String>,
    /// Sidecar P/D protocol: `vllm` (the decode engine pulls) or `pull` (the decode's sidecar
    /// pulls into the engine's shared-memory pool).
    pub sidecar_mode: String,
}

/// A sidecar in front of one engine.
#[derive(Debug, Clone, Serialize)]
pub struct Sidecar {
    pub engine: String,
    pub role: String,
    pub url: String,
    pub pid: u32,
}

/// Running daemons; dropping this stops them.
#[derive(Debug)]
pub struct Daemons {
    pub coordinator_url: String,
    pub coordinator_pid: u32,
    pub sidecars: Vec<Sidecar>,
    pub group: Group,
}

fn child_log() -> String {
    std::env::var("PDBENCH_CHILD_LOG").unwrap_or_else(|_| "warn".into())
}

impl Daemons {
    /// Starts the coordinator, then a sidecar per engine, and waits until the coordinator knows
    /// every engine (so the first requests are already paired).
    pub async fn start(
        engines: &[Engine],
        opts: &DaemonOptions,
        log_dir: &std::path::Path,
        http: &reqwest::Client,
    ) -> Result<Daemons, DaemonError> {
        let mut group = Group::default();
        let port = free_port()?;
        let coordinator_url = format!("http://127.0.0.1:{port}");
        let mut cmd = Command::new(&opts.coordinator_bin);
        cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--grpc-listen", &format!("127.0.0.1:{}", free_port()?)])
            .args(["--no-grpc", "--workers", "1"])
            .env("RUST_LOG", child_log())
            .env_remove("PD_COORDINATOR_CONFIG")
            .args(&opts.coordinator_args);
        let coordinator = group.push(Proc::spawn("coordinator", cmd, log_dir)?);
        let coordinator_pid = coordinator.pid();
        coordinator.wait_healthy(http, &format!("{coordinator_url}/health"), opts.startup_timeout).await?;

        let mut sidecars = Vec::new();
        for e in engines {
            let port = free_port()?;
            let url = format!("http://127.0.0.1:{port}");
            let mut cmd = Command::new(&opts.sidecar_bin);
            cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--engine", &e.url, "--mode", &opts.sidecar_mode])
                .args(["--coordinator", &coordinator_url, "--engine-id", &e.name, "--role", &e.role])
                // pd-sim's agent is its engine id: prefills grant it the blocks it reads.
                .args(["--engine-xfer-agent", &e.name])
                .args(["--node", "local", "--model", &opts.model, "--advertise-url", &url, "--workers", "1"])
                .env("RUST_LOG", child_log())
                .env_remove("PD_SIDECAR_CONFIG");
            if let Some(ev) = &e.kv_events {
                cmd.args(["--kv-events", ev]);
            }
            // Without a pairing (coordinator unreachable) a decode sidecar falls back to the
            // static list: every prefill engine.
            if e.role != "prefill" {
                for p in engines.iter().filter(|p| p.role == "prefill") {
                    cmd.args(["--prefill", &p.url]);
                }
            }
            cmd.args(&opts.sidecar_args);
            let p = group.push(Proc::spawn(&format!("sidecar-{}", e.name), cmd, log_dir)?);
            sidecars.push(Sidecar { engine: e.name.clone(), role: e.role.clone(), url, pid: p.pid() });
        }
        for (i, s) in sidecars.iter().enumerate() {
            group.proc_mut(i + 1).wait_healthy(http, &format!("{}/health", s.url), opts.startup_timeout).await?;
        }
        let daemons = Daemons { coordinator_url, coordinator_pid, sidecars, group };
        daemons.wait_registered(http, engines.len(), opts.startup_timeout).await?;
        Ok(daemons)
    }

    async fn wait_registered(&self, http: &reqwest::Client, want: usize, timeout: Duration) -> Result<(), DaemonError> {
        let deadline = Instant::now() + timeout;
        let url = format!("{}/v1/engines", self.coordinator_url);
        loop {
            let seen = match http.get(&url).timeout(Duration::from_secs(2)).send().await {
                Ok(r) => r.json::<serde_json::Value>().await.ok().and_then(|v| v.as_array().map(Vec::len)).unwrap_or(0),
                Err(_) => 0,
            };
            if seen >= want {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(DaemonError::NotRegistered { url, seen, want, secs: timeout.as_secs() });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The decode-capable sidecars (role `decode` or `both`): where clients send requests.
    pub fn entry_urls(&self) -> Vec<String> {
        self.sidecars.iter().filter(|s| s.role != "prefill").map(|s| s.url.clone()).collect()
    }

    /// Decisions as the daemons counted them.
    pub async fn decisions(&self, http: &reqwest::Client) -> Decisions {
        let mut d = Decisions::default();
        for s in &self.sidecars {
            if let Some(t) = get_text(http, &format!("{}/metrics", s.url)).await {
                d.sidecar_disaggregated += metrics::sum(&t, "pd_sidecar_disaggregated_total");
                d.sidecar_local += metrics::sum(&t, "pd_sidecar_local_decode_total");
                let local =
                    |r: &str| metrics::sum_labeled(&t, "pd_sidecar_local_decode_total", &format!("reason=\"{r}\""));
                d.local_reasons = d.local_reasons.plus(LocalReasons {
                    coordinator: local("coordinator"),
                    threshold: local("threshold"),
                    prefill_failed: local("prefill_failed"),
                    null_params: local("null_params"),
                    no_candidate: local("no_candidate"),
                });
                d.sidecar_pull_bytes += metrics::sum(&t, "pd_sidecar_pull_bytes_total");
                d.sidecar_pulls += metrics::sum(&t, "pd_sidecar_pulls_ok_total");
                d.sidecar_handoff_seconds +=
                    metrics::sum_labeled(&t, "pd_sidecar_phase_seconds_sum", "phase=\"kv_handoff\"");
                d.sidecar_pairing_seconds +=
                    metrics::sum_labeled(&t, "pd_sidecar_phase_seconds_sum", "phase=\"pairing\"");
                d.sidecar_pairing_calls +=
                    metrics::sum_labeled(&t, "pd_sidecar_phase_seconds_count", "phase=\"pairing\"");
            }
        }
        if let Some(t) = get_text(http, &format!("{}/metrics", self.coordinator_url)).await {
            let by =
                |r: &str| metrics::sum_labeled(&t, "pd_coordinator_pair_decisions_total", &format!("reason=\"{r}\""));
            d.coordinator_disaggregated = by("disaggregated");
            d.coordinator_local_prefill = by("local_prefill");
            d.coordinator_no_decode = by("no_decode");
            d.coordinator_invalid = by("invalid");
            d.coordinator_moved = metrics::sum(&t, "pd_coordinator_pair_moved_total");
            d.coordinator_pair_seconds = metrics::sum(&t, "pd_coordinator_pair_latency_seconds_sum");
        }
        d
    }
}

async fn get_text(http: &reqwest::Client, url: &str) -> Option<String> {
    let r = http.get(url).timeout(Duration::from_secs(5)).send().await.ok()?;
    if !r.status().is_success() {
        return None;
    }
    r.text().await.ok()
}

/// Disaggregated vs local decisions, from the sidecars' and the coordinator's counters.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Decisions {
    pub sidecar_disaggregated: f64,
    pub sidecar_local: f64,
    pub coordinator_disaggregated: f64,
    pub coordinator_local_prefill: f64,
    /// Pairing requests the coordinator could not answer: no live decode engine, or malformed.
    pub coordinator_no_decode: f64,
    pub coordinator_invalid: f64,
    /// Answers that moved the request to another engine than the asking sidecar's.
    pub coordinator_moved: f64,
    /// Time in the coordinator's pairing handler (answers only).
    pub coordinator_pair_seconds: f64,
    /// The sidecars' pairing calls and their time, as the sidecars saw it (HTTP and queueing
    /// included).
    pub sidecar_pairing_calls: f64,
    pub sidecar_pairing_seconds: f64,
    /// Why the sidecars decoded requests without a prefill leg.
    pub local_reasons: LocalReasons,
    /// Sidecar pull mode: bytes the sidecars pulled, their pulls, and time in the KV handoff phase.
    pub sidecar_pull_bytes: f64,
    pub sidecar_pulls: f64,
    pub sidecar_handoff_seconds: f64,
}

impl Decisions {
    pub fn since(self, b: Decisions) -> Decisions {
        Decisions {
            sidecar_disaggregated: self.sidecar_disaggregated - b.sidecar_disaggregated,
            sidecar_local: self.sidecar_local - b.sidecar_local,
            coordinator_disaggregated: self.coordinator_disaggregated - b.coordinator_disaggregated,
            coordinator_local_prefill: self.coordinator_local_prefill - b.coordinator_local_prefill,
            coordinator_no_decode: self.coordinator_no_decode - b.coordinator_no_decode,
            coordinator_invalid: self.coordinator_invalid - b.coordinator_invalid,
            coordinator_moved: self.coordinator_moved - b.coordinator_moved,
            coordinator_pair_seconds: self.coordinator_pair_seconds - b.coordinator_pair_seconds,
            sidecar_pairing_calls: self.sidecar_pairing_calls - b.sidecar_pairing_calls,
            sidecar_pairing_seconds: self.sidecar_pairing_seconds - b.sidecar_pairing_seconds,
            local_reasons: self.local_reasons.minus(b.local_reasons),
            sidecar_pull_bytes: self.sidecar_pull_bytes - b.sidecar_pull_bytes,
            sidecar_pulls: self.sidecar_pulls - b.sidecar_pulls,
            sidecar_handoff_seconds: self.sidecar_handoff_seconds - b.sidecar_handoff_seconds,
        }
    }
}

/// The sidecars' `pd_sidecar_local_decode_total{reason=…}`: why a request ran without a prefill
/// leg.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LocalReasons {
    /// The coordinator's pairing named no prefill (its conditional-disaggregation rule).
    pub coordinator: f64,
    /// The prompt was under the sidecar's `--local-prefill-below-tokens`.
    pub threshold: f64,
    /// Every prefill candidate failed and the sidecar's policy is to prefill locally.
    pub prefill_failed: f64,
    /// The prefill answered without `kv_transfer_params`.
    pub null_params: f64,
    /// There was no prefill engine to ask.
    pub no_candidate: f64,
}

impl LocalReasons {
    fn zip(self, o: LocalReasons, f: impl Fn(f64, f64) -> f64) -> LocalReasons {
        LocalReasons {
            coordinator: f(self.coordinator, o.coordinator),
            threshold: f(self.threshold, o.threshold),
            prefill_failed: f(self.prefill_failed, o.prefill_failed),
            null_params: f(self.null_params, o.null_params),
            no_candidate: f(self.no_candidate, o.no_candidate),
        }
    }

    pub fn plus(self, o: LocalReasons) -> LocalReasons {
        self.zip(o, |a, b| a + b)
    }

    pub fn minus(self, o: LocalReasons) -> LocalReasons {
        self.zip(o, |a, b| a - b)
    }

    /// Each reason with its count, its metric label and what it means in plain words, largest
    /// first; reasons with none left out.
    pub fn explained(&self) -> Vec<(f64, &'static str, &'static str)> {
        let mut v = vec![
            (
                self.coordinator,
                "coordinator",
                "the coordinator: the prompt was mostly cached on the decode, so the decode prefilled the rest",
            ),
            (self.threshold, "threshold", "prompt shorter than the sidecar's --local-prefill-below-tokens"),
            (self.prefill_failed, "prefill_failed", "every prefill attempt failed, so the decode prefilled it"),
            (self.null_params, "null_params", "the prefill answered without kv_transfer_params"),
            (self.no_candidate, "no_candidate", "no prefill engine to ask"),
        ];
        v.retain(|(n, _, _)| *n > 0.0);
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
        v
    }
}
