//! Test harness: `pd-sim` processes on free loopback ports, killed on drop, every wait bounded.

#![allow(dead_code)]

use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use pd_sim::harness;
use serde_json::{json, Value};

pub const WAIT: Duration = Duration::from_secs(10);

pub fn free_port() -> u16 {
    pdbench::ports::free_loopback_port().expect("a free loopback port")
}

pub struct Sim {
    child: Child,
    pub port: u16,
    pub url: String,
    args: Vec<String>,
}

impl Sim {
    /// Starts a simulator with these extra flags and waits for `/health`.
    pub async fn start(args: &[&str]) -> Sim {
        harness::start_with_retries("pd-sim", || Self::try_start_on(free_port(), args)).await
    }

    pub async fn start_on(port: u16, args: &[&str]) -> Sim {
        Self::try_start_on(port, args).await.unwrap_or_else(|e| panic!("pd-sim on port {port}: {e}"))
    }

    pub async fn try_start_on(port: u16, args: &[&str]) -> Result<Sim, harness::NotHealthy> {
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let child = harness::command(Path::new(env!("CARGO_BIN_EXE_pd-sim")), port, "warn")
            .args(&args)
            .spawn()
            .expect("spawning pd-sim");
        let mut sim = Sim { child, port, url: format!("http://127.0.0.1:{port}"), args };
        harness::healthy(&mut sim.child, &sim.url, WAIT).await?;
        Ok(sim)
    }

    /// Kills the process and starts it again with the same port and flags.
    pub async fn restart(&mut self) {
        self.kill();
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let fresh = Sim::start_on(self.port, &args).await;
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old); // already killed and reaped
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has exited, waiting up to `timeout`.
    pub async fn exited_within(&mut self, timeout: Duration) -> bool {
        harness::exited_within(&mut self.child, timeout).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        post(&format!("{}{path}", self.url), body).await
    }

    pub async fn leaks(&self) -> Value {
        get_json(&format!("{}/admin/leaks", self.url)).await
    }

    /// Polls the leak report until `done` holds (bounded); returns the last report.
    pub async fn leaks_until(&self, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + WAIT;
        loop {
            let report = self.leaks().await;
            if done(&report) {
                return report;
            }
            assert!(Instant::now() < deadline, "{what}: {report}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
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

pub fn client() -> reqwest::Client {
    reqwest::Client::builder().timeout(WAIT).build().unwrap()
}

pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

pub async fn get_json(url: &str) -> Value {
    client().get(url).send().await.unwrap().json().await.unwrap()
}

/// A prompt of `n` distinct words (one token each with the simple tokenizer).
pub fn words(n: usize, salt: &str) -> String {
    (0..n).map(|i| format!("{salt}{i}")).collect::<Vec<_>>().join(" ")
}

/// What a P/D proxy sends to the prefill (PROTOCOLS.md §1).
pub fn prefill_body(prompt: &str) -> Value {
    json!({"prompt": prompt, "max_tokens": 1, "stream": false,
           "kv_transfer_params": pd_protocols::kv_params::prefill_request()})
}

/// Polls `f` until it returns `Some` (bounded).
pub async fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
