//! Which engines hold which KV blocks, per model: fed by KV events (exact) or by routing
//! decisions (approximate, with a time to live), queried for the longest cached prefix of a
//! request on every engine.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use pd_protocols::kv_events::KvEvent;

/// Where a block lives on an engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    Gpu,
    Cpu,
    Other,
}

impl Tier {
    /// From an event's `medium` (vLLM says "GPU" even on CPU builds; absent means GPU).
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium.map(str::to_ascii_uppercase).as_deref() {
            None | Some("GPU") => Tier::Gpu,
            Some("CPU") => Tier::Cpu,
            Some(_) => Tier::Other,
        }
    }
}

/// A holder of a block: exact (from events) or approximate until `expires`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    engine: usize,
    tier: Tier,
    expires: Option<Instant>,
}

/// The index of one model's blocks. Engines are small integer ids the caller assigns.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    blocks: HashMap<u64, Vec<Holder>>,
    by_engine: HashMap<usize, HashSet<u64>>,
}

impl PrefixIndex {
    /// Applies one engine's event. Unknown event kinds are ignored.
    pub fn apply(&mut self, engine: usize, event: &KvEvent) {
        match event {
            KvEvent::BlockStored { block_hashes, medium, .. } => {
                let tier = Tier::from_medium(medium.as_deref());
                for hash in block_hashes {
                    self.insert(engine, hash.as_u64(), tier, None);
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for hash in block_hashes {
                    self.remove(engine, hash.as_u64());
                }
            }
            KvEvent::AllBlocksCleared => self.remove_engine(engine),
            KvEvent::Other { .. } => {}
        }
    }

    /// Records blocks an engine probably holds (a routing decision, or a speculative entry
    /// right after one), until `expires`. An event for the same block makes it exact.
    pub fn insert_approximate(&mut self, engine: usize, hashes: &[u64], expires: Instant) {
        for &hash in hashes {
            self.insert(engine, hash, Tier::Gpu, Some(expires));
        }
    }

    fn insert(&mut self, engine: usize, hash: u64, tier: Tier, expires: Option<Instant>) {
        let holders = self.blocks.entry(hash).or_default();
        match holders.iter_mut().find(|h| h.engine == engine) {
            // An exact entry is never downgraded to an approximate one.
            Some(existing) if expires.is_some() && existing.expires.is_none() => {}
            Some(existing) => *existing = Holder { engine, tier, expires },
            None => holders.push(Holder { engine, tier, expires }),
        }
        self.by_engine.entry(engine).or_default().insert(hash);
    }

    fn remove(&mut self, engine: usize, hash: u64) {
        if let Some(holders) = self.blocks.get_mut(&hash) {
            holders.retain(|h| h.engine != engine);
            if holders.is_empty() {
                self.blocks.remove(&hash);
            }
        }
        if let Some(hashes) = self.by_engine.get_mut(&engine) {
            hashes.remove(&hash);
        }
    }

    /// Drops every entry of an engine (it died, restarted, or cleared its cache).
    pub fn remove_engine(&mut self, engine: usize) {
        for hash in self.by_engine.remove(&engine).unwrap_or_default() {
            if let Some(holders) = self.blocks.get_mut(&hash) {
                holders.retain(|h| h.engine != engine);
                if holders.is_empty() {
                    self.blocks.remove(&hash);
                }
            }
        }
    }

    /// Drops approximate entries that expired by `now`.
    pub fn expire(&mut self, now: Instant) {
        let mut emptied = Vec::new();
        for (hash, holders) in &mut self.blocks {
            holders.retain(|h| {
                let keep = h.expires.is_none_or(|at| at > now);
                if !keep {
                    if let Some(set) = self.by_engine.get_mut(&h.engine) {
                        set.remove(hash);
                    }
                }
                keep
            });
            if holders.is_empty() {
                emptied.push(*hash);
            }
        }
        for hash in emptied {
            self.blocks.remove(&hash);
        }
    }

    /// For each engine holding the first block, how many leading blocks of `hashes` it holds
    /// consecutively (entries expired by `now` do not count).
    pub fn overlaps(&self, hashes: &[u64], now: Instant) -> HashMap<usize, usize> {
        let live = |h: &&Holder| h.expires.is_none_or(|at| at > now);
        let mut matched: HashMap<usize, usize> = HashMap::new();
        let Some(first) = hashes.first() else { return matched };
        let mut active: Vec<usize> = match self.blocks.get(first) {
            Some(holders) => holders.iter().filter(live).map(|h| h.engine).collect(),
            None => return matched,
        };
        for engine in &active {
            matched.insert(*engine, 1);
        }
        for hash in &hashes[1..] {
            let Some(holders) = self.blocks.get(hash) else { break };
            active.retain(|engine| holders.iter().filter(live).any(|h| h.engine == *engine));
            if active.is_empty() {
                break;
            }
            for engine in &active {
                *matched.get_mut(engine).expect("active engines are matched") += 1;
            }
        }
        matched
    }

    /// Blocks indexed for an engine.
    pub fn engine_blocks(&self, engine: usize) -> usize {
        self.by_engine.get(&engine).map_or(0, HashSet::len)
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use pd_protocols::kv_events::BlockHash;

    use super::*;

    fn stored(hashes: &[u64]) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: None,
            token_ids: vec![],
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
        }
    }

    #[test]
    fn longest_consecutive_prefix_per_engine() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.apply(1, &stored(&[10, 11, 12]));
        index.apply(2, &stored(&[10, 11]));
        index.apply(3, &stored(&[11, 12])); // no first block: no prefix
        index.apply(2, &stored(&[13])); // not consecutive after the gap at 12
        let overlaps = index.overlaps(&[10, 11, 12, 13], now);
        assert_eq!(overlaps.get(&1), Some(&3));
        assert_eq!(overlaps.get(&2), Some(&2));
        assert_eq!(overlaps.get(&3), None);
        assert!(index.overlaps(&[99], now).is_empty());
        assert!(index.overlaps(&[], now).is_empty());
    }

    #[test]
    fn removal_and_clearing() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.apply(1, &stored(&[10, 11]));
        index.apply(2, &stored(&[10, 11]));
        index.apply(1, &KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(11)], medium: None });
        assert_eq!(index.overlaps(&[10, 11], now).get(&1), Some(&1));
        index.apply(2, &KvEvent::AllBlocksCleared);
        assert_eq!(index.engine_blocks(2), 0);
        index.remove_engine(1);
        assert!(index.is_empty());
    }

    #[test]
    fn approximate_entries_expire_and_events_make_them_exact() {
        let now = Instant::now();
        let mut index = PrefixIndex::default();
        index.insert_approximate(1, &[10, 11], now + Duration::from_secs(2));
        index.insert_approximate(2, &[10], now + Duration::from_secs(2));
        index.apply(2, &stored(&[10]));
        let later = now + Duration::from_secs(3);
        assert_eq!(index.overlaps(&[10, 11], now).get(&1), Some(&2));
        assert_eq!(index.overlaps(&[10, 11], later).get(&1), None);
        index.expire(later);
        assert_eq!(index.engine_blocks(1), 0);
        assert_eq!(index.overlaps(&[10], later).get(&2), Some(&1));
        // A later guess never downgrades an exact entry.
        index.insert_approximate(2, &[10], now);
        assert_eq!(index.overlaps(&[10], later).get(&2), Some(&1));
    }
}
