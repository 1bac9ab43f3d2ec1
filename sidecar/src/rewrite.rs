//! The request bodies of each leg, derived from the client's body (PROTOCOLS.md §1, §4). Pure
//! functions over [`json::Object`]: every key the sidecar does not own keeps its exact text.

use std::borrow::Cow;

use pd_protocols::kv_params::GRANT_KEY;
use serde_json::Value;

use crate::json::{self, Edit, Object};

/// The OpenAI-style API a request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completions,
    Chat,
    /// SGLang's native `/generate`.
    Generate,
}

impl Api {
    pub fn from_path(path: &str) -> Option<Api> {
        match path {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::Chat),
            "/generate" => Some(Api::Generate),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
            Api::Generate => "generate",
        }
    }
}

/// The `kv_transfer_params` of the prefill call. `reader` is the xfer agent that will read the
/// blocks (the decode engine's), put in `remote_engine_id`: a prefill that issues grants (pd-sim)
/// grants that agent alone the held blocks. vLLM's NixlConnector reads
/// `remote_engine_id` of a prefill request only together with `remote_block_ids`, which stays
/// null here, so it accepts the body either way.
pub fn prefill_kv_params(reader: Option<&str>) -> String {
    let reader = reader.map_or_else(|| "null".to_string(), json::string);
    format!(
        r#"{{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":{reader},"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#
    )
}

