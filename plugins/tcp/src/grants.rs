//! Revocable grants: a fresh 128-bit key that lets ONE initiator reach some byte ranges of a
//! registration until a deadline. Requests name a grant key where they would name the region's
//! key (offsets stay relative to the region), so the initiator needs nothing new.
//!
//! Revocation follows the pattern of [`crate::fence`]: frames hold a read guard on the grant's
//! state while they touch memory; `revoke` takes the write guard to flip it, so it returns only
//! after those frames end, and every later frame sees the grant revoked before any byte moves.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use xfer_core::{BackendError, LocalRegion, RefusalCode};

use crate::frame::Key;
use crate::TcpRemoteKey;

/// One grant. `live` is false once revoked.
#[derive(Debug)]
pub struct Grant {
    pub region: Arc<LocalRegion>,
    peer: String,
    /// `(offset, len)` relative to the region's base, sorted and merged (see [`merge_ranges`]).
    ranges: Vec<(u64, u64)>,
    expires: Instant,
    live: RwLock<bool>,
}

/// Why a descriptor under a grant is refused.
pub type Refusal = (RefusalCode, String);

impl Grant {
    pub fn new(region: Arc<LocalRegion>, peer: &str, ranges: Vec<(u64, u64)>, expires: Instant) -> Self {
        Grant { region, peer: peer.to_string(), ranges: merge_ranges(ranges), expires, live: RwLock::new(true) }
    }

    /// Holds the grant against revocation while a frame touches its memory; refuses when it
    /// is already revoked or expired at `now`.
    pub fn hold(&self, now: Instant) -> Result<RwLockReadGuard<'_, bool>, Refusal> {
        let live = self.live.read();
        check_live(*live, self.expires, now)?;
        Ok(live)
    }

    /// Whether `initiator` may move `len` bytes at `offset` (relative to the region).
    pub fn admits(&self, initiator: &str, offset: u64, len: u64) -> Result<(), Refusal> {
        check_range(&self.peer, &self.ranges, initiator, offset, len)
    }

    /// Revokes; waits for frames holding the grant (bounded by the connection timeout, after
    /// which their threads give up on the socket and drop the guard).
    fn revoke(&self) {
        *self.live.write() = false;
    }
}

/// Pure: a grant that is revoked (`live` false) or past its deadline admits nothing.
pub fn check_live(live: bool, expires: Instant, now: Instant) -> Result<(), Refusal> {
    if !live {
        return Err((RefusalCode::Revoked, "grant was revoked".into()));
    }
    if now >= expires {
        return Err((RefusalCode::Revoked, "grant has expired".into()));
    }
    Ok(())
}

/// Pure: sorts ranges by offset and joins those that overlap or touch, so that a descriptor
/// inside the granted bytes lies inside exactly one range, found by binary search.
pub fn merge_ranges(mut ranges: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    ranges.retain(|&(_, len)| len > 0);
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (start, len) in ranges {
        let end = start.saturating_add(len);
        match merged.last_mut() {
            Some((last_start, last_len)) if start <= last_start.saturating_add(*last_len) => {
                *last_len = end.max(last_start.saturating_add(*last_len)) - *last_start;
            }
            _ => merged.push((start, len)),
        }
    }
    merged
}

/// Pure: the granted peer, and a descriptor inside one granted range. `ranges` are sorted and
/// merged ([`merge_ranges`]): a KV-shaped request checks thousands of descriptors against
/// thousands of ranges, so the containing range is found by binary search.
pub fn check_range(peer: &str, ranges: &[(u64, u64)], initiator: &str, offset: u64, len: u64) -> Result<(), Refusal> {
    if peer != initiator {
        // Told like an unknown key: a stranger learns nothing about the grant.
        return Err((RefusalCode::UnknownKey, "key is not granted to this initiator".into()));
    }
    let candidate = ranges.partition_point(|&(start, _)| start <= offset).checked_sub(1).map(|i| ranges[i]);
    let inside = offset
        .checked_add(len)
        .zip(candidate)
        .is_some_and(|(end, (start, n))| offset >= start && end <= start.saturating_add(n));
    if !inside {
        return Err((RefusalCode::OutOfBounds, format!("offset {offset} + {len} bytes is outside the grant")));
    }
    Ok(())
}

/// How long a revoked or expired grant is still remembered, so late requests under it hear
/// `Revoked` rather than `UnknownKey`.
const REMEMBER_AFTER_EXPIRY: Duration = Duration::from_secs(60);

/// The target's grant key → grant map.
#[derive(Debug, Default)]
pub struct GrantTable {
    map: Mutex<HashMap<Key, Arc<Grant>>>,
}

impl GrantTable {
    pub fn insert(&self, key: Key, grant: Grant) {
        self.map.lock().insert(key, Arc::new(grant));
    }

    pub fn get(&self, key: &Key) -> Option<Arc<Grant>> {
        self.map.lock().get(key).cloned()
    }

