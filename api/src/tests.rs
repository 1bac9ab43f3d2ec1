//! Each type's JSON pinned: parsed from the text the API documents, written back to the same
//! text, and parsed again to the same value.

use super::*;

/// Parses `text`, checks it writes back to exactly `text` and reads back equal (per `same`).
fn round_trip<T: Serialize + serde::de::DeserializeOwned>(text: &str, same: impl Fn(&T, &T) -> bool) -> T {
    let value: T = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let written = serde_json::to_string(&value).unwrap();
    assert_eq!(written, text);
    let again: T = serde_json::from_str(&written).unwrap();
    assert!(same(&value, &again), "{text}");
    value
}

fn pinned<T: Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(text: &str) -> T {
    round_trip(text, |a: &T, b: &T| a == b)
}

const SPEC: &str = r#"{"id":"d0","role":"decode","node":"n1","model":"m","engine_url":"http://10.0.0.2:8000","sidecar_url":"http://10.0.0.2:9000","kv_events":"tcp://10.0.0.2:5557","replay":"tcp://10.0.0.2:5558","xfer_side_channel":"10.0.0.2:5600","block_size":16,"capacity_blocks":4096}"#;
const MINIMAL_SPEC: &str =
    r#"{"id":"n:8000","role":"prefill","node":"n","model":"m","engine_url":"http://127.0.0.1:8200","block_size":16}"#;

