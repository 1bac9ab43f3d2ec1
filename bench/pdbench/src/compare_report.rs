//! compare-routing's report: the text table, TTFT ratios, the Markdown the README includes,
//! and the update of the README between its markers.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;
use serde_json::{json, Value};

use crate::args::SetupKind;
use pdbench::cluster::KvReport;
use pdbench::daemons::Decisions;
use pdbench::stats::Summary;
use pdbench::workload::WorkloadSpec;

/// The markers around a generated section (`name` None: the default section).
pub fn markers(name: Option<&str>) -> (String, String) {
    let tag = name.map_or_else(|| "compare-routing".to_string(), |n| format!("compare-routing:{n}"));
    (format!("<!-- {tag}:begin -->"), format!("<!-- {tag}:end -->"))
}

/// One setup in one repetition.
pub struct Row {
    pub kind: SetupKind,
    pub name: String,
    pub rep: usize,
    pub outcome: Outcome,
}

/// A setup either ran and was measured, or could not run (the reason is shown in its row).
pub enum Outcome {
    Measured(Box<Measured>),
    Skipped { why: String },
}

pub struct Measured {
    pub summary: Summary,
    pub kv: KvReport,
    /// The same per engine, in engine order (the P/D setups' prefills first).
    pub per_engine: Vec<KvReport>,
    /// The daemons' counters (coordinator setup only).
    pub decisions: Option<Decisions>,
}

impl Row {
    pub fn skipped(kind: SetupKind, name: &str, rep: usize, why: String) -> Row {
        Row { kind, name: name.to_string(), rep, outcome: Outcome::Skipped { why } }
    }

    pub fn measured(
        kind: SetupKind,
        name: &str,
        rep: usize,
        summary: Summary,
        kv: KvReport,
        per_engine: Vec<KvReport>,
        decisions: Option<Decisions>,
    ) -> Row {
        Row {
            kind,
            name: name.to_string(),
            rep,
            outcome: Outcome::Measured(Box::new(Measured { summary, kv, per_engine, decisions })),
        }
    }

    pub fn to_json(&self) -> Value {
        // `setup` keeps the variant name earlier versions wrote; `name` is the flag's spelling.
        let mut v = json!({"setup": format!("{:?}", self.kind), "name": self.name, "run": self.rep});
        match &self.outcome {
            Outcome::Skipped { why } => v["skipped"] = json!(why),
            Outcome::Measured(m) => {
                v["summary"] = json!(m.summary);
                v["kv"] = json!(m.kv);
                v["kv_per_engine"] = json!(m.per_engine);
                if let Some(d) = &m.decisions {
                    v["decisions"] = json!(d);
                }
            }
        }
        v
    }

    fn mean_ttft(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Measured(m) if m.summary.ok > 0 => Some(m.summary.ttft_ms.mean),
            _ => None,
        }
    }

    /// None without streamed gaps (non-streaming runs, one-token outputs).
    fn p99_itl(&self) -> Option<f64> {
        match &self.outcome {
            Outcome::Measured(m) if m.summary.itl_ms.count > 0 => Some(m.summary.itl_ms.p99),
            _ => None,
        }
    }
}

/// What the run was, for the report's header.
pub struct Context<'a> {
    pub spec: &'a WorkloadSpec,
    /// The replayed trace's summary, which then stands for the generated workload's.
    pub trace: Option<String>,
    pub engines: usize,
    pub concurrency: usize,
    pub pool_blocks: Option<String>,
    pub coordinator_args: Vec<String>,
    pub vllm_router_policy: String,
    pub shared_tokenizer: bool,
    /// /proc/loadavg (1, 5, 15 min) before and after.
    pub load: (Option<[f64; 3]>, Option<[f64; 3]>),
}

/// The 1-, 5- and 15-minute load averages (Linux).
pub fn load_average() -> Option<[f64; 3]> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    let v: Vec<f64> = text.split_whitespace().take(3).filter_map(|x| x.parse().ok()).collect();
    (v.len() == 3).then(|| [v[0], v[1], v[2]])
}

