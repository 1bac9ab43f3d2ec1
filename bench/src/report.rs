//! Result rows: the printed table, JSON and CSV.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::layout::Case;
use crate::measure::Measurement;
use crate::units::{format_size, format_total};

/// One measured case of one engine. Rows read back (`--rows`, peers' scripts) may leave out
/// everything but backend, op, block_size and gbps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Row {
    pub backend: String,
    pub op: String,
    pub block_size: u64,
    pub batch: u64,
    pub threads: u64,
    /// Requests in flight per thread (left out when 1; rows read back without it had 1).
    #[serde(skip_serializing_if = "one_in_flight")]
    pub window: u64,
    pub iters: u64,
    /// Runs of the case; the row is the median one.
    pub repeat: u64,
    pub scatter: bool,
    /// `pairwise`, `many-to-one:N` or `one-to-many:N` (left out when pairwise).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub scheme: String,
    /// The memory kinds moved, source→destination (`FILE→DRAM`); left out when DRAM→DRAM.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub mem: String,
    /// Bytes moved by the measured requests of all threads.
    pub bytes: u64,
    pub gbps: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    /// This row's GB/s over raw-tcp's for the same case (`--compare`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_raw: Option<f64>,
    /// The scattered KV-shaped row's GB/s over the contiguous request of equal size (`--kv-shape`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_vs_contiguous: Option<f64>,
}

impl Row {
    pub fn new(backend: &str, case: &Case, threads: u64, iters: u64, repeat: u64, measured: &Measurement) -> Row {
        Row {
            backend: backend.to_string(),
            op: case.op.to_string(),
            block_size: case.block,
            batch: case.batch,
            threads,
            window: 1,
            iters,
            repeat,
            scatter: case.scatter,
            scheme: String::new(),
            mem: String::new(),
            bytes: measured.bytes,
            gbps: measured.gbps(),
            p50_us: measured.p50_us(),
            p99_us: measured.p99_us(),
            ratio_vs_raw: None,
            ratio_vs_contiguous: None,
        }
    }
}

fn one_in_flight(window: &u64) -> bool {
    *window <= 1
}

/// `a / b`, or `None` when `b` is not positive.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

const COLUMNS: [(&str, usize); 11] = [
    ("backend", 8),
    ("op", 5),
    ("block", 6),
    ("batch", 6),
    ("threads", 7),
    ("layout", 8),
    ("total", 11),
    ("GB/s", 8),
    ("p50 µs", 10),
    ("p99 µs", 10),
    ("vs raw", 6),
];

fn line(cells: [String; 11]) -> String {
    let mut out = String::new();
    for (i, (cell, (_, width))) in cells.iter().zip(COLUMNS).enumerate() {
        if i < 2 || i == 5 {
            out.push_str(&format!("{cell:<width$}"));
        } else {
            out.push_str(&format!("{cell:>width$}"));
        }
        out.push_str("  ");
    }
    out.trim_end().to_string()
}

/// The table's header; with a memory column when some row moves more than DRAM→DRAM (a
/// DRAM-only table stays as it always was).
pub fn header(with_mem: bool) -> String {
    let head = line(COLUMNS.map(|(name, _)| name.to_string()));
    if with_mem {
        head + "  memory"
    } else {
        head
    }
}

pub fn format_row(row: &Row) -> String {
    let cells = line([
        row.backend.clone(),
        row.op.clone(),
        format_size(row.block_size),
        row.batch.to_string(),
        row.threads.to_string(),
        if row.scatter { "scatter" } else { "contig" }.to_string(),
        format_total(row.bytes),
        format!("{:.3}", row.gbps),
        format!("{:.1}", row.p50_us),
        format!("{:.1}", row.p99_us),
        row.ratio_vs_raw.map_or_else(|| "-".to_string(), |r| format!("{r:.2}")),
    ]);
    if row.mem.is_empty() {
        cells
    } else {
        format!("{cells}  {}", row.mem)
    }
}