/// Token limits, streaming and keys a one-token, non-streaming call changes.
const ONE_TOKEN: [(&str, Edit<'static>); 7] = [
    ("stream", Edit::Set("false")),
    ("stream_options", Edit::Remove),
    ("max_tokens", Edit::Set("1")),
    ("max_completion_tokens", Edit::Replace("1")),
    ("max_output_tokens", Edit::Replace("1")),
    ("min_tokens", Edit::Remove),
    ("min_completion_tokens", Edit::Remove),
];

fn one_token_with(params: &str) -> [(&str, Edit<'_>); 8] {
    let mut edits = [("kv_transfer_params", Edit::Set(params)); 8];
    edits[1..].copy_from_slice(&ONE_TOKEN);
    edits
}

/// The prefill call: one token, not streamed, asking the engine to hold the KV for a remote
/// decode (read by the agent `reader` when known).
pub fn prefill_body(client: &Object<'_>, reader: Option<&str>) -> Vec<u8> {
    client.rewrite(&one_token_with(&prefill_kv_params(reader)))
}

/// The decode call: the client's request as sent, plus the prefill's `kv_transfer_params`
/// (JSON text copied verbatim).
pub fn decode_body(client: &Object<'_>, params: &str) -> Vec<u8> {
    client.rewrite(&[("kv_transfer_params", Edit::Set(params))])
}

/// Keys through which a request makes an engine fetch KV from elsewhere.
const HANDOFF_KEYS: [&str; 4] = ["kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"];

/// The client's request for a local decode without a prefill leg: unchanged, except that
/// `kv_transfer_params` (or SGLang bootstrap fields) a client sent are dropped — they would
/// make the engine pull from an address the client chose. `None`: forward the original bytes.
pub fn local_body(client: &Object<'_>) -> Option<Vec<u8>> {
    HANDOFF_KEYS.iter().any(|k| client.contains(k)).then(|| client.rewrite(&HANDOFF_KEYS.map(|k| (k, Edit::Remove))))
}

/// A discarded one-token decode that makes the local engine pull (and so release) the blocks a
/// prefill holds for `params`.
pub fn release_body(client: &Object<'_>, params: &str) -> Vec<u8> {
    client.rewrite(&one_token_with(&ungranted(params)))
}

/// `params` without the prefill's grant token: the engine a release decode runs on may be the
/// prefill itself (`/pd/release` on its sidecar), which is not the agent the blocks were granted
/// to, and a read it cannot make never delivers the "done" that frees them. Its output is
/// discarded, so reading without the fence is harmless. Other keys keep their exact text.
fn ungranted(params: &str) -> Cow<'_, str> {
    match Object::parse(params.as_bytes()) {
        Ok(o) if o.contains(GRANT_KEY) => {
            Cow::Owned(String::from_utf8_lossy(&o.rewrite(&[(GRANT_KEY, Edit::Remove)])).into_owned())
        }
        _ => Cow::Borrowed(params),
    }
}

/// A release call when the original request is not known (`POST /pd/release`): a prompt of
/// `tokens` placeholder token ids, as many blocks as the prefill holds.
pub fn synthetic_release_body(model: Option<&str>, tokens: usize, params: &str) -> Vec<u8> {
    let mut out = String::with_capacity(tokens * 2 + params.len() + 96);
    out.push('{');
    if let Some(model) = model {
        out.push_str("\"model\":");
        out.push_str(&json::string(model));
        out.push(',');
    }
    out.push_str("\"prompt\":[");
    for i in 0..tokens.max(1) {
        if i > 0 {
            out.push(',');
        }
        out.push('0');
    }
    out.push_str("],\"max_tokens\":1,\"stream\":false,\"kv_transfer_params\":");
    out.push_str(&ungranted(params));
    out.push('}');
    out.into_bytes()
}

/// Most prompt tokens a synthetic release names: far beyond any model's context, and a body of
/// 32 MiB. `kv_transfer_params` asking for more are refused, not written out.
pub const MAX_RELEASE_TOKENS: u64 = 1 << 24;

/// `kv_transfer_params` naming a prompt longer than [`MAX_RELEASE_TOKENS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params name a prompt of {0} tokens (a release names at most {MAX_RELEASE_TOKENS})")]
pub struct TooManyTokens(pub u64);

/// How many prompt tokens a release must name: `remote_num_tokens`, else whole blocks.
pub fn release_tokens(params: &Value, block_size: usize) -> Result<usize, TooManyTokens> {
    let tokens = match params.get("remote_num_tokens").and_then(Value::as_u64) {
        Some(n) => n,
        None => {
            let blocks = match params.get("remote_block_ids") {
                Some(Value::Array(groups)) => match groups.first() {
                    Some(Value::Array(first)) => first.len(),
                    Some(_) => groups.len(),
                    None => 0,
                },
                _ => 0,
            };
            (blocks as u64).saturating_mul(block_size as u64)
        }
    };
    if tokens > MAX_RELEASE_TOKENS {
        return Err(TooManyTokens(tokens));
    }
    Ok(tokens as usize)
}

/// SGLang: the bootstrap fields both legs carry; `rooms` has one room per batch item (a single
/// request gets a number, a batch an array).
pub fn sglang_body(client: &Object<'_>, host: &str, port: Option<u16>, rooms: &[i64]) -> Vec<u8> {
    let host = json::string(host);
    let port = port.map_or_else(|| "null".to_string(), |p| p.to_string());
    let room = match rooms {
        [one] => one.to_string(),
        many => {
            let items: Vec<String> = many.iter().map(i64::to_string).collect();
            format!("[{}]", items.join(","))
        }
    };
    let (hosts, ports) = if rooms.len() == 1 {
        (host, port)
    } else {
        (format!("[{}]", vec![host; rooms.len()].join(",")), format!("[{}]", vec![port; rooms.len()].join(",")))
    };
    client.rewrite(&[
        ("bootstrap_host", Edit::Set(&hosts)),
        ("bootstrap_port", Edit::Set(&ports)),
        ("bootstrap_room", Edit::Set(&room)),
    ])
}

/// Items of a batched request (several prompts in one call), 1 otherwise.
pub fn batch_size(client: &Object<'_>, api: Api) -> usize {
    let key = match api {
        Api::Completions => "prompt",
        Api::Generate => {
            if client.contains("text") {
                "text"
            } else {
                "input_ids"
            }
        }
        Api::Chat => return 1,
    };
    match client.parsed::<Value>(key) {
        Some(Value::Array(items)) if items.len() > 1 && items.iter().all(|i| i.is_string() || i.is_array()) => {
            items.len()
        }
        _ => 1,
    }
}

/// The prompt as a router sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
}

impl Prompt {
    /// Token count: exact for token ids, `chars / chars_per_token` for text.
    pub fn estimated_tokens(&self, chars_per_token: f64) -> u64 {
        match self {
            Prompt::Tokens(t) => t.len() as u64,
            Prompt::Text(s) => (s.chars().count() as f64 / chars_per_token.max(0.1)).ceil() as u64,
        }
    }
}

/// The prompt of a request: token ids when the client sent them, else the text (chat messages'
/// contents joined by newlines). `None` when there is nothing to read.
pub fn prompt(client: &Object<'_>, api: Api) -> Option<Prompt> {
    match api {
        Api::Completions => prompt_value(&client.parsed::<Value>("prompt")?),
        Api::Generate => match client.parsed::<Value>("input_ids") {
            Some(ids) => prompt_value(&ids),
            None => prompt_value(&client.parsed::<Value>("text")?),
        },
        Api::Chat => {
            let messages = client.parsed::<Vec<Value>>("messages")?;
            let mut text = String::new();
            for m in &messages {
                match m.get("content") {
                    Some(Value::String(s)) => text.push_str(s),
                    Some(Value::Array(parts)) => {
                        for p in parts {
                            if let Some(Value::String(s)) = p.get("text") {
                                text.push_str(s);
                            }
                        }
                    }
                    _ => {}
                }
                text.push('\n');
            }
            Some(Prompt::Text(text))
        }
    }
}

