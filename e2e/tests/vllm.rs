//! The suite against a real vLLM (CPU build, `ci/vllm/`): one real prefill and one real decode,
//! with `pd-sidecar` in front of the decode (the prefill from its static list), are started once
//! for the whole binary (a shared fixture) and every test uses them. Tests run in name order with
//! `--test-threads 1`; the one that kills the prefill runs last.
//!
//! Both engines run the connector `PD_VLLM_CONNECTOR` names: vLLM's NixlConnector (default) or
//! `xfer`, pd_xfer's XferConnector (the same protocol over xfer; `PD_XFER_SITE`, `PD_XFER_BACKEND`;
//! `PD_XFER_MUTUAL_TLS=1` runs its TCP backend with mutual TLS under a CA made for the run): the
//! test command runs the suite once with each, the TCP one with mutual TLS.
//!
//! Without `PD_VLLM_VENV` every test prints a loud SKIPPED line and passes.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pd_e2e::outcome::{tally_after_kill, KillTally, Outcome};
use pd_e2e::*;
use pd_protocols::hash::{block_hashes, event_id, none_hash};
use serde_json::{json, Value};

const MODEL: &str = "tiny-llama";
const BLOCK_SIZE: u32 = 32; // the CPU attention backend needs a multiple of 32
const START_TIMEOUT: Duration = Duration::from_secs(420);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

fn timing(what: &str, d: Duration) {
    loud(&format!("TIMING vllm-e2e: {what}: {:.2} s", d.as_secs_f64()));
}

struct Cluster {
    prefill: Mutex<Engine>,
    decode: Mutex<Engine>,
    sidecar: Mutex<Proc>,
    sidecar_url: String,
    /// `pd-coordinator` with both engines registered (role both, their KV events ingested).
    _coordinator: Mutex<Proc>,
    coordinator_url: String,
}

/// The sidecar's bounds, short so that a failure test ends quickly: the documented worst case
/// of one request is connect + prefill timeout (per attempt) + the local decode.
const SIDECAR_CONNECT_TIMEOUT: &str = "1s";
const SIDECAR_PREFILL_TIMEOUT: &str = "10s";
/// Every request through the sidecar must end within this, by failover or a clear error.
const REQUEST_BOUND: Duration = Duration::from_secs(30);

impl Cluster {
    fn prefill(&self) -> MutexGuard<'_, Engine> {
        self.prefill.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn decode(&self) -> MutexGuard<'_, Engine> {
        self.decode.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn prefill_url(&self) -> String {
        self.prefill().url()
    }
    fn decode_url(&self) -> String {
        self.decode().url()
    }
    fn sidecar_alive(&self) -> bool {
        self.sidecar.lock().unwrap_or_else(|p| p.into_inner()).running()
    }
}

static CLUSTER: OnceLock<Result<Cluster, E2eError>> = OnceLock::new();

fn start_cluster() -> Result<Cluster, E2eError> {
    let t0 = Instant::now();
    let settings = VllmSettings::from_env()?;
    timing("model ready", t0.elapsed());
    let base = settings.port_base;
    let spec = |name: &str, offset: u16, core: u32| EngineSpec {
        name: name.to_string(),
        port: base + offset,
        side_port: base + 10 + offset,
        core,
        events_port: Some(base + 20 + 2 * offset),
        events_collector: None,
        block_size: BLOCK_SIZE,
    };
    // The decode engine publishes the way llm-d wires vLLM: its endpoint names the coordinator,
    // so it connects to the coordinator's --kv-events-listen socket under `kv@<engine>@<model>`;
    // the prefill binds its own publisher (t2 subscribes to it directly).
    let collector = format!("tcp://127.0.0.1:{}", base + 42);
    let decode_spec = EngineSpec {
        events_collector: Some((collector.clone(), format!("kv@vllm-decode@{MODEL}"))),
        ..spec("vllm-decode", 1, 1)
    };
    let sidecar_bin = workspace_bin("pd-sidecar", "pd-sidecar")?;
    let coordinator_bin = workspace_bin("pd-coordinator", "pd-coordinator")?;
    let t1 = Instant::now();
    // Both start together (one core each): the start is mostly single-threaded Python.
    let mut prefill = Engine::spawn(&settings, spec("vllm-prefill", 0, 0))?;
    let mut decode = Engine::spawn(&settings, decode_spec)?;
    prefill.wait_healthy(START_TIMEOUT)?;
    decode.wait_healthy(START_TIMEOUT.saturating_sub(t1.elapsed()))?;
    timing("prefill + decode started (in parallel)", t1.elapsed());
    loud(&format!(
        "vllm-e2e ({}): prefill {} ({:.0} s), decode {} ({:.0} s); logs in {}",
        settings.connector,
        prefill.url(),
        prefill.started_in.as_secs_f64(),
        decode.url(),
        decode.started_in.as_secs_f64(),
        log_dir().display()
    ));
    let sidecar_addr = format!("127.0.0.1:{}", base + 30);
    let args: Vec<String> = [
        ["--listen", &sidecar_addr, "--mode", "vllm"].as_slice(),
        &["--engine", &decode.url(), "--prefill", &prefill.url()],
        &["--block-size", &BLOCK_SIZE.to_string(), "--fallback", "local"],
        &["--connect-timeout", SIDECAR_CONNECT_TIMEOUT, "--prefill-timeout", SIDECAR_PREFILL_TIMEOUT],
    ]
    .concat()
    .into_iter()
    .map(String::from)
    .collect();
    let mut sidecar = Proc::spawn("pd-sidecar", &sidecar_bin, &args, &[("RUST_LOG", "info")])?;
    let sidecar_url = format!("http://{sidecar_addr}");
    let took = wait_http_ok(&mut sidecar, &format!("{sidecar_url}/ready"), Duration::from_secs(30))?;
    timing("sidecar ready", took);

    let coordinator_addr = format!("127.0.0.1:{}", base + 40);
    let args: Vec<String> =
        ["--listen", &coordinator_addr, "--no-grpc", "--health-interval-ms", "500", "--lease-ms", "3000"]
            .into_iter()
            .chain(["--kv-events-listen", collector.as_str()])
            .map(String::from)
            .collect();
    let mut coordinator = Proc::spawn("pd-coordinator", &coordinator_bin, &args, &[("RUST_LOG", "info")])?;
    let coordinator_url = format!("http://{coordinator_addr}");
    wait_http_ok(&mut coordinator, &format!("{coordinator_url}/health"), Duration::from_secs(30))?;
    for engine in [&prefill, &decode] {
        register(&coordinator_url, engine)?;
    }
    Ok(Cluster {
        prefill: Mutex::new(prefill),
        decode: Mutex::new(decode),
        sidecar: Mutex::new(sidecar),
        sidecar_url,
        _coordinator: Mutex::new(coordinator),
        coordinator_url,
    })
}

