//! Cancellation: clients that leave (during the prefill, between the legs, mid-stream) leave
//! nothing held on the prefill: after a storm of disconnects its held-block count is back to 0
//! within 1 s, far from the 30 s lease. Also `POST /pd/release`.

mod common;

use std::time::{Duration, Instant};

use common::{words, Sidecar, Sim};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_storm_of_disconnects_leaves_no_blocks_held() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&[]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr()]).await;
    // The decode is slow to answer, so clients give up between the legs; some leave earlier.
    d.faults(json!({"delay_ms": 300})).await;
    const N: usize = 48;
    let clients = (0..N).map(|i| {
        let url = format!("{}/v1/completions", s.url);
        let stream = i % 3 == 0;
        async move {
            let give_up = Duration::from_millis(if i % 8 == 0 { 2 } else { 40 + (i as u64 * 7) % 120 });
            let c = reqwest::Client::builder().timeout(give_up).build().unwrap();
            let body = json!({"prompt": words(50, &format!("storm{i}x")), "max_tokens": 8, "stream": stream});
            c.post(url).json(&body).send().await.is_err()
        }
    });
    let gave_up = futures_util::future::join_all(clients).await;
    assert!(gave_up.iter().all(|&g| g), "every client left before its answer");
    let storm_over = Instant::now();
    let report = p.leaks_until("prefill blocks back to 0", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
    let took = storm_over.elapsed();
    assert_eq!(report["expired_leases"], 0, "{report}");
    eprintln!("held blocks back to 0 {took:?} after the storm; {report}");
    // The sidecar counted each request that reached it as cancelled (clients that left
    // within 2 ms may not have), and released every lease the prefill started.
    let leases = report["leases_started"].as_f64().unwrap();
    assert!(leases >= (N / 2) as f64, "{report}");
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let m = s.metrics().await;
        let cancelled = common::metric(&m, "pd_sidecar_requests_total{outcome=\"cancelled\"}");
        let in_flight = common::metric(&m, "pd_sidecar_in_flight");
        let released = common::metric(&m, "pd_sidecar_releases_ok_total");
        if cancelled >= leases && in_flight == 0.0 && released == leases {
            assert_eq!(common::metric(&m, "pd_sidecar_requests_total{outcome=\"ok\"}"), 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "{m}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The decode engine ends up idle too (cancelled decodes and releases done).
    d.faults(json!({"delay_ms": 0})).await;
    d.leaks_until("decode idle", Duration::from_secs(2), |r| r["running"] == 0 && r["used_blocks"] == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pd_release_frees_blocks_named_by_params() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&[]).await;
    // What a coordinator holds: the prefill's answer for a decode that died.
    let prefill_body = json!({"prompt": words(70, "orphan"), "max_tokens": 1, "stream": false,
        "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                               "remote_block_ids": null, "remote_host": null, "remote_port": null}});
    for method in ["decode", "xfer"] {
        let s = Sidecar::start(&["--engine", &d.url, "--release-method", method]).await;
        let (status, held) = common::post(&format!("{}/v1/completions", p.url), &prefill_body).await;
        assert_eq!(status, 200);
        assert_eq!(p.leaks().await["held_blocks"], 5);
        let started = Instant::now();
        let (status, out) = s
            .post("/pd/release", &json!({"request_id": "orphan-1", "kv_transfer_params": held["kv_transfer_params"]}))
            .await;
        assert_eq!((status, out["method"].as_str()), (200, Some(method)), "{out}");
        p.leaks_until("released", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
        assert!(started.elapsed() < Duration::from_secs(1));
        let (status, _) = s.post("/pd/release", &json!({"request_id": "x"})).await;
        assert_eq!(status, 400);
    }
    assert_eq!(p.leaks().await["expired_leases"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_the_prefill_strands_nothing() {
    leave_during_the_prefill(&[], 0.0).await;
}

/// The same with every body counted as large (`--offload-body-bytes 0`): four of the eight
/// requests run off the runtime (as many as it allows at once), and are dropped there when
/// their clients leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_during_an_offloaded_prefill_strands_nothing() {
    leave_during_the_prefill(&["--offload-body-bytes", "0"], 4.0).await;
}

async fn leave_during_the_prefill(flags: &[&str], offloaded: f64) {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&[]).await;
    let prefill = p.addr();
    let args: Vec<&str> =
        ["--engine", d.url.as_str(), "--prefill", prefill.as_str()].into_iter().chain(flags.iter().copied()).collect();
    let s = Sidecar::start(&args).await;
    // The prefill answers after 500 ms; the clients leave once the sidecar has all eight in
    // hand, mid-prefill (a fixed 50 ms client timeout left before the sidecar read them under
    // load, once: no prefill started).
    p.faults(json!({"delay_ms": 500})).await;
    let clients: Vec<_> = (0..8)
        .map(|i| {
            let url = format!("{}/v1/completions", s.url);
            let body = json!({"prompt": words(40, &format!("mid{i}x")), "max_tokens": 4});
            tokio::spawn(async move { reqwest::Client::new().post(url).json(&body).send().await })
        })
        .collect();
    common::eventually("the sidecar holds the eight requests", || async {
        (s.metric("pd_sidecar_in_flight").await == 8.0).then_some(())
    })
    .await;
    assert_eq!(s.metric("pd_sidecar_offloaded_total").await, offloaded);
    tokio::time::sleep(Duration::from_millis(50)).await;
    for client in &clients {
        client.abort();
    }
    for client in clients {
        assert!(client.await.is_err_and(|e| e.is_cancelled()), "a client got its answer before it left");
    }
    // The prefills complete anyway and hold blocks; the sidecar releases each one.
    let report = p
        .leaks_until("leases started and released", Duration::from_secs(2), |r| {
            r["leases_started"] == 8 && r["held_blocks"] == 0
        })
        .await;
    assert_eq!(report["expired_leases"], 0);
    // The sidecar counts a release when its one-token decode answers, which may be after the
    // prefill already freed the blocks (once read 7 of 8 here).
    common::eventually("the sidecar counted the releases", || async {
        (s.metric("pd_sidecar_releases_ok_total").await == 8.0).then_some(())
    })
    .await;
    assert_eq!(d.leaks().await["pulls"], 8, "each release was a one-token decode that pulled");
}
