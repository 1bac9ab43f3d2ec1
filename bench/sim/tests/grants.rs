//! Revocable grants between simulator processes: a prefill told its decode's agent grants it
//! exactly the held blocks; release, lease expiry and cancellation revoke the grant before the
//! blocks are reused, so a decode that reads late is refused (no byte arrives) and recomputes or
//! fails by `--late-read-policy`. It never answers with tokens decoded from other bytes.

mod common;

use common::{prefill_body, words, Sim};
use serde_json::{json, Value};
use xfer::{Agent, BackendParams};

/// A pool of 8 blocks: a second 7-block prompt must reuse the first one's blocks.
const SMALL_POOL: &str = "8";
/// 100 one-word tokens: 7 blocks of 16.
const PROMPT_WORDS: usize = 100;

/// The prefill call of a proxy that names the decode's agent (`remote_engine_id`).
async fn prefill_for(p: &Sim, prompt: &str, decode_agent: &str) -> Value {
    let mut body = prefill_body(prompt);
    body["kv_transfer_params"]["remote_engine_id"] = json!(decode_agent);
    let (status, out) = p.post("/v1/completions", &body).await;
    assert_eq!(status, 200, "{out}");
    out["kv_transfer_params"].clone()
}

async fn decode(d: &Sim, prompt: &str, kv: &Value) -> (u16, Value) {
    d.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4, "kv_transfer_params": kv})).await
}

/// The answer a single engine computes for the prompt on its own: the only right one.
async fn plain_text(sim: &Sim, prompt: &str) -> Value {
    let (status, out) = sim.post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 4})).await;
    assert_eq!(status, 200, "{out}");
    out["choices"][0]["text"].clone()
}

/// Refills the prefill's freed blocks with another prompt (held under a lease of its own).
async fn reuse_blocks(p: &Sim, salt: &str) {
    prefill_for(p, &words(PROMPT_WORDS, salt), "nobody").await;
    let r = p.leaks().await;
    assert_eq!(r["held_blocks"], 7, "the other prompt holds the reused blocks: {r}");
}

