//! The prefix index against a naive reference model, over many random operation sequences:
//! stores and removals (any tier, duplicates), approximate entries with deadlines, time passing,
//! `expire`, `AllBlocksCleared` and `remove_engine`, speculative entries after a decision (plain,
//! or reusing the slots of a lookup of the same request just before, or of an older one), with
//! sparse engine ids and tables large enough that resets stay pending. Every query, count and
//! tier is compared after every step; a failing sequence is shrunk and printed.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use pd_coordinator::index::{PrefixIndex, Probes, Tier};
use pd_protocols::kv_events::{BlockHash, KvEvent};

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len() as u64) as usize]
    }
}

/// The tiers an engine holds a block in: GPU, CPU, other.
type Copies = [bool; 3];

fn slot_of(tier: Tier) -> usize {
    match tier {
        Tier::Gpu => 0,
        Tier::Cpu => 1,
        Tier::Other => 2,
    }
}

/// `state` with a copy in `tier` added (a block stored in a second tier has both).
fn with_copy(state: Option<&State>, tier: Tier) -> State {
    let mut copies = match state {
        Some(State::Exact(copies)) => *copies,
        _ => [false; 3],
    };
    copies[slot_of(tier)] = true;
    State::Exact(copies)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    Exact(Copies),
    /// Until this many milliseconds after the start.
    Approx(u64),
}

/// The obviously-correct model: per engine, the state of each block it holds.
#[derive(Default)]
struct Reference {
    held: HashMap<usize, HashMap<u64, State>>,
}

impl Reference {
    fn live(state: State, now_ms: u64) -> bool {
        match state {
            State::Exact(_) => true,
            State::Approx(until) => until > now_ms,
        }
    }

    fn overlaps(&self, hashes: &[u64], now_ms: u64) -> HashMap<usize, usize> {
        self.held
            .iter()
            .map(|(&engine, blocks)| {
                let n = hashes.iter().take_while(|h| blocks.get(h).is_some_and(|&s| Self::live(s, now_ms))).count();
                (engine, n)
            })
            .filter(|&(_, n)| n > 0)
            .collect()
    }

    fn holds(&self, engine: usize, hash: u64, now_ms: u64) -> Option<Tier> {
        match self.held.get(&engine)?.get(&hash)? {
            State::Exact(copies) => {
                let fastest = copies.iter().position(|&c| c).expect("an exact state has a copy");
                Some([Tier::Gpu, Tier::Cpu, Tier::Other][fastest])
            }
            &State::Approx(until) if until > now_ms => Some(Tier::Gpu),
            State::Approx(_) => None,
        }
    }

    fn len(&self) -> usize {
        self.held.values().flat_map(|blocks| blocks.keys()).collect::<HashSet<_>>().len()
    }
}

