//! Grants through the sidecar flow: a decode sidecar that knows its engine's xfer agent
//! (`--engine-xfer-agent`) names it in the prefill call, so the pd-sim prefill grants that agent
//! alone the held blocks and the decode reads under the grant. A decode that reads after the
//! prefill ended the lease is refused, and recomputes or fails by its `--late-read-policy`.

mod common;

use std::time::Duration;

use common::{post, words, Sidecar, Sim};
use serde_json::{json, Value};

/// A prefill lease shorter than the decode's injected delay, so the decode reads late.
const SHORT_LEASE: &str = "0.3s";
const LATE_MS: u64 = 900;

fn counts(report: &Value, keys: &[&str]) -> Vec<Value> {
    keys.iter().map(|k| report[*k].clone()).collect()
}

/// The answer a single engine computes for the prompt on its own.
async fn direct_text(sim: &Sim, body: &Value) -> Value {
    let (status, out) = post(&format!("{}/v1/completions", sim.url), body).await;
    assert_eq!(status, 200, "{out}");
    out["choices"][0]["text"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_read_through_the_sidecar_is_under_a_grant() {
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--engine-id", "decode-sg1", "--kv-load-failure-policy", "fail"]).await;
    let s = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr(), "--engine-xfer-agent", "decode-sg1"]).await;

    let requests = 4;
    for i in 0..requests {
        let body = json!({"prompt": words(60 + 10 * i, &format!("gr{i}")), "max_tokens": 4});
        let (status, out) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["choices"][0]["text"], direct_text(&p, &body).await, "request {i}");
    }
    let dl = d.leaks().await;
    assert_eq!(
        counts(&dl, &["pulls", "granted_pulls", "late_reads_refused", "recomputed", "verification_failures"]),
        [json!(requests), json!(requests), json!(0), json!(0), json!(0)],
        "{dl}"
    );
    let pl = p
        .leaks_until("the prefill released every lease", Duration::from_secs(5), |r| {
            r["held_blocks"] == 0 && r["grants_revoked"] == requests
        })
        .await;
    assert_eq!(pl["grants_issued"], requests, "one grant per held prompt: {pl}");
    assert!(d.metrics().await.contains("pdsim:granted_pulls_total{"), "the count is a metric");

    // Without the flag the prefill call names no reader: no grant, an unfenced read.
    let plain = Sidecar::start(&["--engine", &d.url, "--prefill", &p.addr()]).await;
    let (status, out) = plain.post("/v1/completions", &json!({"prompt": words(50, "plain"), "max_tokens": 2})).await;
    assert_eq!(status, 200, "{out}");
    let dl = d.leaks().await;
    assert_eq!(counts(&dl, &["pulls", "granted_pulls"]), [json!(requests + 1), json!(requests)], "{dl}");
    assert_eq!(p.leaks().await["grants_issued"], requests);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_read_after_the_prefill_released_is_refused_and_handled_by_policy() {
    let p = Sim::start(&["--kv-lease-secs", SHORT_LEASE]).await;
    let recompute = Sim::start(&["--engine-id", "decode-sg2", "--kv-load-failure-policy", "fail"]).await;
    let fail = Sim::start(&["--engine-id", "decode-sg2f", "--late-read-policy", "fail"]).await;
    let body = json!({"prompt": words(100, "late"), "max_tokens": 4});
    let right = direct_text(&p, &body).await;

    for (d, agent) in [(&recompute, "decode-sg2"), (&fail, "decode-sg2f")] {
        // The decode starts only after the prefill's lease ended and its grant was revoked.
        d.faults(json!({"delay_ms": LATE_MS})).await;
        // After the decode's error the sidecar frees the prefill's blocks with the done
        // notification (not a second, equally late decode call the counts would include).
        let s = Sidecar::start(&[
            "--engine",
            &d.url,
            "--prefill",
            &p.addr(),
            "--engine-xfer-agent",
            agent,
            "--release-method",
            "sim-xfer",
            "--xfer-listen",
            "127.0.0.1:0",
        ])
        .await;
        let (status, out) = s.post("/v1/completions", &body).await;
        let dl = d.leaks().await;
        assert_eq!(
            counts(&dl, &["late_reads_refused", "granted_pulls", "verification_failures"]),
            [json!(1), json!(0), json!(0)],
            "{agent}: refused before any byte moved: {dl}"
        );
        if agent == "decode-sg2" {
            assert_eq!((status, out["choices"][0]["text"].clone()), (200, right.clone()), "recomputed: {out}");
            assert_eq!(dl["recomputed"], 1);
        } else {
            assert_eq!(status, 500, "{out}");
            assert!(out["error"]["message"].as_str().is_some_and(|m| m.contains("revoked")), "a clear error: {out}");
            assert!(out.get("choices").is_none(), "no tokens at all: {out}");
            assert_eq!(dl["recomputed"], 0);
        }
        assert_eq!(dl["used_blocks"], 0, "{dl}");
    }
    let pl = p.leaks_until("both leases ended", Duration::from_secs(5), |r| r["active_leases"] == 0).await;
    assert_eq!(
        counts(&pl, &["grants_issued", "grants_revoked", "expired_leases"]),
        [json!(2), json!(2), json!(2)],
        "{pl}"
    );
}

