//! The command line: subcommands and their flag groups.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use pd_config_file::{duration_or_millis, duration_or_secs};
use pdbench::client::Timeouts;
use pdbench::cluster::SimOptions;
use pdbench::daemons::DaemonOptions;
use pdbench::procs;
use pdbench::runner::{Arrival, RunConfig};
use pdbench::stats::Slo;
use pdbench::trace::{self, Replay, ReplayOptions};
use pdbench::workload::{Api, Dist, Popularity, WorkloadSpec};

/// Timeouts below this are taken as this (a zero timeout would fail every request).
const MIN_TIMEOUT: Duration = Duration::from_millis(1);

/// A duration in (fractional) milliseconds, as the stats count them.
fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[derive(Debug, Parser)]
#[command(
    name = "pdbench",
    version,
    about = "Load generator and local cluster launcher for prefill/decode LLM serving"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

/// Parses the command line; compare-routing's preset fills in every flag not given.
pub fn parse_cli<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let matches = Cli::command().try_get_matches_from(args)?;
    let mut cli = Cli::from_arg_matches(&matches)?;
    if let (Cmd::CompareRouting(c), Some(m)) = (&mut cli.cmd, matches.subcommand_matches("compare-routing")) {
        c.apply_preset(|id| {
            m.try_get_raw(id).ok().flatten().is_some()
                && !matches!(m.value_source(id), Some(clap::parser::ValueSource::DefaultValue) | None)
        });
    }
    if let (Cmd::Cluster(c), Some(m)) = (&mut cli.cmd, matches.subcommand_matches("cluster")) {
        c.apply_demo_defaults(|id| matches!(m.value_source(id), Some(clap::parser::ValueSource::CommandLine)));
    }
    Ok(cli)
}

