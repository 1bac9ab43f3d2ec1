//! `sidecar-bench`: what the sidecar costs.
//!
//! `overhead` (default) starts two `pd-sim` engines (zero timing) and a `pd-sidecar`, then at
//! each concurrency level runs the same P/D requests two ways, alternating rounds: **direct**
//! (this program drives the prefill and decode calls itself, with the sidecar's own rewriting
//! code, so the only difference is the proxy hop) and **through the sidecar**; it reports
//! latency percentiles, the added p50/p99, throughput, and the sidecar's resident set idle and
//! at the highest level.
//!
//! `drive` runs closed-loop load against any URL for a while and prints requests/s (used by
//! `bench/compare-vllm-router.sh` against the sidecar and against vllm-router).
//!
//! ```sh
//! cargo build --release -p pd-sim -p pd-sidecar --example sidecar-bench
//! target/release/examples/sidecar-bench overhead --levels 1,64,512
//! ```

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::body::Body;
use bytes::Bytes;
use clap::{Args, Parser, Subcommand};
use hdrhistogram::Histogram;
use http_body_util::BodyExt;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use pd_sidecar::json::Object;
use pd_sidecar::rewrite;

type HttpClient = Client<HttpConnector, Body>;

#[derive(Parser, Debug)]
#[command(name = "sidecar-bench", about = "Proxy overhead and throughput of pd-sidecar")]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Added latency versus direct P/D calls, per concurrency level, and the sidecar's RSS.
    Overhead(Overhead),
    /// Closed-loop load against a running proxy (or direct P/D) for a while; prints req/s.
    Drive(Drive),
}

#[derive(Args, Debug, Clone)]
struct Workload {
    /// Words per prompt (one token each for pd-sim); every prompt is distinct.
    #[arg(long, default_value_t = 64)]
    prompt_words: usize,
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Non-streaming requests instead of SSE streams.
    #[arg(long)]
    no_stream: bool,
}

#[derive(Args, Debug)]
struct Overhead {
    /// Concurrent streams per level.
    #[arg(long, value_delimiter = ',', default_value = "1,64,512")]
    levels: Vec<usize>,
    /// Measured requests per level and mode (default: max(3000, 20 × level) with zero timing,
    /// max(16, 4 × level) with --decode-us-per-token).
    #[arg(long)]
    requests: Option<usize>,
    /// Rounds per mode (alternating direct / sidecar).
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    #[arg(long)]
    sim_bin: Option<PathBuf>,
    #[arg(long)]
    sidecar_bin: Option<PathBuf>,
    /// Tokio workers of each simulator.
    #[arg(long, default_value_t = 1)]
    sim_workers: usize,
    /// Tokio workers of the sidecar (default: its own default, the cores).
    #[arg(long)]
    sidecar_workers: Option<usize>,
    /// Run the sidecar on this CPU alone and everything else (simulators, this program) on
    /// the other CPUs (`taskset`), as a proxy with a core of its own runs in production.
    #[arg(long)]
    pin_sidecar: Option<usize>,
    /// Write the results as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Decode time per output token of the simulators (0: zero timing, the issue's setting;
    /// more: long-lived streams, so that high concurrency does not saturate the CPUs).
    #[arg(long, default_value_t = 0)]
    decode_us_per_token: u64,
    #[command(flatten)]
    work: Workload,
}

#[derive(Args, Debug)]
struct Drive {
    /// Base URL of the proxy (requests go to {url}/v1/completions).
    #[arg(long)]
    url: Option<String>,
    /// Drive P/D directly instead: prefill and decode base URLs.
    #[arg(long, requires = "decode")]
    prefill: Option<String>,
    #[arg(long)]
    decode: Option<String>,
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    #[arg(long, default_value = "sim-model")]
    model: String,
    /// Also report the CPU time this process (the proxy) spent during the run, and its resident
    /// set before the run and at its peak.
    #[arg(long)]
    pid: Option<u32>,
    #[command(flatten)]
    work: Workload,
}