const CSV_HEADER: &str =
    "backend,op,block_size,batch,threads,iters,repeat,scatter,bytes,gbps,p50_us,p99_us,ratio_vs_raw,ratio_vs_contiguous,mem";

pub fn csv_line(row: &Row) -> String {
    let optional = |v: Option<f64>| v.map_or_else(String::new, |v| format!("{v:.4}"));
    format!(
        "{},{},{},{},{},{},{},{},{},{:.4},{:.2},{:.2},{},{},{}",
        row.backend,
        row.op,
        row.block_size,
        row.batch,
        row.threads,
        row.iters,
        row.repeat,
        row.scatter,
        row.bytes,
        row.gbps,
        row.p50_us,
        row.p99_us,
        optional(row.ratio_vs_raw),
        optional(row.ratio_vs_contiguous),
        row.mem
    )
}

pub fn write_json(path: &Path, rows: &[Row]) -> Result<()> {
    let text = serde_json::to_string_pretty(rows)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// Reads rows written by `--json` here or by the peer scripts (a JSON array of rows).
pub fn read_json(path: &Path) -> Result<Vec<Row>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not a JSON array of result rows", path.display()))
}

pub fn write_csv(path: &Path, rows: &[Row]) -> Result<()> {
    let mut text = String::from(CSV_HEADER) + "\n";
    for row in rows {
        text.push_str(&csv_line(row));
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> Row {
        Row {
            backend: "tcp".into(),
            op: "write".into(),
            block_size: 1 << 20,
            batch: 1,
            threads: 2,
            window: 1,
            iters: 1024,
            repeat: 1,
            scatter: false,
            scheme: String::new(),
            mem: String::new(),
            bytes: 2 << 30,
            gbps: 3.21,
            p50_us: 310.25,
            p99_us: 1200.0,
            ratio_vs_raw: Some(0.913),
            ratio_vs_contiguous: None,
        }
    }

    #[test]
    fn table_rows_line_up_with_the_header() {
        let (head, line) = (header(false), format_row(&row()));
        assert!(head.starts_with("backend   op      block   batch"), "{head}");
        assert!(line.starts_with("tcp       write      1M       1"), "{line}");
        assert!(line.contains("2.00 GiB") && line.contains("3.210") && line.ends_with("0.91"), "{line}");
        assert_eq!(head.find("GB/s").map(|i| i + 4), line.find("3.210").map(|i| i + 5));
        let file = Row { mem: "FILE→DRAM".into(), ..row() };
        let (head, line) = (header(true), format_row(&file));
        assert!(head.ends_with("vs raw  memory") && line.ends_with("0.91  FILE→DRAM"), "{head}\n{line}");
        let column = |text: &str, cell: &str| text.find(cell).map(|at| text[..at].chars().count());
        assert_eq!(column(&head, "memory"), column(&line, "FILE"));
    }

    #[test]
    fn json_has_the_agreed_fields() {
        let value = serde_json::to_value(row()).unwrap();
        for key in ["backend", "op", "block_size", "batch", "bytes", "gbps", "p50_us", "p99_us", "ratio_vs_raw"] {
            assert!(value.get(key).is_some(), "{key}");
        }
        assert!(value.get("ratio_vs_contiguous").is_none(), "absent ratios are left out");
        assert!(value.get("mem").is_none(), "DRAM→DRAM rows are as they were");
        assert_eq!(value["block_size"], 1 << 20);
    }

    #[test]
    fn csv_matches_its_header() {
        let line = csv_line(&row());
        assert_eq!(line.split(',').count(), CSV_HEADER.split(',').count());
        assert!(line.starts_with("tcp,write,1048576,1,2,1024,1,false,2147483648,3.2100,310.25,1200.00,0.9130,"));
        assert!(csv_line(&Row { mem: "VRAM→FILE".into(), ..row() }).ends_with(",VRAM→FILE"));
    }

    #[test]
    fn ratios_need_a_positive_base() {
        assert_eq!(ratio(1.0, 2.0), Some(0.5));
        assert_eq!(ratio(1.0, 0.0), None);
    }
}