#[derive(Debug, Subcommand)]
pub enum Cmd {
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
pub struct WorkloadArgs {
    /// Requests in all (conversations × turns; rounded up to whole conversations).
    #[arg(long, default_value_t = 100)]
    pub requests: usize,
    /// Turns per conversation; each turn resends the history with the previous answers.
    #[arg(long, default_value_t = 1)]
    pub turns: usize,
    /// New user-message length per turn, tokens (words): N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "uniform:32:128")]
    pub prompt_len: Dist,
    /// max_tokens per request: N, uniform:LO:HI or normal:MEAN:STD.
    #[arg(long, default_value = "32")]
    pub output_len: Dist,
    /// Distinct shared system prompts (0: none).
    #[arg(long, default_value_t = 4)]
    pub prefixes: usize,
    /// Length of each shared system prompt, tokens (words).
    #[arg(long, default_value_t = 256)]
    pub prefix_len: usize,
    /// Which system prompt a conversation uses: cyclic (conversation i uses prompt i mod N),
    /// uniform (drawn at random, seeded) or zipf[:S] (prompt k drawn with weight 1/(k+1)^S).
    #[arg(long, default_value = "cyclic")]
    pub prefix_popularity: Popularity,
    /// Endpoint: /v1/completions or /v1/chat/completions.
    #[arg(long, value_enum, default_value = "completions")]
    pub api: Api,
    /// `model` field of each request (omitted when not given).
    #[arg(long)]
    pub model: Option<String>,
    /// Seed of the workload (prompts, lengths, Poisson arrivals).
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl WorkloadArgs {
    pub fn spec(&self) -> anyhow::Result<WorkloadSpec> {
        anyhow::ensure!(self.turns >= 1, "--turns must be at least 1");
        Ok(WorkloadSpec {
            conversations: self.requests.div_ceil(self.turns),
            turns: self.turns,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            prefixes: self.prefixes,
            prefix_len: self.prefix_len,
            popularity: self.prefix_popularity,
            api: self.api,
            model: self.model.clone(),
            seed: self.seed,
        })
    }
}

/// How to send them.
#[derive(Debug, Clone, Args)]
pub struct LoadArgs {
    /// Conversations started per second (default: as fast as --concurrency allows).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Arrival process when --rate is given.
    #[arg(long, value_enum, default_value = "poisson")]
    pub arrival: Arrival,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Non-streaming requests (TTFT is then the whole request; no ITL).
    #[arg(long)]
    pub no_stream: bool,
    /// Whole-request timeout.
    #[arg(long = "timeout-secs", value_parser = duration_or_secs, default_value = "60s")]
    pub timeout: Duration,
    /// Longest silence inside a stream.
    #[arg(long = "idle-timeout-secs", value_parser = duration_or_secs, default_value = "30s")]
    pub idle_timeout: Duration,
    /// TTFT SLO for goodput ("500ms"; a bare number is milliseconds).
    #[arg(long = "slo-ttft-ms", value_parser = duration_or_millis)]
    pub slo_ttft: Option<Duration>,
    /// Mean inter-token latency SLO for goodput ("50ms"; a bare number is milliseconds).
    #[arg(long = "slo-itl-ms", value_parser = duration_or_millis)]
    pub slo_itl: Option<Duration>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Open a new connection per request (no keep-alive pool).
    #[arg(long)]
    pub no_keepalive: bool,
}

impl LoadArgs {
    pub fn config(&self) -> RunConfig {
        RunConfig {
            rate: self.rate,
            arrival: self.arrival,
            concurrency: self.concurrency.max(1),
            stream: !self.no_stream,
            timeouts: Timeouts { request: self.timeout.max(MIN_TIMEOUT), idle: self.idle_timeout.max(MIN_TIMEOUT) },
            slo: Slo { ttft_ms: self.slo_ttft.map(millis), itl_ms: self.slo_itl.map(millis) },
            progress: !self.no_progress,
            no_keepalive: self.no_keepalive,
        }
    }
}

/// Where results go.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Write the results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write plots PREFIX-cdf.{svg,png} (TTFT and end-to-end CDF) and PREFIX-ttft-hist.{svg,png}.
    #[arg(long, value_name = "PREFIX")]
    pub plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct RunCmd {
    /// Base URL of an endpoint (sidecar, router, coordinator entry point, bare engine); repeat
    /// for round-robin over several.
    #[arg(long, required_unless_present = "prefill_url")]
    pub url: Vec<String>,
    /// pdbench itself does the P/D handoff: prefill call to one of these, then the decode call to
    /// one of --decode-url with the returned kv_transfer_params.
    #[arg(long, requires = "decode_url", conflicts_with = "url")]
    pub prefill_url: Vec<String>,
    #[arg(long, requires = "prefill_url")]
    pub decode_url: Vec<String>,
    /// With --prefill-url: pick the prefill by shared-prefix id instead of in turn.
    #[arg(long)]
    pub prefix_affinity: bool,
    /// With --prefill-url: prompts shorter than this many words go to the decode alone.
    #[arg(long, default_value_t = 0)]
    pub local_below: usize,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// Starting simulated engines.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// The pd-sim binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    pub sim_bin: Option<PathBuf>,
    /// Simulated prefill time per uncached prompt token, microseconds.
    #[arg(long)]
    pub prefill_us_per_token: Option<u64>,
    /// Simulated decode time per output token, microseconds.
    #[arg(long)]
    pub decode_us_per_token: Option<u64>,
    /// Extra flag for every pd-sim (repeat; e.g. --sim-arg=--num-blocks=8192).
    #[arg(long, allow_hyphen_values = true)]
    pub sim_arg: Vec<String>,
    /// Directory for the children's logs (default: a fresh one under the temp dir).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// How long each child gets to answer /health.
    #[arg(long = "startup-timeout-secs", value_parser = duration_or_secs, default_value = "30s")]
    pub startup_timeout: Duration,
}

impl SimArgs {
    pub fn options(
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
            startup_timeout: self.startup_timeout,
        }
    }

