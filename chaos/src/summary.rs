//! The figures of a scenario and the summary table, as pure code.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use crate::load::Record;

/// How a scenario ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    Pass,
    /// The bars it missed.
    Fail(Vec<String>),
    /// It could not run here, and why.
    Skipped(String),
}

/// One row of the summary.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub scenario: String,
    pub requests: usize,
    /// Failed requests by kind (`connect`, `timeout`, `http_503`, …).
    pub errors: BTreeMap<String, usize>,
    /// The longest any request took.
    pub max_end: Duration,
    /// Blocks still held on the surviving engines once the scenario's bound passed.
    pub leaked_blocks: u64,
    /// The scenario's detection figure (death seen, view rebuilt, blocks freed), if it has one.
    pub detection: Option<Duration>,
    /// KV bytes pulled (and verified) during the scenario.
    pub kv_bytes: u64,
    /// What the scenario really did where that can differ by machine (scenario 6's impairment).
    pub note: Option<String>,
    pub verdict: Verdict,
}

impl Row {
    /// A row for these requests; the verdict comes from [`Bars`].
    pub fn new(scenario: &str, records: &[Record]) -> Row {
        Row {
            scenario: scenario.to_string(),
            requests: records.len(),
            errors: errors_by_kind(records),
            max_end: records.iter().map(|r| r.end - r.start).max().unwrap_or_default(),
            leaked_blocks: 0,
            detection: None,
            kv_bytes: 0,
            note: None,
            verdict: Verdict::Pass,
        }
    }

    pub fn skipped(scenario: &str, why: String) -> Row {
        Row { verdict: Verdict::Skipped(why), ..Row::new(scenario, &[]) }
    }

    pub fn failed_requests(&self) -> usize {
        self.errors.values().sum()
    }
}

pub fn errors_by_kind(records: &[Record]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for e in records.iter().filter_map(|r| r.error.as_ref()) {
        *out.entry(e.to_string()).or_default() += 1;
    }
    out
}

/// The bars a scenario checks; each miss is written down in words.
#[derive(Debug, Default)]
pub struct Bars {
    missed: Vec<String>,
}

impl Bars {
    pub fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.missed.push(what());
        }
    }

    pub fn verdict(self) -> Verdict {
        if self.missed.is_empty() {
            Verdict::Pass
        } else {
            Verdict::Fail(self.missed)
        }
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

/// The summary table (Markdown), then one line per missed bar or skip reason.
pub fn render(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | requests | errors by kind | max end time | leaked blocks | detection | KV bytes | result |\n|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let errors = if r.errors.is_empty() {
            "0".to_string()
        } else {
            r.errors.iter().map(|(k, n)| format!("{k}: {n}")).collect::<Vec<_>>().join(", ")
        };
        let result = match &r.verdict {
            Verdict::Pass => "pass",
            Verdict::Fail(_) => "FAIL",
            Verdict::Skipped(_) => "SKIPPED",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.scenario,
            r.requests,
            errors,
            secs(r.max_end),
            r.leaked_blocks,
            r.detection.map_or("-".to_string(), secs),
            r.kv_bytes,
            result
        );
    }
    for r in rows {
        if let Some(note) = &r.note {
            let _ = writeln!(out, "NOTE {}: {note}", r.scenario);
        }
        match &r.verdict {
            Verdict::Fail(missed) => {
                for m in missed {
                    let _ = writeln!(out, "FAIL {}: {m}", r.scenario);
                }
            }
            Verdict::Skipped(why) => {
                let _ = writeln!(out, "SKIPPED {}: {why}", r.scenario);
            }
            Verdict::Pass => {}
        }
    }
    out
}

/// Whether every scenario passed; a skipped one counts as passed only when `allow_skips`.
pub fn all_passed(rows: &[Row], allow_skips: bool) -> bool {
    rows.iter().all(|r| match r.verdict {
        Verdict::Pass => true,
        Verdict::Skipped(_) => allow_skips,
        Verdict::Fail(_) => false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdbench::client::ErrorKind;

    fn rec(start_ms: u64, end_ms: u64, error: Option<ErrorKind>) -> Record {
        Record { start: Duration::from_millis(start_ms), end: Duration::from_millis(end_ms), error }
    }

    #[test]
    fn a_row_counts_errors_by_kind_and_the_longest_request() {
        let records = [
            rec(0, 100, None),
            rec(50, 2050, Some(ErrorKind::Status(503))),
            rec(60, 90, Some(ErrorKind::Status(503))),
            rec(70, 400, Some(ErrorKind::Timeout)),
        ];
        let row = Row::new("1 kill prefill", &records);
        assert_eq!(row.requests, 4);
        assert_eq!(row.failed_requests(), 3);
        assert_eq!(row.errors, BTreeMap::from([("http_503".into(), 2), ("timeout".into(), 1)]));
        assert_eq!(row.max_end, Duration::from_secs(2));
        assert_eq!(Row::new("empty", &[]).max_end, Duration::ZERO);
    }

    #[test]
    fn bars_collect_every_miss() {
        let mut bars = Bars::default();
        bars.check(true, || "never written".into());
        assert_eq!(std::mem::take(&mut bars).verdict(), Verdict::Pass);
        bars.check(false, || "a".into());
        bars.check(false, || "b".into());
        assert_eq!(bars.verdict(), Verdict::Fail(vec!["a".into(), "b".into()]));
    }

    #[test]
    fn the_table_has_a_line_per_row_and_names_misses_and_skips() {
        let mut pass = Row::new("1 kill prefill", &[rec(0, 1500, None)]);
        pass.detection = Some(Duration::from_millis(1234));
        pass.kv_bytes = 4096;
        let mut fail = Row::new("2 kill decode", &[rec(0, 10, Some(ErrorKind::Connect))]);
        fail.leaked_blocks = 3;
        fail.verdict = Verdict::Fail(vec!["3 blocks still held".into()]);
        let skip = Row::skipped("6 lossy link", "no netem".into());
        let mut noted = Row::new("6 lossy link", &[]);
        noted.note = Some("nft 2 % loss + tbf 200 Mbit".into());
        let text = render(&[pass.clone(), fail.clone(), skip.clone(), noted]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[2], "| 1 kill prefill | 1 | 0 | 1.50 s | 0 | 1.23 s | 4096 | pass |");
        assert_eq!(lines[3], "| 2 kill decode | 1 | connect: 1 | 0.01 s | 3 | - | 0 | FAIL |");
        assert_eq!(lines[4], "| 6 lossy link | 0 | 0 | 0.00 s | 0 | - | 0 | SKIPPED |");
        assert_eq!(lines[5], "| 6 lossy link | 0 | 0 | 0.00 s | 0 | - | 0 | pass |");
        assert_eq!(lines[6], "FAIL 2 kill decode: 3 blocks still held");
        assert_eq!(lines[7], "SKIPPED 6 lossy link: no netem");
        assert_eq!(lines[8], "NOTE 6 lossy link: nft 2 % loss + tbf 200 Mbit");
        assert!(all_passed(&[pass.clone(), skip.clone()], true));
        assert!(!all_passed(&[pass.clone(), skip], false));
        assert!(!all_passed(&[pass, fail], true));
    }
}
