//! `pdbench compare-routing`: one simulator cluster, the same workload through each routing setup.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::ValueEnum;
use serde_json::json;

use crate::args::{CompareCmd, SetupKind};
use crate::compare_report::{self, Row};
use crate::write_json;
use pdbench::client::Target;
use pdbench::cluster::{self, Counters, Engine, KvReport, SimCluster};
use pdbench::daemons::Daemons;
use pdbench::procs::{self, Group};
use pdbench::runner;
use pdbench::trace::Replay;
use pdbench::workload::{self, Workload, WorkloadSpec};

/// Tokens per KV block of the simulator (its default; the pool is sized in these).
const BLOCK_TOKENS: u64 = 16;
/// The simulator's longest prompt plus output, in blocks (its default `--max-model-len`, 8192
/// tokens): the ideal engine's pool holds this much for every request of the workload...
const MAX_REQUEST_BLOCKS: u64 = 8192 / BLOCK_TOKENS;
/// ...up to this many blocks (4 GiB of address space at the simulator's default block size,
/// touched only where prompts are written): 4 times what the presets need (480 requests).
const MAX_IDEAL_BLOCKS: u64 = 1 << 20;
/// The simulator flags that make the ideal engine ideal; the cluster's own values of them are
/// left out of its command line.
const IDEAL_FLAGS: [&str; 3] = ["--num-blocks", "--prefill-queue", "--interference-factor"];

/// A routing setup ready to take requests, and whatever it started (stopped on drop).
struct Prepared {
    target: Target,
    daemons: Option<Daemons>,
    _extra: Group,
}

impl Prepared {
    fn plain(target: Target) -> Prepared {
        Prepared { target, daemons: None, _extra: Group::default() }
    }
}

/// The setup's name as given on the command line (`pd-round-robin`).
pub fn setup_name(kind: SetupKind) -> String {
    kind.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_else(|| format!("{kind:?}"))
}

async fn prepare_setup(
    kind: SetupKind,
    engines: &[Engine],
    c: &CompareCmd,
    tokenizer: Option<&Path>,
    log_dir: &Path,
    http: &reqwest::Client,
) -> anyhow::Result<Prepared> {
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let half = urls.len() / 2;
    let (p, d) = (urls[..half].to_vec(), urls[half..].to_vec());
    Ok(match kind {
        SetupKind::RoundRobin | SetupKind::Ideal => Prepared::plain(Target::round_robin(urls)),
        SetupKind::PdRoundRobin => Prepared::plain(Target::direct_pd(p, d, false, 0)),
        SetupKind::PdPrefixAffinity => Prepared::plain(Target::direct_pd(p, d, true, 0)),
        SetupKind::Coordinator | SetupKind::CoordinatorColocated => {
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
                .map(|(i, e)| {
                    let role = match kind {
                        SetupKind::CoordinatorColocated => "both",
                        _ if i < half => "prefill",
                        _ => c.coordinator_decode_role.as_str(),
                    };
                    Engine { role: role.into(), ..e.clone() }
                })
                .collect();
            let mut opts = c.daemons.options(c.workload.model.as_deref(), c.sim.startup_timeout);
            if let Some(t) = tokenizer {
                opts.coordinator_args.push(format!("--tokenizer={}", t.display()));
            }
            let d = Daemons::start(&roles, &opts, log_dir, http).await?;
            Prepared { target: Target::round_robin(d.entry_urls()), daemons: Some(d), _extra: Group::default() }
        }
        SetupKind::VllmRouter | SetupKind::VllmRouterRoundRobin | SetupKind::VllmRouterColocated => {
            let bin = c.vllm_router.clone().context("the vllm-router setups need --vllm-router PATH")?;
            let policy = if kind == SetupKind::VllmRouterRoundRobin { "round_robin" } else { &c.vllm_router_policy };
            let template = if kind == SetupKind::VllmRouterColocated {
                &c.vllm_router_colocated_args
            } else {
                &c.vllm_router_args
            };
            let port = procs::free_port()?;
            let metrics_port = procs::free_port()?;
            let prefills: Vec<String> = p.iter().flat_map(|u| ["--prefill".to_string(), u.clone()]).collect();
            let decodes: Vec<String> = d.iter().flat_map(|u| ["--decode".to_string(), u.clone()]).collect();
            let mut args = Vec::new();
            for a in template.split_whitespace() {
                match a {
                    "{workers}" => args.extend(urls.iter().cloned()),
                    "{prefills}" => args.extend(prefills.iter().cloned()),
                    "{decodes}" => args.extend(decodes.iter().cloned()),
                    _ => args.push(
                        a.replace("{port}", &port.to_string())
                            .replace("{metrics_port}", &metrics_port.to_string())
                            .replace("{policy}", policy),
                    ),
                }
            }
            let mut cmd = std::process::Command::new(&bin);
            cmd.args(&args);
            let mut group = Group::default();
            let proc_ = group.push(procs::Proc::spawn(&format!("{}-0", setup_name(kind)), cmd, log_dir)?);
            let url = format!("http://127.0.0.1:{port}");
            proc_.wait_healthy(http, &format!("{url}/health"), c.sim.startup_timeout).await?;
            Prepared { target: Target::round_robin(vec![url]), daemons: None, _extra: group }
        }
    })
}

