//! The engine: configuration, tokenizer, the KV pool (bookkeeping + memory), leases and rooms,
//! metrics, events, and the xfer agent the pool is registered with.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use pd_protocols::hash::{block_digest, block_hashes, none_hash, BlockDigest};
use pd_protocols::kv_events::KvEvent;
use tokio::sync::Semaphore;
use xfer::{Agent, BackendParams, Grant, MemType, PreparedLocal, PreparedRemote};

use crate::config::Config;
use crate::content;
use crate::events::EventSink;
use crate::faults::Faults;
use crate::interference::{Law, PrefillLog, PrefillQueue};
use crate::lease::{LeaseTable, Notif, Released};
use crate::mem::PoolMemory;
use crate::metrics::{add, Gauges, Metrics};
use crate::pool::{BlockId, BlockPool, CacheChanges, PoolFull};
use crate::rooms::RoomTable;
use crate::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("xfer: {0}")]
    Xfer(#[from] xfer::XferError),
    #[error("shared-memory pool {path}: {source}")]
    Shm { path: String, source: std::io::Error },
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

/// Everything the pool's mutex guards.
#[derive(Debug)]
pub struct State {
    pub pool: BlockPool,
    /// Leases fenced by the xfer grant their decode reads under.
    pub leases: LeaseTable<Grant>,
    pub rooms: RoomTable,
}

/// A prompt's tokens and the digests its blocks' contents derive from.
#[derive(Debug)]
pub struct Prompt {
    pub tokens: Vec<u32>,
    /// Prefix-cache hashes of the full blocks.
    pub full: Vec<BlockDigest>,
    /// Pseudo-digest of the partial last block (hashed like a block, parent = last full one).
    pub tail: Option<BlockDigest>,
}

impl Prompt {
    /// The digests of a prompt's blocks, chained from `none` (NONE_HASH).
    pub fn new(none: &BlockDigest, tokens: Vec<u32>, block_size: usize) -> Prompt {
        let full = block_hashes(none, &tokens, block_size);
        let rest = &tokens[full.len() * block_size..];
        let tail = (!rest.is_empty()).then(|| block_digest(full.last().unwrap_or(none), rest, None));
        Prompt { tokens, full, tail }
    }

    pub fn num_blocks(&self) -> usize {
        self.full.len() + usize::from(self.tail.is_some())
    }

    pub fn content_digest(&self, i: usize) -> &BlockDigest {
        self.full.get(i).or(self.tail.as_ref()).expect("block index within the prompt")
    }
}

#[derive(Debug)]
pub struct Engine {
    pub cfg: Config,
    pub engine_id: String,
    pub tokenizer: Tokenizer,
    none_hash: BlockDigest,
    pub state: Mutex<State>,
    pub memory: PoolMemory,
    pub metrics: Metrics,
    pub faults: Faults,
    pub slots: Arc<Semaphore>,
    pub running: AtomicUsize,
    pub waiting: AtomicUsize,
    pub events: Option<EventSink>,
    pub agent: Agent,
    pub local_blocks: PreparedLocal,
    /// Prepared descriptor lists of peers' pools, by engine id.
    pub peers: Mutex<HashMap<String, Arc<PreparedRemote>>>,
    /// Held while loading a grant and preparing descriptors under it, so a concurrent load of
    /// an older grant over the same blocks cannot slip in between (`pull::read_blocks`).
    pub grant_loading: Mutex<()>,
    pub xfer_port: u16,
    pub started: Instant,
    /// The prefills this engine computed lately: what its decode steps pay for.
    pub prefill_log: Mutex<PrefillLog>,
    /// When queued prompts run (`--prefill-queue fifo`).
    pub prefill_queue: Mutex<PrefillQueue>,
}

/// A request's decode steps, timed by the interference law. Each step is charged with the
/// prefill computed since the previous one began, by the clock: a late timer shows as a longer
/// gap, as it would to a client.
#[derive(Debug)]
pub struct DecodeSteps {
    since: Instant,
}

impl DecodeSteps {
    pub fn new(now: Instant) -> DecodeSteps {
        DecodeSteps { since: now }
    }

    /// The deadline of the step starting at `now`; `None` when it takes no time (the zero-time
    /// model needs no timer).
    pub fn next(&mut self, engine: &Engine, now: Instant) -> Option<Instant> {
        let law = engine.law();
        let prefill = if law.factor > 0.0 && law.prefill_us_per_token > 0.0 {
            engine.prefill_log.lock().tokens_between(self.since, now)
        } else {
            0.0
        };
        self.since = now;
        let step = Duration::from_secs_f64(law.step_us(prefill).min(1e12) / 1e6);
        (!step.is_zero()).then(|| now + step)
    }

    /// Runs `n` steps.
    pub async fn run(&mut self, engine: &Engine, n: usize) {
        for _ in 0..n {
            if let Some(deadline) = self.next(engine, Instant::now()) {
                tokio::time::sleep_until(deadline.into()).await;
            }
        }
    }
}

impl Engine {
    pub fn new(cfg: Config, events: Option<EventSink>) -> Result<Arc<Engine>, EngineError> {
        let engine_id = cfg.engine_id.clone().unwrap_or_else(random_uuid);
        let tokenizer = match &cfg.tokenizer {
            Some(path) => Tokenizer::load(path)?,
            None => Tokenizer::Simple,
        };
        let (block_bytes, n) = (cfg.block_bytes(), cfg.num_blocks);
        let mut memory = match &cfg.shm_path {
            Some(path) => PoolMemory::shm(path, block_bytes, n)
                .map_err(|source| EngineError::Shm { path: path.display().to_string(), source })?,
            None => PoolMemory::heap(block_bytes, n),
        };
        let agent = Agent::new(&engine_id)?;
        let params = BackendParams::new()
            .with("listen", format!("{}:{}", cfg.host_ip, cfg.xfer_data_port))
            .with("advertise", cfg.host_ip.clone());
        agent.add_backend("tcp", params)?;
        memory.register(&agent)?;
        let descs: Vec<xfer::Desc> = (0..n as u32).map(|i| memory.block_desc(i)).collect();
        let local_blocks = agent.prep_local(MemType::Dram, &descs)?;
        let xfer_port = agent.start_side_channel(&format!("{}:{}", cfg.host_ip, cfg.xfer_port))?.port();
        Ok(Arc::new(Engine {
            none_hash: none_hash(cfg.pythonhashseed.as_deref()),
            state: Mutex::new(State {
                pool: BlockPool::new(n),
                leases: LeaseTable::new(cfg.kv_lease, cfg.heartbeat_extension),
                rooms: RoomTable::default(),
            }),
            memory,
            metrics: Metrics::default(),
            faults: Faults::new(cfg.error_rate, u64::try_from(cfg.delay.as_millis()).unwrap_or(u64::MAX)),
            slots: Arc::new(Semaphore::new(cfg.max_running)),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            events,
            agent,
            local_blocks,
            peers: Mutex::new(HashMap::new()),
            grant_loading: Mutex::new(()),
            xfer_port,
            started: Instant::now(),
            prefill_log: Mutex::new(PrefillLog::default()),
            prefill_queue: Mutex::new(PrefillQueue::default()),
            engine_id,
            tokenizer,
            cfg,
        }))
    }

    /// The interference law with this engine's timing.
    pub fn law(&self) -> Law {
        Law {
            decode_us: self.cfg.decode_us_per_token,
            prefill_us_per_token: self.cfg.prefill_us_per_token,
            factor: self.cfg.interference_factor,
            budget_tokens: self.cfg.step_token_budget,
        }
    }

    pub fn prompt(&self, tokens: Vec<u32>) -> Prompt {
        Prompt::new(&self.none_hash, tokens, self.cfg.block_size)
    }

    /// Takes the cached prefix and allocates the rest of the prompt's blocks. Returns the
    /// blocks (prompt order) and how many leading ones were prefix-cache hits. As in vLLM, the
    /// last prompt token is always computed, so a fully cached prompt recomputes its last block.
    pub fn reserve(&self, prompt: &Prompt) -> Result<(Vec<BlockId>, usize), PoolFull> {
        let max_hit = prompt.tokens.len().saturating_sub(1) / self.cfg.block_size;
        let mut changes = CacheChanges::default();
        let mut state = self.state.lock();
        let hit = state.pool.longest_prefix(&prompt.full[..max_hit.min(prompt.full.len())]);
        let mut blocks = state.pool.acquire_cached(&prompt.full[..hit]);
        match state.pool.allocate(prompt.num_blocks() - hit, &mut changes) {
            Ok(new) => blocks.extend(new),
            Err(full) => {
                state.pool.release(&blocks);
                return Err(full);
            }
        }
        self.emit_removed(changes);
        drop(state);
        let (queries, hits) = (prompt.tokens.len() as u64, (hit * self.cfg.block_size) as u64);
        add(&self.metrics.prefix_cache_queries, queries);
        add(&self.metrics.prefix_cache_hits, hits);
        add(&self.metrics.prompt_tokens_cached, hits);
        Ok((blocks, hit))
    }

    /// Writes the content of blocks `from..` of the prompt into their pool blocks.
    pub fn fill(&self, prompt: &Prompt, blocks: &[BlockId], from: usize) {
        let mut scratch = vec![0u8; self.memory.block_bytes()];
        for (i, &id) in blocks.iter().enumerate().skip(from) {
            content::fill(prompt.content_digest(i), &mut scratch);
            self.memory.write_block(id, &scratch);
        }
    }

    /// Index of the first block of `from..` whose pool bytes are not the prompt's content.
    pub fn first_mismatch(&self, prompt: &Prompt, blocks: &[BlockId], from: usize) -> Option<usize> {
        let mut scratch = vec![0u8; self.memory.block_bytes()];
        (from..blocks.len()).find(|&i| {
            self.memory.read_block(blocks[i], &mut scratch);
            !content::verify(prompt.content_digest(i), &scratch)
        })
    }

    /// Enters the full blocks `from..` into the prefix cache and publishes `BlockStored` for
    /// each run of newly cached blocks.
    pub fn commit(&self, prompt: &Prompt, blocks: &[BlockId], from: usize) {
        let bs = self.cfg.block_size;
        let mut state = self.state.lock();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for (i, (&block, digest)) in blocks.iter().zip(&prompt.full).enumerate().skip(from) {
            if state.pool.commit(block, *digest) {
                match runs.last_mut() {
                    Some((_, end)) if *end == i => *end = i + 1,
                    _ => runs.push((i, i + 1)),
                }
            }
        }
        if let Some(sink) = &self.events {
            let events = runs
                .into_iter()
                .map(|(start, end)| KvEvent::BlockStored {
                    block_hashes: prompt.full[start..end].iter().map(|d| sink.hash(d)).collect(),
                    parent_block_hash: start.checked_sub(1).map(|p| sink.hash(&prompt.full[p])),
                    token_ids: prompt.tokens[start * bs..end * bs].to_vec(),
                    block_size: bs as u32,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    cache_salt: None,
                })
                .collect();
            sink.emit(events);
        }
    }

    fn emit_removed(&self, changes: CacheChanges) {
        if let (Some(sink), false) = (&self.events, changes.removed.is_empty()) {
            let block_hashes = changes.removed.iter().map(|d| sink.hash(d)).collect();
            sink.emit(vec![KvEvent::BlockRemoved { block_hashes, medium: Some("GPU".into()) }]);
        }
    }

    pub fn release(&self, blocks: &[BlockId]) {
        if !blocks.is_empty() {
            self.state.lock().pool.release(blocks);
        }
    }

    /// `/reset_prefix_cache`: forgets every cached digest and publishes `AllBlocksCleared`.
    pub fn reset_prefix_cache(&self) {
        let mut state = self.state.lock();
        state.pool.clear_cache();
        if let Some(sink) = &self.events {
            sink.emit(vec![KvEvent::AllBlocksCleared]);
        }
    }

    /// Holds blocks for a decode engine that will pull them. With grants on and the decode's
    /// agent named, the blocks are fenced by a grant to it for the lease's duration; returns
    /// the grant's token (hex) for `kv_transfer_params`.
    pub fn start_lease(&self, request_id: String, blocks: Vec<BlockId>, decode_agent: Option<&str>) -> Option<String> {
        let fence = decode_agent.filter(|_| !self.cfg.no_kv_grants).and_then(|decode| self.grant(decode, &blocks));
        let token = fence.as_ref().map(|(grant, _)| grant.token_hex());
        let replaced = {
            let mut state = self.state.lock();
            let (_, replaced) = state.leases.insert(request_id, blocks, fence, Instant::now());
            replaced
        };
        add(&self.metrics.leases_started, 1);
        self.free(replaced);
        token
    }

    /// A grant to `decode` over exactly these blocks, with its deadline; `None` (logged) when
    /// the backend cannot issue one: the lease is then unfenced, as without grants.
    fn grant(&self, decode: &str, blocks: &[BlockId]) -> Option<(Grant, Instant)> {
        let ranges: Vec<xfer::Desc> = blocks.iter().map(|&id| self.memory.block_desc(id)).collect();
        let ttl = self.cfg.kv_lease;
        let deadline = Instant::now() + ttl;
        match self.agent.grant(decode, MemType::Dram, &ranges, ttl) {
            Ok(grant) => {
                add(&self.metrics.grants_issued, 1);
                Some((grant, deadline))
            }
            Err(err) => {
                tracing::warn!(%err, decode, "cannot grant the held blocks; holding them unfenced");
                None
            }
        }
    }

    /// Gives back what ended leases held: each grant is revoked (which waits until no
    /// transfer under it touches the blocks) before its blocks return to the pool.
    fn free(&self, released: impl IntoIterator<Item = Released<Grant>>) {
        let mut blocks = Vec::new();
        for Released { blocks: held, fence } in released {
            if let Some(grant) = fence {
                grant.revoke();
                add(&self.metrics.grants_revoked, 1);
            }
            blocks.extend(held);
        }
        self.release(&blocks);
    }

    /// Sidecar-pull mode: allocates `n` blocks for a co-located process to write into, held
    /// under a lease (id `res-…`) until a request adopts them or the lease expires.
    pub fn reserve_for_sidecar(&self, n: usize) -> Result<(String, Vec<BlockId>), PoolFull> {
        let mut changes = CacheChanges::default();
        let mut state = self.state.lock();
        let blocks = state.pool.allocate(n, &mut changes)?;
        self.emit_removed(changes);
        let id = format!("res-{}", random_hex(8));
        state.leases.insert(id.clone(), blocks.clone(), None, Instant::now());
        Ok((id, blocks))
    }

    /// Takes a sidecar reservation's blocks (now owned by the caller); `None` when unknown.
    pub fn take_reservation(&self, id: &str) -> Option<Vec<BlockId>> {
        let Released { blocks, fence } = self.state.lock().leases.remove(id)?;
        // Reservations are never fenced; a fence would be lifted here all the same.
        drop(fence);
        Some(blocks)
    }

    /// Handles the notifications the agent received and ends expired leases. Called by the
    /// notification thread; also by tests.
    pub fn service_notifications(&self, notifs: HashMap<String, Vec<Vec<u8>>>, now: Instant) {
        let mut ended = Vec::new();
        let mut state = self.state.lock();
        for msg in notifs.values().flatten() {
            if let Some(room) = crate::rooms::parse_room_done(msg) {
                state.rooms.mark_pulled(room);
                continue;
            }
            let Some(notif) = Notif::parse(msg) else {
                tracing::debug!(len = msg.len(), "ignoring an unknown notification");
                continue;
            };
            if matches!(notif, Notif::Heartbeat { .. }) {
                add(&self.metrics.heartbeats_received, 1);
            }
            if let Some(released) = state.leases.on_notif(&notif, now) {
                ended.push(released);
                add(&self.metrics.leases_done, 1);
            }
        }
        for (id, released) in state.leases.expire(now) {
            tracing::warn!(request_id = %id, blocks = released.blocks.len(), "KV lease expired before the decode pulled");
            ended.push(released);
            add(&self.metrics.expired_leases, 1);
        }
        // Revoking waits for transfers in flight: not under the pool's lock.
        drop(state);
        self.free(ended);
    }

    /// Runs the notification/lease thread until the engine is dropped.
    pub fn spawn_notification_thread(self: &Arc<Self>) {
        let weak = Arc::downgrade(self);
        let agent = self.agent.clone();
        std::thread::Builder::new()
            .name("xfer-notifs".into())
            .spawn(move || loop {
                agent.wait_notifs(Duration::from_millis(50));
                let Some(engine) = weak.upgrade() else { return };
                engine.service_notifications(agent.get_notifs(), Instant::now());
            })
            .expect("spawning the notification thread");
    }

    pub fn gauges(&self) -> Gauges {
        let state = self.state.lock();
        Gauges {
            running: self.running.load(Relaxed),
            waiting: self.waiting.load(Relaxed),
            kv_usage: state.pool.used() as f64 / state.pool.num_blocks() as f64,
            held_blocks: state.leases.held_blocks() + state.rooms.held_blocks(),
            leases: state.leases.len(),
            rooms: state.rooms.len(),
            block_size: self.cfg.block_size,
        }
    }
}

fn random_uuid() -> String {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b).expect("the OS random source");
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// A random lowercase hex string of `n` bytes.
pub fn random_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).expect("the OS random source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}
