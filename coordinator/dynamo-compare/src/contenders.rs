//! The indexes compared, behind one small interface: ours (`PrefixIndex`) and each of
//! dynamo-kv-router's indexers its public API lets a program drive.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    compute_next_seq_hash, ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData,
    KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash, OverlapScores, RouterEvent,
};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer, RadixTree};
use parking_lot::RwLock;
use pd_coordinator::index::{PrefixIndex, SharedIndex, PUBLISH_EVERY};
use pd_protocols::kv_events::KvEvent;

use crate::shared::measure::{measure, Latency, Span, Summary};
use crate::stream::Stream;

/// Dynamo's default distance between the positions `PositionalIndexer` probes.
const POSITIONAL_JUMP: usize = 32;

/// An index under test.
pub trait Contender {
    fn name(&self) -> String;
    /// Threads that apply events.
    fn apply_threads(&self) -> usize;
    /// Converts the stream into this index's own events (not timed).
    fn prepare(&mut self, stream: &Stream);
    /// Applies the stream (or what `prepare` made, which it consumes); returns once every event
    /// is in the index.
    fn apply(&mut self, stream: &Stream);
    /// One lookup, timed alone into `latency`; each engine's overlap (non-zero ones, sorted by
    /// engine) into `out`.
    fn lookup(&self, request: &[u64], latency: &mut Latency, out: &mut Vec<(usize, usize)>);
    /// Events the index refused (it logs nothing we could see otherwise).
    fn rejected(&self) -> usize {
        0
    }
    /// (block, engine) entries held, where the index counts them (ours does).
    fn entries(&self) -> Option<usize> {
        None
    }
}

/// Our events as Dynamo's. Our block hash is the block's tokens hash (what lookups walk);
/// its sequence hash is Dynamo's own chain over the tokens hashes of its prefix, as Dynamo's
/// workers publish it (`PositionalIndexer` checks it on every lookup). `chain` maps our hashes
/// to those sequence hashes; a block hash always has the same parent in our streams.
fn router_event(engine: usize, event_id: u64, event: &KvEvent, chain: &mut HashMap<u64, u64>) -> Option<RouterEvent> {
    let sequence = |chain: &HashMap<u64, u64>, h: u64| ExternalSequenceBlockHash(chain.get(&h).copied().unwrap_or(h));
    let data = match event {
        KvEvent::BlockStored { block_hashes, parent_block_hash, .. } => {
            let parent = parent_block_hash.as_ref().map(|h| sequence(chain, h.as_u64()));
            let mut previous = parent.map(|p| p.0);
            let blocks = block_hashes
                .iter()
                .map(|h| {
                    let local = LocalBlockHash(h.as_u64());
                    let seq = previous.map_or(local.0, |p| compute_next_seq_hash(p, local));
                    chain.insert(h.as_u64(), seq);
                    previous = Some(seq);
                    KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(seq),
                        tokens_hash: local,
                        mm_extra_info: None,
                    }
                })
                .collect();
            KvCacheEventData::Stored(KvCacheStoreData { parent_hash: parent, start_position: None, blocks })
        }
        KvEvent::BlockRemoved { block_hashes, .. } => KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: block_hashes.iter().map(|h| sequence(chain, h.as_u64())).collect(),
        }),
        KvEvent::AllBlocksCleared => KvCacheEventData::Cleared,
        KvEvent::Other { .. } => return None,
    };
    Some(RouterEvent::new(engine as u64, KvCacheEvent { event_id, data, dp_rank: 0 }))
}

fn router_events(stream: &Stream) -> Vec<RouterEvent> {
    let mut chain = HashMap::new();
    stream
        .events()
        .enumerate()
        .filter_map(|(id, (engine, event))| router_event(engine, id as u64, event, &mut chain))
        .collect()
}

fn local_hashes(request: &[u64]) -> Vec<LocalBlockHash> {
    request.iter().map(|&h| LocalBlockHash(h)).collect()
}

/// Dynamo's per-worker scores as our per-engine overlaps.
fn overlaps(scores: &OverlapScores, out: &mut Vec<(usize, usize)>) {
    out.clear();
    out.extend(scores.scores.iter().filter(|(_, n)| **n > 0).map(|(w, n)| (w.worker_id as usize, *n as usize)));
    out.sort_unstable();
}

pub struct Ours {
    index: PrefixIndex,
    now: Instant,
}

impl Ours {
    pub fn new() -> Ours {
        Ours { index: PrefixIndex::default(), now: Instant::now() }
    }
}

impl Contender for Ours {
    fn name(&self) -> String {
        "ours: PrefixIndex".into()
    }

