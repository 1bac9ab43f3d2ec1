//! Test harness: `pd-coordinator` and `pd-sim` processes on free loopback ports, killed on
//! drop, every wait bounded.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pd_sim::harness;
use serde_json::{json, Value};

pub const WAIT: Duration = Duration::from_secs(15);
pub const MODEL: &str = "sim-model";

pub fn free_port() -> u16 {
    pdbench::ports::free_loopback_port().expect("a free loopback port")
}

/// Binds `socket` on a loopback port the system picks as it binds (a port found free first may
/// be taken by a parallel test before the bind), and returns its endpoint.
pub fn bind_any_port(socket: &zmq::Socket) -> String {
    socket.bind("tcp://127.0.0.1:*").unwrap();
    socket.get_last_endpoint().unwrap().expect("a tcp endpoint is UTF-8")
}

/// A free loopback port whose next one is free too (for a data-parallel rank 1 beside rank 0).
pub fn adjacent_free_ports() -> u16 {
    for _ in 0..20 {
        let base = free_port();
        let free = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port)).is_ok();
        if base.checked_add(1).is_some_and(free) && free(base) {
            return base;
        }
    }
    panic!("no two adjacent free loopback ports");
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(Duration::from_secs(5)).build().unwrap()
}

/// A process's log file, in [`log_dir`]: removed when the process is dropped by a test that
/// passes, kept (and named on stderr) for one that fails.
fn log_path(name: &str) -> PathBuf {
    log_dir().join(format!("{name}.log"))
}

/// Under the target directory, shared by every run (the names hold ports or pids).
fn log_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("pd-coordinator-tests")
}

/// pd-sim sits next to pd-coordinator in the target directory (`cargo test --workspace`
/// builds it); when only this crate's tests were built, it is built now.
pub fn pd_sim_path() -> PathBuf {
    harness::binary_in(Path::new(env!("CARGO_BIN_EXE_pd-coordinator")).parent().unwrap())
}

pub struct Proc {
    child: Child,
    log: PathBuf,
}

/// Spawns `cmd` with its output in a log file, killed on drop.
pub fn spawn(cmd: Command, name: &str) -> Proc {
    Proc::spawn(cmd, name)
}

impl Proc {
    fn spawn(mut cmd: Command, name: &str) -> Proc {
        std::fs::create_dir_all(log_dir()).unwrap();
        let path = log_path(name);
        let log = std::fs::File::create(&path).unwrap();
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {name}: {e}"));
        Proc { child, log: path }
    }

