//! How a job's end is reported, and how a striped request survives a rail failing. A request
//! to a peer reached over one rail completes its own [`Completer`]; a request to a peer with
//! several rails runs as one share per rail in use, and the [`Stripe`] they share completes
//! the request once every share has. A share that fails for its rail ([`is_rail_failure`]:
//! an error completion for the peer, or nothing completed within `failover_ms`) marks the rail
//! down and runs again, whole, on a rail that is up; only when none is left does the request
//! fail. With every share's data done, the notification (if any) goes as a job of no pieces on
//! a rail that is up, so it follows the data of every rail.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xfer_core::{BackendError, Completer, MemSlice};

use crate::engine::{Handle, Job, Piece};
use crate::fabric::Rma;
use crate::failover::{is_rail_failure, Marked, RailHealth};

/// Whom a job's end is reported to.
#[derive(Debug)]
pub enum Finish {
    Request(Completer),
    /// Share `part` of a striped request, running on `rail`.
    Part {
        stripe: Arc<Stripe>,
        part: usize,
        rail: usize,
    },
}

impl Finish {
    pub fn complete(self, result: Result<(), BackendError>) {
        match self {
            Finish::Request(done) => done.complete(result),
            Finish::Part { stripe, part, rail } => stripe.part_done(part, rail, result),
        }
    }

    /// The request was cancelled, or (a share) another share of it already failed.
    pub fn is_cancelled(&self) -> bool {
        match self {
            Finish::Request(done) => done.is_cancelled(),
            Finish::Part { stripe, .. } => stripe.is_cancelled(),
        }
    }
}

/// Bytes of a request not yet bound to a rail: the local piece, the remote address as the
/// peer's provider wants it, and the peer's key on each of its rails.
#[derive(Debug)]
pub struct Span {
    pub local: MemSlice,
    pub remote: u64,
    pub keys: Arc<[u64]>,
}

/// A peer as one of our rails reaches it.
#[derive(Debug)]
pub struct PeerRail {
    pub engine: Arc<Handle>,
    /// The rail engine's handle on this connection (it maps it to the peer's AV entry).
    pub address: u64,
    /// The peer's rail this one meets (the index of its keys).
    pub remote: usize,
}

/// A connected peer's rails, shared by its requests.
#[derive(Debug)]
pub struct PeerRails {
    pub name: String,
    /// At least one.
    pub rails: Vec<PeerRail>,
    pub health: Mutex<RailHealth>,
    /// The peer's notification chunk.
    pub chunk: usize,
    /// A request's bound without progress.
    pub timeout: Duration,
    /// A share's bound without progress on its rail before it moves.
    pub failover: Duration,
    pub closed: AtomicBool,
}

impl PeerRails {
    /// The job that moves `spans` over `rail`.
    pub fn job(
        &self,
        rail: usize,
        op: Rma,
        spans: &[Span],
        notif: Option<Vec<u8>>,
        stall: Duration,
        done: Finish,
    ) -> Result<Job, (BackendError, Finish)> {
        let on = &self.rails[rail];
        let mut pieces = std::collections::VecDeque::with_capacity(spans.len());
        for span in spans {
            let Some(&key) = span.keys.get(on.remote) else {
                let err = BackendError::InvalidMetadata(format!(
                    "a key for {} rails of peer {}, which has at least {}",
                    span.keys.len(),
                    self.name,
                    on.remote + 1
                ));
                return Err((err, done));
            };
            let Some(local) = span.local.sub(0, span.local.len()) else {
                return Err((BackendError::Protocol("a local piece outside itself".into()), done));
            };
            pieces.push_back(Piece { local, remote: span.remote, key });
        }
        Ok(Job { peer: on.address, peer_name: self.name.clone(), op, pieces, notif, chunk: self.chunk, stall, done })
    }

    /// Hands a job to its rail's engine, failing it if the engine has stopped.
    pub fn submit(&self, rail: usize, job: Job) {
        if let Err(job) = self.rails[rail].engine.try_post(job) {
            job.done.complete(Err(BackendError::Unsupported("the libfabric backend has shut down".into())));
        }
    }

