//! The coordinator link against an in-test fake of coordinator/API.md (registration, load in
//! heartbeats, pairing, reports, notices, re-registration, an unreachable coordinator), and
//! against the real `pd-coordinator` built next to `pd-sidecar` (missing, the test fails).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::routing::{get, post};
use axum::{Json, Router};
use common::{free_port, words, Sidecar, Sim};
use serde_json::{json, Value};

#[derive(Default)]
struct Fake {
    registrations: Mutex<Vec<Value>>,
    heartbeats: Mutex<Vec<Value>>,
    pairs: Mutex<Vec<Value>>,
    reports: Mutex<Vec<Value>>,
    /// `None`: answer local_prefill; else the prefill's (id, url).
    pair_with: Mutex<Option<(String, String)>>,
    /// The data-parallel ranks a decision names: (decode, prefill).
    pair_ranks: Mutex<(Option<u32>, Option<u32>)>,
    notices: Mutex<Option<Value>>,
    forget_once: AtomicBool,
    /// Registrations are answered as by a coordinator older than `decode_started_on_end`.
    old: AtomicBool,
    beats: AtomicU32,
}

type S = State<Arc<Fake>>;

async fn fake_coordinator() -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route(
            "/v1/engines",
            post(|State(f): S, Json(spec): Json<Value>| async move {
                let id = spec["id"].as_str().unwrap().to_string();
                f.registrations.lock().unwrap().push(spec);
                let mut answer = json!({"engine": id, "lease_ms": 3000, "heartbeat_ms": 100});
                if !f.old.load(SeqCst) {
                    answer["decode_started_on_end"] = true.into();
                }
                Json(answer)
            })
            .get(|| async { Json(json!([])) }),
        )
        .route(
            "/v1/engines/{id}/heartbeat",
            post(|State(f): S, Path(id): Path<String>, Json(b): Json<Value>| async move {
                f.beats.fetch_add(1, SeqCst);
                if f.forget_once.swap(false, SeqCst) {
                    return (http::StatusCode::NOT_FOUND, Json(json!({"error": {"message": "unknown engine", "type": "NotFound", "code": 404}})));
                }
                f.heartbeats.lock().unwrap().push(json!({"id": id, "body": b}));
                let notices = f.notices.lock().unwrap().take().unwrap_or(json!({"dead_engines": [], "release": []}));
                (http::StatusCode::OK, Json(notices))
            }),
        )
        .route(
            "/v1/pair",
            post(|State(f): S, Json(req): Json<Value>| async move {
                let rid = req["request_id"].clone();
                f.pairs.lock().unwrap().push(req);
                let decode = json!({"id": "dec-1", "engine_url": "http://unused:1", "node": "n"});
                let mut decision = match f.pair_with.lock().unwrap().clone() {
                    Some((id, url)) => json!({"request_id": rid, "decode": decode, "prefill": {"id": id, "engine_url": url, "node": "n"},
                                              "decode_overlap_blocks": 0, "prefill_overlap_blocks": 0, "reason": "disaggregated"}),
                    None => json!({"request_id": rid, "decode": decode, "prefill": null,
                                   "decode_overlap_blocks": 3, "prefill_overlap_blocks": 0, "reason": "local_prefill"}),
                };
                let (decode_rank, prefill_rank) = *f.pair_ranks.lock().unwrap();
                for (field, rank) in [("decode_dp_rank", decode_rank), ("prefill_dp_rank", prefill_rank)] {
                    if let Some(rank) = rank {
                        decision[field] = rank.into();
                    }
                }
                Json(decision)
            }),
        )
        .route(
            "/v1/report",
            post(|State(f): S, Json(r): Json<Value>| async move {
                f.reports.lock().unwrap().push(r);
                http::StatusCode::NO_CONTENT
            }),
        )
        .route("/health", get(|| async { "ok" }))
        .with_state(Arc::clone(&fake));
    (format!("http://{}", common::serve(app).await), fake)
}

/// A completion of two tokens through the sidecar at `url`, under request id `id`.
async fn complete(url: &str, id: &str, prompt: &str, stream: bool) -> reqwest::Response {
    let body = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 2, "stream": stream});
    let request = common::client().post(format!("{url}/v1/completions")).header("x-request-id", id).json(&body);
    request.send().await.unwrap()
}

