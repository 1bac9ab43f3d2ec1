//! The suite against a real SGLang 0.5.23 (CPU engine, `ci/sglang/`): two real prefills and one
//! real decode over Mooncake's TCP transport (`PD_SGLANG_TRANSFER=xfer`: over xfer, through
//! SGLang's NIXL transfer backend with pd_xfer.nixl as NIXL), `pd-sidecar --mode sglang` in front of the decode
//! (both prefills in its static list), a plain (non-disaggregated) server as the reference, and
//! `pd-coordinator` fed by the prefills' KV events, are started once for the whole binary (a
//! shared fixture) and every test uses them. Tests run in name order with `--test-threads 1`;
//! the one that kills a prefill runs last.
//!
//! Without `PD_SGLANG_VENV` every test prints a loud SKIPPED line and passes.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use pd_e2e::outcome::{tally_after_kill, KillTally, Outcome};
use pd_e2e::sglang::{SglangRole, SglangServer, SglangSettings, SglangSpec, SglangTransfer, SGLANG_SKIP_HOW};
use pd_e2e::*;
use pd_protocols::hash::sglang::{event_id, page_hashes};
use serde_json::{json, Value};

const MODEL: &str = "tiny-llama";
/// SGLang's page size on CPU: every token is a block.
const PAGE_SIZE: u32 = 1;
/// KV cache per server, in tokens (capped: uncapped, SGLang sizes it from host RAM).
const MAX_TOTAL_TOKENS: u32 = 16384;
const START_TIMEOUT: Duration = Duration::from_secs(600);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_TOKENS: u64 = 12;

fn timing(what: &str, d: Duration) {
    loud(&format!("TIMING sglang-e2e: {what}: {:.2} s", d.as_secs_f64()));
}

/// The sidecar's bounds, short so that a failure test ends quickly: the documented worst case of
/// one request is connect + prefill timeout per attempt, far below SGLang's own 300 s waits.
const SIDECAR_CONNECT_TIMEOUT: &str = "1s";
const SIDECAR_PREFILL_TIMEOUT: &str = "10s";
/// Every request through the sidecar must end within this, by failover or a clear error.
const REQUEST_BOUND: Duration = Duration::from_secs(30);

const KV_TRANSFERS: &str = "sglang:kv_transfer_latency_ms_count";
const KV_TRANSFER_MB: &str = "sglang:kv_transfer_total_mb_sum";
const TOKEN_USAGE: &str = "sglang:token_usage";
const RUNNING: &str = "sglang:num_running_reqs";
const USED_TOKENS: &str = "sglang:num_used_tokens";

struct Cluster {
    prefills: [Mutex<SglangServer>; 2],
    decode_url: String,
    decode_log: std::path::PathBuf,
    plain_url: String,
    transfer: SglangTransfer,
    /// The decode and the plain server, held until the binary exits.
    _servers: Mutex<Vec<SglangServer>>,
    sidecar: Mutex<Proc>,
    sidecar_url: String,
    _coordinator: Mutex<Proc>,
    coordinator_url: String,
    /// The first of the 50 ports the suite holds (servers +0..3, bootstrap +10..11, events
    /// +20..23, sidecars +30..32, ports nothing listens on +33..34, the coordinator +40).
    port_base: u16,
}

impl Cluster {
    fn prefill(&self, i: usize) -> MutexGuard<'_, SglangServer> {
        self.prefills[i].lock().unwrap_or_else(|p| p.into_inner())
    }
    fn prefill_url(&self, i: usize) -> String {
        self.prefill(i).url()
    }
    fn bootstrap_port(&self, i: usize) -> u16 {
        match self.prefill(i).spec.role {
            SglangRole::Prefill { bootstrap_port } => bootstrap_port,
            other => unreachable!("prefill {i} runs as {other:?}"),
        }
    }
    fn sidecar_alive(&self) -> bool {
        self.sidecar.lock().unwrap_or_else(|p| p.into_inner()).running()
    }
    /// A metric summed over both prefills.
    async fn prefills_sum(&self, client: &reqwest::Client, name: &str) -> f64 {
        let mut total = 0.0;
        for i in 0..2 {
            total += metric(client, &self.prefill_url(i), name, &[]).await;
        }
        total
    }
    /// KV transfers counted by both prefills.
    async fn transfers(&self, client: &reqwest::Client) -> f64 {
        self.prefills_sum(client, KV_TRANSFERS).await
    }
    /// MB of KV both prefills sent.
    async fn transferred_mb(&self, client: &reqwest::Client) -> f64 {
        self.prefills_sum(client, KV_TRANSFER_MB).await
    }
}

static CLUSTER: OnceLock<Result<Cluster, E2eError>> = OnceLock::new();

