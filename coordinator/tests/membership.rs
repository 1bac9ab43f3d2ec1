//! Membership over the real daemon: registration, heartbeats and their notices, lease expiry,
//! graceful leave, health checks (a statically declared engine revived when it answers
//! again), and malformed input answered with OpenAI-style errors.

mod common;

use std::time::Duration;

use common::{eventually, free_port, Coord, Sim, MODEL};
use serde_json::json;

fn spec(id: &str, role: &str, sidecar: bool) -> serde_json::Value {
    // Nothing listens on these ports; health checks are off in the lease test.
    let mut spec = json!({"id": id, "role": role, "node": "n1", "model": MODEL,
                          "engine_url": format!("http://127.0.0.1:{}", free_port()), "block_size": 16});
    if sidecar {
        spec["sidecar_url"] = format!("http://127.0.0.1:{}", free_port()).into();
    }
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_heartbeats_and_lease_expiry() {
    let coord = Coord::start(&["--lease-ms", "1500", "--heartbeat-ms", "500", "--health-interval-ms", "0"]).await;
    let (status, reg) = coord.post("/v1/engines", &spec("d0", "decode", true)).await;
    assert_eq!(status, 200);
    assert_eq!(reg, json!({"engine": "d0", "lease_ms": 1500, "heartbeat_ms": 500, "decode_started_on_end": true}));
    coord.register(&spec("p0", "prefill", true)).await;

    // Both heartbeat for a while: both stay alive past the lease.
    for _ in 0..5 {
        for id in ["d0", "p0"] {
            let (status, notices) = coord.heartbeat(id).await;
            assert_eq!(status, 200);
            assert_eq!(notices, json!({"dead_engines": [], "release": []}));
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert_eq!(coord.alive().await.get("p0"), Some(&true));

    // p0 stops: it dies within the lease (plus a tick), d0 hears of it once.
    let took = eventually(Duration::from_secs(4), "p0 expires", || async {
        let (_, notices) = coord.heartbeat("d0").await;
        let told = notices["dead_engines"] == json!(["p0"]);
        told && coord.alive().await.get("p0") == Some(&false)
    })
    .await;
    println!("lease expiry noticed after {took:?} (lease 1.5 s)");
    let (_, notices) = coord.heartbeat("d0").await;
    assert_eq!(notices["dead_engines"], json!([]), "told once");
    let (status, err) = coord.heartbeat("p0").await;
    assert_eq!(status, 404, "a dead engine re-registers: {err}");
    assert_eq!(err["error"]["code"], 404);

    // Re-registration revives it as a new generation.
    coord.register(&spec("p0", "prefill", true)).await;
    let (_, list) = coord.get("/v1/engines").await;
    let p0 = list.as_array().unwrap().iter().find(|e| e["id"] == "p0").unwrap().clone();
    assert_eq!((p0["alive"].as_bool(), p0["generation"].as_u64()), (Some(true), Some(2)));
    assert_eq!(p0["origin"], "registered");

    // Graceful leave.
    assert_eq!(coord.delete("/v1/engines/d0").await, 204);
    assert_eq!(coord.delete("/v1/engines/nobody").await, 404);
    assert_eq!(coord.heartbeat("d0").await.0, 404);
    let (status, err) = coord.pair(&json!({"request_id": "r1", "model": MODEL, "token_ids": [1, 2, 3]})).await;
    assert_eq!(status, 503, "no live decode: {err}");
    assert_eq!(err["error"]["type"], "service_unavailable");
    assert_eq!(coord.metric("pd_coordinator_engine_deaths_total{cause=\"lease\"}").await, 1.0);
    assert_eq!(coord.metric("pd_coordinator_engine_deaths_total{cause=\"deregistered\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_kill_engines_and_revive_static_ones() {
    let mut sim = Sim::start("s0", &[]).await;
    let dir = std::env::temp_dir().join(format!("pd-coord-health-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cluster = dir.join("cluster.toml");
    std::fs::write(
        &cluster,
        format!(
            "[[engines]]\nid = \"s0\"\nrole = \"both\"\nnode = \"n1\"\nmodel = \"{MODEL}\"\nengine_url = \"{}\"\n\
             kv_events = \"tcp://*:{}\"\nreplay = \"tcp://*:{}\"\nblock_size = 16\ncapacity = 4096\n",
            sim.url, sim.events, sim.replay
        ),
    )
    .unwrap();
    let coord = Coord::start(&[
        "--cluster",
        cluster.to_str().unwrap(),
        "--lease-ms",
        "1500",
        "--heartbeat-ms",
        "500",
        "--health-interval-ms",
        "200",
        "--health-failures",
        "2",
    ])
    .await;
    // A sidecar-registered engine whose engine never answers /health, though it heartbeats.
    coord.register(&spec("ghost", "decode", true)).await;

    // The static engine has no sidecar: its health checks keep it alive past the lease.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let alive = coord.alive().await;
    assert_eq!(alive.get("s0"), Some(&true));
    assert_eq!(alive.get("ghost"), Some(&false), "failed health checks kill even a heartbeating engine");
    let (_, list) = coord.get("/v1/engines").await;
    assert_eq!(list[0]["origin"], "static");
    assert_eq!(list[0]["capacity_blocks"], 4096);

    // Its events are ingested (the sim's cache shows up in the index).
    sim.complete(&common::tokens(1, 64)).await;
    eventually(Duration::from_secs(5), "s0's blocks indexed", || async { coord.indexed("s0").await == 4 }).await;

    // kill -9: gone within two failed checks.
    let (port, events, replay) = (sim.port, sim.events, sim.replay);
    sim.proc.kill9();
    let took =
        eventually(Duration::from_secs(3), "s0 dead", || async { coord.alive().await.get("s0") == Some(&false) }).await;
    println!("killed static engine left pairing after {took:?}");
    assert_eq!(coord.indexed("s0").await, 0, "a dead engine leaves the index");

    // Back on the same port: revived from the cluster file.
    let _sim = Sim::start_on("s0", port, events, replay, &[]).await;
    eventually(Duration::from_secs(5), "s0 revived", || async { coord.alive().await.get("s0") == Some(&true) }).await;
    let (_, list) = coord.get("/v1/engines").await;
    assert_eq!(list[0]["generation"], 2);
    let (status, decision) = coord.pair(&json!({"request_id": "r", "model": MODEL, "token_ids": [1, 2]})).await;
    assert_eq!((status, decision["decode"]["id"].as_str()), (200, Some("s0")));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_input_gets_openai_errors() {
    let coord = Coord::start(&["--health-interval-ms", "0"]).await;
    coord.register(&spec("d0", "decode", false)).await;
    let cases: &[(&str, &str)] = &[
        ("/v1/engines", ""),
        ("/v1/engines", "{"),
        ("/v1/engines", "[]"),
        ("/v1/engines", r#"{"id": "x"}"#),
        ("/v1/engines", r#"{"id":"x","role":"boss","node":"n","model":"m","engine_url":"http://h","block_size":16}"#),
        ("/v1/engines", r#"{"id":"x","role":"both","node":"n","model":"m","engine_url":"http://h","block_size":0}"#),
        ("/v1/engines", r#"{"id":"a/b","role":"both","node":"n","model":"m","engine_url":"http://h","block_size":1}"#),
        ("/v1/engines", r#"{"id":"x","role":"both","node":"n","model":"m","engine_url":"file:///","block_size":1}"#),
        (
            "/v1/engines",
            r#"{"id":"x","role":"both","node":"n","model":"m","engine_url":"http://h","block_size":1,"extra":1}"#,
        ),
        ("/v1/engines/d0/heartbeat", r#"{"load": {"running": -1}}"#),
        ("/v1/engines/d0/heartbeat", r#"{"lode": {}}"#),
        ("/v1/pair", r#"{"request_id": "r", "model": "m", "token_ids": [1, -2]}"#),
        ("/v1/pair", r#"{"request_id": "r", "model": "m", "token_ids": [4294967296]}"#),
        ("/v1/pair", r#"{"request_id": "", "model": "m"}"#),
        ("/v1/pair", r#"{"request_id": "r", "model": "m", "temperature": 1}"#),
        ("/v1/pair", "\u{0}\u{1}\u{2}"),
        ("/v1/report", r#"{"request_id": "r", "event": "exploded"}"#),
        ("/v1/report", r#"{"request_id": "r", "event": "finished", "kv_transfer_params": {"a": }"#),
        ("/v1/report", r#"{"request_id": "r", "event": "finished", "note": 1}"#),
    ];
    for (path, body) in cases {
        let (status, err) = coord.post_raw(path, body.as_bytes().to_vec()).await;
        assert_eq!(status, 400, "{path} {body:?}: {err}");
        assert_eq!(err["error"]["type"], "invalid_request_error", "{path} {body:?}");
        assert_eq!(err["error"]["code"], 400);
        assert!(err["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    let (status, err) = coord.get("/v1/nothing").await;
    assert_eq!((status, &err["error"]["code"]), (404, &json!(404)));
    let (status, err) = coord.get("/v1/pair").await;
    assert_eq!((status, &err["error"]["code"]), (405, &json!(405)));
    let (status, err) = coord.post_raw("/v1/pair", vec![b' '; 17 << 20]).await;
    assert_eq!((status, &err["error"]["code"]), (413, &json!(413)), "body limit: {err}");

    // Random bytes and random JSON-ish noise: never a 5xx, the daemon stays up.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let alphabet = br#"{}[]":,0123456789-.eE abcdefnulltrue\"request_id model token_ids event"#;
    for i in 0..300 {
        let len = (next() % 200) as usize;
        let body: Vec<u8> = (0..len)
            .map(|_| if i % 2 == 0 { next() as u8 } else { alphabet[(next() % alphabet.len() as u64) as usize] })
            .collect();
        let path = ["/v1/engines", "/v1/pair", "/v1/report", "/v1/engines/d0/heartbeat"][i % 4];
        let (status, body) = coord.post_raw(path, body).await;
        assert!(status < 500, "{path}: {status} {body}");
    }
    let (status, _) = coord.get("/health").await;
    assert_eq!(status, 200);
    // Valid requests still work, and a pair without prompt is a local prefill.
    let (status, decision) = coord.pair(&json!({"request_id": "r", "model": MODEL})).await;
    assert_eq!((status, decision["reason"].as_str()), (200, Some("local_prefill")));
    assert!(coord.metric("pd_coordinator_pair_decisions_total{reason=\"invalid\"}").await >= 5.0);
}
