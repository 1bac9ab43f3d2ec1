//! A transfer request: created once, posted (and reposted), polled or awaited, cancelled.

use std::future::Future;
use std::pin::Pin as StdPin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xfer_core::{Completion, LocalMem, Op, Pin, RemoteAgent, RemoteSeg, Status, TransferJob};

use crate::error::XferError;
use crate::prepared::LocalSeg;
use crate::tables::Peer;

/// Per-request choices.
#[derive(Clone, Debug, Default)]
pub struct RequestOptions {
    /// Delivered to the peer after the data is visible there.
    pub notif: Option<Vec<u8>>,
    /// Use this backend instead of choosing by capability.
    pub backend: Option<String>,
}

impl RequestOptions {
    pub fn notify(message: impl AsRef<[u8]>) -> Self {
        RequestOptions { notif: Some(message.as_ref().to_vec()), backend: None }
    }

    pub fn backend(mut self, name: impl Into<String>) -> Self {
        self.backend = Some(name.into());
        self
    }
}

/// What one posting of a request moved and how long it took.
#[derive(Clone, Debug)]
pub struct Telemetry {
    pub backend: &'static str,
    pub bytes: u64,
    pub descriptors: usize,
    pub posted_at: Instant,
    /// Post-to-complete time; `None` while in progress.
    pub duration: Option<Duration>,
}

/// `segs` with each one that continues the one before it (same region, by `same_region`, and
/// starting where it ends) folded into it. Backends move each side's bytes in list order,
/// whatever the other side's boundaries, so this is the same transfer in fewer, longer pieces:
/// an engine that lists a KV run block by block (SGLang, one descriptor per token and layer)
/// costs UCX one operation per run, not per block.
fn merge_runs<S>(
    mut segs: Vec<S>,
    same_region: impl Fn(&S, &S) -> bool,
    span: impl Fn(&mut S) -> (u64, &mut u64),
) -> Vec<S> {
    // In place, so a request costs no second list: `segs[..kept]` are the merged runs so far.
    let mut kept = 0;
    for i in 0..segs.len() {
        if kept > 0 {
            let (before, from) = segs.split_at_mut(i);
            let (last, seg) = (&mut before[kept - 1], &mut from[0]);
            if same_region(last, seg) {
                let (addr, len) = span(seg);
                let len = *len;
                let (last_addr, last_len) = span(last);
                if last_addr.checked_add(*last_len) == Some(addr) {
                    *last_len += len;
                    continue;
                }
            }
        }
        segs.swap(kept, i);
        kept += 1;
    }
    segs.truncate(kept);
    segs
}

/// A READ or WRITE between local and remote descriptor lists. Dropping it releases it; a
/// posting still in flight is cancelled (the memory stays pinned until the backend lets go).
pub struct XferRequest {
    op: Op,
    backend: &'static str,
    link: Arc<dyn RemoteAgent>,
    /// The descriptors as given, contiguous runs merged ([`merge_runs`]).
    local: Vec<LocalSeg>,
    remote: Vec<RemoteSeg>,
    /// Local descriptors as given (telemetry counts them so).
    descriptors: usize,
    notif: Option<Vec<u8>>,
    bytes: u64,
    current: Mutex<Option<Arc<Completion>>>,
    /// Keeps the peer's unpacked keys alive for as long as the request may be posted.
    _peer: Arc<Peer>,
}

impl std::fmt::Debug for XferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XferRequest")
            .field("op", &self.op)
            .field("peer", &self._peer.name)
            .field("backend", &self.backend)
            .field("bytes", &self.bytes)
            .field("descriptors", &self.descriptors)
            .finish_non_exhaustive()
    }
}