fn start_cluster() -> Result<Cluster, E2eError> {
    let t0 = Instant::now();
    let settings = SglangSettings::from_env()?;
    let base = settings.port_base;
    let spec = |name: &str, offset: u16, role: SglangRole, events: bool| SglangSpec {
        name: name.to_string(),
        role,
        port: base + offset,
        events_port: events.then_some(base + 20 + offset),
        max_total_tokens: MAX_TOTAL_TOKENS,
    };
    let sidecar_bin = workspace_bin("pd-sidecar", "pd-sidecar")?;
    let coordinator_bin = workspace_bin("pd-coordinator", "pd-coordinator")?;
    timing("model and binaries ready", t0.elapsed());
    let t1 = Instant::now();
    // All four start together: the start is mostly single-threaded Python.
    let mut servers = vec![
        SglangServer::spawn(
            &settings,
            spec("sglang-prefill-a", 0, SglangRole::Prefill { bootstrap_port: base + 10 }, true),
        )?,
        SglangServer::spawn(
            &settings,
            spec("sglang-prefill-b", 1, SglangRole::Prefill { bootstrap_port: base + 11 }, true),
        )?,
        SglangServer::spawn(&settings, spec("sglang-decode", 2, SglangRole::Decode, false))?,
        SglangServer::spawn(&settings, spec("sglang-plain", 3, SglangRole::Plain, false))?,
    ];
    for server in &mut servers {
        server.wait_healthy(START_TIMEOUT.saturating_sub(t1.elapsed()))?;
    }
    timing("2 prefills + decode + plain server started (in parallel)", t1.elapsed());
    let mut servers = servers.into_iter();
    let (a, b, decode, plain) = match (servers.next(), servers.next(), servers.next(), servers.next()) {
        (Some(a), Some(b), Some(d), Some(p)) => (a, b, d, p),
        _ => unreachable!("four servers"),
    };
    loud(&format!(
        "sglang-e2e: prefills {} {}, decode {}, plain {} (started in {:.0}/{:.0}/{:.0}/{:.0} s), KV over {}; logs in {}",
        a.url(),
        b.url(),
        decode.url(),
        plain.url(),
        a.started_in.as_secs_f64(),
        b.started_in.as_secs_f64(),
        decode.started_in.as_secs_f64(),
        plain.started_in.as_secs_f64(),
        settings.transfer,
        log_dir().display()
    ));

    let sidecar_addr = format!("127.0.0.1:{}", base + 30);
    let prefills = format!("{}#bootstrap={},{}#bootstrap={}", a.url(), base + 10, b.url(), base + 11);
    let args: Vec<String> = [
        ["--listen", &sidecar_addr, "--mode", "sglang"].as_slice(),
        &["--engine", &decode.url(), "--prefill", &prefills],
        &["--connect-timeout", SIDECAR_CONNECT_TIMEOUT, "--prefill-timeout", SIDECAR_PREFILL_TIMEOUT],
        // A decode-mode SGLang server refuses a request without a bootstrap room (400), so it
        // cannot compute a prompt itself: no local fallback.
        &["--fallback", "fail"],
    ]
    .concat()
    .into_iter()
    .map(String::from)
    .collect();
    // Debug for the SGLang flow: each attempt logs its bootstrap room (t3 reads them).
    let mut sidecar =
        Proc::spawn("pd-sidecar-sglang", &sidecar_bin, &args, &[("RUST_LOG", "info,pd_sidecar::sglang=debug")])?;
    let sidecar_url = format!("http://{sidecar_addr}");
    timing("sidecar ready", wait_http_ok(&mut sidecar, &format!("{sidecar_url}/ready"), Duration::from_secs(30))?);

    let coordinator_addr = format!("127.0.0.1:{}", base + 40);
    // SGLang's /health generates one token (a round trip through its scheduler): on a busy
    // 2-core machine that took over the coordinator's default 1 s health timeout, and every
    // engine was dropped as dead.
    let args: Vec<String> = [
        "--listen",
        &coordinator_addr,
        "--no-grpc",
        "--health-interval-ms",
        "1s",
        "--health-timeout-ms",
        "10s",
        "--lease-ms",
        "30s",
        "--block-hash",
        "sglang",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    let mut coordinator = Proc::spawn("pd-coordinator-sglang", &coordinator_bin, &args, &[("RUST_LOG", "info")])?;
    let coordinator_url = format!("http://{coordinator_addr}");
    wait_http_ok(&mut coordinator, &format!("{coordinator_url}/health"), Duration::from_secs(30))?;
    for (server, role) in [(&a, "prefill"), (&b, "prefill"), (&decode, "decode")] {
        register(&coordinator_url, server, role)?;
    }
    Ok(Cluster {
        prefills: [Mutex::new(a), Mutex::new(b)],
        decode_url: decode.url(),
        decode_log: decode.proc.log.clone(),
        plain_url: plain.url(),
        transfer: settings.transfer,
        _servers: Mutex::new(vec![decode, plain]),
        sidecar: Mutex::new(sidecar),
        sidecar_url,
        _coordinator: Mutex::new(coordinator),
        coordinator_url,
        port_base: base,
    })
}

/// Registers a real server with the coordinator (no sidecar: the coordinator health-checks it).
fn register(coordinator: &str, server: &SglangServer, role: &str) -> Result<(), E2eError> {
    let spec = json!({
        "id": server.spec.name, "role": role, "node": "local", "model": MODEL,
        "engine_url": server.url(), "kv_events": server.events_endpoint(), "block_size": PAGE_SIZE,
    });
    register_engine(coordinator, &spec)
}

/// The shared fixture, or `None` (after a loud SKIPPED line) when the suite cannot run here.
fn cluster(test: &str) -> Option<&'static Cluster> {
    shared_fixture(&CLUSTER, start_cluster, ("SGLang", "PD_SGLANG_VENV", SGLANG_SKIP_HOW), test)
}