/// Blocks per engine pool: `share` of the shared prompts' blocks, plus room for the engine's
/// share of the requests in flight (whole: prompt, history and output). Never less than all
/// requests in flight whole, so no engine can wait forever for free blocks.
pub fn pool_blocks(spec: &WorkloadSpec, share: f64, concurrency: usize, engines: usize) -> u64 {
    let prefix_blocks = (spec.prefix_len as u64).div_ceil(BLOCK_TOKENS);
    let per_turn = spec.prompt_len.upper() + spec.output_len.upper();
    let request_blocks = prefix_blocks + (spec.turns as u64 * per_turn).div_ceil(BLOCK_TOKENS) + 1;
    pool_of(spec.prefixes as u64 * prefix_blocks, request_blocks, share, concurrency, engines)
}

/// The same for a trace: `share` of the distinct blocks of all its prompts, and room for its
/// longest requests in flight.
pub fn trace_pool_blocks(replay: &Replay, share: f64, concurrency: usize, engines: usize) -> u64 {
    let request_blocks = replay.max_request_tokens().div_ceil(BLOCK_TOKENS) + 1;
    pool_of(replay.distinct_kv_blocks(BLOCK_TOKENS), request_blocks, share, concurrency, engines)
}

fn pool_of(shared_blocks: u64, request_blocks: u64, share: f64, concurrency: usize, engines: usize) -> u64 {
    let n = concurrency as u64;
    let shared = (share * shared_blocks as f64).ceil() as u64;
    (shared + n.div_ceil(engines.max(1) as u64) * request_blocks).max(n * request_blocks)
}

/// The simulator flags the cache sizing and the shared tokenizer add.
fn sim_extra_args(
    c: &CompareCmd,
    spec: &WorkloadSpec,
    replay: Option<&Replay>,
    tokenizer: Option<&Path>,
) -> Vec<String> {
    let mut args = Vec::new();
    let user_sized = c.sim.sim_arg.iter().any(|a| a.starts_with("--num-blocks"));
    if let Some(share) = c.cache_share.filter(|&s| s > 0.0 && !user_sized) {
        let n = c.load.concurrency.max(1);
        let blocks = match replay {
            Some(r) => trace_pool_blocks(r, share, n, c.engines),
            None => pool_blocks(spec, share, n, c.engines),
        };
        args.push(format!("--num-blocks={blocks}"));
    }
    if let Some(t) = tokenizer {
        args.push(format!("--tokenizer={}", t.display()));
    }
    args
}

/// The ideal engine's flags: the cluster's, less [`IDEAL_FLAGS`] (as `--flag=value` or
/// `--flag value`), then a pool of `blocks`, prompts side by side, decodes never slowed.
fn ideal_args(cluster: &[String], blocks: u64) -> Vec<String> {
    let mut out = Vec::with_capacity(cluster.len() + 3);
    let mut args = cluster.iter();
    while let Some(a) = args.next() {
        let name = a.split_once('=').map_or(a.as_str(), |(name, _)| name);
        if !IDEAL_FLAGS.contains(&name) {
            out.push(a.clone());
        } else if !a.contains('=') {
            args.next();
        }
    }
    out.extend([format!("--num-blocks={blocks}"), "--prefill-queue=none".into(), "--interference-factor=0".into()]);
    out
}

