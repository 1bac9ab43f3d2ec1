//! The progress thread: it owns the UCP context, the worker and every endpoint, and makes all
//! UCP calls (the worker runs in single-thread mode). Other threads hand it [`Command`]s over a
//! channel and wake it with `ucp_worker_signal`. It polls while work is in flight and for a
//! short spin after the last event, then sleeps on the worker's event file descriptor.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};
use parking_lot::Mutex;
use xfer_core::{BackendError, LocalRegion, MemType, NotifSink, TransferJob};

use crate::config::{ErrorMode, Settings};
use crate::conn::{Conn, Env, Job, PeerInfo, Waiter};
use crate::keys::UcxRemoteKey;
use crate::msg::{self, Msg};
use crate::ucp::{self, Close, Config, Context, Event, MemHandle, Signaler, Worker};

/// How long the backend waits for the progress thread to start or answer a registration.
pub const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// After a connection fails, how long its jobs wait for UCX to release their memory before
/// they complete anyway (the memory then stays pinned until UCX does).
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// Longest sleep while work is in flight, so timeouts are checked on time.
const BUSY_NAP: Duration = Duration::from_millis(50);
const IDLE_NAP: Duration = Duration::from_secs(1);
/// Progress calls before commands are looked at again.
const PROGRESS_BURST: usize = 64;

pub enum Command {
    Register { region: Arc<LocalRegion>, reply: Sender<Result<Vec<u8>, BackendError>> },
    Deregister { region_id: u64, reply: Sender<()> },
    Post { peer: Arc<PeerInfo>, job: TransferJob },
    Notify { peer: Arc<PeerInfo>, message: Vec<u8>, reply: Sender<Result<(), BackendError>> },
    Disconnect { peer: Arc<PeerInfo> },
    Shutdown,
}