/// The three generation APIs the sidecar serves in SGLang mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
    Generate,
}

impl Api {
    fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
            Api::Generate => "/generate",
        }
    }

    fn body(self, prompt: &str, stream: bool, max_tokens: u64) -> Value {
        match self {
            Api::Completions => json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "stream": stream}),
            Api::Chat => json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}),
            Api::Generate => json!({"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}),
        }
    }

    /// The generated text of an answer (streamed or not).
    fn text(self, body: &str, stream: bool) -> Result<String, E2eError> {
        match (self, stream) {
            (Api::Generate, false) => serde_json::from_str::<Value>(body)
                .map_err(E2eError::json(format!("bad /generate answer {body:?}")))?["text"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| E2eError::Answer { what: "no text in", body: format!("{body:?}") }),
            (Api::Generate, true) => generate_stream_text(body),
            (_, true) => sse_text(body),
            (_, false) => Ok(response_text(&serde_json::from_str(body).map_err(E2eError::json(format!("{body:?}")))?)),
        }
    }
}

/// The text of a streamed `/generate`: every chunk carries the whole text so far.
fn generate_stream_text(body: &str) -> Result<String, E2eError> {
    let mut text = None;
    let mut done = false;
    for line in body.lines() {
        let Some(data) = line.strip_prefix("data:").map(str::trim) else { continue };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).map_err(E2eError::json(format!("bad chunk {data:?}")))?;
        if v.get("error").is_some() {
            return Err(E2eError::Answer { what: "error in stream", body: v.to_string() });
        }
        text = v["text"].as_str().map(str::to_owned);
    }
    match (text, done) {
        (Some(t), true) => Ok(t),
        _ => Err(E2eError::Answer { what: "stream ended without text and [DONE]", body: format!("{body:?}") }),
    }
}

/// The plain server's answer to the same request, non-streamed: what the P/D pair must equal.
async fn reference(client: &reqwest::Client, c: &Cluster, api: Api, prompt: &str, max_tokens: u64) -> String {
    let (status, body) = post_json(
        client,
        &format!("{}{}", c.plain_url, api.path()),
        &api.body(prompt, false, max_tokens),
        REQUEST_TIMEOUT,
    )
    .await
    .expect("plain request");
    assert_eq!(status, 200, "plain {api:?}: {body}");
    api.text(&body, false).expect("plain text")
}

/// One P/D request driven by the test itself (PROTOCOLS.md §4): the same body, with the
/// bootstrap fields of prefill `i`, to the prefill and the decode at once.
async fn pd_by_hand(client: &reqwest::Client, c: &Cluster, i: usize, mut body: Value, room: i64) -> Value {
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(c.bootstrap_port(i));
    body["bootstrap_room"] = json!(room);
    let (prefill_url, decode_url) = (format!("{}/generate", c.prefill_url(i)), format!("{}/generate", c.decode_url));
    let prefill = post_json(client, &prefill_url, &body, REQUEST_TIMEOUT);
    let decode = post_json(client, &decode_url, &body, REQUEST_TIMEOUT);
    let (prefill, decode) = tokio::join!(prefill, decode);
    let (status, text) = prefill.expect("prefill leg");
    assert_eq!(status, 200, "prefill leg: {text}");
    let (status, text) = decode.expect("decode leg");
    assert_eq!(status, 200, "decode leg: {text}");
    serde_json::from_str(&text).expect("decode json")
}

/// A room no other request of this run uses.
fn test_room(n: u64) -> i64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    ((nanos as u64 ^ (n << 40)) & (i64::MAX as u64)) as i64
}

/// `count` token ids no earlier request used as a prefix (the vocabulary has 2048 ids).
fn fresh_tokens(count: usize) -> Vec<u32> {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let mut x = (nanos as u64) | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (10 + x % 2000) as u32
        })
        .collect()
}