/// User + system CPU time of a process (and its threads), seconds.
fn cpu_secs(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

fn client() -> HttpClient {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new()).pool_max_idle_per_host(4096).build(http)
}

static SEQ: AtomicU64 = AtomicU64::new(0);

fn body(w: &Workload, model: &str) -> Vec<u8> {
    let n = SEQ.fetch_add(1, Relaxed);
    let prompt: Vec<String> = (0..w.prompt_words).map(|i| format!("r{n}w{i}")).collect();
    serde_json::to_vec(&serde_json::json!({
        "model": model, "prompt": prompt.join(" "), "max_tokens": w.max_tokens, "stream": !w.no_stream
    }))
    .unwrap()
}

async fn post(c: &HttpClient, url: &str, body: Vec<u8>) -> anyhow::Result<Bytes> {
    post_timed(c, url, body, Instant::now()).await.map(|(b, _)| b)
}

/// The whole body, and when (after `t0`) its first byte arrived.
async fn post_timed(c: &HttpClient, url: &str, body: Vec<u8>, t0: Instant) -> anyhow::Result<(Bytes, Duration)> {
    let req = http::Request::post(url).header("content-type", "application/json").body(Body::from(body))?;
    let resp = c.request(req).await?;
    let status = resp.status();
    let mut incoming = resp.into_body();
    let mut out = bytes::BytesMut::new();
    let mut first = None;
    while let Some(frame) = incoming.frame().await {
        if let Ok(data) = frame?.into_data() {
            first.get_or_insert_with(|| t0.elapsed());
            out.extend_from_slice(&data);
        }
    }
    if !status.is_success() {
        bail!("{url}: {status}: {}", String::from_utf8_lossy(&out));
    }
    Ok((out.freeze(), first.unwrap_or_else(|| t0.elapsed())))
}

/// Where one request goes.
#[derive(Clone, Debug)]
enum Route {
    Proxy(String),
    /// Prefill and decode base URLs: the load generator is the proxy.
    Direct(String, String),
}

/// One request; returns the time to its first response byte.
async fn one(c: &HttpClient, route: &Route, body: Vec<u8>) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    match route {
        Route::Proxy(url) => post_timed(c, &format!("{url}/v1/completions"), body, t0).await.map(|(_, t)| t),
        Route::Direct(p, d) => {
            let object = Object::parse(&body)?;
            let answer = post(c, &format!("{p}/v1/completions"), rewrite::prefill_body(&object, None)).await?;
            let answer = Object::parse(&answer)?;
            let params = answer.get("kv_transfer_params").context("no kv_transfer_params")?.get();
            post_timed(c, &format!("{d}/v1/completions"), rewrite::decode_body(&object, params), t0)
                .await
                .map(|(_, t)| t)
        }
    }
}

fn hist() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 600_000_000, 3).unwrap()
}

/// Latencies of one run: first byte and whole response, microseconds.
struct Lat {
    first: Histogram<u64>,
    total: Histogram<u64>,
}

impl Lat {
    fn new() -> Lat {
        Lat { first: hist(), total: hist() }
    }

    fn add(&mut self, o: Lat) {
        self.first.add(o.first).unwrap();
        self.total.add(o.total).unwrap();
    }
}

/// `requests` requests over `concurrency` workers (started a little apart, so streams do not
/// march in lockstep).
async fn run(
    c: &HttpClient,
    route: &Route,
    w: &Workload,
    concurrency: usize,
    requests: usize,
) -> anyhow::Result<(Lat, Duration)> {
    let started = Instant::now();
    let per = requests.div_ceil(concurrency);
    let tasks: Vec<_> = (0..concurrency)
        .map(|i| {
            let (c, route, w) = (c.clone(), route.clone(), w.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_micros((i as u64 * 997) % 20_000)).await;
                let mut lat = Lat::new();
                for _ in 0..per {
                    let t = Instant::now();
                    let first = one(&c, &route, body(&w, "sim-model")).await?;
                    lat.first.record(first.as_micros().max(1) as u64).unwrap();
                    lat.total.record(t.elapsed().as_micros().max(1) as u64).unwrap();
                }
                anyhow::Ok(lat)
            })
        })
        .collect();
    let mut all = Lat::new();
    for t in tasks {
        all.add(t.await??);
    }
    Ok((all, started.elapsed()))
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// The highest resident set of a process while it lives, sampled every 5 ms on a thread.
struct RssPeak {
    sampling: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: std::thread::JoinHandle<()>,
}

