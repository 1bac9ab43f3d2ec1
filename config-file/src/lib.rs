//! A TOML settings file read as command-line flags.
//!
//! The daemons define their settings once, as clap flags; a file's `key = value` becomes
//! `--key value` placed before the real command line, so that flags given there win. `true`
//! becomes the bare flag, `false` leaves it out, an array repeats the flag once per item.
//! Underscores in keys become dashes (`block_size` and `block-size` both mean `--block-size`).
//! [`merged_args`] puts a daemon's file before its command line, with what the environment sets
//! left out of it, so that every daemon ranks its three sources alike: the command line, then
//! the environment, then the file. [`reference`] renders a daemon's flags (its settings
//! reference) from the same definition; [`report`] prints a binary's final error on one line.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

mod duration;
pub mod reference;
pub mod report;
#[cfg(feature = "signals")]
pub mod signals;

pub use duration::{
    duration_or_millis, duration_or_secs, parse_duration, parse_duration_or_bare, warn_unitless, BareUnit,
    DurationError,
};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FileError {
    #[error("cannot read config file {path}: {reason}")]
    Unreadable { path: String, reason: String },
    #[error("config file {path}: key {key}: only strings, numbers, booleans and arrays of them are allowed")]
    Value { path: String, key: String },
}

/// One flag the file sets: `--key` and its value (`None` for a flag set to `true`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileFlag {
    pub flag: String,
    pub value: Option<String>,
}

/// The flags the TOML file at `path` sets, by key (an array's items in their order).
pub fn read_flags(path: &Path) -> Result<Vec<FileFlag>, FileError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| FileError::Unreadable { path: path.display().to_string(), reason: e.to_string() })?;
    parse_flags(&text, path)
}

/// [`read_flags`] of text already read (`path` names it in errors).
pub fn parse_flags(text: &str, path: &Path) -> Result<Vec<FileFlag>, FileError> {
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| FileError::Unreadable {
        path: path.display().to_string(),
        reason: e.to_string(),
    })?;
    let scalar = |v: &toml::Value| match v {
        toml::Value::String(s) => Some(s.clone()),
        toml::Value::Integer(i) => Some(i.to_string()),
        toml::Value::Float(f) => Some(f.to_string()),
        _ => None,
    };
    let mut out = Vec::new();
    for (key, value) in table {
        let flag = format!("--{}", key.replace('_', "-"));
        let bad = || FileError::Value { path: path.display().to_string(), key: key.clone() };
        match &value {
            toml::Value::Boolean(true) => out.push(FileFlag { flag, value: None }),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                for item in items {
                    out.push(FileFlag { flag: flag.clone(), value: Some(scalar(item).ok_or_else(bad)?) });
                }
            }
            v => out.push(FileFlag { flag, value: Some(scalar(v).ok_or_else(bad)?) }),
        }
    }
    Ok(out)
}

/// `flags` as arguments, for a parser that takes a command line.
pub fn to_args(flags: impl IntoIterator<Item = FileFlag>) -> Vec<String> {
    flags.into_iter().flat_map(|f| std::iter::once(f.flag).chain(f.value)).collect()
}

/// `args` (program name first) with the flags of the TOML file that `--config` names put
/// before the rest, for `command` (the daemon's clap definition) to parse. The file is the one
/// `--config` names on the command line, else in its environment variable. A file entry is left
/// out where the flag's own environment variable is set: clap reads the environment only for
/// flags the arguments lack, so the command line wins over the environment, and the
/// environment over the file. A flag both the file and the command line give is given twice:
/// `command` must let the later one win (`args_override_self`).
pub fn merged_args(args: Vec<String>, command: &clap::Command) -> Result<Vec<String>, FileError> {
    let env_of = |long: &str| {
        command.get_arguments().find(|a| a.get_long() == Some(long)).and_then(|a| a.get_env()).map(OsString::from)
    };
    let set_in_env = |long: &str| env_of(long).and_then(std::env::var_os).is_some_and(|v| !v.is_empty());
    let path = config_arg(&args)
        .map(PathBuf::from)
        .or_else(|| env_of("config").and_then(std::env::var_os).filter(|v| !v.is_empty()).map(PathBuf::from));
    let Some(path) = path else { return Ok(args) };
    let from_file = read_flags(&path)?.into_iter().filter(|f| !set_in_env(f.flag.trim_start_matches("--")));
    let mut merged = args[..args.len().min(1)].to_vec();
    merged.extend(to_args(from_file));
    merged.extend(args.into_iter().skip(1));
    Ok(merged)
}

