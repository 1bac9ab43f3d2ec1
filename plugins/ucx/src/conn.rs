//! One live endpoint to a peer and the work on it: transfers (puts or gets per descriptor;
//! puts then one flush, so the data is visible at the target; a completed get has landed
//! here already, so reads need none) and notifications (active messages sent after that,
//! acknowledged by the peer). Runs on whichever thread holds the engine. Requests it finishes are handed back in
//! a [`Finished`] list and completed after the engine's lock is released, so a waker never
//! runs under it.

use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use xfer_core::{BackendError, Completer, LocalMem, Op, RefusalCode, TransferJob};

use crate::grants::{Held, UcxGrantKey};
use crate::keys::UcxRemoteKey;
use crate::msg;
use crate::ucp::{Endpoint, Flush, MemHandle, Rkey, Rma, Send, Status};

/// A peer as its `RemoteAgent` knows it.
#[derive(Debug)]
pub struct PeerInfo {
    pub id: u64,
    pub name: String,
    /// The peer's UCX worker address (checked framing, see `keys`).
    pub address: Vec<u8>,
    /// The peer's pid when it runs on this host, in this pid namespace.
    pub local_pid: Option<u32>,
    /// Set by `disconnect`: later work fails at once.
    pub closed: AtomicBool,
}

impl PeerInfo {
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub fn disconnected(&self, reason: impl Into<String>) -> BackendError {
        BackendError::PeerDisconnected { peer: self.name.clone(), reason: reason.into() }
    }

    /// The error for a failed UCX operation toward this peer.
    pub fn failure(&self, what: &str, status: Status) -> BackendError {
        if status.is_peer_failure() {
            self.disconnected(format!("{what}: {status}"))
        } else {
            BackendError::Protocol(format!("ucx {what}: {status}"))
        }
    }
}

/// Requests finished under the engine's lock, completed once it is released.
pub type Finished = Vec<(Completer, Result<(), BackendError>)>;

/// Who waits for a notification's acknowledgement.
pub enum Waiter {
    Job(Completer),
    Caller(Sender<Result<(), BackendError>>),
}

impl Waiter {
    pub fn finish(self, result: Result<(), BackendError>, finished: &mut Finished) {
        match self {
            Waiter::Job(done) => finished.push((done, result)),
            Waiter::Caller(reply) => _ = reply.send(result),
        }
    }
}

/// A message sent (a notification, a grant's hold or revocation) and not yet acknowledged.
struct Pending {
    seq: u64,
    _send: Send,
    waiter: Waiter,
}

/// A transfer whose operations are posted.
pub struct Job {
    ops: VecDeque<Rma>,
    flush: Option<Flush>,
    error: Option<BackendError>,
    notif: Option<Vec<u8>>,
    done: Option<Completer>,
    /// When failed by its connection: stop waiting for UCX to release the memory at this time.
    pub give_up_at: Option<Instant>,
}

impl Job {
    /// Fails the job (the first error wins); it completes once UCX lets go of its memory.
    pub fn fail(&mut self, err: BackendError, give_up_at: Instant) {
        self.error.get_or_insert(err);
        self.give_up_at = Some(give_up_at);
    }

    /// For a failed job: `true` once finished (UCX completed its operations and flush, or the
    /// grace time passed).
    pub fn poll_dying(&mut self, now: Instant, finished: &mut Finished) -> bool {
        self.ops.retain_mut(|rma| rma.poll().is_none());
        let flushed = self.flush.as_mut().is_none_or(|flush| flush.poll().is_some());
        if !(flushed && self.ops.is_empty()) && self.give_up_at.is_some_and(|at| now < at) {
            return false;
        }
        // Operations still running are parked with the worker: their memory stays pinned
        // until UCX completes them, whatever the caller does next. A flush holds no memory.
        self.ops.clear();
        self.flush = None;
        let err = self.error.take().unwrap_or_else(|| BackendError::Protocol("ucx transfer failed".into()));
        if let Some(done) = self.done.take() {
            finished.push((done, Err(err)));
        }
        true
    }
}

/// What a connection needs from the engine to act.
pub struct Env<'a> {
    pub agent_name: &'a str,
    pub regions: &'a HashMap<u64, Rc<MemHandle>>,
    pub max_op_bytes: u64,
    /// UCX was built with CUDA: device pointers go to it as they are.
    pub cuda: bool,
    pub next_seq: &'a mut u64,
    pub finished: &'a mut Finished,
    /// Grants this side holds (module `grants`), by grant id.
    pub held: &'a HashMap<u64, Held>,
}

