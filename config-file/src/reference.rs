//! The settings reference of a daemon, generated from its clap definition: per help heading, a
//! Markdown table with a row per long flag (which is also the TOML key, see the crate docs), its
//! value type, default, environment variable and help text.
//!
//! `CONFIG.md` at the repository root holds one generated section per daemon between markers;
//! each daemon's tests call [`check_section`], which fails when the section no longer matches
//! the flags and rewrites it when [`UPDATE_ENV`] is set.

use std::any::TypeId;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Arg, ArgAction, Command};

/// Set to `1` to rewrite stale sections instead of failing.
pub const UPDATE_ENV: &str = "PD_UPDATE_CONFIG_DOC";
/// The command that refreshes every daemon's section.
pub const UPDATE_COMMAND: &str =
    "PD_UPDATE_CONFIG_DOC=1 cargo test --workspace --all-features --locked --test examples config_reference";

const DURATION: &str = "duration (`250ms`, `30s`, `2m`)";

#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("cannot read or write {path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path} has no section for {daemon} (between `{begin}` and `{end}`); create it with: {UPDATE_COMMAND}")]
    MissingSection { path: String, daemon: String, begin: String, end: String },
    #[error(
        "{path}: the {daemon} section is out of date with its flags (line {line}: committed {committed:?}, \
         generated {generated:?}); refresh it with: {UPDATE_COMMAND}"
    )]
    Stale { path: String, daemon: String, line: usize, committed: String, generated: String },
}

/// The Markdown section of `command`: a heading with its name and description, then a table per
/// help heading. Hidden and positional arguments and `--help`/`--version` are left out.
pub fn render(command: &Command) -> String {
    // Building fills in what clap otherwise adds at parse time (switches' `false` default).
    let mut command = command.clone();
    command.build();
    let mut out = String::new();
    let name = command.get_name();
    let _ = writeln!(out, "## {name}\n");
    if let Some(about) = command.get_about() {
        let _ = writeln!(out, "{}\n", one_line(&about.to_string()));
    }
    let args: Vec<&Arg> = command
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_positional() && a.get_long().is_some())
        .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
        .collect();
    let mut headings: Vec<Option<&str>> = Vec::new();
    for arg in &args {
        if !headings.contains(&arg.get_help_heading()) {
            headings.push(arg.get_help_heading());
        }
    }
    for heading in headings {
        if let Some(h) = heading {
            let _ = writeln!(out, "### {h}\n");
        }
        out.push_str("| flag / TOML key | value | default | environment | meaning |\n");
        out.push_str("|---|---|---|---|---|\n");
        for arg in args.iter().filter(|a| a.get_help_heading() == heading) {
            let long = arg.get_long().unwrap_or_default();
            let env = arg.get_env().map(|e| format!("`{}`", e.to_string_lossy())).unwrap_or_default();
            let _ = writeln!(
                out,
                "| `--{long}`<br>`{long}` | {} | {} | {env} | {} |",
                cell(&value_kind(arg)),
                cell(&default(arg)),
                cell(&meaning(arg)),
            );
        }
        out.push('\n');
    }
    out.truncate(out.trim_end().len());
    out.push('\n');
    out
}

fn begin_marker(daemon: &str) -> String {
    format!("<!-- BEGIN generated section: {daemon} -->")
}

fn end_marker(daemon: &str) -> String {
    format!("<!-- END generated section: {daemon} -->")
}

/// Compares `command`'s section of the page at `page` with [`render`]; with [`UPDATE_ENV`]`=1`
/// rewrites it instead (appending it when the page has none).
pub fn check_section(page: &Path, command: &Command) -> Result<(), ReferenceError> {
    let update = std::env::var(UPDATE_ENV).is_ok_and(|v| v == "1");
    let path = page.display().to_string();
    let io = |e: std::io::Error| ReferenceError::Io { path: path.clone(), reason: e.to_string() };
    let text = std::fs::read_to_string(page).map_err(io)?;
    let daemon = command.get_name().to_string();
    let (begin, end) = (begin_marker(&daemon), end_marker(&daemon));
    let generated = render(command);
    let Some((before, inner, after)) = split_section(&text, &begin, &end) else {
        if !update {
            return Err(ReferenceError::MissingSection { path, daemon, begin, end });
        }
        let text = format!("{}\n\n{begin}\n{generated}{end}\n", text.trim_end());
        return std::fs::write(page, text).map_err(io);
    };
    let committed = inner.strip_prefix('\n').unwrap_or(inner);
    if committed == generated {
        return Ok(());
    }
    if update {
        return std::fs::write(page, format!("{before}{begin}\n{generated}{end}{after}")).map_err(io);
    }
    let (line, committed, generated) = first_difference(committed, &generated);
    Err(ReferenceError::Stale { path, daemon, line, committed, generated })
}

