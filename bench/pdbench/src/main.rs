//! pdbench: load generator for OpenAI-API P/D deployments, routing comparison on a simulator
//! cluster, and the local P/D cluster launcher. See bench/pdbench/README.md.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use serde_json::json;

use pdbench::client::{Target, Timeouts};
use pdbench::cluster::{self, Engine, KvReport, SimCluster, SimOptions};
use pdbench::daemons::{DaemonOptions, Daemons};
use pdbench::plot::{self, Series};
use pdbench::procs::{self, Group};
use pdbench::runner::{self, Arrival, RunConfig, RunResult};
use pdbench::stats::Slo;
use pdbench::workload::{Api, Dist, WorkloadSpec};

#[derive(Debug, Parser)]
#[command(
    name = "pdbench",
    version,
    about = "Load generator and local cluster launcher for prefill/decode LLM serving"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Drive a workload against running endpoints and report TTFT, ITL, end-to-end latency,
    /// throughput, goodput and errors.
    Run(RunCmd),
    /// Start a simulator cluster and run the same shared-prefix workload through several routing
    /// setups; print mean TTFT side by side.
    CompareRouting(CompareCmd),
    /// Start a complete local P/D cluster (2 prefill + 2 decode engines), drive a sample workload
    /// and print a report; Ctrl-C stops everything.
    Cluster(ClusterCmd),
}

