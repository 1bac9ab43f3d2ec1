//! `RemoteAgent` for one peer: posts and notifies on the caller's thread, under the engine's
//! lock; jobs with memory UCX cannot take go to the stager (`staged`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer_core::{BackendError, RemoteAgent, RemoteKey, TransferJob};

use crate::conn::PeerInfo;
use crate::engine::Shared;
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
        Ok(Arc::new(UcxRemoteKey::decode(public)?))
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

    fn disconnect(&self) {
        if !self.info.closed.swap(true, Ordering::AcqRel) {
            let info = &self.info;
            let _ = self.engine.with(|engine| engine.disconnect(info));
        }
    }
}

/// Posts a job of memory UCX takes as it is, on the caller's thread; a WRITE completes once
/// its data is `visible` at the target, or else once its puts let go of the local memory.
pub fn post(engine: &Arc<Shared>, info: &Arc<PeerInfo>, job: TransferJob, visible: bool) {
    job.done.set_progress(engine.hook());
    let mut job = Some(job);
    let posted = engine.with(|engine| {
        if let Some(job) = job.take() {
            engine.post(info, job, visible);
        }
    });
    match posted {
        // In flight (not completed at once): make sure someone progresses it, should the
        // caller not wait.
        Ok(()) if engine.is_busy() => engine.posted(),
        Ok(()) => {}
        Err(err) => {
            if let Some(job) = job {
                job.done.complete(Err(err));
            }
        }
    }
}

/// Sends a notification and waits, at most `bound`, for the peer's acknowledgement.
pub fn notify(engine: &Shared, info: &Arc<PeerInfo>, message: &[u8], bound: Duration) -> Result<(), BackendError> {
    let (reply, answer) = crossbeam_channel::bounded(1);
    engine.with(|engine| engine.notify(info, message, reply))?;
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
