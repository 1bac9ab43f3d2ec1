//! The engine: the UCP context, the worker and every endpoint, in one [`WorkerCell`] behind
//! one lock ([`Shared`]). Whoever holds the lock makes the UCP calls (the worker runs in
//! serialized mode):
//! - callers register, post and notify on their own thread, under the lock;
//! - a thread that waits for (or polls) a request drives the worker itself, through the
//!   [`Progress`] hook its request carries, so a request completes on the caller's thread
//!   with no hand-off between this process's threads, as in `ucx_perftest` (over TCP and
//!   shared memory the peer's progress thread still answers UCX's emulated put and get);
//! - a progress thread does the rest (incoming notifications, requests nobody waits for,
//!   timeouts while nobody drives): it polls while work is in flight and for `spin` after
//!   the last event, then sleeps on the worker's event fd. While a waiter drives, it stands
//!   back (parks), so the two never fight over the lock or a CPU.
//!
//! Requests are completed after the lock is released (see [`Finished`]): a completion's waker
//! or condition variable never runs under it.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use xfer_core::{BackendError, Completion, Desc, LocalRegion, MemType, NotifSink, Progress, RefusalCode, TransferJob};

use crate::config::{with_transport, ErrorMode, Settings};
use crate::conn::{Conn, Env, Finished, Job, PeerInfo, Waiter};
use crate::grants::{self, Held, UcxGrantKey, REMEMBER_AFTER_EXPIRY};
use crate::keys::{self, ProcessId, UcxRemoteKey};
use crate::msg::{self, Msg};
use crate::ucp::{self, AllocatedRange, Close, Config, Context, Event, MemHandle, Signaler, Worker, WorkerCell};

/// After a connection fails, how long its jobs wait for UCX to release their memory before
/// they complete anyway (the memory then stays pinned until UCX does).
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// Longest sleep while work is in flight, so timeouts are checked on time.
const BUSY_NAP: Duration = Duration::from_millis(50);
const IDLE_NAP: Duration = Duration::from_secs(1);
/// Progress calls in one pass.
const PROGRESS_BURST: usize = 64;
/// After a caller posted, the progress thread leaves the work to it this long, so that a
/// caller that goes on to wait drives its request alone: a woken progress thread that starts
/// progressing first takes the lock (and, on a busy machine, the caller's CPU) from it.
const HANDOFF_GRACE: Duration = Duration::from_micros(100);
/// A driving waiter gives up after `spin` without events and at least this many idle passes.
const MIN_IDLE_PASSES: u32 = 100;
const YIELD_AFTER_IDLE_PASSES: u32 = 16;
/// The progress thread naps this long once UCX refused this many arms in a row without any
/// event showing up in between.
const MAX_REFUSED_ARMS: u32 = 100;
const REFUSED_ARM_NAP: Duration = Duration::from_millis(1);
/// How often the grant tables are swept of long-expired entries.
const GRANT_SWEEP: Duration = Duration::from_secs(1);
/// Peer ids of grant holders (peers known from their `Hold`, not through the agent) start
/// here, apart from the backend's own.
const HOLDER_IDS: u64 = 1 << 62;

/// What the progress thread does instead of progressing.
enum Sleep {
    /// Wait on the armed worker's event fd this long at most.
    Nap(Duration),
    /// A caller posted since the last pass: progress again.
    Posted,
    /// UCX has events pending (it refused to arm): progress again.
    Pending,
}

fn stopped() -> BackendError {
    BackendError::Protocol("the ucx backend is shut down".into())
}

fn ucx_error(what: &str, status: ucp::Status) -> BackendError {
    BackendError::Protocol(format!("ucx {what}: {status}"))
}

/// What the engine's lock guards.
struct Slot {
    /// `None` once shut down.
    engine: Option<WorkerCell<Engine>>,
    /// After shutdown: the allocations applications still hold (with the UCP context they
    /// need), each unmapped when its buffer drops.
    leftover: Option<WorkerCell<Allocations>>,
}

/// Memory UCX allocated for applications ([`Engine::allocate`]), by allocation id.
#[derive(Default)]
pub struct Allocations(HashMap<u64, Allocated>);

/// One UCX allocation: its registration handle (shared with the registrations of regions
/// inside it, see [`Engine::register`]) and range.
struct Allocated {
    memh: Rc<MemHandle>,
    range: Desc,
}

/// The engine and the threads around it.
pub struct Shared {
    engine: Mutex<Slot>,
    signal: Signaler,
    /// The worker's event fd; valid while `engine` holds the worker, which outlives the
    /// progress thread (the only thread that waits on it).
    efd: RawFd,
    spin: Duration,
    /// Threads driving the worker from a wait right now.
    drivers: AtomicUsize,
    /// Whether work was in flight when the lock was last released.
    busy: AtomicBool,
    /// When a caller last posted, in nanoseconds since `epoch` (0: handed over, see
    /// [`HANDOFF_GRACE`]).
    posted_at: AtomicU64,
    epoch: Instant,
    /// The progress thread is (about to be) asleep on `efd`.
    sleeping: AtomicBool,
    stop: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    progress_thread: OnceLock<Thread>,
    /// What requests carry to let their waiters drive (holds a `Weak` of this).
    hook: OnceLock<Arc<dyn Progress>>,
}