    /// SIGKILL, no cleanup.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("log kept: {}", self.log.display());
        } else {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Waits for `proc`'s `/health`; when it never answers, says why and where its log is.
pub async fn wait_healthy(proc: &mut Proc, url: &str, name: &str) -> Result<(), harness::NotHealthy> {
    harness::healthy(&mut proc.child, url, WAIT).await.inspect_err(|_| {
        eprintln!("{name} at {url}: log in {}", log_path(name).display());
    })
}

/// A simulated engine with KV events and replay.
pub struct Sim {
    pub proc: Proc,
    pub id: String,
    pub port: u16,
    pub url: String,
    pub events: u16,
    pub replay: u16,
    extra: Vec<String>,
}

impl Sim {
    pub async fn start(id: &str, extra: &[&str]) -> Sim {
        let what = format!("pd-sim {id}");
        harness::start_with_retries(&what, || {
            Self::try_start_on(id, free_port(), free_port(), free_port(), None, extra)
        })
        .await
    }

    pub async fn start_on(id: &str, port: u16, events: u16, replay: u16, extra: &[&str]) -> Sim {
        let started = Self::try_start_on(id, port, events, replay, None, extra).await;
        started.unwrap_or_else(|e| panic!("pd-sim {id} on port {port}: {e}"))
    }

    /// An engine that connects its publisher to `collector` (a coordinator's
    /// --kv-events-listen) and publishes under `topic`; its replay socket is its own.
    pub async fn start_publishing_to(id: &str, collector: &str, topic: &str) -> Sim {
        let what = format!("pd-sim {id}");
        let extra = ["--kv-events-topic", topic];
        harness::start_with_retries(&what, || {
            Self::try_start_on(id, free_port(), 0, free_port(), Some(collector), &extra)
        })
        .await
    }

    /// Data-parallel rank `rank` of engine `id` in collector mode: it connects its publisher to
    /// `collector` (the coordinator's socket for that rank), names `rank` in its batches and
    /// serves replay on `replay` (vLLM's rank r: both endpoints offset by r).
    pub async fn start_rank_publishing_to(id: &str, rank: u32, collector: &str, topic: &str, replay: u16) -> Sim {
        let rank = rank.to_string();
        let extra = ["--kv-events-topic", topic, "--data-parallel-rank", &rank];
        let started = Self::try_start_on(id, free_port(), 0, replay, Some(collector), &extra).await;
        started.unwrap_or_else(|e| panic!("pd-sim {id} rank {rank} (replay on {replay}): {e}"))
    }

    async fn try_start_on(
        id: &str,
        port: u16,
        events: u16,
        replay: u16,
        collector: Option<&str>,
        extra: &[&str],
    ) -> Result<Sim, harness::NotHealthy> {
        let mut cmd = harness::command(&pd_sim_path(), port, "warn");
        let events_endpoint = collector.map_or_else(|| format!("tcp://*:{events}"), String::from);
        cmd.args(["--host", "127.0.0.1", "--engine-id", id, "--workers", "1"])
            .args(["--kv-events-endpoint", &events_endpoint])
            .args(["--kv-events-replay-endpoint", &format!("tcp://*:{replay}")])
            .args(extra);
        let name = format!("sim-{id}-{port}");
        let mut proc = Proc::spawn(cmd, &name);
        let url = format!("http://127.0.0.1:{port}");
        wait_healthy(&mut proc, &url, &name).await?;
        let extra = extra.iter().map(|s| s.to_string()).collect();
        Ok(Sim { proc, id: id.into(), port, url, events, replay, extra })
    }

    /// The registration body (as a sidecar would send it); `sidecar_url` optional.
    pub fn spec(&self, role: &str, sidecar_url: Option<&str>) -> Value {
        let mut spec = json!({
            "id": self.id, "role": role, "node": "node-1", "model": MODEL, "engine_url": self.url,
            "kv_events": format!("tcp://*:{}", self.events), "replay": format!("tcp://*:{}", self.replay),
            "block_size": 16,
        });
        if let Some(url) = sidecar_url {
            spec["sidecar_url"] = url.into();
        }
        spec
    }

    /// The registration body of an engine started with [`Sim::start_publishing_to`]: no
    /// `kv_events` endpoint; `topic` named when the coordinator cannot tell it from the pattern.
    pub fn collected_spec(&self, role: &str, topic: Option<&str>) -> Value {
        let mut spec = self.spec(role, None);
        let fields = spec.as_object_mut().unwrap();
        fields.remove("kv_events");
        if let Some(topic) = topic {
            fields.insert("kv_events_topic".into(), topic.into());
        }
        spec
    }

    /// A completion with a token-id prompt, so the engine caches (and publishes) its blocks.
    pub async fn complete(&self, tokens: &[u32]) {
        let r = client()
            .post(format!("{}/v1/completions", self.url))
            .json(&json!({"prompt": tokens, "max_tokens": 1}))
            .send()
            .await
            .expect("completion");
        assert!(r.status().is_success(), "completion on {}: {}", self.id, r.status());
    }

    pub async fn complete_text(&self, text: &str) {
        let r = client()
            .post(format!("{}/v1/completions", self.url))
            .json(&json!({"prompt": text, "max_tokens": 1}))
            .send()
            .await
            .expect("completion");
        assert!(r.status().is_success(), "completion on {}: {}", self.id, r.status());
    }
}

/// A coordinator daemon.
pub struct Coord {
    pub proc: Proc,
    pub http: u16,
    pub grpc: u16,
    pub url: String,
    args: Vec<String>,
}

impl Coord {
    pub async fn start(args: &[&str]) -> Coord {
        let args = || args.iter().map(|s| s.to_string()).collect();
        harness::start_with_retries("pd-coordinator", || Self::try_start_on(free_port(), free_port(), args())).await
    }

    /// In collector mode: `--kv-events-listen` on a loopback port whose next one is free too
    /// (data-parallel rank 1's), drawn again with the other ports when an attempt fails (a port
    /// found free may be taken before the coordinator binds it). [`Coord::collector`] names it.
    pub async fn start_collecting(args: &[&str]) -> Coord {
        let args = || {
            let listen = format!("tcp://127.0.0.1:{}", adjacent_free_ports());
            ["--kv-events-listen".to_string(), listen].into_iter().chain(args.iter().map(|s| s.to_string())).collect()
        };
        harness::start_with_retries("pd-coordinator", || Self::try_start_on(free_port(), free_port(), args())).await
    }

    pub async fn start_on(http: u16, grpc: u16, args: &[&str]) -> Coord {
        let started = Self::try_start_on(http, grpc, args.iter().map(|s| s.to_string()).collect()).await;
        started.unwrap_or_else(|e| panic!("pd-coordinator on port {http}: {e}"))
    }

    async fn try_start_on(http: u16, grpc: u16, args: Vec<String>) -> Result<Coord, harness::NotHealthy> {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_pd-coordinator"));
        cmd.args(["--listen", &format!("127.0.0.1:{http}"), "--grpc-listen", &format!("127.0.0.1:{grpc}")])
            .args(["--workers", "2", "--log", "info,pd_coordinator=debug"])
            .args(&args)
            .env_remove("PYTHONHASHSEED")
            .env_remove("RUST_LOG");
        let name = format!("coordinator-{http}");
        let mut proc = Proc::spawn(cmd, &name);
        let url = format!("http://127.0.0.1:{http}");
        wait_healthy(&mut proc, &url, &name).await?;
        Ok(Coord { proc, http, grpc, url, args })
    }

    /// The endpoint data-parallel rank `rank` publishes to, of a coordinator started with
    /// [`Coord::start_collecting`].
    pub fn collector(&self, rank: u32) -> String {
        let listen = self.args.iter().skip_while(|a| *a != "--kv-events-listen").nth(1);
        let listen = listen.expect("a coordinator started with --kv-events-listen");
        pd_protocols::zmq_frames::rank_endpoint(listen, rank).expect("a tcp:// collector endpoint")
    }

    /// kill -9 and start again on the same ports with the same flags.
    pub async fn restart(&mut self) {
        self.proc.kill9();
        let started = Coord::try_start_on(self.http, self.grpc, std::mem::take(&mut self.args)).await;
        *self = started.unwrap_or_else(|e| panic!("pd-coordinator on port {}: {e}", self.http));
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, body.to_string().into_bytes()).await
    }

    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> (u16, Value) {
        let r = client()
            .post(format!("{}{path}", self.url))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("POST {path}: {e}"));
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = client().get(format!("{}{path}", self.url)).send().await.unwrap_or_else(|e| panic!("GET {path}: {e}"));
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
    }

    pub async fn delete(&self, path: &str) -> u16 {
        client().delete(format!("{}{path}", self.url)).send().await.unwrap().status().as_u16()
    }

    pub async fn register(&self, spec: &Value) {
        let (status, body) = self.post("/v1/engines", spec).await;
        assert_eq!(status, 200, "register: {body}");
    }

    pub async fn heartbeat(&self, id: &str) -> (u16, Value) {
        self.post(&format!("/v1/engines/{id}/heartbeat"), &json!({})).await
    }

    /// `id` → alive, from GET /v1/engines.
    pub async fn alive(&self) -> std::collections::HashMap<String, bool> {
        let (status, list) = self.get("/v1/engines").await;
        assert_eq!(status, 200);
        list.as_array()
            .unwrap()
            .iter()
            .map(|e| (e["id"].as_str().unwrap().to_string(), e["alive"].as_bool().unwrap()))
            .collect()
    }

    /// Blocks indexed for `engine` (GET /v1/index/stats).
    pub async fn indexed(&self, engine: &str) -> u64 {
        let (_, stats) = self.get("/v1/index/stats").await;
        stats["models"][MODEL]["engines"][engine].as_u64().unwrap_or(0)
    }

    pub async fn pair(&self, body: &Value) -> (u16, Value) {
        self.post("/v1/pair", body).await
    }

    /// A counter or gauge from /metrics (first sample whose name and labels start with `key`).
    pub async fn metric(&self, key: &str) -> f64 {
        let (_, text) = self.get("/metrics").await;
        let text = text.as_str().unwrap().to_string();
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("metric {key} missing"))
    }
}

/// Polls `check` until it holds or `within` passes; returns how long it took.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            return start.elapsed();
        }
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Token ids `from .. from + n`.
pub fn tokens(from: u32, n: u32) -> Vec<u32> {
    (from..from + n).collect()
}

/// Records every POST /pd/release body it receives (the prefill sidecars' stand-in).
pub async fn recording_sidecar() -> (String, std::sync::Arc<parking_lot::Mutex<Vec<String>>>) {
    let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let app = {
        let seen = std::sync::Arc::clone(&seen);
        axum::Router::new().route(
            "/pd/release",
            axum::routing::post(move |body: String| {
                let seen = std::sync::Arc::clone(&seen);
                async move {
                    seen.lock().push(body);
                    "ok"
                }
            }),
        )
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}