/// Mean-TTFT ratios per repetition: the coordinator (P/D) over round-robin's, over
/// vllm-router's in P/D mode and over vllm-router's regular (colocated) mode, and the
/// coordinator-colocated setup over vllm-router-colocated; then the same two P/D and
/// colocated pairs' ITL p99 ratios; then the ideal engine's over both vllm-router setups' (the
/// lowest ratio any routing could reach against them) and both coordinator setups' over the
/// ideal's. Null where a setup did not run.
pub fn ratios(rows: &[Row]) -> Vec<Value> {
    let reps = rows.iter().map(|r| r.rep).max().unwrap_or(0);
    (1..=reps)
        .map(|rep| {
            let of = |k: SetupKind| rows.iter().find(|r| r.rep == rep && r.kind == k).and_then(Row::mean_ttft);
            let over = |a: SetupKind, b: SetupKind| of(a).zip(of(b)).map(|(a, b)| a / b);
            let itl = |k: SetupKind| rows.iter().find(|r| r.rep == rep && r.kind == k).and_then(Row::p99_itl);
            let itl_over = |a: SetupKind, b: SetupKind| itl(a).zip(itl(b)).map(|(a, b)| a / b);
            json!({
                "run": rep,
                "coordinator_over_round_robin": over(SetupKind::Coordinator, SetupKind::RoundRobin),
                "coordinator_over_vllm_router": over(SetupKind::Coordinator, SetupKind::VllmRouter),
                "coordinator_over_vllm_router_colocated": over(SetupKind::Coordinator, SetupKind::VllmRouterColocated),
                "coordinator_colocated_over_vllm_router_colocated":
                    over(SetupKind::CoordinatorColocated, SetupKind::VllmRouterColocated),
                "itl_p99_coordinator_over_vllm_router": itl_over(SetupKind::Coordinator, SetupKind::VllmRouter),
                "itl_p99_coordinator_colocated_over_vllm_router_colocated":
                    itl_over(SetupKind::CoordinatorColocated, SetupKind::VllmRouterColocated),
                "ideal_over_vllm_router": over(SetupKind::Ideal, SetupKind::VllmRouter),
                "ideal_over_vllm_router_colocated": over(SetupKind::Ideal, SetupKind::VllmRouterColocated),
                "coordinator_over_ideal": over(SetupKind::Coordinator, SetupKind::Ideal),
                "coordinator_colocated_over_ideal": over(SetupKind::CoordinatorColocated, SetupKind::Ideal),
            })
        })
        .collect()
}

fn describe(c: &Context<'_>) -> String {
    let s = c.spec;
    let mut d = match &c.trace {
        Some(t) => format!("{t}; concurrency {}; {} engines", c.concurrency, c.engines),
        None => format!(
            "{} requests ({} turn{}), {} shared prefixes of {} tokens ({} popularity), user messages {} tokens, \
             {} output tokens, concurrency {}; {} engines",
            s.total_requests(),
            s.turns,
            if s.turns == 1 { "" } else { "s" },
            s.prefixes,
            s.prefix_len,
            s.popularity,
            s.prompt_len,
            s.output_len,
            c.concurrency,
            c.engines
        ),
    };
    match (&c.pool_blocks, &c.trace) {
        (Some(b), Some(_)) => {
            let _ = write!(d, ", {b} KV blocks each");
        }
        (Some(b), None) => {
            let prefix_blocks = (s.prefix_len as f64 / 16.0).ceil().max(1.0);
            let _ = write!(
                d,
                ", {b} KV blocks each (room for ~{:.0} prefixes)",
                b.parse::<f64>().unwrap_or(0.0) / prefix_blocks
            );
        }
        (None, _) => {}
    }
    if c.shared_tokenizer {
        d.push_str(", shared word-level tokenizer.json");
    }
    d
}

fn fmt_load(l: Option<[f64; 3]>) -> String {
    l.map_or_else(|| "?".into(), |[a, b, c]| format!("{a:.2} {b:.2} {c:.2}"))
}

fn decisions_cell(m: &Measured) -> String {
    m.decisions.as_ref().map_or_else(String::new, decisions_text)
}

