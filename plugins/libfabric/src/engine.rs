//! The engine thread: it alone drives the endpoint. Callers hand it commands over a channel
//! (and wake it with `fi_cq_signal`); it posts each job's operations within the window, reads
//! completions, sends and acknowledges notifications, and fails a job once neither it nor
//! anything else for its peer completed within the job's stall bound (the timeout, or for a
//! share of a striped request `failover_ms`). Progress and completions thus never depend on a
//! caller waiting.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender};
use xfer_core::{BackendError, LocalRegion, NotifSink, RefusalCode};

use crate::config::Settings;
use crate::fabric::{CqError, Done, Endpoint, Rma, Waker};
use crate::stripe::Finish;

pub use crate::fabric::RmaPiece as Piece;

/// A transfer as the engine runs it.
#[derive(Debug)]
pub struct Job {
    /// The connection ([`Cmd::Connect`]'s answer); the engine swaps in its AV entry on intake.
    pub peer: u64,
    pub peer_name: String,
    pub op: Rma,
    pub pieces: VecDeque<Piece>,
    pub notif: Option<Vec<u8>>,
    /// The peer's notification chunk.
    pub chunk: usize,
    /// The job fails (TimedOut) once neither it nor anything else for its peer on this rail
    /// completed for this long: the request's timeout, or, for a share of a request striped
    /// over several rails, the shorter bound after which the share moves to another rail.
    pub stall: Duration,
    pub done: Finish,
}

pub enum Cmd {
    Register(Arc<LocalRegion>, Sender<Result<u64, BackendError>>),
    Deregister(u64, Sender<()>),
    /// Inserts a peer's address (once, however many connections use it); answers a
    /// connection handle.
    Connect(Vec<u8>, Sender<Result<u64, BackendError>>),
    /// Ends a connection; the last one to an address fails its jobs and removes it from the AV.
    Disconnect(u64),
    /// How many peer addresses the AV holds.
    Peers(Sender<Result<usize, BackendError>>),
    Post(Job),
    Notify {
        peer: u64,
        peer_name: String,
        chunk: usize,
        message: Vec<u8>,
        reply: Sender<Result<(), BackendError>>,
    },
    Stop,
}