/// What requests to send.
#[derive(Debug, Clone, Args)]
struct WorkloadArgs {
    /// Requests in all (conversations × turns; rounded up to whole conversations).
    #[arg(long, default_value_t = 100)]
    requests: usize,
    /// Turns per conversation; each turn resends the history with the previous answers.
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// New user-message length per turn, tokens (words): N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "uniform:32:128")]
    prompt_len: Dist,
    /// max_tokens per request: N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "32")]
    output_len: Dist,
    /// Distinct shared system prompts (0: none); conversation i uses prompt i mod N.
    #[arg(long, default_value_t = 4)]
    prefixes: usize,
    /// Length of each shared system prompt, tokens (words).
    #[arg(long, default_value_t = 256)]
    prefix_len: usize,
    /// Endpoint: /v1/completions or /v1/chat/completions.
    #[arg(long, value_enum, default_value = "completions")]
    api: Api,
    /// `model` field of each request (omitted when not given).
    #[arg(long)]
    model: Option<String>,
    /// Seed of the workload (prompts, lengths, Poisson arrivals).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

impl WorkloadArgs {
    fn spec(&self) -> anyhow::Result<WorkloadSpec> {
        anyhow::ensure!(self.turns >= 1, "--turns must be at least 1");
        Ok(WorkloadSpec {
            conversations: self.requests.div_ceil(self.turns),
            turns: self.turns,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            prefixes: self.prefixes,
            prefix_len: self.prefix_len,
            api: self.api,
            model: self.model.clone(),
            seed: self.seed,
        })
    }
}

/// How to send them.
#[derive(Debug, Clone, Args)]
struct LoadArgs {
    /// Conversations started per second (default: as fast as --concurrency allows).
    #[arg(long)]
    rate: Option<f64>,
    /// Arrival process when --rate is given.
    #[arg(long, value_enum, default_value = "poisson")]
    arrival: Arrival,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Non-streaming requests (TTFT is then the whole request; no ITL).
    #[arg(long)]
    no_stream: bool,
    /// Whole-request timeout, seconds.
    #[arg(long, default_value_t = 60.0)]
    timeout_secs: f64,
    /// Longest silence inside a stream, seconds.
    #[arg(long, default_value_t = 30.0)]
    idle_timeout_secs: f64,
    /// TTFT SLO for goodput, milliseconds.
    #[arg(long)]
    slo_ttft_ms: Option<f64>,
    /// Mean inter-token latency SLO for goodput, milliseconds.
    #[arg(long)]
    slo_itl_ms: Option<f64>,
    /// No progress bar.
    #[arg(long)]
    no_progress: bool,
}

impl LoadArgs {
    fn config(&self) -> RunConfig {
        RunConfig {
            rate: self.rate,
            arrival: self.arrival,
            concurrency: self.concurrency.max(1),
            stream: !self.no_stream,
            timeouts: Timeouts {
                request: Duration::from_secs_f64(self.timeout_secs.max(0.001)),
                idle: Duration::from_secs_f64(self.idle_timeout_secs.max(0.001)),
            },
            slo: Slo { ttft_ms: self.slo_ttft_ms, itl_ms: self.slo_itl_ms },
            progress: !self.no_progress,
        }
    }
}

/// Where results go.
#[derive(Debug, Clone, Args)]
struct OutputArgs {
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Write plots PREFIX-cdf.{svg,png} (TTFT and end-to-end CDF) and PREFIX-ttft-hist.{svg,png}.
    #[arg(long, value_name = "PREFIX")]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
struct RunCmd {
    /// Base URL of an endpoint (sidecar, router, coordinator entry point, bare engine); repeat
    /// for round-robin over several.
    #[arg(long, required_unless_present = "prefill_url")]
    url: Vec<String>,
    /// pdbench itself does the P/D handoff: prefill call to one of these, then the decode call to
    /// one of --decode-url with the returned kv_transfer_params.
    #[arg(long, requires = "decode_url", conflicts_with = "url")]
    prefill_url: Vec<String>,
    #[arg(long, requires = "prefill_url")]
    decode_url: Vec<String>,
    /// With --prefill-url: pick the prefill by shared-prefix id instead of in turn.
    #[arg(long)]
    prefix_affinity: bool,
    /// With --prefill-url: prompts shorter than this many words go to the decode alone.
    #[arg(long, default_value_t = 0)]
    local_below: usize,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    out: OutputArgs,
}

/// Starting simulated engines.
#[derive(Debug, Clone, Args)]
struct SimArgs {
    /// The pd-sim binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    sim_bin: Option<PathBuf>,
    /// Simulated prefill time per uncached prompt token, microseconds.
    #[arg(long)]
    prefill_us_per_token: Option<u64>,
    /// Simulated decode time per output token, microseconds.
    #[arg(long)]
    decode_us_per_token: Option<u64>,
    /// Extra flag for every pd-sim (repeat; e.g. --sim-arg=--num-blocks=8192).
    #[arg(long, allow_hyphen_values = true)]
    sim_arg: Vec<String>,
    /// Directory for the children's logs (default: a fresh one under the temp dir).
    #[arg(long)]
    log_dir: Option<PathBuf>,
    /// Seconds each child gets to answer /health.
    #[arg(long, default_value_t = 30)]
    startup_timeout_secs: u64,
}

impl SimArgs {
    fn options(
        &self,
        prefill_default: u64,
        decode_default: u64,
        kv_events: bool,
        shm_dir: Option<PathBuf>,
    ) -> SimOptions {
        SimOptions {
            bin: self.sim_bin.clone().unwrap_or_else(|| procs::sibling_binary("pd-sim")),
            args: self.sim_arg.clone(),
            prefill_us_per_token: self.prefill_us_per_token.unwrap_or(prefill_default),
            decode_us_per_token: self.decode_us_per_token.unwrap_or(decode_default),
            kv_events,
            shm_dir,
            startup_timeout: Duration::from_secs(self.startup_timeout_secs),
        }
    }

    fn log_dir(&self, what: &str) -> anyhow::Result<PathBuf> {
        let dir = match &self.log_dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!("pdbench-{what}-{}", std::process::id())),
        };
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }
}

/// Starting the suite's daemons.
#[derive(Debug, Clone, Args)]
struct DaemonArgs {
    /// The pd-coordinator binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    coordinator_bin: Option<PathBuf>,
    /// The pd-sidecar binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    sidecar_bin: Option<PathBuf>,
    /// Extra flag for pd-coordinator (repeat; e.g. --coordinator-arg=--local-prefill-max-tokens=0).
    #[arg(long, allow_hyphen_values = true)]
    coordinator_arg: Vec<String>,
    /// Extra flag for every pd-sidecar (repeat).
    #[arg(long, allow_hyphen_values = true)]
    sidecar_arg: Vec<String>,
}

