//! The seed inputs of the fuzz targets in `fuzz/`: a few valid messages per target, written by
//! the encoders the daemons use (and, for the side channel, captured off a socket), so that each
//! run starts from real shapes rather than from nothing. `tests/fuzz_seeds.rs` checks that the
//! committed copies under `fuzz/seeds/<target>/` are what these functions write, and rewrites them
//! with `PD_FUZZ_SEEDS_WRITE=1`. Everything is deterministic: fixed ids, addresses and rooms.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use pd_api::{Endpoint, EngineSpec, Heartbeat, Load, Notices, PairDecision, PairReason, PairRequest, ReleaseNotice};
use pd_api::{Report, ReportEvent, Role};
use pd_protocols::kv_events::{encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};
use pd_protocols::kv_params::KvTransferParams;
use pd_sidecar::json::Object;
use pd_sidecar::rewrite;
use rmpv::Value;
use serde_json::json;
use serde_json::value::RawValue;
use xfer::metadata::{AgentMetadata, BackendInfo, RegionInfo};
use xfer::side_channel::{self, SideOp};
use xfer::{Desc, MemType};
use xfer_tcp::frame::{self, Kind, Session, WireDesc};
use xfer_tcp::records;
use xfer_tcp::TcpRemoteKey;
use xfer_ucx::{encode_conn_info, ProcessId, TcpSegments, UcxRemoteKey};

/// One seed: the fuzz target it is for, its file name and its bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seed {
    pub target: &'static str,
    pub name: &'static str,
    pub bytes: Vec<u8>,
}

fn seed(target: &'static str, name: &'static str, bytes: impl Into<Vec<u8>>) -> Seed {
    Seed { target, name, bytes: bytes.into() }
}

/// Every seed of every target.
pub fn all() -> Vec<Seed> {
    let mut seeds = Vec::new();
    seeds.extend(tcp_frames());
    seeds.extend(tls_records());
    seeds.extend(metadata_blobs());
    seeds.extend(side_channel());
    seeds.extend(grant_claims());
    seeds.extend(ucx());
    seeds.extend(kv_events());
    seeds.extend(coordinator_api());
    seeds.extend(sidecar_engine_json());
    seeds.extend(http_responses());
    seeds
}

fn tcp_frames() -> Vec<Seed> {
    let descs =
        [WireDesc { key: [7; 16], offset: 0, len: 4096 }, WireDesc { key: [9; 16], offset: 65_536, len: 131_072 }];
    let session = Session { id: 0x5eed, epoch: 2 };
    let mut out = Vec::new();
    let mut frame = |name, write: &dyn Fn(&mut Vec<u8>)| {
        let mut bytes = Vec::new();
        write(&mut bytes);
        out.push(seed("tcp_frames", name, bytes));
    };
    frame("write-request", &|b| frame::encode_request(Kind::Write, 1, &descs, 135_168, b));
    frame("read-request", &|b| frame::encode_request(Kind::Read, 2, &descs[..1], 0, b));
    frame("notif-request", &|b| frame::encode_request(Kind::Notif, 3, &[], 5, b));
    frame("response-ok", &|b| frame::encode_response(0, 2, 4096, "", b));
    frame("response-refused", &|b| frame::encode_response(3, 4, 0, "unknown key", b));
    frame("hello", &|b| frame::encode_hello("prefill-0", "decode-0", session, b));
    frame("hello-auth", &|b| frame::encode_hello_with("prefill-0", "decode-0", session, true, b));
    frame("hello-reply", &|b| frame::encode_hello_reply(0, "", b));
    out
}