/// The callers' side of the engine.
#[derive(Debug)]
pub struct Handle {
    tx: Sender<Cmd>,
    waker: Waker,
    thread: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Handle {
    /// Hands a command to the engine; `false` once it has stopped.
    pub fn send(&self, cmd: Cmd) -> bool {
        let sent = self.tx.send(cmd).is_ok();
        self.waker.wake();
        sent
    }

    /// Hands a job to the engine; gives it back once the engine has stopped.
    pub fn try_post(&self, job: Job) -> Result<(), Box<Job>> {
        let sent = self.tx.send(Cmd::Post(job));
        self.waker.wake();
        match sent {
            Ok(()) => Ok(()),
            Err(crossbeam_channel::SendError(Cmd::Post(job))) => Err(Box::new(job)),
            // Only a job was sent.
            Err(_) => Ok(()),
        }
    }

    /// Sends a command with a reply channel and waits at most `bound` for the answer.
    pub fn call<T>(
        &self,
        bound: Duration,
        make: impl FnOnce(Sender<Result<T, BackendError>>) -> Cmd,
    ) -> Result<T, BackendError> {
        let (reply, answer) = crossbeam_channel::bounded(1);
        if !self.send(make(reply)) {
            return Err(stopped());
        }
        match answer.recv_timeout(bound) {
            Ok(result) => result,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Err(BackendError::TimedOut(bound)),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Err(stopped()),
        }
    }

    pub fn stop(&self) {
        self.send(Cmd::Stop);
        if let Some(thread) = self.thread.lock().take() {
            if thread.join().is_err() {
                tracing::error!("libfabric engine thread panicked");
            }
        }
    }
}

fn gone(peer: &str) -> BackendError {
    BackendError::PeerDisconnected { peer: peer.to_string(), reason: "disconnected by the agent".into() }
}

fn stopped() -> BackendError {
    BackendError::Unsupported("the libfabric backend has shut down".into())
}

/// Starts the engine thread over an open endpoint.
pub fn start(
    ep: Endpoint,
    agent_name: String,
    own_address: Vec<u8>,
    settings: Settings,
    notifs: NotifSink,
) -> Result<Handle, BackendError> {
    let (tx, rx) = crossbeam_channel::unbounded();
    let waker = ep.waker();
    let tx_cap = ep.attrs().tx_size.saturating_sub(8).max(1);
    let max_iov = ep.attrs().max_iov;
    let engine = Engine {
        ep,
        rx,
        settings,
        notifs,
        agent_name,
        own_address,
        tx_cap,
        max_iov,
        jobs: BTreeMap::new(),
        next_job: 1,
        rma_in_flight: 0,
        waiters: HashMap::new(),
        next_seq: 1,
        conns: HashMap::new(),
        next_conn: 1,
        av: HashMap::new(),
        last_heard: HashMap::new(),
        partial: HashMap::new(),
        outbox: VecDeque::new(),
    };
    let thread = std::thread::Builder::new().name("xfer-libfabric".into()).spawn(move || engine.run())?;
    Ok(Handle { tx, waker, thread: parking_lot::Mutex::new(Some(thread)) })
}

struct Active {
    job: Job,
    in_flight: usize,
    last_progress: Instant,
    /// The notification's sequence number once sent.
    notif_seq: Option<u64>,
}

struct Partial {
    chunks: Vec<Option<Vec<u8>>>,
    left: usize,
    bytes: usize,
    since: Instant,
}

/// A notification whose chunks stopped arriving (its sender died) is dropped after this.
const PARTIAL_BOUND: Duration = Duration::from_secs(60);
/// A peer in the AV only to acknowledge its notifications (no connection of ours) is removed
/// once unused this long.
const SENDER_IDLE: Duration = Duration::from_secs(30);

/// A peer address in the AV.
struct AvEntry {
    addr: u64,
    /// Connections using it; 0: inserted to acknowledge its notifications.
    conns: usize,
    last_used: Instant,
}

enum Waiter {
    Job(u64),
    Caller(Sender<Result<(), BackendError>>, String),
}

struct Pending {
    waiter: Waiter,
    deadline: Instant,
}

struct Engine {
    ep: Endpoint,
    rx: Receiver<Cmd>,
    settings: Settings,
    notifs: NotifSink,
    agent_name: String,
    own_address: Vec<u8>,
    tx_cap: usize,
    /// Pieces per vectored operation.
    max_iov: usize,
    jobs: BTreeMap<u64, Active>,
    next_job: u64,
    rma_in_flight: usize,
    /// Notifications waiting for the peer's acknowledgement, by sequence number.
    waiters: HashMap<u64, Pending>,
    next_seq: u64,
    /// Connections' peer addresses, by connection handle.
    conns: HashMap<u64, Vec<u8>>,
    next_conn: u64,
    /// The AV's entries by peer address: connected peers and notifying ones.
    av: HashMap<Vec<u8>, AvEntry>,
    /// When an operation to each peer (AV entry) last completed: a job waiting behind others
    /// to the same peer is not stalled while they progress.
    last_heard: HashMap<u64, Instant>,
    /// Notifications of several chunks still arriving, by (sender's address, seq).
    partial: HashMap<(Vec<u8>, u64), Partial>,
    /// Messages the provider had no room for: (peer, bytes, token).
    outbox: VecDeque<(u64, Vec<u8>, u64)>,
}

/// Sequence number 0 marks sends nobody waits for (acknowledgements).
const NO_WAITER: u64 = 0;

impl Engine {
    fn run(mut self) {
        let mut done = Vec::new();
        let mut last_busy = Instant::now();
        let mut last_sweep = Instant::now();
        'run: loop {
            let mut busy = false;
            loop {
                match self.rx.try_recv() {
                    Ok(Cmd::Stop) | Err(crossbeam_channel::TryRecvError::Disconnected) => break 'run,
                    Ok(cmd) => {
                        busy = true;
                        self.command(cmd);
                    }
                    Err(crossbeam_channel::TryRecvError::Empty) => break,
                }
            }
            busy |= self.flush_outbox();
            busy |= self.post_ready();
            let now = Instant::now();
            let idle = !busy && now.duration_since(last_busy) > self.settings.spin;
            let polled = if idle {
                let wait_ms = if self.jobs.is_empty() && self.waiters.is_empty() { 20 } else { 1 };
                self.ep.wait(16, wait_ms, &mut done)
            } else {
                self.ep.poll(16, &mut done)
            };
            match polled {
                Ok(n) => busy |= n > 0,
                Err(err) => {
                    tracing::error!(%err, "libfabric completion queue");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            for d in done.drain(..) {
                self.completed(d);
            }
            let now = Instant::now();
            if busy {
                last_busy = now;
            }
            if now.duration_since(last_sweep) >= Duration::from_millis(1) {
                last_sweep = now;
                self.sweep(now);
            }
        }
        self.shut_down();
    }

    fn command(&mut self, cmd: Cmd) {
        match cmd {
            Cmd::Register(region, reply) => {
                let result = self.ep.register(&region).map_err(|e| BackendError::Protocol(e.to_string()));
                let _ = reply.send(result);
            }
            Cmd::Deregister(region, reply) => {
                if !self.ep.deregister(region) {
                    tracing::debug!(region, "libfabric deregistration of an unknown region");
                }
                let _ = reply.send(());
            }
            Cmd::Connect(address, reply) => {
                let result = self.av_entry(&address).map(|entry| entry.conns += 1).map(|()| {
                    let conn = self.next_conn;
                    self.next_conn += 1;
                    self.conns.insert(conn, address);
                    conn
                });
                let _ = reply.send(result);
            }
            Cmd::Disconnect(conn) => {
                let Some(address) = self.conns.remove(&conn) else { return };
                let last = self.av.get_mut(&address).is_some_and(|entry| {
                    entry.conns = entry.conns.saturating_sub(1);
                    entry.conns == 0
                });
                if last {
                    self.remove_peer(&address);
                }
            }
            Cmd::Peers(reply) => _ = reply.send(Ok(self.av.len())),
            Cmd::Post(mut job) => {
                match self.resolve(job.peer) {
                    Some(addr) => job.peer = addr,
                    None => return job.done.complete(Err(gone(&job.peer_name))),
                }
                let id = self.next_job;
                self.next_job += 1;
                self.jobs.insert(id, Active { job, in_flight: 0, last_progress: Instant::now(), notif_seq: None });
                self.maybe_finish(id);
            }
            Cmd::Notify { peer, peer_name, chunk, message, reply } => {
                let Some(peer) = self.resolve(peer) else {
                    let _ = reply.send(Err(gone(&peer_name)));
                    return;
                };
                let seq = self.send_notif(peer, &message, chunk);
                let deadline = Instant::now() + self.settings.timeout;
                self.waiters.insert(seq, Pending { waiter: Waiter::Caller(reply, peer_name), deadline });
            }
            Cmd::Stop => {}
        }
    }

    /// Queues a notification; returns its sequence number.
    fn send_notif(&mut self, peer: u64, payload: &[u8], chunk: usize) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        for message in crate::msg::notif(seq, &self.own_address, &self.agent_name, payload, chunk) {
            self.outbox.push_back((peer, message, seq));
        }
        self.flush_outbox();
        seq
    }