async fn until<T>(what: &str, within: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_heartbeats_pairs_reports_and_acts_on_notices() {
    // The decode takes 20 ms a token, so a streamed answer arrives in pieces (its first output
    // before its end) and a whole one at once.
    let decode_args = ["--kv-load-failure-policy", "fail", "--decode-us-per-token", "20000"];
    let (p1, p2, d) = (Sim::start(&[]).await, Sim::start(&[]).await, Sim::start(&decode_args).await);
    let (url, fake) = fake_coordinator().await;
    *fake.pair_with.lock().unwrap() = Some(("pre-2".into(), p2.url.clone()));
    let s = Sidecar::start(&[
        "--engine",
        &d.url,
        "--prefill",
        &p1.addr(),
        "--coordinator",
        &url,
        "--engine-id",
        "dec-1",
        "--role",
        "decode",
        "--node",
        "n1",
        "--model",
        "sim-model",
        "--advertise-url",
        "http://127.0.0.1:9",
        "--kv-events",
        "tcp://127.0.0.1:5557",
    ])
    .await;
    let spec =
        until("registration", Duration::from_secs(5), || fake.registrations.lock().unwrap().first().cloned()).await;
    assert_eq!(
        spec,
        json!({"id": "dec-1", "role": "decode", "node": "n1", "model": "sim-model", "engine_url": d.url,
               "sidecar_url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:5557", "block_size": 16})
    );
    let beat = until("heartbeat", Duration::from_secs(5), || fake.heartbeats.lock().unwrap().first().cloned()).await;
    assert_eq!(beat["id"], "dec-1");
    assert_eq!(
        (beat["body"]["load"]["running"].clone(), beat["body"]["load"]["waiting"].clone()),
        (json!(0), json!(0)),
        "{beat}"
    );
    assert!(beat["body"]["load"]["kv_usage"].is_number(), "{beat}");

    // The coordinator's prefill wins over the static list; the decision is reported on.
    let r = complete(&s.url, "coord-1", &words(40, "co"), false).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        (p2.leaks().await["leases_started"].clone(), p1.leaks().await["leases_started"].clone()),
        (json!(1), json!(0))
    );
    let pair = fake.pairs.lock().unwrap()[0].clone();
    assert_eq!(
        (pair["request_id"].as_str(), pair["model"].as_str(), pair["local_engine"].as_str()),
        (Some("coord-1"), Some("sim-model"), Some("dec-1"))
    );
    assert!(pair["prompt"].as_str().unwrap().starts_with("co0 co1"));
    assert!(pair.get("lora_name").is_none(), "the engine's own model names no adapter: {pair}");
    let reports_of = |id: &str| -> Vec<Value> {
        fake.reports.lock().unwrap().iter().filter(|r| r["request_id"] == id).cloned().collect()
    };
    // Reports are sent independently: any may land first.
    let arrived = |reports: &[Value], events: &[&str]| events.iter().all(|e| reports.iter().any(|r| r["event"] == *e));
    let reports = until("reports", Duration::from_secs(2), || {
        let r = reports_of("coord-1");
        arrived(&r, &["prefill_done", "finished"]).then_some(r)
    })
    .await;
    let done = reports.iter().find(|r| r["event"] == "prefill_done").unwrap();
    assert_eq!((done["request_id"].as_str(), done["engine"].as_str()), (Some("coord-1"), Some("pre-2")));
    assert_eq!(done["kv_transfer_params"]["do_remote_prefill"], true);
    // The answer came whole: its first output is reported with its end, in one report.
    let finished = reports.iter().find(|r| r["event"] == "finished").unwrap();
    assert_eq!((finished["engine"].as_str(), &finished["decode_started"]), (Some("dec-1"), &json!(true)));
    // Streamed, the first output is reported when it comes, the end on its own.
    let r = complete(&s.url, "coord-2", &words(40, "st"), true).await;
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
    let reports = until("the streamed request's three reports", Duration::from_secs(2), || {
        let r = reports_of("coord-2");
        (r.len() >= 3).then_some(r)
    })
    .await;
    let mut events: Vec<&str> = reports.iter().filter_map(|r| r["event"].as_str()).collect();
    events.sort_unstable();
    assert_eq!(events, ["decode_started", "finished", "prefill_done"], "{reports:?}");
    assert!(reports.iter().all(|r| r.get("decode_started").is_none()), "{reports:?}");
    // By now the whole answer's reports have long landed: no decode_started of its own.
    assert_eq!(reports_of("coord-1").len(), 2, "{:?}", reports_of("coord-1"));

    // local_prefill: no prefill leg at all.
    *fake.pair_with.lock().unwrap() = None;
    let (status, _) = s.post("/v1/completions", &json!({"prompt": words(40, "lp"), "max_tokens": 2})).await;
    assert_eq!(status, 200);
    assert_eq!(s.metric("pd_sidecar_local_decode_total{reason=\"coordinator\"}").await, 1.0);
    assert_eq!(p1.leaks().await["leases_started"], 0);

    // Notices: a dead engine is skipped even when paired with; a release list frees blocks.
    *fake.pair_with.lock().unwrap() = Some(("pre-2".into(), p2.url.clone()));
    let (_, held) = common::post(
        &format!("{}/v1/completions", p1.url),
        &json!({"prompt": words(50, "orph"), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true}}),
    )
    .await;
    assert_eq!(p1.leaks().await["held_blocks"], 4);
    *fake.notices.lock().unwrap() = Some(
        json!({"dead_engines": ["pre-2"], "release": [{"request_id": "orph", "prefill": "pre-1", "kv_transfer_params": held["kv_transfer_params"]}]}),
    );
    until("notices taken", Duration::from_secs(2), || fake.notices.lock().unwrap().is_none().then_some(())).await;
    p1.leaks_until("released by notice", Duration::from_secs(2), |r| r["held_blocks"] == 0).await;
    let (status, _) = s.post("/v1/completions", &json!({"prompt": words(40, "dead"), "max_tokens": 2})).await;
    assert_eq!(status, 200);
    assert_eq!(p2.leaks().await["leases_started"], 2, "the dead engine got nothing (after its two above)");
    assert_eq!(p1.leaks().await["leases_started"], 2, "the static list served");
    assert_eq!(s.metric("pd_sidecar_dead_engine_notices_total").await, 1.0);

    // The coordinator forgot us (restart): 404 on heartbeat → registered again. It came back
    // older, not reading `decode_started` on a final report: a whole answer is reported in two.
    fake.old.store(true, SeqCst);
    fake.forget_once.store(true, SeqCst);
    until("re-registration", Duration::from_secs(3), || (fake.registrations.lock().unwrap().len() >= 2).then_some(()))
        .await;
    let r = complete(&s.url, "coord-old", &words(40, "old"), false).await;
    assert_eq!(r.status(), 200);
    let reports = until("the start and the end reported apart", Duration::from_secs(2), || {
        let r = reports_of("coord-old");
        arrived(&r, &["decode_started", "finished"]).then_some(r)
    })
    .await;
    assert!(reports.iter().all(|r| r.get("decode_started").is_none()), "{reports:?}");

    // Another model is one of the engine's LoRA adapters: named in the pairing, which asks
    // for the engine's model (whatever the simulated engine makes of the name).
    let before = fake.pairs.lock().unwrap().len();
    s.post("/v1/completions", &json!({"model": "sql-lora", "prompt": words(40, "lora"), "max_tokens": 2})).await;
    let pair =
        until("the adapter's pairing", Duration::from_secs(2), || fake.pairs.lock().unwrap().get(before).cloned())
            .await;
    assert_eq!((pair["model"].as_str(), pair["lora_name"].as_str()), (Some("sim-model"), Some("sql-lora")), "{pair}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeps_serving_when_the_coordinator_is_unreachable() {
    let (p, d) = (Sim::start(&[]).await, Sim::start(&[]).await);
    let dead = format!("http://127.0.0.1:{}", free_port());
    let s = Sidecar::start(&[
        "--engine",
        &d.url,
        "--prefill",
        &p.addr(),
        "--coordinator",
        &dead,
        "--coordinator-timeout",
        "100ms",
    ])
    .await;
    for i in 0..5 {
        let started = Instant::now();
        let (status, out) =
            s.post("/v1/completions", &json!({"prompt": words(30, &format!("nc{i}x")), "max_tokens": 2})).await;
        assert_eq!(status, 200, "{out}");
        assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
    }
    assert_eq!(d.leaks().await["pulls"], 5, "disaggregated through the static list");
    assert!(s.metric("pd_sidecar_coordinator_errors_total").await >= 1.0);
}

