//! Test harness: `pd-sim` and `pd-sidecar` processes on free loopback ports (killed on drop),
//! small in-test HTTP fakes, and clients. Every wait is bounded.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use pd_sim::harness;
use serde_json::Value;

pub const WAIT: Duration = Duration::from_secs(10);

pub fn free_port() -> u16 {
    pdbench::ports::free_loopback_port().expect("a free loopback port")
}

/// The pd-sim binary: `PD_SIM_BIN`, else next to pd-sidecar (built on first use if missing).
pub fn sim_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| harness::binary_in(Path::new(env!("CARGO_BIN_EXE_pd-sidecar")).parent().unwrap())).clone()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(WAIT).pool_max_idle_per_host(0).build().unwrap()
}

pub struct Sim {
    child: Child,
    pub port: u16,
    pub url: String,
}

impl Sim {
    pub async fn start(args: &[&str]) -> Sim {
        harness::start_with_retries("pd-sim", || async {
            let port = free_port();
            let child = harness::command(&sim_bin(), port, "error").args(args).spawn().expect("spawning pd-sim");
            let mut sim = Sim { child, port, url: format!("http://127.0.0.1:{port}") };
            harness::healthy(&mut sim.child, &sim.url, WAIT).await?;
            Ok(sim)
        })
        .await
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub async fn leaks(&self) -> Value {
        get_json(&format!("{}/admin/leaks", self.url)).await
    }

    pub async fn leaks_until(&self, what: &str, within: Duration, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let report = self.leaks().await;
            if done(&report) {
                return report;
            }
            assert!(Instant::now() < deadline, "{what}: {report}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub async fn faults(&self, settings: Value) {
        let r = client().post(format!("{}/admin/faults", self.url)).json(&settings).send().await.unwrap();
        assert!(r.status().is_success());
    }

    pub async fn metrics(&self) -> String {
        client().get(format!("{}/metrics", self.url)).send().await.unwrap().text().await.unwrap()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Sidecar {
    child: Child,
    pub url: String,
    pub addr: String,
}

impl Sidecar {
    /// Starts pd-sidecar on a free port with these flags and waits until it listens.
    pub async fn start(args: &[&str]) -> Sidecar {
        Self::start_with(args, "http").await
    }

    pub async fn start_with(args: &[&str], scheme: &str) -> Sidecar {
        Self::spawn("127.0.0.1:0", args, scheme).await
    }

    /// Starts pd-sidecar on `port` (for a sidecar that must know its own URL up front).
    pub async fn start_on(port: u16, args: &[&str]) -> Sidecar {
        Self::start_on_with(port, args, "http").await
    }

    pub async fn start_on_with(port: u16, args: &[&str], scheme: &str) -> Sidecar {
        Self::spawn(&format!("127.0.0.1:{port}"), args, scheme).await
    }

    async fn spawn(listen: &str, args: &[&str], scheme: &str) -> Sidecar {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pd-sidecar"))
            .args(["--listen", listen])
            .args(args)
            .env("RUST_LOG", std::env::var("SIDECAR_LOG").unwrap_or_else(|_| "error".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning pd-sidecar");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            if let Some(Ok(line)) = lines.next() {
                let _ = tx.send(line);
            }
            for _ in lines {}
        });
        let line = rx.recv_timeout(WAIT).expect("pd-sidecar did not report its address");
        let addr = line.rsplit(' ').next().unwrap().to_string();
        Sidecar { child, url: format!("{scheme}://{addr}"), addr }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process exited (waiting up to `timeout`).
    pub async fn exited_within(&mut self, timeout: Duration) -> bool {
        harness::exited_within(&mut self.child, timeout).await
    }

    pub async fn metrics(&self) -> String {
        client().get(format!("{}/metrics", self.url)).send().await.unwrap().text().await.unwrap()
    }

    /// One sample of the sidecar's metrics (name with labels, as printed).
    pub async fn metric(&self, name: &str) -> f64 {
        metric(&self.metrics().await, name)
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post(&format!("{}{path}", self.url), body).await
    }
}

impl Drop for Sidecar {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name}"))
        .trim()
        .parse()
        .unwrap()
}

pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn get_json(url: &str) -> Value {
    client().get(url).send().await.unwrap().json().await.unwrap()
}

/// The body of a streamed response, as text.
pub async fn post_text(url: &str, body: &Value, headers: &[(&str, &str)]) -> (u16, String) {
    let mut req = client().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.text().await.unwrap())
}

/// A prompt of `n` distinct words (one token each with the simulator's tokenizer).
pub fn words(n: usize, salt: &str) -> String {
    (0..n).map(|i| format!("{salt}{i}")).collect::<Vec<_>>().join(" ")
}

/// SSE `data:` payloads, `[DONE]` included.
pub fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(String::from).collect()
}

/// Generated text of an SSE stream (completions or chat), ids ignored.
pub fn sse_text(text: &str) -> String {
    let mut out = String::new();
    for e in sse_events(text) {
        if e == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&e).unwrap();
        let c = &v["choices"][0];
        if let Some(t) = c["text"].as_str() {
            out.push_str(t);
        } else if let Some(t) = c["delta"]["content"].as_str() {
            out.push_str(t);
        }
    }
    out
}

