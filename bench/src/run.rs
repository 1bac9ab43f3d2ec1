//! The initiator: finds the target, runs every case on the engine under test (and on the
//! raw-tcp baseline with `--compare`), prints the table and writes the files.

use std::io::IsTerminal;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};

use crate::cli::{Args, Settings, KV_BLOCK, RAW_TCP};
use crate::layout::Case;
use crate::measure::{median, Measurement, Plan};
use crate::raw::{RawConn, RawEngine};
use crate::report::{format_row, header, ratio, read_json, write_csv, write_json, Row};
use crate::spawn::Target;
use crate::xfer_engine::XferEngine;

pub fn main(args: &Args) -> Result<()> {
    if !args.rows.is_empty() {
        return replay(args);
    }
    let settings = args.settings(std::io::stderr().is_terminal())?;
    settings.memory.check_gpu(args.connect.is_empty())?;
    let targets = if args.connect.is_empty() {
        (0..settings.targets).map(|_| Target::spawn(&settings.target_args())).collect::<Result<Vec<_>>>()?
    } else {
        args.connect.iter().map(|addr| Target::running(addr)).collect::<Result<Vec<_>>>()?
    };
    if args.memcpy {
        for line in crate::memcpy::report(&args.block_sizes) {
            println!("{line}");
        }
    }
    let rows = run(&settings, &targets)?;
    drop(targets);
    export(args, &rows)
}

/// `--rows`: the table, files and plot of rows measured earlier, possibly by several tools.
fn replay(args: &Args) -> Result<()> {
    let mut rows = Vec::new();
    for path in &args.rows {
        rows.extend(read_json(path)?);
    }
    println!("{}", header(rows.iter().any(|row| !row.mem.is_empty())));
    for row in &rows {
        println!("{}", format_row(row));
    }
    export(args, &rows)
}

fn export(args: &Args, rows: &[Row]) -> Result<()> {
    if let Some(stem) = &args.plot {
        let [svg, png] = crate::plot::write(stem, rows, "xferbench: GB/s by block size")?;
        eprintln!("plots: {} {}", svg.display(), png.display());
    }
    if let Some(path) = &args.json {
        write_json(path, rows)?;
    }
    if let Some(path) = &args.csv {
        write_csv(path, rows)?;
    }
    Ok(())
}

fn run(settings: &Settings, targets: &[Target]) -> Result<Vec<Row>> {
    let first = targets.first().ok_or_else(|| anyhow!("no target"))?;
    let mut xfer = match &settings.xfer_backend {
        Some(backend) => {
            let sides = targets
                .iter()
                .map(|t| t.side.clone().ok_or_else(|| anyhow!("the target serves no side channel")))
                .collect::<Result<Vec<_>>>()?;
            let control = if settings.check || settings.grants { Some(RawConn::connect(&first.raw)?) } else { None };
            let mut engine =
                XferEngine::connect(backend, &settings.params, &sides, settings.agents, &settings.memory, control)?;
            engine.grants = settings.grants;
            Some(engine)
        }
        None => None,
    };
    let raw = (xfer.is_none() || settings.compare).then(|| RawEngine { addr: first.raw.clone() });

    if !settings.scheme_label().is_empty() {
        println!(
            "scheme {}: {} initiator agent(s), {} target(s)",
            settings.scheme_label(),
            settings.agents,
            settings.targets
        );
    }
    if settings.window > 1 {
        println!("window {}: requests in flight per initiator thread", settings.window);
    }
    let beyond_dram = settings.cases.iter().any(|case| !settings.memory.label(case.op).is_empty());
    println!("{}", header(beyond_dram));
    let mut rows = Vec::new();
    for case in &settings.cases {
        for row in run_case(settings, case, xfer.as_mut(), raw.as_ref())? {
            println!("{}", format_row(&row));
            rows.push(row);
        }
    }
    if settings.kv_shape {
        for line in apply_kv_ratios(&mut rows) {
            println!("{line}");
        }
    }
    Ok(rows)
}