/// A grant the peer revoked: the message to acknowledge (`seq`), the grant's rkeys, and how
/// many jobs the connection had posted when it arrived (those may still use the rkeys; later
/// ones cannot, the grant being marked revoked before they post).
struct Revocation {
    seq: u64,
    key_ids: Vec<u64>,
    jobs_before: u64,
}

/// A live endpoint to one peer.
pub struct Conn {
    pub peer: Arc<PeerInfo>,
    pub ep: Endpoint,
    rkeys: HashMap<u64, Rkey>,
    jobs: VecDeque<Job>,
    /// Jobs posted and jobs finished on this connection since it opened (they finish in order).
    jobs_posted: u64,
    jobs_finished: u64,
    pending: VecDeque<Pending>,
    /// Revocations from the peer waiting for the jobs posted before them to finish.
    revocations: Vec<Revocation>,
    /// Revocations whose jobs are done, waiting for a flush: a WRITE of staged memory
    /// completes before its puts are visible at the target, the flush makes them so.
    flushing: Option<(Flush, Vec<Revocation>)>,
    /// Acknowledgements of revocations, until UCX has sent them.
    acks: Vec<Send>,
    last_progress: Instant,
}

impl Conn {
    pub fn new(peer: Arc<PeerInfo>, ep: Endpoint) -> Conn {
        Conn {
            peer,
            ep,
            rkeys: HashMap::new(),
            jobs: VecDeque::new(),
            jobs_posted: 0,
            jobs_finished: 0,
            pending: VecDeque::new(),
            revocations: Vec::new(),
            flushing: None,
            acks: Vec::new(),
            last_progress: Instant::now(),
        }
    }

    pub fn is_busy(&self) -> bool {
        self.is_waiting() || !self.revocations.is_empty() || !self.acks.is_empty()
    }

    /// Whether anything waits for the peer (what its silence times out).
    fn is_waiting(&self) -> bool {
        !self.jobs.is_empty() || !self.pending.is_empty() || self.flushing.is_some()
    }

    /// When the connection times out if nothing completes before.
    pub fn deadline(&self, timeout: std::time::Duration) -> Option<Instant> {
        self.is_waiting().then(|| self.last_progress + timeout)
    }

    fn touch_if_idle(&mut self) {
        if !self.is_waiting() {
            self.last_progress = Instant::now();
        }
    }

    /// Posts every operation of a job, then, for a WRITE that is to be `visible` at the target
    /// on completion, its flush. Without it a WRITE completes once its puts are done with the
    /// local memory (the stager's slot puts, flushed once after the last). `false`: refused at
    /// once (finished already).
    pub fn start(&mut self, job: TransferJob, visible: bool, env: &mut Env<'_>) -> bool {
        let TransferJob { op, local, remote, notif, done } = job;
        // Host memory, and GPU memory when UCX has CUDA (it detects device pointers itself).
        // Files, and GPU memory without CUDA, go to the stager instead; here they would be
        // misread as host addresses, so they are refused.
        let movable = |piece: &LocalMem| match piece {
            LocalMem::Host(_) => true,
            LocalMem::Device(_) => env.cuda,
            LocalMem::File(_) => false,
        };
        if let Some(piece) = local.iter().find(|piece| !movable(piece)) {
            let err = BackendError::MemoryNotMoved { backend: "ucx", mem_type: piece.mem_type() };
            env.finished.push((done, Err(err)));
            return false;
        }
        let plan = match self.plan(&remote, &local, env) {
            Ok(plan) => plan,
            Err(err) => {
                env.finished.push((done, Err(err)));
                return false;
            }
        };
        self.touch_if_idle();
        let mut ops = VecDeque::new();
        let mut error = None;
        let mut remote = plan.into_iter();
        let mut current = remote.next();
        for slice in local {
            let mut rest = Some(slice);
            while let Some(mut slice) = rest.take() {
                let Some((addr, left, key_id)) = current.as_mut() else { break };
                if slice.is_empty() || error.is_some() {
                    break;
                }
                let n = slice.len().min(*left).min(env.max_op_bytes);
                let piece = if n == slice.len() {
                    slice
                } else {
                    let front = slice.split_front(n);
                    rest = Some(slice);
                    front
                };
                match self.issue(op, piece, *addr, *key_id, env.regions) {
                    Ok(rma) => ops.push_back(rma),
                    Err(status) => error = Some(self.peer.failure(&format!("{op} posting"), status)),
                }
                *addr += n;
                *left -= n;
                if *left == 0 {
                    current = remote.next();
                }
            }
        }
        // A get is complete once its data has landed here; puts complete locally before the
        // target sees them, so a WRITE waits for a flush.
        let flush = (op == Op::Write && visible).then(|| self.ep.flush());
        self.jobs.push_back(Job { ops, flush, error, notif, done: Some(done), give_up_at: None });
        self.jobs_posted += 1;
        true
    }

