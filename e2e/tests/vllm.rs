//! The suite against a real vLLM (CPU build, `ci/vllm/`): one real prefill and one real decode
//! are started once for the whole binary (a shared fixture) and every test uses them. Tests run
//! in name order with `--test-threads 1`; the one that kills the prefill runs last.
//!
//! Without `PD_VLLM_VENV` every test prints a loud SKIPPED line and passes.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pd_e2e::*;
use pd_protocols::hash::{block_hashes, event_id, none_hash};
use pd_protocols::kv_events::{decode_batch, EventBatch, KvEvent};
use pd_protocols::zmq_frames::parse_pub;
use serde_json::{json, Value};

const MODEL: &str = "tiny-llama";
const BLOCK_SIZE: u32 = 32; // the CPU attention backend needs a multiple of 32
const START_TIMEOUT: Duration = Duration::from_secs(420);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Written straight to stderr: libtest's capture only hooks the print macros, so these lines
/// show even for passing tests.
fn loud(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

fn timing(what: &str, d: Duration) {
    loud(&format!("TIMING vllm-e2e: {what}: {:.2} s", d.as_secs_f64()));
}

struct Cluster {
    settings: VllmSettings,
    prefill: Mutex<Engine>,
    decode: Mutex<Engine>,
}

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
}

static CLUSTER: OnceLock<Result<Cluster, String>> = OnceLock::new();

fn start_cluster() -> Result<Cluster, String> {
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
        block_size: BLOCK_SIZE,
    };
    let t1 = Instant::now();
    // Both start together (one core each): the start is mostly single-threaded Python.
    let mut prefill = Engine::spawn(&settings, spec("vllm-prefill", 0, 0))?;
    let mut decode = Engine::spawn(&settings, spec("vllm-decode", 1, 1))?;
    prefill.wait_healthy(START_TIMEOUT)?;
    decode.wait_healthy(START_TIMEOUT.saturating_sub(t1.elapsed()))?;
    timing("prefill + decode started (in parallel)", t1.elapsed());
    loud(&format!(
        "vllm-e2e: prefill {} ({:.0} s), decode {} ({:.0} s); logs in {}",
        prefill.url(),
        prefill.started_in.as_secs_f64(),
        decode.url(),
        decode.started_in.as_secs_f64(),
        log_dir().display()
    ));
    Ok(Cluster { settings, prefill: Mutex::new(prefill), decode: Mutex::new(decode) })
}

/// The shared fixture, or `None` (after a loud SKIPPED line) when the suite cannot run here.
fn cluster(test: &str) -> Option<&'static Cluster> {
    if std::env::var_os("PD_VLLM_VENV").is_none_or(|v| v.is_empty()) {
        loud(&format!("SKIPPED: real-vLLM test `{test}` did not run: PD_VLLM_VENV is not set; {SKIP_HOW}"));
        return None;
    }
    match CLUSTER.get_or_init(start_cluster) {
        Ok(c) => Some(c),
        Err(e) => panic!("real vLLM cluster did not start: {e}"),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().pool_max_idle_per_host(0).build().expect("client")
}

