//! Request ids and SGLang bootstrap rooms: a random per-process seed run through bijections of
//! a counter, so values never repeat within a process and look random across processes.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

const MASK63: u64 = (1 << 63) - 1;
/// Odd, so `counter × STEP` is a bijection modulo 2^63.
const STEP: u64 = 0x5851_F42D_4C95_7F2D | 1;

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    if getrandom::fill(&mut b).is_err() {
        // No entropy source: the clock and pid still separate processes well enough.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return (t.as_nanos() as u64) ^ (u64::from(std::process::id()) << 32);
    }
    u64::from_le_bytes(b)
}

/// splitmix64's finaliser: a bijection of u64.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[derive(Debug)]
pub struct Ids {
    seed: u64,
    prefix: u64,
    next_id: AtomicU64,
    room_base: u64,
    next_room: AtomicU64,
    next_jitter: AtomicU64,
}

impl Default for Ids {
    fn default() -> Self {
        Ids::with_seed(random_u64(), random_u64())
    }
}

impl Ids {
    pub fn with_seed(seed: u64, room_base: u64) -> Ids {
        Ids {
            seed,
            prefix: mix(seed ^ 0xA5A5_A5A5_A5A5_A5A5),
            next_id: AtomicU64::new(0),
            room_base,
            next_room: AtomicU64::new(0),
            next_jitter: AtomicU64::new(0),
        }
    }

    /// A fresh request id: 32 hex digits.
    pub fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Relaxed);
        format!("{:016x}{:016x}", self.prefix, mix(self.seed.wrapping_add(n)))
    }

    /// A number in [0, 1) for jitter (not for anything that must be unpredictable).
    pub fn jitter(&self) -> f64 {
        let n = self.next_jitter.fetch_add(1, Relaxed);
        (mix(self.room_base ^ n.wrapping_mul(STEP)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A bootstrap room in [0, 2^63−1], distinct from every other room this process handed out
    /// (for 2^63 requests).
    pub fn room(&self) -> i64 {
        let n = self.next_room.fetch_add(1, Relaxed);
        (self.room_base.wrapping_add(n.wrapping_mul(STEP)) & MASK63) as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn distinct_and_in_range() {
        let ids = Ids::default();
        let mut seen = HashSet::new();
        let mut rooms = HashSet::new();
        for _ in 0..100_000 {
            let id = ids.request_id();
            assert_eq!(id.len(), 32);
            assert!(seen.insert(id));
            let r = ids.room();
            assert!(r >= 0);
            assert!(rooms.insert(r));
        }
        // The room sequence wraps modulo 2^63 without repeating: check around the wrap.
        let near = Ids::with_seed(1, MASK63 - 2);
        let a: Vec<i64> = (0..4).map(|_| near.room()).collect();
        assert!(a.iter().all(|&r| r >= 0) && a.iter().collect::<HashSet<_>>().len() == 4, "{a:?}");
        assert_ne!(Ids::default().request_id(), Ids::default().request_id());
        let j: Vec<f64> = (0..1000).map(|_| ids.jitter()).collect();
        assert!(j.iter().all(|x| (0.0..1.0).contains(x)));
        assert!(j.iter().sum::<f64>() / 1000.0 > 0.4 && j.iter().sum::<f64>() / 1000.0 < 0.6);
    }
}
