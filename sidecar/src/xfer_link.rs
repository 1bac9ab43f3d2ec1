//! The sidecar's own xfer agent: reaches prefill engines' agents through their side channels
//! (the `remote_host:remote_port` of `kv_transfer_params`) to pull blocks (pull mode) or to send
//! the "done" notification that frees a prefill's held blocks.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error("kv_transfer_params: {0}")]
    Params(String),
    #[error("xfer: {0}")]
    Xfer(#[from] xfer::XferError),
    #[error("the agent at {addr} is {got}, not {expected}")]
    WrongPeer { addr: String, expected: String, got: String },
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Other(String),
}

/// The fields of `kv_transfer_params` the sidecar acts on (everything else stays opaque).
#[derive(Debug, Clone, Deserialize)]
pub struct Handle {
    pub remote_engine_id: String,
    pub remote_request_id: String,
    pub remote_host: String,
    pub remote_port: u16,
    #[serde(default)]
    remote_block_ids: Option<serde_json::Value>,
    /// The prefill's grant token (hex) when it granted the blocks to the reader the prefill call
    /// named (`pd_protocols::kv_params::GRANT_KEY`).
    #[serde(default, rename = "xfer_grant")]
    pub grant: Option<String>,
}

impl Handle {
    pub fn parse(params: &str) -> Result<Handle, LinkError> {
        serde_json::from_str(params).map_err(|e| LinkError::Params(e.to_string()))
    }

    pub fn side_channel(&self) -> String {
        if self.remote_host.contains(':') {
            format!("[{}]:{}", self.remote_host, self.remote_port)
        } else {
            format!("{}:{}", self.remote_host, self.remote_port)
        }
    }

    /// The first KV-cache group's block ids (older vLLM: a flat list).
    pub fn block_ids(&self) -> Result<Vec<u64>, LinkError> {
        let bad = || LinkError::Params("remote_block_ids is not a list of block ids".into());
        let ids = match self.remote_block_ids.as_ref().ok_or_else(bad)? {
            serde_json::Value::Array(groups) if groups.first().is_some_and(serde_json::Value::is_array) => {
                groups[0].as_array().ok_or_else(bad)?
            }
            serde_json::Value::Array(flat) => flat,
            _ => return Err(bad()),
        };
        ids.iter().map(|v| v.as_u64().ok_or_else(bad)).collect()
    }

    pub fn done_notification(&self) -> String {
        format!("{}:1", self.remote_request_id)
    }
}

#[derive(Debug)]
pub struct XferLink {
    pub agent: xfer::Agent,
    /// Engine id → loaded peer name (the same, checked once).
    peers: Mutex<HashMap<String, String>>,
}

impl XferLink {
    pub fn new(listen: &str) -> Result<Arc<XferLink>, LinkError> {
        let mut nonce = [0u8; 6];
        getrandom::fill(&mut nonce).map_err(|e| LinkError::Other(e.to_string()))?;
        let name = format!(
            "pd-sidecar-{}-{}",
            std::process::id(),
            nonce.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let agent = xfer::Agent::new(&name)?;
        agent.add_backend("tcp", xfer::BackendParams::new().with("listen", listen))?;
        Ok(Arc::new(XferLink { agent, peers: Mutex::new(HashMap::new()) }))
    }

    /// The prefill engine's agent, its metadata fetched once (blocking).
    pub fn peer(&self, h: &Handle, refresh: bool) -> Result<String, LinkError> {
        if !refresh {
            if let Some(p) = self.peers.lock().get(&h.remote_engine_id) {
                return Ok(p.clone());
            }
        }
        let addr = h.side_channel();
        let name = self.agent.fetch_remote_metadata(&addr)?;
        if name != h.remote_engine_id {
            return Err(LinkError::WrongPeer { addr, expected: h.remote_engine_id.clone(), got: name });
        }
        self.peers.lock().insert(h.remote_engine_id.clone(), name.clone());
        Ok(name)
    }

    pub fn forget(&self, engine_id: &str) {
        self.peers.lock().remove(engine_id);
    }

    /// Tells the prefill its blocks for `h` are no longer needed (blocking; retried once with
    /// fresh metadata in case the peer restarted).
    pub fn notify_done(&self, h: &Handle) -> Result<(), LinkError> {
        let msg = h.done_notification();
        let peer = self.peer(h, false)?;
        match self.agent.send_notif(&peer, msg.as_bytes()) {
            Ok(()) => Ok(()),
            Err(_) => {
                let peer = self.peer(h, true)?;
                Ok(self.agent.send_notif(&peer, msg.as_bytes())?)
            }
        }
    }
}

/// Runs blocking xfer work on the blocking pool, bounded by `timeout`.
pub async fn blocking<T: Send + 'static>(
    timeout: Duration,
    f: impl FnOnce() -> Result<T, LinkError> + Send + 'static,
) -> Result<T, LinkError> {
    match tokio::time::timeout(timeout, tokio::task::spawn_blocking(f)).await {
        Err(_) => Err(LinkError::Timeout(timeout)),
        Ok(Err(join)) => Err(LinkError::Other(join.to_string())),
        Ok(Ok(r)) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles() {
        let h = Handle::parse(
            r#"{"do_remote_prefill": true, "remote_block_ids": [[3, 4]], "remote_engine_id": "e", "remote_request_id": "cmpl-1-0-ab", "remote_host": "::1", "remote_port": 5600, "extra": 1}"#,
        )
        .unwrap();
        assert_eq!((h.side_channel(), h.done_notification()), ("[::1]:5600".to_string(), "cmpl-1-0-ab:1".to_string()));
        assert_eq!(h.block_ids().unwrap(), vec![3, 4]);
        let flat = Handle::parse(r#"{"remote_block_ids": [7], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1}"#).unwrap();
        assert_eq!(flat.block_ids().unwrap(), vec![7]);
        assert!(Handle::parse(r#"{"remote_engine_id": "e"}"#).is_err());
        assert_eq!(h.grant, None);
        let granted = format!(
            r#"{{"remote_block_ids": [7], "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "{}": "ab12"}}"#,
            pd_protocols::kv_params::GRANT_KEY
        );
        assert_eq!(Handle::parse(&granted).unwrap().grant.as_deref(), Some("ab12"));
    }
}
