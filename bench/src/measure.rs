//! The timing harness shared by every engine: threads, warmup, latency histogram, wall time.

use std::collections::VecDeque;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use hdrhistogram::Histogram;
use indicatif::ProgressBar;

use crate::units::gbps;

/// Every wait for one request is bounded by this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// One initiator thread's prepared state, with one request per lane of its window: `post`
/// starts lane `lane`'s request, `wait` returns when it is done. A worker whose requests block
/// (raw-tcp) has one lane and moves the whole request in `post`. Everything it needs (requests,
/// connections, buffers) is built before measuring.
pub trait Worker: Send {
    fn post(&mut self, lane: usize) -> Result<()>;
    fn wait(&mut self, lane: usize) -> Result<()>;
}

/// How many requests to time, how big they are, and how many each thread keeps in flight.
#[derive(Clone, Copy, Debug)]
pub struct Plan {
    pub warmup: u64,
    pub iters: u64,
    pub request_bytes: u64,
    /// Requests in flight per thread (lanes); 1 posts the next only after the last is done.
    pub window: usize,
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
/// `iters` timed ones, each thread keeping up to `window` of them in flight.
pub fn measure<W: Worker>(workers: &mut [W], plan: Plan, progress: &ProgressBar) -> Result<Measurement> {
    let barrier = Barrier::new(workers.len());
    let outcomes: Vec<Result<(Histogram<u64>, Instant, Instant)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .iter_mut()
            .map(|worker| {
                let barrier = &barrier;
                scope.spawn(move || {
                    let warm = timed(worker, plan.warmup, plan.window, progress);
                    // Every thread reaches the barrier, even after a failed warmup.
                    barrier.wait();
                    warm.map_err(|e| e.context("warmup"))?;
                    timed(worker, plan.iters, plan.window, progress)
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

/// Moves `iters` requests through a window of `window` lanes, waiting on the oldest first: each
/// latency runs from a request's post to the return of its wait, so it includes the time the
/// request finished behind older ones. Every request posted is waited for, also on failure.
fn timed<W: Worker>(
    worker: &mut W,
    iters: u64,
    window: usize,
    progress: &ProgressBar,
) -> Result<(Histogram<u64>, Instant, Instant)> {
    let mut histogram = new_histogram();
    let mut in_flight: VecDeque<(usize, Instant)> = VecDeque::with_capacity(window);
    let start = Instant::now();
    let mut posted = 0u64;
    let mut outcome = Ok(());
    while outcome.is_ok() && (posted < iters || !in_flight.is_empty()) {
        if posted < iters && in_flight.len() < window.max(1) {
            let lane = (posted % window.max(1) as u64) as usize;
            let at = Instant::now();
            outcome = worker.post(lane);
            if outcome.is_ok() {
                in_flight.push_back((lane, at));
                posted += 1;
            }
            continue;
        }
        let Some((lane, at)) = in_flight.pop_front() else { break };
        outcome = worker.wait(lane);
        histogram.saturating_record(at.elapsed().as_nanos() as u64);
        progress.inc(1);
    }
    let end = Instant::now();
    // Leave no request in flight behind a failure (each wait is bounded by the worker).
    for (lane, _) in in_flight {
        worker.wait(lane).ok();
    }
    outcome.map(|()| (histogram, start, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Sleeper(Duration, u64);

    impl Worker for Sleeper {
        fn post(&mut self, _lane: usize) -> Result<()> {
            self.1 += 1;
            std::thread::sleep(self.0);
            Ok(())
        }

        fn wait(&mut self, _lane: usize) -> Result<()> {
            Ok(())
        }
    }

    struct Failing;

    impl Worker for Failing {
        fn post(&mut self, _lane: usize) -> Result<()> {
            Err(anyhow!("broken"))
        }

        fn wait(&mut self, _lane: usize) -> Result<()> {
            Ok(())
        }
    }

    /// Records the order of posts and waits per lane, and the most lanes in flight at once.
    #[derive(Default)]
    struct Lanes {
        busy: Vec<bool>,
        events: Vec<(char, usize)>,
        most_in_flight: usize,
        fail_wait_at: Option<usize>,
    }

    impl Worker for Lanes {
        fn post(&mut self, lane: usize) -> Result<()> {
            if self.busy.len() <= lane {
                self.busy.resize(lane + 1, false);
            }
            assert!(!self.busy[lane], "lane {lane} posted while in flight");
            self.busy[lane] = true;
            self.events.push(('p', lane));
            self.most_in_flight = self.most_in_flight.max(self.busy.iter().filter(|b| **b).count());
            Ok(())
        }

        fn wait(&mut self, lane: usize) -> Result<()> {
            assert!(self.busy[lane], "lane {lane} waited while idle");
            self.busy[lane] = false;
            self.events.push(('w', lane));
            match self.fail_wait_at == Some(self.events.len()) {
                true => Err(anyhow!("wait failed")),
                false => Ok(()),
            }
        }
    }

    #[test]
    fn counts_requests_bytes_and_latency() {
        let mut workers = [Sleeper(Duration::from_millis(2), 0), Sleeper(Duration::from_millis(2), 0)];
        let plan = Plan { warmup: 2, iters: 5, request_bytes: 1000, window: 1 };
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
        let err = measure(
            &mut [Failing, Failing],
            Plan { warmup: 1, iters: 1, request_bytes: 1, window: 1 },
            &ProgressBar::hidden(),
        )
        .unwrap_err();
        assert!(format!("{err:#}").contains("broken"));
    }

    #[test]
    fn a_window_keeps_that_many_lanes_in_flight_and_waits_oldest_first() {
        let mut workers = [Lanes::default(), Lanes::default()];
        let plan = Plan { warmup: 3, iters: 10, request_bytes: 100, window: 4 };
        let m = measure(&mut workers, plan, &ProgressBar::hidden()).unwrap();
        assert_eq!((m.bytes, m.latency.len()), (2 * 10 * 100, 20), "only measured requests count");
        let lanes = &workers[0];
        assert_eq!(lanes.most_in_flight, 4);
        assert!(lanes.busy.iter().all(|b| !b), "every request waited for");
        // Measured part: four posts fill the window, then each wait of the oldest frees its lane.
        let measured = &lanes.events[6..];
        assert_eq!(&measured[..6], &[('p', 0), ('p', 1), ('p', 2), ('p', 3), ('w', 0), ('p', 0)]);
        assert_eq!(measured.iter().filter(|(kind, _)| *kind == 'w').count(), 10);
    }

    #[test]
    fn a_window_larger_than_the_run_and_a_failed_wait_drain_every_lane() {
        let mut workers = [Lanes::default()];
        measure(&mut workers, Plan { warmup: 0, iters: 2, request_bytes: 1, window: 64 }, &ProgressBar::hidden())
            .unwrap();
        assert_eq!(workers[0].events, [('p', 0), ('p', 1), ('w', 0), ('w', 1)]);

        let mut workers = [Lanes { fail_wait_at: Some(5), ..Lanes::default() }];
        let plan = Plan { warmup: 0, iters: 8, request_bytes: 1, window: 4 };
        let err = measure(&mut workers, plan, &ProgressBar::hidden()).unwrap_err();
        assert!(format!("{err:#}").contains("wait failed"));
        assert!(workers[0].busy.iter().all(|b| !b), "the lanes still in flight were waited for");
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