impl DaemonArgs {
    fn bins(&self) -> (PathBuf, PathBuf) {
        (
            self.coordinator_bin.clone().unwrap_or_else(|| procs::sibling_binary("pd-coordinator")),
            self.sidecar_bin.clone().unwrap_or_else(|| procs::sibling_binary("pd-sidecar")),
        )
    }

    fn usable(&self) -> bool {
        let (c, s) = self.bins();
        usable_daemon(&c) && usable_daemon(&s)
    }

    fn options(&self, model: Option<&str>, startup_timeout_secs: u64) -> DaemonOptions {
        let (coordinator_bin, sidecar_bin) = self.bins();
        DaemonOptions {
            coordinator_bin,
            sidecar_bin,
            model: model.unwrap_or("sim-model").to_string(),
            startup_timeout: Duration::from_secs(startup_timeout_secs),
            coordinator_args: self.coordinator_arg.clone(),
            sidecar_args: self.sidecar_arg.clone(),
            sidecar_mode: "vllm".into(),
        }
    }
}

/// Routing setups compare-routing knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum SetupKind {
    /// Every engine serves whole requests, chosen in turn (no disaggregation).
    RoundRobin,
    /// P/D driven by pdbench: prefill and decode engines each chosen in turn.
    PdRoundRobin,
    /// P/D driven by pdbench: the prefill chosen by the request's shared-prefix id (the engine
    /// that already cached it), decode in turn — a stand-in for KV-aware pairing.
    PdPrefixAffinity,
    /// Requests enter through the decode engines' pd-sidecars, which pair them through
    /// pd-coordinator (KV events, prefix index, load) — needs both binaries.
    Coordinator,
    /// vllm-router in P/D mode in front of the engines (needs --vllm-router).
    VllmRouter,
}

#[derive(Debug, Args)]
struct CompareCmd {
    /// Engines to start; the P/D setups use the first half as prefills, the rest as decodes.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Setups to compare, in order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,pd-round-robin,pd-prefix-affinity,coordinator"
    )]
    setups: Vec<SetupKind>,
    /// The vllm-router executable (PyPI `vllm-router`), for the vllm-router setup.
    #[arg(long)]
    vllm_router: Option<PathBuf>,
    /// Its arguments; {port}, {metrics_port} (free ports), {prefills} (`--prefill URL` each) and
    /// {decodes} (`--decode URL` each) are substituted. The default suits vllm-router 0.1.17.
    #[arg(
        long,
        default_value = "--host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} \
                         --vllm-pd-disaggregation {prefills} {decodes} --policy round_robin"
    )]
    vllm_router_args: String,
    #[command(flatten)]
    daemons: DaemonArgs,
    #[command(flatten)]
    sim: SimArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    /// Write every setup's results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ClusterMode {
    /// Sidecars and coordinator when their binaries are usable, else direct.
    Auto,
    /// pdbench does the P/D handoff itself (prefill call, then decode call).
    Direct,
    /// Requests enter through the decode engines' pd-sidecars, paired by pd-coordinator.
    Sidecar,
}