/// What a P/D server's log says about how it moves KV, for each transfer the suite runs.
fn transfer_log_lines(transfer: &SglangTransfer) -> (Vec<String>, Vec<&'static str>) {
    let launch_xfer = "nixl is pd_xfer.nixl";
    match transfer {
        SglangTransfer::Mooncake => {
            (vec!["'disaggregation_transfer_backend': 'mooncake'".to_string()], vec![launch_xfer])
        }
        SglangTransfer::Xfer { backend, .. } => (
            vec![
                "'disaggregation_transfer_backend': 'nixl'".to_string(),
                launch_xfer.to_string(),
                format!("NIXL KVManager initialized with backend: {backend}"),
            ],
            vec![],
        ),
    }
}

#[test]
fn t0_pd_servers_move_kv_over_the_transfer_asked_for() {
    let Some(c) = cluster("t0_pd_servers_move_kv_over_the_transfer_asked_for") else { return };
    let (present, absent) = transfer_log_lines(&c.transfer);
    let logs = [c.prefill(0).proc.log.clone(), c.prefill(1).proc.log.clone(), c.decode_log.clone()];
    for log in &logs {
        for line in &present {
            assert!(!log_lines_with(log, line).is_empty(), "{}: no line with {line:?}", log.display());
        }
        for line in &absent {
            assert!(log_lines_with(log, line).is_empty(), "{}: a line with {line:?}", log.display());
        }
    }
    loud(&format!("sglang-e2e: both prefills and the decode move KV over {}", c.transfer));
}

#[test]
fn t1_pd_through_sidecar_completions_chat_and_generate() {
    let Some(c) = cluster("t1_pd_through_sidecar_completions_chat_and_generate") else { return };
    runtime().block_on(async {
        let client = client();
        let sidecar = c.sidecar_url.clone();
        for api in [Api::Completions, Api::Chat, Api::Generate] {
            for stream in [false, true] {
                let t0 = Instant::now();
                let prompt = fresh_prompt("pd", 60);
                let expected = reference(&client, c, api, &prompt, MAX_TOKENS).await;
                let transfers = c.transfers(&client).await;
                let mb = c.transferred_mb(&client).await;
                let disaggregated = metric(&client, &sidecar, "pd_sidecar_disaggregated_total", &[]).await;
                let t_req = Instant::now();
                let (status, body) = post_json(
                    &client,
                    &format!("{sidecar}{}", api.path()),
                    &api.body(&prompt, stream, MAX_TOKENS),
                    REQUEST_TIMEOUT,
                )
                .await
                .expect("request through the sidecar");
                let latency = t_req.elapsed();
                assert_eq!(status, 200, "{api:?} stream={stream}: {body}");
                let text = api.text(&body, stream).expect("answer text");
                assert!(!text.is_empty(), "{api:?} stream={stream}: empty text");
                assert_eq!(text, expected, "{api:?} stream={stream}: P/D text differs from the plain server's");
                // The prefill counts its transfer when it completes, maybe after the answer.
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut after = c.transfers(&client).await;
                while after <= transfers && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    after = c.transfers(&client).await;
                }
                assert!(after > transfers, "{api:?} stream={stream}: no prefill counted a KV transfer");
                let mb_after = c.transferred_mb(&client).await;
                assert!(mb_after > mb, "{api:?} stream={stream}: kv_transfer_total_mb did not grow");
                let counted = metric(&client, &sidecar, "pd_sidecar_disaggregated_total", &[]).await;
                assert!(counted > disaggregated, "{api:?} stream={stream}: the sidecar counted no disaggregation");
                timing(
                    &format!(
                        "P/D through the sidecar {} stream={stream}: request {:.0} ms, {:.4} MB of KV moved, with reference",
                        api.path(),
                        latency.as_secs_f64() * 1e3,
                        mb_after - mb
                    ),
                    t0.elapsed(),
                );
            }
        }
    });
}

/// `[logprob, token id, text]` triples of one `meta_info` list: (ids, logprobs; None for the
/// first input token, which has no logprob).
fn logprob_list(meta: &Value, field: &str) -> (Vec<u64>, Vec<Option<f64>>) {
    let list = meta[field].as_array().unwrap_or_else(|| panic!("{field} missing in {meta}"));
    list.iter().map(|e| (e[1].as_u64().expect("token id"), e[0].as_f64())).unzip()
}

