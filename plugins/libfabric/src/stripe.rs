//! How a job's end is reported. A request on one rail completes its own [`Completer`]; a
//! request striped over several rails runs as one part per rail, and the [`Stripe`] they share
//! completes the request once every part has: with the first part's error, or, all data moved,
//! by handing the notification (if any) to rail 0 as a job of no pieces, so it follows the data
//! of every rail.

use std::sync::Arc;

use parking_lot::Mutex;
use xfer_core::{BackendError, Completer};

use crate::engine::{Cmd, Handle, Job};
use crate::fabric::Rma;

/// Whom a job's end is reported to.
#[derive(Debug)]
pub enum Finish {
    Request(Completer),
    Part(Arc<Stripe>),
}

impl Finish {
    pub fn complete(self, result: Result<(), BackendError>) {
        match self {
            Finish::Request(done) => done.complete(result),
            Finish::Part(stripe) => stripe.part_done(result),
        }
    }

    /// The request was cancelled, or (a part) another part of it already failed.
    pub fn is_cancelled(&self) -> bool {
        match self {
            Finish::Request(done) => done.is_cancelled(),
            Finish::Part(stripe) => stripe.is_cancelled(),
        }
    }
}

/// The notification a striped request sends once all its parts are done, on rail 0.
#[derive(Debug)]
pub struct NotifyAfter {
    pub rail0: Arc<Handle>,
    /// The peer's AV entry on rail 0.
    pub peer: u64,
    pub peer_name: String,
    pub message: Vec<u8>,
    /// The peer's notification chunk.
    pub chunk: usize,
}

/// The parts of one request, one per rail.
#[derive(Debug)]
pub struct Stripe(Mutex<State>);

#[derive(Debug)]
struct State {
    left: usize,
    error: Option<BackendError>,
    /// Taken when the last part reports.
    done: Option<Completer>,
    notify: Option<NotifyAfter>,
}

impl Stripe {
    pub fn new(parts: usize, done: Completer, notify: Option<NotifyAfter>) -> Arc<Stripe> {
        Arc::new(Stripe(Mutex::new(State { left: parts, error: None, done: Some(done), notify })))
    }

    fn is_cancelled(&self) -> bool {
        let state = self.0.lock();
        state.error.is_some() || state.done.as_ref().is_some_and(Completer::is_cancelled)
    }

    fn part_done(&self, result: Result<(), BackendError>) {
        let mut state = self.0.lock();
        if let Err(err) = result {
            state.error.get_or_insert(err);
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
            (None, Some(NotifyAfter { rail0, peer, peer_name, message, chunk })) => {
                let job = Job {
                    peer,
                    peer_name,
                    op: Rma::Write,
                    pieces: Default::default(),
                    notif: Some(message),
                    chunk,
                    done: Finish::Request(done),
                };
                if let Err(crossbeam_channel::SendError(Cmd::Post(job))) = rail0.try_post(job) {
                    job.done.complete(Err(BackendError::Unsupported("the libfabric backend has shut down".into())));
                }
            }
        }
    }
}
