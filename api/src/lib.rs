//! `pd-api`: the coordinator's wire contract (coordinator/API.md) as one set of types. The
//! coordinator's HTTP edge reads and writes them, its gRPC edge maps them to the proto messages,
//! and the sidecar sends and reads the same types: there is no second declaration to drift.
//!
//! Requests the coordinator reads reject unknown fields; answers it writes are read leniently
//! where the sidecar has to tolerate an older coordinator (missing fields take defaults).
//! `kv_transfer_params` travel as raw JSON text, verbatim (key order, number precision).

#![forbid(unsafe_code)]

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// Longest id, model name or URL accepted, bytes.
pub const MAX_NAME: usize = 512;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: u32 = 1 << 20;
/// Most data-parallel ranks an engine may declare.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 1024;
/// The header vLLM routes a request to one of its data-parallel ranks by (its value: the rank).
pub const DATA_PARALLEL_RANK_HEADER: &str = "x-data-parallel-rank";

/// What an engine does in a disaggregated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Both,
}

impl Role {
    /// Whether the engine can serve prefill legs.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether the engine can serve decode legs.
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// An engine's declaration (registration body, cluster-file entry).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpec {
    pub id: String,
    pub role: Role,
    pub node: String,
    pub model: String,
    pub engine_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// The topic the engine publishes KV events under; with no `kv_events` endpoint it is how
    /// a coordinator collecting events on its own socket (`--kv-events-listen`) knows them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_topic: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xfer_side_channel: Option<String>,
    pub block_size: u32,
    #[serde(default, alias = "capacity", skip_serializing_if = "Option::is_none")]
    pub capacity_blocks: Option<u64>,
    /// vLLM data parallel: ranks behind the one `engine_url`, each with its own KV cache and its
    /// own KV-event stream (rank r publishes on the `kv_events`/`replay` ports + r). Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel_size: Option<u32>,
}

/// Why a declaration is refused (the coordinator answers it as a 400).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InvalidSpec {
    #[error("'{field}' must be 1..{MAX_NAME} bytes")]
    Name { field: &'static str },
    #[error("'{field}' is too long")]
    TooLong { field: &'static str },
    #[error("'id' must not contain '/', whitespace or control characters")]
    IdCharacters,
    #[error("'block_size' must be within 1..={MAX_BLOCK_SIZE}")]
    BlockSize,
    #[error("'data_parallel_size' must be within 1..={MAX_DATA_PARALLEL_SIZE}")]
    DataParallelSize,
    #[error("'{field}' must be a {schemes} URL")]
    Url { field: &'static str, schemes: &'static str },
}

/// URL schemes accepted for a field, and how an error names them.
struct Schemes(&'static [&'static str], &'static str);

const HTTP: Schemes = Schemes(&["http", "https"], "http/https");
const EVENTS: Schemes = Schemes(&["tcp", "ipc", "inproc"], "tcp/ipc/inproc");

fn check_url(field: &'static str, url: &str, Schemes(schemes, names): Schemes) -> Result<(), InvalidSpec> {
    if url.len() > MAX_NAME {
        return Err(InvalidSpec::TooLong { field });
    }
    let has_scheme =
        |s: &&str| url.strip_prefix(s).and_then(|rest| rest.strip_prefix("://")).is_some_and(|r| !r.is_empty());
    if !schemes.iter().any(has_scheme) {
        return Err(InvalidSpec::Url { field, schemes: names });
    }
    Ok(())
}

impl EngineSpec {
    /// Checks the limits of API.md (names, URL schemes, block size).
    pub fn validate(&self) -> Result<(), InvalidSpec> {
        for (field, value) in [("id", &self.id), ("model", &self.model)] {
            if value.is_empty() || value.len() > MAX_NAME {
                return Err(InvalidSpec::Name { field });
            }
        }
        if self.node.len() > MAX_NAME {
            return Err(InvalidSpec::TooLong { field: "node" });
        }
        if self.kv_events_topic.as_ref().is_some_and(|t| t.is_empty() || t.len() > MAX_NAME) {
            return Err(InvalidSpec::Name { field: "kv_events_topic" });
        }
        if self.id.chars().any(|c| c == '/' || c.is_control() || c.is_whitespace()) {
            return Err(InvalidSpec::IdCharacters);
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(InvalidSpec::BlockSize);
        }
        if self.data_parallel_size.is_some_and(|n| n == 0 || n > MAX_DATA_PARALLEL_SIZE) {
            return Err(InvalidSpec::DataParallelSize);
        }
        check_url("engine_url", &self.engine_url, HTTP)?;
        if let Some(url) = &self.sidecar_url {
            check_url("sidecar_url", url, HTTP)?;
        }
        for (field, endpoint) in [("kv_events", &self.kv_events), ("replay", &self.replay)] {
            if let Some(endpoint) = endpoint {
                check_url(field, endpoint, EVENTS)?;
            }
        }
        if self.xfer_side_channel.as_ref().is_some_and(|s| s.len() > MAX_NAME) {
            return Err(InvalidSpec::TooLong { field: "xfer_side_channel" });
        }
        Ok(())
    }
}

/// The answer to a registration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// The id the engine has at the coordinator.
    pub engine: String,
    #[serde(default)]
    pub lease_ms: u64,
    /// How often to heartbeat; 0 when the coordinator did not say.
    #[serde(default)]
    pub heartbeat_ms: u64,
    /// The coordinator reads [`Report::decode_started`], so a sidecar may fold that report into
    /// the request's end. False from a coordinator older than the field: it refuses the field
    /// (reports reject unknown fields), so the sidecar then reports `decode_started` on its own.
    #[serde(default)]
    pub decode_started_on_end: bool,
}