/// The coordinator's answers, the requests it moved, and what a pairing call cost.
fn decisions_text(d: &Decisions) -> String {
    let mut cell =
        format!("{:.0} disaggregated / {:.0} local prefill", d.coordinator_disaggregated, d.coordinator_local_prefill);
    if d.coordinator_moved > 0.0 {
        cell.push_str(&format!(", {:.0} moved", d.coordinator_moved));
    }
    let answered = d.coordinator_disaggregated + d.coordinator_local_prefill;
    if d.sidecar_pairing_calls > 0.0 && answered > 0.0 {
        let ms = |secs: f64, n: f64| 1e3 * secs / n;
        cell.push_str(&format!(
            "; pairing call {:.2} ms ({:.2} in the coordinator)",
            ms(d.sidecar_pairing_seconds, d.sidecar_pairing_calls),
            ms(d.coordinator_pair_seconds, answered)
        ));
    }
    cell
}

fn engine_hits(m: &Measured) -> String {
    let rates: Vec<String> = m.per_engine.iter().map(|k| format!("{:.0}", 100.0 * k.prefix_hit_rate)).collect();
    rates.join("/")
}

fn fmt_ratio(v: &Value) -> String {
    v.as_f64().map_or_else(|| "—".into(), |x| format!("{x:.2}"))
}

/// The report printed to stdout.
pub fn text(c: &Context<'_>, rows: &[Row]) -> String {
    let mut out = format!("{}\n", describe(c));
    let _ = writeln!(
        out,
        "{:>3} {:<26} {:>5} {:>6} {:>12} {:>9} {:>9} {:>8} {:>8} {:>9} {:>14} {:>8}  coordinator pairings",
        "run",
        "setup",
        "ok",
        "failed",
        "mean TTFT ms",
        "p50 TTFT",
        "p99 TTFT",
        "p50 ITL",
        "p99 ITL",
        "hit rate",
        "by engine %",
        "KV MB"
    );
    for r in rows {
        match &r.outcome {
            Outcome::Skipped { why } => {
                let _ = writeln!(out, "{:>3} {:<26} skipped: {why}", r.rep, r.name);
            }
            Outcome::Measured(m) => {
                let t = &m.summary.ttft_ms;
                let _ = writeln!(
                    out,
                    "{:>3} {:<26} {:>5} {:>6} {:>12.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2} {:>8.1}% {:>14} {:>8.2}  {}",
                    r.rep,
                    r.name,
                    m.summary.ok,
                    m.summary.failed,
                    t.mean,
                    t.p50,
                    t.p99,
                    m.summary.itl_ms.p50,
                    m.summary.itl_ms.p99,
                    100.0 * m.kv.prefix_hit_rate,
                    engine_hits(m),
                    m.kv.bytes / 1e6,
                    decisions_cell(m)
                );
            }
        }
    }
    for v in ratios(rows) {
        let _ = writeln!(
            out,
            "run {}: coordinator mean TTFT = {} x round-robin, {} x vllm-router ({}), {} x vllm-router-colocated; \
             coordinator-colocated = {} x vllm-router-colocated; ITL p99: coordinator = {} x vllm-router, \
             coordinator-colocated = {} x vllm-router-colocated",
            v["run"],
            fmt_ratio(&v["coordinator_over_round_robin"]),
            fmt_ratio(&v["coordinator_over_vllm_router"]),
            c.vllm_router_policy,
            fmt_ratio(&v["coordinator_over_vllm_router_colocated"]),
            fmt_ratio(&v["coordinator_colocated_over_vllm_router_colocated"]),
            fmt_ratio(&v["itl_p99_coordinator_over_vllm_router"]),
            fmt_ratio(&v["itl_p99_coordinator_colocated_over_vllm_router_colocated"])
        );
    }
    if ran_ideal(rows) {
        for v in ratios(rows) {
            let _ = writeln!(
                out,
                "run {}: ideal mean TTFT = {} x vllm-router, {} x vllm-router-colocated; coordinator = {} x ideal, \
                 coordinator-colocated = {} x ideal",
                v["run"],
                fmt_ratio(&v["ideal_over_vllm_router"]),
                fmt_ratio(&v["ideal_over_vllm_router_colocated"]),
                fmt_ratio(&v["coordinator_over_ideal"]),
                fmt_ratio(&v["coordinator_colocated_over_ideal"])
            );
        }
    }
    let _ = writeln!(out, "load average before: {}, after: {}", fmt_load(c.load.0), fmt_load(c.load.1));
    out
}

