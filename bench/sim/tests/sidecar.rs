//! Sidecar-pull mode: the pool lives in a shared-memory file; a co-located process (here the
//! test) writes blocks into reserved pool blocks, and the decode request adopts them.

mod common;

use std::os::unix::fs::FileExt;

use common::{words, Sim};
use pd_protocols::hash::none_hash;
use pd_sim::content;
use pd_sim::engine::Prompt;
use pd_sim::tokenizer::Tokenizer;
use serde_json::{json, Value};

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