/// Runs one case `--repeat` times on each engine (alternating), keeping the median runs: the
/// engine under test's row first (with its ratio to raw-tcp), then raw-tcp's.
fn run_case(
    settings: &Settings,
    case: &Case,
    mut xfer: Option<&mut XferEngine>,
    raw: Option<&RawEngine>,
) -> Result<Vec<Row>> {
    let plan = Plan {
        warmup: settings.warmup,
        iters: settings.iters_for(case),
        request_bytes: case.request_bytes(),
        window: settings.window as usize,
    };
    let check_seed = settings.check.then_some(settings.seed);
    let (mut xfer_runs, mut raw_runs) = (Vec::new(), Vec::new());
    for _ in 0..settings.repeat {
        if let Some(engine) = xfer.as_deref_mut() {
            let bar = progress(settings, plan, &engine.name(), case);
            xfer_runs.push(engine.run(case, plan, settings.threads, settings.seed, settings.check, &bar)?);
            bar.finish_and_clear();
        }
        if let Some(engine) = raw {
            let bar = progress(settings, plan, RAW_TCP, case);
            raw_runs.push(engine.run(case, plan, settings.threads, check_seed, &bar)?);
            bar.finish_and_clear();
        }
    }
    let row = |name: &str, measured: &Measurement, mem: String| Row {
        scheme: settings.scheme_label(),
        window: settings.window,
        mem,
        ..Row::new(name, case, settings.threads, plan.iters, settings.repeat, measured)
    };
    let mut engine_row =
        xfer.zip(median(xfer_runs)).map(|(engine, m)| row(&engine.name(), &m, settings.memory.label(case.op)));
    // The baseline moves host memory whatever the engine's kinds.
    let raw_row = median(raw_runs).map(|m| row(RAW_TCP, &m, String::new()));
    if let (Some(engine_row), Some(raw_row)) = (engine_row.as_mut(), raw_row.as_ref()) {
        engine_row.ratio_vs_raw = ratio(engine_row.gbps, raw_row.gbps);
    }
    Ok(engine_row.into_iter().chain(raw_row).collect())
}

fn progress(settings: &Settings, plan: Plan, engine: &str, case: &Case) -> ProgressBar {
    if !settings.progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(settings.threads * (plan.warmup + plan.iters));
    let style = ProgressStyle::with_template("{msg:32} [{bar:30}] {pos}/{len} {elapsed}")
        .expect("valid template")
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_message(format!("{engine} {}", case.label()));
    bar
}

/// For each engine and op, the KV-shaped (scattered 16K blocks) row's GB/s over the contiguous
/// request's of the same size; stored on the scattered row. Returns the lines to print.
pub fn apply_kv_ratios(rows: &mut [Row]) -> Vec<String> {
    let mut lines = Vec::new();
    for i in 0..rows.len() {
        let scattered = &rows[i];
        if !(scattered.scatter && scattered.block_size == KV_BLOCK) {
            continue;
        }
        let contiguous = rows.iter().find(|r| {
            r.backend == scattered.backend
                && r.op == scattered.op
                && !r.scatter
                && r.batch == 1
                && r.block_size == scattered.block_size * scattered.batch
        });
        let Some(contiguous) = contiguous else { continue };
        let Some(value) = ratio(scattered.gbps, contiguous.gbps) else { continue };
        lines.push(format!(
            "kv-shape {} {}: 16K x {} scattered {:.3} GB/s vs one contiguous request {:.3} GB/s: ratio {value:.2}",
            scattered.backend, scattered.op, scattered.batch, scattered.gbps, contiguous.gbps
        ));
        rows[i].ratio_vs_contiguous = Some(value);
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(backend: &str, op: &str, block: u64, batch: u64, scatter: bool, gbps: f64) -> Row {
        Row {
            backend: backend.into(),
            op: op.into(),
            block_size: block,
            batch,
            threads: 1,
            iters: 10,
            repeat: 1,
            scatter,
            bytes: 1,
            gbps,
            p50_us: 1.0,
            p99_us: 1.0,
            ..Row::default()
        }
    }

    #[test]
    fn kv_ratio_pairs_same_backend_and_op() {
        let mut rows = vec![
            row("tcp", "read", 16 << 10, 2048, true, 2.0),
            row("tcp", "read", 32 << 20, 1, false, 4.0),
            row("raw-tcp", "read", 16 << 10, 2048, true, 3.0),
            row("raw-tcp", "read", 32 << 20, 1, false, 3.0),
            row("tcp", "write", 16 << 10, 2048, true, 1.0),
        ];
        let lines = apply_kv_ratios(&mut rows);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(rows[0].ratio_vs_contiguous, Some(0.5));
        assert_eq!(rows[2].ratio_vs_contiguous, Some(1.0));
        assert_eq!(rows[4].ratio_vs_contiguous, None, "no contiguous write row");
        assert!(lines[0].contains("ratio 0.50"), "{}", lines[0]);
    }
}