#[derive(Debug, Args)]
struct ClusterCmd {
    /// Prefill engines to start.
    #[arg(long, default_value_t = 2)]
    prefills: usize,
    /// Decode engines to start.
    #[arg(long, default_value_t = 2)]
    decodes: usize,
    #[arg(long, value_enum, default_value = "auto")]
    mode: ClusterMode,
    #[command(flatten)]
    daemons: DaemonArgs,
    /// Use already-running real vLLM engines (--prefill-url, --decode-url) instead of starting
    /// simulators; pdbench does the P/D handoff.
    #[arg(long, requires_all = ["prefill_url", "decode_url"])]
    vllm: bool,
    /// With --vllm: a prefill engine's base URL (repeat).
    #[arg(long, requires = "vllm")]
    prefill_url: Vec<String>,
    /// With --vllm: a decode engine's base URL (repeat).
    #[arg(long, requires = "vllm")]
    decode_url: Vec<String>,
    /// Prompts shorter than this many words are prefilled on the decode itself (a local decision).
    #[arg(long, default_value_t = 0)]
    local_below: usize,
    /// Sidecar mode: the decode sidecars pull the KV blocks into their engine's shared-memory
    /// pool (engines started with --shm-path under --shm-dir) instead of the engine pulling.
    #[arg(long)]
    pull: bool,
    /// Directory of the shared-memory pool files for --pull.
    #[arg(long, default_value = "/dev/shm")]
    shm_dir: PathBuf,
    /// Write the pids of the started processes (JSON list) here once all are up.
    #[arg(long)]
    pids_file: Option<PathBuf>,
    #[command(flatten)]
    sim: SimArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    load: LoadArgs,
    #[command(flatten)]
    out: OutputArgs,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = rt.block_on(async {
        match cli.cmd {
            Cmd::Run(c) => run_cmd(c).await.map(|()| 0),
            Cmd::CompareRouting(c) => until_signal(compare_cmd(c)).await,
            Cmd::Cluster(c) => until_signal(cluster_cmd(c)).await,
        }
    })?;
    drop(rt);
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// Runs `f` unless SIGINT or SIGTERM comes first; then `f` is dropped (its children stopped by
/// their guards) and the exit code is 130.
async fn until_signal(f: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<i32> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let interrupted = tokio::select! {
        r = f => { r?; false }
        _ = int.recv() => true,
        _ = term.recv() => true,
    };
    // By now the work future is dropped and every child process stopped.
    if interrupted {
        eprintln!("pdbench: interrupted; every child process stopped");
        return Ok(130);
    }
    Ok(0)
}

fn write_json(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(value)?).with_context(|| format!("writing {}", path.display()))
}

fn write_plots(prefix: &Path, r: &RunResult) {
    let series = [
        Series { name: "TTFT", samples: &r.collector.ttft_samples },
        Series { name: "end-to-end", samples: &r.collector.e2e_samples },
    ];
    match plot::write_plots(prefix, &series, &r.collector.ttft_samples) {
        Ok(files) => {
            for f in files {
                eprintln!("wrote {}", f.display());
            }
        }
        Err(e) => eprintln!("pdbench: plots not written: {e}"),
    }
}

async fn run_cmd(c: RunCmd) -> anyhow::Result<()> {
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let target = if c.prefill_url.is_empty() {
        Target::round_robin(c.url.clone())
    } else {
        Target::direct_pd(c.prefill_url.clone(), c.decode_url.clone(), c.prefix_affinity, c.local_below)
    };
    let r = runner::run(Arc::new(target), &spec, &cfg).await?;
    print!("{}", r.summary.table());
    if let Some(p) = &c.out.json {
        write_json(p, &json!({"workload": spec, "summary": r.summary}))?;
    }
    if let Some(p) = &c.out.plot {
        write_plots(p, &r);
    }
    Ok(())
}

/// A routing setup ready to take requests, and whatever it started (stopped on drop).
struct Prepared {
    target: Target,
    _extra: Group,
}