/// Registers a real engine with the coordinator (no sidecar: the coordinator health-checks it).
fn register(coordinator: &str, engine: &Engine) -> Result<(), E2eError> {
    let spec = json!({
        "id": engine.spec.name, "role": "both", "node": "local", "model": MODEL,
        "engine_url": engine.url(), "kv_events": engine.events_endpoint(), "replay": engine.replay_endpoint(),
        "block_size": BLOCK_SIZE,
    });
    register_engine(coordinator, &spec)
}

/// The shared fixture, or `None` (after a loud SKIPPED line) when the suite cannot run here.
fn cluster(test: &str) -> Option<&'static Cluster> {
    shared_fixture(&CLUSTER, start_cluster, ("vLLM", "PD_VLLM_VENV", SKIP_HOW), test)
}

async fn reset_prefix_cache(client: &reqwest::Client, base: &str) {
    let resp = client
        .post(format!("{base}/reset_prefix_cache"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .expect("POST /reset_prefix_cache");
    assert!(resp.status().is_success(), "reset_prefix_cache: {}", resp.status());
}

async fn tokenize(client: &reqwest::Client, base: &str, prompt: &str) -> Vec<u32> {
    let (status, body) =
        post_json(client, &format!("{base}/tokenize"), &json!({"model": MODEL, "prompt": prompt}), REQUEST_TIMEOUT)
            .await
            .expect("tokenize");
    assert_eq!(status, 200, "tokenize: {body}");
    let v: Value = serde_json::from_str(&body).expect("tokenize json");
    v["tokens"].as_array().expect("tokens").iter().map(|t| t.as_u64().expect("token id") as u32).collect()
}

fn request_body(chat: bool, prompt: &str, stream: bool) -> Value {
    let mut body = if chat {
        json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}]})
    } else {
        json!({"model": MODEL, "prompt": prompt})
    };
    body["max_tokens"] = json!(12);
    body["temperature"] = json!(0);
    body["stream"] = json!(stream);
    body
}

fn path(chat: bool) -> &'static str {
    if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    }
}