    /// Builds and submits a job, failing it if it cannot be built.
    pub fn run_on(&self, rail: usize, op: Rma, spans: &[Span], notif: Option<Vec<u8>>, stall: Duration, done: Finish) {
        match self.job(rail, op, spans, notif, stall, done) {
            Ok(job) => self.submit(rail, job),
            Err((err, done)) => done.complete(Err(err)),
        }
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The error of a request none of whose rails is left.
    pub fn all_down(&self, last: &BackendError) -> BackendError {
        BackendError::PeerDisconnected {
            peer: self.name.clone(),
            reason: format!("every one of its {} libfabric rails is down (last: {last})", self.rails.len()),
        }
    }
}

/// The shares of one request, one per rail it started on.
#[derive(Debug)]
pub struct Stripe {
    peer: Arc<PeerRails>,
    op: Rma,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    left: usize,
    error: Option<BackendError>,
    /// Taken when the last share reports.
    done: Option<Completer>,
    notify: Option<Vec<u8>>,
    /// Every share's bytes, kept to run a share again elsewhere.
    shares: Vec<Arc<[Span]>>,
}

impl Stripe {
    /// Starts every share on its rail.
    pub fn start(
        peer: &Arc<PeerRails>,
        op: Rma,
        shares: Vec<(usize, Vec<Span>)>,
        done: Completer,
        notify: Option<Vec<u8>>,
    ) {
        let rails: Vec<usize> = shares.iter().map(|(rail, _)| *rail).collect();
        let shares: Vec<Arc<[Span]>> = shares.into_iter().map(|(_, spans)| spans.into()).collect();
        let stripe = Arc::new(Stripe {
            peer: Arc::clone(peer),
            op,
            state: Mutex::new(State {
                left: shares.len(),
                error: None,
                done: Some(done),
                notify,
                shares: shares.clone(),
            }),
        });
        for (part, (rail, spans)) in rails.into_iter().zip(shares).enumerate() {
            let done = Finish::Part { stripe: Arc::clone(&stripe), part, rail };
            peer.run_on(rail, op, &spans, None, peer.failover, done);
        }
    }

    fn is_cancelled(&self) -> bool {
        let state = self.state.lock();
        state.error.is_some() || state.done.as_ref().is_some_and(Completer::is_cancelled)
    }

    fn part_done(self: &Arc<Self>, part: usize, rail: usize, result: Result<(), BackendError>) {
        let peer = &self.peer;
        let mut state = self.state.lock();
        match result {
            Ok(()) => {
                if peer.health.lock().succeeded(rail) {
                    tracing::info!(peer = %peer.name, rail, "libfabric rail is up again");
                }
            }
            Err(err) => {
                let live = state.error.is_none() && !state.done.as_ref().is_some_and(Completer::is_cancelled);
                let err = if live && is_rail_failure(&err) && !peer.is_closed() {
                    match self.move_share(&mut state, part, rail, &err) {
                        Some(()) => return,
                        None => peer.all_down(&err),
                    }
                } else {
                    err
                };
                state.error.get_or_insert(err);
            }
        }
        state.left = state.left.saturating_sub(1);
        if state.left > 0 {
            return;
        }
        let (Some(done), error, notify) = (state.done.take(), state.error.take(), state.notify.take()) else {
            return;
        };
        drop(state);
        match (error, notify) {
            (Some(err), _) => done.complete(Err(err)),
            (None, None) => done.complete(Ok(())),
            (None, Some(message)) => {
                let rail = peer.health.lock().notify_rail(Instant::now());
                peer.run_on(rail, Rma::Write, &[], Some(message), peer.timeout, Finish::Request(done));
            }
        }
    }

    /// Marks `rail` down and runs share `part` again on a rail that is up (unlocking `state`
    /// first: a job that cannot be submitted reports at once). `None`: no rail is left.
    fn move_share(
        self: &Arc<Self>,
        state: &mut parking_lot::MutexGuard<'_, State>,
        part: usize,
        rail: usize,
        err: &BackendError,
    ) -> Option<()> {
        let peer = &self.peer;
        let to = {
            let mut health = peer.health.lock();
            match health.failed(rail, Instant::now()) {
                Marked::WentDown { retry_in } => {
                    tracing::warn!(peer = %peer.name, rail, %err, ?retry_in, "libfabric rail down: its shares move to the other rails");
                }
                Marked::StillDown { .. } => {}
            }
            health.reroute(rail)?
        };
        let spans = Arc::clone(state.shares.get(part)?);
        tracing::debug!(peer = %peer.name, from = rail, to, part, "libfabric share moves");
        let done = Finish::Part { stripe: Arc::clone(self), part, rail: to };
        parking_lot::MutexGuard::unlocked(state, || peer.run_on(to, self.op, &spans, None, peer.failover, done));
        Some(())
    }
}
