//! Failure injection, set at start and changed at runtime through the admin endpoint.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// The longest a hung request hangs when nobody clears the hang (every wait is bounded).
const MAX_HANG: Duration = Duration::from_secs(3600);

/// A fault setting the admin endpoint refuses.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    #[error("error_rate must be within 0..=1, got {0}")]
    ErrorRateOutOfRange(f64),
}

#[derive(Debug, Default)]
pub struct Faults {
    error_rate_bits: AtomicU64,
    delay_ms: AtomicU64,
    hang: AtomicBool,
    unhung: Notify,
    rng: AtomicU64,
}

/// The admin endpoint's view (every field optional on input).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSettings {
    pub error_rate: Option<f64>,
    pub delay_ms: Option<u64>,
    pub hang: Option<bool>,
    /// Exit the process at once, without cleanup (input only).
    #[serde(skip_serializing)]
    pub crash: Option<bool>,
}

/// What the injected faults say about one request.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Proceed,
    Fail,
}

impl Faults {
    pub fn new(error_rate: f64, delay_ms: u64) -> Self {
        let f = Faults::default();
        f.error_rate_bits.store(error_rate.to_bits(), Relaxed);
        f.delay_ms.store(delay_ms, Relaxed);
        f.rng.store(0x243F_6A88_85A3_08D3 ^ u64::from(std::process::id()), Relaxed);
        f
    }

    pub fn settings(&self) -> FaultSettings {
        FaultSettings {
            error_rate: Some(f64::from_bits(self.error_rate_bits.load(Relaxed))),
            delay_ms: Some(self.delay_ms.load(Relaxed)),
            hang: Some(self.hang.load(Relaxed)),
            crash: None,
        }
    }

    /// Applies the given settings; an out-of-range error rate is refused.
    pub fn apply(&self, s: &FaultSettings) -> Result<(), FaultError> {
        if let Some(rate) = s.error_rate {
            if !(0.0..=1.0).contains(&rate) {
                return Err(FaultError::ErrorRateOutOfRange(rate));
            }
            self.error_rate_bits.store(rate.to_bits(), Relaxed);
        }
        if let Some(ms) = s.delay_ms {
            self.delay_ms.store(ms.min(3_600_000), Relaxed);
        }
        if let Some(hang) = s.hang {
            self.hang.store(hang, Relaxed);
            if !hang {
                self.unhung.notify_waiters();
            }
        }
        Ok(())
    }

    fn uniform(&self) -> f64 {
        // splitmix64 over a shared counter: cheap, lock-free, good enough for a coin flip.
        let mut z = self.rng.fetch_add(0x9E37_79B9_7F4A_7C15, Relaxed).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Hangs while a hang is injected, sleeps the injected delay, then flips the error coin.
    pub async fn before_request(&self) -> Verdict {
        if self.hang.load(Relaxed) {
            let unhung = self.unhung.notified();
            if self.hang.load(Relaxed) {
                let _ = tokio::time::timeout(MAX_HANG, unhung).await;
            }
        }
        let delay = self.delay_ms.load(Relaxed);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        let rate = f64::from_bits(self.error_rate_bits.load(Relaxed));
        if rate > 0.0 && self.uniform() < rate {
            Verdict::Fail
        } else {
            Verdict::Proceed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn error_rate_and_settings() {
        let f = Faults::new(1.0, 0);
        assert_eq!(f.before_request().await, Verdict::Fail);
        f.apply(&FaultSettings { error_rate: Some(0.0), ..Default::default() }).unwrap();
        assert_eq!(f.before_request().await, Verdict::Proceed);
        assert!(matches!(
            f.apply(&FaultSettings { error_rate: Some(1.5), ..Default::default() }),
            Err(FaultError::ErrorRateOutOfRange(r)) if r == 1.5
        ));
        let half = Faults::new(0.5, 0);
        let mut fails = 0;
        for _ in 0..1000 {
            fails += (half.before_request().await == Verdict::Fail) as u32;
        }
        assert!((350..650).contains(&fails), "{fails}");
    }
}