    /// Revokes the grant and waits until no frame under it touches memory. It stays known
    /// (refusing with `Revoked`) until [`GrantTable::sweep`] forgets it.
    pub fn revoke(&self, key: &Key) {
        let grant = self.get(key);
        if let Some(grant) = grant {
            grant.revoke();
        }
    }

    /// Revokes every grant on a region (it is being deregistered).
    pub fn revoke_region(&self, region_id: u64) {
        let gone: Vec<Arc<Grant>> = {
            let mut map = self.map.lock();
            let keys: Vec<Key> = map.iter().filter(|(_, g)| g.region.id() == region_id).map(|(k, _)| *k).collect();
            keys.iter().filter_map(|k| map.remove(k)).collect()
        };
        gone.iter().for_each(|grant| grant.revoke());
    }

    /// Issues a grant to `peer` over `ranges` (absolute addresses inside `region`) until
    /// `expires`; returns the public key that names it (a [`TcpRemoteKey`], as a region's).
    pub fn issue(
        &self,
        region: &Arc<LocalRegion>,
        peer: &str,
        ranges: &[(u64, u64)],
        expires: Instant,
    ) -> Result<Vec<u8>, BackendError> {
        let desc = region.desc();
        let mut offsets = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            let offset = addr
                .checked_sub(desc.addr)
                .filter(|off| off.checked_add(len).is_some_and(|end| end <= desc.len))
                .ok_or_else(|| BackendError::InvalidParam {
                    name: "grant".into(),
                    reason: format!("{addr:#x}+{len} is outside its registration"),
                })?;
            offsets.push((offset, len));
        }
        self.sweep(Instant::now());
        let key = crate::keys::random_key()?;
        self.insert(key, Grant::new(Arc::clone(region), peer, offsets, expires));
        Ok(TcpRemoteKey { key, base: desc.addr, len: desc.len }.encode())
    }

    /// Revokes the grant a public key from [`GrantTable::issue`] names (see
    /// [`GrantTable::revoke`]); a key that does not decode names none.
    pub fn revoke_public(&self, public: &[u8]) {
        if let Ok(grant) = TcpRemoteKey::decode(public) {
            self.revoke(&grant.key);
        }
    }

    /// Forgets grants expired a while ago (they refuse anyway; this bounds the table).
    pub fn sweep(&self, now: Instant) {
        self.map.lock().retain(|_, grant| now < grant.expires + REMEMBER_AFTER_EXPIRY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_until_revoked_or_expired() {
        let t0 = Instant::now();
        let expires = t0 + Duration::from_millis(100);
        assert!(check_live(true, expires, t0).is_ok());
        assert_eq!(check_live(true, expires, expires).unwrap_err().0, RefusalCode::Revoked);
        assert_eq!(check_live(true, expires, t0 + Duration::from_secs(1)).unwrap_err().0, RefusalCode::Revoked);
        assert_eq!(check_live(false, expires, t0).unwrap_err().0, RefusalCode::Revoked);
    }

    #[test]
    fn merged_ranges_answer_like_a_scan_of_the_raw_ranges() {
        assert_eq!(merge_ranges(vec![(100, 10), (0, 50), (50, 10), (105, 20), (300, 0)]), vec![(0, 60), (100, 25)]);
        assert_eq!(merge_ranges(vec![(u64::MAX - 1, 5), (u64::MAX - 3, 2)]), vec![(u64::MAX - 3, 3)]);
        // Scattered, adjacent and overlapping blocks: binary search over the merged ranges
        // admits a descriptor exactly when it lies inside the union of the raw ranges.
        let raw: Vec<(u64, u64)> = (0..64u64).map(|i| ((i * 37) % 50 * 16, 16 + (i % 3) * 8)).collect();
        let merged = merge_ranges(raw.clone());
        let covered = |b: u64| raw.iter().any(|&(s, n)| b >= s && b < s + n);
        for offset in 0..900u64 {
            for len in [1u64, 7, 16, 40] {
                let expected = (offset..offset + len).all(covered);
                let got = check_range("d", &merged, "d", offset, len).is_ok();
                assert_eq!(got, expected, "offset {offset} len {len}");
            }
        }
    }

    #[test]
    fn only_the_peer_inside_the_ranges() {
        let ranges = [(4096, 4096), (16384, 100)];
        assert!(check_range("decode", &ranges, "decode", 4096, 4096).is_ok());
        assert!(check_range("decode", &ranges, "decode", 16390, 10).is_ok());
        assert_eq!(check_range("decode", &ranges, "decode", 4095, 2).unwrap_err().0, RefusalCode::OutOfBounds);
        assert_eq!(check_range("decode", &ranges, "decode", 8000, 200).unwrap_err().0, RefusalCode::OutOfBounds);
        assert_eq!(check_range("decode", &ranges, "decode", u64::MAX, 2).unwrap_err().0, RefusalCode::OutOfBounds);
        assert_eq!(check_range("decode", &ranges, "other", 4096, 10).unwrap_err().0, RefusalCode::UnknownKey);
    }
}
