//! A request with a large body runs off the runtime thread (`--offload-body-bytes`): while the
//! sidecar reads, parses and rewrites a long prompt, its other requests are still answered.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Sidecar;
use serde_json::{json, Value};

/// A 36 MB prompt through a P/D handoff, with `/health` asked every 2 ms meanwhile: with the
/// flow on the runtime (a threshold no body reaches), off it (the default), and off it when the
/// body comes in chunks with no length. The longest `/health` wait while the prompt is
/// handled must be well under the inline one each time, and both engines must get the prompt
/// whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_does_not_hold_up_other_requests() {
    let ((prefill, prefill_seen), (decode, decode_seen)) = common::fake_handoff_engines().await;
    let prompt = "lorem ipsum ".repeat(3 << 20);
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2}).to_string();

    let mut worst = Vec::new();
    for (threshold, sent_as, offloaded) in
        [("1000000000000", Sent::WithLength, 0.0), ("262144", Sent::WithLength, 1.0), ("262144", Sent::InChunks, 1.0)]
    {
        let s = Sidecar::start(&["--engine", &decode, "--prefill", &prefill, "--offload-body-bytes", threshold]).await;
        worst.push(longest_health_wait(&s, body.clone(), sent_as).await);
        assert_eq!(s.metric("pd_sidecar_offloaded_total").await, offloaded, "threshold {threshold}, {sent_as:?}");
        for (engine, seen) in [("prefill", &prefill_seen), ("decode", &decode_seen)] {
            let last = seen.lock().unwrap().pop().unwrap_or_else(|| panic!("the {engine} engine was not called"));
            let sent: Value = serde_json::from_slice(&last.body).unwrap();
            assert!(sent["prompt"].as_str() == Some(prompt.as_str()), "the {engine} engine got the prompt whole");
        }
    }
    let (inline, offloaded, chunked) = (worst[0], worst[1], worst[2]);
    eprintln!(
        "longest /health wait during a 36 MB prompt: inline {inline:?}, offloaded {offloaded:?}, sent in chunks \
         {chunked:?}"
    );
    assert!(offloaded * 2 < inline, "offloaded {offloaded:?} against inline {inline:?}");
    assert!(chunked * 2 < inline, "sent in chunks {chunked:?} against inline {inline:?}");
}

#[derive(Debug, Clone, Copy)]
enum Sent {
    WithLength,
    /// Chunked transfer encoding, no `Content-Length`.
    InChunks,
}

/// Posts `body` as a completion and asks `/health` every 2 ms until it is answered; returns
/// the longest `/health` took.
async fn longest_health_wait(s: &Sidecar, body: String, sent_as: Sent) -> Duration {
    let client = common::client();
    let done = Arc::new(AtomicBool::new(false));
    let prober = {
        let (client, url, done) = (client.clone(), format!("{}/health", s.url), Arc::clone(&done));
        tokio::spawn(async move {
            let mut longest = Duration::ZERO;
            while !done.load(Ordering::Relaxed) {
                let asked = Instant::now();
                let r = client.get(&url).timeout(Duration::from_secs(10)).send().await.unwrap();
                assert_eq!(r.status(), 200);
                longest = longest.max(asked.elapsed());
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            longest
        })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let r = client
        .post(format!("{}/v1/completions", s.url))
        .header("content-type", "application/json")
        .body(match sent_as {
            Sent::WithLength => reqwest::Body::from(body),
            Sent::InChunks => {
                let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
                    body.into_bytes().chunks(1 << 20).map(|c| Ok(c.to_vec())).collect();
                reqwest::Body::wrap_stream(futures_util::stream::iter(chunks))
            }
        })
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert_eq!(status, 200, "{text}");
    done.store(true, Ordering::Relaxed);
    prober.await.unwrap()
}