/// Whether the ideal engine ran in any repetition (its ratios are shown only then).
fn ran_ideal(rows: &[Row]) -> bool {
    rows.iter().any(|r| r.kind == SetupKind::Ideal && matches!(r.outcome, Outcome::Measured(_)))
}

/// The command line as typed, with the executable shortened to `pdbench`.
fn command_line() -> String {
    let args: Vec<String> = std::env::args().skip(1).collect();
    format!("pdbench {}", args.join(" "))
}

/// The Markdown the README includes between its markers.
pub fn markdown(c: &Context<'_>, rows: &[Row]) -> String {
    let profile = if cfg!(debug_assertions) { "debug" } else { "release" };
    let mut md = format!(
        "Generated by `{}` ({profile} build; {} CPUs; load average before {}, after {}).\n\n{}.",
        command_line(),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        fmt_load(c.load.0),
        fmt_load(c.load.1),
        describe(c)
    );
    if !c.coordinator_args.is_empty() {
        let _ = write!(md, " Coordinator flags: `{}`.", c.coordinator_args.join(" "));
    }
    md.push_str(
        "\n\n| run | setup | ok | mean TTFT ms | p50 | p99 | ITL p50 ms | ITL p99 | prefix hit rate | by engine % | KV MB | coordinator pairings |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        match &r.outcome {
            Outcome::Skipped { why } => {
                let _ = writeln!(md, "| {} | {} | skipped: {} ||||||||||", r.rep, r.name, why.replace('|', "/"));
            }
            Outcome::Measured(m) => {
                let t = &m.summary.ttft_ms;
                let _ = writeln!(
                    md,
                    "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1}% | {} | {:.2} | {} |",
                    r.rep,
                    r.name,
                    m.summary.ok,
                    t.mean,
                    t.p50,
                    t.p99,
                    m.summary.itl_ms.p50,
                    m.summary.itl_ms.p99,
                    100.0 * m.kv.prefix_hit_rate,
                    engine_hits(m),
                    m.kv.bytes / 1e6,
                    decisions_cell(m)
                );
            }
        }
    }
    let policy = &c.vllm_router_policy;
    let pairs = [
        ("coordinator / round-robin".to_string(), "coordinator_over_round_robin"),
        (format!("coordinator / vllm-router ({policy})"), "coordinator_over_vllm_router"),
        (format!("coordinator / vllm-router-colocated ({policy})"), "coordinator_over_vllm_router_colocated"),
        (
            format!("coordinator-colocated / vllm-router-colocated ({policy})"),
            "coordinator_colocated_over_vllm_router_colocated",
        ),
        ("ITL p99: coordinator / vllm-router".to_string(), "itl_p99_coordinator_over_vllm_router"),
        (
            "ITL p99: coordinator-colocated / vllm-router-colocated".to_string(),
            "itl_p99_coordinator_colocated_over_vllm_router_colocated",
        ),
    ];
    ratio_table(&mut md, rows, &pairs);
    if ran_ideal(rows) {
        let bound = [
            (format!("ideal / vllm-router ({policy})"), "ideal_over_vllm_router"),
            (format!("ideal / vllm-router-colocated ({policy})"), "ideal_over_vllm_router_colocated"),
            ("coordinator / ideal".to_string(), "coordinator_over_ideal"),
            ("coordinator-colocated / ideal".to_string(), "coordinator_colocated_over_ideal"),
        ];
        ratio_table(&mut md, rows, &bound);
    }
    md
}

