//! Configuration: command-line flags, `PD_SIDECAR_*` environment variables, and an optional TOML
//! file whose keys are the long flag names (`prefill-timeout = "30s"`, lists as arrays); flags
//! win over the environment, which wins over the file.

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use pd_config_file::{parse_duration_or_bare, BareUnit, DurationError};
use pd_http::Bearer;

use crate::allowlist::{AllowError, Allowlist};
use crate::target::{Target, TargetError};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// vLLM NixlConnector protocol: prefill call, then decode call with its kv_transfer_params.
    Vllm,
    /// SGLang bootstrap protocol: both legs at once, paired by bootstrap_room.
    Sglang,
    /// The pd-sim protocol, not an engine feature: the sidecar's xfer agent pulls the blocks
    /// into the simulator's shared-memory pool (`/admin/pool`, `/admin/reserve`), then the
    /// decode call names the reservation. `pull` is the old name.
    #[value(name = "sim-pull", alias = "pull")]
    SimPull,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Fallback {
    /// Let the local engine compute the prompt itself (counted).
    Local,
    /// Answer the client with an OpenAI-style 502/503 error.
    Fail,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ReleaseMethod {
    /// `sim-xfer` when the sidecar has an xfer agent (sim-pull mode), else `decode`.
    Auto,
    /// A discarded one-token decode on the local engine with the held params (any engine).
    Decode,
    /// The pd-sim protocol, not an engine feature: the done notification straight to the
    /// prefill engine's xfer agent. `xfer` is the old name.
    #[value(name = "sim-xfer", alias = "xfer")]
    SimXfer,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl From<Role> for pd_api::Role {
    fn from(role: Role) -> pd_api::Role {
        match role {
            Role::Prefill => pd_api::Role::Prefill,
            Role::Decode => pd_api::Role::Decode,
            Role::Both => pd_api::Role::Both,
        }
    }
}

/// A duration flag: "250ms", "30s" (the shared parser), or bare seconds — the old spelling,
/// accepted for this release with a warning.
fn duration(text: &str) -> Result<Duration, DurationError> {
    parse_duration_or_bare(text, BareUnit::Seconds)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a 5xx HTTP status")]
pub struct StatusError(String);

fn parse_statuses(s: &str) -> Result<u16, StatusError> {
    s.trim().parse::<u16>().ok().filter(|v| (500..600).contains(v)).ok_or_else(|| StatusError(s.to_string()))
}

#[derive(Clone, Debug, Parser)]
#[command(
    name = "pd-sidecar",
    version,
    about = "Decode-first prefill/decode proxy next to one vLLM or SGLang engine",
    long_about = "Decode-first prefill/decode proxy next to one vLLM or SGLang engine.\n\n\
Every flag can also be set with a PD_SIDECAR_<FLAG> environment variable (list flags: comma \
separated) or in a TOML file given with --config, whose keys are the long flag names. Flags win \
over the environment, the environment over the file."
)]
#[command(args_override_self = true)]
pub struct Config {
    /// TOML file with any of these options (keys are the long flag names).
    #[arg(long, env = "PD_SIDECAR_CONFIG")]
    pub config: Option<PathBuf>,

    // ---- serving
    /// Address the proxy listens on.
    #[arg(long, env = "PD_SIDECAR_LISTEN", default_value = "0.0.0.0:8000", help_heading = "Serving")]
    pub listen: String,
    /// The local engine's base URL; repeat for data-parallel ranks (requests go to the least
    /// busy; other paths to the first).
    #[arg(
        long = "engine",
        env = "PD_SIDECAR_ENGINE",
        value_delimiter = ',',
        required = true,
        help_heading = "Serving"
    )]
    pub engines: Vec<String>,
    /// P/D protocol.
    #[arg(long, env = "PD_SIDECAR_MODE", value_enum, default_value_t = Mode::Vllm, help_heading = "Serving")]
    pub mode: Mode,
    /// The xfer agent name the local engine reads KV blocks with (pd-sim: its --engine-id). Sent
    /// as remote_engine_id in the prefill call, so a prefill that issues grants (pd-sim) lets
    /// that agent alone read the held blocks, and only until it frees them (a later read is
    /// refused rather than served from reused memory). vLLM's connectors ignore it (their agents
    /// are named by a random UUID per worker, so leave it unset for vLLM). Unset: no reader
    /// named, the prefill holds the blocks without a grant. In sim-pull mode the sidecar names
    /// its own agent instead.
    #[arg(long, env = "PD_SIDECAR_ENGINE_XFER_AGENT", help_heading = "Serving")]
    pub engine_xfer_agent: Option<String>,
    /// Largest request body accepted, bytes.
    #[arg(long, env = "PD_SIDECAR_MAX_BODY_BYTES", default_value_t = 64 << 20, help_heading = "Serving")]
    pub max_body_bytes: usize,
    /// Requests whose body declares (Content-Length) at least this many bytes, or is sent in
    /// chunks, run on a thread of their own, so that reading, parsing and rewriting a long prompt
    /// (about 2 ns a byte: over a millisecond for a 128 k-token prompt) does not hold up the
    /// other requests on the runtime; at most 4 at a time, more run inline as smaller ones do.
    #[arg(long, env = "PD_SIDECAR_OFFLOAD_BODY_BYTES", default_value_t = 256 << 10, help_heading = "Serving")]
    pub offload_body_bytes: u64,
    /// Tokio worker threads (default 1: one thread, tokio's current-thread runtime). A request
    /// costs the sidecar about 0.05-0.4 ms of CPU (sidecar/README.md), so one thread carries
    /// thousands per second; with more, each upstream exchange may wake an idle worker to steal
    /// the task it hands over: more CPU per request.
    #[arg(long, env = "PD_SIDECAR_WORKERS", help_heading = "Serving")]
    pub workers: Option<usize>,
    /// How long a shutdown waits for requests in flight.
    #[arg(long, env = "PD_SIDECAR_DRAIN_TIMEOUT", value_parser = duration, default_value = "10s", help_heading = "Serving")]
    pub drain_timeout: Duration,

    // ---- prefill selection
    /// Static prefill endpoints (URL or host:port; SGLang bootstrap port per entry as
    /// `URL#bootstrap=PORT`), used round robin when neither an upstream router's header nor
    /// the coordinator names one. Always allowed.
    #[arg(long = "prefill", env = "PD_SIDECAR_PREFILL", value_delimiter = ',', help_heading = "Prefill selection")]
    pub prefills: Vec<String>,
    /// More allowed prefill targets for the x-prefiller-host-port header: host:port, an IP
    /// network (10.0.0.0/8) or a network with a port (10.0.0.0/8:8000).
    #[arg(long = "allow", env = "PD_SIDECAR_ALLOW", value_delimiter = ',', help_heading = "Prefill selection")]
    pub allow: Vec<String>,
    /// Ignore x-prefiller-host-port entirely (it is always stripped before forwarding).
    #[arg(long, env = "PD_SIDECAR_IGNORE_ROUTING_HEADER", help_heading = "Prefill selection")]
    pub ignore_routing_header: bool,
    /// Scheme used for targets named by host:port (header, bare --prefill entries).
    #[arg(long, env = "PD_SIDECAR_PREFILL_SCHEME", default_value = "http", value_parser = ["http", "https"], help_heading = "Prefill selection")]
    pub prefill_scheme: String,
    /// Decode locally, without a prefill leg, when the prompt has fewer (estimated) tokens than
    /// this. 0: always disaggregate.
    #[arg(
        long,
        env = "PD_SIDECAR_LOCAL_PREFILL_BELOW_TOKENS",
        default_value_t = 0,
        help_heading = "Prefill selection"
    )]
    pub local_prefill_below_tokens: u64,
    /// Characters per token when estimating a text prompt's length.
    #[arg(long, env = "PD_SIDECAR_CHARS_PER_TOKEN", default_value_t = 4.0, help_heading = "Prefill selection")]
    pub chars_per_token: f64,
    /// Keep kv_transfer_params (and SGLang bootstrap fields) that clients send instead of
    /// dropping them (they make the engine pull from an address the client chose).
    #[arg(long, env = "PD_SIDECAR_TRUST_CLIENT_KV_PARAMS", help_heading = "Prefill selection")]
    pub trust_client_kv_params: bool,

    // ---- failure handling
    /// Longest wait for the prefill's whole response.
    #[arg(long, env = "PD_SIDECAR_PREFILL_TIMEOUT", value_parser = duration, default_value = "60s", help_heading = "Failure handling")]
    pub prefill_timeout: Duration,
    /// Longest wait for the decode's first body byte (its headers and first chunk).
    #[arg(long, env = "PD_SIDECAR_DECODE_FIRST_BYTE_TIMEOUT", value_parser = duration, default_value = "120s", help_heading = "Failure handling")]
    pub decode_first_byte_timeout: Duration,
    /// Longest silence in the middle of a streamed decode response.
    #[arg(long, env = "PD_SIDECAR_STREAM_IDLE_TIMEOUT", value_parser = duration, default_value = "60s", help_heading = "Failure handling")]
    pub stream_idle_timeout: Duration,
    /// TCP connect timeout towards every upstream (a TLS handshake counts against the leg's
    /// own timeout).
    #[arg(long, env = "PD_SIDECAR_CONNECT_TIMEOUT", value_parser = duration, default_value = "2s", help_heading = "Failure handling")]
    pub connect_timeout: Duration,
    /// Prefill candidates tried per request (connect failure, failover status or timeout moves
    /// to the next).
    #[arg(long, env = "PD_SIDECAR_MAX_PREFILL_ATTEMPTS", default_value_t = 3, help_heading = "Failure handling")]
    pub max_prefill_attempts: usize,
    /// Pause before the first failover; doubles per attempt up to --failover-backoff-max
    /// (with jitter).
    #[arg(long, env = "PD_SIDECAR_FAILOVER_BACKOFF", value_parser = duration, default_value = "20ms", help_heading = "Failure handling")]
    pub failover_backoff: Duration,
    /// Longest pause between two failovers.
    #[arg(long, env = "PD_SIDECAR_FAILOVER_BACKOFF_MAX", value_parser = duration, default_value = "500ms", help_heading = "Failure handling")]
    pub failover_backoff_max: Duration,
    /// Prefill statuses that move on to the next candidate (other 5xx go straight to the
    /// fallback policy; 4xx go back to the client unchanged).
    #[arg(long, env = "PD_SIDECAR_FAILOVER_STATUS", value_delimiter = ',', value_parser = parse_statuses, default_value = "502,503,504", help_heading = "Failure handling")]
    pub failover_status: Vec<u16>,
    /// When every prefill candidate failed.
    #[arg(long, env = "PD_SIDECAR_FALLBACK", value_enum, default_value_t = Fallback::Local, help_heading = "Failure handling")]
    pub fallback: Fallback,
    /// When a prefill answers kv_transfer_params: null (early stop, abort), counted either way.
    #[arg(long, env = "PD_SIDECAR_NULL_PARAMS", value_enum, default_value_t = Fallback::Local, help_heading = "Failure handling")]
    pub null_params: Fallback,
    /// How held prefill blocks are freed when their decode will not happen.
    #[arg(long, env = "PD_SIDECAR_RELEASE_METHOD", value_enum, default_value_t = ReleaseMethod::Auto, help_heading = "Failure handling")]
    pub release_method: ReleaseMethod,
    /// Longest a release call may take.
    #[arg(long, env = "PD_SIDECAR_RELEASE_TIMEOUT", value_parser = duration, default_value = "30s", help_heading = "Failure handling")]
    pub release_timeout: Duration,
    /// Tokens per KV block (sizes a release whose params do not give remote_num_tokens).
    #[arg(long, env = "PD_SIDECAR_BLOCK_SIZE", default_value_t = 16, help_heading = "Failure handling")]
    pub block_size: usize,

    // ---- security
    /// Require `Authorization: Bearer <token>` on every request except /health and /ready.
    #[arg(long, env = "PD_SIDECAR_AUTH_TOKEN", hide_env_values = true, help_heading = "Security")]
    pub auth_token: Option<Bearer>,
    /// Authorization sent upstream (Bearer); by default the client's header is passed on.
    #[arg(long, env = "PD_SIDECAR_UPSTREAM_TOKEN", hide_env_values = true, help_heading = "Security")]
    pub upstream_token: Option<Bearer>,
    /// Serve TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "PD_SIDECAR_TLS_CERT", requires = "tls_key", help_heading = "Security")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "PD_SIDECAR_TLS_KEY", requires = "tls_cert", help_heading = "Security")]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) trusted for https upstreams (default: the web PKI roots).
    #[arg(long, env = "PD_SIDECAR_UPSTREAM_CA", help_heading = "Security")]
    pub upstream_ca: Option<PathBuf>,

    // ---- coordinator
    /// Coordinator base URL (e.g. http://10.0.0.1:7700); without it the static list is used.
    #[arg(long, env = "PD_SIDECAR_COORDINATOR", help_heading = "Coordinator")]
    pub coordinator: Option<String>,
    /// Bearer token sent on every coordinator call (the coordinator's --auth-token).
    #[arg(long, env = "PD_SIDECAR_COORDINATOR_TOKEN", hide_env_values = true, help_heading = "Coordinator")]
    pub coordinator_token: Option<Bearer>,
    /// This engine's id at the coordinator (default: node:listen port).
    #[arg(long, env = "PD_SIDECAR_ENGINE_ID", help_heading = "Coordinator")]
    pub engine_id: Option<String>,
    /// The local engine's role in the P/D split.
    #[arg(long, env = "PD_SIDECAR_ROLE", value_enum, default_value_t = Role::Both, help_heading = "Coordinator")]
    pub role: Role,
    /// Node name reported to the coordinator (default: the host name).
    #[arg(long, env = "PD_SIDECAR_NODE", help_heading = "Coordinator")]
    pub node: Option<String>,
    /// Model served (registration, pairing, release calls).
    #[arg(long, env = "PD_SIDECAR_MODEL", help_heading = "Coordinator")]
    pub model: Option<String>,
    /// URL other components reach this sidecar at (for /pd/release).
    #[arg(long, env = "PD_SIDECAR_ADVERTISE_URL", help_heading = "Coordinator")]
    pub advertise_url: Option<String>,
    /// URL the coordinator reaches the engine at (default: the first --engine).
    #[arg(long, env = "PD_SIDECAR_ADVERTISE_ENGINE_URL", help_heading = "Coordinator")]
    pub advertise_engine_url: Option<String>,
    /// The engine's KV-event publisher (e.g. tcp://10.0.0.2:5557).
    #[arg(long, env = "PD_SIDECAR_KV_EVENTS", help_heading = "Coordinator")]
    pub kv_events: Option<String>,
    /// The topic the engine publishes KV events under (its --kv-events-config `topic`); without
    /// --kv-events it is how a coordinator with --kv-events-listen knows the engine's events.
    #[arg(long, env = "PD_SIDECAR_KV_EVENTS_TOPIC", help_heading = "Coordinator")]
    pub kv_events_topic: Option<String>,
    /// The engine's KV-event replay endpoint.
    #[arg(long, env = "PD_SIDECAR_KV_EVENTS_REPLAY", help_heading = "Coordinator")]
    pub kv_events_replay: Option<String>,
    /// The engine's xfer/NIXL side channel host:port.
    #[arg(long, env = "PD_SIDECAR_XFER_SIDE_CHANNEL", help_heading = "Coordinator")]
    pub xfer_side_channel: Option<String>,
    /// KV blocks the engine holds.
    #[arg(long, env = "PD_SIDECAR_CAPACITY_BLOCKS", help_heading = "Coordinator")]
    pub capacity_blocks: Option<u64>,
    /// The engine's vLLM data-parallel ranks (its --data-parallel-size): the coordinator follows
    /// each rank's KV events (on --kv-events and --kv-events-replay offset by the rank; without
    /// --kv-events, on the coordinator's --kv-events-listen port offset by the rank, where vLLM's ranks
    /// connect) and names the rank holding a prompt, sent to the engine as X-data-parallel-rank.
    #[arg(long, env = "PD_SIDECAR_DATA_PARALLEL_SIZE", value_parser = clap::value_parser!(u32).range(1..=i64::from(pd_api::MAX_DATA_PARALLEL_SIZE)), help_heading = "Coordinator")]
    pub data_parallel_size: Option<u32>,
    /// Timeout of each coordinator call (pairing sits on the request path: keep it short).
    #[arg(long, env = "PD_SIDECAR_COORDINATOR_TIMEOUT", value_parser = duration, default_value = "250ms", help_heading = "Coordinator")]
    pub coordinator_timeout: Duration,
    /// After a failed coordinator call, skip pairing for this long (last view / static list).
    #[arg(long, env = "PD_SIDECAR_COORDINATOR_BACKOFF", value_parser = duration, default_value = "2s", help_heading = "Coordinator")]
    pub coordinator_backoff: Duration,
    /// Do not ask the coordinator for a pairing per request (register and heartbeat only).
    #[arg(long, env = "PD_SIDECAR_NO_PAIRING", help_heading = "Coordinator")]
    pub no_pairing: bool,

    // ---- SGLang
    /// Bootstrap port of prefill targets that do not give one.
    #[arg(long, env = "PD_SIDECAR_BOOTSTRAP_PORT", default_value_t = 8998, help_heading = "SGLang")]
    pub bootstrap_port: u16,

    // ---- sidecar pull
    /// Address the sidecar's xfer TCP backend listens on (pull mode, xfer releases).
    #[arg(long, env = "PD_SIDECAR_XFER_LISTEN", default_value = "0.0.0.0:0", help_heading = "Sidecar pull")]
    pub xfer_listen: String,
    /// Longest one pull (metadata fetch, reservation and READ) may take.
    #[arg(long, env = "PD_SIDECAR_PULL_TIMEOUT", value_parser = duration, default_value = "10s", help_heading = "Sidecar pull")]
    pub pull_timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] pd_config_file::FileError),
    #[error(transparent)]
    Args(#[from] clap::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
    #[error("invalid target: {0}")]
    Target(#[from] TargetError),
    #[error("invalid allowlist: {0}")]
    Allow(#[from] AllowError),
}

/// What the configuration resolves to (targets parsed, allowlist built).
#[derive(Debug, Clone)]
pub struct Resolved {
    pub engines: Vec<Target>,
    pub prefills: Vec<Target>,
    pub allowlist: Allowlist,
}

impl Config {
    /// Parses `args` (program name first) with the environment and the TOML file they name
    /// ([`pd_config_file::merged_args`]).
    pub fn from_args(args: Vec<String>) -> Result<Config, ConfigError> {
        Ok(Config::try_parse_from(pd_config_file::merged_args(args, &Config::command())?)?)
    }

    /// Checks values and parses targets.
    pub fn resolve(&self) -> Result<Resolved, ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        if self.engines.is_empty() {
            return bad("at least one --engine is required");
        }
        if self.max_prefill_attempts == 0 || self.max_prefill_attempts > 32 {
            return bad("max-prefill-attempts must be within 1..=32");
        }
        if !(self.chars_per_token > 0.0 && self.chars_per_token < 1e6) {
            return bad("chars-per-token must be positive");
        }
        if self.block_size == 0 {
            return bad("block-size must be positive");
        }
        if self.engine_xfer_agent.as_deref().is_some_and(|a| a.trim().is_empty()) {
            return bad("engine-xfer-agent must not be empty");
        }
        for d in [self.prefill_timeout, self.decode_first_byte_timeout, self.stream_idle_timeout, self.connect_timeout]
        {
            if d.is_zero() {
                return bad("timeouts must be positive");
            }
        }
        let engines = self.engines.iter().map(|e| Target::parse(e, "http", None)).collect::<Result<Vec<_>, _>>()?;
        let prefills = self
            .prefills
            .iter()
            .map(|p| Target::parse(p, &self.prefill_scheme, Some(self.bootstrap_port)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut allowlist = Allowlist::parse(&self.allow)?;
        for p in &prefills {
            allowlist.add(&p.host_port.authority())?;
        }
        if let Some(c) = &self.coordinator {
            Target::parse(c, "http", None)?;
        }
        Ok(Resolved { engines, prefills, allowlist })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        std::iter::once("pd-sidecar").chain(list.iter().copied()).map(String::from).collect()
    }

    #[test]
    fn durations() {
        assert_eq!(duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(duration("2").unwrap(), Duration::from_secs(2));
        assert_eq!(duration("1m").unwrap(), Duration::from_secs(60));
        for bad in ["", "x", "-1s", "1e99s", "NaNs"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn flags_file_and_validation() {
        let path = std::env::temp_dir().join(format!("pd-sidecar-cfg-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "engine = [\"http://127.0.0.1:8200\"]\nprefill = [\"10.0.0.1:8100\", \"http://p2:8100#bootstrap=9000\"]\n\
             prefill-timeout = \"5s\"\nmode = \"sglang\"\nignore_routing_header = true\nallow = [\"10.9.0.0/16\"]\n",
        )
        .unwrap();
        let c = Config::from_args(args(&["--config", path.to_str().unwrap(), "--prefill-timeout", "7s"])).unwrap();
        assert_eq!((c.mode, c.prefill_timeout, c.ignore_routing_header), (Mode::Sglang, Duration::from_secs(7), true));
        let r = c.resolve().unwrap();
        assert_eq!(r.engines[0].base, "http://127.0.0.1:8200");
        assert_eq!(r.prefills[0].base, "http://10.0.0.1:8100");
        assert_eq!((r.prefills[0].bootstrap_port, r.prefills[1].bootstrap_port), (Some(8998), Some(9000)));
        assert!(r.allowlist.allows(&"p2:8100".parse().unwrap()));
        assert!(r.allowlist.allows(&"10.9.3.3:1".parse().unwrap()));
        std::fs::remove_file(&path).unwrap();

        assert!(Config::from_args(args(&[])).is_err(), "--engine is required");
        let c = Config::from_args(args(&["--engine", "127.0.0.1:1", "--max-prefill-attempts", "0"])).unwrap();
        assert!(matches!(c.resolve(), Err(ConfigError::Invalid(_))));
        let c = Config::from_args(args(&["--engine", "a:1,b:2", "--failover-status", "502,500"])).unwrap();
        assert_eq!((c.engines.len(), c.failover_status.clone()), (2, vec![502, 500]));
        assert!(Config::from_args(args(&["--engine", "a:1", "--failover-status", "404"])).is_err());
        let c = Config::from_args(args(&["--engine", "a:1", "--allow", "not a target"])).unwrap();
        assert!(matches!(c.resolve(), Err(ConfigError::Allow(_))));
    }
}