/// `text` cut around the section: before the begin marker, between the markers, after the end
/// marker.
fn split_section<'a>(text: &'a str, begin: &str, end: &str) -> Option<(&'a str, &'a str, &'a str)> {
    let start = text.find(begin)?;
    let inner_start = start + begin.len();
    let inner_len = text[inner_start..].find(end)?;
    let inner_end = inner_start + inner_len;
    Some((&text[..start], &text[inner_start..inner_end], &text[inner_end + end.len()..]))
}

/// The first line (1-based, within the section) where the two texts differ, and both versions.
fn first_difference(committed: &str, generated: &str) -> (usize, String, String) {
    let mut a = committed.lines();
    let mut b = generated.lines();
    let mut line = 1;
    loop {
        match (a.next(), b.next()) {
            (Some(x), Some(y)) if x == y => line += 1,
            (x, y) => return (line, x.unwrap_or("").to_string(), y.unwrap_or("").to_string()),
        }
    }
}

fn value_kind(arg: &Arg) -> String {
    match arg.get_action() {
        ArgAction::SetTrue => return "switch (`true` sets it)".to_string(),
        ArgAction::SetFalse => return "switch (`true` clears it)".to_string(),
        ArgAction::Count => return "count".to_string(),
        _ => {}
    }
    let choices: Vec<String> =
        arg.get_possible_values().iter().filter(|p| !p.is_hide_set()).map(|p| format!("`{}`", p.get_name())).collect();
    let one = if !choices.is_empty() {
        format!("one of {}", choices.join(", "))
    } else if let Some(name) = explicit_value_name(arg) {
        if name.eq_ignore_ascii_case("duration") {
            DURATION.to_string()
        } else {
            name.to_ascii_lowercase()
        }
    } else {
        let parser = arg.get_value_parser();
        type_name(|t| parser.type_id() == t).to_string()
    };
    if matches!(arg.get_action(), ArgAction::Append) {
        let separated = if arg.get_value_delimiter().is_some() { ", or comma separated" } else { "" };
        format!("list of {one} (TOML array{separated})")
    } else {
        one
    }
}

/// The value name given in the definition (the derive's default is the field name in capitals).
fn explicit_value_name(arg: &Arg) -> Option<String> {
    let names = arg.get_value_names()?;
    let name = names.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(" ");
    (name != arg.get_id().as_str().to_ascii_uppercase()).then_some(name)
}

/// The value's type in words, `is` telling whether the parser yields a given type.
fn type_name(is: impl Fn(TypeId) -> bool) -> &'static str {
    if is(TypeId::of::<Duration>()) {
        DURATION
    } else if is(TypeId::of::<PathBuf>()) {
        "path"
    } else if is(TypeId::of::<SocketAddr>()) {
        "address (`host:port`)"
    } else if [
        TypeId::of::<u8>(),
        TypeId::of::<u16>(),
        TypeId::of::<u32>(),
        TypeId::of::<u64>(),
        TypeId::of::<usize>(),
        TypeId::of::<i32>(),
        TypeId::of::<i64>(),
    ]
    .into_iter()
    .any(&is)
    {
        "integer"
    } else if is(TypeId::of::<f64>()) || is(TypeId::of::<f32>()) {
        "number"
    } else if is(TypeId::of::<bool>()) {
        "boolean"
    } else {
        "string"
    }
}

fn default(arg: &Arg) -> String {
    let values = arg.get_default_values();
    if values.is_empty() {
        return if arg.is_required_set() { "required".to_string() } else { "none".to_string() };
    }
    let text: Vec<String> = values.iter().map(|v| v.to_string_lossy().into_owned()).collect();
    let text = text.join(",");
    if text.is_empty() {
        "`\"\"`".to_string()
    } else {
        format!("`{text}`")
    }
}