/// Operations on the index. `Speculative`: `insert_speculative` for each `(engine, first)` of
/// `guesses` on `hashes[first..]`; with `probed`, after `prefix_matches_probed` of the same
/// hashes, or, with `stale`, with the probes of the query before the previous operation (often
/// of the same hashes, with that operation's writes in between).
#[derive(Clone, Debug)]
enum Op {
    Stored { engine: usize, hashes: Vec<u64>, medium: Option<&'static str> },
    Removed { engine: usize, hashes: Vec<u64> },
    Cleared { engine: usize },
    RemoveEngine { engine: usize },
    Approx { engine: usize, hashes: Vec<u64>, ttl_ms: u64 },
    Speculative { guesses: Vec<(usize, usize)>, hashes: Vec<u64>, ttl_ms: u64, probed: bool, stale: bool },
    Advance { ms: u64 },
    Expire,
    Query { hashes: Vec<u64> },
}

/// How one sequence draws its operations.
#[derive(Clone, Copy, Debug)]
struct Profile {
    engines: &'static [usize],
    /// Block hashes are drawn as `0..space`, then mapped to 64-bit values when `spread`.
    space: u64,
    spread: bool,
    /// Longest run a store or removal covers.
    run: u64,
    steps: usize,
}

const SMALL: Profile = Profile { engines: &[0, 1, 2, 3, 4, 5], space: 40, spread: false, run: 8, steps: 400 };
const SPARSE: Profile =
    Profile { engines: &[0, 3, 64, 65, 127, 128, 1000, 70_000], space: 60, spread: true, run: 12, steps: 400 };
/// 150 engines appearing as the sequence goes (bitsets widen mid-way), many per block
/// (approximate entries spill out of their slots).
const MANY: Profile = Profile { engines: &ENGINES_150, space: 24, spread: true, run: 10, steps: 600 };
const ENGINES_150: [usize; 150] = {
    let mut ids = [0; 150];
    let mut i = 0;
    while i < 150 {
        ids[i] = i * 7 + 3;
        i += 1;
    }
    ids
};
const LARGE: Profile = Profile { engines: &[0, 1, 2, 7, 200], space: 30_000, spread: true, run: 3000, steps: 150 };

fn block(profile: &Profile, n: u64) -> u64 {
    if profile.spread {
        n.wrapping_mul(0xd6e8_feb8_6659_fd93).rotate_left(17) ^ 0xa5a5
    } else {
        n
    }
}

fn run_of(rng: &mut Rng, profile: &Profile) -> Vec<u64> {
    let start = rng.below(profile.space);
    let len = 1 + rng.below(profile.run);
    let mut run: Vec<u64> = (start..start + len).map(|n| block(profile, n % profile.space)).collect();
    if rng.below(8) == 0 {
        let dup = run[rng.below(run.len() as u64) as usize];
        run.push(dup);
    }
    run
}

fn generate(seed: u64, profile: &Profile) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let mut ops = Vec::new();
    for _ in 0..profile.steps {
        let engine = rng.pick(profile.engines);
        ops.push(match rng.below(100) {
            0..=39 => Op::Stored {
                engine,
                hashes: run_of(&mut rng, profile),
                medium: rng.pick(&[Some("GPU"), Some("GPU"), Some("CPU"), None, Some("disk")]),
            },
            40..=59 => Op::Removed { engine, hashes: run_of(&mut rng, profile) },
            60..=62 => Op::Cleared { engine },
            63..=64 => Op::RemoveEngine { engine },
            65..=72 => Op::Approx { engine, hashes: run_of(&mut rng, profile), ttl_ms: rng.below(3000) },
            73..=79 => {
                let (probed, stale) = (rng.below(4) != 0, rng.below(4) == 0);
                let earlier = ops.len().checked_sub(3).map(|at| &ops[at]);
                let hashes = match earlier {
                    Some(Op::Query { hashes }) if stale && rng.below(2) == 0 => hashes.clone(),
                    _ => run_of(&mut rng, profile),
                };
                let most = if rng.below(4) == 0 { 6 } else { 2 };
                let count = 1 + rng.below(most) as usize;
                let guesses = (0..count)
                    .map(|_| (rng.pick(profile.engines), rng.below(hashes.len() as u64 + 2) as usize))
                    .collect();
                Op::Speculative { guesses, hashes, ttl_ms: rng.below(3000), probed, stale }
            }
            80..=87 => Op::Advance { ms: rng.below(1500) },
            88..=91 => Op::Expire,
            _ => Op::Query { hashes: run_of(&mut rng, profile) },
        });
        // Every step is followed by a query near the last operation's blocks.
        let mut query = run_of(&mut rng, profile);
        if let Some(
            Op::Stored { hashes, .. }
            | Op::Approx { hashes, .. }
            | Op::Removed { hashes, .. }
            | Op::Speculative { hashes, .. },
        ) = ops.last()
        {
            if rng.below(2) == 0 {
                query = hashes.clone();
                query.extend(run_of(&mut rng, profile));
            }
        }
        ops.push(Op::Query { hashes: query });
    }
    ops
}

fn stored(hashes: &[u64], medium: Option<&str>) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
        parent_block_hash: None,
        token_ids: vec![],
        block_size: 16,
        lora_id: None,
        medium: medium.map(str::to_owned),
        lora_name: None,
        cache_salt: None,
    }
}