async fn prepare_setup(
    kind: SetupKind,
    engines: &[Engine],
    c: &CompareCmd,
    log_dir: &Path,
    http: &reqwest::Client,
) -> anyhow::Result<Prepared> {
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let half = urls.len() / 2;
    let (p, d) = (urls[..half].to_vec(), urls[half..].to_vec());
    Ok(match kind {
        SetupKind::RoundRobin => Prepared { target: Target::round_robin(urls), _extra: Group::default() },
        SetupKind::PdRoundRobin => Prepared { target: Target::direct_pd(p, d, false, 0), _extra: Group::default() },
        SetupKind::PdPrefixAffinity => Prepared { target: Target::direct_pd(p, d, true, 0), _extra: Group::default() },
        SetupKind::Coordinator => {
            let (cb, sb) = c.daemons.bins();
            anyhow::ensure!(
                c.daemons.usable(),
                "{} or {} is missing or does not answer --help",
                cb.display(),
                sb.display()
            );
            let roles: Vec<Engine> = engines
                .iter()
                .enumerate()
                .map(|(i, e)| Engine { role: if i < half { "prefill" } else { "decode" }.into(), ..e.clone() })
                .collect();
            let opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout_secs);
            let d = Daemons::start(&roles, &opts, log_dir, http).await?;
            let target = Target::round_robin(d.entry_urls());
            Prepared { target, _extra: d.group }
        }
        SetupKind::VllmRouter => {
            let bin = c.vllm_router.clone().context("the vllm-router setup needs --vllm-router PATH")?;
            let port = procs::free_port()?;
            let metrics_port = procs::free_port()?;
            let prefills: Vec<String> = p.iter().flat_map(|u| ["--prefill".to_string(), u.clone()]).collect();
            let decodes: Vec<String> = d.iter().flat_map(|u| ["--decode".to_string(), u.clone()]).collect();
            let mut args = Vec::new();
            for a in c.vllm_router_args.split_whitespace() {
                match a {
                    "{prefills}" => args.extend(prefills.iter().cloned()),
                    "{decodes}" => args.extend(decodes.iter().cloned()),
                    _ => args.push(
                        a.replace("{port}", &port.to_string()).replace("{metrics_port}", &metrics_port.to_string()),
                    ),
                }
            }
            let mut cmd = std::process::Command::new(&bin);
            cmd.args(&args);
            let mut group = Group::default();
            let proc_ = group.push(procs::Proc::spawn("vllm-router", cmd, log_dir)?);
            let url = format!("http://127.0.0.1:{port}");
            proc_.wait_healthy(http, &format!("{url}/health"), Duration::from_secs(c.sim.startup_timeout_secs)).await?;
            Prepared { target: Target::round_robin(vec![url]), _extra: group }
        }
    })
}

async fn compare_cmd(c: CompareCmd) -> anyhow::Result<()> {
    anyhow::ensure!(c.engines >= 2, "--engines must be at least 2");
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let http = runner::http_client(4, Duration::from_secs(5))?;
    let log_dir = c.sim.log_dir("compare")?;
    let names: Vec<(String, &str)> = (0..c.engines).map(|i| (format!("engine-{i}"), "both")).collect();
    let kv_events = c.setups.contains(&SetupKind::Coordinator);
    let sims = SimCluster::start(&names, &c.sim.options(100, 1000, kv_events, None), &log_dir, &http).await?;
    eprintln!("{} engines up (logs in {})", sims.engines.len(), log_dir.display());
    let mut rows = Vec::new();
    for &kind in &c.setups {
        let name = format!("{kind:?}");
        cluster::reset_prefix_caches(&http, &sims.engines).await?;
        let prepared = match prepare_setup(kind, &sims.engines, &c, &log_dir, &http).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{name}: skipped: {e:#}");
                rows.push(json!({"setup": name, "skipped": format!("{e:#}")}));
                continue;
            }
        };
        let (before, _) = cluster::scrape(&http, &sims.engines).await;
        let r = runner::run(Arc::new(prepared.target), &spec, &cfg).await?;
        let (after, _) = cluster::scrape(&http, &sims.engines).await;
        let kv = KvReport::from(after.since(before));
        eprintln!(
            "{name}: {} ok, {} failed, mean TTFT {:.2} ms",
            r.summary.ok, r.summary.failed, r.summary.ttft_ms.mean
        );
        rows.push(json!({"setup": name, "summary": r.summary, "kv": kv}));
    }
    println!(
        "{} requests, {} shared prefixes of {} tokens, {} engines, concurrency {}",
        spec.total_requests(),
        spec.prefixes,
        spec.prefix_len,
        c.engines,
        cfg.concurrency
    );
    println!(
        "{:<20} {:>8} {:>7} {:>14} {:>12} {:>12} {:>10} {:>10}",
        "setup", "ok", "failed", "mean TTFT ms", "p50 TTFT", "p99 TTFT", "hit rate", "KV MB"
    );
    for row in &rows {
        let setup = row["setup"].as_str().unwrap_or("?");
        if let Some(why) = row.get("skipped") {
            println!("{setup:<20} skipped: {}", why.as_str().unwrap_or(""));
            continue;
        }
        let s = &row["summary"];
        let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
        println!(
            "{setup:<20} {:>8} {:>7} {:>14.2} {:>12.2} {:>12.2} {:>9.1}% {:>10.2}",
            s["ok"].as_u64().unwrap_or(0),
            s["failed"].as_u64().unwrap_or(0),
            f(&s["ttft_ms"]["mean"]),
            f(&s["ttft_ms"]["p50"]),
            f(&s["ttft_ms"]["p99"]),
            100.0 * f(&row["kv"]["prefix_hit_rate"]),
            f(&row["kv"]["bytes"]) / 1e6
        );
    }
    if let Some(p) = &c.json {
        write_json(p, &json!({"workload": spec, "engines": sims.engines, "setups": rows}))?;
    }
    drop(sims);
    Ok(())
}