/// With the real daemon: both engines' sidecars register, the decode's pairs through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_real_coordinator() {
    let coordinator = common::Coordinator::start(&["--heartbeat-ms", "200"]).await;
    let url = coordinator.url.clone();
    let (p, d) = (Sim::start(&[]).await, Sim::start(&["--kv-load-failure-policy", "fail"]).await);
    let common_args = |id: &'static str, role: &'static str, engine: String| {
        vec![
            "--engine".to_string(),
            engine,
            "--coordinator".into(),
            url.clone(),
            "--engine-id".into(),
            id.into(),
            "--role".into(),
            role.into(),
            "--model".into(),
            "sim-model".into(),
            "--node".into(),
            "local".into(),
        ]
    };
    let pa = common_args("pre-0", "prefill", p.url.clone());
    let _ps = Sidecar::start(&pa.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let da = common_args("dec-0", "decode", d.url.clone());
    let ds = Sidecar::start(&da.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let engines = common::eventually("both registered", || async {
        let v = common::client().get(format!("{url}/v1/engines")).send().await.ok()?.json::<Value>().await.ok()?;
        (v.as_array()?.len() == 2).then_some(v)
    })
    .await;
    assert!(engines.as_array().unwrap().iter().all(|e| e["alive"] == true), "{engines}");
    let (status, out) =
        ds.post("/v1/completions", &json!({"model": "sim-model", "prompt": words(64, "real"), "max_tokens": 3})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(ds.metric("pd_sidecar_pairings_total").await, 1.0);
    assert_eq!(ds.metric("pd_sidecar_phase_seconds_count{phase=\"pairing\"}").await, 1.0);
    assert!(ds.metric("pd_sidecar_phase_seconds_sum{phase=\"pairing\"}").await > 0.0);
    assert_eq!(ds.metric("pd_sidecar_disaggregated_total").await, 1.0);
    assert_eq!(d.leaks().await["pulls"], 1);
    p.leaks_until("prefill released", Duration::from_secs(1), |r| r["held_blocks"] == 0).await;
    // prefill_done, then the end carrying decode_started (the answer came whole): the
    // coordinator accepts it, counts it as the two reports it stands for and ends the handoff.
    common::eventually("the reports taken", || async {
        let m = coordinator.metrics().await;
        let settled = common::metric_sum(&m, "pd_coordinator_handoffs_in_flight", "") == 0.0
            && common::metric_sum(&m, "pd_coordinator_reports_total", "") == 3.0;
        settled.then_some(())
    })
    .await;
    assert_eq!(ds.metric("pd_sidecar_reports_dropped_total").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_named_data_parallel_rank_reaches_its_engine() {
    // Engines that record the headers of every request.
    let ((prefill, prefill_seen), (decode, decode_seen)) = common::fake_handoff_engines().await;
    let (url, fake) = fake_coordinator().await;
    *fake.pair_with.lock().unwrap() = Some(("pre-1".into(), format!("http://{prefill}")));
    let s = Sidecar::start(&[
        "--engine",
        &decode,
        "--coordinator",
        &url,
        "--engine-id",
        "dec-1",
        "--role",
        "decode",
        "--model",
        "sim-model",
        "--data-parallel-size",
        "2",
    ])
    .await;
    let spec =
        until("registration", Duration::from_secs(5), || fake.registrations.lock().unwrap().first().cloned()).await;
    assert_eq!(spec["data_parallel_size"], 2, "{spec}");

    // The rank header each engine's completion call carried, request by request.
    let ranks_seen = |seen: &common::Log| -> Vec<Option<String>> {
        let seen = seen.lock().unwrap();
        let completions = seen.iter().filter(|s| s.path == "/v1/completions");
        completions.map(|s| s.headers.get("x-data-parallel-rank").map(|v| v.to_str().unwrap().to_string())).collect()
    };
    let complete = |client_rank: Option<&'static str>| {
        let mut r = common::client().post(format!("{}/v1/completions", s.url));
        if let Some(rank) = client_rank {
            r = r.header("x-data-parallel-rank", rank);
        }
        async move {
            let r = r.json(&json!({"model": "sim-model", "prompt": words(40, "dp"), "max_tokens": 2})).send().await;
            assert_eq!(r.unwrap().status(), 200);
        }
    };
    // Ranks named: each leg carries its own engine's.
    *fake.pair_ranks.lock().unwrap() = (Some(1), Some(0));
    complete(None).await;
    // None named: no leg carries one; a client's own reaches only the engine it addressed.
    *fake.pair_ranks.lock().unwrap() = (None, None);
    complete(None).await;
    complete(Some("5")).await;
    // Only the prefill's named; the client's rank never goes to the prefill.
    *fake.pair_ranks.lock().unwrap() = (None, Some(1));
    complete(Some("5")).await;
    let some = |r: &str| Some(r.to_string());
    assert_eq!(ranks_seen(&prefill_seen), [some("0"), None, None, some("1")]);
    assert_eq!(ranks_seen(&decode_seen), [some("1"), None, some("5"), some("5")]);
}
