//! The API's data types (API.md), shared by the HTTP/JSON edge (`http`) and the gRPC edge
//! (`grpc`), and the one error type both map to their status codes.

pub mod grpc;
pub mod http;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::membership::{EngineSpec, Role};

/// Longest id, model name or URL accepted, bytes.
const MAX_NAME: usize = 512;
/// Largest block size accepted.
const MAX_BLOCK_SIZE: u32 = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RoleJson {
    Prefill,
    Decode,
    Both,
}

impl From<RoleJson> for Role {
    fn from(role: RoleJson) -> Role {
        match role {
            RoleJson::Prefill => Role::Prefill,
            RoleJson::Decode => Role::Decode,
            RoleJson::Both => Role::Both,
        }
    }
}

impl From<Role> for RoleJson {
    fn from(role: Role) -> RoleJson {
        match role {
            Role::Prefill => RoleJson::Prefill,
            Role::Decode => RoleJson::Decode,
            Role::Both => RoleJson::Both,
        }
    }
}

/// An engine's declaration (registration body, cluster-file entry).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineSpecJson {
    pub id: String,
    pub role: RoleJson,
    pub node: String,
    pub model: String,
    pub engine_url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sidecar_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xfer_side_channel: Option<String>,
    pub block_size: u32,
    #[serde(default, alias = "capacity", skip_serializing_if = "Option::is_none")]
    pub capacity_blocks: Option<u64>,
}

fn check_url(what: &str, url: &str, schemes: &[&str]) -> Result<(), String> {
    if url.len() > MAX_NAME {
        return Err(format!("{what} is too long"));
    }
    if !schemes
        .iter()
        .any(|s| url.strip_prefix(s).is_some_and(|rest| rest.strip_prefix("://").is_some_and(|r| !r.is_empty())))
    {
        return Err(format!("{what} must be a {} URL", schemes.join("/")));
    }
    Ok(())
}

impl EngineSpecJson {
    pub fn validate(&self) -> Result<(), String> {
        for (what, value) in [("id", &self.id), ("model", &self.model)] {
            if value.is_empty() || value.len() > MAX_NAME {
                return Err(format!("'{what}' must be 1..{MAX_NAME} bytes"));
            }
        }
        if self.node.len() > MAX_NAME {
            return Err("'node' is too long".into());
        }
        if self.id.chars().any(|c| c == '/' || c.is_control() || c.is_whitespace()) {
            return Err("'id' must not contain '/', whitespace or control characters".into());
        }
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(format!("'block_size' must be within 1..={MAX_BLOCK_SIZE}"));
        }
        check_url("'engine_url'", &self.engine_url, &["http", "https"])?;
        if let Some(url) = &self.sidecar_url {
            check_url("'sidecar_url'", url, &["http", "https"])?;
        }
        for (what, endpoint) in [("'kv_events'", &self.kv_events), ("'replay'", &self.replay)] {
            if let Some(endpoint) = endpoint {
                check_url(what, endpoint, &["tcp", "ipc", "inproc"])?;
            }
        }
        if self.xfer_side_channel.as_ref().is_some_and(|s| s.len() > MAX_NAME) {
            return Err("'xfer_side_channel' is too long".into());
        }
        Ok(())
    }

    /// The core's form. An event endpoint bound on a wildcard (`tcp://*:5557`, as engines
    /// are configured) is reached at the engine URL's host.
    pub fn to_spec(&self) -> EngineSpec {
        let host = url_host(&self.engine_url);
        let reachable = |endpoint: &Option<String>| {
            endpoint.as_ref().map(|e| match (&host, e.strip_prefix("tcp://*:")) {
                (Some(host), Some(port)) => format!("tcp://{host}:{port}"),
                _ => e.clone(),
            })
        };
        EngineSpec {
            id: self.id.clone(),
            role: self.role.into(),
            node: self.node.clone(),
            model: self.model.clone(),
            engine_url: self.engine_url.trim_end_matches('/').to_string(),
            sidecar_url: self.sidecar_url.as_ref().map(|u| u.trim_end_matches('/').to_string()),
            kv_events: reachable(&self.kv_events),
            replay: reachable(&self.replay),
            xfer_side_channel: self.xfer_side_channel.clone(),
            block_size: self.block_size,
            capacity_blocks: self.capacity_blocks,
        }
    }

    pub fn from_spec(spec: &EngineSpec) -> EngineSpecJson {
        EngineSpecJson {
            id: spec.id.clone(),
            role: spec.role.into(),
            node: spec.node.clone(),
            model: spec.model.clone(),
            engine_url: spec.engine_url.clone(),
            sidecar_url: spec.sidecar_url.clone(),
            kv_events: spec.kv_events.clone(),
            replay: spec.replay.clone(),
            xfer_side_channel: spec.xfer_side_channel.clone(),
            block_size: spec.block_size,
            capacity_blocks: spec.capacity_blocks,
        }
    }
}

