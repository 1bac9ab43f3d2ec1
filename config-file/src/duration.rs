//! Durations as every daemon's flags and TOML files write them: a number and a unit, `250ms`,
//! `30s`, `1.5s`, `2m`, `1h`, `100us`. One parser, so that `--prefill-timeout 30s` and
//! `lease-ms = "3s"` read alike.
//!
//! Bare numbers were the old spelling (seconds in the sidecar, milliseconds in the coordinator's
//! `*-ms` flags); [`parse_duration_or_bare`] still takes them for one release, with a warning.

use std::time::Duration;

/// Longest duration accepted (about 115 days).
const MAX_SECS: f64 = 1e7;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("{0:?} is not a duration (write a number and a unit: 250ms, 30s, 2m)")]
    Invalid(String),
    #[error("{0:?} is out of range (0 to 1e7 s)")]
    OutOfRange(String),
}

/// The unit a bare number was written in before units were required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BareUnit {
    Seconds,
    Millis,
}

/// Parses a duration with its unit.
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let s = text.trim();
    // Longer suffixes first: "ms" before "s" and "m".
    const UNITS: [(&str, f64); 5] = [("ms", 1e-3), ("us", 1e-6), ("s", 1.0), ("m", 60.0), ("h", 3600.0)];
    let (number, scale) = UNITS
        .iter()
        .find_map(|&(unit, scale)| s.strip_suffix(unit).map(|n| (n, scale)))
        .ok_or_else(|| DurationError::Invalid(s.to_string()))?;
    let value: f64 = number.trim().parse().map_err(|_| DurationError::Invalid(s.to_string()))?;
    seconds(value * scale, s)
}

/// [`parse_duration`], or a bare number in `bare` units (the old spelling), with a warning on
/// stderr: flags are read before logging starts.
pub fn parse_duration_or_bare(text: &str, bare: BareUnit) -> Result<Duration, DurationError> {
    let s = text.trim();
    let Ok(value) = s.parse::<f64>() else { return parse_duration(s) };
    let (scale, unit) = match bare {
        BareUnit::Seconds => (1.0, "s"),
        BareUnit::Millis => (1e-3, "ms"),
    };
    warn_unitless(s, unit);
    seconds(value * scale, s)
}

/// A flag whose old spelling was bare seconds (`--timeout-secs 30`), for clap's `value_parser`.
pub fn duration_or_secs(text: &str) -> Result<Duration, DurationError> {
    parse_duration_or_bare(text, BareUnit::Seconds)
}

/// A flag whose old spelling was bare milliseconds (`--delay-ms 50`), for clap's `value_parser`.
pub fn duration_or_millis(text: &str) -> Result<Duration, DurationError> {
    parse_duration_or_bare(text, BareUnit::Millis)
}

/// The warning for an old, unitless duration (`unit` is what it means): on stderr, because
/// flags are read before logging starts.
pub fn warn_unitless(text: &str, unit: &str) {
    let text = text.trim();
    eprintln!("warning: the duration {text:?} has no unit; write \"{text}{unit}\" (bare numbers will be refused)");
}

fn seconds(secs: f64, text: &str) -> Result<Duration, DurationError> {
    if !secs.is_finite() || !(0.0..=MAX_SECS).contains(&secs) {
        return Err(DurationError::OutOfRange(text.to_string()));
    }
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        let cases = [
            ("250ms", 250_000),
            ("30s", 30_000_000),
            ("1.5s", 1_500_000),
            ("2m", 120_000_000),
            ("1h", 3_600_000_000),
            ("100us", 100),
            (" 20ms ", 20_000),
            ("0s", 0),
        ];
        for (text, micros) in cases {
            assert_eq!(parse_duration(text), Ok(Duration::from_micros(micros)), "{text}");
        }
        for bad in ["", "s", "ms", "2", "x2s", "2 parsecs", "2d"] {
            assert_eq!(parse_duration(bad), Err(DurationError::Invalid(bad.trim().to_string())), "{bad}");
        }
        for far in ["-1s", "1e8s", "NaNs", "infs"] {
            assert!(parse_duration(far).is_err(), "{far}");
        }
    }

    #[test]
    fn bare_numbers_keep_their_old_unit() {
        assert_eq!(parse_duration_or_bare("2", BareUnit::Seconds), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration_or_bare("3000", BareUnit::Millis), Ok(Duration::from_secs(3)));
        assert_eq!(parse_duration_or_bare("250ms", BareUnit::Seconds), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration_or_bare("3s", BareUnit::Millis), Ok(Duration::from_secs(3)));
        assert!(parse_duration_or_bare("-5", BareUnit::Millis).is_err());
        assert!(parse_duration_or_bare("soon", BareUnit::Seconds).is_err());
    }
}
