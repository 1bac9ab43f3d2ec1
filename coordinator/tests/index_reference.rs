//! The prefix index against a naive reference model, over many random event sequences.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pd_coordinator::index::PrefixIndex;
use pd_protocols::kv_events::{BlockHash, KvEvent};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The obviously-correct model: a set of blocks per engine.
#[derive(Default)]
struct Reference {
    held: HashMap<usize, HashSet<u64>>,
}

impl Reference {
    fn overlaps(&self, hashes: &[u64]) -> HashMap<usize, usize> {
        self.held
            .iter()
            .map(|(&engine, set)| (engine, hashes.iter().take_while(|h| set.contains(h)).count()))
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

fn hashes(list: &[u64]) -> Vec<BlockHash> {
    list.iter().map(|&h| BlockHash::Int(h)).collect()
}

#[test]
fn matches_the_reference_model() {
    let now = Instant::now();
    for seed in 1..=40u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let (mut index, mut reference) = (PrefixIndex::default(), Reference::default());
        for _ in 0..400 {
            let engine = rng.below(6) as usize;
            let run: Vec<u64> = {
                let start = rng.below(30);
                (start..start + 1 + rng.below(8)).collect()
            };
            match rng.below(10) {
                0..=5 => {
                    let event = KvEvent::BlockStored {
                        block_hashes: hashes(&run),
                        parent_block_hash: None,
                        token_ids: vec![],
                        block_size: 16,
                        lora_id: None,
                        medium: Some(if rng.below(2) == 0 { "GPU" } else { "CPU" }.into()),
                        lora_name: None,
                    };
                    index.apply(engine, &event);
                    reference.held.entry(engine).or_default().extend(&run);
                }
                6..=8 => {
                    index.apply(engine, &KvEvent::BlockRemoved { block_hashes: hashes(&run), medium: None });
                    if let Some(set) = reference.held.get_mut(&engine) {
                        for h in &run {
                            set.remove(h);
                        }
                    }
                }
                _ => {
                    index.apply(engine, &KvEvent::AllBlocksCleared);
                    reference.held.remove(&engine);
                }
            }
            let query: Vec<u64> = {
                let start = rng.below(30);
                (start..start + rng.below(12)).collect()
            };
            assert_eq!(index.overlaps(&query, now), reference.overlaps(&query), "seed {seed}, query {query:?}");
        }
        let total: usize = reference.held.values().map(HashSet::len).sum();
        let indexed: usize = (0..6).map(|e| index.engine_blocks(e)).sum();
        assert_eq!(indexed, total, "seed {seed}");
        // Approximate entries never outlive their deadline.
        index.insert_approximate(9, &[1000, 1001], now + Duration::from_secs(1));
        assert_eq!(index.overlaps(&[1000, 1001], now).get(&9), Some(&2));
        index.expire(now + Duration::from_secs(2));
        assert_eq!(index.engine_blocks(9), 0);
    }
}
