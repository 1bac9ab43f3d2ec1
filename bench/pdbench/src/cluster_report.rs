//! The parts of `pdbench cluster`'s report that explain themselves: who decided what and why,
//! where the plots went, and how to reach a cluster kept up with `--serve`.

use std::fmt::Write;
use std::path::PathBuf;

use pdbench::daemons::Decisions;
use pdbench::plot::PlotError;

/// The "decisions" section: disaggregated and local counts, each local reason in plain words.
/// `local_below` is pdbench's own threshold in direct mode; `local_rule` describes the
/// coordinator's conditional-disaggregation flags as the cluster was started with them.
pub fn decisions_section(
    disaggregated: u64,
    local: u64,
    daemons: Option<&Decisions>,
    local_below: usize,
    local_rule: &str,
) -> String {
    let mut out = String::new();
    let total = disaggregated + local;
    let share = if total > 0 { 100.0 * disaggregated as f64 / total as f64 } else { 0.0 };
    let _ = writeln!(out, "decisions    {disaggregated} disaggregated ({share:.0}%), {local} local");
    match daemons {
        Some(d) => {
            let reasons = d.local_reasons.explained();
            for (n, label, why) in &reasons {
                let _ = writeln!(out, "  local {n:>5}  {why}");
                if *label == "coordinator" {
                    let _ = writeln!(out, "               ({local_rule})");
                }
            }
            let unexplained = local as f64 - reasons.iter().map(|(n, _, _)| n).sum::<f64>();
            if unexplained > 0.0 {
                let _ = writeln!(out, "  local {unexplained:>5}  reason not counted by the sidecars");
            }
            let _ = write!(
                out,
                "coordinator  {} disaggregated, {} local-prefill pairings",
                d.coordinator_disaggregated, d.coordinator_local_prefill
            );
            let refused = d.coordinator_no_decode + d.coordinator_invalid;
            if refused > 0.0 {
                let _ = write!(
                    out,
                    "; refused {refused} ({} no live decode, {} malformed)",
                    d.coordinator_no_decode, d.coordinator_invalid
                );
            }
            out.push('\n');
        }
        None if local > 0 => {
            let _ = writeln!(
                out,
                "  local {local:>5}  prompt under --local-below {local_below} words: pdbench sent it to a decode alone"
            );
        }
        None => {}
    }
    out
}

/// The "plots" line: the files written, or why there are none.
pub fn plots_line(result: &Result<Vec<PathBuf>, PlotError>) -> String {
    match result {
        Ok(files) if !files.is_empty() => {
            let mut out = String::from("plots");
            for (i, f) in files.iter().enumerate() {
                let _ = writeln!(out, "{}{}", if i == 0 { "        " } else { "             " }, f.display());
            }
            out
        }
        Ok(_) => "plots        none written (no samples)\n".into(),
        Err(PlotError::NoFont) => "plots        skipped: no TrueType font found (Debian: apt-get install \
                                   fonts-dejavu-core, or set PDBENCH_FONT to a .ttf file)\n"
            .into(),
        Err(e) => format!("plots        skipped: {e}\n"),
    }
}

/// What `--serve` prints once the cluster is ready for other clients: the OpenAI base URL, the
/// model, and a request to paste (curl and the `openai` Python package).
pub fn serve_banner(entry: &str, other_entries: &[String], model: &str) -> String {
    let base = format!("{}/v1", entry.trim_end_matches('/'));
    let mut out = String::new();
    let _ = writeln!(out, "serving      the cluster stays up until Ctrl-C (SIGINT or SIGTERM stops every process)");
    let _ = writeln!(out, "  base URL   {base}");
    if !other_entries.is_empty() {
        let _ = writeln!(
            out,
            "             (a decode engine's sidecar; the coordinator spreads requests over every decode. \
             Other entry points: {})",
            other_entries.iter().map(|u| format!("{}/v1", u.trim_end_matches('/'))).collect::<Vec<_>>().join(", ")
        );
    }
    let _ = writeln!(out, "  model      {model}");
    let body = format!(
        r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}], "max_tokens": 16, "stream": true}}"#
    );
    let _ = writeln!(out, "  curl:");
    let _ = writeln!(out, "    curl -sN {base}/chat/completions -H 'Content-Type: application/json' -d '{body}'");
    let _ = writeln!(out, "  python (pip install openai):");
    let _ = writeln!(out, "    from openai import OpenAI");
    let _ = writeln!(out, "    client = OpenAI(base_url=\"{base}\", api_key=\"unused\")");
    let _ = writeln!(
        out,
        "    r = client.chat.completions.create(model=\"{model}\", messages=[{{\"role\": \"user\", \"content\": \"Say hello\"}}], max_tokens=16)"
    );
    let _ = writeln!(out, "    print(r.choices[0].message.content)");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdbench::daemons::LocalReasons;

    #[test]
    fn local_decisions_are_broken_down_by_reason_largest_first() {
        let d = Decisions {
            coordinator_disaggregated: 90.0,
            coordinator_local_prefill: 7.0,
            coordinator_no_decode: 1.0,
            local_reasons: LocalReasons { coordinator: 7.0, no_candidate: 2.0, ..Default::default() },
            ..Default::default()
        };
        let s = decisions_section(90, 10, Some(&d), 0, "under 256 uncached tokens");
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "decisions    90 disaggregated (90%), 10 local");
        assert!(lines[1].contains("7") && lines[1].contains("mostly cached on the decode"), "{s}");
        assert!(lines[2].contains("under 256 uncached tokens"), "{s}");
        assert!(lines[3].contains("2") && lines[3].contains("no prefill engine"), "{s}");
        assert!(lines[4].contains("1") && lines[4].contains("not counted"), "{s}");
        assert!(lines[5].contains("refused 1 (1 no live decode, 0 malformed)"), "{s}");
    }

    #[test]
    fn direct_mode_names_its_own_threshold() {
        let s = decisions_section(40, 10, None, 64, "");
        assert!(s.contains("10 local") && s.contains("--local-below 64 words"), "{s}");
        assert_eq!(decisions_section(50, 0, None, 0, "").lines().count(), 1);
    }

    #[test]
    fn plots_line_names_files_or_the_reason_they_are_missing() {
        let files = vec![PathBuf::from("/tmp/x-cdf.svg"), PathBuf::from("/tmp/x-cdf.png")];
        let s = plots_line(&Ok(files));
        assert!(s.starts_with("plots        /tmp/x-cdf.svg\n") && s.contains("/tmp/x-cdf.png"), "{s}");
        assert!(plots_line(&Err(PlotError::NoFont)).contains("fonts-dejavu-core"));
    }

    #[test]
    fn serve_banner_has_the_base_url_model_and_snippets() {
        let s = serve_banner("http://127.0.0.1:4000/", &["http://127.0.0.1:4001".into()], "sim-model");
        assert!(s.contains("  base URL   http://127.0.0.1:4000/v1\n"), "{s}");
        assert!(s.contains("http://127.0.0.1:4001/v1"), "{s}");
        assert!(s.contains("  model      sim-model\n"), "{s}");
        assert!(s.contains("curl -sN http://127.0.0.1:4000/v1/chat/completions"), "{s}");
        assert!(s.contains("OpenAI(base_url=\"http://127.0.0.1:4000/v1\""), "{s}");
        // The curl body is valid JSON.
        let body = s.split("-d '").nth(1).unwrap().split('\'').next().unwrap();
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["model"], "sim-model");
    }
}
