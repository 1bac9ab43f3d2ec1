//! Driving a workload against a target: arrivals (as fast as the concurrency cap allows, at a
//! fixed rate, or Poisson), the concurrency cap, multi-turn conversations whose next turn
//! follows the previous answer, and a progress bar.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::sync::{mpsc, Semaphore};

use crate::client::{Outcome, Target, Timeouts};
use crate::stats::{Collector, Slo, Summary};
use crate::workload::{ChatState, Workload, WorkloadSpec};

/// How conversations arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Arrival {
    /// Exponential gaps (a Poisson process) with mean 1/rate.
    Poisson,
    /// Gaps of exactly 1/rate.
    Fixed,
}

/// How to run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Conversations started per second; None: all at once (the concurrency cap paces them).
    pub rate: Option<f64>,
    pub arrival: Arrival,
    /// Requests in flight at most.
    pub concurrency: usize,
    pub stream: bool,
    pub timeouts: Timeouts,
    pub slo: Slo,
    pub progress: bool,
    /// A new connection per request instead of a keep-alive pool.
    pub no_keepalive: bool,
}

/// The start offsets of `n` arrivals.
pub fn arrival_offsets(n: usize, rate: Option<f64>, arrival: Arrival, seed: u64) -> Vec<Duration> {
    let Some(rate) = rate.filter(|r| *r > 0.0 && r.is_finite()) else {
        return vec![Duration::ZERO; n];
    };
    let mut rng = StdRng::seed_from_u64(seed ^ 0xa771_7a15);
    let mut t = 0.0f64;
    (0..n)
        .map(|i| {
            if i > 0 {
                t += match arrival {
                    Arrival::Fixed => 1.0 / rate,
                    Arrival::Poisson => -rng.random_range(f64::EPSILON..1.0f64).ln() / rate,
                };
            }
            Duration::from_secs_f64(t)
        })
        .collect()
}

/// What a run produced.
#[derive(Debug)]
pub struct RunResult {
    pub summary: Summary,
    pub collector: Collector,
}

/// A client suited to benchmarks: keep-alive pool, connect timeout, no proxy from the
/// environment (targets are local or explicit).
pub fn http_client(concurrency: usize, connect_timeout: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(concurrency.max(1))
        .connect_timeout(connect_timeout)
        .no_proxy()
        .build()
}

/// Runs the workload to the end and returns its measurements.
pub async fn run(target: Arc<Target>, spec: &WorkloadSpec, cfg: &RunConfig) -> anyhow::Result<RunResult> {
    run_workload(target, Arc::new(Workload::new(spec)), cfg).await
}

/// The same for a planned workload; one that fixes its arrivals (a trace) is sent at those
/// times, each request waiting for a slot under the concurrency cap.
pub async fn run_workload(target: Arc<Target>, workload: Arc<Workload>, cfg: &RunConfig) -> anyhow::Result<RunResult> {
    let spec = workload.spec().clone();
    let http = if cfg.no_keepalive {
        // Linux acknowledges the first segments of a fresh connection at once, so servers without
        // TCP_NODELAY do not stall streamed chunks behind a delayed ACK (about 40 ms).
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .connect_timeout(Duration::from_secs(5))
            .no_proxy()
            .build()?
    } else {
        http_client(cfg.concurrency, Duration::from_secs(5))?
    };
    let total = spec.total_requests();
    let fixed_arrivals = workload.arrivals();
    // Without a rate the run is closed-loop: each of `concurrency` slots carries one conversation
    // at a time, all its turns, so only that many conversations (and tasks) exist at once.
    let closed_loop = fixed_arrivals.is_none() && cfg.rate.filter(|r| *r > 0.0 && r.is_finite()).is_none();
    let offsets = fixed_arrivals.unwrap_or_else(|| arrival_offsets(workload.len(), cfg.rate, cfg.arrival, spec.seed));
    let permits = Arc::new(Semaphore::new(cfg.concurrency.max(1)));
    let (tx, mut rx) = mpsc::unbounded_channel::<Outcome>();
    let bar = if cfg.progress && total > 0 {
        let b = ProgressBar::new(total as u64);
        b.set_style(
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} requests {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b
    } else {
        ProgressBar::hidden()
    };
    let started = Instant::now();
    let spec = Arc::new(spec);
    let mut tasks = tokio::task::JoinSet::new();
    let cfg2 = cfg.clone();
    let launcher = {
        let workload = Arc::clone(&workload);
        async move {
            for (i, off) in offsets.into_iter().enumerate() {
                tokio::time::sleep_until(tokio::time::Instant::from_std(started + off)).await;
                let slot = if closed_loop {
                    match Arc::clone(&permits).acquire_owned().await {
                        Ok(p) => Some(p),
                        Err(_) => break,
                    }
                } else {
                    None
                };
                // Reap finished conversations as we go.
                while tasks.try_join_next().is_some() {}
                let (target, http, permits, tx, spec, workload, cfg) = (
                    Arc::clone(&target),
                    http.clone(),
                    Arc::clone(&permits),
                    tx.clone(),
                    Arc::clone(&spec),
                    Arc::clone(&workload),
                    cfg2.clone(),
                );
                tasks.spawn(async move {
                    let conv = workload.conversation(i);
                    let mut state = ChatState::new(&conv);
                    while let Some(req) = state.next_request(&spec) {
                        // The conversation's slot (closed loop) or one permit per request.
                        let _permit = if slot.is_some() {
                            None
                        } else {
                            match permits.acquire().await {
                                Ok(p) => Some(p),
                                Err(_) => return,
                            }
                        };
                        let o = target.send(&http, &req, cfg.stream, cfg.timeouts).await;
                        let text = o.text.clone();
                        let failed = !o.ok();
                        if tx.send(o).is_err() {
                            return;
                        }
                        if failed {
                            // Later turns need this answer; count them as not sent.
                            return;
                        }
                        state.answered(&text);
                    }
                });
            }
            drop(tx);
            while tasks.join_next().await.is_some() {}
        }
    };
    let launch = tokio::spawn(launcher);
    let mut collector = Collector::new(cfg.slo);
    let mut failed = 0u64;
    while let Some(o) = rx.recv().await {
        collector.record(&o);
        bar.inc(1);
        if !o.ok() {
            failed += 1;
            bar.set_message(format!("({failed} failed)"));
        }
    }
    let elapsed = started.elapsed();
    launch.await?;
    bar.finish_and_clear();
    let summary = collector.summary(elapsed);
    Ok(RunResult { summary, collector })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals() {
        assert_eq!(arrival_offsets(3, None, Arrival::Poisson, 1), vec![Duration::ZERO; 3]);
        let f = arrival_offsets(5, Some(10.0), Arrival::Fixed, 1);
        assert_eq!(f[0], Duration::ZERO);
        assert!((f[4].as_secs_f64() - 0.4).abs() < 1e-9);
        let n = 20_000;
        let p = arrival_offsets(n, Some(100.0), Arrival::Poisson, 3);
        assert!(p.windows(2).all(|w| w[0] <= w[1]));
        let mean_gap = p[n - 1].as_secs_f64() / (n - 1) as f64;
        assert!((mean_gap - 0.01).abs() < 0.0005, "mean gap {mean_gap}");
        // Exponential gaps: about 63% shorter than the mean.
        let short = p.windows(2).filter(|w| (w[1] - w[0]).as_secs_f64() < 0.01).count() as f64 / (n - 1) as f64;
        assert!((short - 0.632).abs() < 0.02, "{short}");
        assert_eq!(p, arrival_offsets(n, Some(100.0), Arrival::Poisson, 3));
    }
}
