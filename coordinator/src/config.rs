//! Configuration: command-line flags, `PD_COORDINATOR_*` environment variables, and an optional
//! TOML file whose keys are the long flag names (`lease-ms = 3000`); flags win over the file,
//! the file over the environment. The static cluster (engines declared by the operator) is a
//! second TOML file, `--cluster`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{CommandFactory, Parser};
use pd_config_file::{parse_duration, warn_unitless, DurationError};
use pd_http::Bearer;
use serde::Deserialize;

use crate::api::EngineSpecJson;
use crate::cluster::Settings;
use crate::pairing::{LocalPrefillPolicy, TierWeights, Weights};
use crate::placement::Placement;
use crate::prompt::BlockHashScheme;
use crate::topic::TopicPattern;

#[derive(Clone, Debug, Parser)]
#[command(
    name = "pd-coordinator",
    version,
    about = "Membership, KV-aware pairing of prefill and decode engines, and failure cleanup for P/D serving",
    long_about = "Membership, KV-aware pairing of prefill and decode engines, and failure cleanup for \
                  prefill/decode disaggregated serving on bare-metal nodes.\n\n\
                  Engines are declared in a TOML cluster file (--cluster) and/or registered by their \
                  sidecars over the API (HTTP/JSON on --listen, gRPC on --grpc-listen; see API.md). \
                  Every option can also be set in a TOML file (--config; keys are the long option \
                  names) or through the environment variable shown."
)]
#[command(args_override_self = true)]
pub struct Config {
    /// TOML file with any of these options (keys are the long option names).
    #[arg(long, env = "PD_COORDINATOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// TOML file declaring the static engines (`[[engines]]` tables; see README).
    #[arg(long, env = "PD_COORDINATOR_CLUSTER")]
    pub cluster: Option<PathBuf>,

    /// HTTP/JSON API and /metrics address.
    #[arg(long, env = "PD_COORDINATOR_LISTEN", default_value = "0.0.0.0:7700")]
    pub listen: SocketAddr,
    /// gRPC API address (package pd.coordinator.v1).
    #[arg(long, env = "PD_COORDINATOR_GRPC_LISTEN", default_value = "0.0.0.0:7701")]
    pub grpc_listen: SocketAddr,
    /// Do not serve gRPC.
    #[arg(long, env = "PD_COORDINATOR_NO_GRPC")]
    pub no_grpc: bool,

    /// Where membership and leases live: `memory` (this process only) or
    /// `etcd://host:port[,host:port...]` (shared by every coordinator using the same etcd and
    /// --etcd-prefix).
    #[arg(long, env = "PD_COORDINATOR_STORE", default_value = "memory")]
    pub store: String,
    /// Key prefix in etcd; coordinators of one cluster share it.
    #[arg(long, env = "PD_COORDINATOR_ETCD_PREFIX", default_value = "/pd-coordinator/")]
    pub etcd_prefix: String,

    /// Lease of an engine: it is dead when neither a heartbeat nor (for engines without a
    /// sidecar) a successful health check renewed it for this long.
    #[arg(long, env = "PD_COORDINATOR_LEASE_MS", value_parser = millis, value_name = "DURATION", default_value = "3s")]
    pub lease_ms: u64,
    /// Heartbeat interval told to sidecars.
    #[arg(long, env = "PD_COORDINATOR_HEARTBEAT_MS", value_parser = millis, value_name = "DURATION", default_value = "1s")]
    pub heartbeat_ms: u64,
    /// How often every engine's GET /health is polled (0s: never).
    #[arg(long, env = "PD_COORDINATOR_HEALTH_INTERVAL_MS", value_parser = millis, value_name = "DURATION", default_value = "1s")]
    pub health_interval_ms: u64,
    /// Timeout of one health check.
    #[arg(long, env = "PD_COORDINATOR_HEALTH_TIMEOUT_MS", value_parser = millis, value_name = "DURATION", default_value = "1s")]
    pub health_timeout_ms: u64,
    /// Consecutive failed health checks after which an engine is dead.
    #[arg(long, env = "PD_COORDINATOR_HEALTH_FAILURES", default_value_t = 2)]
    pub health_failures: u32,
    /// How often leases are checked.
    #[arg(long, env = "PD_COORDINATOR_TICK_MS", value_parser = millis, value_name = "DURATION", default_value = "100ms")]
    pub tick_ms: u64,

