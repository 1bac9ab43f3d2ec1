//! Freeing a prefill's held blocks when their decode will not happen (client gone between the
//! legs, decode failed, coordinator's notice), instead of leaving them to the engine's lease:
//! a discarded one-token decode with the held params on the local engine (the engine pulls and
//! notifies the prefill, which frees — works with any vLLM), or the done notification sent
//! straight from the sidecar's xfer agent (engines whose agents speak xfer, like the simulator).

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use pd_protocols::kv_params::RELEASE_REQUEST_ID_SUFFIX;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::ReleaseMethod;
use crate::context::Context;
use crate::engines::EnginePool;
use crate::errors::UpstreamError;
use crate::json::Object;
use crate::metrics::inc;
use crate::rewrite;
use crate::upstream::{self, REQUEST_ID};
use crate::xfer_link::{self, Handle, LinkError, XferLink};

/// What a release needs: the context, the local engine's ranks (a release decode runs there)
/// and the sidecar's xfer agent when it has one (the done notification).
#[derive(Debug)]
pub struct Releaser {
    ctx: Arc<Context>,
    engines: Arc<EnginePool>,
    xfer: Option<Arc<XferLink>>,
}

/// Frees the prefill's blocks when dropped armed (spawns the release; never blocks).
#[derive(Debug)]
pub struct ReleaseGuard {
    releaser: Arc<Releaser>,
    job: Option<Job>,
}

#[derive(Debug)]
struct Job {
    request_id: String,
    params: String,
    body: Bytes,
    path: String,
    method: ReleaseMethod,
}

impl ReleaseGuard {
    pub fn new(
        releaser: &Arc<Releaser>,
        request_id: &str,
        params: &str,
        client_body: Bytes,
        path: &str,
    ) -> ReleaseGuard {
        ReleaseGuard {
            releaser: Arc::clone(releaser),
            job: Some(Job {
                request_id: request_id.to_string(),
                params: params.to_string(),
                body: client_body,
                path: path.to_string(),
                method: releaser.ctx.cfg.release_method,
            }),
        }
    }

    /// Releases with a one-token decode whatever the configuration says (what is held is a
    /// reservation on the local engine, which only a decode consumes).
    pub fn decode_only(mut self) -> ReleaseGuard {
        if let Some(job) = self.job.as_mut() {
            job.method = ReleaseMethod::Decode;
        }
        self
    }

    /// The decode has the blocks: nothing to free.
    pub fn disarm(&mut self) {
        self.job = None;
    }

    pub fn is_armed(&self) -> bool {
        self.job.is_some()
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let Some(job) = self.job.take() else { return };
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let releaser = Arc::clone(&self.releaser);
        rt.spawn(async move {
            let started = Instant::now();
            match releaser.release_with(job.method, &job.request_id, &job.params, Some(&job.body), Some(&job.path)).await {
                Ok(how) => tracing::info!(request_id = %job.request_id, method = how, ms = started.elapsed().as_millis() as u64, "released the prefill's blocks"),
                Err(e) => tracing::warn!(request_id = %job.request_id, %e, "could not release the prefill's blocks; the engine's lease will"),
            }
        });
    }
}

