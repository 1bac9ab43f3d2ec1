//! The cluster on the namespaces of a [`Net`]: a coordinator node, a client node (the load
//! generator and the harness's own calls) and engine nodes, each running a `pd-sim` and its
//! `pd-sidecar`. Every daemon binds its node's address, so HTTP legs, xfer pulls, KV events,
//! heartbeats and health checks all cross the veth links.
//!
//! The cluster's methods do HTTP, so they must run on a thread that entered the client node
//! ([`Net::enter`]). Processes are pdbench's [`Proc`]s (each in its own process group, killed
//! when the cluster drops); the namespaces go when the [`Net`] drops, after them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use pd_api::EngineView;
use pdbench::metrics;
use pdbench::procs::{Group, Proc, ProcError};

use crate::netns::{Net, NetError};

pub const COORDINATOR_NODE: &str = "coord";
pub const CLIENT_NODE: &str = "client";
pub const MODEL: &str = "sim-model";
const ENGINE_PORT: u16 = 8100;
const SIDECAR_PORT: u16 = 8000;
const XFER_PORT: u16 = 5600;
const KV_EVENTS_PORT: u16 = 5557;
const COORDINATOR_PORT: u16 = 7700;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Proc(#[from] ProcError),
    #[error("the coordinator listed {alive} live engines of {want} after {secs} s")]
    NotRegistered { alive: usize, want: usize, secs: u64 },
    #[error("no engine node named {0}")]
    UnknownEngine(String),
    #[error("building the HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

/// Role of an engine node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

/// The timeouts and leases the cluster runs with; the scenarios' bounds derive from them.
#[derive(Debug, Clone)]
pub struct Timing {
    /// Coordinator: an engine without heartbeat (or failing health checks) is dead after this.
    pub coordinator_lease: Duration,
    pub heartbeat: Duration,
    pub health_interval: Duration,
    pub health_timeout: Duration,
    /// Sidecar: longest prefill leg before failing over.
    pub prefill_timeout: Duration,
    pub connect_timeout: Duration,
    /// Simulator: how long a prefill holds blocks nobody pulls, and the longest pull.
    pub kv_lease: Duration,
    pub pull_timeout: Duration,
    pub prefill_us_per_token: u32,
    pub decode_us_per_token: u32,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            coordinator_lease: Duration::from_secs(2),
            heartbeat: Duration::from_millis(500),
            health_interval: Duration::from_millis(500),
            health_timeout: Duration::from_secs(1),
            prefill_timeout: Duration::from_secs(3),
            // The sidecar's own default. It must outlast the kernel's first SYN retransmission
            // (1 s): on scenario 6's lossy link one lost SYN or SYN-ACK would otherwise fail a
            // request that a second try connects in 1 s.
            connect_timeout: Duration::from_secs(2),
            kv_lease: Duration::from_secs(5),
            pull_timeout: Duration::from_secs(3),
            prefill_us_per_token: 200,
            decode_us_per_token: 2000,
        }
    }
}

impl Timing {
    /// The longest a request may take when one engine fails under it: a prefill leg that times
    /// out, the failover backoff (at most 0.5 s), a pull that times out (the decode then
    /// recomputes), and a second of service.
    pub fn request_bound(&self) -> Duration {
        self.prefill_timeout + Duration::from_millis(500) + self.pull_timeout + Duration::from_secs(1)
    }
}

/// Paths of the daemons' binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub sim: PathBuf,
    pub sidecar: PathBuf,
    pub coordinator: PathBuf,
}

impl Binaries {
    /// The binaries next to this executable (`target/<profile>/`), as the workspace build leaves them.
    pub fn beside_me() -> Binaries {
        use pdbench::procs::sibling_binary;
        Binaries {
            sim: sibling_binary("pd-sim"),
            sidecar: sibling_binary("pd-sidecar"),
            coordinator: sibling_binary("pd-coordinator"),
        }
    }
}

/// An engine node: a `pd-sim` and its sidecar.
#[derive(Debug, Clone)]
pub struct EngineNode {
    pub name: String,
    pub role: Role,
    pub engine_url: String,
    pub sidecar_url: String,
    engine_proc: usize,
}

/// What the coordinator says of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineState {
    pub alive: bool,
    pub indexed_blocks: u64,
}

/// Counters of one engine's `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SimCounters {
    pub held_blocks: f64,
    pub leases_started: f64,
    pub pulls: f64,
    /// Pulls made under a grant from the prefill (the sidecars name each engine's agent).
    pub granted_pulls: f64,
    pub bytes_pulled: f64,
    pub verification_failures: f64,
}