/// Runs `ops` on a fresh index and the reference; the first disagreement, if any.
fn check(ops: &[Op], profile: &Profile) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let mut now_ms = 0u64;
    let (mut index, mut reference) = (PrefixIndex::default(), Reference::default());
    let mut matches = Vec::new();
    // The probes of the last query, and of the one before it.
    let (mut probes, mut older) = (Probes::default(), Probes::default());
    for (step, op) in ops.iter().enumerate() {
        let now = t0 + Duration::from_millis(now_ms);
        match op {
            Op::Stored { engine, hashes, medium } => {
                index.apply(*engine, &stored(hashes, *medium));
                let tier = Tier::from_medium(*medium);
                let blocks = reference.held.entry(*engine).or_default();
                for h in hashes {
                    let state = with_copy(blocks.get(h), tier);
                    blocks.insert(*h, state);
                }
            }
            Op::Removed { engine, hashes } => {
                let block_hashes = hashes.iter().map(|&h| BlockHash::Int(h)).collect();
                index.apply(*engine, &KvEvent::BlockRemoved { block_hashes, medium: None });
                if let Some(blocks) = reference.held.get_mut(engine) {
                    for h in hashes {
                        blocks.remove(h);
                    }
                }
            }
            Op::Cleared { engine } => {
                index.apply(*engine, &KvEvent::AllBlocksCleared);
                reference.held.remove(engine);
            }
            Op::RemoveEngine { engine } => {
                index.remove_engine(*engine);
                reference.held.remove(engine);
            }
            Op::Approx { engine, hashes, ttl_ms } => {
                index.insert_approximate(*engine, hashes, now + Duration::from_millis(*ttl_ms));
                let blocks = reference.held.entry(*engine).or_default();
                for h in hashes {
                    match blocks.get(h) {
                        Some(State::Exact(_)) => {}
                        _ => {
                            blocks.insert(*h, State::Approx(now_ms + ttl_ms));
                        }
                    }
                }
            }
            Op::Speculative { guesses, hashes, ttl_ms, probed, stale } => {
                let until = now + Duration::from_millis(*ttl_ms);
                if *probed && *stale {
                    // Slots found for another request, or before other writes, must not be
                    // trusted blindly.
                    index.insert_speculative_probed(guesses, hashes, until, &older);
                } else if *probed {
                    let mut fresh = Probes::default();
                    index.prefix_matches_probed(hashes, now, &mut matches, &mut fresh);
                    index.insert_speculative_probed(guesses, hashes, until, &fresh);
                } else {
                    index.insert_speculative(guesses, hashes, until);
                }
                for &(engine, first) in guesses {
                    if first >= hashes.len() {
                        continue;
                    }
                    let blocks = reference.held.entry(engine).or_default();
                    for h in &hashes[first..] {
                        if !matches!(blocks.get(h), Some(State::Exact(_))) {
                            blocks.insert(*h, State::Approx(now_ms + ttl_ms));
                        }
                    }
                }
            }
            Op::Advance { ms } => now_ms += ms,
            Op::Expire => {
                index.expire(now);
                for blocks in reference.held.values_mut() {
                    blocks.retain(|_, s| Reference::live(*s, now_ms));
                }
            }
            Op::Query { hashes } => {
                let got = index.overlaps(hashes, now);
                let want = reference.overlaps(hashes, now_ms);
                if got != want {
                    anyhow::bail!("step {step}: overlaps({hashes:?}) = {got:?}, reference {want:?}");
                }
                std::mem::swap(&mut probes, &mut older);
                index.prefix_matches_probed(hashes, now, &mut matches, &mut probes);
                matches.sort_unstable();
                let mut sorted: Vec<_> = want.into_iter().collect();
                sorted.sort_unstable();
                if matches != sorted {
                    anyhow::bail!("step {step}: prefix_matches {matches:?}, reference {sorted:?}");
                }
                for &engine in profile.engines.iter().take(3) {
                    for h in hashes.iter().take(4) {
                        let (got, want) = (index.holds(engine, *h, now), reference.holds(engine, *h, now_ms));
                        if got != want {
                            anyhow::bail!("step {step}: holds({engine}, {h}) = {got:?}, reference {want:?}");
                        }
                    }
                }
            }
        }
        for &engine in profile.engines {
            let want = reference.held.get(&engine).map_or(0, HashMap::len);
            if index.engine_blocks(engine) != want {
                anyhow::bail!(
                    "step {step}: engine_blocks({engine}) = {}, reference {want}",
                    index.engine_blocks(engine)
                );
            }
        }
        let entries: usize = reference.held.values().map(HashMap::len).sum();
        if index.entries() != entries {
            anyhow::bail!("step {step}: entries() = {}, reference {entries}", index.entries());
        }
        if step % 16 == 0 || matches!(op, Op::Cleared { .. } | Op::RemoveEngine { .. } | Op::Expire) {
            let (len, want) = (index.len(), reference.len());
            if len != want || index.is_empty() != (want == 0) {
                anyhow::bail!("step {step}: len() = {len}, reference {want}");
            }
        }
    }
    Ok(())
}

