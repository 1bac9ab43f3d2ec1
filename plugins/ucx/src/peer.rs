//! `RemoteAgent` for one peer: hands its work to the progress thread.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use xfer_core::{BackendError, RemoteAgent, RemoteKey, TransferJob};

use crate::conn::PeerInfo;
use crate::engine::{Command, Handle};
use crate::keys::UcxRemoteKey;

pub struct UcxPeer {
    pub(crate) info: Arc<PeerInfo>,
    pub(crate) engine: Arc<Handle>,
    /// Bound on a standalone notification: the backend's timeout plus slack for the thread.
    pub(crate) notify_bound: Duration,
}

impl std::fmt::Debug for UcxPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxPeer").field("peer", &self.info.name).field("id", &self.info.id).finish()
    }
}

fn stopped() -> BackendError {
    BackendError::Protocol("the ucx backend is shut down".into())
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
        if let Err(Command::Post { job, .. }) = self.engine.send(Command::Post { peer: Arc::clone(&self.info), job }) {
            job.done.complete(Err(stopped()));
        }
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        if self.info.is_closed() {
            return Err(self.info.disconnected("disconnected by the agent"));
        }
        let (reply, answer) = crossbeam_channel::bounded(1);
        let command = Command::Notify { peer: Arc::clone(&self.info), message: message.to_vec(), reply };
        self.engine.send(command).map_err(|_| stopped())?;
        answer.recv_timeout(self.notify_bound).map_err(|_| BackendError::TimedOut(self.notify_bound))?
    }

    fn disconnect(&self) {
        if !self.info.closed.swap(true, Ordering::AcqRel) {
            let _ = self.engine.send(Command::Disconnect { peer: Arc::clone(&self.info) });
        }
    }
}

impl Drop for UcxPeer {
    fn drop(&mut self) {
        self.disconnect();
    }
}