/// The two legs of a P/D request done by the test itself (the protocol of PROTOCOLS.md §1).
async fn pd_by_hand(
    client: &reqwest::Client,
    prefill: &str,
    decode: &str,
    route: &str,
    body: &Value,
) -> Result<(u16, String), E2eError> {
    let mut first = body.clone();
    first["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    first["stream"] = json!(false);
    first.as_object_mut().expect("object").remove("stream_options");
    first["max_tokens"] = json!(1);
    let (status, text) = post_json(client, &format!("{prefill}{route}"), &first, REQUEST_TIMEOUT).await?;
    if status != 200 {
        return Err(E2eError::Status { what: "prefill leg".into(), status, body: text });
    }
    let answer: Value = serde_json::from_str(&text).map_err(E2eError::json("the prefill's answer"))?;
    let params = answer["kv_transfer_params"].clone();
    if params.is_null() {
        return Err(E2eError::Answer { what: "prefill returned no kv_transfer_params", body: text });
    }
    let mut second = body.clone();
    second["kv_transfer_params"] = params;
    post_json(client, &format!("{decode}{route}"), &second, REQUEST_TIMEOUT).await
}

const XFER_COUNT: &str = "vllm:nixl_xfer_time_seconds_count";
const XFER_BYTES: &str = "vllm:nixl_bytes_transferred_sum";
const BY_SOURCE: &str = "vllm:prompt_tokens_by_source_total";
const EXTERNAL: (&str, &str) = ("source", "external_kv_transfer");

/// The protocol itself (PROTOCOLS.md §1) driven by the test, no sidecar: tells an engine problem
/// apart from a sidecar problem when t1 fails.
#[test]
fn t0_pd_protocol_by_hand() {
    let Some(c) = cluster("t0_pd_protocol_by_hand") else { return };
    runtime().block_on(async {
        let client = client();
        let (prefill, decode) = (c.prefill_url(), c.decode_url());
        let prompt = fresh_prompt("by-hand", 90);
        let body = request_body(false, &prompt, false);
        let (status, plain) = post_json(&client, &format!("{decode}/v1/completions"), &body, REQUEST_TIMEOUT)
            .await
            .expect("plain request");
        assert_eq!(status, 200, "{plain}");
        let reference = response_text(&serde_json::from_str(&plain).expect("json"));
        reset_prefix_cache(&client, &decode).await;
        let xfers = metric(&client, &decode, XFER_COUNT, &[]).await;
        let (status, text) = pd_by_hand(&client, &prefill, &decode, "/v1/completions", &body).await.expect("P/D");
        assert_eq!(status, 200, "{text}");
        assert_eq!(response_text(&serde_json::from_str(&text).expect("json")), reference);
        let after = wait_metric(&client, &decode, XFER_COUNT, &[], Duration::from_secs(10), |v| v > xfers).await;
        assert!(after > xfers, "the decode made no KV transfer");
    });
}

#[test]
fn t1_pd_through_sidecar_completions_and_chat_streaming_and_not() {
    let Some(c) = cluster("t1_pd_through_sidecar_completions_and_chat_streaming_and_not") else { return };
    runtime().block_on(async {
        let client = client();
        let (decode, sidecar) = (c.decode_url(), c.sidecar_url.clone());
        for (chat, stream) in [(false, false), (false, true), (true, false), (true, true)] {
            let t0 = Instant::now();
            let what = format!("{} stream={stream}", path(chat));
            let prompt = fresh_prompt("pd", 90);
            // Reference: the same request served by the decode alone, then its cache emptied so
            // that the P/D request must pull every block.
            let (status, plain) =
                post_json(&client, &format!("{decode}{}", path(chat)), &request_body(chat, &prompt, false), REQUEST_TIMEOUT)
                    .await
                    .expect("plain request");
            assert_eq!(status, 200, "{what}: plain request: {plain}");
            let plain: Value = serde_json::from_str(&plain).expect("json");
            let reference = response_text(&plain);
            let prompt_tokens = plain["usage"]["prompt_tokens"].as_f64().expect("usage.prompt_tokens");
            reset_prefix_cache(&client, &decode).await;

            let xfers = metric(&client, &decode, XFER_COUNT, &[]).await;
            let moved = metric(&client, &decode, XFER_BYTES, &[]).await;
            let external = metric(&client, &decode, BY_SOURCE, &[EXTERNAL]).await;
            let disaggregated = metric(&client, &sidecar, "pd_sidecar_disaggregated_total", &[]).await;
            let t_req = Instant::now();
            let (status, text) =
                post_json(&client, &format!("{sidecar}{}", path(chat)), &request_body(chat, &prompt, stream), REQUEST_TIMEOUT)
                    .await
                    .expect("request through the sidecar");
            let latency = t_req.elapsed();
            assert_eq!(status, 200, "{what}: through the sidecar: {text}");
            let text = if stream {
                sse_text(&text).expect("stream")
            } else {
                response_text(&serde_json::from_str(&text).expect("json"))
            };
            let xfers_after =
                wait_metric(&client, &decode, XFER_COUNT, &[], Duration::from_secs(10), |v| v > xfers).await;
            let external_after = wait_metric(&client, &decode, BY_SOURCE, &[EXTERNAL], Duration::from_secs(10), |v| {
                v >= external + prompt_tokens
            })
            .await;
            let disaggregated_after = metric(&client, &sidecar, "pd_sidecar_disaggregated_total", &[]).await;
            // The connector's telemetry (NIXL's, or xfer's through pd_xfer.nixl) counts every
            // block of the prompt, the last partial one included, each the same size.
            let moved_after = metric(&client, &decode, XFER_BYTES, &[]).await;
            let blocks = (prompt_tokens / f64::from(BLOCK_SIZE)).ceil();
            let moved_now = moved_after - moved;
            assert!(
                moved_now > 0.0 && moved_now % blocks == 0.0,
                "{what}: {XFER_BYTES} grew by {moved_now}, not a whole number of bytes for each of the prompt's {blocks} blocks"
            );

            assert!(
                xfers_after > xfers,
                "{what}: the decode made no KV transfer ({XFER_COUNT} {xfers} -> {xfers_after})"
            );
            assert_eq!(
                external_after - external,
                prompt_tokens,
                "{what}: external_kv_transfer prompt tokens must grow by the prompt length"
            );
            assert_eq!(disaggregated_after - disaggregated, 1.0, "{what}: the sidecar counted no disaggregation");
            assert_eq!(text, reference, "{what}: disaggregated text differs from the decode's own");
            assert!(!text.is_empty(), "{what}: empty text");
            timing(
                &format!(
                    "P/D through the sidecar {what} ({prompt_tokens} prompt tokens): request {:.0} ms, with reference + reset",
                    latency.as_secs_f64() * 1e3
                ),
                t0.elapsed(),
            );
        }
    });
}

#[test]
fn t2_kv_event_hashes_equal_ours() {
    let Some(c) = cluster("t2_kv_event_hashes_equal_ours") else { return };
    let rt = runtime();
    let (endpoint, base) = {
        let p = c.prefill();
        (p.events_endpoint().expect("events"), p.url())
    };
    let sub = Subscription::new(endpoint);
    // Let the subscription join (ZMQ's slow joiner) before the engine publishes.
    std::thread::sleep(Duration::from_millis(1000));
    let t0 = Instant::now();
    let prompt = fresh_prompt("events", 100);
    let tokens = rt.block_on(async {
        let client = client();
        let tokens = tokenize(&client, &base, &prompt).await;
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
        let (status, text) =
            post_json(&client, &format!("{base}/v1/completions"), &body, REQUEST_TIMEOUT).await.expect("request");
        assert_eq!(status, 200, "{text}");
        tokens
    });
    let bs = BLOCK_SIZE as usize;
    let ours: Vec<u64> = block_hashes(&none_hash(None), &tokens, bs).iter().map(event_id).collect();
    assert!(ours.len() >= 3, "prompt too short: {} tokens", tokens.len());
    let (theirs, stored_tokens, first_parent) = sub.stored_until(Duration::from_secs(15), |h| h.len() >= ours.len());
    timing(&format!("KV events of a {}-token prompt ({} blocks) received", tokens.len(), ours.len()), t0.elapsed());
    assert_eq!(first_parent, None, "the prompt's first block has no parent");
    assert!(theirs.len() >= ours.len(), "engine stored {} blocks, we hash {}", theirs.len(), ours.len());
    assert_eq!(
        &theirs[..ours.len()],
        &ours[..],
        "the engine's BlockStored hashes differ from pd_protocols' sha256_cbor chain"
    );
    assert_eq!(&stored_tokens[..ours.len() * bs], &tokens[..ours.len() * bs], "stored token ids differ from /tokenize");
}

const KV_USAGE: &str = "vllm:kv_cache_usage_perc";

/// A client that disconnects while its request sits between the two legs (the prefill done and
/// holding its blocks, the decode not started: the decode engine is paused with SIGSTOP). The
/// prefill's KV usage must come back to its baseline well before vLLM's 30 s lease would free it.
#[test]
fn t3_client_gone_between_legs_frees_prefill_blocks() {
    let Some(c) = cluster("t3_client_gone_between_legs_frees_prefill_blocks") else { return };
    let rt = runtime();
    rt.block_on(async {
        let client = client();
        let (prefill, sidecar) = (c.prefill_url(), c.sidecar_url.clone());
        let baseline = metric(&client, &prefill, KV_USAGE, &[]).await;
        let cancelled = ("outcome", "cancelled");
        let cancelled_before = metric(&client, &sidecar, "pd_sidecar_requests_total", &[cancelled]).await;
        let releases_before = metric(&client, &sidecar, "pd_sidecar_releases_ok_total", &[]).await;
        let refused_before = metric(&client, &sidecar, "pd_sidecar_releases_failed_total", &[]).await;
        let decode_pid = c.decode().proc.main_pid().expect("the decode's API server pid");
        let paused = Paused::new(decode_pid);
        let prompt = fresh_prompt("gone", 400);
        let body = request_body(false, &prompt, false);
        let url = format!("{sidecar}/v1/completions");
        let request = {
            let client = client.clone();
            tokio::spawn(async move { post_json(&client, &url, &body, REQUEST_TIMEOUT).await })
        };
        // The prefill has answered when its blocks are held (usage above the baseline).
        let held =
            wait_metric(&client, &prefill, KV_USAGE, &[], Duration::from_secs(20), |v| v > baseline + 1e-9).await;
        assert!(held > baseline, "the prefill never held blocks (usage {baseline} -> {held})");
        request.abort();
        let _ = request.await;
        let gone = Instant::now();
        // Give the sidecar a moment to see the disconnect while the decode is still paused.
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(paused);
        let after =
            wait_metric(&client, &prefill, KV_USAGE, &[], Duration::from_secs(30), |v| v <= baseline + 1e-9).await;
        let took = gone.elapsed();
        let cancelled_after = metric(&client, &sidecar, "pd_sidecar_requests_total", &[cancelled]).await;
        let releases_after = metric(&client, &sidecar, "pd_sidecar_releases_ok_total", &[]).await;
        let refused_after = metric(&client, &sidecar, "pd_sidecar_releases_failed_total", &[]).await;
        timing(
            &format!(
                "prefill KV usage back to baseline after the client left ({held:.6} -> {after:.6}; sidecar: {} cancelled, {} released)",
                cancelled_after - cancelled_before,
                releases_after - releases_before
            ),
            took,
        );
        assert!(
            after <= baseline + 1e-9,
            "the prefill still holds blocks 30 s after the client left ({KV_USAGE} {baseline} -> {held} -> {after})"
        );
        assert!(took < Duration::from_secs(10), "freeing the prefill's blocks took {took:?}, not well before 30 s");
        // The sidecar saw the client leave and freed the held blocks itself (a discarded
        // one-token decode with the prefill's params), rather than waiting for the lease.
        assert!(cancelled_after > cancelled_before, "the sidecar did not count the request as cancelled");
        match VllmSettings::from_env().expect("settings").connector {
            Connector::Nixl => assert!(releases_after > releases_before, "the sidecar released nothing"),
            // vLLM's decode also frees them: a request aborted before it was scheduled notifies
            // the prefill with no blocks read. Under XferConnector that revokes the grant, so
            // the sidecar's release decode, arriving second, is refused (vLLM answers 500)
            // instead of reading freed blocks as it does over NIXL.
            Connector::Xfer { .. } => assert!(
                releases_after + refused_after > releases_before + refused_before,
                "the sidecar did not try to release"
            ),
        }
        assert!(c.sidecar_alive(), "the sidecar died");
    });
}

/// vLLM's lease (kv_lease_duration, 30 s by default): a prefill whose blocks no decode ever
/// pulls frees them once the lease runs out.
const LEASE: Duration = Duration::from_secs(30);

/// For `PD_VLLM_CONNECTOR=xfer` (the NixlConnector run skips it with `--skip t4_`): the lease
/// is vLLM's own, so under NixlConnector it would only repeat vLLM's tests; under XferConnector
/// it shows the lease still works with xfer's agents and notifications. Then the late read:
/// the decode is handed the expired prefill's params; the prefill revoked the blocks' grant
/// before freeing them, so the decode's read is refused and the answer is the decode's own
/// (recomputed) or a clean error, never text decoded from the freed blocks.
#[test]
fn t4_lease_expiry_frees_prefill_blocks() {
    let Some(c) = cluster("t4_lease_expiry_frees_prefill_blocks") else { return };
    assert_ne!(
        VllmSettings::from_env().expect("settings").connector,
        Connector::Nixl,
        "t4 checks XferConnector (PD_VLLM_CONNECTOR=xfer); with NixlConnector pass --skip t4_"
    );
    runtime().block_on(async {
        let client = client();
        let (prefill, decode) = (c.prefill_url(), c.decode_url());
        let prompt = fresh_prompt("lease", 400);
        let plain = request_body(false, &prompt, false);
        let (status, text) =
            post_json(&client, &format!("{decode}/v1/completions"), &plain, REQUEST_TIMEOUT).await.expect("plain");
        assert_eq!(status, 200, "{text}");
        let reference = response_text(&serde_json::from_str(&text).expect("json"));
        reset_prefix_cache(&client, &decode).await;
        let baseline = metric(&client, &prefill, KV_USAGE, &[]).await;
        let mut body = plain.clone();
        body["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
        body["max_tokens"] = json!(1);
        let (status, text) = post_json(&client, &format!("{prefill}/v1/completions"), &body, REQUEST_TIMEOUT)
            .await
            .expect("prefill leg");
        assert_eq!(status, 200, "{text}");
        let answered = Instant::now();
        let held = metric(&client, &prefill, KV_USAGE, &[]).await;
        assert!(held > baseline + 1e-9, "the prefill holds no blocks after answering ({baseline} -> {held})");
        // No decode ever comes: the lease must run out and the blocks go back.
        let after =
            wait_metric(&client, &prefill, KV_USAGE, &[], LEASE + Duration::from_secs(15), |v| v <= baseline + 1e-9)
                .await;
        let took = answered.elapsed();
        timing(&format!("prefill blocks freed by lease expiry ({held:.6} -> {after:.6})"), took);
        assert!(after <= baseline + 1e-9, "the prefill still holds blocks {took:?} after answering ({after})");
        late_read_is_refused(&client, &decode, &text, &plain, &reference).await;
    });
}

/// The decode leg of t4, after the prefill freed the blocks: the read is refused (the grant was
/// revoked before the blocks were freed), no KV counts as transferred, and the answer is the
/// decode's own or a clean error.
async fn late_read_is_refused(
    client: &reqwest::Client,
    decode: &str,
    prefill_answer: &str,
    plain: &Value,
    reference: &str,
) {
    let params = serde_json::from_str::<Value>(prefill_answer).expect("json")["kv_transfer_params"].clone();
    let request_id = params["remote_request_id"].as_str().expect("remote_request_id").to_string();
    let prefill_log = log_dir().join("vllm-prefill.log");
    let revocations = log_lines_with(&prefill_log, "pd_xfer revoked the grant for request");
    assert!(
        revocations.iter().any(|line| line.contains(&request_id)),
        "the prefill logged no revocation of {request_id}'s grant: {revocations:?}"
    );
    let external = metric(client, decode, BY_SOURCE, &[EXTERNAL]).await;
    let decode_log = log_dir().join("vllm-decode.log");
    let refusals_before = log_lines_with(&decode_log, "grant revoked or expired").len();
    let mut late = plain.clone();
    late["kv_transfer_params"] = params;
    let started = Instant::now();
    let (status, text) =
        post_json(client, &format!("{decode}/v1/completions"), &late, REQUEST_TIMEOUT).await.expect("late decode");
    timing(&format!("late decode answered {status}"), started.elapsed());
    if status == 200 {
        let answer = response_text(&serde_json::from_str(&text).expect("json"));
        assert!(
            answer.is_empty() || answer == reference,
            "a late read answered {answer:?}, not the decode's own {reference:?}"
        );
    } else {
        assert!(text.contains("error"), "the late decode failed without an error body: {status} {text}");
    }
    let external_after = metric(client, decode, BY_SOURCE, &[EXTERNAL]).await;
    assert_eq!(external_after, external, "the decode counted KV read after the prefill freed it");
    let refusals = log_lines_with(&decode_log, "grant revoked or expired");
    assert!(refusals.len() > refusals_before, "the decode's log shows no refused read");
    loud(&format!("t4: late read refused; decode answered {status}; {}", refusals[refusals.len() - 1]));
}

/// A prefill on NIXL and a decode on xfer cannot be a pair: the decode's handshake refuses the
/// NIXL agent's metadata (a clear error in its log), and the request fails or is recomputed by
/// the decode, never answered from corrupt KV. For `PD_VLLM_CONNECTOR=xfer` (the NixlConnector
/// run skips it with `--skip t5_`): it starts a third engine, with NixlConnector.
#[test]
fn t5_mixed_nixl_and_xfer_pair_is_refused_at_handshake() {
    let Some(c) = cluster("t5_mixed_nixl_and_xfer_pair_is_refused_at_handshake") else { return };
    let mut settings = VllmSettings::from_env().expect("settings");
    assert_ne!(
        settings.connector,
        Connector::Nixl,
        "t5 pairs a NIXL prefill with an XferConnector decode (PD_VLLM_CONNECTOR=xfer); with NixlConnector pass --skip t5_"
    );
    settings.connector = Connector::Nixl;
    let nixl_prefill = third_engine(&settings, "vllm-prefill-nixl", 0, 0);
    refused_kv(
        &nixl_prefill.url(),
        &c.decode_url(),
        "vllm-decode",
        "same transfer library",
        "t5: the decode, KV from a NIXL prefill",
    );
    drop(nixl_prefill);
}

/// Starts engine `name` of `settings` beside the suite's two, on ports `offset` into the next
/// free range (the suite's own range is taken), with vLLM on core `core`.
fn third_engine(settings: &VllmSettings, name: &str, offset: u16, core: u32) -> Engine {
    let base = settings.port_base;
    let spec = EngineSpec {
        name: name.into(),
        port: base + offset,
        side_port: base + 10 + offset,
        core,
        events_port: None,
        events_collector: None,
        block_size: BLOCK_SIZE,
    };
    let t0 = Instant::now();
    let mut engine = Engine::spawn(settings, spec).unwrap_or_else(|e| panic!("spawn {name}: {e}"));
    engine.wait_healthy(START_TIMEOUT).unwrap_or_else(|e| panic!("{name} healthy: {e}"));
    timing(&format!("{name} started"), t0.elapsed());
    engine
}

/// P/D by hand from `prefill` to `decode` where the decode must not take the prefill's KV: it
/// counts no prompt token as transferred, answers (if it answers) with the text it gives on its
/// own, and its log (`decode_log`.log) says why (`refusal`). `who` names the case in messages.
fn refused_kv(prefill: &str, decode: &str, decode_log: &str, refusal: &str, who: &str) {
    runtime().block_on(async {
        let client = client();
        let prompt = fresh_prompt(decode_log, 90);
        let body = request_body(false, &prompt, false);
        let (status, plain) =
            post_json(&client, &format!("{decode}/v1/completions"), &body, REQUEST_TIMEOUT).await.expect("plain");
        assert_eq!(status, 200, "{plain}");
        let reference = response_text(&serde_json::from_str(&plain).expect("json"));
        reset_prefix_cache(&client, decode).await;
        let external = metric(&client, decode, BY_SOURCE, &[EXTERNAL]).await;
        let answer = pd_by_hand(&client, prefill, decode, "/v1/completions", &body).await;
        if let Ok((200, text)) = &answer {
            let text = response_text(&serde_json::from_str(text).expect("json"));
            assert_eq!(text, reference, "{who}: answered with other text than the decode's own");
        }
        let external_after = metric(&client, decode, BY_SOURCE, &[EXTERNAL]).await;
        assert_eq!(external_after, external, "{who}: the decode counted KV as transferred");
        let log = std::fs::read_to_string(log_dir().join(format!("{decode_log}.log"))).unwrap_or_default();
        assert!(log.contains(refusal), "{who}: the decode's log does not say {refusal:?} ({answer:?})");
        loud(&format!("{who}: answered {:?}", answer.map(|(s, t)| (s, t.chars().take(200).collect::<String>()))));
    });
}

/// With mutual TLS (`PD_XFER_MUTUAL_TLS=1`: every engine of the suite holds a certificate of
/// the run's cluster CA), a decode whose xfer agent has TLS but no certificate is refused at the
/// handshake by the prefill's (TLS alert 116): it counts no KV as transferred and answers, if it
/// answers, with its own computation. For the mutual-TLS run only (the others pass
/// `--skip t6_`): it starts a third engine.
#[test]
fn t6_a_decode_without_the_cluster_certificate_reads_no_kv() {
    let Some(c) = cluster("t6_a_decode_without_the_cluster_certificate_reads_no_kv") else { return };
    let mut settings = VllmSettings::from_env().expect("settings");
    let Connector::Xfer { tcp_params, .. } = &mut settings.connector else {
        panic!("t6 needs PD_VLLM_CONNECTOR=xfer with PD_XFER_MUTUAL_TLS=1; otherwise pass --skip t6_")
    };
    assert!(tcp_params.is_some(), "t6 needs PD_XFER_MUTUAL_TLS=1; otherwise pass --skip t6_");
    *tcp_params = Some("tls=on".into());
    let stranger = third_engine(&settings, "vllm-decode-stranger", 2, 1);
    refused_kv(
        &c.prefill_url(),
        &stranger.url(),
        "vllm-decode-stranger",
        "TLS alert 116",
        "t6: a decode without the cluster's certificate",
    );
    drop(stranger);
}

/// Kills the prefill engine (SIGKILL, its whole process group) while requests run through the
/// sidecar: every request must end within the bound, by failover (the sidecar's local fallback)
/// or a clear OpenAI-style error; later requests still succeed. Runs last: the prefill stays dead.
#[test]
fn t9_prefill_killed_during_a_run() {
    let Some(c) = cluster("t9_prefill_killed_during_a_run") else { return };
    let rt = runtime();
    rt.block_on(async {
        let client = client();
        let sidecar = c.sidecar_url.clone();
        let local_before = metric(&client, &sidecar, "pd_sidecar_local_decode_total", &[]).await;
        const REQUESTS: usize = 16;
        const KILL_AFTER: usize = 4;
        let t0 = Instant::now();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Outcome>();
        // Two requests in flight at a time, so the kill lands in the middle of some.
        let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        for _ in 0..2 {
            let (client, sidecar, next, done_tx) = (client.clone(), sidecar.clone(), next.clone(), done_tx.clone());
            tokio::spawn(async move {
                loop {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    if index >= REQUESTS {
                        return;
                    }
                    let chat = index % 2 == 1;
                    let stream = index % 4 >= 2;
                    let body = request_body(chat, &fresh_prompt("kill", 200), stream);
                    let started = t0.elapsed();
                    let t = Instant::now();
                    let url = format!("{sidecar}{}", path(chat));
                    let result = post_json(&client, &url, &body, REQUEST_BOUND + Duration::from_secs(10)).await;
                    let result = result.map(|(status, text)| {
                        if status == 200 && stream {
                            match sse_text(&text) {
                                Ok(t) => (status, t),
                                Err(e) => (0, e.to_string()),
                            }
                        } else {
                            (status, text)
                        }
                    });
                    let _ = done_tx.send(Outcome { index, started, took: t.elapsed(), result });
                }
            });
        }
        drop(done_tx);
        let mut outcomes = Vec::new();
        let mut killed_at = None;
        let deadline = Instant::now() + REQUEST_BOUND * (REQUESTS as u32);
        while let Ok(Some(outcome)) = tokio::time::timeout_at(deadline.into(), done_rx.recv()).await {
            outcomes.push(outcome);
            if outcomes.len() == KILL_AFTER && killed_at.is_none() {
                c.prefill().proc.signal_group(libc::SIGKILL);
                killed_at = Some(t0.elapsed());
                loud(&format!("vllm-e2e: prefill killed at {:.2} s", t0.elapsed().as_secs_f64()));
            }
        }
        let killed_at = killed_at.expect("the prefill was killed");
        c.prefill().proc.kill_with(libc::SIGKILL, Duration::from_secs(10));
        assert_eq!(outcomes.len(), REQUESTS, "requests that never ended: {outcomes:?}");
        let KillTally { ok, ok_after_kill: after_kill_ok, clear_errors: errors, slowest } =
            tally_after_kill(&outcomes, killed_at, REQUEST_BOUND);
        let local_after = metric(&client, &sidecar, "pd_sidecar_local_decode_total", &[]).await;
        timing(
            &format!("{REQUESTS} requests, prefill killed after {KILL_AFTER}: {ok} ok ({after_kill_ok} started after the kill), {errors} clear errors, slowest {:.2} s", slowest.as_secs_f64()),
            t0.elapsed(),
        );
        assert!(after_kill_ok > 0, "no request started after the kill succeeded (local fallback): {outcomes:?}");
        assert!(local_after > local_before, "the sidecar counted no local decode after the prefill died");
        assert!(c.sidecar_alive(), "the sidecar died");
        assert_eq!(http_status_blocking(&format!("{}/health", c.decode_url())), Some(200), "the decode is unhealthy");

        // The coordinator drops the dead engine (health checks every 500 ms, lease 3 s).
        let coordinator = c.coordinator_url.clone();
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut state = coordinator_alive(&client, &coordinator, "vllm-prefill").await;
        while state == Some(true) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(200)).await;
            state = coordinator_alive(&client, &coordinator, "vllm-prefill").await;
        }
        let since_kill = t0.elapsed().saturating_sub(killed_at);
        timing("coordinator dropped the killed prefill (since the kill)", since_kill);
        assert_ne!(state, Some(true), "the coordinator still lists the killed prefill as alive");
        assert_eq!(coordinator_alive(&client, &coordinator, "vllm-decode").await, Some(true), "the decode is not alive");
        // And pairs only with the live decode now.
        let pair = json!({"request_id": "e2e-after-kill", "model": MODEL, "prompt": "after the kill"});
        let (status, text) =
            post_json(&client, &format!("{coordinator}/v1/pair"), &pair, Duration::from_secs(10)).await.expect("pair");
        assert_eq!(status, 200, "{text}");
        let d: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(d["decode"]["id"], "vllm-decode", "{d}");
        assert!(d["prefill"].is_null() || d["prefill"]["id"] != "vllm-prefill", "paired with the dead prefill: {d}");
    });
}