    /// Whether the job posted last is still in flight (jobs finish in the order posted).
    pub fn last_job_in_flight(&self) -> bool {
        self.jobs_finished < self.jobs_posted
    }

    fn issue(
        &mut self,
        op: Op,
        piece: LocalMem,
        addr: u64,
        key_id: u64,
        regions: &HashMap<u64, Rc<MemHandle>>,
    ) -> Result<Rma, Status> {
        // `plan` unpacked every key of the job; a miss would be our bug, reported as an error.
        let rkey = self.rkeys.get(&key_id).ok_or(Status(xfer_ucx_sys::UCS_ERR_NO_ELEM))?;
        let memh = regions.get(&piece.pin().region().id()).map(|memh| &**memh);
        match op {
            Op::Write => self.ep.put(piece, addr, rkey, memh),
            Op::Read => self.ep.get(piece, addr, rkey, memh),
        }
    }

    /// Checks the remote segments against their keys and the byte totals, unpacks keys not yet
    /// unpacked on this endpoint, and returns `(address, length, key id)` per non-empty
    /// segment.
    fn plan(
        &mut self,
        remote: &[xfer_core::RemoteSeg],
        local: &[LocalMem],
        env: &Env<'_>,
    ) -> Result<Vec<(u64, u64, u64)>, BackendError> {
        let mut plan = Vec::with_capacity(remote.len());
        let now_ms = crate::grants::unix_ms(std::time::SystemTime::now());
        for seg in remote {
            let key = if let Some(key) = seg.key.downcast_ref::<UcxRemoteKey>() {
                key
            } else if let Some(grant) = seg.key.downcast_ref::<UcxGrantKey>() {
                // Checked here, before any operation is posted: over tcp and shared memory
                // nothing on the target would refuse it (see module `grants`).
                let revoked = env.held.get(&grant.grant_id).map(|held| held.revoked);
                grant
                    .admit(env.agent_name, revoked, now_ms, seg.addr, seg.len)
                    .map_err(|(code, message)| BackendError::Refused { code, message })?
            } else {
                return Err(BackendError::InvalidMetadata("remote key is not a ucx key".into()));
            };
            if key.is_local_only() {
                return Err(BackendError::Unsupported(format!(
                    "{}'s region (ucx key {}) is a file, or GPU memory its UCX has no CUDA for: UCX \
                     cannot reach it from here (it moves only from the peer's own side)",
                    self.peer.name, key.key_id
                )));
            }
            if !key.covers(seg.addr, seg.len) {
                let message = format!("remote {:#x}+{} is outside its region", seg.addr, seg.len);
                return Err(BackendError::Refused { code: RefusalCode::OutOfBounds, message });
            }
            if !self.rkeys.contains_key(&key.key_id) {
                let rkey = self.ep.unpack_rkey(&key.packed).map_err(|status| {
                    BackendError::InvalidMetadata(format!("ucx remote key {} does not unpack: {status}", key.key_id))
                })?;
                self.rkeys.insert(key.key_id, rkey);
            }
            if seg.len > 0 {
                plan.push((seg.addr, seg.len, key.key_id));
            }
        }
        let remote_total: u64 = plan.iter().map(|p| p.1).sum();
        let local_total: u64 = local.iter().map(LocalMem::len).sum();
        if remote_total != local_total {
            let message = format!("local {local_total} bytes vs remote {remote_total} bytes");
            return Err(BackendError::Refused { code: RefusalCode::BadRequest, message });
        }
        Ok(plan)
    }

    /// Sends a notification; `waiter` finishes when the peer acknowledges it.
    pub fn notify(&mut self, message: &[u8], waiter: Waiter, env: &mut Env<'_>) {
        let agent_name = env.agent_name;
        self.request(|seq| msg::encode_notif(seq, agent_name, message), waiter, env);
    }

    /// Sends the message `encode` makes with a fresh sequence number; `waiter` finishes when
    /// the peer acknowledges it (or refuses, or the connection fails).
    pub fn request(
        &mut self,
        encode: impl FnOnce(u64) -> Result<Vec<u8>, msg::MsgError>,
        waiter: Waiter,
        env: &mut Env<'_>,
    ) {
        let seq = *env.next_seq;
        *env.next_seq += 1;
        let payload = match encode(seq) {
            Ok(payload) => payload,
            Err(err) => return waiter.finish(Err(BackendError::Unsupported(err.to_string())), env.finished),
        };
        self.touch_if_idle();
        let send = self.ep.send(payload);
        self.pending.push_back(Pending { seq, _send: send, waiter });
    }