impl SimCounters {
    pub fn from_text(text: &str) -> SimCounters {
        SimCounters {
            held_blocks: metrics::sum(text, "pdsim:held_blocks"),
            leases_started: metrics::sum(text, "pdsim:leases_started_total"),
            pulls: metrics::sum(text, "pdsim:pulls_total"),
            granted_pulls: metrics::sum(text, "pdsim:granted_pulls_total"),
            bytes_pulled: metrics::sum(text, "vllm:nixl_bytes_transferred_total"),
            verification_failures: metrics::sum(text, "pdsim:verification_failures_total"),
        }
    }
}

/// A running cluster. Field order matters: the processes stop before the namespaces go.
#[derive(Debug)]
pub struct Cluster {
    group: Group,
    pub net: Net,
    pub engines: Vec<EngineNode>,
    pub coordinator_url: String,
    coordinator_proc: usize,
    pub timing: Timing,
    bins: Binaries,
    log_dir: PathBuf,
    pub http: reqwest::Client,
}

const STARTUP: Duration = Duration::from_secs(30);

fn child_log() -> String {
    std::env::var("PD_CHAOS_CHILD_LOG").unwrap_or_else(|_| "warn".into())
}

impl Cluster {
    /// Starts the engines, the coordinator and the sidecars, and waits until the coordinator
    /// lists every engine alive. Runs on a thread inside the client node.
    pub async fn start(
        net: Net,
        engines: &[(&str, Role)],
        timing: Timing,
        bins: Binaries,
        log_dir: &Path,
    ) -> Result<Cluster, ClusterError> {
        let http = reqwest::Client::builder().connect_timeout(timing.connect_timeout).build()?;
        let coordinator_ip = net.node(COORDINATOR_NODE)?.ip;
        let mut cluster = Cluster {
            group: Group::default(),
            engines: Vec::new(),
            coordinator_url: format!("http://{coordinator_ip}:{COORDINATOR_PORT}"),
            coordinator_proc: 0,
            net,
            timing,
            bins,
            log_dir: log_dir.to_path_buf(),
            http,
        };
        for (name, role) in engines {
            let ip = cluster.net.node(name)?.ip;
            let engine_proc = cluster.group.procs().len();
            let cmd = cluster.sim_command(name)?;
            cluster.group.push(Proc::spawn(&format!("{name}-sim"), cmd, log_dir)?);
            cluster.engines.push(EngineNode {
                name: name.to_string(),
                role: *role,
                engine_url: format!("http://{ip}:{ENGINE_PORT}"),
                sidecar_url: format!("http://{ip}:{SIDECAR_PORT}"),
                engine_proc,
            });
        }
        cluster.coordinator_proc = cluster.group.procs().len();
        let cmd = cluster.coordinator_command()?;
        cluster.group.push(Proc::spawn("coordinator", cmd, log_dir)?);
        let mut sidecar_procs = Vec::new();
        for i in 0..cluster.engines.len() {
            sidecar_procs.push(cluster.group.procs().len());
            let cmd = cluster.sidecar_command(&cluster.engines[i])?;
            cluster.group.push(Proc::spawn(&format!("{}-sidecar", cluster.engines[i].name), cmd, log_dir)?);
        }
        let mut waits: Vec<(usize, String)> =
            cluster.engines.iter().map(|e| (e.engine_proc, format!("{}/health", e.engine_url))).collect();
        waits.push((cluster.coordinator_proc, format!("{}/health", cluster.coordinator_url)));
        waits
            .extend(sidecar_procs.iter().zip(&cluster.engines).map(|(p, e)| (*p, format!("{}/health", e.sidecar_url))));
        for (i, url) in waits {
            cluster.group.proc_mut(i).wait_healthy(&cluster.http, &url, STARTUP).await?;
        }
        cluster.wait_all_alive(STARTUP).await?;
        Ok(cluster)
    }

    fn sim_command(&self, name: &str) -> Result<std::process::Command, ClusterError> {
        let ip = self.net.node(name)?.ip.to_string();
        let t = &self.timing;
        let mut cmd = self.net.exec_in(name, &self.bins.sim)?;
        cmd.args(["--host", &ip, "--port", &ENGINE_PORT.to_string(), "--engine-id", name, "--workers", "1"])
            .args(["--host-ip", &ip, "--xfer-port", &XFER_PORT.to_string()])
            .args(["--kv-events-endpoint", &format!("tcp://*:{KV_EVENTS_PORT}")])
            .args(["--prefill-us-per-token", &t.prefill_us_per_token.to_string()])
            .args(["--decode-us-per-token", &t.decode_us_per_token.to_string()])
            .args(["--kv-lease-secs", &format!("{}ms", t.kv_lease.as_millis())])
            .args(["--pull-timeout-secs", &format!("{}ms", t.pull_timeout.as_millis())])
            .env_remove("VLLM_HOST_IP")
            .env_remove("VLLM_NIXL_SIDE_CHANNEL_PORT")
            .env_remove("PD_SIM_CONFIG")
            .env("RUST_LOG", child_log());
        Ok(cmd)
    }