/// The coordinator, fed by the real engines' KV events, pairs a request with the engine that
/// holds its prefix: the engine doing the prompt's work (the prefill, or the decode when it
/// prefills locally) is the one the prompt was sent to, with every full block counted as overlap.
/// The prefill's events reach it over a subscription to the engine's bound publisher; the
/// decode's through the coordinator's --kv-events-listen socket, which that vLLM connects to.
#[test]
fn t2b_coordinator_prefers_the_engine_holding_the_prefix() {
    let Some(c) = cluster("t2b_coordinator_prefers_the_engine_holding_the_prefix") else { return };
    runtime().block_on(async {
        let client = client();
        let coordinator = c.coordinator_url.clone();
        let engines = [("vllm-prefill", c.prefill_url()), ("vllm-decode", c.decode_url())];
        for (holder, url) in &engines {
            let t0 = Instant::now();
            let prompt = fresh_prompt(&format!("held-by-{holder}"), 120);
            let tokens = tokenize(&client, url, &prompt).await;
            let full_blocks = (tokens.len() / BLOCK_SIZE as usize) as u64;
            let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0});
            let (status, text) =
                post_json(&client, &format!("{url}/v1/completions"), &body, REQUEST_TIMEOUT).await.expect("request");
            assert_eq!(status, 200, "{text}");
            // The events reach the coordinator asynchronously: ask until the overlap shows.
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut n = 0;
            let (worker, overlap, decision) = loop {
                n += 1;
                let pair = json!({"request_id": format!("e2e-pair-{holder}-{n}"), "model": MODEL, "token_ids": tokens});
                let (status, text) =
                    post_json(&client, &format!("{coordinator}/v1/pair"), &pair, Duration::from_secs(10))
                        .await
                        .expect("pair");
                assert_eq!(status, 200, "pair: {text}");
                let d: Value = serde_json::from_str(&text).expect("pair json");
                let (worker, overlap) = if d["prefill"].is_object() {
                    (d["prefill"]["id"].as_str().unwrap_or_default().to_string(), d["prefill_overlap_blocks"].as_u64())
                } else {
                    (d["decode"]["id"].as_str().unwrap_or_default().to_string(), d["decode_overlap_blocks"].as_u64())
                };
                let overlap = overlap.unwrap_or(0);
                if (worker == *holder && overlap == full_blocks) || Instant::now() > deadline {
                    break (worker, overlap, d);
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            };
            timing(&format!("coordinator pairs toward {holder} ({full_blocks} blocks held)"), t0.elapsed());
            assert_eq!(worker, *holder, "the prompt's work went elsewhere: {decision}");
            assert_eq!(overlap, full_blocks, "overlap blocks: {decision}");
        }
    });
}

/// Whether the coordinator lists `id` as alive (None: not listed).
async fn coordinator_alive(client: &reqwest::Client, coordinator: &str, id: &str) -> Option<bool> {
    let text = client
        .get(format!("{coordinator}/v1/engines"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let list: Value = serde_json::from_str(&text).ok()?;
    list.as_array()?.iter().find(|e| e["id"].as_str() == Some(id)).map(|e| e["alive"].as_bool().unwrap_or(false))
}
