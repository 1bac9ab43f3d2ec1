//! coordbench's workload, shared with dynamo-compare so that both replay the same events:
//! shared system prompts ("families") under conversations, every engine's blocks as vLLM
//! `BlockStored` events, and steady-state churn (stores of new conversations, per-block removals
//! of old ones). `coordinator/BENCH.md` describes it.

use pd_protocols::kv_events::{BlockHash, EventBatch, KvEvent};

pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// `k` distinct engines out of `n`.
    pub fn subset(&mut self, n: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<usize> = (0..n).collect();
        for i in 0..k.min(n) {
            let j = i + self.below(n - i);
            all.swap(i, j);
        }
        all.truncate(k.min(n));
        all
    }
}

pub const BLOCK_SIZE: usize = 16;
pub const REQUEST_BLOCKS: usize = 128;
pub const FAMILIES: usize = 200;

/// A shared system prompt and the engines holding it.
pub struct Family {
    pub blocks: Vec<u64>,
    pub holders: Vec<usize>,
}

/// A conversation under a family, and the engines holding it.
pub struct Conversation {
    pub family: usize,
    pub blocks: Vec<u64>,
    pub holders: Vec<usize>,
}

pub struct Universe {
    pub families: Vec<Family>,
    pub conversations: Vec<Conversation>,
    /// Cumulative popularity of families (Zipf, s = 1).
    popularity: Vec<f64>,
}

impl Universe {
    pub fn generate(rng: &mut Rng, engines: usize, target_blocks: usize) -> Universe {
        let mut families: Vec<Family> = (0..FAMILIES)
            .map(|f| {
                let len = if f == 0 { REQUEST_BLOCKS } else { rng.range(4, 48) };
                let holders = (engines as f64 / (1.0 + f as f64 / 4.0)).round().clamp(2.0, engines as f64) as usize;
                Family { blocks: (0..len).map(|_| rng.next()).collect(), holders: rng.subset(engines, holders) }
            })
            .collect();
        let weights: Vec<f64> = (0..FAMILIES).map(|f| 1.0 / (f + 1) as f64).collect();
        let total: f64 = weights.iter().sum();
        let popularity: Vec<f64> = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w / total;
                Some(*acc)
            })
            .collect();
        let mut universe = Universe { families: Vec::new(), conversations: Vec::new(), popularity };
        let mut distinct: usize = families.iter().map(|f| f.blocks.len()).sum();
        // At least one conversation, where the families alone reach the target (a small
        // `--blocks`): lookups are drawn from conversations.
        while distinct < target_blocks || universe.conversations.is_empty() {
            let family = universe.pick_family(rng);
            let len = rng.range(8, 160).min(target_blocks.saturating_sub(distinct)).max(1);
            let fam = &mut families[family];
            // Served by a prefill and a decode (both keep the blocks), sometimes locally by one
            // engine, sometimes re-routed to a third; mostly engines that had the system prompt.
            let count = match rng.below(10) {
                0..=1 => 1,
                2..=8 => 2,
                _ => 3,
            };
            let mut holders = Vec::with_capacity(count);
            while holders.len() < count {
                let engine =
                    if rng.below(10) < 8 { fam.holders[rng.below(fam.holders.len())] } else { rng.below(engines) };
                if !holders.contains(&engine) {
                    holders.push(engine);
                }
            }
            for &engine in &holders {
                if !fam.holders.contains(&engine) {
                    fam.holders.push(engine);
                }
            }
            universe.conversations.push(Conversation {
                family,
                blocks: (0..len).map(|_| rng.next()).collect(),
                holders,
            });
            distinct += len;
        }
        universe.families = families;
        universe
    }

    pub fn pick_family(&self, rng: &mut Rng) -> usize {
        let u = rng.unit();
        self.popularity.partition_point(|&p| p < u).min(FAMILIES - 1)
    }

    pub fn distinct_blocks(&self) -> usize {
        self.families.iter().map(|f| f.blocks.len()).sum::<usize>()
            + self.conversations.iter().map(|c| c.blocks.len()).sum::<usize>()
    }

    pub fn entries(&self) -> usize {
        self.families.iter().map(|f| f.blocks.len() * f.holders.len()).sum::<usize>()
            + self.conversations.iter().map(|c| c.blocks.len() * c.holders.len()).sum::<usize>()
    }

    /// A request: a conversation's family prompt and history, then new blocks, 128 in all.
    pub fn request(&self, rng: &mut Rng, out: &mut Vec<u64>) {
        out.clear();
        let c = &self.conversations[rng.below(self.conversations.len())];
        out.extend(&self.families[c.family].blocks);
        out.extend(&c.blocks);
        out.truncate(REQUEST_BLOCKS);
        while out.len() < REQUEST_BLOCKS {
            out.push(rng.next());
        }
    }
}