/// A started engine and what it learned from UCX.
pub struct Started {
    pub shared: Arc<Shared>,
    pub address: Vec<u8>,
    pub cuda: bool,
}

/// Creates the UCX context and worker, and starts the progress thread.
pub fn start(agent_name: String, settings: Settings, notifs: NotifSink) -> Result<Started, BackendError> {
    let spin = settings.spin;
    let mut cell = WorkerCell::build(move || Engine::new(agent_name, settings, notifs))?;
    let (signal, efd, address, cuda) = cell.with(|engine| {
        let efd = engine.worker.event_fd().map_err(|s| ucx_error("worker event fd", s))?;
        let address = engine.worker.address().map_err(|s| ucx_error("worker address", s))?;
        Ok::<_, BackendError>((engine.worker.signaler(), efd, address, engine.cuda))
    })?;
    let shared = Arc::new(Shared {
        engine: Mutex::new(Slot { engine: Some(cell), leftover: None }),
        signal,
        efd,
        spin,
        drivers: AtomicUsize::new(0),
        busy: AtomicBool::new(false),
        posted_at: AtomicU64::new(0),
        epoch: Instant::now(),
        sleeping: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        thread: Mutex::new(None),
        progress_thread: OnceLock::new(),
        hook: OnceLock::new(),
    });
    let _ = shared.hook.set(Arc::new(Hook(Arc::downgrade(&shared))));
    let runner = Arc::clone(&shared);
    let thread = std::thread::Builder::new().name("xfer-ucx".into()).spawn(move || runner.run())?;
    let _ = shared.progress_thread.set(thread.thread().clone());
    *shared.thread.lock() = Some(thread);
    Ok(Started { shared, address, cuda })
}

/// The [`Progress`] hook requests carry. Weak, so a finished request kept by the user does not
/// keep the engine alive.
struct Hook(Weak<Shared>);

impl Progress for Hook {
    fn progress(&self) {
        if let Some(shared) = self.0.upgrade() {
            let now = Instant::now();
            let _ = shared.try_with(|engine| engine.pass(now));
        }
    }

    fn drive(&self, completion: &Completion, deadline: Instant) {
        if let Some(shared) = self.0.upgrade() {
            shared.drive_until(|| completion.is_finished(), deadline);
        }
    }
}

