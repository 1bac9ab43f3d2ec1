//! Bearer tokens, TLS on the listener and towards upstreams (a certificate made in the test),
//! and the allowlist by network.

mod common;

use common::{fake, words, Sidecar, Sim};
use serde_json::json;

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
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    let dir = std::env::temp_dir().join(format!("pd-sidecar-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_path, cert.cert.pem()).unwrap();
    std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
    let (cert_s, key_s) = (cert_path.to_str().unwrap(), key_path.to_str().unwrap());

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
    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert.cert.pem().as_bytes()).unwrap())
        .build()
        .unwrap();
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
    let _ = std::fs::remove_dir_all(&dir);
}
