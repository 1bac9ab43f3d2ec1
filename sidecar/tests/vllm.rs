//! The decode-first flow against simulators in separate processes: both APIs, streaming and
//! not, the exact prefill call, verbatim params, request ids, routing header and allowlist.

mod common;

use std::time::Duration;

use common::{fake, post, post_text, sse_events, sse_text, words, Sidecar, Sim};
use serde_json::{json, Value};

async fn pair() -> (Sim, Sim) {
    (Sim::start(&[]).await, Sim::start(&["--kv-load-failure-policy", "fail"]).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_streamed_and_not_match_a_single_engine() {
    let (p, d) = pair().await;
    let single = Sim::start(&[]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr()]).await;

    let prompt = words(40, "vl");
    let body = json!({"prompt": prompt, "max_tokens": 6});
    let (status, via) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{via}");
    let (_, direct) = single.post_json("/v1/completions", &body).await;
    assert_eq!(via["choices"][0]["text"], direct["choices"][0]["text"]);
    assert_eq!(via["usage"], direct["usage"]);

    let chat = json!({"messages": [{"role": "user", "content": words(30, "ch")}], "max_completion_tokens": 5, "stream": true,
                      "stream_options": {"include_usage": true}});
    let (status, text) = post_text(&format!("{}/v1/chat/completions", s.url), &chat, &[]).await;
    assert_eq!(status, 200, "{text}");
    let (_, direct_text) = post_text(&format!("{}/v1/chat/completions", single.url), &chat, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&direct_text));
    assert_eq!(sse_events(&text).last().unwrap(), "[DONE]");
    assert!(text.contains("\"usage\""), "stream_options reached the decode");

    let streamed = json!({"prompt": words(20, "st"), "max_tokens": 4, "stream": true});
    let (_, text) = post_text(&format!("{}/v1/completions", s.url), &streamed, &[]).await;
    let (_, direct_text) = post_text(&format!("{}/v1/completions", single.url), &streamed, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&direct_text));

    // Every decode pulled from the prefill (no recompute), and nothing is held anywhere.
    let dl = d.leaks().await;
    assert_eq!(
        (dl["pulls"].clone(), dl["recomputed"].clone(), dl["invalid_params"].clone()),
        (json!(3), json!(0), json!(0)),
        "{dl}"
    );
    p.leaks_until("prefill released", Duration::from_secs(1), |r| r["held_blocks"] == 0 && r["leases_done"] == 3).await;
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"ok\"}").await, 3.0);
    assert_eq!(s.metric("pd_sidecar_disaggregated_total").await, 3.0);
    let m = s.metrics().await;
    for phase in ["prefill", "kv_handoff", "decode_first_byte", "end_to_end"] {
        assert_eq!(common::metric(&m, &format!("pd_sidecar_phase_seconds_count{{phase=\"{phase}\"}}")), 3.0, "{phase}");
    }
}

trait PostJson {
    async fn post_json(&self, path: &str, body: &Value) -> (u16, Value);
}

impl PostJson for Sim {
    async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        post(&format!("{}{path}", self.url), body).await
    }
}

