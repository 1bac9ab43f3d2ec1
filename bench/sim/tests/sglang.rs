//! SGLang-style P/D: the same body goes to prefill and decode at once; they pair by room.

mod common;

use std::time::{Duration, Instant};

use common::{free_port, words, Sim};
use serde_json::{json, Value};

async fn pair(timeout_secs: &str) -> (Sim, Sim, u16) {
    let bport = free_port();
    let p = Sim::start(&[
        "--role",
        "prefill",
        "--bootstrap-port",
        &bport.to_string(),
        "--bootstrap-timeout-secs",
        timeout_secs,
    ])
    .await;
    let d =
        Sim::start(&["--role", "decode", "--bootstrap-timeout-secs", timeout_secs, "--kv-load-failure-policy", "fail"])
            .await;
    (p, d, bport)
}

fn body(prompt: &str, bport: u16, room: i64) -> Value {
    json!({"prompt": prompt, "max_tokens": 3, "bootstrap_host": "127.0.0.1", "bootstrap_port": bport, "bootstrap_room": room})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_legs_pair_by_room_and_release() {
    let (p, d, bport) = pair("5").await;
    let prompt = words(50, "sg");
    let b = body(&prompt, bport, 4_611_686_018_427_387_904);
    let (pre, dec) = tokio::join!(p.post("/v1/completions", &b), d.post("/v1/completions", &b));
    assert_eq!(pre.0, 200, "{}", pre.1);
    assert_eq!(dec.0, 200, "{}", dec.1);
    assert_eq!(dec.1["usage"]["completion_tokens"], 3);
    let dl = d.leaks().await;
    assert_eq!(
        (dl["pulls"].clone(), dl["bytes_pulled"].clone(), dl["used_blocks"].clone()),
        (json!(1), json!(4 * 16 * 256), json!(0))
    );
    let pl = p.leaks().await;
    assert_eq!(
        (pl["active_rooms"].clone(), pl["held_blocks"].clone(), pl["used_blocks"].clone()),
        (json!(0), json!(0), json!(0))
    );

    // Decode first, prefill later: the decode waits for the room.
    let b = body(&words(20, "late"), bport, 7);
    let dec = tokio::spawn({
        let url = format!("{}/v1/completions", d.url);
        let b = b.clone();
        async move { common::post(&url, &b).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(p.post("/v1/completions", &b).await.0, 200);
    assert_eq!(dec.await.unwrap().0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_releases_after_timeout_and_rejects_duplicate_rooms() {
    let (p, _d, bport) = pair("0.5").await;
    let b = body(&words(30, "lonely"), bport, 42);
    let first = tokio::spawn({
        let url = format!("{}/v1/completions", p.url);
        let b = b.clone();
        async move { common::post(&url, &b).await }
    });
    p.leaks_until("room held", |r| r["active_rooms"] == 1).await;
    let (status, dup) = p.post("/v1/completions", &b).await;
    assert_eq!(status, 400, "{dup}");
    assert_eq!(dup["error"]["param"], "bootstrap_room");
    let started = Instant::now();
    let (status, err) = first.await.unwrap();
    assert_eq!(status, 500, "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));
    let r = p.leaks().await;
    assert_eq!((r["rooms_timed_out"].clone(), r["rooms_rejected"].clone()), (json!(1), json!(1)));
    assert_eq!(
        (r["active_rooms"].clone(), r["held_blocks"].clone(), r["used_blocks"].clone()),
        (json!(0), json!(0), json!(0))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_without_prefill_times_out() {
    let (_p, d, bport) = pair("0.3").await;
    let (status, err) = d.post("/v1/completions", &body("no prefill here", bport, 9)).await;
    assert_eq!(status, 500, "{err}");
    let r = d.leaks().await;
    assert_eq!((r["active_rooms"].clone(), r["used_blocks"].clone()), (json!(0), json!(0)));
}
