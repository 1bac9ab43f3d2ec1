//! `pdbench cluster`: a whole local P/D cluster, a sample workload, a report.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use serde_json::json;

use crate::args::{ClusterCmd, ClusterMode};
use crate::cluster_report::{decisions_section, plots_line, serve_banner};
use crate::{write_json, write_plots};
use pdbench::client::Target;
use pdbench::cluster::{self, Engine, KvReport, SimCluster};
use pdbench::daemons::Daemons;
use pdbench::runner;
use pdbench::workload::Dist;

/// The sample workload's shape when its flags are not given: a few long shared system prompts
/// and user messages long enough that most prompts are worth prefilling elsewhere.
const DEMO_PREFIX_LEN: usize = 1024;
const DEMO_PROMPT_LEN: Dist = Dist::Uniform { lo: 128, hi: 1024 };
/// KV bytes per token of the simulated engines: a small model's (Qwen2.5-0.5B: 24 layers × 2 KV
/// heads × 64 × K and V × 2 bytes = 12 KiB; Llama-3-8B has 128 KiB), so a 16-token block is
/// 128 KiB and the sample run stays a few seconds long on two cores.
const DEMO_KV_BYTES_PER_TOKEN: usize = 8 * 1024;
/// Blocks per engine (256 MiB of pool): every shared prompt and the requests in flight, twice over.
const DEMO_NUM_BLOCKS: usize = 2048;
/// The coordinator prefills on the decode itself only when fewer uncached tokens than this remain
/// (its own default, 2048, suits prompts longer than the sample's).
const DEMO_LOCAL_PREFILL_MAX_TOKENS: u64 = 256;

impl ClusterCmd {
    /// Fills in the sample workload's shape for every workload flag not given explicitly (not
    /// with `--vllm`: real engines on CPUs keep the flags' own, shorter defaults).
    pub fn apply_demo_defaults(&mut self, given: impl Fn(&str) -> bool) {
        if self.vllm {
            return;
        }
        if !given("prefix_len") {
            self.workload.prefix_len = DEMO_PREFIX_LEN;
        }
        if !given("prompt_len") {
            self.workload.prompt_len = DEMO_PROMPT_LEN;
        }
    }
}

/// The flags pdbench gives the simulators and the coordinator ahead of the user's own
/// (`--sim-arg`, `--coordinator-arg` come later and win: every daemon lets a repeated flag override).
fn demo_sim_args() -> Vec<String> {
    vec![format!("--bytes-per-token={DEMO_KV_BYTES_PER_TOKEN}"), format!("--num-blocks={DEMO_NUM_BLOCKS}")]
}

fn demo_coordinator_args() -> Vec<String> {
    vec![format!("--local-prefill-max-tokens={DEMO_LOCAL_PREFILL_MAX_TOKENS}")]
}

/// The value of `--name=V` or `--name V` last given in `args`.
fn last_flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    let mut found = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if let Some(v) = a.strip_prefix(name).and_then(|r| r.strip_prefix('=')) {
            found = Some(v);
        } else if a == name {
            found = it.next().map(String::as_str);
        }
    }
    found
}

/// The coordinator's conditional-disaggregation rule as it was started, in words.
fn local_rule(coordinator_args: &[String]) -> String {
    let tokens = last_flag(coordinator_args, "--local-prefill-max-tokens").unwrap_or("2048");
    let ratio = last_flag(coordinator_args, "--local-prefill-max-ratio").unwrap_or("0.7");
    format!(
        "prefill on the decode when under {tokens} prompt tokens are uncached there and they are under \
         {ratio} of the prompt: --local-prefill-max-tokens, --local-prefill-max-ratio"
    )
}