/// The value of `--config` on a command line (`--config FILE` or `--config=FILE`), read before
/// parsing, so that flags the file gives count as given.
fn config_arg(args: &[String]) -> Option<String> {
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if a == "--config" {
            return it.next().cloned();
        }
        if let Some(v) = a.strip_prefix("--config=") {
            return Some(v.to_string());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_wins_over_the_environment_and_the_environment_over_the_file() {
        let dir = std::env::temp_dir().join(format!("pd-config-merge-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("d.toml");
        std::fs::write(&file, "port = 1\nhost = \"file\"\nmodel = \"file\"\n").unwrap();
        // Names of this test's own, so no other test sees them; set before the definition,
        // which is when clap reads them.
        std::env::set_var("PD_MERGE_TEST_HOST", "env");
        std::env::set_var("PD_MERGE_TEST_MODEL", "env");
        let arg = |name: &'static str, env: &'static str| clap::Arg::new(name).long(name).env(env);
        let command = clap::Command::new("d")
            .args_override_self(true)
            .arg(arg("config", "PD_MERGE_TEST_CONFIG"))
            .arg(arg("port", "PD_MERGE_TEST_PORT"))
            .arg(arg("host", "PD_MERGE_TEST_HOST"))
            .arg(arg("model", "PD_MERGE_TEST_MODEL"));
        let args =
            |list: &[&str]| std::iter::once("d").chain(list.iter().copied()).map(String::from).collect::<Vec<_>>();
        let parsed = |list: &[&str]| {
            let m = command.clone().try_get_matches_from(merged_args(args(list), &command).unwrap()).unwrap();
            ["port", "host", "model"].map(|k| m.get_one::<String>(k).cloned().unwrap_or_default())
        };
        let path = file.to_str().unwrap();
        assert_eq!(parsed(&["--config", path, "--model", "flag"]), ["1", "env", "flag"]);
        assert_eq!(parsed(&[&format!("--config={path}")]), ["1", "env", "env"]);
        // The file named in the environment instead.
        std::env::set_var("PD_MERGE_TEST_CONFIG", path);
        assert_eq!(parsed(&["--port", "2"]), ["2", "env", "env"]);
        std::env::remove_var("PD_MERGE_TEST_CONFIG");
        // No file: the arguments as they are; one that cannot be read: its error.
        assert_eq!(merged_args(args(&["--port", "3"]), &command).unwrap(), args(&["--port", "3"]));
        let missing = dir.join("missing.toml");
        assert!(merged_args(args(&["--config", missing.to_str().unwrap()]), &command).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn flags(text: &str) -> Result<Vec<String>, FileError> {
        parse_flags(text, Path::new("test.toml")).map(to_args)
    }

    #[test]
    fn keys_become_flags() {
        let text = "port = 8000\nblock_size = 16\nratio = 0.5\nmodel = \"m\"\nverbose = true\nquiet = false\nprefill = [\"a:1\", \"b:2\"]\n";
        assert_eq!(
            flags(text).unwrap(),
            [
                "--block-size",
                "16",
                "--model",
                "m",
                "--port",
                "8000",
                "--prefill",
                "a:1",
                "--prefill",
                "b:2",
                "--ratio",
                "0.5",
                "--verbose"
            ]
        );
    }

    #[test]
    fn tables_dates_and_nested_arrays_are_refused_by_key() {
        for (text, bad) in [
            ("[section]\nx = 1\n", "section"),
            ("when = 1979-05-27\n", "when"),
            ("list = [[1], [2]]\n", "list"),
            ("list = [true]\n", "list"),
        ] {
            match flags(text) {
                Err(FileError::Value { key, .. }) => assert_eq!(key, bad, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
    }

    #[test]
    fn unreadable_and_malformed_files_name_the_path() {
        let missing = read_flags(Path::new("/nonexistent/pd.toml")).unwrap_err();
        assert!(missing.to_string().contains("/nonexistent/pd.toml"), "{missing}");
        let garbage = flags("port = = 1").unwrap_err();
        assert!(
            matches!(garbage, FileError::Unreadable { .. }) && garbage.to_string().contains("test.toml"),
            "{garbage}"
        );
    }
}
