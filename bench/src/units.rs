//! Byte sizes on the command line and in tables, throughput math, iteration defaults.

use std::time::Duration;

pub const KIB: u64 = 1 << 10;
pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;

/// Smallest and largest block size a run accepts.
pub const MIN_BLOCK: u64 = 4 * KIB;
pub const MAX_BLOCK: u64 = 64 * MIB;

/// Why a size on the command line was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("{0:?} is not a size (expected e.g. 4096, 64K, 1M)")]
    NotASize(String),
    #[error("{text:?}: unknown size suffix {suffix:?} (use K, M or G)")]
    UnknownSuffix { text: String, suffix: String },
    #[error("{0:?} is too large")]
    TooLarge(String),
    #[error("block size {text} ({bytes} bytes) is outside {min}..{max}")]
    BlockOutOfRange { text: String, bytes: u64, min: String, max: String },
}

/// Parses `4096`, `64K`, `1M`, `2G` (binary multiples; `KiB`/`KB`/`MiB`/... also accepted).
pub fn parse_bytes(text: &str) -> Result<u64, SizeError> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, suffix) = text.split_at(digits);
    if number.is_empty() {
        return Err(SizeError::NotASize(text.into()));
    }
    let unit = match suffix.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => KIB,
        "M" | "MB" | "MIB" => MIB,
        "G" | "GB" | "GIB" => GIB,
        other => return Err(SizeError::UnknownSuffix { text: text.into(), suffix: other.into() }),
    };
    // Only digits remain, so the parse fails on overflow alone.
    let number: u64 = number.parse().map_err(|_| SizeError::TooLarge(text.into()))?;
    number.checked_mul(unit).ok_or_else(|| SizeError::TooLarge(text.into()))
}

/// Parses a block size and checks it lies in `4K ..= 64M`.
pub fn parse_block_size(text: &str) -> Result<u64, SizeError> {
    let bytes = parse_bytes(text)?;
    if !(MIN_BLOCK..=MAX_BLOCK).contains(&bytes) {
        return Err(SizeError::BlockOutOfRange {
            text: text.into(),
            bytes,
            min: format_size(MIN_BLOCK),
            max: format_size(MAX_BLOCK),
        });
    }
    Ok(bytes)
}

/// `65536` → `64K`, `16777216` → `16M`; sizes that are not whole multiples stay in bytes.
pub fn format_size(bytes: u64) -> String {
    match bytes {
        0 => "0".into(),
        b if b % GIB == 0 => format!("{}G", b / GIB),
        b if b % MIB == 0 => format!("{}M", b / MIB),
        b if b % KIB == 0 => format!("{}K", b / KIB),
        b => b.to_string(),
    }
}

/// A human total: `512.0 MiB`, `1.00 GiB`.
pub fn format_total(bytes: u64) -> String {
    if bytes >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    } else if bytes >= MIB {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    } else {
        format!("{:.1} KiB", bytes as f64 / KIB as f64)
    }
}

/// Decimal gigabytes per second (1e9 bytes/s).
pub fn gbps(bytes: u64, wall: Duration) -> f64 {
    let secs = wall.as_secs_f64();
    if secs <= 0.0 {
        return 0.0;
    }
    bytes as f64 / secs / 1e9
}

/// How much data one block size should move when `--iters` is not given.
pub const DEFAULT_TOTAL: u64 = GIB;
const MIN_ITERS: u64 = 10;
const MAX_ITERS: u64 = 100_000;

/// Requests per thread so that all threads together move about [`DEFAULT_TOTAL`].
pub fn default_iters(request_bytes: u64, threads: u64) -> u64 {
    let per_round = request_bytes.saturating_mul(threads).max(1);
    DEFAULT_TOTAL.div_ceil(per_round).clamp(MIN_ITERS, MAX_ITERS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64K"), Ok(64 * KIB));
        assert_eq!(parse_bytes("64k"), Ok(64 * KIB));
        assert_eq!(parse_bytes("1M"), Ok(MIB));
        assert_eq!(parse_bytes("16MiB"), Ok(16 * MIB));
        assert_eq!(parse_bytes(" 2G "), Ok(2 * GIB));
        assert_eq!(parse_bytes(""), Err(SizeError::NotASize("".into())));
        assert_eq!(parse_bytes("K"), Err(SizeError::NotASize("K".into())));
        assert!(matches!(parse_bytes("1T"), Err(SizeError::UnknownSuffix { .. })));
        assert!(matches!(parse_bytes("1.5M"), Err(SizeError::UnknownSuffix { .. })));
        assert!(matches!(parse_bytes("99999999999999999999G"), Err(SizeError::TooLarge(_))));
        assert!(matches!(parse_bytes("17179869184G"), Err(SizeError::TooLarge(_))));
    }

    #[test]
    fn block_sizes_are_range_checked() {
        assert_eq!(parse_block_size("4K"), Ok(4096));
        assert_eq!(parse_block_size("64M"), Ok(64 * MIB));
        assert_eq!(parse_block_size("32M"), Ok(32 * MIB));
        let err = parse_block_size("2K").unwrap_err().to_string();
        assert!(err.contains("outside 4K..64M"), "{err}");
        assert!(parse_block_size("128M").is_err());
        assert!(parse_block_size("4095").is_err());
    }

    #[test]
    fn formats_sizes() {
        assert_eq!(format_size(65536), "64K");
        assert_eq!(format_size(16 * MIB), "16M");
        assert_eq!(format_size(GIB), "1G");
        assert_eq!(format_size(5000), "5000");
        assert_eq!(format_total(GIB), "1.00 GiB");
        assert_eq!(format_total(512 * MIB), "512.0 MiB");
        assert_eq!(format_total(8 * KIB), "8.0 KiB");
    }

    #[test]
    fn throughput_is_decimal() {
        assert_eq!(gbps(2_000_000_000, Duration::from_secs(1)), 2.0);
        assert_eq!(gbps(1_000_000_000, Duration::from_millis(500)), 2.0);
        assert_eq!(gbps(1, Duration::ZERO), 0.0);
    }

    #[test]
    fn default_iterations_move_about_a_gibibyte() {
        assert_eq!(default_iters(MIB, 1), 1024);
        assert_eq!(default_iters(16 * MIB, 1), 64);
        assert_eq!(default_iters(16 * MIB, 4), 16);
        assert_eq!(default_iters(64 * KIB, 1), 16384);
        assert_eq!(default_iters(4 * KIB, 1), 100_000);
        assert_eq!(default_iters(64 * MIB, 64), 10);
    }
}