impl RssPeak {
    fn start(pid: u32) -> RssPeak {
        let sampling = Arc::new(AtomicBool::new(true));
        let peak = Arc::new(AtomicU64::new(rss_kib(pid)));
        let thread = {
            let (sampling, peak) = (Arc::clone(&sampling), Arc::clone(&peak));
            std::thread::spawn(move || {
                while sampling.load(Relaxed) {
                    peak.fetch_max(rss_kib(pid), Relaxed);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        RssPeak { sampling, peak, thread }
    }

    /// Stops sampling; the peak, KiB.
    fn stop(self) -> u64 {
        self.sampling.store(false, Relaxed);
        let _ = self.thread.join();
        self.peak.load(Relaxed)
    }
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sibling(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/examples/sidecar-bench → target/<profile>/<name>
    exe.parent().and_then(|p| p.parent()).map(|p| p.join(name)).unwrap()
}

async fn wait_health(url: &str) -> anyhow::Result<()> {
    let c = client();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let req = http::Request::get(format!("{url}/health")).body(Body::empty())?;
        if let Ok(r) = c.request(req).await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("{url} did not come up");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Moves every thread of this process off `cpu`, for the sidecar alone; returns `cpu` and the
/// other CPUs as `taskset` lists.
fn leave_cpu_to_sidecar(cpu: usize) -> anyhow::Result<(String, String)> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpu >= cores || cores < 2 {
        bail!("--pin-sidecar {cpu}: this machine has CPUs 0..{cores}");
    }
    let others: Vec<String> = (0..cores).filter(|&c| c != cpu).map(|c| c.to_string()).collect();
    let others = others.join(",");
    let me = std::process::id().to_string();
    let out = std::process::Command::new("taskset").args(["-a", "-p", "-c", &others, &me]).output()?;
    if !out.status.success() {
        bail!("taskset failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((cpu.to_string(), others))
}

/// Starts `bin`, on the CPUs `cpus` (a `taskset` list) when given.
fn spawn(cpus: Option<&str>, bin: &PathBuf, args: &[String]) -> anyhow::Result<Child> {
    let mut command = match cpus {
        Some(cpus) => {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", cpus]).arg(bin);
            c
        }
        None => std::process::Command::new(bin),
    };
    let child = command
        .args(args)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    Ok(Child(child))
}

fn pct(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

async fn overhead(o: Overhead) -> anyhow::Result<()> {
    let sim_bin = o.sim_bin.clone().unwrap_or_else(|| sibling("pd-sim"));
    let sidecar_bin = o.sidecar_bin.clone().unwrap_or_else(|| sibling("pd-sidecar"));
    let free_port = pdbench::ports::free_loopback_port;
    let (pp, dp, sp) = (free_port()?, free_port()?, free_port()?);
    let pinned = o.pin_sidecar.map(leave_cpu_to_sidecar).transpose()?;
    let sidecar_cpus = pinned.as_ref().map(|(mine, _)| mine.as_str());
    let other_cpus = pinned.as_ref().map(|(_, others)| others.as_str());
    let sim = |port: u16| -> Vec<String> {
        [
            "--port",
            &port.to_string(),
            "--workers",
            &o.sim_workers.to_string(),
            "--num-blocks",
            "65536",
            "--max-running",
            "4096",
            "--decode-us-per-token",
            &o.decode_us_per_token.to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let _p = spawn(other_cpus, &sim_bin, &sim(pp))?;
    let _d = spawn(other_cpus, &sim_bin, &sim(dp))?;
    let (p, d) = (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{dp}"));
    let mut sargs: Vec<String> = ["--listen", &format!("127.0.0.1:{sp}"), "--engine", &d, "--prefill", &p]
        .iter()
        .map(|s| s.to_string())
        .collect();
    if let Some(n) = o.sidecar_workers {
        sargs.extend(["--workers".to_string(), n.to_string()]);
    }
    let sidecar = spawn(sidecar_cpus, &sidecar_bin, &sargs)?;
    let s = format!("http://127.0.0.1:{sp}");
    wait_health(&p).await?;
    wait_health(&d).await?;
    wait_health(&s).await?;
    let pid = sidecar.0.id();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rss_idle = rss_kib(pid);
    let c = client();
    let direct = Route::Direct(p.clone(), d.clone());
    let proxied = Route::Proxy(s.clone());
    let mut rows = Vec::new();
    let mut rss_peak = 0;
    println!(
        "pd-sidecar overhead: pd-sim (decode {} us/token), {} prompt tokens, {} output tokens, {}; direct = this program \
         makes the prefill and decode calls itself{}",
        o.decode_us_per_token,
        o.work.prompt_words,
        o.work.max_tokens,
        if o.work.no_stream { "non-streaming" } else { "SSE streams" },
        match &pinned {
            Some((mine, others)) => format!("; sidecar on CPU {mine}, the rest on CPUs {others}"),
            None => String::new(),
        }
    );
    println!(
        "{:>5} {:>8} | {:>17} {:>17} {:>17} |",
        "conc", "latency", "direct p50/p99", "sidecar p50/p99", "added p50/p99"
    );
    for &level in &o.levels {
        let requests =
            o.requests.unwrap_or(if o.decode_us_per_token > 0 { (4 * level).max(16) } else { (20 * level).max(3000) });
        // Warm both paths (connections, caches).
        run(&c, &direct, &o.work, level, level).await?;
        run(&c, &proxied, &o.work, level, level).await?;
        let (mut ld, mut ls) = (Lat::new(), Lat::new());
        let (mut td, mut ts) = (Duration::ZERO, Duration::ZERO);
        let sampler = RssPeak::start(pid);
        let cpu0 = cpu_secs(pid);
        for _ in 0..o.rounds {
            let (l, t) = run(&c, &direct, &o.work, level, requests / o.rounds).await?;
            ld.add(l);
            td += t;
            let (l, t) = run(&c, &proxied, &o.work, level, requests / o.rounds).await?;
            ls.add(l);
            ts += t;
        }
        let cpu_us = (cpu_secs(pid) - cpu0) * 1e6 / ls.total.len().max(1) as f64;
        let level_peak = sampler.stop();
        rss_peak = rss_peak.max(level_peak);
        let (dr, sr) = (ld.total.len() as f64 / td.as_secs_f64(), ls.total.len() as f64 / ts.as_secs_f64());
        let mut row = serde_json::json!({
            "concurrency": level, "requests": ls.total.len(), "direct_rps": dr, "sidecar_rps": sr,
            "sidecar_rss_peak_kib": level_peak, "sidecar_cpu_us_per_request": cpu_us,
        });
        for (name, d, s) in [("first_byte", &ld.first, &ls.first), ("total", &ld.total, &ls.total)] {
            println!(
                "{:>5} {:>8} | {:>7.3}/{:>7.3}ms {:>7.3}/{:>7.3}ms {:>7.3}/{:>7.3}ms | req/s direct {:.0}, sidecar {:.0}; sidecar CPU {:.0} us/req, RSS peak {:.1} MiB",
                level,
                if name == "total" { "total" } else { "1st byte" },
                pct(d, 0.5),
                pct(d, 0.99),
                pct(s, 0.5),
                pct(s, 0.99),
                pct(s, 0.5) - pct(d, 0.5),
                pct(s, 0.99) - pct(d, 0.99),
                dr,
                sr,
                cpu_us,
                level_peak as f64 / 1024.0
            );
            row[name] = serde_json::json!({
                "direct_ms": {"p50": pct(d, 0.5), "p90": pct(d, 0.9), "p99": pct(d, 0.99)},
                "sidecar_ms": {"p50": pct(s, 0.5), "p90": pct(s, 0.9), "p99": pct(s, 0.99)},
                "added_ms": {"p50": pct(s, 0.5) - pct(d, 0.5), "p99": pct(s, 0.99) - pct(d, 0.99)},
            });
        }
        rows.push(row);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_after = rss_kib(pid);
    println!(
        "sidecar RSS: idle {:.1} MiB, peak under load {:.1} MiB, idle after {:.1} MiB",
        rss_idle as f64 / 1024.0,
        rss_peak as f64 / 1024.0,
        rss_after as f64 / 1024.0
    );
    if let Some(path) = o.json {
        let out = serde_json::json!({"levels": rows, "rss_idle_kib": rss_idle, "rss_peak_kib": rss_peak, "rss_after_kib": rss_after,
                                     "prompt_words": o.work.prompt_words, "max_tokens": o.work.max_tokens, "stream": !o.work.no_stream,
                                     "decode_us_per_token": o.decode_us_per_token, "sidecar_cpu": o.pin_sidecar});
        std::fs::write(path, serde_json::to_vec_pretty(&out)?)?;
    }
    Ok(())
}

async fn drive(o: Drive) -> anyhow::Result<()> {
    let route = match (&o.url, &o.prefill, &o.decode) {
        (Some(u), _, _) => Route::Proxy(u.trim_end_matches('/').to_string()),
        (None, Some(p), Some(d)) => Route::Direct(p.clone(), d.clone()),
        _ => bail!("give --url, or --prefill and --decode"),
    };
    let c = client();
    let stop = Instant::now() + Duration::from_secs_f64(o.seconds);
    let errors = Arc::new(AtomicU64::new(0));
    let cpu_before = o.pid.map(cpu_secs);
    let rss = o.pid.map(|pid| (rss_kib(pid), RssPeak::start(pid)));
    let started = Instant::now();
    let tasks: Vec<_> = (0..o.concurrency)
        .map(|_| {
            let (c, route, w, model, errors) =
                (c.clone(), route.clone(), o.work.clone(), o.model.clone(), Arc::clone(&errors));
            tokio::spawn(async move {
                let mut h = hist();
                while Instant::now() < stop {
                    let t = Instant::now();
                    match one(&c, &route, body(&w, &model)).await {
                        Ok(_) => h.record(t.elapsed().as_micros().max(1) as u64).unwrap(),
                        Err(e) => {
                            if errors.fetch_add(1, Relaxed) < 3 {
                                eprintln!("request failed: {}", pd_config_file::report::error_line(e.as_ref()));
                            }
                        }
                    }
                }
                h
            })
        })
        .collect();
    let mut all = hist();
    for t in tasks {
        all.add(t.await?).unwrap();
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = match (o.pid, cpu_before) {
        (Some(pid), Some(before)) => {
            let used = cpu_secs(pid) - before;
            format!(
                ", \"proxy_cpu_s\": {used:.2}, \"proxy_cpu_us_per_request\": {:.1}",
                used * 1e6 / all.len().max(1) as f64
            )
        }
        _ => String::new(),
    };
    let rss = match rss {
        Some((before, peak)) => {
            format!(", \"proxy_rss_before_kib\": {before}, \"proxy_rss_peak_kib\": {}", peak.stop())
        }
        None => String::new(),
    };
    println!(
        "{{\"requests\": {}, \"errors\": {}, \"seconds\": {:.3}, \"rps\": {:.1}, \"p50_ms\": {:.3}, \"p99_ms\": {:.3}{cpu}{rss}}}",
        all.len(),
        errors.load(Relaxed),
        secs,
        all.len() as f64 / secs,
        pct(&all, 0.5),
        pct(&all, 0.99)
    );
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async {
        match cli.cmd {
            Some(Cmd::Drive(d)) => drive(d).await,
            Some(Cmd::Overhead(o)) => overhead(o).await,
            None => match Cli::parse_from(["sidecar-bench", "overhead"]).cmd {
                Some(Cmd::Overhead(o)) => overhead(o).await,
                _ => unreachable!(),
            },
        }
    })
}
