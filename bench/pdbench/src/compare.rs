//! `pdbench compare-routing`: one simulator cluster, the same workload through each routing setup.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use crate::args::{CompareCmd, SetupKind};
use crate::write_json;
use pdbench::client::Target;
use pdbench::cluster::{self, Engine, KvReport, SimCluster};
use pdbench::daemons::Daemons;
use pdbench::procs::{self, Group};
use pdbench::runner;

/// A routing setup ready to take requests, and whatever it started (stopped on drop).
struct Prepared {
    target: Target,
    _extra: Group,
}

async fn prepare_setup(
    kind: SetupKind,
    engines: &[Engine],
    c: &CompareCmd,
    log_dir: &Path,
    http: &reqwest::Client,
) -> anyhow::Result<Prepared> {
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let half = urls.len() / 2;
    let (p, d) = (urls[..half].to_vec(), urls[half..].to_vec());
    Ok(match kind {
        SetupKind::RoundRobin => Prepared { target: Target::round_robin(urls), _extra: Group::default() },
        SetupKind::PdRoundRobin => Prepared { target: Target::direct_pd(p, d, false, 0), _extra: Group::default() },
        SetupKind::PdPrefixAffinity => Prepared { target: Target::direct_pd(p, d, true, 0), _extra: Group::default() },
        SetupKind::Coordinator => {
            let (cb, sb) = c.daemons.bins();
            anyhow::ensure!(
                c.daemons.usable(),
                "{} or {} is missing or does not answer --help",
                cb.display(),
                sb.display()
            );
            let roles: Vec<Engine> = engines
                .iter()
                .enumerate()
                .map(|(i, e)| Engine { role: if i < half { "prefill" } else { "decode" }.into(), ..e.clone() })
                .collect();
            let opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout_secs);
            let d = Daemons::start(&roles, &opts, log_dir, http).await?;
            let target = Target::round_robin(d.entry_urls());
            Prepared { target, _extra: d.group }
        }
        SetupKind::VllmRouter => {
            let bin = c.vllm_router.clone().context("the vllm-router setup needs --vllm-router PATH")?;
            let port = procs::free_port()?;
            let metrics_port = procs::free_port()?;
            let prefills: Vec<String> = p.iter().flat_map(|u| ["--prefill".to_string(), u.clone()]).collect();
            let decodes: Vec<String> = d.iter().flat_map(|u| ["--decode".to_string(), u.clone()]).collect();
            let mut args = Vec::new();
            for a in c.vllm_router_args.split_whitespace() {
                match a {
                    "{prefills}" => args.extend(prefills.iter().cloned()),
                    "{decodes}" => args.extend(decodes.iter().cloned()),
                    _ => args.push(
                        a.replace("{port}", &port.to_string()).replace("{metrics_port}", &metrics_port.to_string()),
                    ),
                }
            }
            let mut cmd = std::process::Command::new(&bin);
            cmd.args(&args);
            let mut group = Group::default();
            let proc_ = group.push(procs::Proc::spawn("vllm-router", cmd, log_dir)?);
            let url = format!("http://127.0.0.1:{port}");
            proc_.wait_healthy(http, &format!("{url}/health"), Duration::from_secs(c.sim.startup_timeout_secs)).await?;
            Prepared { target: Target::round_robin(vec![url]), _extra: group }
        }
    })
}

pub async fn compare_cmd(c: CompareCmd) -> anyhow::Result<()> {
    anyhow::ensure!(c.engines >= 2, "--engines must be at least 2");
    let spec = c.workload.spec()?;
    let cfg = c.load.config();
    let http = runner::http_client(4, Duration::from_secs(5))?;
    let log_dir = c.sim.log_dir("compare")?;
    let names: Vec<(String, &str)> = (0..c.engines).map(|i| (format!("engine-{i}"), "both")).collect();
    let kv_events = c.setups.contains(&SetupKind::Coordinator);
    let sims = SimCluster::start(&names, &c.sim.options(100, 1000, kv_events, None), &log_dir, &http).await?;
    eprintln!("{} engines up (logs in {})", sims.engines.len(), log_dir.display());
    let mut rows = Vec::new();
    for &kind in &c.setups {
        let name = format!("{kind:?}");
        cluster::reset_prefix_caches(&http, &sims.engines).await?;
        let prepared = match prepare_setup(kind, &sims.engines, &c, &log_dir, &http).await {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{name}: skipped: {e:#}");
                rows.push(json!({"setup": name, "skipped": format!("{e:#}")}));
                continue;
            }
        };
        let (before, _) = cluster::scrape(&http, &sims.engines).await;
        let r = runner::run(Arc::new(prepared.target), &spec, &cfg).await?;
        let (after, _) = cluster::scrape(&http, &sims.engines).await;
        let kv = KvReport::from(after.since(before));
        eprintln!(
            "{name}: {} ok, {} failed, mean TTFT {:.2} ms",
            r.summary.ok, r.summary.failed, r.summary.ttft_ms.mean
        );
        rows.push(json!({"setup": name, "summary": r.summary, "kv": kv}));
    }
    println!(
        "{} requests, {} shared prefixes of {} tokens, {} engines, concurrency {}",
        spec.total_requests(),
        spec.prefixes,
        spec.prefix_len,
        c.engines,
        cfg.concurrency
    );
    println!(
        "{:<20} {:>8} {:>7} {:>14} {:>12} {:>12} {:>10} {:>10}",
        "setup", "ok", "failed", "mean TTFT ms", "p50 TTFT", "p99 TTFT", "hit rate", "KV MB"
    );
    for row in &rows {
        let setup = row["setup"].as_str().unwrap_or("?");
        if let Some(why) = row.get("skipped") {
            println!("{setup:<20} skipped: {}", why.as_str().unwrap_or(""));
            continue;
        }
        let s = &row["summary"];
        let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
        println!(
            "{setup:<20} {:>8} {:>7} {:>14.2} {:>12.2} {:>12.2} {:>9.1}% {:>10.2}",
            s["ok"].as_u64().unwrap_or(0),
            s["failed"].as_u64().unwrap_or(0),
            f(&s["ttft_ms"]["mean"]),
            f(&s["ttft_ms"]["p50"]),
            f(&s["ttft_ms"]["p99"]),
            100.0 * f(&row["kv"]["prefix_hit_rate"]),
            f(&row["kv"]["bytes"]) / 1e6
        );
    }
    if let Some(p) = &c.json {
        write_json(p, &json!({"workload": spec, "engines": sims.engines, "setups": rows}))?;
    }
    drop(sims);
    // Logs in a directory of our own choosing are only worth keeping when something failed.
    if c.sim.log_dir.is_none() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    Ok(())
}
