//! `kv_transfer_params`: what vLLM's P/D handoff carries from the prefill's response into the
//! decode's request (`shared/PROTOCOLS.md` §1). Proxies copy the JSON verbatim; this typed view
//! is for the engines' side (and the simulator) and for routing decisions.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{json, Map, Value};

/// The key a prefill adds for the grant token of the blocks it holds (xfer's `Grant::token_hex`);
/// not a vLLM key, so proxies and vLLM pass it through like any unknown one.
pub const GRANT_KEY: &str = "xfer_grant";

/// vLLM 0.32's fields in its key order; unknown keys are kept in `extra`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub do_remote_decode: bool,
    /// One list of block ids per KV-cache group; older vLLM sent one flat list.
    #[serde(default, deserialize_with = "block_id_groups")]
    pub remote_block_ids: Option<Vec<Vec<u64>>>,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_request_id: Option<String>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<u64>,
    #[serde(default)]
    pub remote_blocks_expiry_time: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_prefill_cached_tokens: Option<u64>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn block_id_groups<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Vec<Vec<u64>>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Ids {
        Groups(Vec<Vec<u64>>),
        Flat(Vec<u64>),
    }
    Ok(match Option::<Ids>::deserialize(deserializer)? {
        None => None,
        Some(Ids::Groups(groups)) => Some(groups),
        Some(Ids::Flat(flat)) => Some(vec![flat]),
    })
}

impl KvTransferParams {
    /// Whether a decode engine can pull with these (vLLM otherwise logs "Got invalid
    /// KVTransferParams" and recomputes the prompt).
    pub fn is_valid_for_pull(&self) -> bool {
        self.do_remote_prefill
            && self.remote_block_ids.as_ref().is_some_and(|g| g.iter().any(|ids| !ids.is_empty()))
            && self.remote_engine_id.is_some()
            && self.remote_request_id.is_some()
            && self.remote_host.is_some()
            && self.remote_port.is_some()
    }

    /// The prefill's revocable xfer grant over the blocks, as hex (`xfer_grant`), when it
    /// issued one: the decode loads it and reads under it.
    pub fn grant(&self) -> Option<&str> {
        self.extra.get(GRANT_KEY).and_then(Value::as_str)
    }

    /// The block ids of the first KV-cache group (the only one for plain decoder models).
    pub fn first_group(&self) -> &[u64] {
        self.remote_block_ids.as_ref().and_then(|g| g.first()).map(Vec::as_slice).unwrap_or(&[])
    }
}

/// The `kv_transfer_params` a proxy puts into the prefill call.
pub fn prefill_request() -> Value {
    json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null
    })
}

/// What a sidecar appends to a request's id (`X-Request-Id`) for the discarded one-token decode
/// that frees the blocks a prefill holds for it. Such a decode may carry a synthetic prompt
/// (a coordinator's release knows only the params), so pd-sim does not check what it pulls.
pub const RELEASE_REQUEST_ID_SUFFIX: &str = "-release";

/// The notification a decode engine sends when it has read a request's blocks.
pub fn done_notification(remote_request_id: &str, decode_world_size: u32) -> String {
    format!("{remote_request_id}:{decode_world_size}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unknown keys pass through with their numbers bit for bit, even ones the default float
    /// parser rounds differently on a second read (a coordinator_api fuzz find).
    #[test]
    fn relayed_numbers_survive_a_re_encode() {
        let body = br#"{"": 880000000000000000000000000000005193150770316778608}"#;
        let params: KvTransferParams = serde_json::from_slice(body).unwrap();
        let again: KvTransferParams = serde_json::from_slice(&serde_json::to_vec(&params).unwrap()).unwrap();
        assert_eq!(again, params);
    }

    // The prefill response seen with vLLM 0.32 (PROTOCOLS.md §1).
    const SEEN: &str = r#"{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1,2,3,4,5,6]],
        "remote_engine_id": "79c25778-4455-409d-ba7d-786fbd75dbaa",
        "remote_request_id": "cmpl-b1bd669865c56244-0-90270e35", "remote_host": "127.0.0.1",
        "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 710,
        "remote_blocks_expiry_time": null, "transfer_mode": "pull", "remote_prefill_cached_tokens": 0}"#;

    #[test]
    fn parses_vllm_032_and_keeps_key_order_on_output() {
        let params: KvTransferParams = serde_json::from_str(SEEN).unwrap();
        assert!(params.is_valid_for_pull());
        assert_eq!(params.first_group(), &[1, 2, 3, 4, 5, 6]);
        assert_eq!(params.remote_port, Some(5600));
        let out = serde_json::to_string(&params).unwrap();
        assert!(out.starts_with(r#"{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3,4,5,6]],"remote_engine_id""#), "{out}");
        let reparsed: KvTransferParams = serde_json::from_str(&out).unwrap();
        assert_eq!(reparsed, params);
    }

    #[test]
    fn accepts_older_and_partial_forms() {
        let old: KvTransferParams = serde_json::from_str(
            r#"{"do_remote_prefill": true, "remote_block_ids": [7, 8], "remote_engine_id": "e",
                "remote_request_id": "r", "remote_host": "h", "remote_port": 1, "future_key": 3}"#,
        )
        .unwrap();
        assert_eq!(old.first_group(), &[7, 8]);
        assert_eq!(old.extra.get("future_key"), Some(&json!(3)));
        assert!(old.is_valid_for_pull());
        let missing: KvTransferParams =
            serde_json::from_str(r#"{"do_remote_prefill": true, "remote_block_ids": []}"#).unwrap();
        assert!(!missing.is_valid_for_pull());
        let request: KvTransferParams = serde_json::from_value(prefill_request()).unwrap();
        assert!(request.do_remote_decode && !request.do_remote_prefill);
        assert!(serde_json::from_str::<KvTransferParams>(r#"{"remote_port": "x"}"#).is_err());
        assert_eq!(done_notification("cmpl-1", 1), "cmpl-1:1");
    }
}