pub fn stored(blocks: &[u64], parent: Option<u64>, rng: &mut Rng) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: blocks.iter().map(|&h| BlockHash::Int(h)).collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: (0..blocks.len() * BLOCK_SIZE).map(|_| rng.below(150_000) as u32).collect(),
        block_size: BLOCK_SIZE as u32,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        cache_salt: None,
    }
}

/// Every engine's `BlockStored` events for the universe, in batches of up to 8 events, engines
/// interleaved as their streams would arrive.
pub fn build_batches(universe: &Universe, engines: usize, rng: &mut Rng) -> Vec<(usize, EventBatch)> {
    let mut per_engine: Vec<Vec<KvEvent>> = (0..engines).map(|_| Vec::new()).collect();
    let mut has_family = vec![vec![false; FAMILIES]; engines];
    for (f, family) in universe.families.iter().enumerate() {
        for &engine in &family.holders {
            // Families whose holders have no conversation under them still hold the prompt.
            if rng.below(2) == 0 {
                per_engine[engine].push(stored(&family.blocks, None, rng));
                has_family[engine][f] = true;
            }
        }
    }
    for c in &universe.conversations {
        let family = &universe.families[c.family];
        for &engine in &c.holders {
            if !has_family[engine][c.family] {
                per_engine[engine].push(stored(&family.blocks, None, rng));
                has_family[engine][c.family] = true;
            }
            per_engine[engine].push(stored(&c.blocks, family.blocks.last().copied(), rng));
        }
    }
    for (f, family) in universe.families.iter().enumerate() {
        for &engine in &family.holders {
            if !has_family[engine][f] {
                per_engine[engine].push(stored(&family.blocks, None, rng));
                has_family[engine][f] = true;
            }
        }
    }
    let mut queues: Vec<std::vec::IntoIter<KvEvent>> = per_engine.into_iter().map(Vec::into_iter).collect();
    let mut batches = Vec::new();
    let mut ts = 1.764e9;
    loop {
        let mut any = false;
        for (engine, queue) in queues.iter_mut().enumerate() {
            let events: Vec<KvEvent> = queue.by_ref().take(1 + rng.below(8)).collect();
            if !events.is_empty() {
                any = true;
                ts += 0.001;
                batches.push((engine, EventBatch { ts, events, dp_rank: Some(0) }));
            }
        }
        if !any {
            return batches;
        }
    }
}

/// Steady state: new conversations stored, old ones evicted one block per `BlockRemoved` (as
/// vLLM's LRU eviction publishes them).
pub fn churn_batches(universe: &Universe, rng: &mut Rng, count: usize) -> Vec<(usize, EventBatch)> {
    let mut batches = Vec::new();
    for k in 0..count {
        let old = &universe.conversations[k % universe.conversations.len()];
        let family = &universe.families[old.family];
        let fresh: Vec<u64> = (0..old.blocks.len()).map(|_| rng.next()).collect();
        for &engine in &old.holders {
            let mut events = vec![stored(&fresh, family.blocks.last().copied(), rng)];
            events.extend(
                old.blocks.iter().map(|&h| KvEvent::BlockRemoved {
                    block_hashes: vec![BlockHash::Int(h)],
                    medium: Some("GPU".into()),
                }),
            );
            batches.push((engine, EventBatch { ts: 1.764e9 + k as f64, events, dp_rank: Some(0) }));
        }
    }
    batches
}