    fn apply_threads(&self) -> usize {
        1
    }

    fn prepare(&mut self, _: &Stream) {}

    fn apply(&mut self, stream: &Stream) {
        for (engine, events) in &stream.batches {
            self.index.apply_batch(*engine, events);
        }
    }

    fn lookup(&self, request: &[u64], latency: &mut Latency, out: &mut Vec<(usize, usize)>) {
        // A copy made just before, as Dynamo's lookups get theirs (`local_hashes`): neither
        // index reads a request cold from the benchmark's 100 MB of them.
        let request = request.to_vec();
        latency.time(|| self.index.prefix_matches(&request, self.now, out));
        out.retain(|&(_, n)| n > 0);
        out.sort_unstable();
    }

    fn entries(&self) -> Option<usize> {
        Some(self.index.entries())
    }
}

pub struct Radix {
    tree: RadixTree,
    events: Vec<RouterEvent>,
    rejected: usize,
}

impl Radix {
    pub fn new() -> Radix {
        Radix { tree: RadixTree::new(), events: Vec::new(), rejected: 0 }
    }
}

impl Contender for Radix {
    fn name(&self) -> String {
        "dynamo: RadixTree".into()
    }

    fn apply_threads(&self) -> usize {
        1
    }

    fn prepare(&mut self, stream: &Stream) {
        self.events = router_events(stream);
    }

    fn apply(&mut self, _: &Stream) {
        for event in std::mem::take(&mut self.events) {
            if self.tree.apply_event(event).is_err() {
                self.rejected += 1;
            }
        }
    }

    fn lookup(&self, request: &[u64], latency: &mut Latency, out: &mut Vec<(usize, usize)>) {
        let sequence = local_hashes(request);
        let scores = latency.time(|| self.tree.find_matches(sequence, false));
        overlaps(&scores, out);
    }

    fn rejected(&self) -> usize {
        self.rejected
    }
}

/// `PositionalIndexer` applied on the caller's thread, as one of its worker threads would.
pub struct Positional {
    index: PositionalIndexer,
    events: Vec<RouterEvent>,
    rejected: usize,
}

impl Positional {
    pub fn new() -> Positional {
        Positional { index: PositionalIndexer::new(POSITIONAL_JUMP), events: Vec::new(), rejected: 0 }
    }
}

/// Applies `events` to a `PositionalIndexer` with one thread's worker map; counts refusals.
fn apply_positional(index: &PositionalIndexer, events: Vec<RouterEvent>) -> usize {
    let mut worker_blocks = Default::default();
    events.into_iter().map(|event| index.apply_event(&mut worker_blocks, event, None)).filter(Result::is_err).count()
}

impl Contender for Positional {
    fn name(&self) -> String {
        "dynamo: PositionalIndexer".into()
    }

    fn apply_threads(&self) -> usize {
        1
    }

    fn prepare(&mut self, stream: &Stream) {
        self.events = router_events(stream);
    }

    fn apply(&mut self, _: &Stream) {
        self.rejected += apply_positional(&self.index, std::mem::take(&mut self.events));
    }

    fn lookup(&self, request: &[u64], latency: &mut Latency, out: &mut Vec<(usize, usize)>) {
        let sequence = local_hashes(request);
        let scores = latency.time(|| self.index.find_matches(&sequence, false));
        overlaps(&scores, out);
    }

    fn rejected(&self) -> usize {
        self.rejected
    }
}

/// A `SyncIndexer` behind `ThreadPoolIndexer`: events go to its worker threads, lookups run on
/// the caller's thread (as its `find_matches` does).
pub struct Pool<T: SyncIndexer> {
    label: &'static str,
    workers: usize,
    pool: ThreadPoolIndexer<T>,
    runtime: tokio::runtime::Runtime,
    events: Vec<RouterEvent>,
}

impl<T: SyncIndexer> Pool<T> {
    fn with(label: &'static str, backend: T, workers: usize) -> Pool<T> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a current-thread runtime starts");
        Pool { label, workers, pool: ThreadPoolIndexer::new(backend, workers, 16), runtime, events: Vec::new() }
    }

    /// Enqueues every prepared event and waits until the workers have applied them.
    fn enqueue_all(&mut self) {
        for event in std::mem::take(&mut self.events) {
            self.pool.enqueue_event(event).expect("the thread pool accepts events while it runs");
        }
        self.runtime.block_on(self.pool.flush());
    }
}