impl XferRequest {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        op: Op,
        backend: &'static str,
        link: Arc<dyn RemoteAgent>,
        local: Vec<LocalSeg>,
        remote: Vec<RemoteSeg>,
        notif: Option<Vec<u8>>,
        bytes: u64,
        peer: Arc<Peer>,
    ) -> Self {
        let descriptors = local.len();
        let local = merge_runs(local, |a, b| Arc::ptr_eq(&a.entry, &b.entry), |s| (s.addr, &mut s.len));
        let remote = merge_runs(remote, |a, b| Arc::ptr_eq(&a.key, &b.key), |s| (s.addr, &mut s.len));
        XferRequest {
            op,
            backend,
            link,
            local,
            remote,
            descriptors,
            notif,
            bytes,
            current: Mutex::new(None),
            _peer: peer,
        }
    }

    pub fn op(&self) -> Op {
        self.op
    }

    pub fn backend(&self) -> &'static str {
        self.backend
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn peer(&self) -> &str {
        &self._peer.name
    }

    /// Starts the transfer. A finished request may be posted again (same descriptors).
    pub fn post(&self) -> Result<(), XferError> {
        let mut current = self.current.lock();
        if current.as_ref().is_some_and(|c| !c.status().is_finished()) {
            return Err(XferError::Busy);
        }
        let local = self.pin_local()?;
        let (completion, done) = Completion::new();
        *current = Some(completion);
        drop(current);
        self.link.post(TransferJob {
            op: self.op,
            local,
            remote: self.remote.clone(),
            notif: self.notif.clone(),
            done,
        });
        Ok(())
    }

    /// Pins every local region the request touches (once per run of descriptors in the same
    /// region) and slices the descriptors out of them.
    fn pin_local(&self) -> Result<Vec<LocalMem>, XferError> {
        let mut pinned: Option<(u64, Pin)> = None;
        let mut slices = Vec::with_capacity(self.local.len());
        for seg in &self.local {
            let region = &seg.entry.region;
            let pin = match &pinned {
                Some((id, pin)) if *id == region.id() => pin.clone(),
                _ => {
                    let pin = region.pin().ok_or(XferError::Deregistered)?;
                    pinned = Some((region.id(), pin.clone()));
                    pin
                }
            };
            let slice = pin.local_at(seg.addr, seg.len).ok_or_else(|| {
                XferError::NoBackend(format!("{} memory has no form backends move", region.mem_type()))
            })?;
            slices.push(slice);
        }
        Ok(slices)
    }

    fn completion(&self) -> Result<Arc<Completion>, XferError> {
        self.current.lock().clone().ok_or(XferError::NotPosted)
    }

    fn result(&self, status: Status) -> Result<bool, XferError> {
        match status {
            Status::InProgress => Ok(false),
            Status::Done => Ok(true),
            Status::Failed(err) => Err(XferError::from_backend(self.backend, err)),
        }
    }

    /// `Ok(true)` when done, `Ok(false)` while in progress, the error when it failed. Backends
    /// that can progress on any thread (UCX) make progress here too, without blocking.
    pub fn poll(&self) -> Result<bool, XferError> {
        self.result(self.completion()?.progress_and_status())
    }

    /// Blocks until done, failed, or `timeout` passes (then `TimedOut`; the request goes on).
    /// Backends that can progress on any thread (UCX) are driven by this thread while it waits.
    pub fn wait(&self, timeout: Duration) -> Result<(), XferError> {
        match self.result(self.completion()?.wait(timeout))? {
            true => Ok(()),
            false => Err(XferError::TimedOut(timeout)),
        }
    }

    /// Resolves when the current posting finishes. Bound it with your runtime's timeout.
    pub fn wait_async(&self) -> WaitFuture<'_> {
        WaitFuture { request: self, completion: self.completion() }
    }

    /// Asks the backend to stop; `poll`/`wait` report `Cancelled` once it no longer touches the
    /// memory (parts already on the wire may complete).
    pub fn cancel(&self) {
        if let Some(completion) = self.current.lock().as_ref() {
            completion.cancel();
        }
    }

    /// Telemetry of the current (or last) posting.
    pub fn telemetry(&self) -> Option<Telemetry> {
        let completion = self.current.lock().clone()?;
        Some(Telemetry {
            backend: self.backend,
            bytes: self.bytes,
            descriptors: self.descriptors,
            posted_at: completion.posted_at(),
            duration: completion.elapsed(),
        })
    }
}

impl Drop for XferRequest {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// Future returned by [`XferRequest::wait_async`].
#[derive(Debug)]
pub struct WaitFuture<'a> {
    request: &'a XferRequest,
    completion: Result<Arc<Completion>, XferError>,
}

impl Future for WaitFuture<'_> {
    type Output = Result<(), XferError>;

    fn poll(self: StdPin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let completion = match &this.completion {
            Ok(completion) => completion,
            Err(_) => return Poll::Ready(Err(XferError::NotPosted)),
        };
        match completion.poll_finished(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(status) => Poll::Ready(this.request.result(status).map(|_| ())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::merge_runs;

    #[test]
    fn runs_merge_only_within_a_region_and_only_where_they_continue() {
        // (region, addr, len)
        let segs = vec![
            (1, 100, 10),
            (1, 110, 5),
            (1, 115, 0),
            (1, 115, 5), // continues after an empty one
            (2, 120, 4), // adjacent, another region
            (2, 130, 1), // a gap
            (1, 131, 1), // would continue region 2's run
            (1, 120, 3), // backwards
            (1, u64::MAX - 1, 2),
            (1, 0, 1), // past the end of the address space does not wrap to 0
        ];
        let merged = merge_runs(segs, |a, b| a.0 == b.0, |s| (s.1, &mut s.2));
        assert_eq!(
            merged,
            vec![(1, 100, 20), (2, 120, 4), (2, 130, 1), (1, 131, 1), (1, 120, 3), (1, u64::MAX - 1, 2), (1, 0, 1)]
        );
    }
}