    fn coordinator_command(&self) -> Result<std::process::Command, ClusterError> {
        let ip = self.net.node(COORDINATOR_NODE)?.ip;
        let t = &self.timing;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut cmd = self.net.exec_in(COORDINATOR_NODE, &self.bins.coordinator)?;
        cmd.args(["--listen", &format!("{ip}:{COORDINATOR_PORT}"), "--no-grpc", "--workers", "1"])
            .args(["--lease-ms", &ms(t.coordinator_lease), "--heartbeat-ms", &ms(t.heartbeat)])
            .args(["--health-interval-ms", &ms(t.health_interval), "--health-timeout-ms", &ms(t.health_timeout)])
            // The scenarios break disaggregated requests: the fixed placement rule disaggregates
            // their mostly new prompts, where the learned one could keep them on idle decodes.
            .args(["--local-prefill-max-tokens", "2048"])
            .env_remove("PD_COORDINATOR_CONFIG")
            .env("RUST_LOG", child_log());
        Ok(cmd)
    }

    fn sidecar_command(&self, e: &EngineNode) -> Result<std::process::Command, ClusterError> {
        let ip = self.net.node(&e.name)?.ip;
        let t = &self.timing;
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut cmd = self.net.exec_in(&e.name, &self.bins.sidecar)?;
        cmd.args(["--listen", &format!("{ip}:{SIDECAR_PORT}"), "--engine", &e.engine_url, "--mode", "vllm"])
            .args(["--coordinator", &self.coordinator_url, "--engine-id", &e.name, "--role", e.role.as_str()])
            // pd-sim's agent is its engine id: prefills grant it the blocks it reads, and revoke
            // the grant before a release, an expired lease or a cancellation frees them.
            .args(["--engine-xfer-agent", &e.name])
            .args(["--node", &e.name, "--model", MODEL, "--advertise-url", &e.sidecar_url, "--workers", "1"])
            .args(["--kv-events", &format!("tcp://{ip}:{KV_EVENTS_PORT}")])
            .args(["--prefill-timeout", &ms(t.prefill_timeout), "--connect-timeout", &ms(t.connect_timeout)])
            .env_remove("PD_SIDECAR_CONFIG")
            .env("RUST_LOG", child_log());
        // Without the coordinator a decode's sidecar falls back to the static list.
        if e.role == Role::Decode {
            for p in self.engines.iter().filter(|p| p.role == Role::Prefill) {
                cmd.args(["--prefill", &p.engine_url]);
            }
        }
        Ok(cmd)
    }

    pub fn engine(&self, name: &str) -> Result<&EngineNode, ClusterError> {
        self.engines.iter().find(|e| e.name == name).ok_or_else(|| ClusterError::UnknownEngine(name.into()))
    }

    pub fn by_role(&self, role: Role) -> Vec<&EngineNode> {
        self.engines.iter().filter(|e| e.role == role).collect()
    }

    /// `kill -9` the engine (`pd-sim`) of a node; its sidecar lives on.
    pub fn kill_engine(&mut self, name: &str) -> Result<(), ClusterError> {
        let i = self.engine(name)?.engine_proc;
        kill_proc(self.group.proc_mut(i));
        Ok(())
    }

    /// `kill -9` the coordinator.
    pub fn kill_coordinator(&mut self) {
        kill_proc(self.group.proc_mut(self.coordinator_proc));
    }

    /// Starts a fresh coordinator at the same address and waits for its `/health`.
    pub async fn restart_coordinator(&mut self) -> Result<(), ClusterError> {
        let cmd = self.coordinator_command()?;
        self.coordinator_proc = self.group.procs().len();
        let p = self.group.push(Proc::spawn("coordinator-restarted", cmd, &self.log_dir)?);
        p.wait_healthy(&self.http, &format!("{}/health", self.coordinator_url), STARTUP).await?;
        Ok(())
    }

