//! kill -9 of a simulated prefill engine while real `pd-sidecar` processes drive load through
//! the coordinator: every client request ends within a bound, pairing excludes the dead engine
//! within the lease, and the surviving engines hold no blocks afterwards (`GET /admin/leaks`).
//!
//! Needs `target/<profile>/pd-sidecar` (built by `cargo test --workspace` or
//! `cargo build -p pd-sidecar`); without it the test fails and says how to build it.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{client, eventually, free_port, tokens, Coord, Proc, Sim, MODEL};
use parking_lot::Mutex;
use serde_json::{json, Value};

/// Lease of the test's coordinator; the health checks (250 ms, 2 failures) usually act first.
const LEASE_MS: u64 = 2000;
/// Longest a client request may take, whatever dies under it (generous: a loaded 2-core box).
const REQUEST_BOUND: Duration = Duration::from_secs(30);

/// The `pd-sidecar` built next to `pd-coordinator`. The workspace test command builds it (its
/// package has integration tests); missing, the test fails rather than skips.
fn sidecar_bin() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_pd-coordinator")).parent().expect("a target directory").to_path_buf();
    let bin = dir.join("pd-sidecar");
    assert!(
        bin.exists(),
        "{} is not built: run `cargo build -p pd-sidecar` with this test's profile, or the workspace test command",
        bin.display()
    );
    bin
}

/// A pd-sidecar next to one engine, registered with the coordinator; killed on drop.
struct Sidecar {
    _proc: Proc,
    url: String,
}

impl Sidecar {
    async fn start(bin: &PathBuf, coord: &Coord, sim: &Sim, role: &str, node: &str) -> Sidecar {
        let what = format!("pd-sidecar of {}", sim.id);
        pd_sim::harness::start_with_retries(&what, || Self::try_start(bin, coord, sim, role, node)).await
    }

    async fn try_start(
        bin: &PathBuf,
        coord: &Coord,
        sim: &Sim,
        role: &str,
        node: &str,
    ) -> Result<Sidecar, pd_sim::harness::NotHealthy> {
        // The advertised URL must be known before it binds: a free port, as for the engines
        // (drawn again when it was taken first).
        let port = free_port();
        let url = format!("http://127.0.0.1:{port}");
        let mut cmd = Command::new(bin);
        cmd.args(["--listen", &format!("127.0.0.1:{port}"), "--engine", &sim.url])
            .args(["--coordinator", &coord.url, "--engine-id", &sim.id, "--role", role, "--model", MODEL])
            .args(["--node", node, "--advertise-url", &url])
            .args(["--kv-events", &format!("tcp://127.0.0.1:{}", sim.events)])
            .args(["--kv-events-replay", &format!("tcp://127.0.0.1:{}", sim.replay)])
            .args(["--prefill-timeout", "10s", "--decode-first-byte-timeout", "20s", "--connect-timeout", "1s"])
            .env("RUST_LOG", "warn")
            .env_remove("PD_SIDECAR_CONFIG");
        let name = format!("sidecar-{}-{port}", sim.id);
        let mut proc = common::spawn(cmd, &name);
        common::wait_healthy(&mut proc, &url, &name).await?;
        Ok(Sidecar { _proc: proc, url })
    }
}