/// A Markdown table with a row per run and a column per ratio: each column's heading, and its
/// key in [`ratios`].
fn ratio_table(md: &mut String, rows: &[Row], columns: &[(String, &str)]) {
    md.push_str("\n| run |");
    for (heading, _) in columns {
        let _ = write!(md, " {heading} |");
    }
    md.push_str("\n|---|");
    md.push_str(&"---|".repeat(columns.len()));
    md.push('\n');
    for v in ratios(rows) {
        let _ = write!(md, "| {} |", v["run"]);
        for (_, key) in columns {
            let _ = write!(md, " {} |", fmt_ratio(&v[*key]));
        }
        md.push('\n');
    }
}

/// Byte offset of the line that is exactly `marker` (surrounding spaces aside), from `from` on;
/// a marker quoted inside prose does not count.
fn marker_line(text: &str, marker: &str, from: usize) -> Option<(usize, usize)> {
    let mut at = from;
    for line in text[from..].split_inclusive('\n') {
        if line.trim() == marker {
            return Some((at, at + line.trim_end_matches('\n').len()));
        }
        at += line.len();
    }
    None
}

/// `text` with everything between the marker lines replaced by `inner`; `None` without both.
pub fn replace_between_markers(text: &str, section: Option<&str>, inner: &str) -> Option<String> {
    let (begin, end) = markers(section);
    let (_, start) = marker_line(text, &begin, 0)?;
    let (stop, _) = marker_line(text, &end, start)?;
    Some(format!("{}\n{}\n{}", &text[..start], inner.trim_end(), &text[stop..]))
}

/// Rewrites `path` with `inner` between its markers.
pub fn update_readme(path: &Path, section: Option<&str>, inner: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let (begin, end) = markers(section);
    let new = replace_between_markers(&text, section, inner)
        .with_context(|| format!("{} has no {begin} … {end} markers", path.display()))?;
    std::fs::write(path, new).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decisions_cell_names_moves_and_the_pairing_cost() {
        let plain = Decisions { coordinator_disaggregated: 3.0, coordinator_local_prefill: 1.0, ..Default::default() };
        assert_eq!(decisions_text(&plain), "3 disaggregated / 1 local prefill");
        let timed = Decisions {
            coordinator_moved: 2.0,
            coordinator_pair_seconds: 0.002,
            sidecar_pairing_calls: 5.0,
            sidecar_pairing_seconds: 0.006,
            ..plain
        };
        assert_eq!(
            decisions_text(&timed),
            "3 disaggregated / 1 local prefill, 2 moved; pairing call 1.20 ms (0.50 in the coordinator)"
        );
    }

    #[test]
    fn replaces_only_between_the_markers() {
        let (b, e) = markers(None);
        assert_eq!(b, "<!-- compare-routing:begin -->");
        let (ub, ue) = markers(Some("uniform"));
        assert_eq!(ue, "<!-- compare-routing:uniform:end -->");
        let readme = format!("intro\n{b}\nold table\n{e}\nmiddle\n{ub}\nold\n{ue}\noutro\n");
        let new = replace_between_markers(&readme, None, "| new |\n").unwrap();
        assert_eq!(new, format!("intro\n{b}\n| new |\n{e}\nmiddle\n{ub}\nold\n{ue}\noutro\n"));
        // Idempotent.
        assert_eq!(replace_between_markers(&new, None, "| new |").unwrap(), new);
        let other = replace_between_markers(&new, Some("uniform"), "| u |").unwrap();
        assert_eq!(other, format!("intro\n{b}\n| new |\n{e}\nmiddle\n{ub}\n| u |\n{ue}\noutro\n"));
        assert!(replace_between_markers("no markers", None, "x").is_none());
        assert!(replace_between_markers(&format!("{e}\n{b}\n"), None, "x").is_none());
        // Markers quoted in prose are not markers.
        let prose = format!("put it between `{b}` and `{e}`:\n\n{b}\nold\n{e}\n");
        assert_eq!(
            replace_between_markers(&prose, None, "new").unwrap(),
            format!("put it between `{b}` and `{e}`:\n\n{b}\nnew\n{e}\n")
        );
    }
}
