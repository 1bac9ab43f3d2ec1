//! Shutdown: on SIGTERM the sidecar stops accepting, lets the streams in flight finish, and
//! exits.

mod common;

use std::time::{Duration, Instant};

use common::{words, Sidecar, Sim};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_streams_in_flight() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--decode-us-per-token", "100000"]).await;
    let mut s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr(), "--drain-timeout", "5s"]).await;
    let url = format!("{}/v1/completions", s.url);
    let stream = tokio::spawn(async move {
        common::post_text(&url, &json!({"prompt": words(20, "drain"), "max_tokens": 6, "stream": true}), &[]).await
    });
    tokio::time::sleep(Duration::from_millis(250)).await;
    let started = Instant::now();
    let status = std::process::Command::new("kill").args(["-TERM", &s.pid().to_string()]).status().unwrap();
    assert!(status.success());
    let (code, text) = stream.await.unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        common::sse_events(&text).last().map(String::as_str),
        Some("[DONE]"),
        "the stream ran to its end: {text}"
    );
    assert!(s.exited_within(Duration::from_secs(3)).await, "the sidecar exited after draining");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(common::client().get(format!("{}/health", s.url)).send().await.is_err(), "no longer listening");
}
