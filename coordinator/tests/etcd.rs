//! Two coordinators sharing membership through a real etcd (started here on free ports in a
//! temporary directory): engines registered through one are paired by the other, which
//! ingests their KV events itself; heartbeats through either keep them alive; when the
//! heartbeats stop, both see the lease expire.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{eventually, free_port, tokens, Coord, Proc, Sim, MODEL};
use serde_json::json;

struct Etcd {
    _proc: Proc,
    dir: std::path::PathBuf,
    client_port: u16,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn etcd_binary() -> Option<String> {
    ["etcd", "/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .find(|bin| Command::new(bin).arg("--version").output().is_ok_and(|o| o.status.success()))
        .map(String::from)
}

async fn start_etcd(binary: &str) -> Etcd {
    let (client_port, peer_port) = (free_port(), free_port());
    let dir = std::env::temp_dir().join(format!("pd-coord-etcd-{}-{client_port}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let client = format!("http://127.0.0.1:{client_port}");
    let peer = format!("http://127.0.0.1:{peer_port}");
    let mut cmd = Command::new(binary);
    cmd.args(["--name", "pd-test", "--data-dir", dir.join("data").to_str().unwrap()])
        .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("pd-test={peer}"), "--initial-cluster-state", "new"])
        .args(["--log-level", "warn"]);
    let proc = common::spawn(cmd, &format!("etcd-{client_port}"));
    // Ready when it answers its health endpoint.
    eventually(Duration::from_secs(15), "etcd healthy", || async {
        let r = common::client().get(format!("{client}/health")).send().await;
        r.is_ok_and(|r| r.status().is_success())
    })
    .await;
    Etcd { _proc: proc, dir, client_port }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_share_membership_through_etcd() {
    let Some(binary) = etcd_binary() else {
        println!(
            "SKIPPED two_coordinators_share_membership_through_etcd: no etcd binary (apt-get install etcd-server)"
        );
        return;
    };
    let etcd = start_etcd(&binary).await;
    let store = format!("etcd://127.0.0.1:{}", etcd.client_port);
    let prefix = format!("/pd-test-{}/", std::process::id());
    let args = ["--store", store.as_str(), "--etcd-prefix", prefix.as_str(), "--health-interval-ms", "0"];
    let a = Coord::start(&args).await;
    let b = Coord::start(&args).await;

    let p0 = Sim::start("p0", &[]).await;
    let d0 = Sim::start("d0", &[]).await;
    // With sidecars declared, only heartbeats keep the engines alive.
    a.register(&p0.spec("prefill", Some("http://127.0.0.1:9"))).await;
    a.register(&d0.spec("decode", Some("http://127.0.0.1:9"))).await;
    let seen = eventually(Duration::from_secs(5), "B sees A's registrations", || async {
        let alive = b.alive().await;
        alive.get("p0") == Some(&true) && alive.get("d0") == Some(&true)
    })
    .await;
    println!("registration through A visible on B after {seen:?}");

    // Heartbeats alternate between the coordinators for longer than the lease.
    let p0_prefix = tokens(1, 160);
    p0.complete(&p0_prefix).await;
    for round in 0..8 {
        let c = if round % 2 == 0 { &a } else { &b };
        for id in ["p0", "d0"] {
            let (status, body) = c.heartbeat(id).await;
            assert_eq!(status, 200, "heartbeat {id} via {}: {body}", if round % 2 == 0 { "A" } else { "B" });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    for c in [&a, &b] {
        let alive = c.alive().await;
        assert_eq!((alive.get("p0"), alive.get("d0")), (Some(&true), Some(&true)));
    }

    // B ingested p0's events itself and pairs by them.
    eventually(Duration::from_secs(5), "B indexed p0", || async { b.indexed("p0").await == 10 }).await;
    assert_eq!(a.indexed("p0").await, 10);
    let mut prompt = p0_prefix.clone();
    prompt.extend(tokens(5000, 320));
    let (status, d) = b.pair(&json!({"request_id": "via-b", "model": MODEL, "token_ids": prompt})).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!((d["decode"]["id"].as_str(), d["prefill"]["id"].as_str()), (Some("d0"), Some("p0")));
    assert_eq!(d["prefill_overlap_blocks"], 10);

    // Heartbeats stop: the lease expires for both coordinators.
    let gone = eventually(Duration::from_secs(8), "both see the leases expire", || async {
        let (a_alive, b_alive) = (a.alive().await, b.alive().await);
        [a_alive.get("d0"), a_alive.get("p0"), b_alive.get("d0"), b_alive.get("p0")].iter().all(|v| *v == Some(&false))
    })
    .await;
    println!("lease expiry seen by both coordinators {gone:?} after the last heartbeat checks");
    for c in [&a, &b] {
        let (status, _) = c.pair(&json!({"request_id": "late", "model": MODEL})).await;
        assert_eq!(status, 503);
        assert_eq!(c.heartbeat("d0").await.0, 404, "dead engines register again");
    }

    // A graceful leave through B reaches A.
    b.register(&d0.spec("decode", None)).await;
    eventually(Duration::from_secs(5), "A sees d0 again", || async { a.alive().await.get("d0") == Some(&true) }).await;
    assert_eq!(b.delete("/v1/engines/d0").await, 204);
    eventually(Duration::from_secs(5), "A sees d0 leave", || async { a.alive().await.get("d0") == Some(&false) }).await;
    assert_eq!(a.metric("pd_coordinator_store_errors_total").await, 0.0);
}