/// kv_transfer_params with a key order no serializer would pick and numbers no f64 holds.
const ODD_PARAMS: &str = r#"{"remote_port": 5600, "do_remote_prefill": true, "remote_block_ids": [[1, 2]], "remote_engine_id": "e-1", "remote_request_id": "cmpl-x-0-1", "remote_host": "10.9.9.9", "zeta": 1.00000000000000000000001, "big": 123456789012345678901234567890, "do_remote_decode": false}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_call_and_the_verbatim_handoff() {
    let (prefill, prefill_log) = fake(|_| {
        (
            200,
            "application/json",
            format!(r#"{{"id": "cmpl-1", "choices": [{{"text": "x"}}], "kv_transfer_params": {ODD_PARAMS}}}"#),
        )
    })
    .await;
    let (decode, decode_log) =
        fake(|_| (200, "application/json", r#"{"id": "d", "choices": [{"text": "done"}]}"#.into())).await;
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &prefill]).await;

    let client_body = r#"{"model": "m", "prompt": "hello", "stream": false, "stream_options": {"include_usage": true}, "max_tokens": 50, "min_tokens": 3, "temperature": 0.30000000000000004, "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "evil"}}"#;
    let r = common::client()
        .post(format!("{}/v1/completions", s.url))
        .header("content-type", "application/json")
        .header("x-request-id", "req-42")
        .header("x-prefiller-host-port", "169.254.169.254:80")
        .body(client_body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.text().await.unwrap(),
        r#"{"id": "d", "choices": [{"text": "done"}]}"#,
        "decode body relayed byte for byte"
    );

    let p = prefill_log.lock().unwrap()[0].clone();
    let d = decode_log.lock().unwrap()[0].clone();
    assert_eq!(p.path, "/v1/completions");
    let pb: Value = serde_json::from_slice(&p.body).unwrap();
    assert_eq!(pb["stream"], false);
    assert_eq!(pb["max_tokens"], 1);
    assert!(pb.get("stream_options").is_none() && pb.get("min_tokens").is_none());
    assert_eq!(
        pb["kv_transfer_params"],
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null})
    );
    // The decode call is the client's body with the prefill's params as text, unchanged.
    let dtext = std::str::from_utf8(&d.body).unwrap();
    assert_eq!(
        dtext,
        format!(
            r#"{{"model":"m","prompt":"hello","stream":false,"stream_options":{{"include_usage": true}},"max_tokens":50,"min_tokens":3,"temperature":0.30000000000000004,"kv_transfer_params":{ODD_PARAMS}}}"#
        )
    );
    // One request id on both legs; the routing header (not allowed) reached neither.
    assert_eq!(p.headers["x-request-id"], "req-42");
    assert_eq!(d.headers["x-request-id"], "req-42");
    assert!(p.headers.get("x-prefiller-host-port").is_none() && d.headers.get("x-prefiller-host-port").is_none());
    assert_eq!(s.metric("pd_sidecar_routing_header_rejected_total").await, 1.0);

    // Without an X-Request-Id the sidecar makes one, the same on both legs.
    let (status, _) = s.post("/v1/chat/completions", &json!({"messages": [], "max_completion_tokens": 9})).await;
    assert_eq!(status, 200);
    let p = prefill_log.lock().unwrap()[1].clone();
    let d = decode_log.lock().unwrap()[1].clone();
    let id = p.headers["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(d.headers["x-request-id"], id.as_str());
    let pb: Value = serde_json::from_slice(&p.body).unwrap();
    assert_eq!((pb["max_completion_tokens"].clone(), pb["max_tokens"].clone()), (json!(1), json!(1)));
    let db: Value = serde_json::from_slice(&d.body).unwrap();
    assert_eq!(db["max_completion_tokens"], 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_header_picks_an_allowed_prefill_and_others_pass_through() {
    let (p1, d) = pair().await;
    let p2 = Sim::start(&[]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p1.addr(), "--allow", "127.0.0.0/8"]).await;
    let body = json!({"prompt": words(33, "hd"), "max_tokens": 2});
    // Allowed by the network entry: the header wins over the static list.
    let (status, text) =
        post_text(&format!("{}/v1/completions", s.url), &body, &[("x-prefiller-host-port", &p2.addr())]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(
        (p2.leaks().await["leases_started"].clone(), p1.leaks().await["leases_started"].clone()),
        (json!(1), json!(0))
    );
    // Not allowed (a name, never resolved): ignored, the static list is used.
    let (status, _) =
        post_text(&format!("{}/v1/completions", s.url), &body, &[("x-prefiller-host-port", "localhost:1")]).await;
    assert_eq!(status, 200);
    assert_eq!(p1.leaks().await["leases_started"], 1);

    // Other paths go to the engine untouched; the sidecar answers its own.
    let models = common::get_json(&format!("{}/v1/models", s.url)).await;
    assert_eq!(models["data"][0]["id"], "sim-model");
    let ready = common::get_json(&format!("{}/ready", s.url)).await;
    assert_eq!(ready["ready"], true);
    let engine_metrics =
        common::client().get(format!("{}/engine/metrics", s.url)).send().await.unwrap().text().await.unwrap();
    assert!(engine_metrics.contains("vllm:num_requests_running"));
    assert_eq!(s.metric("pd_sidecar_passthrough_total").await, 1.0);
}

/// A pass-through upload is read whole before it is sent on, so it is held to `--max-body-bytes`
/// like a generation request: over it the client gets 413 and the engine nothing; under it, the
/// engine gets the bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pass_through_uploads_are_held_to_the_body_limit() {
    let d = Sim::start(&[]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--max-body-bytes", "4096"]).await;
    let upload =
        |bytes: usize| common::client().post(format!("{}/v1/not-a-route", s.url)).body(vec![b'x'; bytes]).send();
    let over = upload(64 << 10).await.unwrap();
    assert_eq!(over.status(), 413);
    // Under the limit the upload reaches the engine, which has no such route.
    let under = upload(1024).await.unwrap();
    assert_eq!(under.status(), 404, "{:?}", under.text().await);
    assert_eq!(s.metric("pd_sidecar_passthrough_total").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_prompts_decode_locally_and_data_parallel_ranks_share_the_load() {
    let p = Sim::start(&[]).await;
    let d0 = Sim::start(&[]).await;
    let d1 = Sim::start(&[]).await;
    let s = Sidecar::start(&[
        "--engine",
        &format!("{},{}", d0.url, d1.url),
        "--prefill",
        &p.addr(),
        "--local-prefill-below-tokens",
        "16",
        "--chars-per-token",
        "5",
    ])
    .await;
    // 10 words of ~5 characters: ~11 tokens estimated, below 16: no prefill leg.
    let (status, _) = s.post("/v1/completions", &json!({"prompt": words(10, "shrt"), "max_tokens": 2})).await;
    assert_eq!(status, 200);
    assert_eq!(p.leaks().await["leases_started"], 0);
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"threshold\"}").await, 1.0);
    let futs = (0..8).map(|i| {
        let url = format!("{}/v1/completions", s.url);
        async move { post(&url, &json!({"prompt": words(60, &format!("dp{i}x")), "max_tokens": 2})).await.0 }
    });
    let statuses = futures_util::future::join_all(futs).await;
    assert!(statuses.iter().all(|&s| s == 200), "{statuses:?}");
    let (n0, n1) = (d0.leaks().await["pulls"].as_u64().unwrap(), d1.leaks().await["pulls"].as_u64().unwrap());
    assert_eq!(n0 + n1, 8);
    assert!(n0 > 0 && n1 > 0, "both ranks used: {n0} {n1}");
    // Token-id prompts are measured exactly.
    let (status, _) = s.post("/v1/completions", &json!({"prompt": [5, 6, 7], "max_tokens": 1})).await;
    assert_eq!(status, 200);
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"threshold\"}").await, 2.0);
}
