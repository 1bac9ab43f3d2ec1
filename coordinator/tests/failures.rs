//! kill -9 of a simulated decode engine while pairing load runs: pairing excludes it within
//! the lease, no call hangs, heartbeat notices name it, and blocks a prefill held for it are
//! released through the prefill's sidecar (a recording stand-in here) with the prefill's
//! kv_transfer_params verbatim.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{recording_sidecar, tokens, Coord, Sim, MODEL};
use parking_lot::Mutex;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_decode_under_load() {
    let (sidecar, releases) = recording_sidecar().await;
    let p0 = Sim::start("p0", &[]).await;
    let p1 = Sim::start("p1", &[]).await;
    let mut d0 = Sim::start("d0", &[]).await;
    let d1 = Sim::start("d1", &[]).await;
    let coord = Arc::new(Coord::start(&["--health-interval-ms", "250", "--health-failures", "2"]).await);
    coord.register(&p0.spec("prefill", Some(&sidecar))).await;
    coord.register(&p1.spec("prefill", Some(&sidecar))).await;
    coord.register(&d0.spec("decode", Some("http://127.0.0.1:9"))).await;
    coord.register(&d1.spec("decode", Some("http://127.0.0.1:9"))).await;

    // The sidecars' heartbeats (d0's keeps going after its engine dies, as a live sidecar's
    // would); what they are told is kept.
    let stop = Arc::new(AtomicBool::new(false));
    let told_dead = Arc::new(Mutex::new(Vec::<String>::new()));
    let heartbeats = {
        let (coord, stop, told_dead) = (Arc::clone(&coord), Arc::clone(&stop), Arc::clone(&told_dead));
        tokio::spawn(async move {
            while !stop.load(Ordering::Acquire) {
                for id in ["p0", "p1", "d0", "d1"] {
                    let (status, notices) = coord.heartbeat(id).await;
                    if status == 200 {
                        for dead in notices["dead_engines"].as_array().unwrap() {
                            told_dead.lock().push(format!("{id}:{}", dead.as_str().unwrap()));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
    };

    // Load: pair, run the prefill on the chosen engine, report; every 4th request is left
    // "held" (prefill done, decode not started), as if its decode were about to pull.
    let killed_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let last_d0_after_kill: Arc<Mutex<Option<Duration>>> = Arc::default();
    let pairs = Arc::new(AtomicU64::new(0));
    let held_on_d0 = Arc::new(AtomicU64::new(0));
    // Every request paired with d0 and given a prefill: a release may name any of them (one
    // whose finish report was still on its way when d0 died is rightly released too).
    let prefilled_for_d0: Arc<Mutex<HashSet<String>>> = Arc::default();
    // Held for d0 with the prefill reported before the kill: each must be released.
    let held_before_kill: Arc<Mutex<Vec<String>>> = Arc::default();
    let sims = Arc::new([(p0.id.clone(), p0.url.clone()), (p1.id.clone(), p1.url.clone())]);
    let mut workers = Vec::new();
    for w in 0..4u32 {
        let held_on_d0 = Arc::clone(&held_on_d0);
        let prefilled_for_d0 = Arc::clone(&prefilled_for_d0);
        let held_before_kill = Arc::clone(&held_before_kill);
        let (coord, stop, killed_at, last, pairs, sims) = (
            Arc::clone(&coord),
            Arc::clone(&stop),
            Arc::clone(&killed_at),
            Arc::clone(&last_d0_after_kill),
            Arc::clone(&pairs),
            Arc::clone(&sims),
        );
        workers.push(tokio::spawn(async move {
            let http = common::client();
            let mut n = 0u32;
            while !stop.load(Ordering::Acquire) {
                n += 1;
                let id = format!("w{w}-{n}");
                // A shared 2-block system prefix and a distinct 12-block tail (long enough
                // uncached to be disaggregated).
                let mut prompt = tokens(1, 32);
                prompt.extend(tokens(100_000 * (w + 1) + n * 192, 192));
                let started = Instant::now();
                let (status, d) = coord.pair(&json!({"request_id": id, "model": MODEL, "token_ids": prompt})).await;
                assert!(started.elapsed() < Duration::from_secs(2), "a pair call took {:?}", started.elapsed());
                assert_eq!(status, 200, "{d}");
                pairs.fetch_add(1, Ordering::Relaxed);
                if d["decode"]["id"] == "d0" {
                    if let Some(at) = *killed_at.lock() {
                        *last.lock() = Some(at.elapsed());
                    }
                }
                if let Some(prefill) = d["prefill"]["id"].as_str() {
                    let url = &sims.iter().find(|(id, _)| id == prefill).unwrap().1;
                    let body = json!({"prompt": prompt, "max_tokens": 1});
                    let r = http.post(format!("{url}/v1/completions")).json(&body).send().await;
                    assert!(r.is_ok_and(|r| r.status().is_success()), "prefill on {prefill}");
                }
                let params = format!(r#"{{"remote_request_id": "{id}", "z": 1.50, "a": [1, 2]}}"#);
                let done =
                    format!(r#"{{"request_id": "{id}", "event": "prefill_done", "kv_transfer_params": {params}}}"#);
                if d["decode"]["id"] == "d0" && d["prefill"].is_object() {
                    prefilled_for_d0.lock().insert(id.clone());
                }
                coord.post_raw("/v1/report", done.into_bytes()).await;
                if n.is_multiple_of(4) && d["decode"]["id"] == "d0" && d["prefill"].is_object() {
                    held_on_d0.fetch_add(1, Ordering::Relaxed);
                    if killed_at.lock().is_none() {
                        held_before_kill.lock().push(id.clone());
                    }
                } else {
                    coord.post("/v1/report", &json!({"request_id": id, "event": "decode_started"})).await;
                    coord.post("/v1/report", &json!({"request_id": id, "event": "finished"})).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }));
    }

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = pairs.load(Ordering::Relaxed);
    assert!(before > 10, "load is running ({before} pairs)");
    d0.proc.kill9();
    *killed_at.lock() = Some(Instant::now());
    tokio::time::sleep(Duration::from_millis(4000)).await;
    stop.store(true, Ordering::Release);
    for worker in workers {
        tokio::time::timeout(Duration::from_secs(10), worker).await.expect("a load worker hung").unwrap();
    }
    tokio::time::timeout(Duration::from_secs(10), heartbeats).await.expect("heartbeats hung").unwrap();

    let after = pairs.load(Ordering::Relaxed) - before;
    let last = *last_d0_after_kill.lock();
    println!("{before} pairs before the kill, {after} after; d0 last chosen {last:?} after kill -9");
    assert!(after > 10, "pairing went on");
    assert!(last.is_none_or(|t| t < Duration::from_secs(3)), "d0 still chosen {last:?} after its death");
    assert_eq!(coord.alive().await.get("d0"), Some(&false));
    assert_eq!(coord.indexed("d0").await, 0);
    let told = told_dead.lock().clone();
    for id in ["p0", "p1", "d1"] {
        assert!(told.contains(&format!("{id}:d0")), "{id} was told d0 died: {told:?}");
    }
    // Held blocks of requests whose decode was d0 went back through the prefill's sidecar,
    // with the params exactly as the prefill reported them.
    let released = releases.lock().clone();
    let held = held_on_d0.load(Ordering::Relaxed) as usize;
    println!("{} releases posted to the prefill sidecars ({held} requests held for d0)", released.len());
    assert!(held == 0 || !released.is_empty(), "{} releases, {held} held", released.len());
    let released_ids: HashSet<String> = released
        .iter()
        .filter_map(|body| serde_json::from_str::<serde_json::Value>(body).ok())
        .filter_map(|v| v["request_id"].as_str().map(String::from))
        .collect();
    for id in held_before_kill.lock().iter() {
        assert!(released_ids.contains(id), "{id} was held for d0 before the kill and never released");
    }
    let posted = coord.metric("pd_coordinator_releases_total{outcome=\"posted\"}").await;
    assert_eq!(posted as usize, released.len());
    for body in &released {
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        let id = v["request_id"].as_str().unwrap();
        assert!(prefilled_for_d0.lock().contains(id), "released {id}, which was not prefilled for d0");
        assert!(
            body.contains(&format!(r#""kv_transfer_params":{{"remote_request_id": "{id}", "z": 1.50, "a": [1, 2]}}"#)),
            "{body}"
        );
    }
    assert_eq!(coord.metric("pd_coordinator_engine_deaths_total{cause=\"health\"}").await, 1.0);
}