#[test]
fn t2_return_logprob_merged_equals_the_plain_servers() {
    let Some(c) = cluster("t2_return_logprob_merged_equals_the_plain_servers") else { return };
    runtime().block_on(async {
        let client = client();
        let prompt = fresh_prompt("logprob", 40);
        let mut body = Api::Generate.body(&prompt, false, 6);
        body["return_logprob"] = json!(true);
        body["logprob_start_len"] = json!(0);
        let (status, plain) =
            post_json(&client, &format!("{}/generate", c.plain_url), &body, REQUEST_TIMEOUT).await.expect("plain");
        assert_eq!(status, 200, "{plain}");
        let plain: Value = serde_json::from_str(&plain).expect("json");
        let (status, merged) =
            post_json(&client, &format!("{}/generate", c.sidecar_url), &body, REQUEST_TIMEOUT).await.expect("P/D");
        assert_eq!(status, 200, "{merged}");
        let merged: Value = serde_json::from_str(&merged).expect("json");
        assert_eq!(merged["text"], plain["text"], "text");
        for field in ["input_token_logprobs", "output_token_logprobs"] {
            let (ids, values) = logprob_list(&merged["meta_info"], field);
            let (plain_ids, plain_values) = logprob_list(&plain["meta_info"], field);
            assert_eq!(ids, plain_ids, "{field}: token ids (merged {merged} plain {plain})");
            for (k, (got, want)) in values.iter().zip(&plain_values).enumerate() {
                match (got, want) {
                    (Some(g), Some(w)) => assert!((g - w).abs() < 1e-3, "{field}[{k}]: {g} vs {w}"),
                    (None, None) => {}
                    _ => panic!("{field}[{k}]: {got:?} vs {want:?}"),
                }
            }
            loud(&format!("t2: {field}: {} entries equal the plain server's", ids.len()));
        }
    });
}

#[test]
fn t3_bootstrap_rooms_unique_under_200_concurrent_requests() {
    let Some(c) = cluster("t3_bootstrap_rooms_unique_under_200_concurrent_requests") else { return };
    const REQUESTS: usize = 200;
    const PROMPTS: usize = 8;
    let log = log_dir().join("pd-sidecar-sglang.log");
    let rooms_before = rooms_logged(&log).len();
    runtime().block_on(async {
        let client = client();
        let prompts: Vec<String> = (0..PROMPTS).map(|i| fresh_prompt(&format!("room-{i}"), 12)).collect();
        let mut expected = Vec::new();
        for p in &prompts {
            expected.push(reference(&client, c, Api::Generate, p, 2).await);
        }
        let t0 = Instant::now();
        let mut tasks = Vec::new();
        for i in 0..REQUESTS {
            let (client, url, body) = (
                client.clone(),
                format!("{}/generate", c.sidecar_url),
                Api::Generate.body(&prompts[i % PROMPTS], false, 2),
            );
            tasks.push(tokio::spawn(async move { post_json(&client, &url, &body, Duration::from_secs(120)).await }));
        }
        let mut ok = 0;
        for (i, task) in tasks.into_iter().enumerate() {
            let (status, body) = task.await.expect("task").expect("answer");
            assert_eq!(status, 200, "request {i}: {body}");
            assert_eq!(Api::Generate.text(&body, false).expect("text"), expected[i % PROMPTS], "request {i}");
            ok += 1;
        }
        timing(
            &format!("{ok} concurrent /generate requests through the sidecar, all equal to the plain server's"),
            t0.elapsed(),
        );
    });
    let rooms = rooms_logged(&log);
    let new = &rooms[rooms_before..];
    let distinct: HashSet<i64> = new.iter().copied().collect();
    assert!(new.len() >= REQUESTS, "the sidecar logged {} rooms for {REQUESTS} requests", new.len());
    assert_eq!(distinct.len(), new.len(), "a bootstrap room was used twice");
    assert!(new.iter().all(|&r| r >= 0), "rooms are in [0, 2^63)");
}

/// The bootstrap rooms the sidecar logged (debug line "SGLang legs ... room=N"), in order.
fn rooms_logged(log: &std::path::Path) -> Vec<i64> {
    log_lines_with(log, "SGLang legs")
        .iter()
        .filter_map(|line| {
            let plain = without_ansi(line);
            plain.split("room=").nth(1)?.split(|ch: char| !ch.is_ascii_digit() && ch != '-').next()?.parse().ok()
        })
        .collect()
}

/// `line` without ANSI colour sequences (ESC [ ... m), which the sidecar's log may carry.
fn without_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}

