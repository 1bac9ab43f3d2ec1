//! Memory UCX cannot take as it is (files; GPU memory when this UCX has no CUDA) moves as TCP's
//! does: through a copy lane's host slots (`xfer_core::staging`), so that the copy of one slot
//! overlaps the UCX operation on the one before. One stager thread per backend runs the staged
//! requests in order; each slot's bytes go as a sub-request of its own (a get, or a put) posted
//! to the engine like any other and waited for, so timeouts, dead peers and cancellation behave
//! as for host memory. A put's completion frees its slot; one flush after the last makes a
//! WRITE visible at the target, and the notification follows it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use xfer_core::split::Segment as _;
use xfer_core::staging::{self, Flow, LaneCache, Staging, StagingConfig, Wire};
use xfer_core::{
    BackendError, Desc, LocalMem, LocalRegion, MemSlice, MemType, Op, RefusalCode, RemoteSeg, TransferJob,
};

use crate::conn::PeerInfo;
use crate::engine::Shared;
use crate::peer;

/// Ids of the regions laid over staging slots for one sub-request; far from the agent's ids,
/// and never registered with UCX (no handle is looked up for them).
static SLOT_REGION_IDS: AtomicU64 = AtomicU64::new(1 << 62);

/// A staged job and the peer it goes to.
type Queued = (Arc<PeerInfo>, TransferJob);

/// Whether a job holds memory this UCX cannot address, so it must be staged.
pub fn needs_staging(local: &[LocalMem], cuda: bool) -> bool {
    local.iter().any(|piece| match piece {
        LocalMem::Host(_) => false,
        LocalMem::Device(_) => !cuda,
        LocalMem::File(_) => true,
    })
}

/// The backend's stager: its thread starts with the first staged request.
pub struct Stager {
    engine: Arc<Shared>,
    staging: Arc<dyn Staging>,
    config: StagingConfig,
    /// A sub-request's wait: the backend's timeout (the engine fails an operation that makes no
    /// progress for that long) and some slack.
    bound: Duration,
    max_op_bytes: u64,
    queue: Mutex<Option<Sender<Queued>>>,
}

impl std::fmt::Debug for Stager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Stager {
    pub fn new(
        engine: Arc<Shared>,
        staging: Arc<dyn Staging>,
        config: StagingConfig,
        timeout: Duration,
        max_op_bytes: u64,
    ) -> Stager {
        let bound = timeout + Duration::from_secs(1);
        Stager { engine, staging, config, bound, max_op_bytes, queue: Mutex::new(None) }
    }

    /// Queues a staged job; it completes on the stager thread.
    pub fn post(&self, info: Arc<PeerInfo>, job: TransferJob) {
        let mut queue = self.queue.lock();
        if queue.is_none() {
            let (tx, rx) = crossbeam_channel::unbounded();
            let worker = Worker {
                engine: Arc::clone(&self.engine),
                staging: Arc::clone(&self.staging),
                config: self.config,
                bound: self.bound,
                max_op_bytes: self.max_op_bytes,
            };
            match std::thread::Builder::new().name("xfer-ucx-stage".into()).spawn(move || worker.run(rx)) {
                Ok(_) => *queue = Some(tx),
                Err(err) => return job.done.complete(Err(err.into())),
            }
        }
        if let Some(tx) = queue.as_ref() {
            if let Err(crossbeam_channel::SendError((_, job))) = tx.send((info, job)) {
                job.done.complete(Err(BackendError::Protocol("the ucx stager thread is gone".into())));
            }
        }
    }

    /// Lets the thread finish the queued jobs (their sub-requests fail once the engine is
    /// stopped) and end.
    pub fn shutdown(&self) {
        self.queue.lock().take();
    }
}

struct Worker {
    engine: Arc<Shared>,
    staging: Arc<dyn Staging>,
    config: StagingConfig,
    bound: Duration,
    max_op_bytes: u64,
}

impl Worker {
    fn run(self, jobs: Receiver<Queued>) {
        let mut lanes = LaneCache::default();
        for (info, job) in jobs {
            let TransferJob { op, mut local, remote, notif, done } = job;
            let mut wire = SubRequests {
                engine: &self.engine,
                info: &info,
                op,
                remote: remote.into_iter().filter(|seg| seg.len > 0).collect(),
                bound: self.bound,
                max_op_bytes: self.max_op_bytes,
                cancelled: &|| done.is_cancelled(),
                slots_held: false,
            };
            let result = self.move_job(&mut lanes, &mut local, &mut wire);
            if wire.slots_held {
                // An operation on a slot did not finish in time: UCX may still touch it.
                tracing::warn!(peer = %info.name, "ucx staging: a slot is still in use; its lane is abandoned");
                lanes.abandon();
            }
            let result = result.and_then(|()| match notif {
                Some(_) if done.is_cancelled() => Err(BackendError::Cancelled),
                Some(message) => peer::notify(&self.engine, &info, &message, self.bound),
                None => Ok(()),
            });
            done.complete(result);
        }
    }