async fn leaks(sim: &Sim) -> Value {
    let r = client().get(format!("{}/admin/leaks", sim.url)).send().await.expect("GET /admin/leaks");
    r.json().await.expect("leak report")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_a_prefill_under_sidecar_load() {
    let bin = sidecar_bin();
    let slow = ["--prefill-us-per-token", "200", "--decode-us-per-token", "500"];
    let mut p0 = Sim::start("p0", &slow).await;
    let p1 = Sim::start("p1", &slow).await;
    let d0 = Sim::start("d0", &slow).await;
    let lease = LEASE_MS.to_string();
    let coord = Arc::new(
        Coord::start(&[
            "--lease-ms",
            &lease,
            "--heartbeat-ms",
            "250",
            "--health-interval-ms",
            "250",
            "--health-failures",
            "2",
        ])
        .await,
    );
    let _ps0 = Sidecar::start(&bin, &coord, &p0, "prefill", "node-1").await;
    let _ps1 = Sidecar::start(&bin, &coord, &p1, "prefill", "node-2").await;
    let ds0 = Sidecar::start(&bin, &coord, &d0, "decode", "node-3").await;
    eventually(common::WAIT, "three sidecars registered", || async {
        let alive = coord.alive().await;
        ["p0", "p1", "d0"].iter().all(|id| alive.get(*id) == Some(&true))
    })
    .await;

    // Clients: completions through the decode's sidecar, each bounded; outcomes counted.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let slowest = Arc::new(Mutex::new(Duration::ZERO));
    let ok_after_kill = Arc::new(AtomicU64::new(0));
    let killed = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for w in 0..4u32 {
        let (stop, ok, failed, slowest, ok_after_kill, killed) = (
            Arc::clone(&stop),
            Arc::clone(&ok),
            Arc::clone(&failed),
            Arc::clone(&slowest),
            Arc::clone(&ok_after_kill),
            Arc::clone(&killed),
        );
        let url = format!("{}/v1/completions", ds0.url);
        clients.push(tokio::spawn(async move {
            let http = reqwest::Client::builder().timeout(REQUEST_BOUND).build().unwrap();
            let mut n = 0u32;
            while !stop.load(Ordering::Acquire) {
                n += 1;
                // A shared system prefix and a distinct tail, long enough to be disaggregated.
                let mut prompt = tokens(1, 32);
                prompt.extend(tokens(1_000_000 * (w + 1) + n * 256, 224));
                let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
                let started = Instant::now();
                let outcome = http.post(&url).json(&body).send().await;
                let success = match outcome {
                    Ok(r) => {
                        let status = r.status();
                        // The whole body, also bounded by the client's timeout.
                        r.bytes().await.is_ok() && status.is_success()
                    }
                    Err(err) => {
                        assert!(!err.is_timeout(), "a request hung past {REQUEST_BOUND:?}");
                        false
                    }
                };
                let took = started.elapsed();
                assert!(took < REQUEST_BOUND, "a request took {took:?}");
                let mut s = slowest.lock();
                *s = (*s).max(took);
                drop(s);
                if success {
                    ok.fetch_add(1, Ordering::Relaxed);
                    if killed.load(Ordering::Acquire) {
                        ok_after_kill.fetch_add(1, Ordering::Relaxed);
                    }
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }

    // Load runs with both prefills in use, then p0's engine dies (its sidecar lives on and
    // keeps heartbeating, as on a real node where only the engine crashed).
    eventually(Duration::from_secs(60), "both prefills served", || async {
        leaks(&p0).await["leases_started"].as_u64() > Some(0) && leaks(&p1).await["leases_started"].as_u64() > Some(0)
    })
    .await;
    // Kill while p0 has a request under way (computing, or holding blocks for the decode).
    eventually(Duration::from_secs(60), "a request under way on p0", || async {
        let report = leaks(&p0).await;
        report["running"].as_u64() > Some(0) || report["held_blocks"].as_u64() > Some(0)
    })
    .await;
    let before = ok.load(Ordering::Relaxed);
    p0.proc.kill9();
    let killed_at = Instant::now();
    killed.store(true, Ordering::Release);

    // Pairing excludes p0 within the lease (health checks usually see it sooner).
    eventually(Duration::from_secs(30), "p0 out of pairing", || async {
        coord.alive().await.get("p0") == Some(&false)
    })
    .await;
    let excluded_after = killed_at.elapsed();
    println!("p0 left pairing {excluded_after:?} after kill -9 (lease {LEASE_MS} ms)");
    assert!(
        excluded_after <= Duration::from_millis(LEASE_MS) + Duration::from_secs(3),
        "p0 still in pairing {excluded_after:?} after its death"
    );
    assert_eq!(coord.indexed("p0").await, 0);
    for n in 0..20u32 {
        let mut prompt = tokens(1, 32);
        prompt.extend(tokens(50_000_000 + n * 256, 224));
        let (status, d) =
            coord.pair(&json!({"request_id": format!("probe{n}"), "model": MODEL, "token_ids": prompt})).await;
        assert_eq!(status, 200, "{d}");
        assert_ne!(d["prefill"]["id"], "p0", "the dead prefill was chosen: {d}");
        coord.post("/v1/report", &json!({"request_id": format!("probe{n}"), "event": "failed"})).await;
    }

    // Load goes on through p1 for a while, then stops; every client returns within the bound.
    eventually(Duration::from_secs(60), "requests succeed after the kill", || async {
        ok_after_kill.load(Ordering::Relaxed) >= 8
    })
    .await;
    stop.store(true, Ordering::Release);
    for c in clients {
        tokio::time::timeout(REQUEST_BOUND + Duration::from_secs(10), c).await.expect("a client hung").unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    println!("{before} requests ok before the kill, {ok} in all, {failed} failed, slowest {:?}", *slowest.lock());
    assert!(failed <= 8, "{failed} requests failed: failover should have kept most of them");

    // The survivors hold nothing once the requests are done: no held blocks, no leases.
    for sim in [&p1, &d0] {
        eventually(Duration::from_secs(45), &format!("{} holds no blocks", sim.id), || async {
            let report = leaks(sim).await;
            report["held_blocks"] == 0 && report["active_leases"] == 0
        })
        .await;
        println!("{} after the run: {}", sim.id, leaks(sim).await);
    }
}