    pub fn log_dir(&self, what: &str) -> anyhow::Result<PathBuf> {
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
pub struct DaemonArgs {
    /// The pd-coordinator binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    pub coordinator_bin: Option<PathBuf>,
    /// The pd-sidecar binary (default: next to pdbench, else $PATH).
    #[arg(long)]
    pub sidecar_bin: Option<PathBuf>,
    /// Extra flag for pd-coordinator (repeat; e.g. --coordinator-arg=--local-prefill-max-tokens=0).
    #[arg(long, allow_hyphen_values = true)]
    pub coordinator_arg: Vec<String>,
    /// Extra flag for every pd-sidecar (repeat).
    #[arg(long, allow_hyphen_values = true)]
    pub sidecar_arg: Vec<String>,
}

impl DaemonArgs {
    pub fn bins(&self) -> (PathBuf, PathBuf) {
        (
            self.coordinator_bin.clone().unwrap_or_else(|| procs::sibling_binary("pd-coordinator")),
            self.sidecar_bin.clone().unwrap_or_else(|| procs::sibling_binary("pd-sidecar")),
        )
    }

    pub fn usable(&self) -> bool {
        let (c, s) = self.bins();
        usable_daemon(&c) && usable_daemon(&s)
    }

    pub fn options(&self, model: Option<&str>, startup_timeout: Duration) -> DaemonOptions {
        let (coordinator_bin, sidecar_bin) = self.bins();
        DaemonOptions {
            coordinator_bin,
            sidecar_bin,
            model: model.unwrap_or("sim-model").to_string(),
            startup_timeout,
            coordinator_args: self.coordinator_arg.clone(),
            sidecar_args: self.sidecar_arg.clone(),
            sidecar_mode: "vllm".into(),
        }
    }
}

/// Routing setups compare-routing knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SetupKind {
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
    /// Every engine registered as `both` behind its pd-sidecar, requests entering through all
    /// of them: the coordinator places each request (prefill on the engine holding the prompt,
    /// or disaggregated between two engines) — the counterpart of vllm-router-colocated.
    CoordinatorColocated,
    /// vllm-router in P/D mode in front of the engines with --vllm-router-policy (default
    /// cache_aware); needs --vllm-router.
    VllmRouter,
    /// vllm-router in P/D mode with --policy round_robin; needs --vllm-router.
    VllmRouterRoundRobin,
    /// vllm-router in its regular mode (no P/D: every engine serves whole requests) with
    /// --vllm-router-policy; needs --vllm-router.
    VllmRouterColocated,
    /// No router: one more engine, started for this setup, whose cache holds every prompt of
    /// the workload, computing prompts side by side and without slowing its decodes (pd-sim
    /// --prefill-queue none --interference-factor 0). The simulator's best case, and so a bound
    /// on every router's ratios up to the run's timing: a prompt counts as cached only once
    /// computed, so a router can match its hit rate and, rarely, pass it by a little.
    Ideal,
}

/// Workload and cluster presets of compare-routing; flags given on the command line win.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Preset {
    /// 480 requests over 24 system prompts of 1024 tokens (Zipf popularity, s = 1), 64-token
    /// user messages, 16 output tokens; each engine's KV pool holds a third of the prompts
    /// besides its requests in flight (--cache-share 0.333); engines and coordinator share a
    /// tokenizer.json (see the README).
    SharedPrefix,
    /// No preset: the workload flags' own defaults, the simulator's default pool (4096 blocks),
    /// no shared tokenizer — compare-routing as it was before the presets.
    Legacy,
}

/// Replaying a trace in the Mooncake format instead of the generated workload.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    /// Replay this trace (JSON lines: timestamp ms, input_length, output_length, hash_ids of
    /// 512-token blocks) instead of generating the workload; the workload flags then do not apply.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Replay the first N requests of the trace.
    #[arg(long, default_value_t = 1000)]
    pub trace_requests: usize,
    /// Tokens each 512-token block becomes (prompt lengths scale alike); a multiple of the
    /// simulator's 16-token KV block keeps shared blocks aligned.
    #[arg(long, default_value_t = 32)]
    pub trace_block_tokens: u64,
    /// Divide the trace's timestamps by this (4: four times as fast).
    #[arg(long, default_value_t = 4.0)]
    pub trace_time_scale: f64,
    /// Longest prompt, tokens after scaling (longer ones keep their head).
    #[arg(long, default_value_t = 4096)]
    pub trace_max_input: u64,
    /// Largest max_tokens (the trace's output length, capped).
    #[arg(long, default_value_t = 32)]
    pub trace_max_output: u64,
}

