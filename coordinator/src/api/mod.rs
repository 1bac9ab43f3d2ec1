//! The API's data types (API.md), shared by the HTTP/JSON edge (`http`) and the gRPC edge
//! (`grpc`), and the one error type both map to their status codes.

pub mod grpc;
pub mod http;

use crate::membership::EngineSpec;

// The wire types are `pd-api`'s, shared with the sidecar. `*Json` names set those that have a
// core counterpart here (`membership::EngineSpec`, `pairing::Load`, `cluster::PairRequest`, …)
// apart from it.
pub use pd_api::{
    Endpoint, EngineView, Heartbeat, IndexStats, ModelStats, Notices, Origin, PairReason, Registration, ReleaseNotice,
    ReportEvent,
};
pub use pd_api::{
    EngineSpec as EngineSpecJson, Load as LoadJson, NodeDown as NodeDownJson, PairDecision as PairDecisionJson,
    PairRequest as PairRequestJson, Report as ReportJson,
};

/// The core's form of a declaration. An event endpoint bound on a wildcard (`tcp://*:5557`, as
/// engines are configured) is reached at the engine URL's host.
impl From<&EngineSpecJson> for EngineSpec {
    fn from(spec: &EngineSpecJson) -> EngineSpec {
        let host = url_host(&spec.engine_url);
        let reachable = |endpoint: &Option<String>| {
            endpoint.as_ref().map(|e| match (&host, e.strip_prefix("tcp://*:")) {
                (Some(host), Some(port)) => format!("tcp://{host}:{port}"),
                _ => e.clone(),
            })
        };
        EngineSpec {
            id: spec.id.clone(),
            role: spec.role,
            node: spec.node.clone(),
            model: spec.model.clone(),
            engine_url: spec.engine_url.trim_end_matches('/').to_string(),
            sidecar_url: spec.sidecar_url.as_ref().map(|u| u.trim_end_matches('/').to_string()),
            kv_events: reachable(&spec.kv_events),
            kv_events_topic: spec.kv_events_topic.clone(),
            replay: reachable(&spec.replay),
            xfer_side_channel: spec.xfer_side_channel.clone(),
            block_size: spec.block_size,
            capacity_blocks: spec.capacity_blocks,
            data_parallel_size: spec.data_parallel_size,
        }
    }
}

impl From<&EngineSpec> for EngineSpecJson {
    fn from(spec: &EngineSpec) -> EngineSpecJson {
        EngineSpecJson {
            id: spec.id.clone(),
            role: spec.role,
            node: spec.node.clone(),
            model: spec.model.clone(),
            engine_url: spec.engine_url.clone(),
            sidecar_url: spec.sidecar_url.clone(),
            kv_events: spec.kv_events.clone(),
            kv_events_topic: spec.kv_events_topic.clone(),
            replay: spec.replay.clone(),
            xfer_side_channel: spec.xfer_side_channel.clone(),
            block_size: spec.block_size,
            capacity_blocks: spec.capacity_blocks,
            data_parallel_size: spec.data_parallel_size,
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

/// What went wrong, with the HTTP status it maps to (gRPC maps the same kinds).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    NotFound(String),
    /// A request body over the limit (bytes).
    #[error("request body over {0} bytes")]
    TooLarge(usize),
    /// The call lacked the bearer token `--auth-token` demands.
    #[error("missing or invalid bearer token")]
    Unauthorized,
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
            ApiError::TooLarge(_) => 413,
            ApiError::Unauthorized => 401,
            ApiError::Unavailable(_) => 503,
            ApiError::Internal(_) => 500,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) | ApiError::TooLarge(_) => "invalid_request_error",
            ApiError::NotFound(_) => "not_found_error",
            ApiError::Unauthorized => "authentication_error",
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
        let core = EngineSpec::from(&spec);
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