    /// Hugging Face tokenizer.json used to turn a pair request's `prompt` into token ids
    /// (exact block hashes); without it prompts are hashed approximately (text chunks).
    #[arg(long, env = "PD_COORDINATOR_TOKENIZER")]
    pub tokenizer: Option<PathBuf>,
    /// Add the tokenizer's special tokens (BOS...) when encoding prompts, as vLLM does for
    /// /v1/completions.
    #[arg(long, env = "PD_COORDINATOR_TOKENIZER_ADD_SPECIAL_TOKENS")]
    pub tokenizer_add_special_tokens: bool,
    /// Whose block hashes the engines' KV events carry: vllm (sha256_cbor) or sglang (its
    /// radix-cache page chain).
    #[arg(long, env = "PD_COORDINATOR_BLOCK_HASH", value_enum, default_value_t = BlockHashScheme::Vllm)]
    pub block_hash: BlockHashScheme,
    /// Seeds vLLM's NONE_HASH (set it when the engines run with PYTHONHASHSEED).
    #[arg(long, env = "PYTHONHASHSEED")]
    pub pythonhashseed: Option<String>,
    /// Characters per token assumed when hashing prompt text approximately.
    #[arg(long, env = "PD_COORDINATOR_APPROX_CHARS_PER_TOKEN", default_value_t = 4)]
    pub approx_chars_per_token: usize,
    /// How long a routed prefix counts as cached on an engine whose events cannot confirm it
    /// (no KV events, or approximate hashes).
    #[arg(long, env = "PD_COORDINATOR_APPROX_TTL_SECS", value_parser = secs, value_name = "DURATION", default_value = "120s")]
    pub approx_ttl_secs: f64,
    /// How long a routing decision counts as "the engines hold this prefix" before their
    /// events confirm it.
    #[arg(long, env = "PD_COORDINATOR_SPECULATIVE_TTL_MS", value_parser = millis, value_name = "DURATION", default_value = "2s")]
    pub speculative_ttl_ms: u64,
    /// A handoff that never finished is phantom load after this long (and held blocks are
    /// released).
    #[arg(long, env = "PD_COORDINATOR_HANDOFF_MAX_AGE_SECS", value_parser = secs, value_name = "DURATION", default_value = "120s")]
    pub handoff_max_age_secs: f64,
    /// An engine dead this long is removed altogether (unknown id, number reused; it must
    /// register as new); 0s keeps dead engines forever. Static engines are kept.
    #[arg(long, env = "PD_COORDINATOR_FORGET_DEAD_AFTER_SECS", value_parser = secs, value_name = "DURATION", default_value = "300s")]
    pub forget_dead_after_secs: f64,

    /// Cost of a block of prefill work against a block of decode load (Dynamo's weighting is 1).
    #[arg(long, env = "PD_COORDINATOR_PREFILL_SCALE", default_value_t = Weights::default().prefill_scale)]
    pub prefill_scale: f64,
    /// Prefill work one cached block saves (1.0 = a whole block; above 1 it also forgives as
    /// much of the engine's prefill queue; Dynamo's weighting is 1).
    #[arg(long, env = "PD_COORDINATOR_OVERLAP_CREDIT", default_value_t = Weights::default().overlap_credit)]
    pub overlap_credit: f64,
    /// What a cached block in host memory saves against one on GPU (1.0).
    #[arg(long, env = "PD_COORDINATOR_CPU_TIER_WEIGHT", default_value_t = TierWeights::default().cpu)]
    pub cpu_tier_weight: f64,
    /// The same for a block on disk (or any other slower medium).
    #[arg(long, env = "PD_COORDINATOR_DISK_TIER_WEIGHT", default_value_t = TierWeights::default().disk)]
    pub disk_tier_weight: f64,
    /// 0 picks the cheapest engine; above 0 samples among near-best ones.
    #[arg(long, env = "PD_COORDINATOR_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f64,
    /// Fixes the placement: prefill on the decode engine itself when fewer uncached tokens than
    /// this remain... Unset (with the ratio), the coordinator learns where to compute each
    /// prompt from the prefill and transfer times it observes (coordinator/README.md,
    /// "Placement"), deciding by 2048 and 0.7 until it has seen a few of each.
    #[arg(long, env = "PD_COORDINATOR_LOCAL_PREFILL_MAX_TOKENS")]
    pub local_prefill_max_tokens: Option<u64>,
    /// ...and they are less than this share of the prompt (also fixes the placement).
    #[arg(long, env = "PD_COORDINATOR_LOCAL_PREFILL_MAX_RATIO")]
    pub local_prefill_max_ratio: Option<f64>,
    /// The most a prompt computed on an engine that decodes may stall the requests decoding there
    /// (ms, summed over them, as the learned placement predicts it); a prompt over it goes to a
    /// prefill-only engine when there is one. For clusters whose inter-token latency matters
    /// more than time to first token. Unset: the stall is weighed against the time to first
    /// token. Not with the fixed thresholds above.
    #[arg(long, env = "PD_COORDINATOR_MAX_DECODE_STALL_MS")]
    pub max_decode_stall_ms: Option<f64>,
    /// A pair request's local_engine stays the decode unless its cost exceeds this × the best.
    #[arg(long, env = "PD_COORDINATOR_LOCAL_DECODE_SLACK", default_value_t = 1.5)]
    pub local_decode_slack: f64,