/// Between two idle passes: a pause, and after a few idle passes a yield, so that a spinning
/// thread lets the peer's thread run when CPUs are short (over shared memory and TCP, UCX
/// 1.13 emulates put and get with messages the peer's progress must answer). On an idle CPU
/// the yield returns at once.
fn relax(idle: u32) {
    if idle >= YIELD_AFTER_IDLE_PASSES {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

fn complete(finished: Finished) {
    for (done, result) in finished {
        done.complete(result);
    }
}

impl Shared {
    /// Runs `f` on the engine under the lock, then completes the requests it finished.
    pub fn with<R: Send>(&self, f: impl FnOnce(&mut Engine) -> R + Send) -> Result<R, BackendError> {
        let mut guard = self.engine.lock();
        let cell = guard.engine.as_mut().ok_or_else(stopped)?;
        let (result, busy, finished) = cell.with(|engine| engine.run_and_collect(f));
        drop(guard);
        self.busy.store(busy, Ordering::SeqCst);
        complete(finished);
        Ok(result)
    }

    /// Like [`with`](Self::with), but `None` when another thread holds the engine.
    pub fn try_with<R: Send>(&self, f: impl FnOnce(&mut Engine) -> R + Send) -> Option<Result<R, BackendError>> {
        let mut guard = self.engine.try_lock()?;
        let Some(cell) = guard.engine.as_mut() else { return Some(Err(stopped())) };
        let (result, busy, finished) = cell.with(|engine| engine.run_and_collect(f));
        drop(guard);
        self.busy.store(busy, Ordering::SeqCst);
        complete(finished);
        Some(Ok(result))
    }

    /// The hook for requests of this engine.
    pub fn hook(&self) -> Arc<dyn Progress> {
        Arc::clone(self.hook.get().expect("set at start"))
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX).max(1)
    }

    /// After a post that left work in flight: the progress thread takes it on unless the
    /// caller starts waiting (and so driving) within [`HANDOFF_GRACE`].
    pub fn posted(&self) {
        self.posted_at.store(self.nanos(Instant::now()), Ordering::SeqCst);
        self.kick();
    }

    /// Makes sure someone progresses work just handed to the engine: the progress thread, if
    /// it sleeps (a waiter that drives later makes it stand back again).
    pub fn kick(&self) {
        if let Some(thread) = self.progress_thread.get() {
            thread.unpark();
        }
        if self.sleeping.load(Ordering::SeqCst) {
            self.signal.signal();
        }
    }

    /// Progresses the worker on this thread until `done()`, `deadline`, or `spin` without any
    /// event (then the progress thread takes over and this thread is left to block).
    pub fn drive_until(&self, done: impl Fn() -> bool, deadline: Instant) {
        self.drivers.fetch_add(1, Ordering::SeqCst);
        let mut last_active = Instant::now();
        // Idle passes since the last event: a thread descheduled for longer than `spin` must
        // still look a few times before it concludes that nothing happens.
        let mut idle = 0u32;
        while !done() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            match self.try_with(|engine| engine.pass(now)) {
                Some(Ok(true)) => {
                    last_active = now;
                    idle = 0;
                }
                Some(Err(_)) => break,
                Some(Ok(false)) | None => idle = idle.saturating_add(1),
            }
            if idle >= MIN_IDLE_PASSES && now.saturating_duration_since(last_active) >= self.spin {
                break;
            }
            relax(idle);
        }
        let last = self.drivers.fetch_sub(1, Ordering::SeqCst) == 1;
        if last && (!done() || self.busy.load(Ordering::SeqCst)) {
            // Handed over: no grace.
            self.posted_at.store(0, Ordering::SeqCst);
            self.kick();
        }
    }

    /// The progress thread.
    fn run(&self) {
        let mut last_active = Instant::now();
        // Arms refused in a row with nothing happening in between.
        let mut refused_arms = 0u32;
        while !self.stop.load(Ordering::Acquire) {
            if self.drivers.load(Ordering::SeqCst) > 0 {
                std::thread::park_timeout(BUSY_NAP);
                // Sleep at once if the driver left nothing to do.
                last_active = Instant::now().checked_sub(self.spin).unwrap_or(last_active);
                continue;
            }
            let now = Instant::now();
            let since_post = self.nanos(now).saturating_sub(self.posted_at.load(Ordering::SeqCst));
            if since_post < HANDOFF_GRACE.as_nanos() as u64 {
                std::thread::park_timeout(HANDOFF_GRACE - Duration::from_nanos(since_post));
                continue;
            }
            match self.with(|engine| engine.pass(now)) {
                Err(_) => return,
                Ok(true) => {
                    last_active = now;
                    refused_arms = 0;
                    continue;
                }
                Ok(false) => {}
            }
            if now.saturating_duration_since(last_active) < self.spin {
                relax(MIN_IDLE_PASSES);
                continue;
            }
            // Announced before arming: a thread that posts after the arm sees it and signals.
            self.sleeping.store(true, Ordering::SeqCst);
            match self.with(|engine| engine.prepare_sleep(Instant::now())) {
                Ok(Sleep::Nap(nap)) => {
                    refused_arms = 0;
                    if self.drivers.load(Ordering::SeqCst) == 0 && !self.stop.load(Ordering::Acquire) {
                        ucp::wait_readable(self.efd, nap);
                    }
                }
                Ok(Sleep::Posted) => {}
                // UCX reports events that progress then does not find (seen with a shared-memory
                // peer killed mid-message): back off rather than spin a CPU on it.
                Ok(Sleep::Pending) => {
                    refused_arms += 1;
                    if refused_arms > MAX_REFUSED_ARMS {
                        std::thread::sleep(REFUSED_ARM_NAP);
                    }
                }
                Err(_) => return,
            }
            self.sleeping.store(false, Ordering::SeqCst);
        }
    }

    /// Stops the progress thread, fails the work in flight (giving UCX a grace time to let go
    /// of its memory) and destroys the worker and context. Later calls fail.
    pub fn shutdown(&self) {
        if self.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        self.sleeping.store(true, Ordering::SeqCst);
        self.kick();
        if let Some(thread) = self.thread.lock().take() {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
        let deadline = Instant::now() + RELEASE_GRACE;
        let _ = self.with(Engine::fail_everything);
        while let Ok(false) = self.with(|engine| {
            engine.pass(Instant::now());
            engine.drained()
        }) {
            if Instant::now() >= deadline {
                break;
            }
            std::thread::yield_now();
        }
        let _ = self.with(|engine| engine.give_up(deadline + RELEASE_GRACE));
        // The worker, endpoints and registrations go; allocations that applications still
        // hold stay mapped (with the context) until their buffers drop. Requests posted since
        // are failed, and completed once the lock is released.
        let finished = {
            let mut slot = self.engine.lock();
            let Some(cell) = slot.engine.take() else { return };
            let (leftover, finished) = cell.map(Engine::into_leftover);
            slot.leftover = Some(leftover);
            finished
        };
        complete(finished);
    }

    /// Releases allocation `id` (its buffer was dropped): unmapped now, or once the last
    /// registration inside it is gone.
    pub fn release_allocation(&self, id: u64) {
        let mut slot = self.engine.lock();
        let Slot { engine, leftover } = &mut *slot;
        if let Some(cell) = engine.as_mut() {
            cell.with(|engine| engine.release_allocation(id));
        } else if let Some(cell) = leftover.as_mut() {
            cell.with(|allocations| {
                allocations.0.remove(&id);
            });
        }
    }
}

pub struct Engine {
    agent_name: String,
    settings: Settings,
    notifs: NotifSink,
    /// Requests finished under the lock, completed once it is released.
    finished: Finished,
    /// A request was posted since the last pass: the progress thread must not sleep yet.
    posted: bool,
    // Field order is drop order: endpoints and registrations before the worker and context.
    conns: HashMap<u64, Conn>,
    by_ep: HashMap<usize, u64>,
    dying: Vec<Job>,
    closing: Vec<Close>,
    acks: Vec<ucp::Send>,
    regions: HashMap<u64, Rc<MemHandle>>,
    /// Grants this side issued, by grant id (their handles unmap when they go).
    issued: HashMap<u64, Issued>,
    /// Grants this side holds (or heard revoked), by grant id.
    held: HashMap<u64, Held>,
    /// Holders of our grants, by worker address: where revocations go.
    holders: HashMap<Vec<u8>, Arc<PeerInfo>>,
    grants_swept: Instant,
    process: ProcessId,
    allocations: Allocations,
    next_key: u64,
    next_allocation: u64,
    next_seq: u64,
    cuda: bool,
    worker: Worker,
    ctx: Context,
}

/// An [`Env`] borrowing the engine's fields (a macro: a method would borrow all of `self`).
macro_rules! env {
    ($engine:expr) => {
        Env {
            agent_name: &$engine.agent_name,
            regions: &$engine.regions,
            max_op_bytes: $engine.settings.max_op_bytes,
            cuda: $engine.cuda,
            next_seq: &mut $engine.next_seq,
            finished: &mut $engine.finished,
            held: &$engine.held,
        }
    };
}

/// A grant this side issued (module `grants`).
struct Issued {
    region_id: u64,
    peer: String,
    deadline_ms: u64,
    /// One per granted range; dropping them unmaps the ranges' rkeys.
    _memhs: Vec<MemHandle>,
    /// Who announced itself as holding it (`Hold`).
    holders: Vec<Arc<PeerInfo>>,
    /// Being revoked: no new holder.
    revoked: bool,
}

impl Engine {
    fn new(agent_name: String, settings: Settings, notifs: NotifSink) -> Result<Engine, BackendError> {
        let mut config = Config::from_env().map_err(|s| ucx_error("reading the configuration", s))?;
        for (name, value) in &settings.ucx_options(|name| std::env::var(name).ok()) {
            let applied = config.set(name, value).or_else(|status| match with_transport(name) {
                Some(full_name) => config.set(&full_name, value),
                None => Err(status),
            });
            applied.map_err(|status| BackendError::InvalidParam {
                name: name.to_ascii_lowercase(),
                reason: format!("UCX_{name}={value}: {status}"),
            })?;
        }
        let ctx = Context::new(&config).map_err(|s| ucx_error("init (check UCX_TLS / tls)", s))?;
        let worker = Worker::new(&ctx).map_err(|s| ucx_error("worker", s))?;
        Ok(Engine {
            agent_name,
            notifs,
            finished: Vec::new(),
            posted: false,
            conns: HashMap::new(),
            by_ep: HashMap::new(),
            dying: Vec::new(),
            closing: Vec::new(),
            acks: Vec::new(),
            regions: HashMap::new(),
            issued: HashMap::new(),
            held: HashMap::new(),
            holders: HashMap::new(),
            grants_swept: Instant::now(),
            process: ProcessId::current(),
            allocations: Allocations::default(),
            next_key: 1,
            next_allocation: 1,
            next_seq: 1,
            cuda: ctx.supports_cuda(),
            worker,
            ctx,
            settings,
        })
    }

    fn run_and_collect<R>(&mut self, f: impl FnOnce(&mut Engine) -> R) -> (R, bool, Finished) {
        let result = f(self);
        (result, self.busy(), std::mem::take(&mut self.finished))
    }

    /// Whether anything is in flight.
    fn busy(&self) -> bool {
        !self.dying.is_empty()
            || !self.closing.is_empty()
            || !self.acks.is_empty()
            || self.conns.values().any(Conn::is_busy)
            || self.worker.has_parked()
    }

    /// One round of progress: the worker until quiet (or a burst is done), its events, the
    /// transfers; `true` when anything moved.
    pub fn pass(&mut self, now: Instant) -> bool {
        self.posted = false;
        let mut active = false;
        for _ in 0..PROGRESS_BURST {
            let count = self.worker.progress();
            // Events are handled before the next progress call: replies need that.
            let events = self.worker.take_events();
            if count == 0 && events.is_empty() {
                break;
            }
            active = true;
            for event in events {
                self.on_event(event);
            }
        }
        active | self.poll_work(now)
    }

    /// Arms the worker for the progress thread's sleep; the nap, or `None` to poll again.
    fn prepare_sleep(&mut self, now: Instant) -> Sleep {
        if self.posted {
            return Sleep::Posted;
        }
        match self.worker.arm() {
            Ok(true) => {}
            Ok(false) => return Sleep::Pending,
            Err(status) => {
                tracing::warn!(%status, "ucp_worker_arm failed; polling");
                return Sleep::Pending;
            }
        }
        let mut nap = if self.busy() { BUSY_NAP } else { IDLE_NAP };
        if let Some(deadline) = self.conns.values().filter_map(|c| c.deadline(self.settings.timeout)).min() {
            nap = nap.min(deadline.saturating_duration_since(now));
        }
        Sleep::Nap(nap)
    }

    pub fn register(&mut self, region: &LocalRegion) -> Result<Vec<u8>, BackendError> {
        let desc = region.desc();
        let cuda = match region.mem_type() {
            MemType::Dram => false,
            MemType::Vram if self.cuda => true,
            MemType::Vram => {
                return Err(BackendError::Unsupported(
                    "VRAM through ucx: this UCX build has no CUDA support (ucx_info -v shows its configure line)"
                        .into(),
                ))
            }
            other => return Err(BackendError::Unsupported(format!("ucx moves DRAM and VRAM, not {other}"))),
        };
        // A region inside one of our allocations uses the allocation's handle: its key then
        // lets a peer on this host map the memory (mapping the range again would not).
        let inside = self.allocations.0.values().find(|a| !cuda && a.range.contains(&desc));
        let memh = match inside {
            Some(allocated) => Rc::clone(&allocated.memh),
            None => Rc::new(self.ctx.mem_map(desc.addr, desc.len, cuda).map_err(|s| ucx_error("mem_map", s))?),
        };
        let packed = memh.pack_rkey().map_err(|s| ucx_error("rkey_pack", s))?;
        let key_id = self.next_key;
        self.next_key += 1;
        self.regions.insert(region.id(), memh);
        Ok(UcxRemoteKey { key_id, base: desc.addr, len: desc.len, packed }.encode())
    }

    /// The key of a region this UCX cannot expose (see `UcxRemoteKey::is_local_only`): nothing
    /// is mapped; its jobs are staged.
    pub fn register_local_only(&mut self, region: &LocalRegion) -> Vec<u8> {
        let desc = region.desc();
        let key_id = self.next_key;
        self.next_key += 1;
        UcxRemoteKey { key_id, base: desc.addr, len: desc.len, packed: Vec::new() }.encode()
    }

    pub fn deregister(&mut self, region_id: u64) {
        self.regions.remove(&region_id);
        // The region is closed and idle: its grants go without waiting for their holders.
        let gone: Vec<u64> = self.issued.iter().filter(|(_, g)| g.region_id == region_id).map(|(id, _)| *id).collect();
        let (ignored, _) = crossbeam_channel::unbounded();
        for grant_id in gone {
            self.revoke_grant(grant_id, &ignored);
            self.release_grant(grant_id);
        }
    }

    /// Issues a grant (module `grants`): each range (absolute, merged) mapped again for an
    /// rkey of its own; returns the grant's key.
    pub fn grant(
        &mut self,
        region: &LocalRegion,
        peer: &str,
        ranges: &[(u64, u64)],
        deadline_ms: u64,
    ) -> Result<Vec<u8>, BackendError> {
        if !self.regions.contains_key(&region.id()) {
            return Err(BackendError::Unsupported("ucx grants only memory registered with ucx".into()));
        }
        if peer.len() > 255 || ranges.len() >= grants::MAX_PIECES {
            return Err(BackendError::InvalidParam {
                name: "grant".into(),
                reason: "peer name over 255 bytes or too many ranges".into(),
            });
        }
        let cuda = region.mem_type() == MemType::Vram;
        let mut memhs = Vec::with_capacity(ranges.len());
        let mut pieces = Vec::with_capacity(ranges.len());
        for &(addr, len) in ranges {
            let memh = self.ctx.mem_map(addr, len, cuda).map_err(|s| ucx_error("mem_map (grant)", s))?;
            let packed = memh.pack_rkey().map_err(|s| ucx_error("rkey_pack (grant)", s))?;
            pieces.push(UcxRemoteKey { key_id: self.next_key, base: addr, len, packed });
            self.next_key += 1;
            memhs.push(memh);
        }
        let grant_id = grants::fresh_id(self.next_key);
        let key = UcxGrantKey { grant_id, deadline_ms, peer: peer.to_string(), pieces };
        let issued = Issued {
            region_id: region.id(),
            peer: peer.to_string(),
            deadline_ms,
            _memhs: memhs,
            holders: Vec::new(),
            revoked: false,
        };
        self.issued.insert(grant_id, issued);
        Ok(key.encode())
    }

    /// Starts revoking a grant: it takes no new holder, and each holder is sent `Revoke`, its
    /// answer going to `reply`. Returns how many answers to expect.
    pub fn revoke_grant(&mut self, grant_id: u64, reply: &Sender<Result<(), BackendError>>) -> usize {
        let Some(issued) = self.issued.get_mut(&grant_id).filter(|issued| !issued.revoked) else { return 0 };
        issued.revoked = true;
        let holders = issued.holders.clone();
        self.posted = true;
        let mut env = env!(self);
        for holder in &holders {
            match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, holder) {
                Ok(conn) => {
                    conn.request(|seq| Ok(msg::encode_revoke(seq, grant_id)), Waiter::Caller(reply.clone()), &mut env)
                }
                Err(err) => _ = reply.send(Err(err)),
            }
        }
        holders.len()
    }

    /// Forgets a grant: its ranges' handles are unmapped.
    pub fn release_grant(&mut self, grant_id: u64) {
        self.issued.remove(&grant_id);
    }

    /// Announces this side to `peer` as the holder of `grant`; `reply` gets the answer.
    pub fn hold(
        &mut self,
        peer: &Arc<PeerInfo>,
        grant: &UcxGrantKey,
        conn_info: &[u8],
        reply: Sender<Result<(), BackendError>>,
    ) {
        self.posted = true;
        let left = Duration::from_millis(grant.deadline_ms.saturating_sub(grants::unix_ms(SystemTime::now())));
        let forget_after = Instant::now() + left + REMEMBER_AFTER_EXPIRY;
        // Known already when a revocation overtook the hold, or the token loads again: a
        // revoked grant stays revoked.
        let held = self.held.entry(grant.grant_id).or_insert(Held {
            peer_id: None,
            key_ids: Vec::new(),
            revoked: false,
            forget_after,
        });
        held.peer_id = Some(peer.id);
        held.key_ids = grant.key_ids();
        let mut env = env!(self);
        let holder = env.agent_name;
        match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, peer) {
            Ok(conn) => conn.request(
                |seq| msg::encode_hold(seq, holder, grant.grant_id, conn_info),
                Waiter::Caller(reply),
                &mut env,
            ),
            Err(err) => _ = reply.send(Err(err)),
        }
    }

    /// Marks a held grant revoked (its hold was refused or failed).
    pub fn mark_revoked(&mut self, grant_id: u64) {
        if let Some(held) = self.held.get_mut(&grant_id) {
            held.revoked = true;
        }
    }

    /// A `Hold` from a peer: admitted when the grant is live and the peer's name is the one it
    /// was granted to; the peer is remembered as a holder, to be told of the revocation.
    fn on_hold(&mut self, holder: String, grant_id: u64, conn_info: &[u8]) -> bool {
        let now_ms = grants::unix_ms(SystemTime::now());
        let Some(issued) = self.issued.get_mut(&grant_id) else { return false };
        if issued.revoked || issued.peer != holder || now_ms >= issued.deadline_ms {
            return false;
        }
        let Ok(info) = keys::decode_conn_info(conn_info) else { return false };
        let next_id = HOLDER_IDS + self.holders.len() as u64;
        let peer = self.holders.entry(info.address.clone()).or_insert_with(|| {
            Arc::new(PeerInfo {
                id: next_id,
                name: holder,
                address: info.address,
                local_pid: info.process.local_pid(&self.process),
                closed: AtomicBool::new(false),
            })
        });
        if !issued.holders.iter().any(|known| Arc::ptr_eq(known, peer)) {
            issued.holders.push(Arc::clone(peer));
        }
        true
    }

    /// A `Revoke` from the target of a grant this side holds: refused from now on, and
    /// acknowledged once the connection's jobs in flight are done (or at once without one).
    fn on_revoke(&mut self, seq: u64, grant_id: u64, reply: Option<ucp::ReplyTo>) {
        let held = self.held.entry(grant_id).or_insert(Held {
            peer_id: None,
            key_ids: Vec::new(),
            revoked: true,
            forget_after: Instant::now() + REMEMBER_AFTER_EXPIRY,
        });
        held.revoked = true;
        if let Some(conn) = held.peer_id.and_then(|id| self.conns.get_mut(&id)) {
            return conn.revoke_after_earlier_jobs(seq, held.key_ids.clone());
        }
        let Some(reply) = reply else { return tracing::warn!(grant_id, "cannot acknowledge a revocation") };
        match self.worker.reply(&reply, msg::encode_ack(seq)) {
            Ok(send) => self.acks.push(send),
            Err(status) => tracing::warn!(%status, grant_id, "cannot acknowledge a revocation"),
        }
    }

    /// Forgets grants long past their deadline: held ones refuse by then anyway; issued ones
    /// the application never revoked go (their holders refuse them by their own clock).
    fn sweep_grants(&mut self, now: Instant) {
        if now.saturating_duration_since(self.grants_swept) < GRANT_SWEEP {
            return;
        }
        self.grants_swept = now;
        self.held.retain(|_, held| now < held.forget_after);
        let forget_before = grants::unix_ms(SystemTime::now() - REMEMBER_AFTER_EXPIRY);
        self.issued.retain(|_, issued| issued.deadline_ms > forget_before);
    }

    /// Has UCX allocate and register `len` bytes of host memory; returns the allocation's id
    /// and the range UCX allocated (at least `len` bytes).
    pub fn allocate(&mut self, len: u64) -> Result<(u64, AllocatedRange), BackendError> {
        let (memh, range) = self.ctx.mem_alloc(len).map_err(|s| ucx_error("mem_map (allocate)", s))?;
        let id = self.next_allocation;
        self.next_allocation += 1;
        let desc = Desc::new(range.addr(), range.len(), 0);
        self.allocations.0.insert(id, Allocated { memh: Rc::new(memh), range: desc });
        Ok((id, range))
    }

    /// Forgets an allocation: unmapped now, or once the registrations inside it are gone.
    pub fn release_allocation(&mut self, id: u64) {
        self.allocations.0.remove(&id);
    }

    /// What outlives a shutdown: the allocations. Everything else drops here; requests still
    /// around (posted after the shutdown began) fail, returned to complete outside the lock.
    fn into_leftover(mut self) -> (Allocations, Finished) {
        self.fail_everything();
        // Past every job's release grace, so each completes (with its error) rather than drops.
        self.give_up(Instant::now() + 2 * RELEASE_GRACE);
        let finished = std::mem::take(&mut self.finished);
        (std::mem::take(&mut self.allocations), finished)
    }

    /// Posts a transfer's operations (and, when they complete at once, as they do over shared
    /// memory, completes it); `visible` as in [`Conn::start`]. Returns whether the job is still
    /// in flight: refused or completed at once, nobody has to progress it.
    pub fn post(&mut self, peer: &Arc<PeerInfo>, job: TransferJob, visible: bool) -> bool {
        self.posted = true;
        if job.done.is_cancelled() {
            self.finished.push((job.done, Err(BackendError::Cancelled)));
            return false;
        }
        let mut env = env!(self);
        match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, peer) {
            Ok(conn) => {
                let queued = conn.start(job, visible, &mut env);
                conn.poll(&mut env);
                queued && conn.last_job_in_flight()
            }
            Err(err) => {
                env.finished.push((job.done, Err(err)));
                false
            }
        }
    }

    /// Sends a standalone notification; `reply` gets the outcome once the peer acknowledges.
    pub fn notify(&mut self, peer: &Arc<PeerInfo>, message: &[u8], reply: Sender<Result<(), BackendError>>) {
        self.posted = true;
        let mut env = env!(self);
        match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, peer) {
            Ok(conn) => conn.notify(message, Waiter::Caller(reply), &mut env),
            Err(err) => _ = reply.send(Err(err)),
        }
    }

    pub fn disconnect(&mut self, peer: &PeerInfo) {
        self.fail_conn(peer.id, || peer.disconnected("disconnected by the agent"));
    }

    fn on_event(&mut self, event: Event) {
        match event {
            Event::EndpointFailed { ep, status } => {
                if let Some(&peer_id) = self.by_ep.get(&ep) {
                    let Some(peer) = self.conns.get(&peer_id).map(|c| Arc::clone(&c.peer)) else { return };
                    tracing::debug!(peer = %peer.name, %status, "ucx endpoint failed");
                    self.fail_conn(peer_id, || peer.failure("endpoint", status));
                }
            }
            Event::Message { payload, reply } => match msg::decode(&payload) {
                Ok(Msg::Hold { seq, holder, grant_id, conn_info }) => {
                    let admitted = self.on_hold(holder, grant_id, &conn_info);
                    let answer = if admitted { msg::encode_ack(seq) } else { msg::encode_refused(seq) };
                    let Some(reply) = reply else { return };
                    match self.worker.reply(&reply, answer) {
                        Ok(send) => self.acks.push(send),
                        Err(status) => tracing::warn!(%status, grant_id, "cannot answer a grant's holder"),
                    }
                }
                Ok(Msg::Revoke { seq, grant_id }) => self.on_revoke(seq, grant_id, reply),
                Ok(Msg::Refused { seq }) => {
                    let refused = || BackendError::Refused {
                        code: RefusalCode::Revoked,
                        message: "the grant is revoked, expired, or not granted to this agent".into(),
                    };
                    self.answered(seq, Err(refused()));
                }
                Ok(Msg::Notif { seq, sender, message }) => {
                    (self.notifs)(&sender, message);
                    let Some(reply) = reply else { return };
                    match self.worker.reply(&reply, msg::encode_ack(seq)) {
                        Ok(send) => self.acks.push(send),
                        Err(status) => tracing::warn!(%status, %sender, "cannot acknowledge a notification"),
                    }
                }
                Ok(Msg::Ack { seq }) => self.answered(seq, Ok(())),
                Err(err) => tracing::warn!(%err, "ignoring a malformed ucx message"),
            },
        }
    }

    /// An answer to one of our messages (a notification, hold or revocation) arrived.
    fn answered(&mut self, seq: u64, result: Result<(), BackendError>) {
        match self.conns.values_mut().find(|conn| conn.waits_for(seq)) {
            Some(conn) => conn.acknowledged(seq, result, &mut self.finished),
            None => tracing::debug!(seq, "an answer to a message nobody waits for"),
        }
    }

    /// Advances transfers, times out silent connections, finishes failed jobs and sends.
    fn poll_work(&mut self, now: Instant) -> bool {
        self.sweep_grants(now);
        let mut progressed = false;
        let mut timed_out = Vec::new();
        let mut env = env!(self);
        for (id, conn) in &mut self.conns {
            progressed |= conn.poll(&mut env);
            if conn.deadline(self.settings.timeout).is_some_and(|deadline| now >= deadline) {
                timed_out.push(*id);
            }
        }
        let timeout = self.settings.timeout;
        for id in timed_out {
            tracing::debug!(peer = id, ?timeout, "ucx connection made no progress; closing it");
            self.fail_conn(id, || BackendError::TimedOut(timeout));
        }
        let before = self.dying.len();
        let finished = &mut self.finished;
        self.dying.retain_mut(|job| !job.poll_dying(now, finished));
        progressed |= self.dying.len() != before;
        self.closing.retain_mut(|close| close.poll().is_none());
        self.acks.retain_mut(|send| send.poll().is_none());
        progressed
    }

    /// Tears a connection down: its endpoint is force-closed (UCX fails what is in flight),
    /// its jobs finish with `err` once UCX lets go of their memory. The next request to the
    /// peer connects afresh.
    fn fail_conn(&mut self, peer_id: u64, err: impl Fn() -> BackendError) {
        let Some(mut conn) = self.conns.remove(&peer_id) else { return };
        self.by_ep.remove(&conn.ep.id());
        let jobs = conn.fail_all(&err, Instant::now() + RELEASE_GRACE, &mut self.finished);
        self.dying.extend(jobs);
        let Conn { ep, .. } = conn;
        self.closing.push(ep.close(true));
    }

    fn fail_everything(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.fail_conn(id, || BackendError::PeerDisconnected {
                peer: String::new(),
                reason: "the ucx backend shut down".into(),
            });
        }
    }

    fn drained(&self) -> bool {
        self.dying.is_empty() && self.closing.is_empty()
    }

    /// Finishes every failed job, whether UCX let go of its memory or not.
    fn give_up(&mut self, at: Instant) {
        let finished = &mut self.finished;
        for mut job in self.dying.drain(..) {
            job.poll_dying(at, finished);
        }
    }
}

