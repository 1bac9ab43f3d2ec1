//! Bearer tokens, TLS on the listener and towards upstreams (a certificate made in the test),
//! the same between sidecars and a real coordinator, and the allowlist by network.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{fake, free_port, words, Sidecar, Sim};
use serde_json::{json, Value};

/// A self-signed certificate for localhost/127.0.0.1 written to a fresh directory.
struct TestCert {
    dir: std::path::PathBuf,
    pem: String,
}

impl TestCert {
    fn new(name: &str) -> TestCert {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        let dir = std::env::temp_dir().join(format!("pd-sidecar-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cert.pem"), cert.cert.pem()).unwrap();
        std::fs::write(dir.join("key.pem"), cert.signing_key.serialize_pem()).unwrap();
        TestCert { dir, pem: cert.cert.pem() }
    }

    fn cert(&self) -> String {
        self.dir.join("cert.pem").display().to_string()
    }

    fn key(&self) -> String {
        self.dir.join("key.pem").display().to_string()
    }

    fn client(&self) -> reqwest::Client {
        reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(self.pem.as_bytes()).unwrap())
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap()
    }
}

impl Drop for TestCert {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_token_in_and_upstream_token_out() {
    let (engine, log) = fake(|_| {
        (200, "application/json", r#"{"choices": [], "kv_transfer_params": {"do_remote_prefill": true}}"#.into())
    })
    .await;
    let s = Sidecar::start(&[
        "--engine",
        &engine,
        "--prefill",
        &engine,
        "--auth-token",
        "s3cret",
        "--upstream-token",
        "engine-key",
    ])
    .await;
    let url = format!("{}/v1/completions", s.url);
    let c = common::client();
    let r = c.post(&url).json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let err: serde_json::Value = r.json().await.unwrap();
    assert_eq!(err["error"]["type"], "AuthenticationError");
    let r = c.post(&url).bearer_auth("wrong").json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        c.get(format!("{}/v1/models", s.url)).send().await.unwrap().status(),
        401,
        "pass-through is guarded too"
    );
    assert!(log.lock().unwrap().is_empty());
    let r = c.post(&url).bearer_auth("s3cret").json(&json!({"prompt": "x"})).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let seen = log.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "prefill and decode");
    assert!(seen.iter().all(|s| s.headers["authorization"] == "Bearer engine-key"));
    // Probes stay open.
    assert_eq!(c.get(format!("{}/health", s.url)).send().await.unwrap().status(), 200);
    assert_eq!(s.metric("pd_sidecar_requests_total{outcome=\"unauthorized\"}").await, 2.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_listener_and_tls_upstreams() {
    let tls = TestCert::new("tls");
    let (cert_s, key_s) = (&*tls.cert(), &*tls.key());

    let p = Sim::start(&[]).await;
    let d = Sim::start(&["--kv-load-failure-policy", "fail"]).await;
    // TLS fronts for both engines (they pass the P/D fields through), and a P/D sidecar that
    // reaches them over TLS and serves TLS itself.
    let tls_args = |engine: &str| {
        vec![
            "--engine".to_string(),
            engine.to_string(),
            "--tls-cert".into(),
            cert_s.into(),
            "--tls-key".into(),
            key_s.into(),
            "--trust-client-kv-params".into(),
        ]
    };
    let pa = tls_args(&p.url);
    let da = tls_args(&d.url);
    let p_front = Sidecar::start_with(&pa.iter().map(String::as_str).collect::<Vec<_>>(), "https").await;
    let d_front = Sidecar::start_with(&da.iter().map(String::as_str).collect::<Vec<_>>(), "https").await;
    let s = Sidecar::start_with(
        &[
            "--engine",
            &d_front.url,
            "--prefill",
            &p_front.url,
            "--upstream-ca",
            cert_s,
            "--tls-cert",
            cert_s,
            "--tls-key",
            key_s,
        ],
        "https",
    )
    .await;
    let client = tls.client();
    let r = client
        .post(format!("{}/v1/completions", s.url))
        .json(&json!({"prompt": words(40, "tls"), "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(d.leaks().await["pulls"], 1, "P/D went through both TLS hops");
    // Plain HTTP to a TLS listener fails; a client that does not trust the cert is refused.
    assert!(common::client().get(format!("http://{}/health", s.addr)).send().await.is_err());
    assert!(reqwest::Client::new().get(format!("{}/health", s.url)).send().await.is_err());
    // A sidecar that does not trust the upstream's certificate cannot reach it: 503, clearly.
    let untrusting = Sidecar::start(&["--engine", &d_front.url]).await;
    let (status, err) = untrusting.post("/v1/completions", &json!({"prompt": "a", "max_tokens": 1})).await;
    assert_eq!(status, 503, "{err}");
}

/// A coordinator serving https and demanding a bearer token; sidecars that register, pair and
/// report over https with theirs; and the coordinator's release call to a TLS sidecar that
/// demands its own token, which frees the prefill's held blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_and_tls_between_sidecars_and_the_coordinator() {
    let bin = common::coordinator_bin();
    let tls = TestCert::new("coordinator-tls");
    let https = tls.client();
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let mut coordinator = Command::new(bin)
        .args(["--listen", &format!("127.0.0.1:{port}"), "--no-grpc", "--heartbeat-ms", "200ms"])
        .args(["--auth-token", "coord-key", "--sidecar-token", "side-key"])
        .args(["--tls-cert", &tls.cert(), "--tls-key", &tls.key(), "--tls-ca", &tls.cert()])
        .env("RUST_LOG", "error")
        .env_remove("PD_COORDINATOR_CONFIG")
        .stdin(Stdio::null())
        .spawn()
        .expect("spawning pd-coordinator");
    let _kill = KillOnDrop(&mut coordinator);
    common::eventually("the coordinator serves https", || async {
        https.get(format!("{base}/health")).send().await.ok().filter(|r| r.status() == 200)
    })
    .await;

    // Without the token (or with another) every API call is refused; probes stay open.
    let r = https.get(format!("{base}/v1/engines")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "authentication_error", "{body}");
    let r = https.post(format!("{base}/v1/pair")).bearer_auth("side-key").json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 401, "the sidecars' token is not the coordinator's");
    assert_eq!(https.get(format!("{base}/metrics")).send().await.unwrap().status(), 200);
    assert!(common::client().get(format!("http://127.0.0.1:{port}/health")).send().await.is_err(), "no plain HTTP");

    let (p, d) = (Sim::start(&[]).await, Sim::start(&["--kv-load-failure-policy", "fail"]).await);
    let link = |id: &str, role: &str, node: &str, engine: &str| -> Vec<String> {
        [
            "--engine",
            engine,
            "--coordinator",
            &base,
            "--coordinator-token",
            "coord-key",
            "--upstream-ca",
            &tls.cert(),
            "--engine-id",
            id,
            "--role",
            role,
            "--model",
            "sim-model",
            "--node",
            node,
        ]
        .map(String::from)
        .to_vec()
    };
    // The prefill's sidecar serves TLS and wants its own token on /pd/release.
    let p_port = free_port();
    let mut pa = link("pre-0", "prefill", "pnode", &p.url);
    pa.extend(
        ["--auth-token", "side-key", "--tls-cert", &tls.cert(), "--tls-key", &tls.key(), "--advertise-url"]
            .map(String::from),
    );
    pa.push(format!("https://127.0.0.1:{p_port}"));
    let _ps = Sidecar::start_on_with(p_port, &pa.iter().map(String::as_str).collect::<Vec<_>>(), "https").await;
    let da = link("dec-0", "decode", "dnode", &d.url);
    let ds = Sidecar::start(&da.iter().map(String::as_str).collect::<Vec<_>>()).await;
    let engines = |https: reqwest::Client, base: String| async move {
        let r = https.get(format!("{base}/v1/engines")).bearer_auth("coord-key").send().await.ok()?;
        r.json::<Value>().await.ok()
    };
    common::eventually("both sidecars registered over https", || async {
        let v = engines(https.clone(), base.clone()).await?;
        (v.as_array()?.iter().filter(|e| e["alive"] == true).count() == 2).then_some(())
    })
    .await;
    let (status, out) =
        ds.post("/v1/completions", &json!({"model": "sim-model", "prompt": words(64, "sec"), "max_tokens": 3})).await;
    assert_eq!(status, 200, "{out}");
    assert_eq!(ds.metric("pd_sidecar_pairings_total").await, 1.0, "paired through the https coordinator");
    assert_eq!(ds.metric("pd_sidecar_disaggregated_total").await, 1.0);

    // A handoff whose decode node then goes down: the coordinator releases the prefill's held
    // blocks through its TLS sidecar, with the sidecar token.
    let prompt = words(64, "orphan");
    let call = |path: &str| https.post(format!("{base}{path}")).bearer_auth("coord-key");
    let decision: Value = call("/v1/pair")
        .json(&json!({"request_id": "orphan-1", "model": "sim-model", "prompt": prompt, "local_engine": "dec-0"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(decision["prefill"]["id"], "pre-0", "{decision}");
    let held: Value = common::client()
        .post(format!("{}/v1/completions", p.url))
        .json(&json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let params = held["kv_transfer_params"].clone();
    assert!(params.is_object(), "{held}");
    assert!(p.leaks().await["held_blocks"].as_u64().unwrap() > 0, "the prefill holds blocks for the decode");
    let r = call("/v1/report")
        .json(&json!({"request_id": "orphan-1", "event": "prefill_done", "engine": "pre-0", "kv_transfer_params": params}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert!(call("/v1/nodes/dnode/down").send().await.unwrap().status().is_success());
    p.leaks_until("released through the TLS sidecar", Duration::from_secs(10), |r| r["held_blocks"] == 0).await;
    let metrics = https.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("pd_coordinator_releases_total{outcome=\"posted\"} 1"), "{metrics}");
}

struct KillOnDrop<'a>(&'a mut std::process::Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