/// Record headers and opened plaintexts as the TCP backend's record layer seals them: a header,
/// then content and content type.
fn tls_records() -> Vec<Seed> {
    let record = |name, content: &[u8], content_type| {
        let mut bytes = records::record_header(content.len()).expect("short content").to_vec();
        bytes.extend_from_slice(content);
        bytes.push(content_type);
        seed("tls_records", name, bytes)
    };
    vec![
        record("data", b"a frame header and its payload", records::APPLICATION_DATA),
        record("key-update", &records::KEY_UPDATE_NOT_REQUESTED, records::HANDSHAKE),
        record("close-notify", &[1, 0], records::ALERT),
    ]
}

/// An agent publishing a TCP and a UCX backend and two regions, as `Agent` builds it.
fn agent_metadata() -> AgentMetadata {
    let tcp_key = |key, base, len| TcpRemoteKey { key: [key; 16], base, len }.encode();
    let ucx_key = |key_id, base, len| UcxRemoteKey { key_id, base, len, packed: vec![0x5a; 48] }.encode();
    AgentMetadata {
        name: "prefill-0".into(),
        backends: vec![
            BackendInfo { name: "tcp".into(), conn_info: b"10.0.0.1:5601".to_vec() },
            BackendInfo { name: "ucx".into(), conn_info: ucx_conn_info(TcpSegments { tx: 262_144, rx: 262_144 }) },
        ],
        regions: vec![
            RegionInfo {
                mem_type: MemType::Dram,
                desc: Desc::new(0x7f00_0000_0000, 1 << 20, 0),
                keys: vec![(0, tcp_key(1, 0x7f00_0000_0000, 1 << 20)), (1, ucx_key(1, 0x7f00_0000_0000, 1 << 20))],
            },
            RegionInfo {
                mem_type: MemType::Vram,
                desc: Desc::new(0x2000_0000, 1 << 16, 1),
                keys: vec![(0, tcp_key(2, 0x2000_0000, 1 << 16))],
            },
        ],
    }
}

fn metadata_blobs() -> Vec<Seed> {
    let full = agent_metadata();
    let bare = AgentMetadata { name: "decode-0".into(), backends: full.backends[..1].to_vec(), regions: Vec::new() };
    vec![
        seed("metadata_blob", "two-backends-two-regions", full.encode()),
        seed("metadata_blob", "no-regions", bare.encode()),
    ]
}

/// Requests as `side_channel::call` sends them, read off a socket (the request encoder is private
/// to the side channel).
fn side_channel() -> Vec<Seed> {
    let requests = [
        ("get", SideOp::Get, Vec::new()),
        ("put", SideOp::Put, agent_metadata().encode()),
        ("invalidate", SideOp::Invalidate, b"prefill-0".to_vec()),
    ];
    let empty_success = [0, 0, 0, 0, 0];
    requests
        .into_iter()
        .map(|(name, op, body)| {
            let request = captured_request(&empty_success, |addr| {
                side_channel::call(addr, op, &body, Duration::from_secs(5)).expect("the call succeeds");
            });
            seed("side_channel", name, request)
        })
        .collect()
}

/// Claim bodies as `Agent::claim_grant` sends them, read off a socket (the claim encoder is
/// private to xfer), answered with a refusal so that the claimant does not ask again.
fn grant_claims() -> Vec<Seed> {
    let agent = xfer::Agent::new("decode-0").expect("an agent");
    let revoked: &[u8] = &[0, 6, 0, 0, 0, 7, 0, b'g', b'o', b'n', b'e'];
    let claims = [
        ("one-block", MemType::Dram, vec![Desc::new(0x7f00_0000_0000, 16 << 10, 0)]),
        (
            "three-layers",
            MemType::Vram,
            vec![Desc::new(0x1000, 4096, 1), Desc::new(0x9000, 8192, 1), Desc::new(0x40_0000, 4096, 1)],
        ),
    ];
    claims
        .into_iter()
        .map(|(name, mem_type, ranges)| {
            let request = captured_request(revoked, |addr| {
                let refused =
                    agent.claim_grant(addr, "cmpl-42", mem_type, &ranges).expect_err("answered with a refusal");
                assert!(matches!(refused, xfer::XferError::Refused { code: xfer::RefusalCode::Revoked, .. }));
            });
            seed("grant_claim", name, request[9..].to_vec())
        })
        .collect()
}