/// The prefill's real KV events, decoded by pd_protocols: page size 1, and ids equal to our
/// SGLang page chain over the same tokens (signed 64-bit values included).
#[test]
fn t4_kv_event_hashes_equal_ours() {
    let Some(c) = cluster("t4_kv_event_hashes_equal_ours") else { return };
    let endpoint = c.prefill(0).events_endpoint().expect("events");
    let sub = Subscription::new(endpoint);
    // Let the subscription join (ZMQ's slow joiner) before the engine publishes.
    std::thread::sleep(Duration::from_millis(1000));
    let tokens = fresh_tokens(48);
    let t0 = Instant::now();
    runtime().block_on(async {
        let body = json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 2, "temperature": 0}});
        pd_by_hand(&client(), c, 0, body, test_room(4)).await;
    });
    let (hashes, stored_tokens, parent) = sub.stored_until(Duration::from_secs(15), |h| h.len() >= tokens.len());
    timing(&format!("{} stored pages seen by a subscriber", hashes.len()), t0.elapsed());
    assert!(parent.is_none(), "the first page of a fresh prompt has no parent");
    assert!(hashes.len() >= tokens.len(), "{} pages stored for {} tokens", hashes.len(), tokens.len());
    assert_eq!(stored_tokens[..tokens.len()], tokens[..], "stored token ids");
    let ours: Vec<u64> = page_hashes(&stored_tokens, PAGE_SIZE as usize).iter().map(event_id).collect();
    assert_eq!(hashes, ours, "the engine's page ids differ from pd_protocols::hash::sglang's");
    assert!(hashes.iter().any(|&h| (h as i64) < 0), "expected some negative (signed) ids among {}", hashes.len());
}

/// The coordinator, fed by both prefills' real KV events (SGLang hashes, page size 1), pairs a
/// prompt with the prefill that holds it, counting every token as overlap.
#[test]
fn t5_coordinator_prefers_the_prefill_holding_the_prefix() {
    let Some(c) = cluster("t5_coordinator_prefers_the_prefill_holding_the_prefix") else { return };
    runtime().block_on(async {
        let client = client();
        for (i, holder) in ["sglang-prefill-a", "sglang-prefill-b"].into_iter().enumerate() {
            let t0 = Instant::now();
            let tokens = fresh_tokens(64);
            let before = indexed_blocks(&client, c, holder).await;
            let body = json!({"input_ids": tokens, "sampling_params": {"max_new_tokens": 1, "temperature": 0}});
            pd_by_hand(&client, c, i, body, test_room(5 + i as u64)).await;
            // Wait on the index's read-only stats, then ask once: a pair call records its own
            // routing (the decode will hold the prompt), so asking again and again before the
            // holder's events arrived would make the decode the best place for the prompt.
            let deadline = Instant::now() + Duration::from_secs(15);
            let mut held = before;
            while held < before + tokens.len() as u64 && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
                held = indexed_blocks(&client, c, holder).await;
            }
            assert!(
                held >= before + tokens.len() as u64,
                "{holder}'s events: {before} -> {held} indexed blocks in 15 s"
            );
            let pair = json!({"request_id": format!("e2e-sglang-{holder}"), "model": MODEL, "token_ids": tokens});
            let (status, text) =
                post_json(&client, &format!("{}/v1/pair", c.coordinator_url), &pair, Duration::from_secs(10))
                    .await
                    .expect("pair");
            assert_eq!(status, 200, "pair: {text}");
            let decision: Value = serde_json::from_str(&text).expect("pair json");
            timing(&format!("coordinator pairs toward {holder} ({} pages held)", tokens.len()), t0.elapsed());
            assert_eq!(decision["prefill"]["id"], holder, "the prompt went elsewhere: {decision}");
            assert_eq!(decision["prefill_overlap_blocks"], tokens.len() as u64, "overlap pages: {decision}");
            assert_eq!(decision["decode"]["id"], "sglang-decode", "{decision}");
        }
    });
}

/// How many blocks of `engine` the coordinator's index holds for the model (its stats route).
async fn indexed_blocks(client: &reqwest::Client, c: &Cluster, engine: &str) -> u64 {
    let stats: Value =
        serde_json::from_str(&get_text(client, &format!("{}/v1/index/stats", c.coordinator_url)).await).expect("stats");
    stats["models"][MODEL]["engines"][engine].as_u64().unwrap_or(0)
}

