//! Engines that stay dead and nodes that go down, against real `pd-sim` processes: a dead
//! engine is forgotten after `--forget-dead-after-secs` (its number, index bitset position and
//! load slot reused by the next new engine without inheriting anything), revived if it comes
//! back before; `POST /v1/nodes/{node}/down` takes every engine of a node out of pairing and
//! the index at once, releases what prefills held for them and tells the other sidecars; a final
//! report carrying `decode_started` acts as that report and the end.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{eventually, recording_sidecar, tokens, Coord, Sim, MODEL};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// Heartbeats every 200 ms for the ids in `who` (changeable while it runs); collects the
/// `dead_engines` each id is told about.
struct Heartbeats {
    who: Arc<Mutex<HashSet<String>>>,
    told: Arc<Mutex<HashMap<String, Vec<String>>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Heartbeats {
    fn start(coord: &Arc<Coord>, ids: &[&str]) -> Heartbeats {
        let who = Arc::new(Mutex::new(ids.iter().map(|s| s.to_string()).collect::<HashSet<_>>()));
        let told: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (coord, who, told, stop) = (Arc::clone(coord), Arc::clone(&who), Arc::clone(&told), Arc::clone(&stop));
            tokio::spawn(async move {
                while !stop.load(Ordering::Acquire) {
                    let ids: Vec<String> = who.lock().iter().cloned().collect();
                    for id in ids {
                        let (status, notices) = coord.heartbeat(&id).await;
                        if status == 200 {
                            for dead in notices["dead_engines"].as_array().into_iter().flatten() {
                                told.lock().entry(id.clone()).or_default().push(dead.as_str().unwrap_or("?").into());
                            }
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        Heartbeats { who, told, stop, task }
    }

    fn set(&self, id: &str, on: bool) {
        if on {
            self.who.lock().insert(id.into());
        } else {
            self.who.lock().remove(id);
        }
    }

    fn told(&self, id: &str) -> Vec<String> {
        self.told.lock().get(id).cloned().unwrap_or_default()
    }

    async fn stop(self) {
        self.stop.store(true, Ordering::Release);
        tokio::time::timeout(Duration::from_secs(10), self.task).await.expect("heartbeats hung").unwrap();
    }
}

async fn engines(coord: &Coord) -> HashMap<String, Value> {
    let (status, list) = coord.get("/v1/engines").await;
    assert_eq!(status, 200);
    list.as_array().unwrap().iter().map(|e| (e["id"].as_str().unwrap().to_string(), e.clone())).collect()
}

const WITHIN: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_engines_are_forgotten_after_the_bound_and_their_numbers_reused() {
    let p0 = Sim::start("p0", &[]).await;
    let d0 = Sim::start("d0", &[]).await;
    let d1 = Sim::start("d1", &[]).await;
    let d2 = Sim::start("d2", &[]).await;
    let coord = Arc::new(
        Coord::start(&[
            "--lease-ms",
            "1000",
            "--heartbeat-ms",
            "250",
            "--health-interval-ms",
            "0",
            "--forget-dead-after-secs",
            "2",
        ])
        .await,
    );
    coord.register(&d0.spec("decode", None)).await;
    coord.register(&d1.spec("decode", None)).await;
    coord.register(&p0.spec("prefill", None)).await;
    let beats = Heartbeats::start(&coord, &["p0", "d0", "d1"]);

    // d1 caches prompt A; its events reach the index.
    let prompt_a = tokens(5000, 64);
    d1.complete(&prompt_a).await;
    eventually(WITHIN, "d1's blocks indexed", || async { coord.indexed("d1").await > 0 }).await;

    // d1's heartbeats stop: dead after the lease, its entries gone, but still listed.
    beats.set("d1", false);
    eventually(WITHIN, "d1 dead", || async { coord.alive().await.get("d1") == Some(&false) }).await;
    assert_eq!(coord.indexed("d1").await, 0);
    // Back before the bound: revived under the same id, a new generation.
    coord.register(&d1.spec("decode", None)).await;
    beats.set("d1", true);
    let view = &engines(&coord).await["d1"];
    assert_eq!((view["alive"].as_bool(), view["generation"].as_u64()), (Some(true), Some(2)), "{view}");

    // Dead again, and for longer than the bound: forgotten.
    beats.set("d1", false);
    eventually(WITHIN, "d1 dead again", || async { coord.alive().await.get("d1") == Some(&false) }).await;
    eventually(WITHIN, "d1 forgotten", || async { !engines(&coord).await.contains_key("d1") }).await;
    assert_eq!(coord.heartbeat("d1").await.0, 404, "a forgotten engine must register as new");
    assert_eq!(coord.metric("pd_coordinator_engines_forgotten_total").await, 1.0);
    assert_eq!(coord.metric("pd_coordinator_engines{state=\"dead\"}").await, 0.0);
    let (_, stats) = coord.get("/v1/index/stats").await;
    assert!(stats["models"][MODEL]["engines"].get("d1").is_none(), "{stats}");
    // Live engines were told once that d1 died (twice: it died twice), never after.
    assert!(beats.told("d0").iter().filter(|id| *id == "d1").count() >= 1);

    // A new engine takes the forgotten number: it starts with nothing of d1's (prompt A), and
    // what it caches itself is its own.
    coord.register(&d2.spec("decode", None)).await;
    beats.set("d2", true);
    assert_eq!(coord.indexed("d2").await, 0, "d2 inherited the forgotten engine's entries");
    let prompt_b = tokens(9000, 64);
    d2.complete(&prompt_b).await;
    eventually(WITHIN, "d2's blocks indexed", || async { coord.indexed("d2").await > 0 }).await;
    let (status, a) = coord.pair(&json!({"request_id": "a", "model": MODEL, "token_ids": prompt_a})).await;
    assert_eq!(status, 200, "{a}");
    assert_eq!((a["decode_overlap_blocks"].as_u64(), a["prefill_overlap_blocks"].as_u64()), (Some(0), Some(0)), "{a}");
    let held_by_d2 = coord.indexed("d2").await;
    let (status, b) = coord.pair(&json!({"request_id": "b", "model": MODEL, "token_ids": prompt_b})).await;
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["decode"]["id"], "d2", "{b}");
    assert_eq!(b["decode_overlap_blocks"].as_u64(), Some(held_by_d2), "{b}");

    // The forgotten id registers as a new engine (generation 1), its cache replayed.
    coord.register(&d1.spec("decode", None)).await;
    beats.set("d1", true);
    assert_eq!(engines(&coord).await["d1"]["generation"].as_u64(), Some(1));
    eventually(WITHIN, "d1 replayed", || async { coord.indexed("d1").await > 0 }).await;
    beats.stop().await;
}

fn on_node(sim: &Sim, role: &str, node: &str, sidecar: Option<&str>) -> Value {
    let mut spec = sim.spec(role, sidecar);
    spec["node"] = node.into();
    spec
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_reported_down_takes_all_its_engines_out_at_once() {
    let (sidecar, releases) = recording_sidecar().await;
    let d0 = Sim::start("d0", &[]).await;
    let d1 = Sim::start("d1", &[]).await;
    let p0 = Sim::start("p0", &[]).await;
    let p1 = Sim::start("p1", &[]).await;
    let coord = Arc::new(Coord::start(&["--lease-ms", "3000"]).await);
    // Node a: d0, p0; node b: d1, p1. Decode ties go to d0 (registered first).
    coord.register(&on_node(&d0, "decode", "node-a", Some("http://127.0.0.1:9"))).await;
    coord.register(&on_node(&d1, "decode", "node-b", Some("http://127.0.0.1:9"))).await;
    coord.register(&on_node(&p0, "prefill", "node-a", Some(&sidecar))).await;
    coord.register(&on_node(&p1, "prefill", "node-b", Some(&sidecar))).await;
    let beats = Heartbeats::start(&coord, &["d0", "d1", "p0", "p1"]);
    let cached = tokens(7000, 64);
    d0.complete(&cached).await;
    p0.complete(&cached).await;
    eventually(WITHIN, "node a's blocks indexed", || async {
        coord.indexed("d0").await > 0 && coord.indexed("p0").await > 0
    })
    .await;

    // Requests in flight: one held on p1 for d0 (node b's prefill holds blocks for node a's
    // decode), one prefilling on p0 for d0.
    let mut held = None;
    let mut prefilling = None;
    for n in 0..50u32 {
        let id = format!("r{n}");
        let prompt = tokens(100_000 + n * 512, 256);
        let (status, d) = coord.pair(&json!({"request_id": id, "model": MODEL, "token_ids": prompt})).await;
        assert_eq!(status, 200, "{d}");
        match (d["decode"]["id"].as_str(), d["prefill"]["id"].as_str()) {
            (Some("d0"), Some("p1")) if held.is_none() => {
                let params = format!(r#"{{"remote_request_id": "{id}", "z": 1.50}}"#);
                let done =
                    format!(r#"{{"request_id": "{id}", "event": "prefill_done", "kv_transfer_params": {params}}}"#);
                assert_eq!(coord.post_raw("/v1/report", done.into_bytes()).await.0, 204);
                held = Some((id, params));
            }
            (Some("d0"), Some("p0")) if prefilling.is_none() => prefilling = Some(id),
            _ => {
                coord.post("/v1/report", &json!({"request_id": id, "event": "finished"})).await;
            }
        }
        if held.is_some() && prefilling.is_some() {
            break;
        }
    }
    let (held, params) = held.expect("a request paired d0 with p1");
    assert!(prefilling.is_some(), "a request paired d0 with p0");

    let (status, answer) = coord.post("/v1/nodes/node-a/down", &json!({})).await;
    assert_eq!(status, 200, "{answer}");
    let left: HashSet<&str> = answer["engines"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert_eq!(left, HashSet::from(["d0", "p0"]), "{answer}");
    // At once: out of pairing and the index.
    let alive = coord.alive().await;
    assert_eq!((alive["d0"], alive["p0"], alive["d1"], alive["p1"]), (false, false, true, true));
    assert_eq!((coord.indexed("d0").await, coord.indexed("p0").await), (0, 0));
    for n in 0..20u32 {
        let prompt = if n % 2 == 0 { cached.clone() } else { tokens(300_000 + n * 512, 256) };
        let (status, d) =
            coord.pair(&json!({"request_id": format!("after{n}"), "model": MODEL, "token_ids": prompt})).await;
        assert_eq!(status, 200, "{d}");
        assert_eq!(d["decode"]["id"], "d1", "{d}");
        assert!(d["prefill"].is_null() || d["prefill"]["id"] == "p1", "{d}");
    }
    // The blocks p1 held for d0 go back through p1's sidecar, params verbatim.
    eventually(WITHIN, "held blocks released", || async { !releases.lock().is_empty() }).await;
    let released = releases.lock().clone();
    assert_eq!(released.len(), 1, "{released:?}");
    assert!(released[0].contains(&format!(r#""request_id":"{held}""#)), "{}", released[0]);
    assert!(released[0].contains(&format!(r#""kv_transfer_params":{params}"#)), "{}", released[0]);
    // The other node's sidecars are told, each death once.
    eventually(WITHIN, "node b told", || async {
        ["d1", "p1"].iter().all(|id| {
            let told = beats.told(id);
            ["d0", "p0"].iter().all(|dead| told.iter().filter(|t| t == dead).count() == 1)
        })
    })
    .await;
    assert_eq!(coord.metric("pd_coordinator_engine_deaths_total{cause=\"node\"}").await, 2.0);
    // Again: nothing left to take out; an unknown node is a 404; the sidecars of node a get 404
    // on their heartbeats (they register again when the node is back).
    let (status, again) = coord.post("/v1/nodes/node-a/down", &json!({})).await;
    assert_eq!((status, again["engines"].as_array().map(Vec::len)), (200, Some(0)), "{again}");
    assert_eq!(coord.post("/v1/nodes/nowhere/down", &json!({})).await.0, 404);
    assert_eq!(coord.heartbeat("d0").await.0, 404);
    beats.stop().await;
    // Node a comes back: its sidecars register again and pairing uses it.
    coord.register(&on_node(&d0, "decode", "node-a", Some("http://127.0.0.1:9"))).await;
    assert!(coord.alive().await["d0"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_final_report_carrying_decode_started_acts_as_both_reports() {
    // A sidecar folds `decode_started` into the final report when the decode's answer came
    // whole. Each folded request is set against the same request reported in two: the same
    // reports counted, the handoff ended, and on `failed` nothing freed (the decode had pulled
    // the blocks), where a failure before the decode started frees what the prefill holds. No
    // engine listens at the registered URLs (health off); the prefill's sidecar records.
    let (sidecar, releases) = recording_sidecar().await;
    let coord = Coord::start(&["--health-interval-ms", "0"]).await;
    for (id, role, sidecar_url) in [("p0", "prefill", sidecar.as_str()), ("d0", "decode", "http://127.0.0.1:9")] {
        let port = common::free_port();
        coord
            .register(&json!({"id": id, "role": role, "node": "n", "model": MODEL, "block_size": 16,
                              "engine_url": format!("http://127.0.0.1:{port}"), "sidecar_url": sidecar_url}))
            .await;
    }
    let reports = "pd_coordinator_reports_total";
    let mut counted = HashMap::new();
    // (request, its end, how the decode's start is reported: on its own, folded, or not at all)
    let requests = [
        ("split-ok", "finished", Some(false)),
        ("folded-ok", "finished", Some(true)),
        ("split", "failed", Some(false)),
        ("folded", "failed", Some(true)),
        ("unstarted", "failed", None),
    ];
    for (id, end, started) in requests {
        let prompt = format!("{id} {}", "x ".repeat(3000));
        let (status, d) = coord.pair(&json!({"request_id": id, "model": MODEL, "prompt": prompt})).await;
        assert_eq!((status, d["reason"].as_str()), (200, Some("disaggregated")), "{d}");
        assert_eq!(coord.metric("pd_coordinator_handoffs_in_flight").await, 1.0, "{id}");
        let before = coord.metric(reports).await;
        let params = json!({"remote_request_id": id});
        let done = json!({"request_id": id, "event": "prefill_done", "engine": "p0", "kv_transfer_params": params});
        assert_eq!(coord.post("/v1/report", &done).await.0, 204);
        if started == Some(false) {
            let started = json!({"request_id": id, "event": "decode_started", "engine": "d0"});
            assert_eq!(coord.post("/v1/report", &started).await.0, 204);
        }
        let mut last = json!({"request_id": id, "event": end, "engine": "d0"});
        if end == "failed" {
            last["kv_transfer_params"] = params;
        }
        if started == Some(true) {
            last["decode_started"] = true.into();
        }
        assert_eq!(coord.post("/v1/report", &last).await.0, 204);
        assert_eq!(coord.metric("pd_coordinator_handoffs_in_flight").await, 0.0, "{id}");
        counted.insert(id, coord.metric(reports).await - before);
    }
    assert_eq!((counted["split-ok"], counted["folded-ok"]), (3.0, 3.0), "{counted:?}");
    assert_eq!((counted["split"], counted["folded"], counted["unstarted"]), (3.0, 3.0, 2.0), "{counted:?}");
    eventually(WITHIN, "the unstarted request's blocks released", || async { !releases.lock().is_empty() }).await;
    // Releases are sent in the background: give any other one time to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let released = releases.lock().clone();
    assert_eq!(released.len(), 1, "{released:?}");
    assert!(released[0].contains(r#""request_id":"unstarted""#), "{}", released[0]);
}
