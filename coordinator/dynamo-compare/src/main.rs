//! dynamo-compare: our prefix index (`pd_coordinator::index::PrefixIndex`) against
//! dynamo-kv-router's indexers, fed the same event stream in the same process: apply
//! throughput, 128-block lookup latency, memory per (block, engine), with one thread and with a
//! second thread looking up while events are applied. Every lookup's per-engine overlap must be
//! the same in every index, or the program fails. `coordinator/BENCH.md` describes the runs;
//! `coordinator/dynamo-compare.sh` runs it.

use std::path::PathBuf;

use anyhow::{bail, Context as _};
use clap::Parser;
use serde::Serialize;

#[path = "../../examples/shared/mod.rs"]
#[allow(dead_code)] // coordbench uses all of it, this program only part
mod shared;

mod contenders;
mod report;
mod stream;

use contenders::{Concurrent, Contender};
use shared::measure::{live_bytes, measure, Latency};
use stream::Stream;

#[derive(Parser)]
#[command(about = "Our prefix index against dynamo-kv-router's indexers, same events, same process")]
struct Args {
    /// coordbench's workload: engines.
    #[arg(long, default_value_t = 128)]
    engines: usize,
    /// coordbench's workload: distinct blocks.
    #[arg(long, default_value_t = 1_000_000)]
    blocks: usize,
    /// coordbench's workload: conversations replaced after ingestion (stores + removals).
    #[arg(long, default_value_t = 20_000)]
    churn: usize,
    /// The Mooncake trace (JSON lines with hash_ids); without it only coordbench's workload runs.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Worker counts the trace is spread over, one comparison each.
    #[arg(long, value_delimiter = ',', default_value = "16,128")]
    workers: Vec<usize>,
    /// Blocks each worker's LRU holds.
    #[arg(long, default_value_t = 1024)]
    capacity: usize,
    /// Times the trace is replayed (each as new sessions).
    #[arg(long, default_value_t = 4)]
    replays: usize,
    /// 128-block lookups per index (a tenth more run first as warm-up).
    #[arg(long, default_value_t = 100_000)]
    lookups: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Writes dynamo.json and dynamo.md into this folder.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// CPU time of every live thread of this process (the kernel's schedstat, nanoseconds), so a
/// thread pool's workers count too.
pub fn process_cpu_s() -> Option<f64> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let stat = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        total += stat.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(total as f64 / 1e9)
}

/// One index, one thread looking up after every event is applied.
#[derive(Serialize)]
pub struct Row {
    pub index: String,
    pub apply_threads: usize,
    pub apply_s: f64,
    pub block_events_per_s: f64,
    pub block_events_per_cpu_s: Option<f64>,
    /// The lowest and highest apply rate of the samples (`block_events_per_s` is their median).
    pub apply_range: (f64, f64),
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
    pub lookup_p999_us: f64,
    pub heap_bytes: usize,
    pub bytes_per_entry: f64,
    /// Events the index refused (Dynamo's `apply_event` errors where we can see them).
    pub rejected_events: usize,
}

/// One index applying events while a second thread looks up.
#[derive(Serialize)]
pub struct ConcurrentRow {
    pub index: String,
    pub block_events_per_s: f64,
    pub block_events_per_cpu_s: Option<f64>,
    pub lookups: usize,
    pub lookup_p50_us: f64,
    pub lookup_p99_us: f64,
}

/// Ours over Dynamo's best, per bar.
#[derive(Serialize)]
pub struct Bars {
    pub apply_ratio: f64,
    pub apply_best: String,
    pub apply_met: bool,
    pub lookup_p99_ratio: f64,
    pub lookup_best: String,
    pub lookup_met: bool,
    pub memory_ratio: f64,
    pub memory_best: String,
    pub memory_met: bool,
}