impl TraceArgs {
    /// The replay, when --trace is given.
    pub fn replay(&self) -> anyhow::Result<Option<Replay>> {
        let Some(path) = &self.trace else { return Ok(None) };
        let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        let requests = trace::read(std::io::BufReader::new(file), self.trace_requests)
            .with_context(|| format!("reading {}", path.display()))?;
        let opts = ReplayOptions {
            block_tokens: self.trace_block_tokens,
            time_scale: self.trace_time_scale,
            max_input_tokens: self.trace_max_input,
            max_output_tokens: self.trace_max_output,
        };
        Ok(Some(Replay::new(requests, opts)?))
    }
}

#[derive(Debug, Args)]
pub struct CompareCmd {
    /// Workload and cache sizing preset (see the README); explicit flags override it.
    #[arg(long, value_enum, default_value = "shared-prefix")]
    pub preset: Preset,
    /// Engines to start; the P/D setups use the first half as prefills, the rest as decodes.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// Setups to compare, in order (a vllm-router setup without --vllm-router is skipped).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "round-robin,pd-round-robin,pd-prefix-affinity,coordinator,vllm-router"
    )]
    pub setups: Vec<SetupKind>,
    /// Run every setup this many times (same cluster, same seed, caches cleared before each).
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Size each engine's KV pool (pd-sim --num-blocks) to hold this share of the shared
    /// prompts' blocks, plus the blocks of the requests in flight (0: the simulator's default).
    #[arg(long)]
    pub cache_share: Option<f64>,
    /// Write a word-level tokenizer.json for the workload's vocabulary and give it to every
    /// engine and to the coordinator (`--tokenizer`), so the coordinator hashes prompt text into
    /// the same block hashes the engines' KV events carry.
    #[arg(long, overrides_with = "no_shared_tokenizer")]
    pub shared_tokenizer: bool,
    #[arg(long, overrides_with = "shared_tokenizer")]
    pub no_shared_tokenizer: bool,
    /// Role the coordinator setup registers the decode engines with: `decode`, or `both` (the
    /// coordinator may then also pick the other decode engine as a request's prefill).
    #[arg(long, default_value = "decode", value_parser = ["decode", "both"])]
    pub coordinator_decode_role: String,
    /// The vllm-router executable (PyPI `vllm-router`), for the vllm-router setups.
    #[arg(long, env = "PDBENCH_VLLM_ROUTER")]
    pub vllm_router: Option<PathBuf>,
    /// --policy of the vllm-router setup ({policy} in --vllm-router-args).
    #[arg(long, default_value = "cache_aware")]
    pub vllm_router_policy: String,
    /// Its arguments; {port}, {metrics_port} (free ports), {prefills} (`--prefill URL` each),
    /// {decodes} (`--decode URL` each) and {policy} are substituted. The default suits
    /// vllm-router 0.1.17.
    #[arg(
        long,
        allow_hyphen_values = true,
        default_value = "--host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} \
                         --vllm-pd-disaggregation {prefills} {decodes} --policy {policy}"
    )]
    pub vllm_router_args: String,
    /// The arguments of the vllm-router-colocated setup; {workers} is every engine's URL.
    #[arg(
        long,
        allow_hyphen_values = true,
        default_value = "--host 127.0.0.1 --port {port} --prometheus-host 127.0.0.1 --prometheus-port {metrics_port} \
                         --worker-urls {workers} --policy {policy}"
    )]
    pub vllm_router_colocated_args: String,
    #[command(flatten)]
    pub daemons: DaemonArgs,
    #[command(flatten)]
    pub sim: SimArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub trace: TraceArgs,
    /// Write every setup's results as JSON to this file.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the results as a Markdown table (with the command line and the load average).
    #[arg(long)]
    pub markdown: Option<PathBuf>,
    /// Put that Markdown between `<!-- compare-routing:begin -->` and
    /// `<!-- compare-routing:end -->` in this file (e.g. bench/pdbench/README.md).
    #[arg(long)]
    pub update_readme: Option<PathBuf>,
    /// With --update-readme: use the markers `<!-- compare-routing:NAME:begin -->` …
    /// `<!-- compare-routing:NAME:end -->` instead (several generated tables in one file).
    #[arg(long)]
    pub readme_section: Option<String>,
}

