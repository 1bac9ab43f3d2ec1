//! Sidecar-pull mode: the pool lives in a shared-memory file; a co-located process (here the
//! test) writes blocks into reserved pool blocks, and the decode request adopts them.

mod common;

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use common::{prefill_body, words, Sim, WAIT};
use pd_protocols::hash::none_hash;
use pd_sim::content;
use pd_sim::engine::Prompt;
use pd_sim::tokenizer::Tokenizer;
use serde_json::{json, Value};
use xfer::SharedFile;

async fn reserve(s: &Sim, n: usize) -> (String, Vec<u64>) {
    let (status, r) = s.post("/admin/reserve", &json!({"num_blocks": n})).await;
    assert_eq!(status, 200, "{r}");
    let ids = r["block_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    (r["reservation_id"].as_str().unwrap().to_string(), ids)
}

fn decode_body(prompt: &str, reservation: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 2,
           "kv_transfer_params": {"do_remote_prefill": true, "reservation_id": reservation}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preloaded_blocks_are_verified_and_adopted() {
    let path = std::env::temp_dir().join(format!("pd-sim-sidecar-{}", std::process::id()));
    let s = Sim::start(&["--shm-path", path.to_str().unwrap(), "--kv-load-failure-policy", "fail"]).await;
    let pool = common::get_json(&format!("{}/admin/pool", s.url)).await;
    assert_eq!(pool["shm_path"], path.to_str().unwrap());
    let block_bytes = pool["block_bytes"].as_u64().unwrap();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();

    let prompt_text = words(40, "side");
    let tokens = Tokenizer::Simple.encode(&prompt_text).unwrap();
    let prompt = Prompt::new(&none_hash(None), tokens, 16);
    let (id, ids) = reserve(&s, prompt.num_blocks()).await;
    let mut block = vec![0u8; block_bytes as usize];
    for (i, &b) in ids.iter().enumerate() {
        content::fill(prompt.content_digest(i), &mut block);
        file.write_all_at(&block, b * block_bytes).unwrap();
    }
    let (status, out) = s.post("/v1/completions", &decode_body(&prompt_text, &id)).await;
    assert_eq!(status, 200, "{out}");
    let r = s.leaks().await;
    assert_eq!((r["verification_failures"].clone(), r["recomputed"].clone()), (json!(0), json!(0)), "{r}");
    assert_eq!((r["used_blocks"].clone(), r["active_leases"].clone()), (json!(0), json!(0)), "{r}");
    assert!(s.metrics().await.contains("source=\"external_kv_transfer\"} 40\n"));

    // Garbage in the reserved blocks, or an unknown reservation: refused under `fail`.
    let (id, ids) = reserve(&s, prompt.num_blocks()).await;
    file.write_all_at(&vec![0xAB; block_bytes as usize], ids[0] * block_bytes).unwrap();
    let (status, err) = s.post("/v1/completions", &decode_body(&prompt_text, &id)).await;
    assert_eq!(status, 500, "{err}");
    let (status, _) = s.post("/v1/completions", &decode_body(&prompt_text, "res-unknown")).await;
    assert_eq!(status, 500);
    let r = s.leaks().await;
    assert_eq!((r["verification_failures"].clone(), r["used_blocks"].clone()), (json!(1), json!(0)), "{r}");
    drop(s); // killed: the file outlives the process
    let _ = std::fs::remove_file(&path);
}

/// The whole sidecar-pull path with a second process's own xfer agent (this test): map the
/// decode engine's pool file, register it, pull the prefill engine's blocks into blocks the
/// decode reserved, release the prefill with the done notification, then decode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_colocated_agent_pulls_into_the_shared_pool() {
    let path = std::env::temp_dir().join(format!("pd-sim-sidecar-pull-{}", std::process::id()));
    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--shm-path", path.to_str().unwrap(), "--kv-load-failure-policy", "fail"]).await;
    let prompt_text = words(100, "pull");
    let (status, prefilled) = p.post("/v1/completions", &prefill_body(&prompt_text)).await;
    assert_eq!(status, 200, "{prefilled}");
    let kv = &prefilled["kv_transfer_params"];
    let remote_ids: Vec<u64> =
        kv["remote_block_ids"][0].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
    let side_channel = format!("{}:{}", kv["remote_host"].as_str().unwrap(), kv["remote_port"]);
    let remote_request = kv["remote_request_id"].as_str().unwrap().to_string();
    let block_bytes = common::get_json(&format!("{}/admin/pool", d.url)).await["block_bytes"].as_u64().unwrap();
    let (reservation, local_ids) = reserve(&d, remote_ids.len()).await;

    let pool = Arc::new(SharedFile::open(&path).unwrap());
    let moved = tokio::task::spawn_blocking(move || {
        let agent = xfer::Agent::new("sidecar-under-test").unwrap();
        agent.add_backend("tcp", xfer::BackendParams::new().with("listen", "127.0.0.1:0")).unwrap();
        let registration = agent.register_buffer(&pool).unwrap();
        let peer = agent.fetch_remote_metadata(&side_channel).unwrap();
        let (_, remote_pool) = agent.remote_regions(&peer).unwrap()[0];
        let local: Vec<xfer::Desc> =
            local_ids.iter().map(|&b| xfer::Desc::new(pool.addr() + b * block_bytes, block_bytes, 0)).collect();
        let remote: Vec<xfer::Desc> =
            remote_ids.iter().map(|&b| xfer::Desc::new(remote_pool.addr + b * block_bytes, block_bytes, 0)).collect();
        let request = agent.create_request(xfer::Op::Read, &local, &peer, &remote, Default::default()).unwrap();
        request.post().unwrap();
        request.wait(WAIT).unwrap();
        agent.send_notif(&peer, pd_protocols::kv_params::done_notification(&remote_request, 1).as_bytes()).unwrap();
        let bytes = request.telemetry().unwrap().bytes;
        drop(registration);
        bytes
    })
    .await
    .unwrap();
    assert_eq!(moved, 7 * block_bytes, "100 tokens = 7 blocks of 16 (the last one partial)");

    let (status, out) = d.post("/v1/completions", &decode_body(&prompt_text, &reservation)).await;
    assert_eq!(status, 200, "{out}");
    let r = d.leaks().await;
    assert_eq!((r["verification_failures"].clone(), r["recomputed"].clone()), (json!(0), json!(0)), "{r}");
    p.leaks_until("the prefill's blocks freed by the done notification", |r| r["held_blocks"] == json!(0)).await;
    drop(d);
    let _ = std::fs::remove_file(&path);
}