/// The request `call` makes to a side channel at the address it is given (header and body),
/// answered with `answer`.
fn captured_request(answer: &[u8], call: impl FnOnce(&str)) -> Vec<u8> {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = listener.local_addr().expect("bound").to_string();
    let answer = answer.to_vec();
    let server = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().expect("the client connects");
        stream.set_read_timeout(Some(Duration::from_secs(5))).expect("a timeout");
        let mut header = [0u8; 9];
        stream.read_exact(&mut header).expect("the header");
        let (_, len) = side_channel::decode_request_header(&header).expect("a valid header");
        let mut request = header.to_vec();
        request.resize(9 + len, 0);
        stream.read_exact(&mut request[9..]).expect("the whole request");
        stream.write_all(&answer).expect("the answer");
        request
    });
    call(&addr);
    server.join().expect("the capturing thread")
}

fn ucx_conn_info(segments: TcpSegments) -> Vec<u8> {
    // A worker address is opaque to the decoder; a real one differs per run.
    encode_conn_info(&[0x11; 64], ProcessId { host: 0x0123_4567_89ab_cdef, pid: 4242 }, segments)
}

fn ucx() -> Vec<Seed> {
    vec![
        seed("ucx_conn_info", "tcp-256k-segments", ucx_conn_info(TcpSegments { tx: 262_144, rx: 262_144 })),
        seed("ucx_conn_info", "ucx-default-segments", ucx_conn_info(TcpSegments { tx: 8192, rx: 65_536 })),
        seed("ucx_conn_info", "no-tcp", ucx_conn_info(TcpSegments::default())),
        seed(
            "ucx_keys",
            "host-memory",
            UcxRemoteKey { key_id: 3, base: 0x7f00_0000_0000, len: 1 << 20, packed: vec![0x5a; 48] }.encode(),
        ),
        seed(
            "ucx_keys",
            "local-only",
            UcxRemoteKey { key_id: 4, base: 0x2000_0000, len: 1 << 16, packed: Vec::new() }.encode(),
        ),
    ]
}

/// A batch with every kind of event: integer, signed (SGLang) and digest hashes.
fn event_batch() -> EventBatch {
    EventBatch {
        ts: 1_769_000_000.25,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash::Int(11), BlockHash::Int(-5i64 as u64)],
                parent_block_hash: Some(BlockHash::Int(10)),
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: None,
                medium: Some("GPU".into()),
                lora_name: None,
                cache_salt: None,
            },
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash::Bytes(vec![0xab; 32])],
                parent_block_hash: None,
                token_ids: (100..116).collect(),
                block_size: 16,
                lora_id: Some(1),
                medium: None,
                lora_name: Some("adapter".into()),
                cache_salt: None,
            },
            KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(11)], medium: Some("GPU".into()) },
            KvEvent::AllBlocksCleared,
        ],
        dp_rank: Some(0),
    }
}

fn msgpack(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).expect("writing to a Vec cannot fail");
    out
}

fn kv_events() -> Vec<Seed> {
    let batch = event_batch();
    let tagged = encode_batch(&batch, EventFormat::TaggedMap);
    let legacy = encode_batch(&batch, EventFormat::LegacyArray);
    // What other engines send: the older two-element batch (SGLang) and a batch as a map, each
    // holding one re-encoded event of ours.
    let stored = rmpv::decode::read_value(&mut &tagged[..]).expect("our own msgpack");
    let first_event =
        stored.as_array().and_then(|b| b.get(1)).and_then(|e| e.as_array()).expect("[ts, events, rank]")[0].clone();
    let two_element = msgpack(&Value::Array(vec![Value::from(12.5), Value::Array(vec![first_event.clone()])]));
    let as_map = msgpack(&Value::Map(vec![
        (Value::from("ts"), Value::from(12.5)),
        (Value::from("events"), Value::Array(vec![first_event])),
        (Value::from("data_parallel_rank"), Value::from(1)),
    ]));
    let mut seeds = Vec::new();
    for target in ["kv_event_batch", "kv_event_mutations"] {
        seeds.push(seed(target, "tagged-map", tagged.clone()));
        seeds.push(seed(target, "legacy-array", legacy.clone()));
    }
    seeds.push(seed("kv_event_batch", "two-element-batch", two_element));
    seeds.push(seed("kv_event_batch", "map-batch", as_map));
    seeds
}

