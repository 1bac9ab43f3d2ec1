//! A TOML settings file read as command-line flags.
//!
//! The daemons define their settings once, as clap flags; a file's `key = value` becomes
//! `--key value` placed before the real command line, so that flags given there win. `true`
//! becomes the bare flag, `false` leaves it out, an array repeats the flag once per item.
//! Underscores in keys become dashes (`block_size` and `block-size` both mean `--block-size`).
//! [`reference`] renders a daemon's flags (its settings reference) from the same definition;
//! [`report`] prints a binary's final error on one line.

use std::path::Path;

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

#[cfg(test)]
mod tests {
    use super::*;

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
