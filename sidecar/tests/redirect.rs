//! Redirects to the decode engine the coordinator chose, over real processes: a real
//! `pd-coordinator` (the test fails when it is not built), `pd-sim` engines publishing KV events, and a
//! `pd-sidecar` per engine. A request entering decode sidecar A whose prompt is cached on decode
//! engine B is decoded on B through B's sidecar (which neither pairs it again nor redirects it
//! again, and reports on it alone); a request marked as redirected is never paired or redirected;
//! a chosen decode whose sidecar cannot be reached leaves the request to A.

mod common;

use common::{eventually, free_port, metric_sum, post_text, sse_text, Coordinator, Sidecar, Sim};
use serde_json::json;

const MODEL: &str = "sim-model";

/// An engine with KV events on, and its sidecar registered with the coordinator.
struct Member {
    sim: Sim,
    sidecar: Sidecar,
}

/// Starts an engine and its sidecar as `id` with `role`; the sidecar advertises `advertise`
/// (its own URL when `None`).
async fn member(
    coordinator: &str,
    id: &str,
    role: &str,
    prefill: Option<&Sim>,
    advertise: Option<String>,
    sim_args: &[&str],
) -> Member {
    let events = free_port();
    let endpoint = format!("tcp://*:{events}");
    let sim = Sim::start(&[&["--kv-events-endpoint", endpoint.as_str()], sim_args].concat()).await;
    let port = free_port();
    let advertise = advertise.unwrap_or_else(|| format!("http://127.0.0.1:{port}"));
    let kv_events = format!("tcp://127.0.0.1:{events}");
    let mut args = vec![
        "--engine",
        &sim.url,
        "--coordinator",
        coordinator,
        "--engine-id",
        id,
        "--role",
        role,
        "--model",
        MODEL,
        "--node",
        "local",
        "--advertise-url",
        &advertise,
        "--kv-events",
        &kv_events,
    ];
    let prefill_addr = prefill.map(Sim::addr);
    if let Some(p) = &prefill_addr {
        args.extend(["--prefill", p]);
    }
    let sidecar = Sidecar::start_on(port, &args).await;
    Member { sim, sidecar }
}

fn tokens(from: u32, n: u32) -> Vec<u32> {
    (from..from + n).collect()
}

/// `prefix` followed by one block of fresh tokens.
fn extended(prefix: &[u32], fresh: u32) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend(tokens(fresh, 16));
    p
}

async fn sim_metric(sim: &Sim, name: &str, labels: &str) -> f64 {
    metric_sum(&sim.metrics().await, name, labels)
}

/// Caches `prompt` on `m`'s engine (directly) and waits until the coordinator indexed it.
async fn cache_on(coordinator: &Coordinator, m: &Member, id: &str, prompt: &[u32]) {
    let (status, out) =
        common::post(&format!("{}/v1/completions", m.sim.url), &json!({"prompt": prompt, "max_tokens": 1})).await;
    assert_eq!(status, 200, "{out}");
    let blocks = prompt.len() as u64 / 16;
    eventually(&format!("{id}'s blocks indexed"), || async {
        let stats = coordinator.get("/v1/index/stats").await;
        (stats["models"][MODEL]["engines"][id].as_u64().unwrap_or(0) >= blocks).then_some(())
    })
    .await;
}