#[derive(Serialize)]
pub struct StreamResult {
    pub name: String,
    pub description: String,
    pub engines: usize,
    pub events: usize,
    pub block_events: usize,
    pub entries: usize,
    /// Lookups whose overlaps every index agreed on.
    pub lookups_checked: usize,
    pub rows: Vec<Row>,
    pub concurrent: Vec<ConcurrentRow>,
    pub bars: Bars,
}

#[derive(Serialize)]
pub struct Results {
    pub machine: String,
    pub load_before: String,
    pub load_after: String,
    /// Applies per index and stream, the median reported.
    pub apply_rounds: usize,
    pub streams: Vec<StreamResult>,
}

fn progress(what: &str) {
    eprintln!("dynamo-compare: {what}");
}

/// Lookups each index makes in turn before the next one's turn (see [`lookup_rounds`]).
const ROUND: usize = 1000;
/// Times each index applies the stream (see [`compare`]). This host's speed for one index moves
/// by a third between applies a minute apart, so three samples left the median to chance.
const APPLY_ROUNDS: usize = 5;

/// The sample with the median apply rate (of an odd number of them), with the samples' range.
fn median_apply(mut samples: Vec<Row>) -> Row {
    samples.sort_by(|a, b| a.block_events_per_s.total_cmp(&b.block_events_per_s));
    let range = match (samples.first(), samples.last()) {
        (Some(low), Some(high)) => (low.block_events_per_s, high.block_events_per_s),
        _ => (0.0, 0.0),
    };
    let middle = samples.len() / 2;
    Row { apply_range: range, ..samples.swap_remove(middle) }
}

/// Applies the stream and measures memory; the lookup figures are filled in by
/// [`lookup_rounds`], memory per entry by the caller once ours has counted the entries.
fn apply_one(contender: &mut dyn Contender, stream: &Stream) -> Row {
    progress(&format!("{}: {}", stream.name, contender.name()));
    let baseline = live_bytes();
    contender.prepare(stream);
    let cpu = process_cpu_s();
    let span = measure(|| contender.apply(stream));
    let cpu_s = cpu.zip(process_cpu_s()).map(|(a, b)| b - a);
    let heap = live_bytes().saturating_sub(baseline);
    let per_s = stream.block_events as f64 / span.wall.as_secs_f64();
    progress(&format!("{}: {}: {:.2} M block events/s", stream.name, contender.name(), per_s / 1e6));
    Row {
        index: contender.name(),
        apply_threads: contender.apply_threads(),
        apply_s: span.wall.as_secs_f64(),
        block_events_per_s: per_s,
        block_events_per_cpu_s: cpu_s.map(|c| stream.block_events as f64 / c.max(1e-9)),
        apply_range: (0.0, 0.0),
        lookup_p50_us: 0.0,
        lookup_p99_us: 0.0,
        lookup_p999_us: 0.0,
        heap_bytes: heap,
        bytes_per_entry: 0.0,
        rejected_events: contender.rejected(),
    }
}

/// Every lookup on every index, in rounds of [`ROUND`] lookups per index, the index that goes
/// first moving on each round: the host's noise (other processes on 2 cores) then falls on
/// every index alike rather than on whichever ran during a busy minute, and no index is
/// measured only right after its own events. Each round's answers are checked against ours
/// (the first index) before the next round. Fills in the rows' lookup figures.
fn lookup_rounds(contenders: &[Box<dyn Contender>], rows: &mut [Row], stream: &Stream) -> anyhow::Result<()> {
    progress(&format!("{}: lookups, {} indexes in turn", stream.name, contenders.len()));
    let mut out = Vec::new();
    for contender in contenders {
        let mut warmup = Latency::default();
        for request in stream.lookups.iter().take(stream.lookups.len() / 10) {
            contender.lookup(request, &mut warmup, &mut out);
        }
    }
    let mut latencies: Vec<Latency> = contenders.iter().map(|_| Latency::default()).collect();
    let mut answers: Vec<Vec<Vec<(usize, usize)>>> = contenders.iter().map(|_| Vec::new()).collect();
    for (round, requests) in stream.lookups.chunks(ROUND).enumerate() {
        for turn in 0..contenders.len() {
            let k = (round + turn) % contenders.len();
            answers[k].clear();
            for request in requests {
                contenders[k].lookup(request, &mut latencies[k], &mut out);
                answers[k].push(out.clone());
            }
        }
        let first = round * ROUND;
        for (k, row) in rows.iter().enumerate().skip(1) {
            check(&row.index, stream, first, &answers[0], &answers[k]).with_context(|| {
                format!(
                    "{} with {} apply thread(s), {} events refused",
                    row.index, row.apply_threads, row.rejected_events
                )
            })?;
        }
    }
    for (row, latency) in rows.iter_mut().zip(latencies) {
        let lookups = latency.summary();
        row.lookup_p50_us = lookups.p50_us;
        row.lookup_p99_us = lookups.p99_us;
        row.lookup_p999_us = lookups.p999_us;
    }
    Ok(())
}

