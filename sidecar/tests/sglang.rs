//! SGLang mode against simulators in SGLang roles: rooms injected, both legs at once, decode
//! streamed back, a failing prefill cancels the decode and reaches the client (or fails over).

mod common;

use std::time::{Duration, Instant};

use common::{fake, free_port, post_text, sse_text, words, Sidecar, Sim};
use serde_json::{json, Value};

async fn sglang_pair(timeout: &str) -> (Sim, Sim, u16) {
    let bport = free_port();
    let p =
        Sim::start(&["--role", "prefill", "--bootstrap-port", &bport.to_string(), "--bootstrap-timeout-secs", timeout])
            .await;
    let d = Sim::start(&["--role", "decode", "--bootstrap-timeout-secs", timeout, "--kv-load-failure-policy", "fail"])
        .await;
    (p, d, bport)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_pair_by_room_streamed_and_not() {
    let (p, d, bport) = sglang_pair("5").await;
    let single = Sim::start(&[]).await;
    let prefill = format!("{}#bootstrap={bport}", p.url);
    let s = Sidecar::start(&["--mode", "sglang", "--engine", &d.url, "--prefill", &prefill]).await;
    let body = json!({"prompt": words(50, "sg"), "max_tokens": 3});
    let (status, out) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let direct = common::post(&format!("{}/v1/completions", single.url), &body).await.1;
    assert_eq!(out["choices"][0]["text"], direct["choices"][0]["text"]);
    let chat = json!({"messages": [{"role": "user", "content": words(40, "sgc")}], "max_tokens": 4, "stream": true});
    let (status, text) = post_text(&format!("{}/v1/chat/completions", s.url), &chat, &[]).await;
    assert_eq!(status, 200, "{text}");
    let (_, direct) = post_text(&format!("{}/v1/chat/completions", single.url), &chat, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&direct));
    // Many at once: rooms never collide.
    let futs = (0..16).map(|i| {
        let url = format!("{}/v1/completions", s.url);
        async move { common::post(&url, &json!({"prompt": words(30, &format!("many{i}x")), "max_tokens": 2})).await.0 }
    });
    assert!(futures_util::future::join_all(futs).await.iter().all(|&s| s == 200));
    let dl = d.leaks().await;
    assert_eq!(
        (dl["pulls"].clone(), dl["recomputed"].clone(), dl["active_rooms"].clone()),
        (json!(18), json!(0), json!(0)),
        "{dl}"
    );
    let pl =
        p.leaks_until("rooms done", Duration::from_secs(1), |r| r["active_rooms"] == 0 && r["held_blocks"] == 0).await;
    assert_eq!(pl["rooms_rejected"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_prefill_cancels_the_decode() {
    let (p, d, bport) = sglang_pair("5").await;
    p.faults(json!({"error_rate": 1.0})).await;
    let prefill = format!("{}#bootstrap={bport}", p.url);
    let s =
        Sidecar::start(&["--mode", "sglang", "--engine", &d.url, "--prefill", &prefill, "--fallback", "fail"]).await;
    let started = Instant::now();
    let (status, err) = s.post("/v1/completions", &json!({"prompt": words(30, "bad"), "max_tokens": 3})).await;
    assert_eq!(status, 502, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("injected failure"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1), "not the 5 s bootstrap timeout");
    // The decode waiting for its room was cancelled: nothing left there.
    d.leaks_until("decode room dropped", Duration::from_secs(1), |r| r["active_rooms"] == 0 && r["used_blocks"] == 0)
        .await;
    assert_eq!(s.metric("pd_sidecar_sglang_prefill_failures_total").await, 1.0);

    // Unreachable prefill then a good one: fail over with a fresh room.
    p.faults(json!({"error_rate": 0.0})).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let s = Sidecar::start(&["--mode", "sglang", "--engine", &d.url, "--prefill", &format!("{dead},{prefill}")]).await;
    let (status, out) = s.post("/v1/completions", &json!({"prompt": words(30, "fo"), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(s.metric("pd_sidecar_failovers_total").await, 1.0);

    // Nothing reachable, policy local: the decode computes alone (no bootstrap fields).
    let s = Sidecar::start(&["--mode", "sglang", "--engine", &d.url, "--prefill", &dead]).await;
    let (status, out) = s.post("/v1/completions", &json!({"prompt": words(30, "alone"), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"prefill_failed\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_fields_and_input_logprobs() {
    let (prefill, plog) = fake(|_| {
        (
            200,
            "application/json",
            r#"{"text": "", "meta_info": {"input_token_logprobs": [[-0.5, 1, null], [-0.25, 2, null]]}}"#.into(),
        )
    })
    .await;
    let (decode, dlog) = fake(|_| {
        (
            200,
            "application/json",
            r#"{"text": "out", "meta_info": {"id": "d", "input_token_logprobs": [[-1.5, 3, null]]}}"#.into(),
        )
    })
    .await;
    let s = Sidecar::start(&[
        "--mode",
        "sglang",
        "--engine",
        &decode,
        "--prefill",
        &format!("http://{prefill}#bootstrap=8999"),
    ])
    .await;
    let body = json!({"text": ["a", "b"], "return_logprob": true, "bootstrap_room": 1, "bootstrap_host": "evil"});
    let (status, out) = s.post("/generate", &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["meta_info"]["input_token_logprobs"], json!([[-0.5, 1, null], [-0.25, 2, null], [-1.5, 3, null]]));
    let pb: Value = serde_json::from_slice(&plog.lock().unwrap()[0].body).unwrap();
    // The decode also saw the sidecar's one GET /server_info (its disaggregation mode).
    let paths: Vec<String> = dlog.lock().unwrap().iter().map(|seen| seen.path.clone()).collect();
    assert_eq!(paths, ["/server_info", "/generate"]);
    let db: Value = serde_json::from_slice(&dlog.lock().unwrap()[1].body).unwrap();
    assert_eq!(pb, db, "the same body to both legs");
    assert_eq!(pb["bootstrap_host"], json!(["127.0.0.1", "127.0.0.1"]));
    assert_eq!(pb["bootstrap_port"], json!([8999, 8999]));
    let rooms = pb["bootstrap_room"].as_array().unwrap();
    assert_eq!(rooms.len(), 2);
    assert!(rooms.iter().all(|r| r.as_i64().is_some_and(|r| r >= 0)) && rooms[0] != rooms[1]);
    assert_ne!(rooms[0], 1, "the client's room is replaced");
}