    /// Timeout of a POST {sidecar}/pd/release.
    #[arg(long, env = "PD_COORDINATOR_RELEASE_TIMEOUT_MS", value_parser = millis, value_name = "DURATION", default_value = "2s")]
    pub release_timeout_ms: u64,
    /// ZMQ topic subscribed to on every engine's KV-event publisher ("" = all).
    #[arg(long, env = "PD_COORDINATOR_KV_EVENTS_TOPIC", default_value = "")]
    pub kv_events_topic: String,
    /// Collector mode: bind a SUB socket here (e.g. tcp://0.0.0.0:5557) for engines whose
    /// --kv-events-config endpoint names this host (vLLM then connects instead of binding);
    /// each message's topic says which engine sent it. Data-parallel rank r connects to this
    /// port + r, bound once an engine registers with that many ranks.
    #[arg(long, env = "PD_COORDINATOR_KV_EVENTS_LISTEN")]
    pub kv_events_listen: Option<String>,
    /// How collector-mode topics name their engine: `{engine}` is an engine id or the host of
    /// its engine_url, `{model}` (optional) its model; llm-d's convention is the default.
    #[arg(long, env = "PD_COORDINATOR_KV_EVENTS_TOPIC_PATTERN", default_value = crate::topic::DEFAULT_PATTERN)]
    pub kv_events_topic_pattern: String,

