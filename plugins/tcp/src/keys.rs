//! Remote keys: 128 random bits per registration, published with the region's bounds.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use xfer_core::{BackendError, LocalRegion};

use crate::frame::{Key, KEY_LEN};

/// Public key bytes: key | region base address u64 | region length u64.
pub const PUBLIC_KEY_LEN: usize = KEY_LEN + 16;

pub fn random_key() -> Result<Key, BackendError> {
    let mut key = [0u8; KEY_LEN];
    getrandom::fill(&mut key).map_err(|e| BackendError::Io(std::io::Error::other(e.to_string())))?;
    Ok(key)
}

/// A random 64-bit value (session ids).
pub fn random_u64() -> u64 {
    let mut bytes = [0u8; 8];
    // The OS generator failing is not recoverable; a fixed fallback would only weaken fencing
    // between two restarts of one initiator, so derive one from the clock instead.
    if getrandom::fill(&mut bytes).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        return now.as_nanos() as u64;
    }
    u64::from_le_bytes(bytes)
}

/// A peer's region as the initiator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpRemoteKey {
    pub key: Key,
    pub base: u64,
    pub len: u64,
}

impl TcpRemoteKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(PUBLIC_KEY_LEN);
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.base.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, BackendError> {
        if bytes.len() != PUBLIC_KEY_LEN {
            return Err(BackendError::InvalidMetadata(format!("tcp key of {} bytes", bytes.len())));
        }
        let mut key = [0u8; KEY_LEN];
        key.copy_from_slice(&bytes[..KEY_LEN]);
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        Ok(TcpRemoteKey { key, base: word(KEY_LEN), len: word(KEY_LEN + 8) })
    }
}

/// The target's key → region map. Lookups read an atomically swapped snapshot (no lock on
/// the data path); registration and deregistration copy it under a writer lock.
#[derive(Debug, Default)]
pub struct KeyTable {
    map: ArcSwap<HashMap<Key, Arc<LocalRegion>>>,
    by_region: Mutex<HashMap<u64, Key>>,
}

impl KeyTable {
    /// Registers `region` under a fresh key and returns its public key (what a backend's
    /// `register` hands to the agent's metadata).
    pub fn publish(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        let key = self.insert(region)?;
        let desc = region.desc();
        Ok(TcpRemoteKey { key, base: desc.addr, len: desc.len }.encode())
    }

    pub fn insert(&self, region: &Arc<LocalRegion>) -> Result<Key, BackendError> {
        let mut by_region = self.by_region.lock();
        let key = random_key()?;
        let mut map = self.map.load().as_ref().clone();
        map.insert(key, Arc::clone(region));
        self.map.store(Arc::new(map));
        by_region.insert(region.id(), key);
        Ok(key)
    }

    pub fn remove(&self, region_id: u64) {
        let mut by_region = self.by_region.lock();
        if let Some(key) = by_region.remove(&region_id) {
            let mut map = self.map.load().as_ref().clone();
            map.remove(&key);
            self.map.store(Arc::new(map));
        }
    }

    pub fn get(&self, key: &Key) -> Option<Arc<LocalRegion>> {
        self.map.load().get(key).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_keys_round_trip() {
        let key = TcpRemoteKey { key: random_key().unwrap(), base: 0x7f00_0000_1000, len: 1 << 30 };
        assert_eq!(TcpRemoteKey::decode(&key.encode()).unwrap(), key);
        assert!(TcpRemoteKey::decode(&[0u8; 5]).is_err());
        assert_ne!(random_key().unwrap(), random_key().unwrap());
    }
}