/// The help text, then what each choice means when the choices are documented.
fn meaning(arg: &Arg) -> String {
    let help = arg.get_long_help().or_else(|| arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
    let mut text = one_line(&help);
    let documented: Vec<String> = arg
        .get_possible_values()
        .iter()
        .filter(|p| !p.is_hide_set())
        .filter_map(|p| p.get_help().map(|h| format!("`{}`: {}", p.get_name(), one_line(&h.to_string()))))
        .collect();
    if !documented.is_empty() {
        if !text.is_empty() {
            text.push_str("<br>");
        }
        text.push_str(&documented.join("<br>"));
    }
    text
}

/// Paragraphs joined with `<br>`, lines within a paragraph with spaces.
fn one_line(text: &str) -> String {
    text.split("\n\n")
        .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join("<br>")
}

/// A table cell: `|` would end the cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, clap::ValueEnum)]
    enum Color {
        /// Like the sky.
        Blue,
        Red,
    }

    fn command() -> Command {
        Command::new("demo")
            .about("A demo daemon.")
            .arg(
                Arg::new("port")
                    .long("port")
                    .env("DEMO_PORT")
                    .default_value("80")
                    .value_parser(clap::value_parser!(u16))
                    .help("Port | to bind."),
            )
            .arg(Arg::new("verbose").long("verbose").action(ArgAction::SetTrue).help("More logs."))
            .arg(
                Arg::new("peer")
                    .long("peer")
                    .action(ArgAction::Append)
                    .value_delimiter(',')
                    .help_heading("Peers")
                    .help("A peer.\n\nRepeat for more."),
            )
            .arg(Arg::new("color").long("color").value_parser(clap::value_parser!(Color)).default_value("blue"))
            .arg(Arg::new("wait").long("wait").value_name("DURATION").default_value("1s"))
            .arg(Arg::new("topic").long("topic").default_value(""))
            .arg(Arg::new("secret").long("secret").hide(true))
            .arg(Arg::new("file").required(true))
    }

    #[test]
    fn renders_a_row_per_flag_grouped_by_heading() {
        let text = render(&command());
        let expected = "## demo\n\nA demo daemon.\n\n\
            | flag / TOML key | value | default | environment | meaning |\n|---|---|---|---|---|\n\
            | `--port`<br>`port` | integer | `80` | `DEMO_PORT` | Port \\| to bind. |\n\
            | `--verbose`<br>`verbose` | switch (`true` sets it) | `false` |  | More logs. |\n\
            | `--color`<br>`color` | one of `blue`, `red` | `blue` |  | `blue`: Like the sky |\n\
            | `--wait`<br>`wait` | duration (`250ms`, `30s`, `2m`) | `1s` |  |  |\n\
            | `--topic`<br>`topic` | string | `\"\"` |  |  |\n\n\
            ### Peers\n\n\
            | flag / TOML key | value | default | environment | meaning |\n|---|---|---|---|---|\n\
            | `--peer`<br>`peer` | list of string (TOML array, or comma separated) | none |  | A peer.<br>Repeat for more. |\n";
        assert_eq!(text, expected, "{text}");
    }

    #[test]
    fn a_stale_section_names_the_line_and_the_refresh_command() {
        let dir = std::env::temp_dir().join(format!("pd-config-reference-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let page = dir.join("CONFIG.md");
        let current =
            format!("# Intro\n\n{}\n{}{}\nafter\n", begin_marker("demo"), render(&command()), end_marker("demo"));
        std::fs::write(&page, &current).unwrap();
        check_section(&page, &command()).unwrap();
        std::fs::write(&page, current.replace("Port \\| to bind.", "Port.")).unwrap();
        let err = check_section(&page, &command()).unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, ReferenceError::Stale { line: 7, .. }), "{message}");
        assert!(message.contains(UPDATE_COMMAND), "{message}");
        std::fs::write(&page, "# Intro\n").unwrap();
        assert!(matches!(check_section(&page, &command()), Err(ReferenceError::MissingSection { .. })));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