    /// Sends what the provider takes now. A peer that cannot take a message (full queue, or
    /// a stopped shm peer) keeps it and those after it, in order; other peers' go on.
    fn flush_outbox(&mut self) -> bool {
        let mut sent_any = false;
        let mut waiting: Vec<u64> = Vec::new();
        let mut kept = VecDeque::new();
        while let Some((peer, message, token)) = self.outbox.pop_front() {
            if waiting.contains(&peer) {
                kept.push_back((peer, message, token));
                continue;
            }
            match self.ep.send(peer, &message, token) {
                Ok(true) => sent_any = true,
                Ok(false) => {
                    waiting.push(peer);
                    kept.push_back((peer, message, token));
                }
                Err(err) => {
                    let reason = err.to_string();
                    self.fail_waiter(token, |peer| BackendError::PeerDisconnected { peer, reason });
                }
            }
        }
        self.outbox = kept;
        sent_any
    }

    /// Posts operations of every job within the windows; whether anything was posted.
    fn post_ready(&mut self) -> bool {
        let mut posted = false;
        let mut failed = Vec::new();
        let ids: Vec<u64> = self.jobs.iter().filter(|(_, a)| !a.job.pieces.is_empty()).map(|(&id, _)| id).collect();
        'jobs: for id in ids {
            let Some(active) = self.jobs.get_mut(&id) else { continue };
            while active.in_flight < self.settings.max_in_flight && self.rma_in_flight < self.tx_cap {
                // Consecutive pieces go as one vectored operation, within the provider's iovec
                // limit and max_op_bytes.
                let mut batch = Vec::new();
                let mut bytes = 0;
                while let Some(next) = active.job.pieces.front() {
                    let len = next.local.len();
                    if !batch.is_empty() && (batch.len() == self.max_iov || bytes + len > self.settings.max_op_bytes) {
                        break;
                    }
                    bytes += len;
                    batch.extend(active.job.pieces.pop_front());
                }
                if batch.is_empty() {
                    break;
                }
                match self.ep.post_rma(active.job.op, batch, active.job.peer, id) {
                    Ok(Ok(())) => {
                        active.in_flight += 1;
                        self.rma_in_flight += 1;
                        active.last_progress = Instant::now().max(active.last_progress);
                        posted = true;
                    }
                    Ok(Err(batch)) => {
                        // No room in the provider for this peer now (its queue, or the
                        // connection to a peer that died and has not failed yet): progress
                        // first, then post again. Other peers' jobs still post, so one dead
                        // peer cannot stall the live ones until its requests time out.
                        for piece in batch.into_iter().rev() {
                            active.job.pieces.push_front(piece);
                        }
                        continue 'jobs;
                    }
                    Err(err) => {
                        failed.push((id, post_failed(&active.job.peer_name, err)));
                        break;
                    }
                }
            }
        }
        for (id, err) in failed {
            self.fail_job(id, err);
        }
        posted
    }

