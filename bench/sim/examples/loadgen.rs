//! A small closed-loop load generator for pd-sim: `connections` keep-alive connections, each
//! sending non-streaming completions back to back for `secs` seconds; prints requests/s.
//!
//! ```sh
//! taskset -c 0 target/release/pd-sim --port 8000 --workers 1 &
//! taskset -c 1 target/release/examples/loadgen http://127.0.0.1:8000 32 5
//! ```

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let url = format!("{}/v1/completions", args.get(1).map_or("http://127.0.0.1:8000", String::as_str));
    let connections: usize = args.get(2).map_or(Ok(32), |s| s.parse())?;
    let secs: f64 = args.get(3).map_or(Ok(5.0), |s| s.parse())?;
    let prompt_words: usize = args.get(4).map_or(Ok(64), |s| s.parse())?;
    tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(run(
        url,
        connections,
        secs,
        prompt_words,
    ))
}

async fn run(url: String, connections: usize, secs: f64, prompt_words: usize) -> anyhow::Result<()> {
    let client =
        reqwest::Client::builder().pool_max_idle_per_host(connections).timeout(Duration::from_secs(10)).build()?;
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let tasks: Vec<_> = (0..connections)
        .map(|c| {
            let (client, url, ok, failed) = (client.clone(), url.clone(), Arc::clone(&ok), Arc::clone(&failed));
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    // A shared prefix (cache hits) plus a distinct tail, like chat traffic.
                    let prompt: String = (0..prompt_words)
                        .map(|w| if w < prompt_words / 2 { format!("shared{w} ") } else { format!("c{c}r{i}w{w} ") })
                        .collect();
                    let body = serde_json::json!({"prompt": prompt, "max_tokens": 8});
                    let success = match client.post(&url).json(&body).send().await {
                        Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                        Err(_) => false,
                    };
                    if success { &ok } else { &failed }.fetch_add(1, Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let (ok, failed) = (ok.load(Relaxed), failed.load(Relaxed));
    println!(
        "{ok} ok, {failed} failed in {elapsed:.2} s: {:.0} requests/s ({connections} connections, {prompt_words}-token prompts, 8 output tokens)",
        ok as f64 / elapsed
    );
    Ok(())
}
