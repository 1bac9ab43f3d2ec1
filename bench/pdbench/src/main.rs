//! pdbench: load generator for OpenAI-API P/D deployments, routing comparison on a simulator
//! cluster, and the local P/D cluster launcher. See bench/pdbench/README.md.

mod args;
mod cluster_cmd;
mod cluster_report;
mod compare;
mod compare_report;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use serde_json::json;

use args::{Cmd, RunCmd};
use pdbench::client::Target;
use pdbench::plot::{self, Series};
use pdbench::runner::{self, RunResult};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = args::parse_cli(std::env::args_os()).unwrap_or_else(|e| e.exit());
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let code = rt.block_on(async {
        match cli.cmd {
            Cmd::Run(c) => run_cmd(c).await.map(|()| 0),
            Cmd::CompareRouting(c) => until_signal(compare::compare_cmd(c)).await,
            Cmd::Cluster(c) => until_signal(cluster_cmd::cluster_cmd(c)).await,
        }
    })?;
    drop(rt);
    if code != 0 {
        std::process::exit(code);
    }
    Ok(())
}

/// Runs `f` unless SIGINT or SIGTERM comes first; then `f` is dropped (its children stopped by
/// their guards) and the exit code is 130.
async fn until_signal(f: impl std::future::Future<Output = anyhow::Result<()>>) -> anyhow::Result<i32> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let interrupted = tokio::select! {
        r = f => { r?; false }
        _ = int.recv() => true,
        _ = term.recv() => true,
    };
    // By now the work future is dropped and every child process stopped.
    if interrupted {
        eprintln!("pdbench: interrupted; every child process stopped");
        return Ok(130);
    }
    Ok(0)
}

fn write_json(path: &Path, value: &serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(path, serde_json::to_vec_pretty(value)?).with_context(|| format!("writing {}", path.display()))
}

/// The TTFT and end-to-end CDF and the TTFT histogram under `prefix`; the files written.
fn write_plots(prefix: &Path, r: &RunResult) -> Result<Vec<PathBuf>, plot::PlotError> {
    let series = [
        Series { name: "TTFT", samples: &r.collector.ttft_samples },
        Series { name: "end-to-end", samples: &r.collector.e2e_samples },
    ];
    plot::write_plots(prefix, &series, &r.collector.ttft_samples)
}

async fn run_cmd(c: RunCmd) -> anyhow::Result<()> {
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let target = if c.prefill_url.is_empty() {
        Target::round_robin(c.url.clone())
    } else {
        Target::direct_pd(c.prefill_url.clone(), c.decode_url.clone(), c.prefix_affinity, c.local_below)
    };
    let r = runner::run(Arc::new(target), &spec, &cfg).await?;
    print!("{}", r.summary.table());
    if let Some(p) = &c.out.json {
        write_json(p, &json!({"workload": spec, "summary": r.summary}))?;
    }
    if let Some(p) = &c.out.plot {
        match write_plots(p, &r) {
            Ok(files) => files.iter().for_each(|f| eprintln!("wrote {}", f.display())),
            Err(e) => eprintln!("pdbench: plots not written: {e}"),
        }
    }
    Ok(())
}
