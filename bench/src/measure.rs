//! The timing harness shared by every engine: threads, warmup, latency histogram, wall time.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;

use crate::units::gbps;

/// Every wait for one request is bounded by this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One initiator thread's prepared state: `once` moves one request and returns when it is done.
/// Everything it needs (requests, connections, buffers) is built before measuring.
pub trait Worker: Send {
    fn once(&mut self) -> Result<()>;
}

/// How many requests to time and how big they are.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub warmup: u64,
    pub iters: u64,
    pub request_bytes: u64,
}

/// What one case measured over all threads.
#[derive(Clone, Debug)]
pub struct Measurement {
    pub bytes: u64,
    /// From the first thread starting its measured requests to the last one finishing.
    pub wall: Duration,
    /// Per-request latency in nanoseconds.
    pub latency: Histogram<u64>,
}

impl Measurement {
    pub fn gbps(&self) -> f64 {
        gbps(self.bytes, self.wall)
    }

    pub fn p50_us(&self) -> f64 {
        quantile_us(&self.latency, 0.50)
    }

    pub fn p99_us(&self) -> f64 {
        quantile_us(&self.latency, 0.99)
    }
}

/// The median run by GB/s (of an even count, the faster of the middle two).
pub fn median(mut runs: Vec<Measurement>) -> Option<Measurement> {
    runs.sort_by(|a, b| a.gbps().total_cmp(&b.gbps()));
    let middle = runs.len() / 2;
    runs.into_iter().nth(middle)
}

/// A latency quantile in microseconds from a histogram of nanoseconds.
pub fn quantile_us(histogram: &Histogram<u64>, quantile: f64) -> f64 {
    histogram.value_at_quantile(quantile) as f64 / 1000.0
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Runs every worker on its own thread: `warmup` requests, then (all threads together)
/// `iters` timed ones.
pub fn measure<W: Worker>(workers: &mut [W], plan: Plan, progress: &ProgressBar) -> Result<Measurement> {
    let barrier = Barrier::new(workers.len());
    let outcomes: Vec<Result<(Histogram<u64>, Instant, Instant)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .iter_mut()
            .map(|worker| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let warm = (0..plan.warmup).try_for_each(|_| {
                        worker.once()?;
                        progress.inc(1);
                        Ok::<(), anyhow::Error>(())
                    });
                    // Every thread reaches the barrier, even after a failed warmup.
                    barrier.wait();
                    warm.map_err(|e| e.context("warmup"))?;
                    timed(worker, plan.iters, progress)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("a bench thread panicked")))).collect()
    });
    let mut latency = new_histogram();
    let mut span: Option<(Instant, Instant)> = None;
    for outcome in outcomes {
        let (histogram, start, end) = outcome?;
        latency.add(&histogram).map_err(|e| anyhow!("merging histograms: {e}"))?;
        span = Some(match span {
            None => (start, end),
            Some((s, e)) => (s.min(start), e.max(end)),
        });
    }
    let (start, end) = span.ok_or_else(|| anyhow!("no threads"))?;
    let requests = plan.iters * workers.len() as u64;
    Ok(Measurement { bytes: requests * plan.request_bytes, wall: end - start, latency })
}

fn timed<W: Worker>(worker: &mut W, iters: u64, progress: &ProgressBar) -> Result<(Histogram<u64>, Instant, Instant)> {
    let mut histogram = new_histogram();
    let start = Instant::now();
    for _ in 0..iters {
        let posted = Instant::now();
        worker.once()?;
        histogram.saturating_record(posted.elapsed().as_nanos() as u64);
        progress.inc(1);
    }
    Ok((histogram, start, Instant::now()))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sleeper(Duration, u64);

    impl Worker for Sleeper {
        fn once(&mut self) -> Result<()> {
            self.1 += 1;
            std::thread::sleep(self.0);
            Ok(())
        }
    }

    struct Failing;

    impl Worker for Failing {
        fn once(&mut self) -> Result<()> {
            Err(anyhow!("broken"))
        }
    }

    #[test]
    fn counts_requests_bytes_and_latency() {
        let mut workers = [Sleeper(Duration::from_millis(2), 0), Sleeper(Duration::from_millis(2), 0)];
        let plan = Plan { warmup: 2, iters: 5, request_bytes: 1000 };
        let m = measure(&mut workers, plan, &ProgressBar::hidden()).unwrap();
        assert_eq!(workers[0].1, 7, "warmup + measured");
        assert_eq!(m.bytes, 10_000);
        assert_eq!(m.latency.len(), 10);
        assert!(m.p50_us() >= 2000.0 && m.p99_us() >= m.p50_us());
        assert!(m.wall >= Duration::from_millis(10));
        assert!(m.gbps() > 0.0);
    }

    #[test]
    fn a_failing_thread_fails_the_case_without_hanging() {
        let err =
            measure(&mut [Failing, Failing], Plan { warmup: 1, iters: 1, request_bytes: 1 }, &ProgressBar::hidden())
                .unwrap_err();
        assert!(format!("{err:#}").contains("broken"));
    }

    #[test]
    fn median_picks_the_middle_run_by_throughput() {
        let run = |ms: u64| Measurement { bytes: 1_000_000, wall: Duration::from_millis(ms), latency: new_histogram() };
        assert_eq!(median(vec![run(1), run(9), run(3)]).unwrap().wall, Duration::from_millis(3));
        assert_eq!(median(vec![run(4), run(2)]).unwrap().wall, Duration::from_millis(2));
        assert!(median(Vec::new()).is_none());
    }

    #[test]
    fn quantiles_are_in_microseconds() {
        let mut h = new_histogram();
        for ns in 1..=100u64 {
            h.record(ns * 1000).unwrap();
        }
        assert!((quantile_us(&h, 0.5) - 50.0).abs() < 0.1);
        assert!((quantile_us(&h, 0.99) - 99.0).abs() < 0.1);
    }
}