/// `kv_transfer_params` as vLLM's prefill answers them (NixlConnector's fields).
fn prefill_params() -> KvTransferParams {
    serde_json::from_value(json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": [[1, 2, 3, 4, 5, 6]],
        "remote_engine_id": "79c25778",
        "remote_request_id": "cmpl-b1bd-0-9027",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": 90,
        "remote_blocks_expiry_time": 1_769_000_000.5,
    }))
    .expect("valid params")
}

fn json_bytes(value: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(value).expect("serialises")
}

fn coordinator_api() -> Vec<Seed> {
    let spec = EngineSpec {
        id: "n1".into(),
        role: Role::Prefill,
        node: "node-1".into(),
        model: "m".into(),
        engine_url: "http://10.0.0.1:8100".into(),
        sidecar_url: Some("http://10.0.0.1:8000".into()),
        kv_events: Some("tcp://10.0.0.1:5557".into()),
        kv_events_topic: Some("kv".into()),
        replay: Some("tcp://10.0.0.1:5558".into()),
        xfer_side_channel: Some("10.0.0.1:5600".into()),
        block_size: 16,
        capacity_blocks: Some(4096),
        data_parallel_size: Some(2),
    };
    let load = Load {
        running: Some(3),
        waiting: Some(1),
        kv_usage: Some(0.25),
        active_decode_blocks: Some(40),
        queued_prefill_blocks: Some(8),
    };
    let endpoint = |id: &str, node: &str| Endpoint {
        id: id.into(),
        engine_url: format!("http://{node}:8100"),
        sidecar_url: Some(format!("http://{node}:8000")),
        node: node.into(),
    };
    let pair = PairRequest {
        request_id: "r1".into(),
        model: "m".into(),
        token_ids: Some((0..48).collect()),
        prompt: None,
        prompt_tokens: Some(48),
        local_engine: Some("n3".into()),
        lora_name: None,
    };
    let decision = PairDecision {
        request_id: "r1".into(),
        decode: endpoint("n3", "10.0.0.3"),
        prefill: Some(endpoint("n1", "10.0.0.1")),
        decode_overlap_blocks: 1,
        prefill_overlap_blocks: 3,
        reason: PairReason::Disaggregated,
        decode_dp_rank: Some(0),
        prefill_dp_rank: None,
    };
    let params = RawValue::from_string(serde_json::to_string(&prefill_params()).expect("serialises")).expect("JSON");
    let report = Report {
        request_id: "r1".into(),
        event: ReportEvent::PrefillDone,
        engine: Some("n1".into()),
        kv_transfer_params: Some(params.clone()),
        error: None,
        decode_started: false,
    };
    let notices = Notices {
        dead_engines: vec!["n2".into()],
        release: vec![ReleaseNotice { request_id: "r0".into(), prefill: "n1".into(), kv_transfer_params: params }],
    };
    vec![
        seed("coordinator_api", "engine-spec", json_bytes(&spec)),
        seed("coordinator_api", "heartbeat", json_bytes(&Heartbeat { load: Some(load) })),
        seed("coordinator_api", "pair-request", json_bytes(&pair)),
        seed("coordinator_api", "pair-decision", json_bytes(&decision)),
        seed("coordinator_api", "report", json_bytes(&report)),
        seed("coordinator_api", "notices", json_bytes(&notices)),
        seed("coordinator_api", "kv-transfer-params", json_bytes(&prefill_params())),
    ]
}