    fn completed(&mut self, done: Done) {
        match done {
            Done::Rma { token, result } => {
                self.rma_in_flight = self.rma_in_flight.saturating_sub(1);
                let Some(active) = self.jobs.get_mut(&token) else { return };
                active.in_flight -= 1;
                let now = Instant::now();
                active.last_progress = now;
                match result {
                    Ok(()) => {
                        self.last_heard.insert(active.job.peer, now);
                        self.maybe_finish(token)
                    }
                    Err(err) => {
                        let err = classify(&active.job.peer_name, err);
                        self.fail_job(token, err);
                    }
                }
            }
            Done::Sent { token, result } => {
                if let Err(err) = result {
                    self.fail_waiter(token, |peer| classify(&peer, err));
                }
            }
            Done::Received { result } => match result {
                Ok(bytes) => self.received(&bytes),
                Err(err) if err.code == libc::ECANCELED => {}
                Err(err) => tracing::warn!(code = err.code, message = %err.message, "libfabric receive failed"),
            },
        }
    }

    fn received(&mut self, bytes: &[u8]) {
        match crate::msg::parse(bytes) {
            Ok(crate::msg::Msg::Notif { seq, index, count, address, name, payload }) => {
                let payload = if count == 1 {
                    payload.to_vec()
                } else {
                    let key = (address.to_vec(), seq);
                    let partial = self.partial.entry(key.clone()).or_insert_with(|| Partial {
                        chunks: vec![None; count as usize],
                        left: count as usize,
                        bytes: 0,
                        since: Instant::now(),
                    });
                    if partial.chunks.len() != count as usize
                        || partial.bytes + payload.len() > self.settings.max_notif_bytes
                    {
                        tracing::warn!(from = %name, seq, "libfabric: a notification's chunks do not add up; dropped");
                        self.partial.remove(&key);
                        return;
                    }
                    let slot = &mut partial.chunks[index as usize];
                    if slot.is_none() {
                        *slot = Some(payload.to_vec());
                        partial.left -= 1;
                        partial.bytes += payload.len();
                    }
                    if partial.left > 0 {
                        return;
                    }
                    let Some(partial) = self.partial.remove(&key) else { return };
                    partial.chunks.into_iter().flatten().flatten().collect()
                };
                let peer = match self.av_entry(address) {
                    Ok(entry) => Some(entry.addr),
                    Err(err) => {
                        tracing::warn!(%err, from = %name, "libfabric: cannot acknowledge a notification");
                        None
                    }
                };
                (self.notifs)(&name, payload);
                if let Some(peer) = peer {
                    self.outbox.push_back((peer, crate::msg::ack(seq), NO_WAITER));
                    self.flush_outbox();
                }
            }
            Ok(crate::msg::Msg::Ack { seq }) => match self.waiters.remove(&seq).map(|p| p.waiter) {
                Some(Waiter::Job(id)) => {
                    if let Some(active) = self.jobs.remove(&id) {
                        active.job.done.complete(Ok(()));
                    }
                }
                Some(Waiter::Caller(reply, _)) => _ = reply.send(Ok(())),
                // Acknowledges a notification that already timed out.
                None => {}
            },
            Err(err) => tracing::warn!(%err, "libfabric: a message that is not ours"),
        }
    }

