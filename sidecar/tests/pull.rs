//! Sidecar-pull mode: the sidecar's own xfer agent moves the prompt's blocks from the prefill
//! engine into the local engine's shared-memory pool; the decode adopts them (verified byte for
//! byte by the simulator) without pulling itself.

mod common;

use std::time::Duration;

use common::{post_text, sse_text, words, Sidecar, Sim};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_pulls_and_the_engine_adopts() {
    let path = std::env::temp_dir().join(format!("pd-sidecar-pull-{}", std::process::id()));
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--shm-path", path.to_str().unwrap(), "--kv-load-failure-policy", "fail"]).await;
    let single = Sim::start(&[]).await;
    let s =
        Sidecar::start(&["--mode", "pull", "--engine", &d.url, "--prefill", &p.addr(), "--xfer-listen", "127.0.0.1:0"])
            .await;

    let body = json!({"prompt": words(100, "pull"), "max_tokens": 4});
    let (status, out) = s.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    let direct = common::post(&format!("{}/v1/completions", single.url), &body).await.1;
    assert_eq!(out["choices"][0]["text"], direct["choices"][0]["text"]);
    let chat = json!({"messages": [{"role": "user", "content": words(64, "pc")}], "max_tokens": 3, "stream": true});
    let (status, text) = post_text(&format!("{}/v1/chat/completions", s.url), &chat, &[]).await;
    assert_eq!(status, 200, "{text}");
    let (_, direct) = post_text(&format!("{}/v1/chat/completions", single.url), &chat, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&direct));

    let dl = d.leaks().await;
    // The engine pulled nothing itself, verified every preloaded block, recomputed nothing.
    assert_eq!(
        (dl["pulls"].clone(), dl["verification_failures"].clone(), dl["recomputed"].clone(), dl["used_blocks"].clone()),
        (json!(0), json!(0), json!(0), json!(0)),
        "{dl}"
    );
    let transferred: f64 = d
        .metrics()
        .await
        .lines()
        .find(|l| l.starts_with("vllm:prompt_tokens_by_source_total") && l.contains("external_kv_transfer"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap();
    assert!(transferred > 100.0, "both prompts arrived through the sidecar: {transferred}");
    p.leaks_until("prefill freed by the sidecar's notification", Duration::from_secs(1), |r| r["held_blocks"] == 0)
        .await;
    let m = s.metrics().await;
    assert_eq!(common::metric(&m, "pd_sidecar_pulls_ok_total"), 2.0);
    assert_eq!(common::metric(&m, "pd_sidecar_pulls_failed_total"), 0.0);
    assert!(common::metric(&m, "pd_sidecar_pull_bytes_total") >= (7 * 16 * 256) as f64);

    // An engine without a shared pool: the sidecar falls back to the engine's own pull.
    let plain = Sim::start(&["--kv-load-failure-policy", "fail"]).await;
    let s2 = Sidecar::start(&["--mode", "pull", "--engine", &plain.url, "--prefill", &p.addr()]).await;
    let (status, out) = s2.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(plain.leaks().await["pulls"], 1);
    drop(d);
    let _ = std::fs::remove_file(&path);
}