/// Removes operations while the sequence still fails: halves, then quarters, ..., then singles.
fn shrink(mut ops: Vec<Op>, profile: &Profile) -> (Vec<Op>, anyhow::Error) {
    let mut error = check(&ops, profile).expect_err("shrink a failing sequence");
    let mut chunk = ops.len() / 2;
    while chunk > 0 {
        let mut at = 0;
        while at < ops.len() {
            let mut fewer = ops.clone();
            fewer.drain(at..(at + chunk).min(ops.len()));
            match check(&fewer, profile) {
                Err(e) => (ops, error) = (fewer, e),
                Ok(()) => at += chunk,
            }
        }
        chunk /= 2;
    }
    (ops, error)
}

fn matches_reference(profile: &Profile, seeds: std::ops::RangeInclusive<u64>) {
    for seed in seeds {
        let ops = generate(seed, profile);
        if check(&ops, profile).is_err() {
            let (ops, error) = shrink(ops, profile);
            panic!("seed {seed}: {error}\nshrunk to {} operations:\n{ops:#?}", ops.len());
        }
    }
}

#[test]
fn matches_the_reference_model() {
    matches_reference(&SMALL, 1..=150);
}

#[test]
fn matches_the_reference_model_with_sparse_engine_ids() {
    matches_reference(&SPARSE, 1..=100);
}

#[test]
fn matches_the_reference_model_with_many_engines_per_block() {
    matches_reference(&MANY, 1..=40);
}

#[test]
fn matches_the_reference_model_on_large_tables() {
    // Thousands of blocks: resets stay pending (read through masks) until a sweep.
    matches_reference(&LARGE, 1..=12);
}

