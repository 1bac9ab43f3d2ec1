//! `RemoteAgent` for one peer: posts and notifies on the caller's thread, under the engine's
//! lock; jobs with memory UCX cannot take go to the stager (`staged`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use xfer_core::{
    BackendError, Completion, LocalMem, Op, RefusalCode, RemoteAgent, RemoteKey, RemoteSeg, Status, TransferJob,
};

use crate::conn::PeerInfo;
use crate::engine::{Engine, Shared};
use crate::grants::{unix_ms, UcxGrantKey};
use crate::keys::UcxRemoteKey;
use crate::staged::{self, Stager};

pub struct UcxPeer {
    pub(crate) info: Arc<PeerInfo>,
    pub(crate) engine: Arc<Shared>,
    /// Bound on a standalone notification: the backend's timeout plus slack.
    pub(crate) notify_bound: Duration,
    /// UCX takes device pointers (else GPU memory is staged, as files always are).
    pub(crate) cuda: bool,
    pub(crate) stager: Arc<Stager>,
    /// This agent's name, and this backend's connection info (sent with a grant's `Hold`).
    pub(crate) agent_name: String,
    pub(crate) own_conn_info: Arc<[u8]>,
}

impl std::fmt::Debug for UcxPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxPeer").field("peer", &self.info.name).field("id", &self.info.id).finish()
    }
}

impl RemoteAgent for UcxPeer {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        // UCX unpacks the key on the endpoint, which exists only once the peer is used; the
        // framing and checksum are checked now so a corrupt key never reaches UCX.
        if !UcxGrantKey::is_grant_key(public) {
            return Ok(Arc::new(UcxRemoteKey::decode(public)?));
        }
        let grant = UcxGrantKey::decode(public)?;
        // A grant for another agent, or expired, loads but is refused at use; one for this
        // agent is usable only once the peer knows this side holds it.
        if grant.peer == self.agent_name && unix_ms(std::time::SystemTime::now()) < grant.deadline_ms {
            self.hold(&grant)?;
        }
        Ok(Arc::new(grant))
    }

    fn post(&self, job: TransferJob) {
        if self.info.is_closed() {
            return job.done.complete(Err(self.info.disconnected("disconnected by the agent")));
        }
        if staged::needs_staging(&job.local, self.cuda) {
            return self.stager.post(Arc::clone(&self.info), job);
        }
        post(&self.engine, &self.info, job, true);
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        if self.info.is_closed() {
            return Err(self.info.disconnected("disconnected by the agent"));
        }
        notify(&self.engine, &self.info, message, self.notify_bound)
    }

    /// Wires the endpoint up as the first transfer would: an empty WRITE is one flush, which on
    /// a new endpoint completes once UCX has connected it to the peer, and fails (in peer error
    /// mode) or times out for a peer that is gone.
    fn connect_now(&self) -> Result<(), BackendError> {
        if self.info.is_closed() {
            return Err(self.info.disconnected("disconnected by the agent"));
        }
        post_and_wait(&self.engine, &self.info, Op::Write, Vec::new(), Vec::new(), true, self.notify_bound)
    }

    fn disconnect(&self) {
        if !self.info.closed.swap(true, Ordering::AcqRel) {
            let info = &self.info;
            let _ = self.engine.with(|engine| engine.disconnect(info));
        }
    }
}

/// Posts a job as [`post`] does and waits for it, at most `bound`.
pub fn post_and_wait(
    engine: &Arc<Shared>,
    info: &Arc<PeerInfo>,
    op: Op,
    local: Vec<LocalMem>,
    remote: Vec<RemoteSeg>,
    visible: bool,
    bound: Duration,
) -> Result<(), BackendError> {
    let (completion, done) = Completion::new();
    post(engine, info, TransferJob { op, local, remote, notif: None, done }, visible);
    let status = completion.wait(bound);
    // The completion (dropped here) held the other reference to a failure.
    drop(completion);
    match status {
        Status::InProgress => Err(BackendError::TimedOut(bound)),
        Status::Done => Ok(()),
        Status::Failed(err) => Err(Arc::try_unwrap(err).unwrap_or_else(|err| BackendError::Protocol(err.to_string()))),
    }
}

/// Posts a job of memory UCX takes as it is, on the caller's thread; a WRITE completes once
/// its data is `visible` at the target, or else once its puts let go of the local memory.
pub fn post(engine: &Arc<Shared>, info: &Arc<PeerInfo>, job: TransferJob, visible: bool) {
    job.done.set_progress(engine.hook());
    let mut job = Some(job);
    let in_flight = engine.with(|engine| job.take().is_some_and(|job| engine.post(info, job, visible)));
    match in_flight {
        // Make sure someone progresses it, should the caller not wait. Not for a job refused
        // or completed at once: its caller will not drive, and callers posting such jobs in a
        // loop would otherwise keep the progress thread standing back from the work in flight.
        Ok(true) => engine.posted(),
        Ok(false) => {}
        Err(err) => {
            if let Some(job) = job {
                job.done.complete(Err(err));
            }
        }
    }
}

impl UcxPeer {
    /// Announces this side as the grant's holder (`Hold`, module `grants`) and waits, bounded,
    /// for the peer's answer. Refused (revoked or expired meanwhile): the grant loads, revoked.
    /// Unanswered: it fails, since the peer could not tell this side of a revocation.
    fn hold(&self, grant: &UcxGrantKey) -> Result<(), BackendError> {
        let info = &self.info;
        let conn_info = &self.own_conn_info;
        let answer =
            round_trip(&self.engine, self.notify_bound, |engine, reply| engine.hold(info, grant, conn_info, reply));
        let grant_id = grant.grant_id;
        match answer {
            Ok(()) => Ok(()),
            Err(err) => {
                self.engine.with(|engine| engine.mark_revoked(grant_id))?;
                match err {
                    BackendError::Refused { code: RefusalCode::Revoked, .. } => Ok(()),
                    other => Err(other),
                }
            }
        }
    }
}

/// Sends a notification and waits, at most `bound`, for the peer's acknowledgement.
pub fn notify(engine: &Shared, info: &Arc<PeerInfo>, message: &[u8], bound: Duration) -> Result<(), BackendError> {
    round_trip(engine, bound, |engine, reply| engine.notify(info, message, reply))
}

/// Sends a message with `send` and waits, at most `bound`, for the peer's answer (driving the
/// worker meanwhile).
fn round_trip(
    engine: &Shared,
    bound: Duration,
    send: impl FnOnce(&mut Engine, Sender<Result<(), BackendError>>) + std::marker::Send,
) -> Result<(), BackendError> {
    let (reply, answer) = crossbeam_channel::bounded(1);
    engine.with(|engine| send(engine, reply))?;
    engine.posted();
    let deadline = Instant::now() + bound;
    engine.drive_until(|| !answer.is_empty(), deadline);
    answer.recv_deadline(deadline).map_err(|_| BackendError::TimedOut(bound))?
}

impl Drop for UcxPeer {
    fn drop(&mut self) {
        self.disconnect();
    }
}