/// Removes the children's logs from a log directory pdbench chose itself; the directory goes too
/// unless it holds the plots.
fn remove_logs(log_dir: &Path, keep: &[PathBuf]) {
    if keep.is_empty() {
        let _ = std::fs::remove_dir_all(log_dir);
        return;
    }
    if let Ok(entries) = std::fs::read_dir(log_dir) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

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
    anyhow::ensure!(
        !c.serve || with_daemons,
        "--serve needs the sidecar mode (pd-sidecar and pd-coordinator built): in direct mode pdbench itself is \
         the P/D proxy and serves no endpoint"
    );
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
        let mut opts = c.sim.options(50, 1000, with_daemons, c.pull.then(|| c.shm_dir.clone()));
        opts.args = demo_sim_args().into_iter().chain(opts.args).collect();
        let started = SimCluster::start(&names, &opts, &log_dir, &http).await?;
        let engines = started.engines.clone();
        sims = Some(started);
        engines
    };
    let daemons = if with_daemons {
        let mut opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout);
        opts.coordinator_args = demo_coordinator_args().into_iter().chain(opts.coordinator_args).collect();
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
    let coordinator_args = daemons.as_ref().map(|_| {
        demo_coordinator_args().into_iter().chain(c.daemons.coordinator_arg.iter().cloned()).collect::<Vec<_>>()
    });
    let mut report = json!({
        "mode": mode,
        "engines": engines,
        "pids": pids,
        "workload": spec,
        "coordinator": daemons.as_ref().map(|d| json!({"url": d.coordinator_url, "pid": d.coordinator_pid})),
        "sidecars": daemons.as_ref().map(|d| d.sidecars.clone()),
        "log_dir": log_dir,
    });
    let mut plots = Vec::new();
    if spec.total_requests() > 0 {
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
        let plotted = write_plots(&c.out.plot.clone().unwrap_or_else(|| log_dir.join("cluster")), &r);

        println!(
            "pdbench cluster: {} prefill + {} decode engines, {mode} P/D",
            urls("prefill").len(),
            urls("decode").len()
        );
        if sims.is_some() {
            let kv_bytes_per_token = last_flag(&c.sim.sim_arg, "--bytes-per-token")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEMO_KV_BYTES_PER_TOKEN);
            println!(
                "workload     {} requests, {} shared system prompts of {} tokens, user messages {}, KV {} KiB per token",
                s.requests,
                spec.prefixes,
                spec.prefix_len,
                spec.prompt_len,
                kv_bytes_per_token / 1024
            );
        }
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
        let rule = coordinator_args.as_deref().map(local_rule).unwrap_or_default();
        print!("{}", decisions_section(disaggregated, local, daemon_decisions.as_ref(), c.local_below, &rule));
        if !unreachable.is_empty() {
            println!("metrics      unreachable: {}", unreachable.join(", "));
        }
        print!("{}", plots_line(&plotted));
        plots = plotted.unwrap_or_default();
        let extra = json!({
            "summary": s,
            "requests": s.requests,
            "ok": s.ok,
            "failed": s.failed,
            "errors": s.errors,
            "kv": kv,
            "decisions": {"disaggregated": disaggregated, "local": local, "daemons": daemon_decisions},
            "plots": plots,
        });
        if let (Some(o), Some(e)) = (report.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
    }
    if let (true, Some(d)) = (c.serve, &daemons) {
        let entries = d.entry_urls();
        let (entry, others) = entries.split_first().context("no decode sidecar to serve from")?;
        let model = c.workload.model.as_deref().unwrap_or("sim-model");
        report["serve"] = json!({"base_url": format!("{entry}/v1"), "model": model});
        if let Some(p) = &c.out.json {
            write_json(p, &report)?;
        }
        print!("{}", serve_banner(entry, others, model));
        // Until SIGINT or SIGTERM: the caller then drops this future, and with it every child.
        std::future::pending::<()>().await;
    }
    if let Some(p) = &c.out.json {
        write_json(p, &report)?;
    }
    // Daemons first (they hold connections to the engines), then the engines.
    drop(daemons);
    drop(sims);
    // Logs in a directory of our own choosing are only worth keeping when something failed.
    if c.sim.log_dir.is_none() {
        remove_logs(&log_dir, &plots);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::{parse_cli, Cmd};

    fn cluster(args: &[&str]) -> ClusterCmd {
        match parse_cli(["pdbench", "cluster"].iter().chain(args).copied()).unwrap().cmd {
            Cmd::Cluster(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_sample_workload_fills_in_only_what_is_not_given() {
        let c = cluster(&[]);
        assert_eq!((c.workload.prefix_len, c.workload.prompt_len), (DEMO_PREFIX_LEN, DEMO_PROMPT_LEN));
        let c = cluster(&["--prefix-len", "64", "--prompt-len", "32"]);
        assert_eq!((c.workload.prefix_len, c.workload.prompt_len), (64, Dist::Fixed { value: 32 }));
        // Real engines keep the flags' own defaults.
        let c = cluster(&["--vllm", "--prefill-url", "http://p", "--decode-url", "http://d"]);
        assert_eq!(c.workload.prefix_len, 256);
        assert!(!c.serve && cluster(&["--serve"]).serve);
    }

    #[test]
    fn the_last_flag_given_wins_as_the_daemons_read_it() {
        let args: Vec<String> = demo_coordinator_args()
            .into_iter()
            .chain(["--local-prefill-max-ratio".into(), "0.5".into(), "--local-prefill-max-tokens=64".into()])
            .collect();
        assert_eq!(last_flag(&args, "--local-prefill-max-tokens"), Some("64"));
        assert_eq!(last_flag(&args, "--local-prefill-max-ratio"), Some("0.5"));
        assert_eq!(last_flag(&args, "--absent"), None);
        assert!(local_rule(&args).contains("under 64 prompt tokens") && local_rule(&args).contains("under 0.5 of"));
        assert!(local_rule(&[]).contains("under 2048 prompt tokens"));
    }
}