/// Fails on the first lookup where `theirs` differs from `ours` (lookups `first..`), naming both
/// answers.
fn check(
    name: &str,
    stream: &Stream,
    first: usize,
    ours: &[Vec<(usize, usize)>],
    theirs: &[Vec<(usize, usize)>],
) -> anyhow::Result<()> {
    for (k, (a, b)) in ours.iter().zip(theirs).enumerate() {
        if a != b {
            let only_ours: Vec<_> = a.iter().filter(|x| !b.contains(x)).take(8).collect();
            let only_theirs: Vec<_> = b.iter().filter(|x| !a.contains(x)).take(8).collect();
            bail!(
                "{}: lookup {} differs between ours and {name}: (engine, overlap) only in ours {only_ours:?}, only in theirs {only_theirs:?} ({} vs {} engines matched)",
                stream.name,
                first + k,
                a.len(),
                b.len()
            );
        }
    }
    Ok(())
}

fn concurrent_row(c: Concurrent, stream: &Stream) -> ConcurrentRow {
    ConcurrentRow {
        index: c.name,
        block_events_per_s: stream.block_events as f64 / c.apply.wall.as_secs_f64(),
        block_events_per_cpu_s: c.cpu_s.map(|s| stream.block_events as f64 / s.max(1e-9)),
        lookups: c.lookups.count,
        lookup_p50_us: c.lookups.p50_us,
        lookup_p99_us: c.lookups.p99_us,
    }
}

fn compare(stream: &Stream) -> anyhow::Result<StreamResult> {
    progress(&format!("{}: {} ({} block events)", stream.name, stream.description, stream.block_events));
    let makers: [fn() -> Box<dyn Contender>; 7] = [
        || Box::new(contenders::Ours::new()),
        || Box::new(contenders::Radix::new()),
        || Box::new(contenders::Positional::new()),
        || Box::new(contenders::positional_pool(1)),
        || Box::new(contenders::positional_pool(2)),
        || Box::new(contenders::crtc_pool(1)),
        || Box::new(contenders::crtc_pool(2)),
    ];
    // Each index applies the stream APPLY_ROUNDS times, into a fresh index each time, the
    // order rotating between rounds: no index is the one that always runs first in a fresh
    // process, and a busy minute on the host falls on one sample of each, not on all of one.
    // The median sample is reported; the last round's indexes answer the lookups.
    let mut samples: Vec<Vec<Row>> = makers.iter().map(|_| Vec::new()).collect();
    let mut kept: Vec<Option<Box<dyn Contender>>> = makers.iter().map(|_| None).collect();
    for round in 0..APPLY_ROUNDS {
        for turn in 0..makers.len() {
            let k = (round + turn) % makers.len();
            let mut contender = makers[k]();
            samples[k].push(apply_one(contender.as_mut(), stream));
            if round + 1 == APPLY_ROUNDS {
                kept[k] = Some(contender);
            }
        }
    }
    let contenders: Vec<Box<dyn Contender>> = kept.into_iter().map(|c| c.expect("kept in the last round")).collect();
    let mut rows: Vec<Row> = samples.into_iter().map(median_apply).collect();
    let entries = contenders[0].entries().context("ours counts its entries")?;
    lookup_rounds(&contenders, &mut rows, stream)?;
    drop(contenders);
    progress(&format!("{}: applying while a second thread looks up", stream.name));
    let concurrent = vec![
        concurrent_row(contenders::concurrent_ours(stream), stream),
        concurrent_row(contenders::concurrent_ours_shared(stream), stream),
        concurrent_row(contenders::concurrent_positional(stream), stream),
        concurrent_row(contenders::concurrent_pool(contenders::positional_pool(1), stream), stream),
        concurrent_row(contenders::concurrent_pool(contenders::crtc_pool(1), stream), stream),
    ];
    for row in &mut rows {
        row.bytes_per_entry = row.heap_bytes as f64 / entries.max(1) as f64;
    }
    let bars = bars(&rows);
    Ok(StreamResult {
        name: stream.name.clone(),
        description: stream.description.clone(),
        engines: stream.engines,
        events: stream.events().count(),
        block_events: stream.block_events,
        entries,
        lookups_checked: stream.lookups.len(),
        rows,
        concurrent,
        bars,
    })
}

