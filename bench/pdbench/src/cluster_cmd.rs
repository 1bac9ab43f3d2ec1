//! `pdbench cluster`: a whole local P/D cluster, a sample workload, a report.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::args::{ClusterCmd, ClusterMode};
use crate::{write_json, write_plots};
use pdbench::client::Target;
use pdbench::cluster::{self, Engine, KvReport, SimCluster};
use pdbench::daemons::Daemons;
use pdbench::runner;

pub async fn cluster_cmd(c: ClusterCmd) -> anyhow::Result<()> {
    anyhow::ensure!(c.vllm || (c.prefills >= 1 && c.decodes >= 1), "need at least one prefill and one decode");
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let http = runner::http_client(4, Duration::from_secs(5))?;
    let (coordinator_bin, sidecar_bin) = c.daemons.bins();
    let daemons_usable = !c.vllm && c.daemons.usable();
    let with_daemons = match c.mode {
        ClusterMode::Direct => false,
        ClusterMode::Auto => daemons_usable,
        ClusterMode::Sidecar => {
            anyhow::ensure!(!c.vllm, "--mode sidecar starts its own engines; it does not combine with --vllm");
            anyhow::ensure!(
                daemons_usable,
                "--mode sidecar: {} or {} is missing or does not answer --help",
                coordinator_bin.display(),
                sidecar_bin.display()
            );
            true
        }
    };
    anyhow::ensure!(!c.pull || with_daemons, "--pull needs the sidecar mode (pd-sidecar and pd-coordinator built)");
    let mode = match (with_daemons, c.pull) {
        (true, true) => "sidecar-pull",
        (true, false) => "sidecar",
        _ => "direct",
    };
    let log_dir = c.sim.log_dir("cluster")?;

    // Engines: started simulators, or real vLLM instances already running.
    let sims;
    let engines: Vec<Engine> = if c.vllm {
        sims = None;
        let e = |role: &str, i: usize, url: &String| Engine {
            name: format!("{role}-{i}"),
            role: role.into(),
            url: url.trim_end_matches('/').into(),
            pid: None,
            kv_events: None,
        };
        c.prefill_url
            .iter()
            .enumerate()
            .map(|(i, u)| e("prefill", i, u))
            .chain(c.decode_url.iter().enumerate().map(|(i, u)| e("decode", i, u)))
            .collect()
    } else {
        let names: Vec<(String, &str)> = (0..c.prefills)
            .map(|i| (format!("prefill-{i}"), "prefill"))
            .chain((0..c.decodes).map(|i| (format!("decode-{i}"), "decode")))
            .collect();
        let started = SimCluster::start(
            &names,
            &c.sim.options(50, 1000, with_daemons, c.pull.then(|| c.shm_dir.clone())),
            &log_dir,
            &http,
        )
        .await?;
        let engines = started.engines.clone();
        sims = Some(started);
        engines
    };
    let daemons = if with_daemons {
        let mut opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout);
        if c.pull {
            opts.sidecar_mode = "pull".into();
        }
        Some(Daemons::start(&engines, &opts, &log_dir, &http).await?)
    } else {
        None
    };
    let mut pids: Vec<u32> = sims.as_ref().map(|s| s.group.pids()).unwrap_or_default();
    pids.extend(daemons.as_ref().map(|d| d.group.pids()).unwrap_or_default());
    if let Some(p) = &c.pids_file {
        write_json(p, &json!(pids))?;
    }
    eprintln!("cluster up ({mode} P/D): logs in {}", log_dir.display());
    for e in &engines {
        eprintln!(
            "  {:<10} {:<8} {}{}",
            e.name,
            e.role,
            e.url,
            e.pid.map(|p| format!("  pid {p}")).unwrap_or_default()
        );
    }
    if let Some(d) = &daemons {
        eprintln!("  {:<10} {:<8} {}  pid {}", "coordinator", "", d.coordinator_url, d.coordinator_pid);
        for s in &d.sidecars {
            eprintln!("  {:<10} {:<8} {}  pid {}", format!("sidecar:{}", s.engine), s.role, s.url, s.pid);
        }
    }
    // Test hook: the children must be stopped by unwinding when pdbench panics.
    if std::env::var_os("PDBENCH_TEST_PANIC_AFTER_START").is_some() {
        panic!("PDBENCH_TEST_PANIC_AFTER_START is set");
    }

    let urls = |role: &str| engines.iter().filter(|e| e.role == role).map(|e| e.url.clone()).collect::<Vec<_>>();
    let target = match &daemons {
        Some(d) => Target::round_robin(d.entry_urls()),
        None => Target::direct_pd(urls("prefill"), urls("decode"), true, c.local_below),
    };
    let (before, _) = cluster::scrape(&http, &engines).await;
    let decisions_before = match &daemons {
        Some(d) => Some(d.decisions(&http).await),
        None => None,
    };
    let r = runner::run(Arc::new(target), &spec, &cfg).await?;
    let (after, unreachable) = cluster::scrape(&http, &engines).await;
    let mut kv = KvReport::from(after.since(before));
    let s = &r.summary;
    // Who decided: pdbench itself (direct), or the sidecars and the coordinator.
    let (disaggregated, local, daemon_decisions) = match (&daemons, decisions_before) {
        (Some(d), Some(b)) => {
            let dd = d.decisions(&http).await.since(b);
            if c.pull {
                // The sidecars moved the bytes, not the engines.
                kv.bytes += dd.sidecar_pull_bytes;
                kv.transfers += dd.sidecar_pulls;
                kv.xfer_seconds += dd.sidecar_handoff_seconds;
                kv.gb_per_s = if kv.xfer_seconds > 0.0 { kv.bytes / kv.xfer_seconds / 1e9 } else { 0.0 };
            }
            (dd.sidecar_disaggregated as u64, dd.sidecar_local as u64, Some(dd))
        }
        _ => (s.disaggregated, s.local, None),
    };

    println!(
        "pdbench cluster: {} prefill + {} decode engines, {mode} P/D",
        urls("prefill").len(),
        urls("decode").len()
    );
    print!("{}", s.table());
    println!(
        "KV moved     {:.2} MB in {} transfers, {:.3} s of transfer time: {:.2} GB/s ({} failed transfers)",
        kv.bytes / 1e6,
        kv.transfers,
        kv.xfer_seconds,
        kv.gb_per_s,
        kv.failed_transfers
    );
    println!(
        "prefix hits  {:.1}% ({} of {} prompt tokens found cached)",
        100.0 * kv.prefix_hit_rate,
        kv.prefix_hits,
        kv.prefix_queries
    );
    println!("decisions    {disaggregated} disaggregated, {local} local");
    if let Some(d) = &daemon_decisions {
        println!(
            "coordinator  {} disaggregated, {} local-prefill pairings",
            d.coordinator_disaggregated, d.coordinator_local_prefill
        );
    }
    if !unreachable.is_empty() {
        println!("metrics      unreachable: {}", unreachable.join(", "));
    }
    if let Some(p) = &c.out.json {
        write_json(
            p,
            &json!({
                "mode": mode,
                "engines": engines,
                "pids": pids,
                "workload": spec,
                "summary": s,
                "requests": s.requests,
                "ok": s.ok,
                "failed": s.failed,
                "errors": s.errors,
                "kv": kv,
                "decisions": {"disaggregated": disaggregated, "local": local, "daemons": daemon_decisions},
                "coordinator": daemons.as_ref().map(|d| json!({"url": d.coordinator_url, "pid": d.coordinator_pid})),
                "sidecars": daemons.as_ref().map(|d| d.sidecars.clone()),
                "log_dir": log_dir,
            }),
        )?;
    }
    if let Some(p) = &c.out.plot {
        write_plots(p, &r);
    }
    // Daemons first (they hold connections to the engines), then the engines.
    drop(daemons);
    drop(sims);
    // Logs in a directory of our own choosing are only worth keeping when something failed.
    if c.sim.log_dir.is_none() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    Ok(())
}
