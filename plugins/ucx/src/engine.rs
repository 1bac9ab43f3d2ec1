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
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use parking_lot::Mutex;
use xfer_core::{BackendError, Completion, Desc, LocalRegion, MemType, NotifSink, Progress, TransferJob};

use crate::config::{ErrorMode, Settings};
use crate::conn::{Conn, Env, Finished, Job, PeerInfo, Waiter};
use crate::keys::UcxRemoteKey;
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

    /// Whether work was in flight when the engine was last released.
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst)
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
        }
    };
}

impl Engine {
    fn new(agent_name: String, settings: Settings, notifs: NotifSink) -> Result<Engine, BackendError> {
        let mut config = Config::from_env().map_err(|s| ucx_error("reading the configuration", s))?;
        for (name, value) in &settings.ucx_options(|name| std::env::var(name).ok()) {
            config.set(name, value).map_err(|status| BackendError::InvalidParam {
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
    /// memory, completes it); `visible` as in [`Conn::start`].
    pub fn post(&mut self, peer: &Arc<PeerInfo>, job: TransferJob, visible: bool) {
        self.posted = true;
        if job.done.is_cancelled() {
            return self.finished.push((job.done, Err(BackendError::Cancelled)));
        }
        let mut env = env!(self);
        match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, peer) {
            Ok(conn) => {
                conn.start(job, visible, &mut env);
                conn.poll(&mut env);
            }
            Err(err) => env.finished.push((job.done, Err(err))),
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
                Ok(Msg::Notif { seq, sender, message }) => {
                    (self.notifs)(&sender, message);
                    let Some(reply) = reply else { return };
                    match self.worker.reply(&reply, msg::encode_ack(seq)) {
                        Ok(send) => self.acks.push(send),
                        Err(status) => tracing::warn!(%status, %sender, "cannot acknowledge a notification"),
                    }
                }
                Ok(Msg::Ack { seq }) => {
                    let finished = &mut self.finished;
                    if !self.conns.values_mut().any(|conn| conn.acknowledged(seq, finished)) {
                        tracing::debug!(seq, "acknowledgement of a notification nobody waits for");
                    }
                }
                Err(err) => tracing::warn!(%err, "ignoring a malformed ucx message"),
            },
        }
    }

    /// Advances transfers, times out silent connections, finishes failed jobs and sends.
    fn poll_work(&mut self, now: Instant) -> bool {
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
            let ep = match worker.connect(&peer.address, *mode != ErrorMode::None, peer.local_pid) {
                Err(status) if status.is_unreachable() && *mode == ErrorMode::Auto => {
                    // Asked once per backend (UCX logs the refusal): the transports are fixed.
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