#[test]
fn engine_spec() {
    let spec: EngineSpec = pinned(SPEC);
    assert_eq!((spec.role, spec.capacity_blocks), (Role::Decode, Some(4096)));
    spec.validate().unwrap();
    let minimal: EngineSpec = pinned(MINIMAL_SPEC);
    assert_eq!((minimal.sidecar_url, minimal.kv_events, minimal.data_parallel_size), (None, None, None));
    let ranked: EngineSpec =
        pinned(&MINIMAL_SPEC.replace(r#""block_size":16"#, r#""block_size":16,"data_parallel_size":4"#));
    assert_eq!(ranked.data_parallel_size, Some(4));
    // Cluster files say `capacity`; unknown fields are refused.
    let aliased: EngineSpec = serde_json::from_str(&SPEC.replace("capacity_blocks", "capacity")).unwrap();
    assert_eq!(aliased.capacity_blocks, Some(4096));
    assert!(serde_json::from_str::<EngineSpec>(&SPEC.replace("\"node\"", "\"colour\":1,\"node\"")).is_err());
    assert!(serde_json::from_str::<EngineSpec>(&SPEC.replace("decode", "router")).is_err());
}

#[test]
fn engine_spec_limits() {
    let check = |edit: &dyn Fn(&mut EngineSpec)| {
        let mut spec: EngineSpec = serde_json::from_str(SPEC).unwrap();
        edit(&mut spec);
        spec.validate()
    };
    assert_eq!(check(&|s| s.id.clear()), Err(InvalidSpec::Name { field: "id" }));
    assert_eq!(check(&|s| s.model = "m".repeat(MAX_NAME + 1)), Err(InvalidSpec::Name { field: "model" }));
    assert_eq!(check(&|s| s.node = "n".repeat(MAX_NAME + 1)), Err(InvalidSpec::TooLong { field: "node" }));
    assert_eq!(check(&|s| s.id = "a/b".into()), Err(InvalidSpec::IdCharacters));
    assert_eq!(check(&|s| s.id = "a b".into()), Err(InvalidSpec::IdCharacters));
    assert_eq!(check(&|s| s.block_size = 0), Err(InvalidSpec::BlockSize));
    assert_eq!(check(&|s| s.block_size = MAX_BLOCK_SIZE + 1), Err(InvalidSpec::BlockSize));
    assert_eq!(check(&|s| s.data_parallel_size = Some(0)), Err(InvalidSpec::DataParallelSize));
    assert_eq!(check(&|s| s.data_parallel_size = Some(MAX_DATA_PARALLEL_SIZE + 1)), Err(InvalidSpec::DataParallelSize));
    assert_eq!(check(&|s| s.data_parallel_size = Some(MAX_DATA_PARALLEL_SIZE)), Ok(()));
    let http = Err(InvalidSpec::Url { field: "engine_url", schemes: "http/https" });
    assert_eq!(check(&|s| s.engine_url = "ftp://x".into()), http);
    assert_eq!(check(&|s| s.engine_url = "http://".into()), http);
    assert_eq!(
        check(&|s| s.sidecar_url = Some("x:1".into())),
        Err(InvalidSpec::Url { field: "sidecar_url", schemes: "http/https" })
    );
    assert_eq!(
        check(&|s| s.replay = Some("http://x".into())),
        Err(InvalidSpec::Url { field: "replay", schemes: "tcp/ipc/inproc" })
    );
    assert_eq!(check(&|s| s.kv_events = Some("ipc:///tmp/e".into())), Ok(()));
    assert_eq!(
        check(&|s| s.xfer_side_channel = Some("x".repeat(MAX_NAME + 1))),
        Err(InvalidSpec::TooLong { field: "xfer_side_channel" })
    );
    assert_eq!(
        InvalidSpec::Url { field: "engine_url", schemes: "http/https" }.to_string(),
        "'engine_url' must be a http/https URL"
    );
}

#[test]
fn registration_and_heartbeat() {
    let r: Registration = pinned(r#"{"engine":"d0","lease_ms":3000,"heartbeat_ms":1000,"decode_started_on_end":true}"#);
    assert_eq!((r.heartbeat_ms, r.decode_started_on_end), (1000, true));
    // An older coordinator that names only the engine still reads.
    let bare: Registration = serde_json::from_str(r#"{"engine":"d0"}"#).unwrap();
    assert_eq!((bare.lease_ms, bare.heartbeat_ms, bare.decode_started_on_end), (0, 0, false));
    let load: Load =
        pinned(r#"{"running":2,"waiting":1,"kv_usage":0.25,"active_decode_blocks":40,"queued_prefill_blocks":8}"#);
    assert_eq!(load.kv_usage, Some(0.25));
    pinned::<Load>("{}");
    pinned::<Heartbeat>(r#"{"load":{"running":2,"waiting":0,"kv_usage":0.5}}"#);
    pinned::<Heartbeat>("{}");
    assert!(serde_json::from_str::<Load>(r#"{"busy":1}"#).is_err());
    assert!(serde_json::from_str::<Heartbeat>(r#"{"load":{},"x":1}"#).is_err());
}

#[test]
fn notices_keep_params_verbatim() {
    let text = r#"{"dead_engines":["p1"],"release":[{"request_id":"r","prefill":"p1","kv_transfer_params":{"b": 1.00000000000000000001, "a": 2}}]}"#;
    let n: Notices = round_trip(text, |a: &Notices, b: &Notices| {
        a.dead_engines == b.dead_engines
            && a.release[0].kv_transfer_params.get() == b.release[0].kv_transfer_params.get()
    });
    assert_eq!(n.release[0].kv_transfer_params.get(), r#"{"b": 1.00000000000000000001, "a": 2}"#);
    let empty: Notices = serde_json::from_str("{}").unwrap();
    assert!(empty.dead_engines.is_empty() && empty.release.is_empty());
    let null: Notices =
        serde_json::from_str(r#"{"release":[{"request_id":"r","prefill":"p","kv_transfer_params":null}]}"#).unwrap();
    assert_eq!(null.release[0].kv_transfer_params.get(), "null");
}

#[test]
fn engine_view() {
    let text = format!(
        r#"{},"alive":false,"generation":3,"origin":"registered","load":{{"running":1}},"indexed_blocks":12}}"#,
        SPEC.trim_end_matches('}')
    );
    let view: EngineView = pinned(&text);
    assert!(!view.alive);
    assert_eq!((view.origin, view.spec.id.as_str(), view.generation), (Origin::Registered, "d0", 3));
    let text = format!(
        r#"{},"alive":true,"generation":1,"origin":"static","indexed_blocks":0}}"#,
        MINIMAL_SPEC.trim_end_matches('}')
    );
    let view: EngineView = pinned(&text);
    assert!(view.alive && view.spec.role.prefills() && view.origin == Origin::Static);
    // Liveness is `alive`; a view without it is not guessed at.
    assert!(serde_json::from_str::<EngineView>(&text.replace(r#""alive":true,"#, "")).is_err());
}

#[test]
fn pairing() {
    let req: PairRequest =
        pinned(r#"{"request_id":"r1","model":"m","token_ids":[1,2,3],"prompt_tokens":3,"local_engine":"d0"}"#);
    assert_eq!(req.token_ids.as_deref(), Some(&[1, 2, 3][..]));
    pinned::<PairRequest>(r#"{"request_id":"r2","model":"m","prompt":"hello"}"#);
    assert!(serde_json::from_str::<PairRequest>(r#"{"request_id":"r","model":"m","tokens":[1]}"#).is_err());
    let d: PairDecision = pinned(
        r#"{"request_id":"r1","decode":{"id":"d1","engine_url":"http://d:1","sidecar_url":"http://d:8000","node":"n"},"prefill":{"id":"p0","engine_url":"http://p:1","node":"n"},"decode_overlap_blocks":0,"prefill_overlap_blocks":3,"reason":"disaggregated"}"#,
    );
    assert_eq!((d.reason, d.prefill.map(|p| p.id)), (PairReason::Disaggregated, Some("p0".into())));
    let local: PairDecision = pinned(
        r#"{"request_id":"r1","decode":{"id":"d0","engine_url":"http://d:1","node":"n"},"prefill":null,"decode_overlap_blocks":9,"prefill_overlap_blocks":0,"reason":"local_prefill"}"#,
    );
    assert_eq!((local.reason.as_str(), local.prefill), ("local_prefill", None));
    assert_eq!((local.decode_dp_rank, local.prefill_dp_rank), (None, None), "no rank unless named");
    let ranked: PairDecision = pinned(
        r#"{"request_id":"r1","decode":{"id":"d0","engine_url":"http://d:1","node":"n"},"prefill":{"id":"p0","engine_url":"http://p:1","node":"n"},"decode_overlap_blocks":0,"prefill_overlap_blocks":3,"reason":"disaggregated","prefill_dp_rank":1}"#,
    );
    assert_eq!((ranked.decode_dp_rank, ranked.prefill_dp_rank), (None, Some(1)));
}

#[test]
fn reports() {
    let text = r#"{"request_id":"r","event":"prefill_done","engine":"p0","kv_transfer_params":{"b": 1.00000000000000000001, "a": 2}}"#;
    let r: Report = round_trip(text, |a: &Report, b: &Report| {
        a.event == b.event
            && a.kv_transfer_params.as_ref().map(|p| p.get()) == b.kv_transfer_params.as_ref().map(|p| p.get())
    });
    assert_eq!(r.event, ReportEvent::PrefillDone);
    for (event, name) in [
        (ReportEvent::DecodeStarted, "decode_started"),
        (ReportEvent::Finished, "finished"),
        (ReportEvent::Failed, "failed"),
    ] {
        let text = format!(r#"{{"request_id":"r","event":"{name}","error":"x"}}"#);
        let r: Report = round_trip(&text, |a: &Report, b: &Report| a.event == b.event && a.error == b.error);
        assert_eq!(r.event, event);
    }
    // A final report standing for decode_started too; absent, it reads false and is not written.
    let folded = r#"{"request_id":"r","event":"finished","decode_started":true}"#;
    let r: Report = serde_json::from_str(folded).unwrap();
    assert!(r.decode_started);
    assert_eq!(serde_json::to_string(&r).unwrap(), folded);
    let plain = r#"{"request_id":"r","event":"finished"}"#;
    assert_eq!(serde_json::to_string(&serde_json::from_str::<Report>(plain).unwrap()).unwrap(), plain);
    assert!(serde_json::from_str::<Report>(r#"{"request_id":"r","event":"started"}"#).is_err());
    assert!(serde_json::from_str::<Report>(r#"{"request_id":"r","event":"failed","x":1}"#).is_err());
}

#[test]
fn node_down_and_index_stats() {
    pinned::<NodeDown>(r#"{"node":"n1","engines":["p0","d0"]}"#);
    let stats: IndexStats = pinned(r#"{"models":{"m":{"blocks":4,"entries":6,"engines":{"d0":2,"p0":4}}}}"#);
    assert_eq!(stats.models["m"].engines["p0"], 4);
}
