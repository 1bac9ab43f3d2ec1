//! The OpenAI-compatible surface: shapes, streaming, errors, failure injection.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, Sim, WAIT};
use pd_sim::harness;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_with_the_right_status() {
    let s = Sim::start(&["--max-model-len", "64"]).await;
    let url = format!("{}/v1/completions", s.url);
    let cases: [(&str, u16, Value); 8] = [
        ("{not json", 400, Value::Null),
        ("[1, 2]", 400, Value::Null),
        (r#"{"prompt": {"a": 1}}"#, 400, json!("prompt")),
        (r#"{"prompt": "x", "max_tokens": -1}"#, 400, json!("max_tokens")),
        (r#"{"prompt": "x", "stream": 1}"#, 400, json!("stream")),
        (r#"{"prompt": "x", "max_tokens": 100}"#, 400, Value::Null),
        (r#"{"prompt": "x", "model": "other"}"#, 404, Value::Null),
        (r#"{"max_tokens": 1}"#, 400, json!("prompt")),
    ];
    for (body, status, param) in cases {
        let r = common::client().post(&url).header("content-type", "application/json").body(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{body}");
        let err: Value = r.json().await.unwrap();
        let e = &err["error"];
        assert!(e["message"].is_string() && e["type"].is_string(), "{err}");
        assert_eq!((e["code"].clone(), e["param"].clone()), (json!(status), param), "{body}");
    }
    let (status, err) = s.post("/v1/chat/completions", &json!({"messages": "hi"})).await;
    assert_eq!((status, err["error"]["param"].clone()), (400, json!("messages")));
    let (status, _) = s.post("/v1/nothing", &json!({})).await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_streaming_and_metrics() {
    let s = Sim::start(&["--model", "tiny"]).await;
    let models = common::get_json(&format!("{}/v1/models", s.url)).await;
    assert_eq!(models["data"][0]["id"], "tiny");

    let r = common::client()
        .post(format!("{}/v1/chat/completions", s.url))
        .json(&json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "stream": true,
                      "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 6, "{text}"); // role, 3 tokens, usage, [DONE]
    assert_eq!(events[5], "data: [DONE]");
    let chunk = |i: usize| serde_json::from_str::<Value>(events[i].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(chunk(0)["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunk(3)["choices"][0]["finish_reason"], "length");
    assert_eq!(chunk(4)["usage"]["completion_tokens"], 3);
    assert!(chunk(1)["object"] == "chat.completion.chunk");

    let (_, full) = s.post("/v1/completions", &json!({"prompt": "hello", "max_tokens": 3})).await;
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["choices"][0]["finish_reason"], "length");
    let m = s.metrics().await;
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
        "vllm:time_to_first_token_seconds_count{",
    ] {
        assert!(m.contains(name), "{name} missing");
    }
    assert!(m.contains("vllm:time_to_first_token_seconds_count{model_name=\"tiny\""));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_injection_at_start_and_at_runtime() {
    let mut s = Sim::start(&["--error-rate", "1"]).await;
    let body = json!({"prompt": "x", "max_tokens": 1});
    let (status, err) = s.post("/v1/completions", &body).await;
    assert_eq!((status, err["error"]["code"].clone()), (500, json!(500)));
    let (status, _) = s.post("/admin/faults", &json!({"error_rate": 0.0, "delay_ms": 300})).await;
    assert_eq!(status, 200);
    let t = Instant::now();
    assert_eq!(s.post("/v1/completions", &body).await.0, 200);
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert_eq!(s.post("/admin/faults", &json!({"error_rate": 3.0})).await.0, 400);
    assert_eq!(s.post("/admin/faults", &json!({"delay_ms": 0, "hang": true})).await.0, 200);
    let hung = common::client()
        .post(format!("{}/v1/completions", s.url))
        .timeout(Duration::from_millis(300))
        .json(&body)
        .send()
        .await;
    assert!(hung.is_err_and(|e| e.is_timeout()));
    assert_eq!(s.post("/admin/faults", &json!({"hang": false})).await.0, 200);
    assert_eq!(s.post("/v1/completions", &body).await.0, 200);
    let _ = common::client().post(format!("{}/admin/faults", s.url)).json(&json!({"crash": true})).send().await;
    assert!(s.exited_within(Duration::from_secs(5)).await, "crash injection ends the process");
}

/// vLLM's render endpoints: the token ids the engine would run, without running anything
/// (vllm-router's cache-aware policy routes on them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn render_endpoints_return_the_token_ids_the_engine_would_run() {
    let s = Sim::start(&["--max-model-len", "64"]).await;
    let generations = || async {
        let text = common::client().get(format!("{}/metrics", s.url)).send().await.unwrap().text().await.unwrap();
        text.lines()
            .filter(|l| l.starts_with("vllm:request_success"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let prompt = "the quick brown fox jumps over the lazy dog";
    let (status, rendered) = s.post("/v1/completions/render", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(status, 200, "{rendered}");
    let list = rendered.as_array().expect("completions render answers a list (one per prompt)");
    assert_eq!(list.len(), 1, "{rendered}");
    let ids: Vec<u64> = list[0]["token_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    assert_eq!(list[0]["sampling_params"]["max_tokens"], 4);
    assert!(list[0]["request_id"].as_str().unwrap().starts_with("cmpl-"), "{rendered}");
    assert_eq!(generations().await, 0.0, "rendering generates nothing");

    let (status, done) = s.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(status, 200, "{done}");
    assert_eq!(done["usage"]["prompt_tokens"], json!(ids.len()), "render and generation tokenize alike");
    // Token ids given as the prompt come back as they are.
    let (_, again) = s.post("/v1/completions/render", &json!({"prompt": ids, "max_tokens": 1})).await;
    assert_eq!(again[0]["token_ids"], json!(ids));

    let chat = json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 2});
    let (status, rendered) = s.post("/v1/chat/completions/render", &chat).await;
    assert_eq!(status, 200, "{rendered}");
    assert!(rendered.is_object(), "chat render answers one object: {rendered}");
    assert!(rendered["request_id"].as_str().unwrap().starts_with("chatcmpl-"), "{rendered}");
    let (_, done) = s.post("/v1/chat/completions", &chat).await;
    assert_eq!(json!(rendered["token_ids"].as_array().unwrap().len()), done["usage"]["prompt_tokens"]);

    // Errors as for generation.
    let (status, _) = s.post("/v1/completions/render", &json!({"prompt": "x", "model": "other"})).await;
    assert_eq!(status, 404);
    let (status, err) = s.post("/v1/completions/render", &json!({"prompt": "x", "max_tokens": 100})).await;
    assert_eq!((status, err["error"]["code"].clone()), (400, json!(400)), "over the context length: {err}");
    let (status, _) = s.post("/v1/chat/completions/render", &json!({"messages": "hi"})).await;
    assert_eq!(status, 400);
    assert_eq!(generations().await, 2.0, "only the two generations counted");
}

/// A simulator whose port is taken exits at once, the harness says so without waiting out its
/// bound, and a start on drawn ports retries on fresh ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_reported_at_once_and_retried() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let mut child = harness::command(std::path::Path::new(env!("CARGO_BIN_EXE_pd-sim")), port, "off")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = Instant::now();
    let outcome = harness::healthy(&mut child, &format!("http://127.0.0.1:{port}"), WAIT).await;
    assert!(matches!(outcome, Err(harness::NotHealthy::Exited(status)) if !status.success()), "{outcome:?}");
    assert!(started.elapsed() < WAIT / 2, "seen after {:?}", started.elapsed());
    // The first draw is the taken port; the retry draws a free one.
    let mut ports = [port, free_port()].into_iter();
    let sim = harness::start_with_retries("pd-sim", || Sim::try_start_on(ports.next().unwrap(), &[])).await;
    assert_ne!(sim.port, port);
    drop(taken);
}

/// With `--prefill-queue fifo` an engine computes one prompt at a time: five distinct 100-token
/// prompts sent at once (100 ms each at 1 ms a token) come back about 100 ms apart, the last
/// after 500 ms. Without the queue (the default) each takes its own 100 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_prefill_queue_computes_one_prompt_at_a_time() {
    async fn slowest(args: &[&str]) -> Duration {
        let s = Sim::start(&[&["--prefill-us-per-token", "1000"], args].concat()).await;
        let url = format!("{}/v1/completions", s.url);
        let sent = Instant::now();
        let answers = (0..5).map(|i| {
            let url = url.clone();
            async move {
                let body = json!({"prompt": common::words(100, &format!("q{i}w")), "max_tokens": 1});
                let (status, answer) = common::post(&url, &body).await;
                assert_eq!(status, 200, "{answer}");
                sent.elapsed()
            }
        });
        futures_util::future::join_all(answers).await.into_iter().max().unwrap()
    }
    let queued = slowest(&["--prefill-queue", "fifo"]).await;
    let side_by_side = slowest(&[]).await;
    assert!(queued >= Duration::from_millis(500), "five 100 ms prompts one after another took {queued:?}");
    assert!(side_by_side < Duration::from_millis(400), "five 100 ms prompts side by side took {side_by_side:?}");
}
