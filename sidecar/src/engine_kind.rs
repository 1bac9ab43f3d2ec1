//! Whether the local engine can compute a prompt itself, learned once from SGLang's
//! `GET /server_info` (`/get_server_info` on older servers): its `disaggregation_mode` is
//! `"decode"` for a server started with `--disaggregation-mode decode`, which refuses a request
//! without a bootstrap room. Other modes never ask: vLLM and pd-sim compute prompts.

use std::time::Duration;

use http::Method;
use tokio::sync::OnceCell;

use crate::config::Mode;
use crate::context::Context;
use crate::handoff::LocalEngine;
use crate::target::Target;
use crate::upstream;

/// Largest server-info answer read (SGLang's is a few KB).
const MAX_SERVER_INFO: usize = 1 << 20;

/// Why a server-info answer says nothing usable.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ServerInfoError {
    #[error("server info is not a JSON object")]
    NotAnObject,
    #[error("server info has no string 'disaggregation_mode'")]
    NoMode,
}

/// The kind an SGLang server-info body describes: `"decode"` only decodes; `"null"` (a plain
/// server) and `"prefill"` compute prompts.
pub fn from_server_info(body: &[u8]) -> Result<LocalEngine, ServerInfoError> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|_| ServerInfoError::NotAnObject)?;
    let info = value.as_object().ok_or(ServerInfoError::NotAnObject)?;
    match info.get("disaggregation_mode").and_then(|m| m.as_str()) {
        Some("decode") => Ok(LocalEngine::DecodeOnly),
        Some(_) => Ok(LocalEngine::ComputesPrompts),
        None => Err(ServerInfoError::NoMode),
    }
}

/// Why the local engine could not be asked (the request counts it as computing prompts).
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error("cannot build the server-info request: {0}")]
    Request(#[from] http::Error),
    #[error(transparent)]
    Upstream(#[from] crate::errors::UpstreamError),
}

/// The learned kind, shared by routing and the leg executor.
#[derive(Debug, Default)]
pub struct EngineKind {
    learned: OnceCell<LocalEngine>,
}

impl EngineKind {
    /// The kind when known (the leg executor's policy reads it after routing learned it).
    pub fn known(&self) -> LocalEngine {
        self.learned.get().copied().unwrap_or_default()
    }

    /// The local engine's kind: asked once in SGLang mode. An engine that cannot be asked now
    /// counts as computing prompts for this request and is asked again by the next; one whose
    /// answer has no mode (another engine, an older SGLang) is remembered as computing prompts.
    pub async fn get(&self, ctx: &Context, engine: &Target) -> LocalEngine {
        if ctx.cfg.mode != Mode::Sglang {
            return LocalEngine::ComputesPrompts;
        }
        match self.learned.get_or_try_init(|| ask(ctx, engine)).await {
            Ok(kind) => *kind,
            Err(error) => {
                tracing::warn!(%error, "cannot ask the local engine for its disaggregation mode");
                LocalEngine::default()
            }
        }
    }
}

/// Asks the engine, bounded by the connect timeout (at least 1 s) per call.
async fn ask(ctx: &Context, engine: &Target) -> Result<LocalEngine, AskError> {
    let timeout = ctx.cfg.connect_timeout.max(Duration::from_secs(1));
    for path in ["/server_info", "/get_server_info"] {
        let req = upstream::json_request(Method::GET, &engine.url(path), None)?;
        let resp = upstream::send(&ctx.client, engine, req, timeout).await?;
        if !resp.status().is_success() {
            continue;
        }
        let body = upstream::collect(engine, resp.into_body(), MAX_SERVER_INFO, timeout).await?;
        let kind = from_server_info(&body).unwrap_or_else(|e| {
            tracing::info!(%e, path, "the local engine reports no disaggregation mode; decoding locally stays allowed");
            LocalEngine::ComputesPrompts
        });
        tracing::info!(?kind, "local SGLang engine");
        return Ok(kind);
    }
    tracing::info!("the local engine has no server-info endpoint; decoding locally stays allowed");
    Ok(LocalEngine::ComputesPrompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sglangs_modes() {
        assert_eq!(from_server_info(br#"{"disaggregation_mode": "decode", "x": 1}"#), Ok(LocalEngine::DecodeOnly));
        for mode in ["null", "prefill"] {
            let body = format!(r#"{{"disaggregation_mode": "{mode}"}}"#);
            assert_eq!(from_server_info(body.as_bytes()), Ok(LocalEngine::ComputesPrompts), "{mode}");
        }
        assert_eq!(from_server_info(br#"{"model_path": "m"}"#), Err(ServerInfoError::NoMode));
        assert_eq!(from_server_info(br#"{"disaggregation_mode": 3}"#), Err(ServerInfoError::NoMode));
        assert_eq!(from_server_info(b"[]"), Err(ServerInfoError::NotAnObject));
        assert_eq!(from_server_info(b"not json"), Err(ServerInfoError::NotAnObject));
    }
}