    /// The coordinator's view of every engine; `None` when it does not answer.
    pub async fn view(&self) -> Option<BTreeMap<String, EngineState>> {
        let r = self
            .http
            .get(format!("{}/v1/engines", self.coordinator_url))
            .timeout(Duration::from_millis(500))
            .send()
            .await
            .ok()?;
        let engines: Vec<EngineView> = r.json().await.ok()?;
        Some(
            engines
                .into_iter()
                .map(|e| (e.spec.id, EngineState { alive: e.alive, indexed_blocks: e.indexed_blocks }))
                .collect(),
        )
    }

    /// Polls the view every 20 ms until `pred` holds; the time it took, or `None` after `timeout`.
    pub async fn wait_view(
        &self,
        timeout: Duration,
        pred: impl Fn(&BTreeMap<String, EngineState>) -> bool,
    ) -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if self.view().await.is_some_and(|v| pred(&v)) {
                return Some(start.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        None
    }

    /// Waits until the coordinator lists every engine alive.
    pub async fn wait_all_alive(&self, timeout: Duration) -> Result<Duration, ClusterError> {
        let want = self.engines.len();
        let alive = |v: &BTreeMap<String, EngineState>| v.values().filter(|e| e.alive).count();
        match self.wait_view(timeout, |v| alive(v) >= want).await {
            Some(t) => Ok(t),
            None => Err(ClusterError::NotRegistered {
                alive: self.view().await.map_or(0, |v| alive(&v)),
                want,
                secs: timeout.as_secs(),
            }),
        }
    }

    /// Process ids of the sidecars and the coordinator (for their resident memory).
    pub fn daemon_pids(&self) -> Vec<(String, u32)> {
        self.group.procs().iter().filter(|p| !p.name.ends_with("-sim")).map(|p| (p.name.clone(), p.pid())).collect()
    }

    /// Each engine's simulator counters; an engine that does not answer is left out.
    pub async fn sim_counters(&self) -> BTreeMap<String, SimCounters> {
        let mut out = BTreeMap::new();
        for e in &self.engines {
            if let Some(text) = self.metrics_text(&e.engine_url).await {
                out.insert(e.name.clone(), SimCounters::from_text(&text));
            }
        }
        out
    }

    /// The sum of a sidecar metric over every sidecar that answers.
    pub async fn sidecar_sum(&self, name: &str) -> f64 {
        let mut total = 0.0;
        for e in &self.engines {
            if let Some(text) = self.metrics_text(&e.sidecar_url).await {
                total += metrics::sum(&text, name);
            }
        }
        total
    }

    async fn metrics_text(&self, base: &str) -> Option<String> {
        let r = self.http.get(format!("{base}/metrics")).timeout(Duration::from_millis(500)).send().await.ok()?;
        r.text().await.ok()
    }

    /// Held blocks summed over the engines that answer, polled until 0 or `timeout`: the time it
    /// took, or the blocks still held.
    pub async fn wait_no_held_blocks(&self, timeout: Duration) -> Result<Duration, u64> {
        let start = Instant::now();
        loop {
            let held: f64 = self.sim_counters().await.values().map(|c| c.held_blocks).sum();
            if held == 0.0 {
                return Ok(start.elapsed());
            }
            if start.elapsed() >= timeout {
                return Err(held as u64);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last lines of every daemon's log, for a failed scenario.
    pub fn log_tails(&self, lines: usize) -> String {
        self.group.procs().iter().map(|p| format!("--- {} ---\n{}\n", p.name, p.log_tail(lines))).collect()
    }
}

fn kill_proc(p: &mut Proc) {
    let _ = kill(Pid::from_raw(p.pid() as i32), Signal::SIGKILL);
    // Reaps it, so its pid cannot be reused while the group still names it.
    let deadline = Instant::now() + Duration::from_secs(2);
    while p.exited().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulator_counters_from_metrics() {
        let text = "pdsim:held_blocks{engine=\"n1\"} 3\npdsim:leases_started_total 7\npdsim:pulls_total 5\npdsim:granted_pulls_total 4\nvllm:nixl_bytes_transferred_total{engine=\"n3\"} 4096\npdsim:verification_failures_total 0\n";
        let c = SimCounters::from_text(text);
        assert_eq!((c.held_blocks, c.leases_started, c.pulls, c.bytes_pulled), (3.0, 7.0, 5.0, 4096.0));
        assert_eq!(c.granted_pulls, 4.0);
    }

    #[test]
    fn request_bound_covers_a_failed_prefill_and_a_failed_pull() {
        let t = Timing::default();
        assert_eq!(t.request_bound(), Duration::from_millis(7500));
    }
}