fn sidecar_engine_json() -> Vec<Seed> {
    let target = "sidecar_engine_json";
    let completion = |params: serde_json::Value| {
        json_bytes(&json!({
            "id": "cmpl-b1bd-0",
            "object": "text_completion",
            "model": "m",
            "choices": [{"index": 0, "text": " the", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 90, "completion_tokens": 1, "total_tokens": 91},
            "kv_transfer_params": params,
        }))
    };
    let params = serde_json::to_value(prefill_params()).expect("serialises");
    // Older vLLM: one flat list of block ids; a sidecar-pull prefill (pd-sim) names its side channel.
    let mut flat = params.clone();
    flat["remote_block_ids"] = json!([1, 2, 3]);
    flat["transfer_mode"] = json!("pull");
    // SGLang: the bodies both legs get, single and batched, and its answers with input logprobs
    // (prefill, a NUL, decode) that the sidecar merges.
    let single =
        Object::parse(br#"{"text": "a b c", "sampling_params": {"max_new_tokens": 8}, "return_logprob": true}"#)
            .expect("a request");
    let batch =
        Object::parse(br#"{"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 8}}"#).expect("a request");
    let answer = |logprobs: serde_json::Value| {
        json_bytes(
            &json!({"text": " x", "meta_info": {"id": "1", "prompt_tokens": 3, "input_token_logprobs": logprobs}}),
        )
    };
    let mut merged = answer(json!([[null, 1, null], [-0.5, 2, null]]));
    merged.push(0);
    merged.extend(answer(json!([[-0.25, 3, null]])));
    vec![
        seed(target, "vllm-prefill-answer", completion(params)),
        seed(target, "vllm-prefill-answer-flat-ids", completion(flat)),
        seed(target, "vllm-prefill-answer-null-params", completion(serde_json::Value::Null)),
        seed(target, "sglang-leg", rewrite::sglang_body(&single, "10.0.0.1", Some(8998), &[42])),
        seed(target, "sglang-leg-batch", rewrite::sglang_body(&batch, "10.0.0.1", Some(8998), &[42, 43])),
        seed(target, "sglang-logprob-answers", merged),
    ]
}

/// Engine answers as the sidecar's client reads them, each after the byte that picks the
/// target's piece size. No encoder of ours writes responses: these are the shapes uvicorn sends
/// for vLLM and SGLang (a JSON answer with its length, an SSE stream in chunks, an error), and an
/// answer that runs until the connection closes.
fn http_responses() -> Vec<Seed> {
    let target = "http_responses";
    let json_answer = json_bytes(&json!({"id": "cmpl-1", "choices": [{"index": 0, "text": " the"}]}));
    let mut with_length = format!(
        "HTTP/1.1 200 OK\r\ndate: Sat, 05 Dec 2026 00:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: {}\r\n\
         content-type: application/json\r\n\r\n",
        json_answer.len()
    )
    .into_bytes();
    with_length.extend_from_slice(&json_answer);
    let mut sse = b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; charset=utf-8\r\n\
                    transfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for event in ["data: {\"choices\":[{\"text\":\" a\"}]}\n\n", "data: [DONE]\n\n"] {
        sse.extend_from_slice(format!("{:x}\r\n{event}\r\n", event.len()).as_bytes());
    }
    sse.extend_from_slice(b"0\r\n\r\n");
    let error = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}".to_vec();
    let until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end".to_vec();
    [
        ("json-with-length", with_length),
        ("sse-chunked", sse),
        ("interim-then-error", error),
        ("until-close", until_close),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (name, answer))| {
        let mut bytes = vec![i as u8];
        bytes.extend(answer);
        seed(target, name, bytes)
    })
    .collect()
}