/// Each engine's counters (an unreachable engine counts 0).
async fn scrape_each(http: &reqwest::Client, engines: &[Engine]) -> Vec<Counters> {
    let mut out = Vec::with_capacity(engines.len());
    for e in engines {
        out.push(cluster::scrape(http, std::slice::from_ref(e)).await.0);
    }
    out
}

fn write_tokenizer(log_dir: &Path) -> anyhow::Result<PathBuf> {
    let path = log_dir.join("tokenizer.json");
    std::fs::write(&path, workload::word_level_tokenizer().to_string())
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

pub async fn compare_cmd(c: CompareCmd) -> anyhow::Result<()> {
    anyhow::ensure!(c.engines >= 2, "--engines must be at least 2");
    anyhow::ensure!(c.repeat >= 1, "--repeat must be at least 1");
    let replay = c.trace.replay()?;
    let workload = Arc::new(match &replay {
        Some(r) => Workload::replay(&c.workload.spec()?, r.clone()),
        None => Workload::new(&c.workload.spec()?),
    });
    let spec = workload.spec().clone();
    let cfg = c.load.config();
    let http = runner::http_client(4, Duration::from_secs(5))?;
    let log_dir = c.sim.log_dir("compare")?;
    let load_before = compare_report::load_average();
    let tokenizer = if c.shared_tokenizer { Some(write_tokenizer(&log_dir)?) } else { None };
    let names: Vec<(String, &str)> = (0..c.engines).map(|i| (format!("engine-{i}"), "both")).collect();
    let kv_events = c.setups.iter().any(|k| matches!(k, SetupKind::Coordinator | SetupKind::CoordinatorColocated));
    let mut sim_opts = c.sim.options(100, 1000, kv_events, None);
    let extra = sim_extra_args(&c, &spec, replay.as_ref(), tokenizer.as_deref());
    sim_opts.args.extend(extra.iter().cloned());
    let sims = SimCluster::start(&names, &sim_opts, &log_dir, &http).await?;
    eprintln!("{} engines up (extra pd-sim flags: {extra:?}; logs in {})", sims.engines.len(), log_dir.display());
    let ideal = if c.setups.contains(&SetupKind::Ideal) {
        let blocks = (spec.total_requests() as u64 * MAX_REQUEST_BLOCKS).min(MAX_IDEAL_BLOCKS);
        let opts =
            cluster::SimOptions { args: ideal_args(&sim_opts.args, blocks), kv_events: false, ..sim_opts.clone() };
        let one = SimCluster::start(&[("ideal".to_string(), "both")], &opts, &log_dir, &http).await?;
        eprintln!("ideal engine up (pd-sim flags: {:?})", opts.args);
        Some(one)
    } else {
        None
    };
    let mut rows = Vec::new();
    for rep in 1..=c.repeat {
        for &kind in &c.setups {
            let name = setup_name(kind);
            let engines = match (&ideal, kind) {
                (Some(one), SetupKind::Ideal) => &one.engines,
                _ => &sims.engines,
            };
            cluster::reset_prefix_caches(&http, engines).await?;
            let prepared = match prepare_setup(kind, engines, &c, tokenizer.as_deref(), &log_dir, &http).await {
                Ok(p) => p,
                Err(e) => {
                    let why = pd_config_file::report::error_line(e.as_ref());
                    eprintln!("{name}: skipped: {why}");
                    rows.push(Row::skipped(kind, &name, rep, why));
                    continue;
                }
            };
            let Prepared { target, daemons, _extra } = prepared;
            let decisions_before = match &daemons {
                Some(d) => Some(d.decisions(&http).await),
                None => None,
            };
            let before = scrape_each(&http, engines).await;
            let r = runner::run_workload(Arc::new(target), Arc::clone(&workload), &cfg).await?;
            let after = scrape_each(&http, engines).await;
            let per_engine: Vec<KvReport> =
                after.iter().zip(&before).map(|(a, b)| KvReport::from(a.since(*b))).collect();
            let total = |v: &[Counters]| v.iter().fold(Counters::default(), |t, c| t.plus(*c));
            let decisions = match (&daemons, decisions_before) {
                (Some(d), Some(b)) => Some(d.decisions(&http).await.since(b)),
                _ => None,
            };
            let kv = KvReport::from(total(&after).since(total(&before)));
            eprintln!(
                "run {rep} {name}: {} ok, {} failed, mean TTFT {:.2} ms, prefix hits {:.1}%",
                r.summary.ok,
                r.summary.failed,
                r.summary.ttft_ms.mean,
                100.0 * kv.prefix_hit_rate
            );
            rows.push(Row::measured(kind, &name, rep, r.summary, kv, per_engine, decisions));
        }
    }
    let load_after = compare_report::load_average();
    let context = compare_report::Context {
        spec: &spec,
        trace: replay.as_ref().map(Replay::describe),
        engines: c.engines,
        concurrency: cfg.concurrency,
        pool_blocks: extra.iter().find_map(|a| a.strip_prefix("--num-blocks=")).map(str::to_string),
        coordinator_args: c.daemons.coordinator_arg.clone(),
        vllm_router_policy: c.vllm_router_policy.clone(),
        shared_tokenizer: tokenizer.is_some(),
        load: (load_before, load_after),
    };
    print!("{}", compare_report::text(&context, &rows));
    if let Some(p) = &c.json {
        let setups: Vec<serde_json::Value> = rows.iter().map(Row::to_json).collect();
        let ratios = compare_report::ratios(&rows);
        let trace = replay.as_ref().map(Replay::options);
        write_json(
            p,
            &json!({"workload": spec, "trace": trace, "engines": sims.engines, "setups": setups, "ratios": ratios}),
        )?;
    }
    if c.markdown.is_some() || c.update_readme.is_some() {
        let md = compare_report::markdown(&context, &rows);
        if let Some(p) = &c.markdown {
            std::fs::write(p, &md).with_context(|| format!("writing {}", p.display()))?;
        }
        if let Some(p) = &c.update_readme {
            compare_report::update_readme(p, c.readme_section.as_deref(), &md)?;
            eprintln!("updated {}", p.display());
        }
    }
    drop(sims);
    drop(ideal);
    // Logs in a directory of our own choosing are only worth keeping when something failed.
    if c.sim.log_dir.is_none() {
        let _ = std::fs::remove_dir_all(&log_dir);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdbench::workload::{Api, Dist, Popularity};

    #[test]
    fn pools_hold_their_share_of_the_prefixes_besides_the_requests_in_flight() {
        let spec = WorkloadSpec {
            conversations: 240,
            turns: 1,
            prompt_len: Dist::Fixed { value: 64 },
            output_len: Dist::Fixed { value: 16 },
            prefixes: 24,
            prefix_len: 1024,
            popularity: Popularity::Uniform,
            api: Api::Completions,
            model: None,
            seed: 1,
        };
        // 24 × 64 blocks / 3 = 512, plus 2 requests in flight of 64 + 5 + 1 blocks.
        assert_eq!(pool_blocks(&spec, 1.0 / 3.0, 8, 4), 512 + 2 * 70);
        // Tiny shares still fit every request in flight.
        assert_eq!(pool_blocks(&spec, 0.01, 8, 4), 8 * 70);
    }

    #[test]
    fn the_ideal_engine_keeps_the_clusters_flags_but_its_own_three() {
        let cluster: Vec<String> = [
            "--num-blocks=652",
            "--prefill-queue",
            "fifo",
            "--tokenizer=/t.json",
            "--interference-factor=2",
            "--workers",
            "1",
        ]
        .map(String::from)
        .into();
        assert_eq!(
            ideal_args(&cluster, 9000),
            [
                "--tokenizer=/t.json",
                "--workers",
                "1",
                "--num-blocks=9000",
                "--prefill-queue=none",
                "--interference-factor=0"
            ]
        );
    }
}