    /// The AV entry of `address`, inserted if new.
    fn av_entry(&mut self, address: &[u8]) -> Result<&mut AvEntry, BackendError> {
        if !self.av.contains_key(address) {
            let addr = self.ep.insert(address).map_err(|e| BackendError::Protocol(e.to_string()))?;
            self.av.insert(address.to_vec(), AvEntry { addr, conns: 0, last_used: Instant::now() });
        }
        let entry = self.av.get_mut(address).ok_or_else(|| BackendError::Protocol("lost an AV entry".into()))?;
        entry.last_used = Instant::now();
        Ok(entry)
    }

    /// The AV entry of a live connection.
    fn resolve(&mut self, conn: u64) -> Option<u64> {
        let entry = self.av.get_mut(self.conns.get(&conn)?)?;
        entry.last_used = Instant::now();
        Some(entry.addr)
    }

    /// Fails what is queued for the peer and takes it out of the AV (its `fi_addr_t` may be
    /// handed to another peer afterwards, so nothing may name it any more).
    fn remove_peer(&mut self, address: &[u8]) {
        let Some(entry) = self.av.remove(address) else { return };
        self.last_heard.remove(&entry.addr);
        let doomed: Vec<(u64, String)> = self
            .jobs
            .iter()
            .filter(|(_, a)| a.job.peer == entry.addr)
            .map(|(&id, a)| (id, a.job.peer_name.clone()))
            .collect();
        for (id, name) in doomed {
            self.fail_job(id, gone(&name));
        }
        let (dropped, kept): (VecDeque<_>, VecDeque<_>) =
            std::mem::take(&mut self.outbox).into_iter().partition(|(peer, ..)| *peer == entry.addr);
        self.outbox = kept;
        for (_, _, token) in dropped {
            self.fail_waiter(token, |peer| gone(&peer));
        }
        if let Err(err) = self.ep.remove(entry.addr) {
            tracing::warn!(%err, "libfabric: removing a peer from the address vector");
        }
    }

    /// Completes a job whose data has all moved: now, or after its notification.
    fn maybe_finish(&mut self, id: u64) {
        let Some(active) = self.jobs.get(&id) else { return };
        if active.in_flight > 0 || !active.job.pieces.is_empty() || active.notif_seq.is_some() {
            return;
        }
        match active.job.notif.clone() {
            None => {
                if let Some(active) = self.jobs.remove(&id) {
                    active.job.done.complete(Ok(()));
                }
            }
            Some(message) => {
                let (peer, chunk) = (active.job.peer, active.job.chunk);
                let seq = self.send_notif(peer, &message, chunk);
                if let Some(active) = self.jobs.get_mut(&id) {
                    active.notif_seq = Some(seq);
                    active.last_progress = Instant::now();
                }
                let deadline = Instant::now() + self.settings.timeout;
                self.waiters.insert(seq, Pending { waiter: Waiter::Job(id), deadline });
            }
        }
    }

    fn fail_job(&mut self, id: u64, err: BackendError) {
        if let Some(active) = self.jobs.remove(&id) {
            if let Some(seq) = active.notif_seq {
                self.waiters.remove(&seq);
            }
            // Operations still in flight keep their memory pinned until the CQ reports them.
            active.job.done.complete(Err(err));
        }
    }