/// The other threads' side of the progress thread.
pub struct Handle {
    commands: Sender<Command>,
    signal: Signaler,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Handle {
    /// Queues a command and wakes the thread; gives the command back once it has stopped.
    pub fn send(&self, command: Command) -> Result<(), Command> {
        self.commands.send(command).map_err(|e| e.0)?;
        self.signal.signal();
        Ok(())
    }

    /// Stops the thread: connections close, work in flight fails.
    pub fn shutdown(&self) {
        let _ = self.send(Command::Shutdown);
        if let Some(thread) = self.thread.lock().take() {
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// A started progress thread and what it learned from UCX.
pub struct Started {
    pub handle: Handle,
    pub address: Vec<u8>,
    pub cuda: bool,
}

/// Creates the UCX context and worker on a new progress thread.
pub fn start(agent_name: String, settings: Settings, notifs: NotifSink) -> Result<Started, BackendError> {
    let (init_tx, init_rx) = crossbeam_channel::bounded(1);
    let (commands, receiver) = crossbeam_channel::unbounded();
    let thread = std::thread::Builder::new().name("xfer-ucx".into()).spawn(move || {
        let engine = match Engine::new(agent_name, settings, notifs, receiver) {
            Ok(engine) => engine,
            Err(err) => {
                let _ = init_tx.send(Err(err));
                return;
            }
        };
        let ready = engine.worker.address().map(|address| (engine.worker.signaler(), address, engine.cuda));
        let ready = ready.map_err(|status| BackendError::Protocol(format!("ucx worker address: {status}")));
        let ok = ready.is_ok();
        if init_tx.send(ready).is_ok() && ok {
            engine.run();
        }
    })?;
    let (signal, address, cuda) = init_rx
        .recv_timeout(CONTROL_TIMEOUT)
        .map_err(|_| BackendError::Protocol("the ucx progress thread did not start".into()))??;
    Ok(Started { handle: Handle { commands, signal, thread: Mutex::new(Some(thread)) }, address, cuda })
}

struct Engine {
    agent_name: String,
    settings: Settings,
    notifs: NotifSink,
    commands: Receiver<Command>,
    // Field order is drop order: endpoints and registrations before the worker and context.
    conns: HashMap<u64, Conn>,
    by_ep: HashMap<usize, u64>,
    dying: Vec<Job>,
    closing: Vec<Close>,
    acks: Vec<ucp::Send>,
    regions: HashMap<u64, MemHandle>,
    next_key: u64,
    next_seq: u64,
    cuda: bool,
    worker: Worker,
    ctx: Context,
}

fn ucx_error(what: &str, status: ucp::Status) -> BackendError {
    BackendError::Protocol(format!("ucx {what}: {status}"))
}

impl Engine {
    fn new(
        agent_name: String,
        settings: Settings,
        notifs: NotifSink,
        commands: Receiver<Command>,
    ) -> Result<Engine, BackendError> {
        let mut config = Config::from_env().map_err(|s| ucx_error("reading the configuration", s))?;
        for (name, value) in &settings.ucx {
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
            commands,
            conns: HashMap::new(),
            by_ep: HashMap::new(),
            dying: Vec::new(),
            closing: Vec::new(),
            acks: Vec::new(),
            regions: HashMap::new(),
            next_key: 1,
            next_seq: 1,
            cuda: ctx.supports_cuda(),
            worker,
            ctx,
            settings,
        })
    }

    fn run(mut self) {
        let mut last_activity = Instant::now();
        loop {
            let mut active = false;
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Shutdown) | Err(TryRecvError::Disconnected) => return self.shutdown(),
                    Ok(command) => {
                        self.handle(command);
                        active = true;
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            active |= self.progress();
            active |= self.poll_work(Instant::now());
            let now = Instant::now();
            if active {
                last_activity = now;
                continue;
            }
            if now - last_activity < self.settings.spin {
                std::hint::spin_loop();
                continue;
            }
            self.sleep(now);
        }
    }

    /// Progresses the worker until it is quiet (or a burst is done); handles its events.
    fn progress(&mut self) -> bool {
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
        active
    }

    fn sleep(&mut self, now: Instant) {
        match self.worker.arm() {
            Ok(true) => {}
            Ok(false) => return,
            Err(status) => {
                tracing::warn!(%status, "ucp_worker_arm failed; polling");
                return;
            }
        }
        // A command queued before arming signalled a worker that was not armed yet.
        if !self.commands.is_empty() {
            return;
        }
        let busy = !self.dying.is_empty() || !self.closing.is_empty() || self.conns.values().any(Conn::is_busy);
        let mut nap = if busy || self.worker.has_parked() { BUSY_NAP } else { IDLE_NAP };
        if let Some(deadline) = self.conns.values().filter_map(|c| c.deadline(self.settings.timeout)).min() {
            nap = nap.min(deadline.saturating_duration_since(now));
        }
        if let Err(status) = self.worker.sleep(nap) {
            tracing::warn!(%status, "waiting on the ucx worker failed");
        }
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Register { region, reply } => _ = reply.send(self.register(&region)),
            Command::Deregister { region_id, reply } => {
                self.regions.remove(&region_id);
                let _ = reply.send(());
            }
            Command::Post { peer, job } => {
                if job.done.is_cancelled() {
                    return job.done.complete(Err(BackendError::Cancelled));
                }
                let mut env = Env {
                    agent_name: &self.agent_name,
                    regions: &self.regions,
                    max_op_bytes: self.settings.max_op_bytes,
                    next_seq: &mut self.next_seq,
                };
                match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, &peer) {
                    Ok(conn) => conn.start(job, &mut env),
                    Err(err) => job.done.complete(Err(err)),
                }
            }
            Command::Notify { peer, message, reply } => {
                let mut env = Env {
                    agent_name: &self.agent_name,
                    regions: &self.regions,
                    max_op_bytes: self.settings.max_op_bytes,
                    next_seq: &mut self.next_seq,
                };
                match conn_for(&mut self.conns, &mut self.by_ep, &self.worker, &mut self.settings.error_mode, &peer) {
                    Ok(conn) => conn.notify(&message, Waiter::Caller(reply), &mut env),
                    Err(err) => _ = reply.send(Err(err)),
                }
            }
            Command::Disconnect { peer } => {
                self.fail_conn(peer.id, || peer.disconnected("disconnected by the agent"));
            }
            Command::Shutdown => {}
        }
    }

    fn register(&mut self, region: &LocalRegion) -> Result<Vec<u8>, BackendError> {
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
        let memh = self.ctx.mem_map(desc.addr, desc.len, cuda).map_err(|s| ucx_error("mem_map", s))?;
        let packed = memh.pack_rkey().map_err(|s| ucx_error("rkey_pack", s))?;
        let key_id = self.next_key;
        self.next_key += 1;
        self.regions.insert(region.id(), memh);
        Ok(UcxRemoteKey { key_id, base: desc.addr, len: desc.len, packed }.encode())
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
                    if !self.conns.values_mut().any(|conn| conn.acknowledged(seq)) {
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
        let mut env = Env {
            agent_name: &self.agent_name,
            regions: &self.regions,
            max_op_bytes: self.settings.max_op_bytes,
            next_seq: &mut self.next_seq,
        };
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
        self.dying.retain_mut(|job| !job.poll_dying(now));
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
        let jobs = conn.fail_all(&err, Instant::now() + RELEASE_GRACE);
        self.dying.extend(jobs);
        let Conn { ep, .. } = conn;
        self.closing.push(ep.close(true));
    }

    fn shutdown(mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.fail_conn(id, || BackendError::PeerDisconnected {
                peer: String::new(),
                reason: "the ucx backend shut down".into(),
            });
        }
        let deadline = Instant::now() + RELEASE_GRACE;
        while (!self.dying.is_empty() || !self.closing.is_empty()) && Instant::now() < deadline {
            self.progress();
            self.poll_work(Instant::now());
        }
        for mut job in self.dying.drain(..) {
            job.poll_dying(deadline + RELEASE_GRACE);
        }
        // Commands that raced the shutdown: their completers fail as they drop.
        while let Ok(command) = self.commands.try_recv() {
            if let Command::Notify { reply, .. } = command {
                let _ = reply.send(Err(BackendError::Protocol("the ucx backend shut down".into())));
            }
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
            let ep = match worker.connect(&peer.address, *mode != ErrorMode::None) {
                Err(status) if status.is_unreachable() && *mode == ErrorMode::Auto => {
                    // Asked once per backend (UCX logs the refusal): the transports are fixed.
                    tracing::info!("ucx: no transport detects peer failure; dead peers end by timeout_ms");
                    *mode = ErrorMode::None;
                    worker.connect(&peer.address, false)
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