/// The original sequence shape: exact events only, one query per step.
#[test]
fn exact_events_only() {
    let now = Instant::now();
    for seed in 1..=40u64 {
        let mut rng = Rng::new(seed);
        let (mut index, mut reference) = (PrefixIndex::default(), Reference::default());
        for _ in 0..400 {
            let engine = rng.below(6) as usize;
            let run: Vec<u64> = {
                let start = rng.below(30);
                (start..start + 1 + rng.below(8)).collect()
            };
            match rng.below(10) {
                0..=5 => {
                    let medium = if rng.below(2) == 0 { "GPU" } else { "CPU" };
                    index.apply(engine, &stored(&run, Some(medium)));
                    let blocks = reference.held.entry(engine).or_default();
                    for h in &run {
                        let state = with_copy(blocks.get(h), Tier::from_medium(Some(medium)));
                        blocks.insert(*h, state);
                    }
                }
                6..=8 => {
                    let block_hashes = run.iter().map(|&h| BlockHash::Int(h)).collect();
                    index.apply(engine, &KvEvent::BlockRemoved { block_hashes, medium: None });
                    if let Some(blocks) = reference.held.get_mut(&engine) {
                        for h in &run {
                            blocks.remove(h);
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
            assert_eq!(index.overlaps(&query, now), reference.overlaps(&query, 0), "seed {seed}, query {query:?}");
        }
        let total: usize = reference.held.values().map(HashMap::len).sum();
        let indexed: usize = (0..6).map(|e| index.engine_blocks(e)).sum();
        assert_eq!(indexed, total, "seed {seed}");
        // Approximate entries never outlive their deadline.
        index.insert_approximate(9, &[1000, 1001], now + Duration::from_secs(1));
        assert_eq!(index.overlaps(&[1000, 1001], now).get(&9), Some(&2));
        index.expire(now + Duration::from_secs(2));
        assert_eq!(index.engine_blocks(9), 0);
    }
}

/// `apply_batch` against `apply` one event at a time, on random batches of one engine's events:
/// runs of one-block removals (as engines evict), multi-block removals longer than a chunk,
/// stores in any tier, clears, with guesses between batches; in a small table, and (even seeds)
/// in one grown past the size from which `apply_batch` loads removals' slots ahead. After every
/// batch both indexes must answer every query alike; every block's holders are compared every
/// few batches.
#[test]
fn batch_apply_equals_one_by_one() {
    const BACKGROUND: u64 = 1 << 32;
    let now = Instant::now();
    for seed in 1..=8u64 {
        let mut rng = Rng::new(seed);
        let (mut single, mut batched) = (PrefixIndex::default(), PrefixIndex::default());
        let engines = [0usize, 1, 2, 5, 64, 130];
        let space = 3000u64;
        let background = if seed % 2 == 0 { 150_000 } else { 0 };
        let filler: Vec<u64> = (BACKGROUND..BACKGROUND + background).collect();
        for run in filler.chunks(1000) {
            single.apply(engines[0], &stored(run, None));
            batched.apply(engines[0], &stored(run, None));
        }
        if background > 0 {
            assert!(batched.heap_bytes() > 4 << 20, "the table outgrew the cache-sized ones");
        }
        let mut events = Vec::new();
        for round in 0..200 {
            let engine = rng.pick(&engines);
            events.clear();
            for _ in 0..1 + rng.below(40) {
                let start = rng.below(space);
                let run: Vec<u64> = (start..start + 1 + rng.below(150)).map(|n| n % space).collect();
                let evicted =
                    if background > 0 && rng.below(4) == 0 { BACKGROUND + rng.below(background) } else { run[0] };
                let event = match rng.below(100) {
                    0..=29 => stored(&run, rng.pick(&[Some("GPU"), None, Some("CPU"), Some("disk")])),
                    30..=89 => KvEvent::BlockRemoved {
                        block_hashes: vec![BlockHash::Int(evicted)],
                        medium: rng.pick(&[Some("GPU"), None, Some("CPU")]).map(str::to_owned),
                    },
                    90..=97 => KvEvent::BlockRemoved {
                        block_hashes: run.iter().map(|&h| BlockHash::Int(h)).collect(),
                        medium: None,
                    },
                    _ => KvEvent::AllBlocksCleared,
                };
                events.push(event);
            }
            for event in &events {
                single.apply(engine, event);
            }
            batched.apply_batch(engine, &events);
            if rng.below(4) == 0 {
                let start = rng.below(space);
                let guessed: Vec<u64> = (start..start + 1 + rng.below(60)).map(|n| n % space).collect();
                let (guesser, until) = (rng.pick(&engines), now + Duration::from_secs(60));
                single.insert_approximate(guesser, &guessed, until);
                batched.insert_approximate(guesser, &guessed, until);
            }
            assert_eq!(single.entries(), batched.entries(), "seed {seed}, batch {round}");
            assert_eq!(single.len(), batched.len(), "seed {seed}, batch {round}");
            for &engine in &engines {
                assert_eq!(single.engine_blocks(engine), batched.engine_blocks(engine), "seed {seed}, batch {round}");
            }
            for _ in 0..8 {
                let start = rng.below(space);
                let query: Vec<u64> = (start..start + 1 + rng.below(64)).map(|n| n % space).collect();
                assert_eq!(single.overlaps(&query, now), batched.overlaps(&query, now), "seed {seed}, batch {round}");
            }
            if round % 25 == 0 {
                for h in 0..space {
                    for &engine in &engines {
                        assert_eq!(
                            single.holds(engine, h, now),
                            batched.holds(engine, h, now),
                            "seed {seed}, batch {round}, block {h}, engine {engine}"
                        );
                    }
                }
            }
        }
    }
}
