//! vLLM-style P/D between two simulator processes: the test is the proxy doing the two calls.

mod common;

use std::time::{Duration, Instant};

use common::{prefill_body, words, Sim};
use serde_json::{json, Value};

const KEYS_032: [&str; 14] = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
];

async fn prefill(p: &Sim, prompt: &str) -> Value {
    let (status, body) = p.post("/v1/completions", &prefill_body(prompt)).await;
    assert_eq!(status, 200, "{body}");
    body["kv_transfer_params"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_moves_verified_blocks_and_frees_the_prefill() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--kv-load-failure-policy", "fail"]).await;
    let prompt = words(100, "pd"); // 100 tokens: 6 full blocks of 16 + a partial one

    // The prefill's answer, shaped like vLLM 0.32's (keys in order, ids as one group).
    let raw = common::client()
        .post(format!("{}/v1/completions", p.url))
        .json(&prefill_body(&prompt))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let kv_start = raw.find("\"kv_transfer_params\":").unwrap();
    let mut last = kv_start;
    for key in KEYS_032 {
        let at = raw[kv_start..].find(&format!("\"{key}\":")).map(|i| i + kv_start).unwrap_or_else(|| panic!("{key}"));
        assert!(at > last || key == KEYS_032[0], "{key} out of order in {raw}");
        last = at;
    }
    let kv: Value = serde_json::from_str::<Value>(&raw).unwrap()["kv_transfer_params"].clone();
    assert_eq!(kv["remote_block_ids"][0].as_array().unwrap().len(), 7);
    assert_eq!((kv["remote_num_tokens"].clone(), kv["transfer_mode"].clone()), (json!(100), json!("pull")));
    assert!(kv["remote_request_id"].as_str().unwrap().starts_with("cmpl-"));
    let held = p.leaks().await;
    assert_eq!((held["held_blocks"].clone(), held["active_leases"].clone()), (json!(7), json!(1)));

    // The decode call: the client's body plus the params, verbatim.
    let (status, out) =
        d.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(
        out["usage"],
        json!({"prompt_tokens": 100, "total_tokens": 104, "completion_tokens": 4, "prompt_tokens_details": null})
    );
    assert!(out["kv_transfer_params"].is_null());
    let dl = d.leaks().await;
    assert_eq!((dl["pulls"].clone(), dl["bytes_pulled"].clone()), (json!(1), json!(7 * 16 * 256)));
    assert_eq!((dl["verification_failures"].clone(), dl["recomputed"].clone()), (json!(0), json!(0)));
    assert_eq!(dl["used_blocks"], json!(0));
    let metrics = d.metrics().await;
    assert!(metrics.contains("source=\"external_kv_transfer\"} 100\n"), "{metrics}");

    // The decode's "done" notification frees the prefill's blocks.
    let pl = p.leaks_until("prefill releases", |r| r["held_blocks"] == 0 && r["used_blocks"] == 0).await;
    assert_eq!((pl["leases_done"].clone(), pl["expired_leases"].clone()), (json!(1), json!(0)));

    // Same text as a plain request to a single engine.
    let (_, plain) = p.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(plain["choices"][0]["text"], out["choices"][0]["text"]);

    // Chat goes the same way.
    let messages = json!([{"role": "user", "content": words(40, "chat")}]);
    let (status, pre) = p
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 1,
               "kv_transfer_params": pd_protocols::kv_params::prefill_request()}),
        )
        .await;
    assert_eq!(status, 200, "{pre}");
    let (status, chat) = d
        .post(
            "/v1/chat/completions",
            &json!({"messages": messages, "max_tokens": 3,
               "kv_transfer_params": pre["kv_transfer_params"]}),
        )
        .await;
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(d.leaks().await["pulls"], json!(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_blocks_fail_verification_then_fail_or_recompute() {
    let p = Sim::start(&["--kv-lease-secs", "5"]).await;
    let strict = Sim::start(&["--kv-load-failure-policy", "fail"]).await;
    let lenient = Sim::start(&["--kv-load-failure-policy", "recompute"]).await;
    let prompt = words(64, "v");
    let mut kv = prefill(&p, &prompt).await;
    // Point at the right blocks in the wrong order: the bytes arrive, the content is wrong.
    let mut ids = kv["remote_block_ids"][0].as_array().unwrap().clone();
    ids.reverse();
    kv["remote_block_ids"] = json!([ids]);

    let body = json!({"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kv});
    let (status, err) = strict.post("/v1/completions", &body).await;
    assert_eq!(status, 500, "{err}");
    assert_eq!(err["error"]["code"], 500);
    assert!(err["error"]["message"].as_str().unwrap().contains("expected content"), "{err}");
    let (status, ok) = lenient.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{ok}");
    for (sim, recomputed) in [(&strict, 0), (&lenient, 1)] {
        let r = sim.leaks().await;
        assert_eq!((r["verification_failures"].clone(), r["recomputed"].clone()), (json!(1), json!(recomputed)));
        assert_eq!(r["used_blocks"], 0, "nothing leaked: {r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expires_when_no_decode_comes() {
    let p = Sim::start(&["--kv-lease-secs", "0.5"]).await;
    let started = Instant::now();
    prefill(&p, &words(40, "x")).await;
    // The expiry is counted under the pool's lock; the blocks return to the pool just after,
    // once the grant is revoked, so wait for both.
    let r = p.leaks_until("lease expiry", |r| r["expired_leases"] == 1 && r["used_blocks"] == 0).await;
    assert!(started.elapsed() >= Duration::from_millis(450));
    assert_eq!((r["held_blocks"].clone(), r["active_leases"].clone()), (json!(0), json!(0)));
    assert!(p.metrics().await.contains("vllm:nixl_num_kv_expired_reqs_total{"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_lease_while_the_decode_queues() {
    // The lease alone (1 s) is shorter than the decode's queue wait (~2 s): only heartbeats
    // (every 0.2 s, each extending it by 1 s) keep the blocks.
    let p = Sim::start(&["--kv-lease-secs", "1", "--heartbeat-extension-secs", "1"]).await;
    let d = Sim::start(&[
        "--max-running",
        "1",
        "--decode-us-per-token",
        "100000",
        "--heartbeat-interval-secs",
        "0.2",
        "--kv-load-failure-policy",
        "fail",
    ])
    .await;
    let busy_url = format!("{}/v1/completions", d.url);
    let busy =
        tokio::spawn(async move { common::post(&busy_url, &json!({"prompt": "occupy", "max_tokens": 20})).await });
    d.leaks_until("the decode to be busy", |r| r["running"] == 1).await;
    let prompt = words(40, "hb");
    let kv = prefill(&p, &prompt).await;
    let started = Instant::now();
    let (status, out) =
        d.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv})).await;
    assert_eq!(status, 200, "{out}");
    assert!(started.elapsed() > Duration::from_millis(1200), "the decode did queue");
    assert_eq!(busy.await.unwrap().0, 200);
    let pl = p.leaks_until("prefill released", |r| r["held_blocks"] == 0).await;
    assert_eq!((pl["expired_leases"].clone(), pl["leases_done"].clone()), (json!(0), json!(1)), "{pl}");
    assert!(pl["heartbeats_received"].as_u64().unwrap() >= 3, "{pl}");
    let dl = d.leaks().await;
    assert_eq!((dl["pulls"].clone(), dl["verification_failures"].clone()), (json!(1), json!(0)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_params_recompute_and_are_counted() {
    let d = Sim::start(&[]).await;
    for kv in [json!({"do_remote_prefill": true}), json!({"do_remote_prefill": true, "remote_port": "x"})] {
        let (status, out) = d.post("/v1/completions", &json!({"prompt": "a b c", "kv_transfer_params": kv})).await;
        assert_eq!(status, 200, "{out}");
    }
    let r = d.leaks().await;
    assert_eq!((r["invalid_params"].clone(), r["pulls"].clone()), (json!(2), json!(0)));
    // An unreachable prefill is a failed pull, recomputed under the default policy.
    let kv = json!({"do_remote_prefill": true, "remote_block_ids": [[0]], "remote_engine_id": "gone",
                    "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": common::free_port()});
    let (status, _) = d.post("/v1/completions", &json!({"prompt": "a b c", "kv_transfer_params": kv})).await;
    assert_eq!(status, 200);
    assert_eq!(d.leaks().await["recomputed"], json!(1));
}