/// A streamed completion of `prompt` at `url` (status, body text).
async fn streamed(url: &str, prompt: &[u32], headers: &[(&str, &str)]) -> (u16, String) {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": true});
    post_text(&format!("{url}/v1/completions"), &body, headers).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_to_the_decode_holding_the_prefix() {
    let coordinator = Coordinator::start(&["--heartbeat-ms", "200"]).await;
    let c = coordinator.url.clone();
    let prefill = member(&c, "pre", "prefill", None, None, &[]).await;
    let a = member(&c, "dec-a", "decode", Some(&prefill.sim), None, &[]).await;
    // dec-b decodes 20 ms per token, so a long answer is still streaming when its client leaves.
    let b = member(&c, "dec-b", "decode", Some(&prefill.sim), None, &["--decode-us-per-token", "20000"]).await;
    // dec-c's sidecar advertises a port nothing listens on: a decode sidecar that is down.
    let down = Some(format!("http://127.0.0.1:{}", free_port()));
    let cdown = member(&c, "dec-c", "decode", Some(&prefill.sim), down, &[]).await;
    eventually("all registered and alive", || async {
        let v = coordinator.get("/v1/engines").await;
        let all = v.as_array()?;
        (all.len() == 4 && all.iter().all(|e| e["alive"] == true)).then_some(())
    })
    .await;

    // A prompt whose 20-block prefix only dec-b holds, entering through dec-a's sidecar.
    let on_b = tokens(1000, 320);
    cache_on(&coordinator, &b, "dec-b", &on_b).await;
    let b_ok_before = sim_metric(&b.sim, "vllm:request_success_total", "").await;
    let prompt = extended(&on_b, 5000);
    let (status, text) = streamed(&a.sidecar.url, &prompt, &[("x-request-id", "redir-1")]).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");

    // Decoded on dec-b (which found the prefix in its own cache), nothing on dec-a.
    assert_eq!(sim_metric(&b.sim, "vllm:request_success_total", "").await, b_ok_before + 1.0);
    assert!(sim_metric(&b.sim, "vllm:prompt_tokens_by_source_total", "local_cache_hit").await >= 320.0);
    assert_eq!(sim_metric(&a.sim, "vllm:request_success_total", "").await, 0.0);
    assert_eq!(a.sidecar.metric("pd_sidecar_redirects_total{outcome=\"ok\"}").await, 1.0);
    assert_eq!(a.sidecar.metric("pd_sidecar_pairings_total").await, 1.0);
    // dec-b's sidecar served it without pairing again or redirecting again.
    assert_eq!(b.sidecar.metric("pd_sidecar_redirects_total{outcome=\"received\"}").await, 1.0);
    assert_eq!(b.sidecar.metric("pd_sidecar_pairings_total").await, 0.0);
    assert_eq!(b.sidecar.metric("pd_sidecar_redirects_total{outcome=\"ok\"}").await, 0.0);
    assert_eq!(b.sidecar.metric("pd_sidecar_requests_total{outcome=\"ok\"}").await, 1.0);
    // One pairing at the coordinator, settled by dec-b's report alone.
    let coord_metrics = coordinator.metrics().await;
    assert_eq!(metric_sum(&coord_metrics, "pd_coordinator_pair_decisions_total", ""), 1.0, "{coord_metrics}");
    eventually("the handoff settled", || async {
        let m = coordinator.metrics().await;
        (metric_sum(&m, "pd_coordinator_handoffs_in_flight", "") == 0.0).then_some(())
    })
    .await;
    // decode_started and finished (sent independently: either may land first).
    eventually("both reports", || async {
        let m = coordinator.metrics().await;
        (metric_sum(&m, "pd_coordinator_reports_total", "") == 2.0).then_some(())
    })
    .await;

    // The text is the engine's answer to the same prompt.
    let (_, reference) = streamed(&prefill.sim.url, &prompt, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&reference));
    assert!(!sse_text(&text).is_empty());

    // A client leaving mid-stream cancels the redirected leg: dec-b's sidecar and engine stop.
    let body = json!({"model": MODEL, "prompt": extended(&on_b, 5500), "max_tokens": 2000, "stream": true});
    let mut r = common::client().post(format!("{}/v1/completions", a.sidecar.url)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(!r.chunk().await.unwrap().unwrap_or_default().is_empty());
    drop(r);
    eventually("the redirected leg cancelled", || async {
        let cancelled = "pd_sidecar_requests_total{outcome=\"cancelled\"}";
        let done = a.sidecar.metric(cancelled).await == 1.0
            && b.sidecar.metric(cancelled).await == 1.0
            && b.sim.leaks().await["running"] == 0;
        done.then_some(())
    })
    .await;

    // Loop guard: a request marked as redirected is served here, neither paired nor redirected,
    // even though its prompt is dec-b's.
    let again = extended(&on_b, 6000);
    let (status, text) = streamed(&a.sidecar.url, &again, &[("x-pd-redirected", "prefill")]).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(a.sidecar.metric("pd_sidecar_pairings_total").await, 2.0, "only the two requests before");
    assert_eq!(a.sidecar.metric("pd_sidecar_redirects_total{outcome=\"ok\"}").await, 2.0);
    assert_eq!(a.sidecar.metric("pd_sidecar_redirects_total{outcome=\"received\"}").await, 1.0);
    assert_eq!(sim_metric(&a.sim, "vllm:request_success_total", "").await, 1.0);
    assert_eq!(a.sidecar.metric("pd_sidecar_disaggregated_total").await, 1.0, "prefilled on the static prefill");

    // A chosen decode whose sidecar is down: served here (prefill leg included), counted.
    let on_c = tokens(9000, 320);
    cache_on(&coordinator, &cdown, "dec-c", &on_c).await;
    let prompt = extended(&on_c, 7000);
    let (status, text) = streamed(&a.sidecar.url, &prompt, &[]).await;
    assert_eq!(status, 200, "{text}");
    let (_, reference) = streamed(&prefill.sim.url, &prompt, &[]).await;
    assert_eq!(sse_text(&text), sse_text(&reference));
    assert_eq!(a.sidecar.metric("pd_sidecar_redirects_total{outcome=\"fallback_unreachable\"}").await, 1.0);
    assert_eq!(sim_metric(&a.sim, "vllm:request_success_total", "").await, 2.0);
    assert_eq!(a.sidecar.metric("pd_sidecar_disaggregated_total").await, 2.0, "not the whole prompt on dec-a");
}