    /// Require `Authorization: Bearer <token>` on every HTTP and gRPC call except /health and
    /// /metrics (sidecars send it with --coordinator-token).
    #[arg(long, env = "PD_COORDINATOR_AUTH_TOKEN", hide_env_values = true)]
    pub auth_token: Option<Bearer>,
    /// Bearer token sent on the release calls to sidecars (their --auth-token).
    #[arg(long, env = "PD_COORDINATOR_SIDECAR_TOKEN", hide_env_values = true)]
    pub sidecar_token: Option<Bearer>,
    /// Serve the HTTP and gRPC APIs over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, env = "PD_COORDINATOR_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "PD_COORDINATOR_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// CA certificates (PEM) trusted for https sidecars and engines (default: the web PKI roots).
    #[arg(long, env = "PD_COORDINATOR_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// Log filter (tracing's EnvFilter syntax); without it RUST_LOG, else `info`.
    #[arg(long, env = "PD_COORDINATOR_LOG")]
    pub log: Option<String>,
    /// Tokio worker threads (default: available cores).
    #[arg(long, env = "PD_COORDINATOR_WORKERS")]
    pub workers: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {reason}")]
    File { path: String, reason: String },
    #[error(transparent)]
    Settings(#[from] pd_config_file::FileError),
    #[error(transparent)]
    Args(#[from] clap::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

/// Where membership lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreUrl {
    Memory,
    Etcd(Vec<String>),
}

impl Config {
    /// Parses `args` (program name first) with the environment and the TOML file they name
    /// ([`pd_config_file::merged_args`]).
    pub fn from_args(args: Vec<String>) -> Result<Config, ConfigError> {
        let config = Config::try_parse_from(pd_config_file::merged_args(args, &Config::command())?)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: &str| Err(ConfigError::Invalid(m.to_string()));
        if self.lease_ms == 0 || self.heartbeat_ms == 0 || self.tick_ms == 0 {
            return bad("lease-ms, heartbeat-ms and tick-ms must be positive");
        }
        if self.heartbeat_ms >= self.lease_ms {
            return bad("heartbeat-ms must be shorter than lease-ms");
        }
        // Instants plus these must not overflow.
        let year_ms = 365 * 86_400_000;
        let millis = [
            self.lease_ms,
            self.heartbeat_ms,
            self.health_interval_ms,
            self.health_timeout_ms,
            self.tick_ms,
            self.speculative_ttl_ms,
            self.release_timeout_ms,
        ];
        if millis.iter().any(|&ms| ms > year_ms) {
            return bad("times must be below a year");
        }
        if self.health_failures == 0 || self.health_timeout_ms == 0 {
            return bad("health-failures and health-timeout-ms must be positive");
        }
        if self.approx_chars_per_token == 0 {
            return bad("approx-chars-per-token must be positive");
        }
        let finite = [
            self.approx_ttl_secs,
            self.handoff_max_age_secs,
            self.forget_dead_after_secs,
            self.prefill_scale,
            self.overlap_credit,
            self.temperature,
            self.cpu_tier_weight,
            self.disk_tier_weight,
            self.local_prefill_max_ratio.unwrap_or_default(),
            self.local_decode_slack,
            self.max_decode_stall_ms.unwrap_or_default(),
        ];
        if finite.iter().any(|v| !v.is_finite() || *v < 0.0 || *v > 1e7) {
            return bad("weights and times must be finite, non-negative and below 1e7");
        }
        let fixed = self.local_prefill_max_tokens.is_some() || self.local_prefill_max_ratio.is_some();
        if fixed && self.max_decode_stall_ms.is_some() {
            return bad("max-decode-stall-ms bounds the learned placement; local-prefill-max-tokens and -ratio fix it instead (give one or the other)");
        }
        self.store_url()?;
        self.topic_pattern()?;
        if let Some(listen) = &self.kv_events_listen {
            if !["tcp://", "ipc://"].iter().any(|scheme| listen.starts_with(scheme)) {
                return bad("kv-events-listen must be a tcp:// or ipc:// ZMQ endpoint");
            }
        }
        Ok(())
    }

    pub fn store_url(&self) -> Result<StoreUrl, ConfigError> {
        if self.store == "memory" {
            return Ok(StoreUrl::Memory);
        }
        let Some(rest) = self.store.strip_prefix("etcd://") else {
            return Err(ConfigError::Invalid(format!("--store {:?}: expected memory or etcd://host:port", self.store)));
        };
        let endpoints: Vec<String> =
            rest.trim_end_matches('/').split(',').filter(|e| !e.is_empty()).map(|e| format!("http://{e}")).collect();
        if endpoints.is_empty() {
            return Err(ConfigError::Invalid("--store etcd:// needs at least one host:port".into()));
        }
        Ok(StoreUrl::Etcd(endpoints))
    }

    pub fn topic_pattern(&self) -> Result<TopicPattern, ConfigError> {
        TopicPattern::parse(&self.kv_events_topic_pattern).map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    pub fn lease(&self) -> Duration {
        Duration::from_millis(self.lease_ms)
    }

    /// The sans-I/O core's settings.
    /// Learned, unless a threshold is given (the other then keeps its default).
    fn placement(&self) -> Placement {
        if self.local_prefill_max_tokens.is_none() && self.local_prefill_max_ratio.is_none() {
            return Placement::Adaptive {
                cold: LocalPrefillPolicy::default(),
                max_decode_stall_ms: self.max_decode_stall_ms,
            };
        }
        let d = LocalPrefillPolicy::default();
        Placement::Fixed(LocalPrefillPolicy {
            max_uncached_tokens: self.local_prefill_max_tokens.unwrap_or(d.max_uncached_tokens),
            max_uncached_ratio: self.local_prefill_max_ratio.unwrap_or(d.max_uncached_ratio),
        })
    }

    pub fn settings(&self) -> Settings {
        Settings {
            lease: self.lease(),
            weights: Weights {
                prefill_scale: self.prefill_scale,
                overlap_credit: self.overlap_credit,
                temperature: self.temperature,
            },
            tier_weights: TierWeights { cpu: self.cpu_tier_weight, disk: self.disk_tier_weight },
            placement: self.placement(),
            handoff_max_age: Duration::from_secs_f64(self.handoff_max_age_secs),
            speculative_ttl: Duration::from_millis(self.speculative_ttl_ms),
            rekey_sglang_adapters: self.block_hash == BlockHashScheme::Sglang,
        }
    }
}

/// A `*-ms` flag: a duration ("250ms", "3s"), or bare milliseconds — the old spelling, taken
/// as before (range checked by [`Config::validate`]) with a warning.
fn millis(text: &str) -> Result<u64, DurationError> {
    if let Ok(ms) = text.trim().parse::<u64>() {
        warn_unitless(text, "ms");
        return Ok(ms);
    }
    parse_duration(text).map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A `*-secs` flag: a duration ("120s", "2m"), or bare seconds — the old spelling, taken as
/// before (range checked by [`Config::validate`]) with a warning.
fn secs(text: &str) -> Result<f64, DurationError> {
    if let Ok(secs) = text.trim().parse::<f64>() {
        warn_unitless(text, "s");
        return Ok(secs);
    }
    parse_duration(text).map(|d| d.as_secs_f64())
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map_err(|e| ConfigError::File { path: path.display().to_string(), reason: e.to_string() })
}

/// The static cluster file: `[[engines]]` tables with the fields of a registration
/// (`capacity` is accepted for `capacity_blocks`).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    #[serde(default)]
    pub engines: Vec<EngineSpecJson>,
}

impl ClusterFile {
    pub fn load(path: &Path) -> Result<ClusterFile, ConfigError> {
        let text = read(path)?;
        let file: ClusterFile = toml::from_str(&text)
            .map_err(|e| ConfigError::File { path: path.display().to_string(), reason: e.to_string() })?;
        let mut seen = std::collections::HashSet::new();
        for engine in &file.engines {
            engine
                .validate()
                .map_err(|e| ConfigError::Invalid(format!("{}: engine {:?}: {e}", path.display(), engine.id)))?;
            if !seen.insert(engine.id.as_str()) {
                return Err(ConfigError::Invalid(format!(
                    "{}: engine id {:?} declared twice",
                    path.display(),
                    engine.id
                )));
            }
        }
        Ok(file)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Vec<String> {
        std::iter::once("pd-coordinator").chain(list.iter().copied()).map(String::from).collect()
    }

    fn temp(name: &str, text: &str) -> PathBuf {
        let path = std::env::temp_dir().join(format!("pd-coord-{}-{name}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn file_then_flags_and_validation() {
        let path = temp("cfg.toml", "lease_ms = \"5s\"\nlisten = \"127.0.0.1:9000\"\nno-grpc = true\n");
        let c = Config::from_args(args(&["--config", path.to_str().unwrap(), "--listen", "127.0.0.1:9001"])).unwrap();
        assert_eq!((c.lease_ms, c.listen.port(), c.no_grpc), (5000, 9001, true));
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(Config::from_args(args(&["--heartbeat-ms", "5000"])), Err(ConfigError::Invalid(_))));
        assert!(matches!(Config::from_args(args(&["--store", "redis://x"])), Err(ConfigError::Invalid(_))));
        let pattern = ["--kv-events-topic-pattern", "kv@{model}"];
        assert!(matches!(Config::from_args(args(&pattern)), Err(ConfigError::Invalid(_))));
        let listen = ["--kv-events-listen", "0.0.0.0:5557"];
        assert!(matches!(Config::from_args(args(&listen)), Err(ConfigError::Invalid(_))));
        let huge = u64::MAX.to_string();
        assert!(matches!(Config::from_args(args(&["--speculative-ttl-ms", &huge])), Err(ConfigError::Invalid(_))));
        assert!(matches!(Config::from_args(args(&["--approx-ttl-secs", "inf"])), Err(ConfigError::Invalid(_))));
        let budget = Config::from_args(args(&["--max-decode-stall-ms", "4"])).unwrap();
        let expected = Placement::Adaptive { cold: LocalPrefillPolicy::default(), max_decode_stall_ms: Some(4.0) };
        assert_eq!(budget.settings().placement, expected);
        let both = ["--max-decode-stall-ms", "4", "--local-prefill-max-tokens", "100"];
        assert!(
            matches!(Config::from_args(args(&both)), Err(ConfigError::Invalid(m)) if m.contains("max-decode-stall-ms"))
        );
        assert!(matches!(Config::from_args(args(&["--max-decode-stall-ms=-1"])), Err(ConfigError::Invalid(_))));
        let etcd = Config::from_args(args(&["--store", "etcd://a:1,b:2"])).unwrap();
        assert_eq!(etcd.store_url().unwrap(), StoreUrl::Etcd(vec!["http://a:1".into(), "http://b:2".into()]));
    }

    #[test]
    fn cluster_file() {
        let path = temp(
            "cluster.toml",
            r#"
[[engines]]
id = "p0"
role = "prefill"
node = "n1"
model = "m"
engine_url = "http://10.0.0.1:8000"
kv_events = "tcp://10.0.0.1:5557"
replay = "tcp://10.0.0.1:5558"
block_size = 16
capacity = 4096

[[engines]]
id = "d0"
role = "decode"
node = "n2"
model = "m"
engine_url = "http://10.0.0.2:8000"
sidecar_url = "http://10.0.0.2:9000"
block_size = 16
"#,
        );
        let file = ClusterFile::load(&path).unwrap();
        assert_eq!(file.engines.len(), 2);
        assert_eq!(file.engines[0].capacity_blocks, Some(4096));
        std::fs::write(&path, "[[engines]]\nid = \"x\"\nbogus = 1\n").unwrap();
        assert!(ClusterFile::load(&path).is_err());
        std::fs::remove_file(&path).unwrap();
    }
}
