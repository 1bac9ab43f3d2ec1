//! The two event streams both indexes are fed: coordbench's workload and the Mooncake
//! conversation trace replayed onto workers with per-worker LRU caches.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::Context as _;
use pd_protocols::kv_events::{BlockHash, KvEvent};

use crate::shared::workload::{build_batches, churn_batches, Rng, Universe, REQUEST_BLOCKS};

/// Everything one comparison replays.
pub struct Stream {
    pub name: String,
    pub engines: usize,
    /// Every event in arrival order, in the batches engines publish them in (vLLM's
    /// `KVEventBatch`), with the engine that published each batch.
    pub batches: Vec<(usize, Vec<KvEvent>)>,
    /// Block hashes in stored + removed events.
    pub block_events: usize,
    /// Requests looked up once every event is applied, `REQUEST_BLOCKS` blocks each.
    pub lookups: Vec<Vec<u64>>,
    /// A line on how the stream was made, for the report.
    pub description: String,
}

/// coordbench's universe, its `BlockStored` ingestion, then `churn` conversations replaced
/// (new ones stored, old ones removed block by block).
pub fn coordbench(engines: usize, blocks: usize, churn: usize, lookups: usize, seed: u64) -> Stream {
    let mut rng = Rng(seed);
    let universe = Universe::generate(&mut rng, engines, blocks);
    let mut batches = build_batches(&universe, engines, &mut rng);
    batches.extend(churn_batches(&universe, &mut rng, churn.min(universe.conversations.len())));
    let block_events = batches.iter().map(|(_, b)| b.block_count()).sum();
    let batches = batches.into_iter().map(|(engine, batch)| (engine, batch.events)).collect();
    let mut request = Vec::with_capacity(REQUEST_BLOCKS);
    let lookups = (0..lookups)
        .map(|_| {
            universe.request(&mut rng, &mut request);
            request.clone()
        })
        .collect();
    Stream {
        name: "coordbench".into(),
        engines,
        description: format!(
            "coordbench's workload: {} distinct blocks on {engines} engines, then {} conversations churned",
            universe.distinct_blocks(),
            churn.min(universe.conversations.len())
        ),
        batches,
        block_events,
        lookups,
    }
}

impl Stream {
    /// Every event in arrival order, with the engine that published it.
    pub fn events(&self) -> impl Iterator<Item = (usize, &KvEvent)> {
        self.batches.iter().flat_map(|(engine, events)| events.iter().map(move |e| (*engine, e)))
    }
}

#[derive(serde::Deserialize)]
struct TraceRow {
    hash_ids: Vec<u64>,
}

/// splitmix64's finaliser, a bijection: the trace numbers blocks 0, 1, 2, …, engines publish
/// uniformly spread 64-bit hashes, and neither index should be judged on sequential keys.
fn spread(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One worker's cache: blocks by last use. A request touches its blocks last to first, so a
/// block is never older than the blocks after it and eviction takes a prefix's tail first (as
/// vLLM frees a request's blocks in reverse order); a stored block's parent is always held.
#[derive(Default)]
struct Lru {
    by_use: BTreeMap<u64, u64>,
    last_use: HashMap<u64, u64>,
}

impl Lru {
    fn touch(&mut self, block: u64, clock: u64) -> bool {
        let held = match self.last_use.insert(block, clock) {
            Some(old) => {
                self.by_use.remove(&old);
                true
            }
            None => false,
        };
        self.by_use.insert(clock, block);
        held
    }

    fn evict(&mut self) -> Option<u64> {
        let (_, block) = self.by_use.pop_first()?;
        self.last_use.remove(&block);
        Some(block)
    }
}

/// The Mooncake trace, `replays` times (each replay's ids moved to their own range, as new
/// sessions), requests in file order. A request goes to worker `spread(hash_ids[1]) % workers`
/// (its conversation's first own block: every request shares block 0, and a conversation's
/// turns stay on one worker); on arrival the worker stores the blocks it lacks (one
/// `BlockStored` whose parent is the last block it had) and evicts past `capacity` blocks by
/// LRU (one `BlockRemoved` per block, as vLLM publishes them), all in one batch (a vLLM engine
/// publishes one batch per scheduler step, so an arrival's events would share one at least). Lookups are the last replay's
/// requests, cut or padded to `REQUEST_BLOCKS` with blocks no one holds.
pub fn mooncake(
    path: &Path,
    workers: usize,
    capacity: usize,
    replays: usize,
    lookups: usize,
) -> anyhow::Result<Stream> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the trace {}", path.display()))?;
    let rows: Vec<TraceRow> = text
        .lines()
        .enumerate()
        .map(|(n, line)| serde_json::from_str(line).with_context(|| format!("{}:{}", path.display(), n + 1)))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(!rows.is_empty(), "the trace {} has no requests", path.display());
    let mut caches: Vec<Lru> = (0..workers).map(|_| Lru::default()).collect();
    let (mut batches, mut block_events, mut clock) = (Vec::new(), 0usize, 0u64);
    let mut requests = Vec::new();
    for replay in 0..replays.max(1) as u64 {
        for row in rows.iter().filter(|r| !r.hash_ids.is_empty()) {
            let blocks: Vec<u64> = row.hash_ids.iter().map(|&id| spread(id | replay << 40)).collect();
            let worker = (blocks[1.min(blocks.len() - 1)] % workers as u64) as usize;
            let cache = &mut caches[worker];
            // What the worker publishes for this arrival: its stores and the evictions they cause.
            let mut batch = Vec::new();
            let mut missing = Vec::new();
            for &block in blocks.iter().rev() {
                clock += 1;
                if !cache.touch(block, clock) {
                    missing.push(block);
                }
            }
            missing.reverse();
            if !missing.is_empty() {
                let parent = blocks.len().checked_sub(missing.len() + 1).map(|i| BlockHash::Int(blocks[i]));
                block_events += missing.len();
                batch.push(KvEvent::BlockStored {
                    block_hashes: missing.into_iter().map(BlockHash::Int).collect(),
                    parent_block_hash: parent,
                    token_ids: Vec::new(),
                    block_size: 512,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    cache_salt: None,
                });
            }
            while cache.last_use.len() > capacity {
                let old = cache.evict().expect("over capacity");
                block_events += 1;
                batch.push(KvEvent::BlockRemoved {
                    block_hashes: vec![BlockHash::Int(old)],
                    medium: Some("GPU".into()),
                });
            }
            if !batch.is_empty() {
                batches.push((worker, batch));
            }
            if replay + 1 == replays.max(1) as u64 {
                requests.push(blocks);
            }
        }
    }
    let mut rng = Rng(0x6d6f_6f6e);
    let lookups = requests
        .iter()
        .cycle()
        .take(lookups)
        .map(|blocks| {
            let mut request: Vec<u64> = blocks.iter().copied().take(REQUEST_BLOCKS).collect();
            while request.len() < REQUEST_BLOCKS {
                request.push(rng.next());
            }
            request
        })
        .collect();
    Ok(Stream {
        name: format!("mooncake-{workers}"),
        engines: workers,
        description: format!(
            "Mooncake conversation trace ×{replays}: {} requests on {workers} workers, LRU of {capacity} blocks each",
            rows.len() * replays.max(1)
        ),
        batches,
        block_events,
        lookups,
    })
}