/// What an in-test fake upstream saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub path: String,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
}

pub type Log = Arc<Mutex<Vec<Seen>>>;

/// Runs an axum app on a free port; returns its address (the server lives as long as the
/// runtime of the test).
pub async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("127.0.0.1:{}", addr.port())
}

/// A fake upstream answering every POST with `respond(seen)` and recording requests.
pub async fn fake<F>(respond: F) -> (String, Log)
where
    F: Fn(&Seen) -> (u16, &'static str, String) + Send + Sync + 'static,
{
    let log: Log = Arc::default();
    let respond = Arc::new(respond);
    let l = Arc::clone(&log);
    let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
        let (l, respond) = (Arc::clone(&l), Arc::clone(&respond));
        async move {
            let (parts, body) = req.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap();
            let seen = Seen { path: parts.uri.path().to_string(), headers: parts.headers, body };
            let (status, ctype, text) = respond(&seen);
            l.lock().unwrap().push(seen);
            http::Response::builder()
                .status(status)
                .header("content-type", ctype)
                .body(axum::body::Body::from(text))
                .unwrap()
        }
    });
    (serve(app).await, log)
}

/// Two fakes for a vLLM handoff: a prefill answering with the params a decode pulls with, and
/// a decode answering a completion; each records what it was sent.
pub async fn fake_handoff_engines() -> ((String, Log), (String, Log)) {
    let params = serde_json::json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": "p",
                        "remote_block_ids": [1, 2], "remote_request_id": "r", "remote_host": "127.0.0.1", "remote_port": 1});
    let prefilled = serde_json::json!({"id": "p", "object": "text_completion", "kv_transfer_params": params,
                           "choices": [{"index": 0, "text": "a", "finish_reason": "length"}]})
    .to_string();
    let decoded =
        serde_json::json!({"id": "d", "object": "text_completion", "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]})
            .to_string();
    let prefill = fake(move |_| (200, "application/json", prefilled.clone())).await;
    let decode = fake(move |_| (200, "application/json", decoded.clone())).await;
    (prefill, decode)
}

/// The `pd-coordinator` built next to `pd-sidecar`. The workspace test command builds it (its
/// package has integration tests); a test that needs it fails, not skips, when it is missing.
pub fn coordinator_bin() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_BIN_EXE_pd-sidecar")).parent().expect("a target directory").to_path_buf();
    let bin = dir.join("pd-coordinator");
    assert!(
        bin.exists(),
        "{} is not built: run `cargo build -p pd-coordinator` with this test's profile, or the workspace test command",
        bin.display()
    );
    bin
}

/// A real `pd-coordinator` on a free port (HTTP only), killed on drop.
pub struct Coordinator {
    child: Child,
    pub url: String,
}

impl Coordinator {
    pub async fn start(args: &[&str]) -> Coordinator {
        let bin = coordinator_bin();
        let started = harness::start_with_retries("pd-coordinator", || async {
            let port = free_port();
            let child = Command::new(&bin)
                .args(["--listen", &format!("127.0.0.1:{port}"), "--no-grpc"])
                .args(args)
                .env("RUST_LOG", "error")
                .env_remove("PD_COORDINATOR_CONFIG")
                .stdin(Stdio::null())
                .spawn()
                .expect("spawning pd-coordinator");
            let mut c = Coordinator { child, url: format!("http://127.0.0.1:{port}") };
            harness::healthy(&mut c.child, &c.url, WAIT).await?;
            Ok(c)
        });
        started.await
    }

    pub async fn metrics(&self) -> String {
        client().get(format!("{}/metrics", self.url)).send().await.unwrap().text().await.unwrap()
    }

    pub async fn get(&self, path: &str) -> Value {
        get_json(&format!("{}{path}", self.url)).await
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `f` until it gives a value (bounded by [`WAIT`]).
pub async fn eventually<T, F: std::future::Future<Output = Option<T>>>(what: &str, mut f: impl FnMut() -> F) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The sum of the samples of `name` whose labels contain `labels` (engines label their metrics).
pub fn metric_sum(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