/// Whether a daemon binary is there and answers `--help` (the skeletons print nothing).
fn usable_daemon(bin: &Path) -> bool {
    std::process::Command::new(bin)
        .arg("--help")
        .stdin(std::process::Stdio::null())
        .output()
        .map(|o| o.status.success() && !o.stdout.is_empty())
        .unwrap_or(false)
}

async fn cluster_cmd(c: ClusterCmd) -> anyhow::Result<()> {
    anyhow::ensure!(c.vllm || (c.prefills >= 1 && c.decodes >= 1), "need at least one prefill and one decode");
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let http = runner::http_client(4, Duration::from_secs(5))?;
    let (coordinator_bin, sidecar_bin) = c.daemons.bins();
    let daemons_usable = !c.vllm && c.daemons.usable();
    let with_daemons = match c.mode {
        ClusterMode::Direct => false,
        ClusterMode::Auto => daemons_usable,
        ClusterMode::Sidecar => {
            anyhow::ensure!(!c.vllm, "--mode sidecar starts its own engines; it does not combine with --vllm");
            anyhow::ensure!(
                daemons_usable,
                "--mode sidecar: {} or {} is missing or does not answer --help",
                coordinator_bin.display(),
                sidecar_bin.display()
            );
            true
        }
    };
    anyhow::ensure!(!c.pull || with_daemons, "--pull needs the sidecar mode (pd-sidecar and pd-coordinator built)");
    let mode = match (with_daemons, c.pull) {
        (true, true) => "sidecar-pull",
        (true, false) => "sidecar",
        _ => "direct",
    };
    let log_dir = c.sim.log_dir("cluster")?;

    // Engines: started simulators, or real vLLM instances already running.
    let sims;
    let engines: Vec<Engine> = if c.vllm {
        sims = None;
        let e = |role: &str, i: usize, url: &String| Engine {
            name: format!("{role}-{i}"),
            role: role.into(),
            url: url.trim_end_matches('/').into(),
            pid: None,
            kv_events: None,
        };
        c.prefill_url
            .iter()
            .enumerate()
            .map(|(i, u)| e("prefill", i, u))
            .chain(c.decode_url.iter().enumerate().map(|(i, u)| e("decode", i, u)))
            .collect()
    } else {
        let names: Vec<(String, &str)> = (0..c.prefills)
            .map(|i| (format!("prefill-{i}"), "prefill"))
            .chain((0..c.decodes).map(|i| (format!("decode-{i}"), "decode")))
            .collect();
        let started = SimCluster::start(
            &names,
            &c.sim.options(50, 1000, with_daemons, c.pull.then(|| c.shm_dir.clone())),
            &log_dir,
            &http,
        )
        .await?;
        let engines = started.engines.clone();
        sims = Some(started);
        engines
    };
    let daemons = if with_daemons {
        let mut opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout_secs);
        if c.pull {
            opts.sidecar_mode = "pull".into();
        }
        Some(Daemons::start(&engines, &opts, &log_dir, &http).await?)
    } else {
        None
    };
    let mut pids: Vec<u32> = sims.as_ref().map(|s| s.group.pids()).unwrap_or_default();
    pids.extend(daemons.as_ref().map(|d| d.group.pids()).unwrap_or_default());
    if let Some(p) = &c.pids_file {
        write_json(p, &json!(pids))?;
    }
    eprintln!("cluster up ({mode} P/D): logs in {}", log_dir.display());
    for e in &engines {
        eprintln!(
            "  {:<10} {:<8} {}{}",
            e.name,
            e.role,
            e.url,
            e.pid.map(|p| format!("  pid {p}")).unwrap_or_default()
        );
    }
    if let Some(d) = &daemons {
        eprintln!("  {:<10} {:<8} {}  pid {}", "coordinator", "", d.coordinator_url, d.coordinator_pid);
        for s in &d.sidecars {
            eprintln!("  {:<10} {:<8} {}  pid {}", format!("sidecar:{}", s.engine), s.role, s.url, s.pid);
        }
    }
    // Test hook: the children must be stopped by unwinding when pdbench panics.
    if std::env::var_os("PDBENCH_TEST_PANIC_AFTER_START").is_some() {
        panic!("PDBENCH_TEST_PANIC_AFTER_START is set");
    }

    let urls = |role: &str| engines.iter().filter(|e| e.role == role).map(|e| e.url.clone()).collect::<Vec<_>>();
    let target = match &daemons {
        Some(d) => Target::round_robin(d.entry_urls()),
        None => Target::direct_pd(urls("prefill"), urls("decode"), true, c.local_below),
    };
    let (before, _) = cluster::scrape(&http, &engines).await;
    let decisions_before = match &daemons {
        Some(d) => Some(d.decisions(&http).await),
        None => None,
    };
    let r = runner::run(Arc::new(target), &spec, &cfg).await?;
    let (after, unreachable) = cluster::scrape(&http, &engines).await;
    let mut kv = KvReport::from(after.since(before));
    let s = &r.summary;
    // Who decided: pdbench itself (direct), or the sidecars and the coordinator.
    let (disaggregated, local, daemon_decisions) = match (&daemons, decisions_before) {
        (Some(d), Some(b)) => {
            let dd = d.decisions(&http).await.since(b);
            if c.pull {
                // The sidecars moved the bytes, not the engines.
                kv.bytes += dd.sidecar_pull_bytes;
                kv.transfers += dd.sidecar_pulls;
                kv.xfer_seconds += dd.sidecar_handoff_seconds;
                kv.gb_per_s = if kv.xfer_seconds > 0.0 { kv.bytes / kv.xfer_seconds / 1e9 } else { 0.0 };
            }
            (dd.sidecar_disaggregated as u64, dd.sidecar_local as u64, Some(dd))
        }
        _ => (s.disaggregated, s.local, None),
    };

    println!(
        "pdbench cluster: {} prefill + {} decode engines, {mode} P/D",
        urls("prefill").len(),
        urls("decode").len()
    );
    print!("{}", s.table());
    println!(
        "KV moved     {:.2} MB in {} transfers, {:.3} s of transfer time: {:.2} GB/s ({} failed transfers)",
        kv.bytes / 1e6,
        kv.transfers,
        kv.xfer_seconds,
        kv.gb_per_s,
        kv.failed_transfers
    );
    println!(
        "prefix hits  {:.1}% ({} of {} prompt tokens found cached)",
        100.0 * kv.prefix_hit_rate,
        kv.prefix_hits,
        kv.prefix_queries
    );
    println!("decisions    {disaggregated} disaggregated, {local} local");
    if let Some(d) = &daemon_decisions {
        println!(
            "coordinator  {} disaggregated, {} local-prefill pairings",
            d.coordinator_disaggregated, d.coordinator_local_prefill
        );
    }
    if !unreachable.is_empty() {
        println!("metrics      unreachable: {}", unreachable.join(", "));
    }
    if let Some(p) = &c.out.json {
        write_json(
            p,
            &json!({
                "mode": mode,
                "engines": engines,
                "pids": pids,
                "workload": spec,
                "summary": s,
                "requests": s.requests,
                "ok": s.ok,
                "failed": s.failed,
                "errors": s.errors,
                "kv": kv,
                "decisions": {"disaggregated": disaggregated, "local": local, "daemons": daemon_decisions},
                "coordinator": daemons.as_ref().map(|d| json!({"url": d.coordinator_url, "pid": d.coordinator_pid})),
                "sidecars": daemons.as_ref().map(|d| d.sidecars.clone()),
                "log_dir": log_dir,
            }),
        )?;
    }
    if let Some(p) = &c.out.plot {
        write_plots(p, &r);
    }
    // Daemons first (they hold connections to the engines), then the engines.
    drop(daemons);
    drop(sims);
    Ok(())
}