/// Why held blocks could not be freed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("this sidecar has no xfer agent (--mode sim-pull)")]
    NoAgent,
    #[error(transparent)]
    Notify(#[from] LinkError),
    #[error("kv_transfer_params: {0}")]
    Params(#[from] serde_json::Error),
    #[error(transparent)]
    TooManyTokens(#[from] rewrite::TooManyTokens),
    #[error("release decode answered {0}")]
    Status(StatusCode),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("no engine rank reachable for the release: {last}")]
    NoRank { last: String },
}

impl Releaser {
    pub fn new(ctx: &Arc<Context>, engines: &Arc<EnginePool>, xfer: Option<Arc<XferLink>>) -> Releaser {
        Releaser { ctx: Arc::clone(ctx), engines: Arc::clone(engines), xfer }
    }

    /// Frees the blocks `params` name; returns the method that worked.
    pub async fn release(
        &self,
        request_id: &str,
        params: &str,
        client_body: Option<&[u8]>,
        path: Option<&str>,
    ) -> Result<&'static str, ReleaseError> {
        self.release_with(self.ctx.cfg.release_method, request_id, params, client_body, path).await
    }

    async fn release_with(
        &self,
        method: ReleaseMethod,
        request_id: &str,
        params: &str,
        client_body: Option<&[u8]>,
        path: Option<&str>,
    ) -> Result<&'static str, ReleaseError> {
        let metrics = &self.ctx.metrics;
        if via_xfer(method, self.xfer.is_some()) {
            match self.notify(params).await {
                Ok(()) => {
                    inc(&metrics.releases_ok);
                    return Ok("xfer");
                }
                Err(e) if method == ReleaseMethod::SimXfer => {
                    inc(&metrics.releases_failed);
                    return Err(e);
                }
                Err(e) => tracing::debug!(%e, "xfer release failed; trying a one-token decode"),
            }
        }
        let outcome = self.decode(request_id, params, client_body, path).await;
        inc(if outcome.is_ok() { &metrics.releases_ok } else { &metrics.releases_failed });
        outcome.map(|()| "decode")
    }

    async fn notify(&self, params: &str) -> Result<(), ReleaseError> {
        let cfg = &self.ctx.cfg;
        let link = self.xfer.clone().ok_or(ReleaseError::NoAgent)?;
        let handle = Handle::parse(params)?;
        Ok(xfer_link::blocking(cfg.release_timeout, move || link.notify_done(&handle)).await?)
    }

    async fn decode(
        &self,
        request_id: &str,
        params: &str,
        client_body: Option<&[u8]>,
        path: Option<&str>,
    ) -> Result<(), ReleaseError> {
        let cfg = &self.ctx.cfg;
        let client = client_body.and_then(|b| Object::parse(b).ok());
        let (body, path) = match (&client, path) {
            (Some(o), Some(p)) => (rewrite::release_body(o, params), p),
            _ => {
                let v: serde_json::Value = serde_json::from_str(params)?;
                let tokens = rewrite::release_tokens(&v, cfg.block_size)?;
                (rewrite::synthetic_release_body(cfg.model.as_deref(), tokens, params), "/v1/completions")
            }
        };
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Ok(v) = HeaderValue::from_str(&format!("{request_id}{RELEASE_REQUEST_ID_SUFFIX}")) {
            headers.insert(REQUEST_ID, v);
        }
        if let Some(a) = self.ctx.upstream_authorization() {
            headers.insert(header::AUTHORIZATION, a.clone());
        }
        let mut last = String::new();
        let mut tried = Vec::new();
        while let Some(rank) = self.engines.pick(&tried) {
            tried.push(rank.index);
            let target = self.engines.rank(rank.index).clone();
            let req = upstream::post(&target, path, headers.clone(), Body::from(body.clone()));
            match upstream::send(&self.ctx.client, &target, req, cfg.release_timeout).await {
                Ok(resp) => {
                    let status = resp.status();
                    // Read (and drop) the answer so the connection goes back to the pool.
                    let _ = upstream::collect(&target, resp.into_body(), 16 << 20, cfg.release_timeout).await;
                    return if status.is_success() { Ok(()) } else { Err(ReleaseError::Status(status)) };
                }
                Err(e) if e.is_connect() => last = e.to_string(),
                Err(e) => return Err(e.into()),
            }
        }
        Err(ReleaseError::NoRank { last })
    }
}

/// Whether to try the done notification first (`auto` needs the sidecar's own xfer agent).
fn via_xfer(method: ReleaseMethod, has_agent: bool) -> bool {
    match method {
        ReleaseMethod::SimXfer => true,
        ReleaseMethod::Decode => false,
        ReleaseMethod::Auto => has_agent,
    }
}

/// `POST /pd/release` body (coordinator/API.md).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub request_id: String,
    pub kv_transfer_params: Box<RawValue>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_method_tried_first() {
        use ReleaseMethod::{Auto, Decode, SimXfer};
        for (method, agent, xfer) in [
            (SimXfer, true, true),
            (SimXfer, false, true),
            (Decode, true, false),
            (Decode, false, false),
            (Auto, true, true),
            (Auto, false, false),
        ] {
            assert_eq!(via_xfer(method, agent), xfer, "{method:?} with agent {agent}");
        }
    }

    #[test]
    fn release_requests_are_read_strictly() {
        let ok: ReleaseRequest = serde_json::from_str(r#"{"request_id":"r","kv_transfer_params":{"a":1.50}}"#).unwrap();
        assert_eq!((ok.request_id.as_str(), ok.kv_transfer_params.get()), ("r", r#"{"a":1.50}"#));
        for bad in [
            r#"{"request_id":"r"}"#,
            r#"{"kv_transfer_params":{}}"#,
            r#"{"request_id":"r","kv_transfer_params":{},"extra":1}"#,
            r#"{"request_id":1,"kv_transfer_params":{}}"#,
            "",
            "[]",
        ] {
            assert!(serde_json::from_str::<ReleaseRequest>(bad).is_err(), "{bad}");
        }
    }
}