impl CompareCmd {
    /// Fills in the preset's values for every flag not given explicitly (`given(id)`).
    pub fn apply_preset(&mut self, given: impl Fn(&str) -> bool) {
        if !given("shared_tokenizer") && !given("no_shared_tokenizer") {
            self.shared_tokenizer = self.preset == Preset::SharedPrefix;
        }
        self.shared_tokenizer &= !self.no_shared_tokenizer;
        if self.preset != Preset::SharedPrefix {
            return;
        }
        let w = &mut self.workload;
        let set = |id: &str, f: &mut dyn FnMut()| {
            if !given(id) {
                f()
            }
        };
        set("requests", &mut || w.requests = 480);
        set("prefixes", &mut || w.prefixes = 24);
        set("prefix_len", &mut || w.prefix_len = 1024);
        set("prompt_len", &mut || w.prompt_len = Dist::Fixed { value: 64 });
        set("output_len", &mut || w.output_len = Dist::Fixed { value: 16 });
        set("prefix_popularity", &mut || w.prefix_popularity = Popularity::Zipf { s: 1.0 });
        if !given("cache_share") {
            self.cache_share = Some(1.0 / 3.0);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClusterMode {
    /// Sidecars and coordinator when their binaries are usable, else direct.
    Auto,
    /// pdbench does the P/D handoff itself (prefill call, then decode call).
    Direct,
    /// Requests enter through the decode engines' pd-sidecars, paired by pd-coordinator.
    Sidecar,
}

#[derive(Debug, Args)]
pub struct ClusterCmd {
    /// Prefill engines to start.
    #[arg(long, default_value_t = 2)]
    pub prefills: usize,
    /// Decode engines to start.
    #[arg(long, default_value_t = 2)]
    pub decodes: usize,
    #[arg(long, value_enum, default_value = "auto")]
    pub mode: ClusterMode,
    #[command(flatten)]
    pub daemons: DaemonArgs,
    /// Use already-running real vLLM engines (--prefill-url, --decode-url) instead of starting
    /// simulators; pdbench does the P/D handoff.
    #[arg(long, requires_all = ["prefill_url", "decode_url"])]
    pub vllm: bool,
    /// With --vllm: a prefill engine's base URL (repeat).
    #[arg(long, requires = "vllm")]
    pub prefill_url: Vec<String>,
    /// With --vllm: a decode engine's base URL (repeat).
    #[arg(long, requires = "vllm")]
    pub decode_url: Vec<String>,
    /// Prompts shorter than this many words are prefilled on the decode itself (a local decision).
    #[arg(long, default_value_t = 0)]
    pub local_below: usize,
    /// Sidecar mode: the decode sidecars pull the KV blocks into their engine's shared-memory
    /// pool (engines started with --shm-path under --shm-dir) instead of the engine pulling.
    #[arg(long)]
    pub pull: bool,
    /// Directory of the shared-memory pool files for --pull.
    #[arg(long, default_value = "/dev/shm")]
    pub shm_dir: PathBuf,
    /// Write the pids of the started processes (JSON list) here once all are up.
    #[arg(long)]
    pub pids_file: Option<PathBuf>,
    /// Keep the cluster up after the sample workload (none with --requests 0) and print its
    /// OpenAI base URL, model and example requests; Ctrl-C stops everything (sidecar mode only).
    #[arg(long)]
    pub serve: bool,
    #[command(flatten)]
    pub sim: SimArgs,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub load: LoadArgs,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// Whether a daemon binary is there and answers `--help` (the skeletons print nothing).
pub fn usable_daemon(bin: &Path) -> bool {
    std::process::Command::new(bin)
        .arg("--help")
        .stdin(std::process::Stdio::null())
        .output()
        .map(|o| o.status.success() && !o.stdout.is_empty())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compare(args: &[&str]) -> CompareCmd {
        let cli = parse_cli(["pdbench", "compare-routing"].iter().chain(args)).unwrap();
        match cli.cmd {
            Cmd::CompareRouting(c) => c,
            _ => unreachable!(),
        }
    }

    #[test]
    fn the_preset_fills_in_what_the_command_line_leaves_out() {
        let c = compare(&["--prefixes", "8", "--coordinator-arg=--prefill-scale=3"]);
        let w = &c.workload;
        assert_eq!((w.prefixes, w.requests, w.prefix_len), (8, 480, 1024));
        assert_eq!(w.prefix_popularity, Popularity::Zipf { s: 1.0 });
        assert_eq!(c.cache_share, Some(1.0 / 3.0));
        assert!(c.shared_tokenizer);
        assert_eq!(c.daemons.coordinator_arg, ["--prefill-scale=3"], "the coordinator runs with its own defaults");
        let c = compare(&["--no-shared-tokenizer", "--prefix-popularity", "uniform", "--cache-share", "0.5"]);
        assert!(!c.shared_tokenizer);
        assert_eq!((c.workload.prefix_popularity, c.cache_share), (Popularity::Uniform, Some(0.5)));

        let legacy = compare(&["--preset", "legacy", "--requests", "200"]);
        let w = &legacy.workload;
        assert_eq!((w.requests, w.prefixes, w.prefix_len), (200, 4, 256));
        assert_eq!(w.prefix_popularity, Popularity::Cyclic);
        assert_eq!(legacy.cache_share, None);
        assert!(!legacy.shared_tokenizer && legacy.daemons.coordinator_arg.is_empty());
    }

    fn load(args: &[&str]) -> Result<LoadArgs, clap::Error> {
        let cli = parse_cli(["pdbench", "run", "--url", "http://x"].iter().chain(args))?;
        match cli.cmd {
            Cmd::Run(r) => Ok(r.load),
            _ => unreachable!(),
        }
    }

    #[test]
    fn durations_take_units_and_the_old_bare_numbers() {
        let l = load(&["--timeout-secs", "1.5s", "--idle-timeout-secs", "2m", "--slo-ttft-ms", "0.5s"]).unwrap();
        assert_eq!((l.timeout, l.idle_timeout), (Duration::from_millis(1500), Duration::from_secs(120)));
        assert_eq!(l.config().slo.ttft_ms, Some(500.0));
        // Bare numbers keep their old unit (with a warning) for one release.
        let l = load(&["--timeout-secs", "0.5", "--slo-ttft-ms", "250", "--slo-itl-ms", "12.5"]).unwrap();
        assert_eq!(l.timeout, Duration::from_millis(500));
        assert_eq!((l.config().slo.ttft_ms, l.config().slo.itl_ms), (Some(250.0), Some(12.5)));
        let defaults = load(&[]).unwrap();
        assert_eq!(
            (defaults.timeout, defaults.idle_timeout, defaults.slo_ttft),
            (Duration::from_secs(60), Duration::from_secs(30), None)
        );
        assert_eq!(load(&["--timeout-secs", "0s"]).unwrap().config().timeouts.request, MIN_TIMEOUT);
        assert!(load(&["--timeout-secs", "soon"]).is_err());
        let c = compare(&["--startup-timeout-secs", "45"]);
        assert_eq!(c.sim.startup_timeout, Duration::from_secs(45));
        assert_eq!(compare(&["--startup-timeout-secs", "1m"]).sim.startup_timeout, Duration::from_secs(60));
    }
}