/// The live connection to a peer, created on first use.
fn conn_for<'a>(
    conns: &'a mut HashMap<u64, Conn>,
    by_ep: &mut HashMap<usize, u64>,
    worker: &Worker,
    mode: &mut ErrorMode,
    peer: &Arc<PeerInfo>,
) -> Result<&'a mut Conn, BackendError> {
    if peer.is_closed() {
        return Err(peer.disconnected("disconnected by the agent"));
    }
    match conns.entry(peer.id) {
        Entry::Occupied(entry) => Ok(entry.into_mut()),
        Entry::Vacant(entry) => {
            let first = match *mode {
                ErrorMode::Auto => worker.connect_probing(&peer.address, peer.local_pid),
                _ => worker.connect(&peer.address, *mode == ErrorMode::Peer, peer.local_pid),
            };
            let ep = match first {
                Err(status) if status.is_unreachable() && *mode == ErrorMode::Auto => {
                    // Asked once per backend: the transports are fixed.
                    tracing::info!("ucx: no transport detects peer failure; dead peers end by timeout_ms");
                    *mode = ErrorMode::None;
                    worker.connect(&peer.address, false, peer.local_pid)
                }
                other => other,
            };
            // Whatever the status, the peer cannot be reached (a dead process's shared memory
            // is gone, its address unreachable).
            let ep = ep.map_err(|status| peer.disconnected(format!("endpoint creation: {status}")))?;
            by_ep.insert(ep.id(), peer.id);
            Ok(entry.insert(Conn::new(Arc::clone(peer), ep)))
        }
    }
}