/// The host part of `scheme://host[:port][/path]` (brackets kept for IPv6).
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next()?
    } else {
        authority.split(':').next()?
    };
    (!host.is_empty()).then(|| host.to_string())
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    pub engine: String,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadJson {
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

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeartbeatBody {
    #[serde(default)]
    pub load: Option<LoadJson>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReleaseNotice {
    pub request_id: String,
    pub prefill: String,
    pub kv_transfer_params: Box<RawValue>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Notices {
    pub dead_engines: Vec<String>,
    pub release: Vec<ReleaseNotice>,
}

#[derive(Clone, Debug, Serialize)]
pub struct EngineView {
    #[serde(flatten)]
    pub spec: EngineSpecJson,
    pub alive: bool,
    /// Times the engine was (re)registered with a new declaration or after dying.
    pub generation: u64,
    /// "static" (cluster file) or "registered" (API).
    pub origin: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<LoadJson>,
    /// Blocks the index holds for this engine.
    pub indexed_blocks: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PairRequestJson {
    pub request_id: String,
    pub model: String,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub local_engine: Option<String>,
}

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

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PairDecisionJson {
    pub request_id: String,
    pub decode: Endpoint,
    pub prefill: Option<Endpoint>,
    pub decode_overlap_blocks: u64,
    pub prefill_overlap_blocks: u64,
    pub reason: PairReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportEvent {
    PrefillDone,
    DecodeStarted,
    Finished,
    Failed,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReportJson {
    pub request_id: String,
    pub event: ReportEvent,
    #[serde(default)]
    pub engine: Option<String>,
    #[serde(default)]
    pub kv_transfer_params: Option<Box<RawValue>>,
    #[serde(default)]
    pub error: Option<String>,
}

/// The answer to `POST /v1/nodes/{node}/down`: the engines that left pairing because of it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeDownJson {
    pub node: String,
    pub engines: Vec<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelStats {
    pub blocks: u64,
    pub entries: u64,
    pub engines: BTreeMap<String, u64>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IndexStats {
    pub models: BTreeMap<String, ModelStats>,
}

/// What went wrong, with the HTTP status it maps to (gRPC maps the same kinds).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> u16 {
        match self {
            ApiError::BadRequest(_) => 400,
            ApiError::NotFound(_) => 404,
            ApiError::Unavailable(_) => 503,
            ApiError::Internal(_) => 500,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "invalid_request_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::Unavailable(_) => "service_unavailable",
            ApiError::Internal(_) => "internal_error",
        }
    }

    /// `{"error": {"message", "type", "code"}}`.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.to_string(), "type": self.kind(), "code": self.status()}})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_json(extra: &str) -> String {
        format!(
            r#"{{"id": "e0", "role": "both", "node": "n", "model": "m", "engine_url": "http://10.1.2.3:8000/",
                "kv_events": "tcp://*:5557", "block_size": 16{extra}}}"#
        )
    }

    #[test]
    fn specs_parse_strictly_and_wildcard_endpoints_get_the_engine_host() {
        let spec: EngineSpecJson = serde_json::from_str(&spec_json("")).unwrap();
        spec.validate().unwrap();
        let core = spec.to_spec();
        assert_eq!(core.kv_events.as_deref(), Some("tcp://10.1.2.3:5557"));
        assert_eq!(core.engine_url, "http://10.1.2.3:8000");
        assert!(serde_json::from_str::<EngineSpecJson>(&spec_json(r#", "colour": 1"#)).is_err());
        let bad = |extra: &str| {
            let spec: EngineSpecJson = serde_json::from_str(&spec_json(extra)).unwrap();
            spec.validate().is_err()
        };
        assert!(bad(r#", "sidecar_url": "ftp://x""#));
        assert!(bad(r#", "replay": "http://x""#));
        assert!(!bad(r#", "sidecar_url": "http://x:1""#));
        assert_eq!(url_host("http://[::1]:80/x"), Some("[::1]".into()));
        assert_eq!(url_host("http://u@h:80"), Some("h".into()));
    }

    #[test]
    fn errors_are_openai_shaped() {
        let body = ApiError::NotFound("unknown engine".into()).body();
        assert_eq!(body["error"]["code"], 404);
        assert_eq!(body["error"]["type"], "not_found_error");
    }
}