/// A client that leaves during the decode: the decode drops the request and every server's KV
/// usage returns to its baseline (SGLang's own gauges), within a bound; the time is reported.
/// (The prefills release their KV once it is sent, before the client leaves; their gauges are
/// checked all the same.)
#[test]
fn t6_client_gone_during_decode_frees_kv() {
    let Some(c) = cluster("t6_client_gone_during_decode_frees_kv") else { return };
    runtime().block_on(async {
        let client = client();
        let servers = [c.prefill_url(0), c.prefill_url(1), c.decode_url.clone()];
        let mut baseline = Vec::new();
        for s in &servers {
            baseline.push(metric(&client, s, TOKEN_USAGE, &[]).await);
        }
        let mut body = Api::Generate.body(&fresh_prompt("gone", 200), true, 1500);
        body["sampling_params"]["ignore_eos"] = json!(true);
        let t0 = Instant::now();
        let mut resp = client
            .post(format!("{}/generate", c.sidecar_url))
            .json(&body)
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .expect("streamed request");
        assert_eq!(resp.status(), 200);
        // SGLang refreshes its gauges every 40 decode steps: read until the decode's show the
        // request (KV in use), then leave.
        let mut chunks = 0;
        let mut held = 0.0;
        while held == 0.0 {
            match tokio::time::timeout(REQUEST_TIMEOUT, resp.chunk()).await {
                Ok(Ok(Some(_))) => chunks += 1,
                other => panic!("the stream ended early: {other:?}"),
            }
            if chunks % 10 == 0 && metric(&client, &c.decode_url, RUNNING, &[]).await >= 1.0 {
                held = metric(&client, &c.decode_url, USED_TOKENS, &[]).await;
            }
            assert!(chunks < 1000, "the decode's gauges never showed the request");
        }
        drop(resp);
        let gone = Instant::now();
        loud(&format!(
            "t6: client left after {chunks} chunks ({:.2} s), the decode holding {held} tokens of KV",
            t0.elapsed().as_secs_f64()
        ));
        let running = wait_metric(&client, &c.decode_url, RUNNING, &[], Duration::from_secs(20), |v| v == 0.0).await;
        let decode_stopped = gone.elapsed();
        assert_eq!(running, 0.0, "the decode still runs the abandoned request");
        for (s, base) in servers.iter().zip(&baseline) {
            let usage = wait_metric(&client, s, TOKEN_USAGE, &[], Duration::from_secs(20), |v| v <= *base).await;
            assert!(usage <= *base, "{s}: token usage {usage} did not return to its baseline {base}");
        }
        timing("decode dropped the abandoned request (num_running_reqs 0)", decode_stopped);
        timing("every server's token_usage back to baseline after the client left", gone.elapsed());
    });
}

/// Starts one more `pd-sidecar --mode sglang` in front of the real decode, with `extra` flags.
fn extra_sidecar(c: &Cluster, name: &str, port_offset: u16, extra: &[&str]) -> (Proc, String) {
    let addr = format!("127.0.0.1:{}", c.port_base + port_offset);
    let args: Vec<String> =
        [["--listen", addr.as_str(), "--mode", "sglang", "--engine", &c.decode_url].as_slice(), extra]
            .concat()
            .into_iter()
            .map(String::from)
            .collect();
    let bin = workspace_bin("pd-sidecar", "pd-sidecar").expect("pd-sidecar binary");
    let mut proc = Proc::spawn(name, &bin, &args, &[("RUST_LOG", "info")]).expect("starting a sidecar");
    let url = format!("http://{addr}");
    wait_http_ok(&mut proc, &format!("{url}/ready"), Duration::from_secs(30)).expect("sidecar ready");
    (proc, url)
}

/// Local decisions in front of a decode-mode SGLang (which refuses, 400, a body without
/// `bootstrap_room`): the sidecar reads the engine's `disaggregation_mode` from its
/// `/server_info`, runs a short prompt's "local" decision through a prefill it knows instead
/// (same text as the plain server's, a KV transfer counted), and with `--fallback local` and
/// its only prefill down answers a clear 503 within the bound, not SGLang's 400.
#[test]
fn t7_local_decisions_in_front_of_a_decode_only_engine() {
    let Some(c) = cluster("t7_local_decisions_in_front_of_a_decode_only_engine") else { return };
    runtime().block_on(async {
        let client = client();
        let t0 = Instant::now();
        let info = client
            .get(format!("{}/server_info", c.decode_url))
            .timeout(REQUEST_TIMEOUT)
            .send()
            .await
            .expect("the decode's /server_info");
        let info: Value = info.json().await.expect("server info JSON");
        assert_eq!(info["disaggregation_mode"], "decode", "the real decode's server info: {info}");

        // Every prompt is "short": each request is decided local, and must be served through
        // prefill B.
        let prefill_b = format!("{}#bootstrap={}", c.prefill_url(1), c.bootstrap_port(1));
        let (_short, short_url) = extra_sidecar(
            c,
            "pd-sidecar-sglang-short",
            31,
            &["--prefill", &prefill_b, "--local-prefill-below-tokens", "100000", "--fallback", "local"],
        );
        for api in [Api::Completions, Api::Generate] {
            let prompt = fresh_prompt("local-decision", 40);
            let expected = reference(&client, c, api, &prompt, MAX_TOKENS).await;
            let before = metric(&client, &c.prefill_url(1), KV_TRANSFERS, &[]).await;
            let body = api.body(&prompt, false, MAX_TOKENS);
            let (status, text) =
                post_json(&client, &format!("{short_url}{}", api.path()), &body, REQUEST_BOUND).await.expect("answer");
            assert_eq!(status, 200, "{api:?}: a local decision in front of the decode-only engine: {text}");
            assert_eq!(
                api.text(&text, false).expect("text"),
                expected,
                "{api:?}: text differs from the plain server's"
            );
            let after =
                wait_metric(&client, &c.prefill_url(1), KV_TRANSFERS, &[], Duration::from_secs(10), |v| v > before)
                    .await;
            assert!(after > before, "{api:?}: prefill B counted no KV transfer for a 'local' decision");
        }
        let disaggregated = metric(&client, &short_url, "pd_sidecar_disaggregated_total", &[]).await;
        assert_eq!(disaggregated, 2.0, "the sidecar should have disaggregated both 'local' decisions");
        timing("2 local decisions served through a prefill (decode-only engine)", t0.elapsed());

        // --fallback local with the only prefill down: a clear error, not the engine's 400.
        let t1 = Instant::now();
        let nowhere = format!("127.0.0.1:{}#bootstrap={}", c.port_base + 33, c.port_base + 34);
        let (_down, down_url) = extra_sidecar(
            c,
            "pd-sidecar-sglang-down",
            32,
            &["--prefill", &nowhere, "--fallback", "local", "--connect-timeout", SIDECAR_CONNECT_TIMEOUT],
        );
        let body = Api::Completions.body(&fresh_prompt("no-prefill", 40), false, MAX_TOKENS);
        let (status, text) =
            post_json(&client, &format!("{down_url}/v1/completions"), &body, REQUEST_BOUND).await.expect("answer");
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert_eq!(status, 503, "--fallback local with no prefill in front of a decode-only engine: {text}");
        assert!(v["error"]["message"].is_string(), "not an OpenAI-style error: {text}");
        assert!(t1.elapsed() < REQUEST_BOUND, "took {:?}", t1.elapsed());
        timing("--fallback local, prefill down, decode-only engine: 503", t1.elapsed());
    });
}