pub fn crtc_pool(workers: usize) -> Pool<ConcurrentRadixTreeCompressed> {
    Pool::with("ConcurrentRadixTreeCompressed", ConcurrentRadixTreeCompressed::new(), workers)
}

pub fn positional_pool(workers: usize) -> Pool<PositionalIndexer> {
    Pool::with("PositionalIndexer", PositionalIndexer::new(POSITIONAL_JUMP), workers)
}

impl<T: SyncIndexer> Contender for Pool<T> {
    fn name(&self) -> String {
        format!("dynamo: ThreadPoolIndexer<{}>", self.label)
    }

    fn apply_threads(&self) -> usize {
        self.workers
    }

    fn prepare(&mut self, stream: &Stream) {
        self.events = router_events(stream);
    }

    fn apply(&mut self, _: &Stream) {
        self.enqueue_all();
    }

    fn lookup(&self, request: &[u64], latency: &mut Latency, out: &mut Vec<(usize, usize)>) {
        let sequence = local_hashes(request);
        let scores = latency.time(|| self.pool.backend().find_matches(&sequence, false));
        overlaps(&scores, out);
    }
}

/// Applying while another thread looks up.
pub struct Concurrent {
    pub name: String,
    pub apply: Span,
    pub cpu_s: Option<f64>,
    pub lookups: Summary,
}

/// Runs `apply` on this thread while a second thread runs `lookup` over `requests` (at least
/// once) until `apply` returns.
fn alongside_lookups(
    name: String,
    requests: &[Vec<u64>],
    lookup: impl Fn(&[u64], &mut Latency, &mut Vec<(usize, usize)>) + Sync,
    apply: impl FnOnce(),
) -> Concurrent {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let (mut latency, mut out) = (Latency::default(), Vec::new());
            for request in requests.iter().cycle() {
                lookup(request, &mut latency, &mut out);
                if done.load(Ordering::Relaxed) {
                    break;
                }
            }
            latency
        });
        let cpu = crate::process_cpu_s();
        let span = measure(apply);
        let cpu_s = cpu.zip(crate::process_cpu_s()).map(|(a, b)| b - a);
        done.store(true, Ordering::Relaxed);
        let latency = reader.join().expect("the lookup thread does not panic");
        Concurrent { name, apply: span, cpu_s, lookups: latency.summary() }
    })
}

/// Ours behind a read-write lock (one write lock per batch), as a daemon sharing it would.
pub fn concurrent_ours(stream: &Stream) -> Concurrent {
    let index = RwLock::new(PrefixIndex::default());
    let now = Instant::now();
    alongside_lookups(
        "ours: PrefixIndex behind an RwLock".into(),
        &stream.lookups,
        |request, latency, out| latency.time(|| index.read().prefix_matches(request, now, out)),
        || {
            for (engine, events) in &stream.batches {
                index.write().apply_batch(*engine, events);
            }
        },
    )
}

/// Ours as two copies ([`SharedIndex`]): lookups read the published copy while the writer
/// applies to the other. The writer takes its events owned, as from a decoder; they are copied
/// out of the stream before the clock starts, as Dynamo's pools get theirs.
pub fn concurrent_ours_shared(stream: &Stream) -> Concurrent {
    let (index, mut writer) = SharedIndex::new();
    let batches = stream.batches.clone();
    let now = Instant::now();
    alongside_lookups(
        format!("ours: SharedIndex (two copies, published every {PUBLISH_EVERY} block events)"),
        &stream.lookups,
        |request, latency, out| latency.time(|| index.read(|copy| copy.prefix_matches(request, now, out))),
        move || {
            for (engine, events) in batches {
                writer.apply_batch(engine, events);
            }
            writer.publish();
        },
    )
}

pub fn concurrent_positional(stream: &Stream) -> Concurrent {
    let index = PositionalIndexer::new(POSITIONAL_JUMP);
    let events = router_events(stream);
    alongside_lookups(
        "dynamo: PositionalIndexer".into(),
        &stream.lookups,
        |request, latency, _| {
            let sequence = local_hashes(request);
            drop(latency.time(|| index.find_matches(&sequence, false)));
        },
        || {
            apply_positional(&index, events);
        },
    )
}

pub fn concurrent_pool<T: SyncIndexer>(mut pool: Pool<T>, stream: &Stream) -> Concurrent {
    pool.prepare(stream);
    let backend = pool.pool.backend_arc();
    let name = pool.name();
    alongside_lookups(
        name,
        &stream.lookups,
        |request, latency, _| {
            let sequence = local_hashes(request);
            drop(latency.time(|| backend.find_matches(&sequence, false)));
        },
        || pool.enqueue_all(),
    )
}
