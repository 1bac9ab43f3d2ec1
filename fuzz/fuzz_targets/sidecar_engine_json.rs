//! The sidecar's reading of engine JSON, through its own functions: a prefill's answer and its
//! `kv_transfer_params` (vLLM NixlConnector/XferConnector fields) on their way into the decode
//! and release calls and the sidecar's own pull handle; a request body given SGLang bootstrap
//! fields, or stripped of client-sent ones; SGLang's answers merged for `return_logprob`; an
//! engine URL from the coordinator. Errors, never panics, and every body the sidecar writes is
//! one JSON object carrying exactly what it set.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_sidecar::json::Object;
use pd_sidecar::metrics::Metrics;
use pd_sidecar::prefill::{read_params, Prefilled};
use pd_sidecar::rewrite::{self, Api};
use pd_sidecar::target::Target;
use pd_sidecar::xfer_link::Handle;

/// A client's request as the prefill leg saw it (the release and decode calls are built from it).
const CLIENT: &[u8] = br#"{"model":"m","prompt":"a b c","max_tokens":8,"stream":true}"#;
/// The block size the release call counts tokens in (the sidecar's default).
const BLOCK_SIZE: usize = 16;
/// Keys through which a request makes an engine fetch KV from elsewhere.
const HANDOFF_KEYS: [&str; 4] = ["kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"];

fn one_object(body: &[u8]) -> Object<'_> {
    Object::parse(body).unwrap_or_else(|e| panic!("the sidecar wrote {:?}: {e}", String::from_utf8_lossy(body)))
}

fn prefill_answer(data: &[u8]) {
    let target = Target::parse("10.0.0.1:8100", "http", None).expect("a valid target");
    let Prefilled::Params { params, .. } = read_params(&Metrics::default(), &target, data) else { return };
    let client = Object::parse(CLIENT).expect("a valid request");
    for body in [rewrite::decode_body(&client, &params), rewrite::release_body(&client, &params)] {
        assert_eq!(one_object(&body).get("kv_transfer_params").map(|raw| raw.get()), Some(params.as_str()));
    }
    if let Ok(value) = serde_json::from_str::<serde_json::Value>(&params) {
        if let Ok(tokens) = rewrite::release_tokens(&value, BLOCK_SIZE) {
            let body = rewrite::synthetic_release_body(Some("m"), tokens, &params);
            assert_eq!(one_object(&body).get("kv_transfer_params").map(|raw| raw.get()), Some(params.as_str()));
        }
    }
    if let Ok(handle) = Handle::parse(&params) {
        let _ = handle.block_ids();
        assert!(handle.done_notification().starts_with(&handle.remote_request_id));
    }
}

fn client_request(data: &[u8]) {
    let Ok(client) = Object::parse(data) else { return };
    if let Some(body) = rewrite::local_body(&client) {
        let local = one_object(&body);
        assert!(HANDOFF_KEYS.iter().all(|key| !local.contains(key)));
    }
    for api in [Api::Completions, Api::Chat, Api::Generate] {
        let _ = rewrite::prompt(&client, api).map(|p| p.estimated_tokens(4.0));
        let items = rewrite::batch_size(&client, api);
        let rooms: Vec<i64> = (1..=items as i64).collect();
        let body = rewrite::sglang_body(&client, "10.0.0.1", Some(8998), &rooms);
        let leg = one_object(&body);
        let room = leg.get("bootstrap_room").expect("the room is set").get();
        match rooms.as_slice() {
            [one] => assert_eq!(room, one.to_string()),
            many => assert_eq!(serde_json::from_str::<Vec<i64>>(room).ok().as_deref(), Some(many)),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    prefill_answer(data);
    client_request(data);
    // SGLang's prefill and decode answers, split at the first NUL.
    if let Some(at) = data.iter().position(|&b| b == 0) {
        if let Some(merged) = rewrite::merge_input_logprobs(&data[..at], &data[at + 1..]) {
            assert!(serde_json::from_slice::<serde_json::Value>(&merged).is_ok(), "merged into invalid JSON");
        }
    }
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Target::parse(text, "http", Some(8998));
    }
});