/// SIGKILLs prefill A (its whole process group) while requests run through the sidecar: every
/// request ends within the sidecar's bound (not SGLang's 300 s bootstrap wait) with text or a
/// clear OpenAI-style error; requests started after the kill succeed through prefill B. Runs
/// last: prefill A stays dead.
#[test]
fn t9_prefill_killed_during_a_run() {
    let Some(c) = cluster("t9_prefill_killed_during_a_run") else { return };
    runtime().block_on(async {
        let client = client();
        let sidecar = c.sidecar_url.clone();
        let survivor_before = metric(&client, &c.prefill_url(1), KV_TRANSFERS, &[]).await;
        const REQUESTS: usize = 12;
        const KILL_AFTER: usize = 3;
        let t0 = Instant::now();
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<Outcome>();
        // Two requests in flight at a time, so the kill lands in the middle of some.
        let next = Arc::new(AtomicUsize::new(0));
        for _ in 0..2 {
            let (client, sidecar, next, done_tx) = (client.clone(), sidecar.clone(), next.clone(), done_tx.clone());
            tokio::spawn(async move {
                loop {
                    let index = next.fetch_add(1, Ordering::SeqCst);
                    if index >= REQUESTS {
                        return;
                    }
                    let api = [Api::Completions, Api::Chat, Api::Generate][index % 3];
                    let stream = index % 2 == 1;
                    let body = api.body(&fresh_prompt("kill", 200), stream, MAX_TOKENS);
                    let started = t0.elapsed();
                    let t = Instant::now();
                    let url = format!("{sidecar}{}", api.path());
                    let result = post_json(&client, &url, &body, REQUEST_BOUND + Duration::from_secs(10)).await;
                    let result = result.map(|(status, text)| {
                        if status == 200 {
                            match api.text(&text, stream) {
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
                c.prefill(0).proc.signal_group(libc::SIGKILL);
                killed_at = Some(t0.elapsed());
                loud(&format!("sglang-e2e: prefill A killed at {:.2} s", t0.elapsed().as_secs_f64()));
            }
        }
        let killed_at = killed_at.expect("prefill A was killed");
        c.prefill(0).proc.kill_with(libc::SIGKILL, Duration::from_secs(10));
        assert_eq!(outcomes.len(), REQUESTS, "requests that never ended: {outcomes:?}");
        let KillTally { ok, ok_after_kill: after_kill_ok, clear_errors: errors, slowest } =
            tally_after_kill(&outcomes, killed_at, REQUEST_BOUND);
        timing(
            &format!(
                "{REQUESTS} requests, prefill A killed after {KILL_AFTER}: {ok} ok ({after_kill_ok} started after the kill), {errors} clear errors, slowest {:.2} s",
                slowest.as_secs_f64()
            ),
            t0.elapsed(),
        );
        assert!(after_kill_ok > 0, "no request started after the kill succeeded: {outcomes:?}");
        let survivor_after = metric(&client, &c.prefill_url(1), KV_TRANSFERS, &[]).await;
        assert!(survivor_after > survivor_before, "prefill B moved no KV after A died");
        assert!(c.sidecar_alive(), "the sidecar died");
        assert_eq!(http_status_blocking(&format!("{}/health", c.decode_url)), Some(200), "the decode is unhealthy");
    });
}
