//! Measuring tools shared by the coordinator's benchmark programs (coordbench, dynamo-compare):
//! a counting global allocator, on-CPU time, per-call latency percentiles and the CPU's name. The TCP
//! backend's allocation test (xfer/conformance/tests/tcp_allocations.rs) includes this file
//! for its allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Counts live heap bytes, so that the index's footprint is measured, not estimated, and
/// allocations made, so that a hot path's allocations are counted.
pub struct Counting;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to the system allocator with the caller's arguments unchanged;
// the counter is only bookkeeping.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded under the caller's contract.
        unsafe { System.dealloc(ptr, layout) };
        LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded under the caller's contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE_BYTES.fetch_add(new_size, Ordering::Relaxed);
            ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
            LIVE_BYTES.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The CPU's model name, for reports (which host ran a benchmark decides its figures).
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}

/// Nanoseconds this thread has run on a CPU (the kernel's schedstat): time spent waiting for
/// a CPU on a busy machine does not count.
pub fn cpu_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat").ok()?.split_whitespace().next()?.parse().ok()
}

/// A phase's wall-clock and on-CPU time.
#[derive(Clone, Copy)]
pub struct Span {
    pub wall: Duration,
    pub cpu: Option<Duration>,
}

pub fn measure(f: impl FnOnce()) -> Span {
    let (cpu, start) = (cpu_ns(), Instant::now());
    f();
    let wall = start.elapsed();
    let cpu = cpu.zip(cpu_ns()).map(|(a, b)| Duration::from_nanos(b.saturating_sub(a)));
    Span { wall, cpu }
}

impl Span {
    /// `n` per second of wall time, and per second on a CPU.
    pub fn rates(self, n: usize) -> (f64, Option<f64>) {
        (n as f64 / self.wall.as_secs_f64(), self.cpu.map(|c| n as f64 / c.as_secs_f64().max(1e-9)))
    }

    pub fn describe(self, n: usize, unit: &str) -> String {
        let (wall, cpu) = self.rates(n);
        match cpu {
            Some(cpu) => format!("{:.2} M {unit}/s ({:.2} M/s per CPU-second)", wall / 1e6, cpu / 1e6),
            None => format!("{:.2} M {unit}/s", wall / 1e6),
        }
    }
}

pub fn live_bytes() -> usize {
    LIVE_BYTES.load(Ordering::Relaxed)
}

/// Allocations (and reallocations) made so far, by every thread.
#[allow(dead_code)] // Read by xfer/conformance/tests/tcp_allocations.rs, not by coordbench.
pub fn allocations() -> usize {
    ALLOCATIONS.load(Ordering::Relaxed)
}

#[derive(Default)]
pub struct Latency {
    samples: Vec<u32>,
}

impl Latency {
    pub fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.samples.push(start.elapsed().as_nanos().min(u32::MAX as u128) as u32);
        out
    }

    pub fn summary(mut self) -> Summary {
        self.samples.sort_unstable();
        let n = self.samples.len();
        let at = |q: f64| f64::from(self.samples[((n as f64 * q) as usize).min(n - 1)]) / 1000.0;
        let total: u64 = self.samples.iter().map(|&s| u64::from(s)).sum();
        Summary {
            count: n,
            mean_us: total as f64 / n as f64 / 1000.0,
            p50_us: at(0.50),
            p99_us: at(0.99),
            p999_us: at(0.999),
            max_us: at(1.0),
        }
    }
}

pub struct Summary {
    pub count: usize,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}