/// A decode that fails after its prefill computed the prompt: its sidecar reports the request
/// failed, and the coordinator frees the prefill's blocks (revoking their grant) through the
/// prefill's sidecar at once, not when the prefill's 30 s lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_has_the_coordinator_release_the_prefills_blocks() {
    let coordinator = common::Coordinator::start(&["--heartbeat-ms", "200ms"]).await;
    let url = coordinator.url.clone();
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--engine-id", "dec-g"]).await;
    let sidecar_args = |id: &str, role: &str, engine: &str, extra: &[&str]| -> Vec<String> {
        let base = ["--engine", engine, "--coordinator", &url, "--engine-id", id, "--role", role];
        let more = ["--model", "sim-model", "--node", "local"];
        base.iter().chain(&more).chain(extra).map(|s| s.to_string()).collect()
    };
    let port = common::free_port();
    let advertise = format!("http://127.0.0.1:{port}");
    let pa = sidecar_args("pre-g", "prefill", &p.url, &["--advertise-url", &advertise]);
    let _ps = Sidecar::start_on(port, &pa.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let da = sidecar_args("dec-g", "decode", &d.url, &["--engine-xfer-agent", "dec-g", "--release-method", "decode"]);
    let ds = Sidecar::start(&da.iter().map(String::as_str).collect::<Vec<_>>()).await;
    common::eventually("both registered", || async {
        let v = common::client().get(format!("{url}/v1/engines")).send().await.ok()?.json::<Value>().await.ok()?;
        (v.as_array()?.len() == 2).then_some(())
    })
    .await;

    // The decode engine fails every call, the sidecar's own release (a decode call) included.
    d.faults(json!({"error_rate": 1.0})).await;
    let (status, out) =
        ds.post("/v1/completions", &json!({"model": "sim-model", "prompt": words(64, "dies"), "max_tokens": 3})).await;
    assert_eq!(status, 500, "{out}");
    assert_eq!(p.leaks().await["grants_issued"], 1, "the prefill granted the decode its blocks");
    let pl = p
        .leaks_until("the coordinator released the blocks", Duration::from_secs(5), |r| {
            r["held_blocks"] == 0 && r["grants_revoked"] == 1
        })
        .await;
    assert_eq!(counts(&pl, &["expired_leases", "leases_done"]), [json!(0), json!(1)], "released, not expired: {pl}");
    // The coordinator counts the release when the sidecar's answer reaches it, which may be
    // after the prefill already freed the blocks.
    common::eventually("the coordinator counted the release", || async {
        let posted = common::metric(&coordinator.metrics().await, "pd_coordinator_releases_total{outcome=\"posted\"}");
        (posted == 1.0).then_some(())
    })
    .await;
    assert_eq!(d.leaks().await["pulls"], 0);
}

/// Sim-pull mode: once the sidecar mapped the engine's pool it names its own agent, and its
/// pulls read under the prefill's grant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecars_own_pulls_read_under_grants() {
    let path = std::env::temp_dir().join(format!("pd-sidecar-grant-pull-{}", std::process::id()));
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--shm-path", path.to_str().unwrap(), "--kv-load-failure-policy", "fail"]).await;
    let s = Sidecar::start(&[
        "--mode",
        "sim-pull",
        "--engine",
        &d.url,
        "--prefill",
        &p.addr(),
        "--xfer-listen",
        "127.0.0.1:0",
    ])
    .await;
    let requests = 3;
    for i in 0..requests {
        let body = json!({"prompt": words(70 + i, &format!("sp{i}")), "max_tokens": 3});
        let (status, out) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{out}");
        assert_eq!(out["choices"][0]["text"], direct_text(&p, &body).await, "request {i}");
    }
    // The first request mapped the pool (no reader named yet); the others were granted.
    let pl = p
        .leaks_until("the prefill released every lease", Duration::from_secs(5), |r| {
            r["held_blocks"] == 0 && r["grants_revoked"] == requests - 1
        })
        .await;
    assert_eq!(pl["grants_issued"], requests - 1, "{pl}");
    let m = s.metrics().await;
    assert_eq!(common::metric(&m, "pd_sidecar_pulls_ok_total"), requests as f64);
    let dl = d.leaks().await;
    assert_eq!(counts(&dl, &["pulls", "verification_failures", "recomputed"]), [json!(0), json!(0), json!(0)], "{dl}");
    drop(d);
    let _ = std::fs::remove_file(&path);
}