/// The bars: apply ≥ 1.5 × Dynamo's best, lookup p99 ≤ 0.67 × its best, memory ≤ its
/// best (the first row is ours).
fn bars(rows: &[Row]) -> Bars {
    let (ours, dynamo) = rows.split_first().expect("ours and Dynamo's rows");
    let best_by = |key: fn(&Row) -> f64, highest: bool| {
        let pick = dynamo
            .iter()
            .max_by(|a, b| {
                let order = key(a).total_cmp(&key(b));
                if highest {
                    order
                } else {
                    order.reverse()
                }
            })
            .expect("Dynamo's rows");
        (key(pick), format!("{} ({} apply thread(s))", pick.index, pick.apply_threads))
    };
    let (apply, apply_best) = best_by(|r| r.block_events_per_s, true);
    let (p99, lookup_best) = best_by(|r| r.lookup_p99_us, false);
    let (memory, memory_best) = best_by(|r| r.bytes_per_entry, false);
    let apply_ratio = ours.block_events_per_s / apply;
    let lookup_p99_ratio = ours.lookup_p99_us / p99;
    let memory_ratio = ours.bytes_per_entry / memory;
    Bars {
        apply_ratio,
        apply_best,
        apply_met: apply_ratio >= 1.5,
        lookup_p99_ratio,
        lookup_best,
        lookup_met: lookup_p99_ratio <= 0.67,
        memory_ratio,
        memory_best,
        memory_met: memory_ratio <= 1.0,
    }
}

fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map_or_else(|_| "unknown".into(), |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let load_before = load();
    let mut streams = Vec::new();
    let coordbench = stream::coordbench(args.engines, args.blocks, args.churn, args.lookups, args.seed);
    streams.push(compare(&coordbench)?);
    drop(coordbench);
    if let Some(trace) = &args.trace {
        for &workers in &args.workers {
            let mooncake = stream::mooncake(trace, workers, args.capacity, args.replays, args.lookups)?;
            streams.push(compare(&mooncake)?);
        }
    } else {
        progress("no --trace given: the Mooncake comparison is skipped");
    }
    let results =
        Results { machine: report::machine(), load_before, load_after: load(), apply_rounds: APPLY_ROUNDS, streams };
    let markdown = report::markdown(&results);
    println!("{markdown}");
    if let Some(out) = &args.out {
        std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
        let json = serde_json::to_string_pretty(&results)?;
        std::fs::write(out.join("dynamo.json"), json + "\n").context("writing dynamo.json")?;
        std::fs::write(out.join("dynamo.md"), markdown).context("writing dynamo.md")?;
    }
    Ok(())
}