    fn fail_waiter(&mut self, seq: u64, err: impl FnOnce(String) -> BackendError) {
        match self.waiters.remove(&seq).map(|p| p.waiter) {
            Some(Waiter::Job(id)) => {
                let peer = self.jobs.get(&id).map(|a| a.job.peer_name.clone()).unwrap_or_default();
                self.fail_job(id, err(peer));
            }
            Some(Waiter::Caller(reply, peer)) => _ = reply.send(Err(err(peer))),
            None => {}
        }
    }

    /// Fails what made no progress for the timeout, and cancelled jobs.
    fn sweep(&mut self, now: Instant) {
        let timeout = self.settings.timeout;
        let stale: Vec<(u64, BackendError)> = self
            .jobs
            .iter()
            .filter_map(|(&id, a)| {
                let heard = self.last_heard.get(&a.job.peer).map_or(a.last_progress, |&t| t.max(a.last_progress));
                if a.job.done.is_cancelled() {
                    Some((id, BackendError::Cancelled))
                } else if a.notif_seq.is_none() && now.duration_since(heard) > a.job.stall {
                    Some((id, BackendError::TimedOut(a.job.stall)))
                } else {
                    None
                }
            })
            .collect();
        for (id, err) in stale {
            self.fail_job(id, err);
        }
        self.partial.retain(|_, p| now.duration_since(p.since) < PARTIAL_BOUND);
        let idle: Vec<Vec<u8>> = self
            .av
            .iter()
            .filter(|(_, e)| e.conns == 0 && now.duration_since(e.last_used) > SENDER_IDLE)
            .filter(|(_, e)| !self.outbox.iter().any(|(peer, ..)| *peer == e.addr))
            .map(|(address, _)| address.clone())
            .collect();
        for address in idle {
            self.remove_peer(&address);
        }
        let late: Vec<u64> = self.waiters.iter().filter(|(_, p)| now > p.deadline).map(|(&s, _)| s).collect();
        for seq in late {
            self.fail_waiter(seq, |_| BackendError::TimedOut(timeout));
        }
    }

    fn shut_down(mut self) {
        let ids: Vec<u64> = self.jobs.keys().copied().collect();
        for id in ids {
            let peer = self.jobs.get(&id).map(|a| a.job.peer_name.clone()).unwrap_or_default();
            self.fail_job(id, BackendError::PeerDisconnected { peer, reason: "the backend shut down".into() });
        }
        let seqs: Vec<u64> = self.waiters.keys().copied().collect();
        for seq in seqs {
            self.fail_waiter(seq, |peer| BackendError::PeerDisconnected {
                peer,
                reason: "the backend shut down".into(),
            });
        }
        // Commands that raced the stop.
        while let Ok(cmd) = self.rx.try_recv() {
            if let Cmd::Post(job) = cmd {
                job.done.complete(Err(stopped()));
            }
        }
        // Dropping the endpoint closes it; operations still in flight let go of their memory.
        tracing::debug!(in_flight = self.ep.in_flight(), "libfabric engine stopped");
    }
}

/// A post the provider refused outright. `sockets` answers a post to a peer whose connection
/// is gone with ENOENT or a connection error.
fn post_failed(peer: &str, err: crate::fabric::FabricError) -> BackendError {
    match err.code {
        libc::ENOENT
        | libc::ECONNREFUSED
        | libc::ECONNRESET
        | libc::ECONNABORTED
        | libc::ENOTCONN
        | libc::EPIPE
        | libc::EHOSTUNREACH => BackendError::PeerDisconnected { peer: peer.to_string(), reason: err.to_string() },
        _ => BackendError::Protocol(err.to_string()),
    }
}

/// An error completion as the agent sees it.
fn classify(peer: &str, err: CqError) -> BackendError {
    let CqError { code, message } = err;
    match code {
        // rxm cancels what it had queued to a connection that broke (peer killed, or a
        // refused key: the target's provider drops the connection).
        libc::EKEYREJECTED | libc::EACCES | libc::EPERM => {
            BackendError::Refused { code: RefusalCode::UnknownKey, message }
        }
        c if c == xfer_libfabric_sys::FI_ENOKEY as i32 => {
            BackendError::Refused { code: RefusalCode::UnknownKey, message }
        }
        _ => BackendError::PeerDisconnected { peer: peer.to_string(), reason: message },
    }
}
