//! Frees blocks a prefill holds for a decode that died: `POST {sidecar}/pd/release` at once,
//! else a `release` notice in the prefill sidecar's next heartbeat answer.

use std::time::Duration;

use serde::Serialize;
use serde_json::value::RawValue;

use crate::metrics::ReleaseOutcome;

use super::state::Coordinator;
use crate::api::ReleaseNotice;

#[derive(Serialize)]
struct Body<'a> {
    request_id: &'a str,
    kv_transfer_params: &'a RawValue,
}

impl Coordinator {
    pub(crate) async fn release(&self, notice: ReleaseNotice, sidecar_url: Option<String>) {
        let Some(sidecar) = sidecar_url else {
            self.metrics.release(ReleaseOutcome::NoSidecar);
            self.queue_release(notice);
            return;
        };
        // The prefill's params go back verbatim (RawValue keeps key order and numbers).
        let body = Body { request_id: &notice.request_id, kv_transfer_params: &notice.kv_transfer_params };
        let mut call = self.http.post(format!("{sidecar}/pd/release"));
        if let Some(token) = &self.config.sidecar_token {
            call = call.header(reqwest::header::AUTHORIZATION, token.header().clone());
        }
        let sent = call.timeout(Duration::from_millis(self.config.release_timeout_ms)).json(&body).send().await;
        match sent {
            Ok(response) if response.status().is_success() => {
                tracing::info!(request = %notice.request_id, prefill = %notice.prefill, "released held blocks");
                self.metrics.release(ReleaseOutcome::Posted);
            }
            outcome => {
                let why = match outcome {
                    Ok(response) => format!("HTTP {}", response.status()),
                    Err(err) => err.to_string(),
                };
                tracing::warn!(request = %notice.request_id, prefill = %notice.prefill, %why, "release call failed; left for the heartbeat");
                self.metrics.release(ReleaseOutcome::Noticed);
                self.queue_release(notice);
            }
        }
    }
}
