//! Every error path, each wait bounded: failover, fallback policies, prefill 4xx/5xx/non-JSON/
//! null params, prefill and decode timeouts, a decode engine that is down, idle streams.

mod common;

use std::time::{Duration, Instant};

use common::{fake, free_port, post_text, words, Sidecar, Sim};
use serde_json::{json, Value};

fn dead_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

const PARAMS_BODY: &str =
    r#"{"choices": [{"text": "x"}], "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "e"}}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fails_over_past_dead_and_overloaded_prefills() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--kv-load-failure-policy", "fail"]).await;
    let (busy, busy_log) = fake(|_| (503, "application/json", r#"{"error": {"message": "overloaded"}}"#.into())).await;
    let dead = dead_addr();
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &format!("{dead},{busy},{}", p.addr())]).await;
    // Round robin starts at the first entry for the first request.
    let started = Instant::now();
    let (status, out) = s.post("/v1/completions", &json!({"prompt": words(40, "fo"), "max_tokens": 3})).await;
    assert_eq!(status, 200, "{out}");
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(busy_log.lock().unwrap().len(), 1);
    assert_eq!(d.leaks().await["pulls"], 1);
    let m = s.metrics().await;
    assert_eq!(common::metric(&m, "pd_sidecar_failovers_total"), 2.0);
    assert_eq!(common::metric(&m, "pd_sidecar_prefill_attempts_total{result=\"connect_error\"}"), 1.0);
    assert_eq!(common::metric(&m, "pd_sidecar_prefill_attempts_total{result=\"failover_status\"}"), 1.0);
    assert_eq!(common::metric(&m, "pd_sidecar_prefill_attempts_total{result=\"ok\"}"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_no_prefill_works_the_policy_decides() {
    let d = Sim::start(&[]).await;
    let (bad_gw, _) = fake(|_| (502, "text/plain", "bad gateway".into())).await;
    let prefills = format!("{},{}", dead_addr(), dead_addr());
    // Policy local: the engine computes the prompt itself.
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &prefills]).await;
    let (status, out) = s.post("/v1/completions", &json!({"prompt": words(20, "loc"), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(d.leaks().await["pulls"], 0);
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"prefill_failed\"}").await, 1.0);
    drop(s);
    // Policy fail: every candidate unreachable → 503; one answered 502 → 502.
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &prefills, "--fallback", "fail"]).await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "a b", "max_tokens": 2})).await;
    assert_eq!(status, 503, "{err}");
    assert_eq!(err["error"]["type"], "ServiceUnavailableError");
    assert!(err["error"]["message"].as_str().unwrap().contains("no prefill engine available"), "{err}");
    drop(s);
    let s =
        Sidecar::start(&["--engine", &d.url, "--prefill", &format!("{bad_gw},{}", dead_addr()), "--fallback", "fail"])
            .await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "a b", "max_tokens": 2})).await;
    assert_eq!(status, 502, "{err}");
    assert_eq!(err["error"]["code"], 502);
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"prefill_failed\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_answers_client_errors_garbage_and_null_params() {
    let (decode, decode_log) = fake(|_| (200, "application/json", r#"{"ok": true}"#.into())).await;
    let (four, _) = fake(|_| {
        (
            400,
            "application/json",
            r#"{"error": {"message": "max_tokens too big", "type": "BadRequestError", "code": 400}}"#.into(),
        )
    })
    .await;
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &four]).await;
    let (status, text) = post_text(&format!("{}/v1/completions", s.url), &json!({"prompt": "x"}), &[]).await;
    assert_eq!(
        (status, text.as_str()),
        (400, r#"{"error": {"message": "max_tokens too big", "type": "BadRequestError", "code": 400}}"#)
    );
    assert!(decode_log.lock().unwrap().is_empty(), "no decode after a prefill 4xx");
    drop(s);

    let (garbage, _) = fake(|_| (200, "text/html", "<html>proxy error</html>".into())).await;
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &garbage]).await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(status, 502, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("not JSON"), "{err}");
    drop(s);

    let (null, _) = fake(|_| (200, "application/json", r#"{"choices": [], "kv_transfer_params": null}"#.into())).await;
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &null]).await;
    let (status, _) =
        s.post("/v1/completions", &json!({"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}})).await;
    assert_eq!(status, 200);
    let seen: Value = serde_json::from_slice(&decode_log.lock().unwrap()[0].body).unwrap();
    assert_eq!(seen, json!({"prompt": "x"}), "local decode, client's params dropped");
    assert_eq!(s.metric("pd_sidecar_prefill_attempts_total{result=\"null_params\"}").await, 1.0);
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"null_params\"}").await, 1.0);
    drop(s);
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &null, "--null-params", "fail"]).await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(status, 502, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("no kv_transfer_params"));

    // A 500 is not retried elsewhere: straight to the policy (here: fail → 502).
    let (five, five_log) =
        fake(|_| (500, "application/json", r#"{"error": {"message": "engine crashed"}}"#.into())).await;
    let (ok, ok_log) = fake(|_| (200, "application/json", PARAMS_BODY.into())).await;
    let s = Sidecar::start(&["--engine", &decode, "--prefill", &format!("{five},{ok}"), "--fallback", "fail"]).await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": "x"})).await;
    assert_eq!(status, 502, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("engine crashed"), "{err}");
    assert_eq!((five_log.lock().unwrap().len(), ok_log.lock().unwrap().len()), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_prefill_times_out_and_the_next_one_serves() {
    let hung = Sim::start(&[]).await;
    hung.faults(json!({"hang": true})).await;
    let p = Sim::start(&[]).await;
    let d = Sim::start(&[]).await;
    let s = Sidecar::start(&[
        "--engine",
        &d.url,
        "--prefill",
        &format!("{},{}", hung.addr(), p.addr()),
        "--prefill-timeout",
        "300ms",
    ])
    .await;
    let started = Instant::now();
    let (status, out) = s.post("/v1/completions", &json!({"prompt": words(20, "hang"), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{out}");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(2), "{took:?}");
    assert_eq!(s.metric("pd_sidecar_prefill_attempts_total{result=\"timeout\"}").await, 1.0);
    assert_eq!(d.leaks().await["pulls"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_engine_down_hung_or_failing() {
    let p = Sim::start(&[]).await;
    // Down: a clear 503.
    let s = Sidecar::start(&[
        "--engine",
        &format!("http://{}", dead_addr()),
        "--prefill",
        &p.addr(),
        "--release-method",
        "xfer",
    ])
    .await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": words(20, "down"), "max_tokens": 2})).await;
    assert_eq!(status, 503, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().starts_with("the decode engine is unavailable"), "{err}");
    // The prefill's blocks do not wait for the 30 s lease (xfer release: no engine needed).
    p.leaks_until("released after decode down", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
    let ready = common::client().get(format!("{}/ready", s.url)).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    drop(s);

    // Hung: 504 after the first-byte timeout, blocks released.
    let d = Sim::start(&[]).await;
    d.faults(json!({"hang": true})).await;
    let s = Sidecar::start(&[
        "--engine",
        &d.url,
        "--prefill",
        &p.addr(),
        "--decode-first-byte-timeout",
        "300ms",
        "--release-method",
        "xfer",
    ])
    .await;
    let started = Instant::now();
    let (status, err) = s.post("/v1/completions", &json!({"prompt": words(20, "hung"), "max_tokens": 2})).await;
    assert_eq!(status, 504, "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    p.leaks_until("released after decode timeout", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"timeout\"}").await, 1.0);
    d.faults(json!({"hang": false})).await;
    drop(s);

    // Failing: the engine's error goes back as it is.
    d.faults(json!({"error_rate": 1.0})).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr(), "--release-method", "xfer"]).await;
    let (status, err) = s.post("/v1/completions", &json!({"prompt": words(20, "fail"), "max_tokens": 2})).await;
    assert_eq!(status, 500, "{err}");
    assert_eq!(err["error"]["message"], "injected failure");
    p.leaks_until("released after decode error", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"engine_error\"}").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_is_cut_with_an_error_event() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--decode-us-per-token", "400000"]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr(), "--stream-idle-timeout", "150ms"]).await;
    let started = Instant::now();
    let (status, text) = post_text(
        &format!("{}/v1/completions", s.url),
        &json!({"prompt": words(20, "idle"), "max_tokens": 4, "stream": true}),
        &[],
    )
    .await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
    let events = common::sse_events(&text);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], 504, "{text}");
    assert_eq!(events.len(), 2, "one token, then the error: {text}");
    assert_eq!(s.metric("pd_sidecar_stream_idle_timeouts_total").await, 1.0);
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"timeout\"}").await, 1.0);
    // The engine's stream was closed: its request ends and frees its blocks.
    d.leaks_until("decode request ended", Duration::from_secs(2), |r| r["running"] == 0 && r["used_blocks"] == 0).await;
}