    /// Whether message `seq` was sent here and waits for its answer.
    pub fn waits_for(&self, seq: u64) -> bool {
        self.pending.iter().any(|p| p.seq == seq)
    }

    /// The answer to message `seq` arrived (an acknowledgement, or a refusal).
    pub fn acknowledged(&mut self, seq: u64, result: Result<(), BackendError>, finished: &mut Finished) {
        let Some(index) = self.pending.iter().position(|p| p.seq == seq) else { return };
        if let Some(pending) = self.pending.remove(index) {
            pending.waiter.finish(result, finished);
        }
        self.last_progress = Instant::now();
    }

    /// The peer revoked a grant whose rkeys are `key_ids`: acknowledged (message `seq`) once
    /// the jobs posted on this connection before it, which alone may use them, are done, the
    /// rkeys destroyed first. Jobs posted later do not hold it up, so a connection that is never
    /// idle still acknowledges.
    pub fn revoke_after_earlier_jobs(&mut self, seq: u64, key_ids: Vec<u64>) {
        self.revocations.push(Revocation { seq, key_ids, jobs_before: self.jobs_posted });
    }

    /// Acknowledges the revocations whose earlier jobs are done, once a flush after them
    /// completed.
    fn answer_revocations(&mut self) {
        self.acks.retain_mut(|send| send.poll().is_none());
        if self.flushing.is_none() {
            // Revocations arrive in order, so those ready form a prefix.
            let ready = self.revocations.iter().take_while(|r| r.jobs_before <= self.jobs_finished).count();
            if ready > 0 {
                let revocations = self.revocations.drain(..ready).collect();
                self.flushing = Some((self.ep.flush(), revocations));
            }
        }
        let Some((flush, _)) = self.flushing.as_mut() else { return };
        // A flush fails only with its endpoint: the acknowledgement then fails too, and the
        // target sees the endpoint fail instead.
        if flush.poll().is_none() {
            return;
        }
        let Some((_, done)) = self.flushing.take() else { return };
        for Revocation { seq, key_ids, .. } in done {
            for key_id in key_ids {
                self.rkeys.remove(&key_id);
            }
            self.acks.push(self.ep.send(msg::encode_ack(seq)));
        }
    }

    /// Advances the jobs in order; returns whether anything completed.
    pub fn poll(&mut self, env: &mut Env<'_>) -> bool {
        let mut progressed = false;
        while let Some(job) = self.jobs.front_mut() {
            while let Some(rma) = job.ops.front_mut() {
                match rma.poll() {
                    None => break,
                    Some(result) => {
                        if let Err(status) = result {
                            job.error.get_or_insert_with(|| self.peer.failure("transfer", status));
                        }
                        job.ops.pop_front();
                        progressed = true;
                    }
                }
            }
            let result = match job.flush.as_mut() {
                Some(flush) => match flush.poll() {
                    Some(result) => result,
                    None => break,
                },
                None if job.ops.is_empty() => Ok(()),
                None => break,
            };
            progressed = true;
            let Some(mut job) = self.jobs.pop_front() else { break };
            self.jobs_finished += 1;
            job.flush = None;
            // Every operation is complete once the flush is: this releases their pins before
            // completing, so a waiter that deregisters next never waits.
            job.ops.clear();
            let Some(done) = job.done.take() else { continue };
            let outcome = match (job.error.take(), result) {
                (Some(err), _) => Err(err),
                (None, Err(status)) => Err(self.peer.failure("flush", status)),
                (None, Ok(())) => Ok(()),
            };
            match (outcome, job.notif.take()) {
                (Ok(()), _) if done.is_cancelled() => env.finished.push((done, Err(BackendError::Cancelled))),
                (Ok(()), Some(message)) => self.notify(&message, Waiter::Job(done), env),
                (outcome, _) => env.finished.push((done, outcome)),
            }
        }
        if progressed {
            self.last_progress = Instant::now();
        }
        self.answer_revocations();
        progressed
    }

    /// Takes the work off a connection being torn down: jobs to finish once UCX lets go of
    /// their memory, and notification waiters, failed now (a notification may still arrive:
    /// it is never resent).
    pub fn fail_all(
        &mut self,
        err: impl Fn() -> BackendError,
        give_up_at: Instant,
        finished: &mut Finished,
    ) -> Vec<Job> {
        for pending in self.pending.drain(..) {
            pending.waiter.finish(Err(err()), finished);
        }
        self.rkeys.clear();
        // Their acknowledgements cannot go out now: the target sees this connection fail.
        self.revocations.clear();
        self.flushing = None;
        self.jobs_finished = self.jobs_posted;
        self.jobs
            .drain(..)
            .map(|mut job| {
                job.fail(err(), give_up_at);
                job
            })
            .collect()
    }
}