    fn move_job(
        &self,
        lanes: &mut LaneCache,
        local: &mut [LocalMem],
        wire: &mut SubRequests<'_>,
    ) -> Result<(), BackendError> {
        let flow = match wire.op {
            Op::Write => Flow::ToWire,
            Op::Read => Flow::FromWire,
        };
        let local_total: u64 = local.iter().map(LocalMem::len).sum();
        let remote_total: u64 = wire.remote.iter().map(|seg| seg.len).sum();
        if local_total != remote_total {
            let message = format!("local {local_total} bytes vs remote {remote_total} bytes");
            return Err(BackendError::Refused { code: RefusalCode::BadRequest, message });
        }
        staging::check_files(flow, local)?;
        let lane = lanes.get(&*self.staging, self.config, local)?;
        staging::run(flow, local, lane, wire)?;
        match flow {
            Flow::ToWire => wire.flush(),
            Flow::FromWire => Ok(()),
        }
    }
}

/// The wire of a staged job: each call moves the next bytes of the remote segments as one
/// sub-request and waits for it.
struct SubRequests<'a> {
    engine: &'a Arc<Shared>,
    info: &'a Arc<PeerInfo>,
    op: Op,
    remote: VecDeque<RemoteSeg>,
    bound: Duration,
    max_op_bytes: u64,
    cancelled: &'a dyn Fn() -> bool,
    /// A slot's sub-request outlived its wait: UCX may still read or write the slot.
    slots_held: bool,
}

impl SubRequests<'_> {
    /// The next `len` bytes of the remote segments.
    fn take_remote(&mut self, mut len: u64) -> Result<Vec<RemoteSeg>, BackendError> {
        let mut out = Vec::new();
        while len > 0 {
            let Some(seg) = self.remote.front_mut() else {
                return Err(BackendError::Protocol("ucx staging ran past the remote segments".into()));
            };
            if seg.len <= len {
                len -= seg.len;
                out.extend(self.remote.pop_front());
            } else {
                out.push(seg.take_front(len));
                len = 0;
            }
        }
        Ok(out)
    }

    /// Posts `local` against the next remote bytes and waits until the engine completed it.
    fn move_piece(&mut self, local: LocalMem, bound: Duration) -> Result<(), BackendError> {
        if (self.cancelled)() {
            return Err(BackendError::Cancelled);
        }
        if self.info.is_closed() {
            return Err(self.info.disconnected("disconnected by the agent"));
        }
        let remote = self.take_remote(local.len())?;
        self.post_and_wait(vec![local], remote, false, bound)
    }

    /// Makes every put so far visible at the target (one flush; the slots' puts had none).
    fn flush(&mut self) -> Result<(), BackendError> {
        self.post_and_wait(Vec::new(), Vec::new(), true, self.bound)
    }

    fn post_and_wait(
        &mut self,
        local: Vec<LocalMem>,
        remote: Vec<RemoteSeg>,
        visible: bool,
        bound: Duration,
    ) -> Result<(), BackendError> {
        peer::post_and_wait(self.engine, self.info, self.op, local, remote, visible, bound)
    }

    /// Moves a slot's bytes through a region laid over them for this one sub-request.
    fn move_slot(&mut self, ptr: *mut u8, len: usize) -> Result<(), BackendError> {
        let id = SLOT_REGION_IDS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: `ptr .. ptr + len` is a slot of this job's copy lane, which the caller
        // borrows for this call; the region lives only inside it: it is closed and waited for
        // below before the borrow ends, and if UCX still holds it then (an operation that did not
        // finish in time) `slots_held` makes the worker abandon the lane, so the slot memory is
        // never freed or reused while UCX may touch it.
        let region = Arc::new(unsafe { LocalRegion::new(id, MemType::Dram, Desc::new(ptr as u64, len as u64, 0)) });
        let piece = region.pin().and_then(|pin| pin.slice(0, len as u64)).map(LocalMem::Host);
        let result = match piece {
            Some(piece) => self.move_piece(piece, self.bound),
            None => Err(BackendError::Protocol("ucx staging: a slot region closed early".into())),
        };
        if !region.close_and_wait(self.bound) {
            self.slots_held = true;
        }
        result
    }

    fn move_host(&mut self, slice: &MemSlice) -> Result<(), BackendError> {
        let whole =
            slice.sub(0, slice.len()).ok_or_else(|| BackendError::Protocol("ucx staging: host piece".into()))?;
        // The engine cuts a host piece into operations of `max_op_bytes`; each may take the
        // backend's timeout.
        let ops = (whole.len() as u64).div_ceil(self.max_op_bytes).max(1);
        let bound = self.bound.saturating_mul(u32::try_from(ops).unwrap_or(u32::MAX));
        self.move_piece(LocalMem::Host(whole), bound)
    }
}

impl Wire for SubRequests<'_> {
    fn send(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
        // UCX only reads the slot for a put.
        self.move_slot(bytes.as_ptr().cast_mut(), bytes.len())
    }

    fn send_host(&mut self, slice: &MemSlice) -> Result<(), BackendError> {
        self.move_host(slice)
    }

    fn receive(&mut self, bytes: &mut [u8]) -> Result<(), BackendError> {
        self.move_slot(bytes.as_mut_ptr(), bytes.len())
    }

    fn receive_host(&mut self, slice: &mut MemSlice) -> Result<(), BackendError> {
        self.move_host(slice)
    }
}