/// Polls a metric until `pred` holds (bounded), returning the last value.
async fn wait_metric(
    client: &reqwest::Client,
    base: &str,
    name: &str,
    labels: &[(&str, &str)],
    timeout: Duration,
    pred: impl Fn(f64) -> bool,
) -> f64 {
    let deadline = Instant::now() + timeout;
    loop {
        let v = metric(client, base, name, labels).await;
        if pred(v) || Instant::now() > deadline {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
) -> Result<(u16, String), String> {
    let mut first = body.clone();
    first["kv_transfer_params"] = json!({"do_remote_decode": true, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null});
    first["stream"] = json!(false);
    first.as_object_mut().expect("object").remove("stream_options");
    first["max_tokens"] = json!(1);
    let (status, text) = post_json(client, &format!("{prefill}{route}"), &first, REQUEST_TIMEOUT).await?;
    if status != 200 {
        return Err(format!("prefill leg: {status} {text}"));
    }
    let answer: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let params = answer["kv_transfer_params"].clone();
    if params.is_null() {
        return Err(format!("prefill returned no kv_transfer_params: {text}"));
    }
    let mut second = body.clone();
    second["kv_transfer_params"] = params;
    post_json(client, &format!("{decode}{route}"), &second, REQUEST_TIMEOUT).await
}

/// Sends `body` through P/D and returns the generated text (streamed or not).
async fn pd_text(client: &reqwest::Client, c: &Cluster, route: &str, body: &Value) -> String {
    let (status, text) = pd_by_hand(client, &c.prefill_url(), &c.decode_url(), route, body).await.expect("P/D request");
    assert_eq!(status, 200, "P/D request: {text}");
    if body["stream"].as_bool() == Some(true) {
        sse_text(&text).expect("stream")
    } else {
        response_text(&serde_json::from_str(&text).expect("json"))
    }
}

const XFER_COUNT: &str = "vllm:nixl_xfer_time_seconds_count";
const BY_SOURCE: &str = "vllm:prompt_tokens_by_source_total";
const EXTERNAL: (&str, &str) = ("source", "external_kv_transfer");

#[test]
fn t1_pd_completions_and_chat_streaming_and_not() {
    let Some(c) = cluster("t1_pd_completions_and_chat_streaming_and_not") else { return };
    let rt = runtime();
    rt.block_on(async {
        let client = client();
        let decode = c.decode_url();
        for (chat, stream) in [(false, false), (false, true), (true, false), (true, true)] {
            let t0 = Instant::now();
            let what = format!("{} stream={stream}", path(chat));
            let prompt = fresh_prompt("pd", 90);
            // Reference: the same request served by the decode alone, then its cache emptied so
            // that the P/D request must pull every block.
            let (status, plain) = post_json(
                &client,
                &format!("{decode}{}", path(chat)),
                &request_body(chat, &prompt, false),
                REQUEST_TIMEOUT,
            )
            .await
            .expect("plain request");
            assert_eq!(status, 200, "{what}: plain request: {plain}");
            let plain: Value = serde_json::from_str(&plain).expect("json");
            let reference = response_text(&plain);
            let prompt_tokens = plain["usage"]["prompt_tokens"].as_f64().expect("usage.prompt_tokens");
            reset_prefix_cache(&client, &decode).await;

            let xfers = metric(&client, &decode, XFER_COUNT, &[]).await;
            let external = metric(&client, &decode, BY_SOURCE, &[EXTERNAL]).await;
            let text = pd_text(&client, c, path(chat), &request_body(chat, &prompt, stream)).await;
            let xfers_after =
                wait_metric(&client, &decode, XFER_COUNT, &[], Duration::from_secs(10), |v| v > xfers).await;
            let external_after = wait_metric(&client, &decode, BY_SOURCE, &[EXTERNAL], Duration::from_secs(10), |v| {
                v >= external + prompt_tokens
            })
            .await;

            assert!(
                xfers_after > xfers,
                "{what}: the decode made no NIXL transfer ({XFER_COUNT} {xfers} -> {xfers_after})"
            );
            assert_eq!(
                external_after - external,
                prompt_tokens,
                "{what}: external_kv_transfer prompt tokens must grow by the prompt length"
            );
            assert_eq!(text, reference, "{what}: disaggregated text differs from the decode's own");
            assert!(!text.is_empty(), "{what}: empty text");
            timing(&format!("P/D {what} ({prompt_tokens} prompt tokens, reference + reset + P/D)"), t0.elapsed());
        }
    });
}

/// Subscribes to an engine's KV events (a ZMQ SUB socket on a thread, batches decoded by
/// pd_protocols).
struct Subscription {
    stop: Arc<AtomicBool>,
    rx: mpsc::Receiver<EventBatch>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Subscription {
    fn new(endpoint: String) -> Subscription {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let ctx = zmq::Context::new();
            let sub = ctx.socket(zmq::SUB).expect("SUB");
            sub.set_rcvtimeo(200).expect("rcvtimeo");
            sub.set_linger(0).expect("linger");
            sub.set_subscribe(b"kv-events").expect("subscribe");
            sub.connect(&endpoint).expect("connect");
            while !flag.load(Ordering::Acquire) {
                let Ok(frames) = sub.recv_multipart(0) else { continue };
                let (_, _, payload) = parse_pub(&frames).expect("3-frame PUB message");
                let _ = tx.send(decode_batch(payload).expect("event batch decodes"));
            }
        });
        Subscription { stop, rx, thread: Some(thread) }
    }

    /// Stored block hashes (in order) and their token ids seen until `enough` holds or timeout.
    fn stored_until(&self, timeout: Duration, enough: impl Fn(&[u64]) -> bool) -> (Vec<u64>, Vec<u32>, Option<u64>) {
        let deadline = Instant::now() + timeout;
        let (mut hashes, mut tokens, mut first_parent) = (Vec::new(), Vec::new(), None);
        while !enough(&hashes) && Instant::now() < deadline {
            if let Ok(batch) = self.rx.recv_timeout(Duration::from_millis(200)) {
                for ev in batch.events {
                    if let KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } = ev {
                        if hashes.is_empty() {
                            first_parent = parent_block_hash.map(|h| h.as_u64());
                        }
                        hashes.extend(block_hashes.iter().map(|h| h.as_u64()));
                        tokens.extend(token_ids);
                    }
                }
            }
        }
        (hashes, tokens, first_parent)
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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
    let _ = &c.settings;
}