/// An engine's load as its sidecar reports it with each heartbeat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Load {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waiting: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_usage: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_decode_blocks: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued_prefill_blocks: Option<u64>,
}

/// A heartbeat's body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
}

/// Blocks a prefill holds for a decode that will not come: the prefill's sidecar frees them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReleaseNotice {
    pub request_id: String,
    /// The prefill engine's id.
    pub prefill: String,
    /// As the `prefill_done` report carried them (`null` when it carried none).
    pub kv_transfer_params: Box<RawValue>,
}

/// The answer to a heartbeat.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Notices {
    /// Engines that died since this engine's previous heartbeat, each named once.
    #[serde(default)]
    pub dead_engines: Vec<String>,
    #[serde(default)]
    pub release: Vec<ReleaseNotice>,
}

/// Where the coordinator learnt of an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// Declared in the cluster file.
    Static,
    /// Registered over the API (there or, with etcd, through another coordinator).
    Registered,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Static => "static",
            Origin::Registered => "registered",
        }
    }
}

/// One engine of `GET /v1/engines`: its declaration as the coordinator uses it (wildcard event
/// hosts filled in) and what the coordinator knows of it. `alive` is the one liveness fact.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EngineView {
    #[serde(flatten)]
    pub spec: EngineSpec,
    pub alive: bool,
    /// Times the engine was (re)registered with a new declaration or after dying.
    pub generation: u64,
    pub origin: Origin,
    /// The last heartbeat's load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load: Option<Load>,
    /// Blocks the index holds for this engine.
    pub indexed_blocks: u64,
}

/// `POST /v1/pair`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairRequest {
    pub request_id: String,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// The caller's own engine, preferred as decode unless it is dead or much worse.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_engine: Option<String>,
    /// The LoRA adapter the request runs under (vLLM's `lora_name`); absent for the base model.
    /// Its blocks hash with the name as extra key and are indexed apart from other adapters'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_name: Option<String>,
}

/// An engine named in a pairing decision.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    pub id: String,
    pub engine_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar_url: Option<String>,
    pub node: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PairReason {
    Disaggregated,
    /// The decode computes the prompt itself (its uncached part is short).
    LocalPrefill,
}

impl PairReason {
    pub fn as_str(self) -> &'static str {
        match self {
            PairReason::Disaggregated => "disaggregated",
            PairReason::LocalPrefill => "local_prefill",
        }
    }
}

/// The answer to `POST /v1/pair`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairDecision {
    pub request_id: String,
    pub decode: Endpoint,
    pub prefill: Option<Endpoint>,
    pub decode_overlap_blocks: u64,
    pub prefill_overlap_blocks: u64,
    pub reason: PairReason,
    /// The data-parallel rank of the decode engine holding the prefix, sent to it as
    /// [`DATA_PARALLEL_RANK_HEADER`]; absent for an engine without data parallel, or when no
    /// rank holds any of the prompt (the engine balances its ranks itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_dp_rank: Option<u32>,
    /// The same for the prefill engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_dp_rank: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportEvent {
    PrefillDone,
    DecodeStarted,
    Finished,
    Failed,
}

/// `POST /v1/report`: how a request went.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    pub request_id: String,
    pub event: ReportEvent,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// `prefill_done`: the prefill's params, so blocks held for a decode that dies can be freed.
    /// `failed`: the params of the failed attempt's prefill leg, if it had one; the coordinator
    /// frees its blocks when they are the params it holds for the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_transfer_params: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// `finished` / `failed`: the decode's first output came with this end (a non-streaming
    /// answer arrives whole), which stands for a `decode_started` report at the same moment.
    /// Sent only to a coordinator whose [`Registration::decode_started_on_end`] says it reads it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub decode_started: bool,
}

/// The answer to `POST /v1/nodes/{node}/down`: the engines that left pairing because of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeDown {
    pub node: String,
    pub engines: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelStats {
    pub blocks: u64,
    pub entries: u64,
    pub engines: BTreeMap<String, u64>,
}

/// The answer to `GET /v1/index/stats`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IndexStats {
    pub models: BTreeMap<String, ModelStats>,
}

#[cfg(test)]
mod tests;