fn prompt_value(v: &Value) -> Option<Prompt> {
    let ids = |items: &[Value]| -> Option<Vec<u32>> {
        items.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    match v {
        Value::String(s) => Some(Prompt::Text(s.clone())),
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_number) => {
            ids(items).map(Prompt::Tokens)
        }
        Value::Array(items) => {
            // A batch: the sizes add up; the text form keeps everything.
            let mut tokens = Vec::new();
            let mut text = String::new();
            for item in items {
                match prompt_value(item)? {
                    Prompt::Tokens(t) => tokens.extend(t),
                    Prompt::Text(s) => text.push_str(&s),
                }
            }
            Some(if text.is_empty() { Prompt::Tokens(tokens) } else { Prompt::Text(text) })
        }
        _ => None,
    }
}

/// SGLang with `return_logprob`: the prefill's `meta_info.input_token_logprobs` go before the
/// decode's (PROTOCOLS.md §4). Works on one response object or a batch (array of them); `None`
/// when either body lacks the fields (the decode's body is then sent as it came).
pub fn merge_input_logprobs(prefill: &[u8], decode: &[u8]) -> Option<Vec<u8>> {
    let p: &serde_json::value::RawValue = serde_json::from_slice(prefill).ok()?;
    let d: &serde_json::value::RawValue = serde_json::from_slice(decode).ok()?;
    merge_value(p.get(), d.get()).map(String::into_bytes)
}

fn merge_value(p: &str, d: &str) -> Option<String> {
    if d.trim_start().starts_with('[') {
        let ps: Vec<&serde_json::value::RawValue> = serde_json::from_str(p).ok()?;
        let ds: Vec<&serde_json::value::RawValue> = serde_json::from_str(d).ok()?;
        if ps.len() != ds.len() {
            return None;
        }
        let merged: Option<Vec<String>> = ps.iter().zip(&ds).map(|(p, d)| merge_value(p.get(), d.get())).collect();
        return Some(format!("[{}]", merged?.join(",")));
    }
    let po = Object::parse(p.as_bytes()).ok()?;
    let dobj = Object::parse(d.as_bytes()).ok()?;
    let pmeta = Object::parse(po.get("meta_info")?.get().as_bytes()).ok()?;
    let dmeta_raw = dobj.get("meta_info")?;
    let dmeta = Object::parse(dmeta_raw.get().as_bytes()).ok()?;
    let key = "input_token_logprobs";
    let plist = array_items(pmeta.get(key)?.get())?;
    let dlist = dmeta.get(key).map_or(Some(""), |raw| array_items(raw.get()))?;
    let joined = match (plist.is_empty(), dlist.is_empty()) {
        (_, true) => format!("[{plist}]"),
        (true, false) => format!("[{dlist}]"),
        (false, false) => format!("[{plist},{dlist}]"),
    };
    let meta = String::from_utf8(dmeta.rewrite(&[(key, Edit::Set(&joined))])).ok()?;
    String::from_utf8(dobj.rewrite(&[("meta_info", Edit::Set(&meta))])).ok()
}