fn pair(r: &Value, a: &str, b: &str) -> (Value, Value) {
    (r[a].clone(), r[b].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_under_grants_and_late_reads_after_release_are_refused() {
    let p = Sim::start(&["--num-blocks", SMALL_POOL]).await;
    // Any failure other than a late read would answer 500 here, not recompute.
    let d = Sim::start(&["--engine-id", "decode-g1", "--kv-load-failure-policy", "fail"]).await;
    let prompt = words(PROMPT_WORDS, "g");

    // The normal path: granted, read under the grant, released, revoked.
    let kv = prefill_for(&p, &prompt, "decode-g1").await;
    let token = kv[pd_protocols::kv_params::GRANT_KEY].as_str().expect("a grant token in the params");
    assert!(token.len() > 7 * 32, "a token naming 7 ranges: {token}");
    let (status, out) = decode(&d, &prompt, &kv).await;
    assert_eq!(status, 200, "{out}");
    let dl = d.leaks().await;
    assert_eq!(pair(&dl, "pulls", "bytes_pulled"), (json!(1), json!(7 * 16 * 256)));
    assert_eq!(pair(&dl, "late_reads_refused", "recomputed"), (json!(0), json!(0)));
    let pl = p.leaks_until("prefill releases", |r| r["used_blocks"] == 0).await;
    assert_eq!(pair(&pl, "grants_issued", "grants_revoked"), (json!(1), json!(1)));
    let right = plain_text(&p, &prompt).await;
    assert_eq!(out["choices"][0]["text"], right);

    // The same params again, after the release and after the blocks now hold another prompt:
    // refused before any byte moved, recomputed, right answer.
    reuse_blocks(&p, "other").await;
    let (status, late) = decode(&d, &prompt, &kv).await;
    assert_eq!(status, 200, "{late}");
    assert_eq!(late["choices"][0]["text"], right, "tokens from the prompt's own KV");
    let dl = d.leaks().await;
    assert_eq!(pair(&dl, "late_reads_refused", "recomputed"), (json!(1), json!(1)));
    assert_eq!(pair(&dl, "verification_failures", "pulls"), (json!(0), json!(1)), "no byte of the late read arrived");
    assert_eq!(dl["used_blocks"], 0);
    assert!(d.metrics().await.contains("pdsim:late_reads_refused_total{"), "the refusal is a metric");

    // For comparison, a prefill without grants: the late read delivers the reused bytes, and
    // only the content check stands between them and the answer.
    let old = Sim::start(&["--num-blocks", SMALL_POOL, "--no-kv-grants"]).await;
    let d2 = Sim::start(&["--engine-id", "decode-g1b"]).await;
    let kv = prefill_for(&old, &prompt, "decode-g1b").await;
    assert!(kv.get(pd_protocols::kv_params::GRANT_KEY).is_none(), "{kv}");
    assert_eq!(decode(&d2, &prompt, &kv).await.0, 200);
    old.leaks_until("release", |r| r["used_blocks"] == 0).await;
    reuse_blocks(&old, "other").await;
    let (status, late) = decode(&d2, &prompt, &kv).await;
    assert_eq!((status, late["choices"][0]["text"].clone()), (200, right));
    let dl = d2.leaks().await;
    assert_eq!(pair(&dl, "late_reads_refused", "verification_failures"), (json!(0), json!(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_reads_after_expiry_recompute_or_fail_by_policy() {
    let p = Sim::start(&["--num-blocks", SMALL_POOL, "--kv-lease-secs", "0.5"]).await;
    let recompute = Sim::start(&["--engine-id", "decode-g2", "--kv-load-failure-policy", "fail"]).await;
    let fail = Sim::start(&["--engine-id", "decode-g2f", "--late-read-policy", "fail"]).await;
    let prompt = words(PROMPT_WORDS, "e");
    let right = plain_text(&p, &prompt).await;

    for (d, name) in [(&recompute, "decode-g2"), (&fail, "decode-g2f")] {
        let kv = prefill_for(&p, &prompt, name).await;
        let pl = p.leaks_until("the lease expires", |r| r["active_leases"] == 0 && r["used_blocks"] == 0).await;
        assert_eq!(pl["grants_revoked"], pl["grants_issued"], "{pl}");
        // Another prompt takes the blocks; its lease expires too before the next round.
        reuse_blocks(&p, &format!("other-{name}")).await;
        let (status, out) = decode(d, &prompt, &kv).await;
        let dl = d.leaks().await;
        assert_eq!(pair(&dl, "late_reads_refused", "verification_failures"), (json!(1), json!(0)), "{name}");
        if name == "decode-g2" {
            assert_eq!((status, out["choices"][0]["text"].clone()), (200, right.clone()));
            assert_eq!(dl["recomputed"], 1);
        } else {
            assert_eq!(status, 500, "{out}");
            let message = out["error"]["message"].as_str().unwrap();
            assert!(message.contains("revoked"), "a clear error: {message}");
            assert!(out.get("choices").is_none(), "no tokens at all: {out}");
            assert_eq!(dl["recomputed"], 0);
        }
        assert_eq!(dl["used_blocks"], 0);
        p.leaks_until("the other lease expires", |r| r["active_leases"] == 0).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_lease_is_revoked_before_reuse() {
    let p = Sim::start(&["--num-blocks", SMALL_POOL]).await;
    let d = Sim::start(&["--engine-id", "decode-g3", "--kv-load-failure-policy", "fail"]).await;
    let prompt = words(PROMPT_WORDS, "c");
    let right = plain_text(&p, &prompt).await;
    let kv = prefill_for(&p, &prompt, "decode-g3").await;

    // A proxy whose client left cancels as the sidecar does: the "done" notification from an
    // agent of its own, over xfer.
    let canceller = Agent::new("canceller").unwrap();
    canceller.add_backend("tcp", BackendParams::new()).unwrap();
    let side = format!("{}:{}", kv["remote_host"].as_str().unwrap(), kv["remote_port"]);
    let prefill_agent = canceller.fetch_remote_metadata(&side).unwrap();
    let done = pd_protocols::kv_params::done_notification(kv["remote_request_id"].as_str().unwrap(), 1);
    canceller.send_notif(&prefill_agent, done.as_bytes()).unwrap();
    let pl = p.leaks_until("the cancelled lease ends", |r| r["used_blocks"] == 0).await;
    assert_eq!(pair(&pl, "leases_done", "grants_revoked"), (json!(1), json!(1)));

    reuse_blocks(&p, "after-cancel").await;
    let (status, out) = decode(&d, &prompt, &kv).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(out["choices"][0]["text"], right);
    let dl = d.leaks().await;
    assert_eq!(pair(&dl, "late_reads_refused", "recomputed"), (json!(1), json!(1)));
    assert_eq!(dl["verification_failures"], 0);
}
