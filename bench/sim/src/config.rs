//! Configuration: command-line flags, `PD_SIM_*` environment variables, and an optional TOML
//! file whose keys are the long flag names (`block-size = 16`); flags win over the file.

use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use pd_config_file::{duration_or_millis, duration_or_secs};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FailurePolicy {
    /// Answer HTTP 500 when the KV blocks cannot be pulled.
    Fail,
    /// Compute the prompt locally instead (counted).
    Recompute,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum PrefillQueueMode {
    /// Each prompt takes its own time, however many are computed at once.
    #[default]
    None,
    /// One prompt at a time, in arrival order: the engine's prefill throughput is one token per
    /// `--prefill-us-per-token`, as a GPU's is, so prompts arriving together wait for each other.
    Fifo,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Role {
    /// vLLM style: any request may carry `kv_transfer_params`.
    Both,
    /// SGLang style prefill: holds a bootstrap room's blocks until its decode pulls them.
    Prefill,
    /// SGLang style decode: pulls from the prefill named by `bootstrap_host`/`bootstrap_port`.
    Decode,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum EventLayout {
    /// Events as maps tagged by "type" (vLLM 0.32).
    Map,
    /// Events as tagged arrays (older vLLM).
    Array,
}

#[derive(Clone, Debug, Parser)]
#[command(name = "pd-sim", version, about = "An OpenAI-compatible vLLM/SGLang stand-in whose KV blocks really move")]
#[command(args_override_self = true)]
pub struct Config {
    /// TOML file with any of these options (keys are the long flag names).
    #[arg(long, env = "PD_SIM_CONFIG")]
    pub config: Option<PathBuf>,

    /// Address the HTTP API binds to.
    #[arg(long, env = "PD_SIM_HOST", default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the HTTP API (OpenAI routes, /health, /metrics).
    #[arg(long, env = "PD_SIM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Model name served (`/v1/models`; requests naming another model get 404).
    #[arg(long, default_value = "sim-model")]
    pub model: String,
    /// A Hugging Face tokenizer.json; without it a simple word tokenizer is used.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV bytes per token (a block holds block-size × this; must make blocks a multiple of 8).
    #[arg(long, default_value_t = 256)]
    pub bytes_per_token: usize,
    /// Blocks in the pool.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: usize,
    /// Longest prompt plus output, in tokens; longer requests get 400.
    #[arg(long, default_value_t = 8192)]
    pub max_model_len: usize,
    /// max_tokens when a request gives none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: usize,
    /// Prefill time per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub prefill_us_per_token: f64,
    /// Decode time per output token, microseconds.
    #[arg(long, default_value_t = 0.0)]
    pub decode_us_per_token: f64,
    /// How much of a prefill token's time each decode step running beside it pays (the
    /// interference law, bench/sim/README.md "Prefill/decode interference"); 0 turns it off.
    #[arg(long, default_value_t = 1.0)]
    pub interference_factor: f64,
    /// Prefill tokens one step carries at most (vLLM's max_num_batched_tokens): caps what a
    /// single decode step pays for interference.
    #[arg(long, default_value_t = 2048)]
    pub step_token_budget: u64,
    /// How prompts computed at the same time share the engine (bench/sim/README.md, "Prompts
    /// computed at the same time").
    #[arg(long, value_enum, default_value_t = PrefillQueueMode::None)]
    pub prefill_queue: PrefillQueueMode,
    /// Requests running at once; more wait in a queue.
    #[arg(long, default_value_t = 256)]
    pub max_running: usize,
    /// Longest a request waits in the queue (or for free blocks) before a 503.
    #[arg(long = "queue-timeout-secs", value_parser = duration_or_secs, default_value = "60s")]
    pub queue_timeout: Duration,

    /// Fraction of requests answered with HTTP 500 (failure injection; also at runtime).
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Delay added to every request (failure injection).
    #[arg(long = "delay-ms", value_parser = duration_or_millis, default_value = "0ms")]
    pub delay: Duration,

    /// This engine's id (the xfer agent name, `remote_engine_id`); a random UUID by default.
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Host the xfer side channel and data port listen on and advertise (`remote_host`).
    #[arg(long, env = "VLLM_HOST_IP", default_value = "127.0.0.1")]
    pub host_ip: String,
    /// xfer side-channel port (`remote_port`; vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT). 0 = any.
    #[arg(long, env = "VLLM_NIXL_SIDE_CHANNEL_PORT", default_value_t = 0)]
    pub xfer_port: u16,
    /// xfer TCP data port. 0 = any.
    #[arg(long, default_value_t = 0)]
    pub xfer_data_port: u16,
    /// How long a prefill holds blocks for a decode that has not pulled them.
    #[arg(long = "kv-lease-secs", value_parser = duration_or_secs, default_value = "30s")]
    pub kv_lease: Duration,
    /// How far a heartbeat from the decode pushes the lease out.
    #[arg(long = "heartbeat-extension-secs", value_parser = duration_or_secs, default_value = "20s")]
    pub heartbeat_extension: Duration,
    /// How often a decode waiting to pull sends heartbeats (0s: never).
    #[arg(long = "heartbeat-interval-secs", value_parser = duration_or_secs, default_value = "5s")]
    pub heartbeat_interval: Duration,
    /// Longest one pull (metadata fetch + READ) may take.
    #[arg(long = "pull-timeout-secs", value_parser = duration_or_secs, default_value = "10s")]
    pub pull_timeout: Duration,
    /// What a decode does when it cannot pull or verify the blocks.
    #[arg(long, value_enum, default_value_t = FailurePolicy::Recompute)]
    pub kv_load_failure_policy: FailurePolicy,
    /// Hold a prefill's blocks without a revocable xfer grant (older peers, comparisons). By
    /// default a prefill told its decode's agent grants that agent exactly the held blocks for
    /// the lease, and a decode reads under the grant its params carry.
    #[arg(long)]
    pub no_kv_grants: bool,
    /// What a decode does when the prefill refuses a read because it revoked the grant (the
    /// lease ended first): compute the prompt itself, or answer HTTP 500.
    #[arg(long, value_enum, default_value_t = FailurePolicy::Recompute)]
    pub late_read_policy: FailurePolicy,
    /// Keep the pool in this shared-memory file (e.g. /dev/shm/pd-sim-0) so a co-located
    /// sidecar can register it and move blocks on the engine's behalf.
    #[arg(long)]
    pub shm_path: Option<PathBuf>,

    /// SGLang-style role.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// SGLang bootstrap port: the prefill serves it; a decode uses it when a request's
    /// bootstrap_port is null.
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// How long a decode waits for its prefill's room, and a prefill for its decode.
    #[arg(long = "bootstrap-timeout-secs", value_parser = duration_or_secs, default_value = "300s")]
    pub bootstrap_timeout: Duration,

    /// ZMQ endpoint of the KV-event publisher (e.g. tcp://*:5557); no events without it.
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER endpoint answering replay requests (e.g. tcp://*:5558).
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// ZMQ topic the KV events are published under.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// How each KV event is encoded in a batch.
    #[arg(long, value_enum, default_value_t = EventLayout::Map)]
    pub kv_events_layout: EventLayout,
    /// Block hashes in events as raw 32-byte digests instead of u64
    /// (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
    #[arg(long)]
    pub kv_events_bytes_hashes: bool,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// data_parallel_rank in event batches.
    #[arg(long)]
    pub data_parallel_rank: Option<i64>,
    /// Seeds NONE_HASH as vLLM does.
    #[arg(long, env = "PYTHONHASHSEED")]
    pub pythonhashseed: Option<String>,

    /// Tokio worker threads (default: available cores).
    #[arg(long)]
    pub workers: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    File(#[from] pd_config_file::FileError),
    #[error(transparent)]
    Args(#[from] clap::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl Config {
    /// Parses `args` (program name first) with the environment and the TOML file they name
    /// ([`pd_config_file::merged_args`]).
    pub fn from_args(args: Vec<String>) -> Result<Config, ConfigError> {
        let config = Config::try_parse_from(pd_config_file::merged_args(args, &Config::command())?)?;
        config.validate()?;
        Ok(config)
    }

    pub fn block_bytes(&self) -> usize {
        self.block_size * self.bytes_per_token
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        if self.block_size == 0 || self.bytes_per_token == 0 || self.num_blocks == 0 {
            return bad("block-size, bytes-per-token and num-blocks must be positive");
        }
        if self.block_bytes() & 7 != 0 {
            return bad("block-size × bytes-per-token must be a multiple of 8");
        }
        if self.num_blocks >= u32::MAX as usize || self.block_bytes().checked_mul(self.num_blocks).is_none() {
            return bad("pool too large");
        }
        if !(0.0..=1.0).contains(&self.error_rate) {
            return bad("error-rate must be within 0..=1");
        }
        if self.max_running == 0 || self.step_token_budget == 0 {
            return bad("max-running and step-token-budget must be positive");
        }
        // Durations are bounded by their parser; the per-token rates are plain numbers.
        let rates = [self.prefill_us_per_token, self.decode_us_per_token, self.interference_factor];
        if rates.iter().any(|s| !s.is_finite() || *s < 0.0 || *s > 1e9) {
            return bad("times must be finite, non-negative and below 1e9");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        std::iter::once("pd-sim").chain(list.iter().copied()).map(String::from).collect()
    }

    #[test]
    fn file_then_flags() {
        let path = std::env::temp_dir().join(format!("pd-sim-cfg-{}.toml", std::process::id()));
        std::fs::write(&path, "block_size = 32\nport = 9000\nkv-events-bytes-hashes = true\nmodel = \"m\"\n").unwrap();
        let c = Config::from_args(args(&["--config", path.to_str().unwrap(), "--port", "9001"])).unwrap();
        assert_eq!((c.block_size, c.port, c.kv_events_bytes_hashes, c.model.as_str()), (32, 9001, true, "m"));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            Config::from_args(args(&["--bytes-per-token", "3", "--block-size", "3"])),
            Err(ConfigError::Invalid(_))
        ));
        assert!(matches!(Config::from_args(args(&["--error-rate", "2"])), Err(ConfigError::Invalid(_))));
    }

    #[test]
    fn durations_take_units_and_the_old_bare_numbers() {
        let c =
            Config::from_args(args(&["--kv-lease-secs", "1.5s", "--delay-ms", "250ms", "--pull-timeout-secs", "2m"]))
                .unwrap();
        assert_eq!(
            (c.kv_lease, c.delay, c.pull_timeout),
            (Duration::from_millis(1500), Duration::from_millis(250), Duration::from_secs(120))
        );
        // Bare numbers keep their old unit (with a warning) for one release.
        let c =
            Config::from_args(args(&["--kv-lease-secs", "0.5", "--delay-ms", "300", "--bootstrap-timeout-secs", "2"]))
                .unwrap();
        assert_eq!(
            (c.kv_lease, c.delay, c.bootstrap_timeout),
            (Duration::from_millis(500), Duration::from_millis(300), Duration::from_secs(2))
        );
        let defaults = Config::from_args(args(&[])).unwrap();
        assert_eq!(
            (defaults.queue_timeout, defaults.heartbeat_interval, defaults.delay),
            (Duration::from_secs(60), Duration::from_secs(5), Duration::ZERO)
        );
        for bad in [["--kv-lease-secs", "soon"], ["--delay-ms", "-1"], ["--pull-timeout-secs", "1e12"]] {
            assert!(matches!(Config::from_args(args(&bad)), Err(ConfigError::Args(_))), "{bad:?}");
        }
        // A TOML file writes them the same way.
        let path = std::env::temp_dir().join(format!("pd-sim-durations-{}.toml", std::process::id()));
        std::fs::write(&path, "kv-lease-secs = \"45s\"\nheartbeat_interval_secs = 2\n").unwrap();
        let c = Config::from_args(args(&["--config", path.to_str().unwrap()])).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!((c.kv_lease, c.heartbeat_interval), (Duration::from_secs(45), Duration::from_secs(2)));
    }
}