/// The inside of a JSON array's text (between the brackets, trimmed); `None` if not an array.
fn array_items(text: &str) -> Option<&str> {
    let t = text.trim();
    let inner = t.strip_prefix('[')?.strip_suffix(']')?;
    Some(inner.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    // vLLM 0.32's answer (PROTOCOLS.md §1), with a number no f64 holds and a key order that
    // is not alphabetical, to show the copy is verbatim.
    const PARAMS: &str = r#"{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [[1,2,3,4,5,6]], "remote_engine_id": "79c25778", "remote_request_id": "cmpl-b1bd-0-9027", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 710, "remote_blocks_expiry_time": 1769000000.123456789012345678, "transfer_mode": "pull", "big": 18446744073709551617}"#;

    fn s(v: Vec<u8>) -> String {
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn prefill_call_follows_the_protocol() {
        let body = br#"{"model": "m", "prompt": "hi", "stream": true, "stream_options": {"include_usage": true}, "max_tokens": 50, "min_tokens": 5, "temperature": 0.70000000000000001, "kv_transfer_params": {"evil": 1}}"#;
        let o = Object::parse(body).unwrap();
        let p = s(prefill_body(&o, None));
        let unnamed = prefill_kv_params(None);
        assert_eq!(
            p,
            format!(
                r#"{{"model":"m","prompt":"hi","stream":false,"max_tokens":1,"temperature":0.70000000000000001,"kv_transfer_params":{unnamed}}}"#
            )
        );
        let named: Value = serde_json::from_slice(&prefill_body(&o, Some("decode-\"0\""))).unwrap();
        assert_eq!(named["kv_transfer_params"]["remote_engine_id"], "decode-\"0\"");
        assert_eq!(named["kv_transfer_params"]["remote_block_ids"], Value::Null, "NixlConnector ignores the name");
        let chat =
            Object::parse(br#"{"messages": [], "max_completion_tokens": 9, "min_completion_tokens": 2}"#).unwrap();
        let v: Value = serde_json::from_slice(&prefill_body(&chat, None)).unwrap();
        assert_eq!((v["max_completion_tokens"].clone(), v["max_tokens"].clone()), (1.into(), 1.into()));
        assert!(v.get("min_completion_tokens").is_none() && v.get("stream_options").is_none());
        assert_eq!(v["kv_transfer_params"], serde_json::from_str::<Value>(&unnamed).unwrap());
    }

    #[test]
    fn decode_call_carries_the_params_verbatim() {
        let client = br#"{"prompt": [1, 2, 3], "stream": true, "max_tokens": 50, "min_tokens": 5, "kv_transfer_params": {"client": "sent"}}"#;
        let out = s(decode_body(&Object::parse(client).unwrap(), PARAMS));
        assert_eq!(
            out,
            format!(
                r#"{{"prompt":[1, 2, 3],"stream":true,"max_tokens":50,"min_tokens":5,"kv_transfer_params":{PARAMS}}}"#
            )
        );
        assert!(out.contains("1769000000.123456789012345678") && out.contains("18446744073709551617"));
    }

    #[test]
    fn local_and_release_bodies() {
        let plain = Object::parse(br#"{"prompt": "x"}"#).unwrap();
        assert!(local_body(&plain).is_none());
        let sneaky = Object::parse(br#"{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}"#).unwrap();
        assert_eq!(s(local_body(&sneaky).unwrap()), r#"{"prompt":"x"}"#);
        let sg = Object::parse(br#"{"bootstrap_room": 5, "prompt": "x", "bootstrap_host": "evil"}"#).unwrap();
        assert_eq!(s(local_body(&sg).unwrap()), r#"{"prompt":"x"}"#);
        let rel =
            s(release_body(&Object::parse(br#"{"prompt": "x", "stream": true, "max_tokens": 7}"#).unwrap(), PARAMS));
        assert_eq!(rel, format!(r#"{{"prompt":"x","stream":false,"max_tokens":1,"kv_transfer_params":{PARAMS}}}"#));
        let synth = s(synthetic_release_body(Some("m"), 3, PARAMS));
        assert_eq!(
            synth,
            format!(r#"{{"model":"m","prompt":[0,0,0],"max_tokens":1,"stream":false,"kv_transfer_params":{PARAMS}}}"#)
        );
        let params: Value = serde_json::from_str(PARAMS).unwrap();
        assert_eq!(release_tokens(&params, 16), Ok(710));
        // A release reads without the grant; everything else stays verbatim.
        let granted = format!("{}, \"{GRANT_KEY}\": \"58473100\"}}", PARAMS.trim_end_matches('}'));
        let stripped = ungranted(&granted);
        assert!(!stripped.contains(GRANT_KEY) && stripped.contains("18446744073709551617"), "{stripped}");
        assert_eq!(serde_json::from_str::<Value>(&stripped).unwrap(), params);
        for body in [
            release_body(&Object::parse(br#"{"prompt": "x"}"#).unwrap(), &granted),
            synthetic_release_body(None, 1, &granted),
        ] {
            assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["kv_transfer_params"], params);
        }
        assert!(matches!(ungranted(PARAMS), Cow::Borrowed(_)), "without a grant the text is kept as sent");
        assert_eq!(release_tokens(&serde_json::json!({"remote_block_ids": [4, 5]}), 16), Ok(32));
        assert_eq!(release_tokens(&serde_json::json!({"remote_block_ids": [[4, 5, 6]]}), 16), Ok(48));
    }

    #[test]
    fn a_release_of_an_impossible_prompt_is_refused() {
        // Found writing the sidecar_engine_json fuzz target (its binary aborted on this input):
        // the synthetic release body asked for 200 GB, and the failed allocation aborts.
        let huge = serde_json::json!({"remote_num_tokens": 100_000_000_000u64, "remote_block_ids": [1]});
        assert_eq!(release_tokens(&huge, 16), Err(TooManyTokens(100_000_000_000)));
        let many_blocks = serde_json::json!({"remote_block_ids": [1, 2]});
        assert_eq!(release_tokens(&many_blocks, usize::MAX), Err(TooManyTokens(u64::MAX)));
        let limit = serde_json::json!({"remote_num_tokens": MAX_RELEASE_TOKENS});
        assert_eq!(release_tokens(&limit, 16), Ok(MAX_RELEASE_TOKENS as usize));
    }

    #[test]
    fn sglang_fields_single_and_batched() {
        let o = Object::parse(br#"{"text": "a", "bootstrap_room": 1}"#).unwrap();
        assert_eq!(
            s(sglang_body(&o, "10.0.0.1", Some(8998), &[42])),
            r#"{"text":"a","bootstrap_room":42,"bootstrap_host":"10.0.0.1","bootstrap_port":8998}"#
        );
        let batch = Object::parse(br#"{"prompt": ["a", "b"]}"#).unwrap();
        assert_eq!(batch_size(&batch, Api::Completions), 2);
        assert_eq!(
            s(sglang_body(&batch, "h", None, &[1, 2])),
            r#"{"prompt":["a", "b"],"bootstrap_host":["h","h"],"bootstrap_port":[null,null],"bootstrap_room":[1,2]}"#
        );
        assert_eq!(batch_size(&Object::parse(br#"{"prompt": [1, 2]}"#).unwrap(), Api::Completions), 1);
        assert_eq!(batch_size(&Object::parse(br#"{"input_ids": [[1], [2], [3]]}"#).unwrap(), Api::Generate), 3);
    }

    #[test]
    fn prompts_and_sizes() {
        let p = |b: &[u8], api| prompt(&Object::parse(b).unwrap(), api);
        assert_eq!(p(br#"{"prompt": [5, 6, 7]}"#, Api::Completions), Some(Prompt::Tokens(vec![5, 6, 7])));
        assert_eq!(p(br#"{"prompt": ["ab", "cd"]}"#, Api::Completions), Some(Prompt::Text("abcd".into())));
        assert_eq!(p(br#"{"prompt": [[1], [2, 3]]}"#, Api::Completions), Some(Prompt::Tokens(vec![1, 2, 3])));
        assert_eq!(p(br#"{"prompt": 5}"#, Api::Completions), None);
        assert_eq!(p(br#"{"input_ids": [9]}"#, Api::Generate), Some(Prompt::Tokens(vec![9])));
        let chat = p(
            br#"{"messages": [{"role": "user", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "world"}]}]}"#,
            Api::Chat,
        )
        .unwrap();
        assert_eq!(chat, Prompt::Text("hello\nworld\n".into()));
        assert_eq!(chat.estimated_tokens(4.0), 3);
        assert_eq!(Prompt::Tokens(vec![1; 10]).estimated_tokens(4.0), 10);
    }

    #[test]
    fn input_logprobs_are_merged_prefill_first() {
        let pre =
            br#"{"text": "x", "meta_info": {"id": "p", "input_token_logprobs": [[-0.5, 1, null], [-1.25, 2, null]]}}"#;
        let dec = br#"{"text": "yz", "meta_info": {"id": "d", "input_token_logprobs": [[-2.0, 3, null]], "output_token_logprobs": []}}"#;
        let merged = s(merge_input_logprobs(pre, dec).unwrap());
        assert_eq!(
            merged,
            r#"{"text":"yz","meta_info":{"id":"d","input_token_logprobs":[[-0.5, 1, null], [-1.25, 2, null],[-2.0, 3, null]],"output_token_logprobs":[]}}"#
        );
        let v: Value = serde_json::from_str(&merged).unwrap();
        assert_eq!(v["meta_info"]["input_token_logprobs"].as_array().unwrap().len(), 3);
        let batch = s(merge_input_logprobs(
            format!("[{}]", String::from_utf8_lossy(pre)).as_bytes(),
            format!("[{}]", String::from_utf8_lossy(dec)).as_bytes(),
        )
        .unwrap());
        assert!(batch.starts_with("[{") && batch.contains("[-1.25, 2, null],[-2.0"));
        assert!(merge_input_logprobs(b"{}", dec).is_none());
        assert!(merge_input_logprobs(pre, b"not json").is_none());
    }
}
