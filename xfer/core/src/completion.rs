//! Completion of a posted transfer, shared between the request handle and the backend.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::BackendError;

/// Where a posted transfer stands.
#[derive(Debug)]
pub enum Status {
    InProgress,
    Done,
    Failed(Arc<BackendError>),
}

impl Status {
    pub fn is_finished(&self) -> bool {
        !matches!(self, Status::InProgress)
    }
}

impl Clone for Status {
    fn clone(&self) -> Self {
        match self {
            Status::InProgress => Status::InProgress,
            Status::Done => Status::Done,
            Status::Failed(err) => Status::Failed(Arc::clone(err)),
        }
    }
}

#[derive(Debug)]
struct State {
    status: Status,
    finished_at: Option<Instant>,
    waker: Option<Waker>,
}

/// The shared completion record of one posting.
#[derive(Debug)]
pub struct Completion {
    state: Mutex<State>,
    finished: Condvar,
    cancel: AtomicBool,
    posted_at: Instant,
}

impl Completion {
    /// A new in-progress completion and the backend's half of it.
    pub fn new() -> (Arc<Completion>, Completer) {
        let completion = Arc::new(Completion {
            state: Mutex::new(State { status: Status::InProgress, finished_at: None, waker: None }),
            finished: Condvar::new(),
            cancel: AtomicBool::new(false),
            posted_at: Instant::now(),
        });
        let completer = Completer(Some(Arc::clone(&completion)));
        (completion, completer)
    }

    pub fn status(&self) -> Status {
        self.state.lock().status.clone()
    }

    /// Asks the backend to stop; the status turns to a `Cancelled` failure once the backend no
    /// longer touches the request's memory.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    pub fn is_cancel_requested(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    pub fn posted_at(&self) -> Instant {
        self.posted_at
    }

    /// Post-to-complete time, once finished.
    pub fn elapsed(&self) -> Option<Duration> {
        self.state.lock().finished_at.map(|at| at - self.posted_at)
    }

    /// Blocks until finished or `timeout` passes; returns the status at that point.
    pub fn wait(&self, timeout: Duration) -> Status {
        let deadline = Instant::now() + timeout;
        let mut state = self.state.lock();
        while !state.status.is_finished() {
            if self.finished.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.status.clone()
    }

    /// Async readiness: `Ready` with the final status once finished.
    pub fn poll_finished(&self, cx: &mut Context<'_>) -> Poll<Status> {
        let mut state = self.state.lock();
        if state.status.is_finished() {
            return Poll::Ready(state.status.clone());
        }
        match &state.waker {
            Some(waker) if waker.will_wake(cx.waker()) => {}
            _ => state.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }

    fn finish(&self, result: Result<(), BackendError>) {
        let waker = {
            let mut state = self.state.lock();
            if state.status.is_finished() {
                return;
            }
            state.status = match result {
                Ok(()) => Status::Done,
                Err(err) => Status::Failed(Arc::new(err)),
            };
            state.finished_at = Some(Instant::now());
            self.finished.notify_all();
            state.waker.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The backend's handle on a posted transfer: complete it exactly once. Dropping it without
/// completing fails the transfer, so a backend bug can never leave a waiter hanging.
#[derive(Debug)]
pub struct Completer(Option<Arc<Completion>>);

impl Completer {
    pub fn is_cancelled(&self) -> bool {
        self.0.as_ref().is_some_and(|c| c.is_cancel_requested())
    }

    pub fn complete(mut self, result: Result<(), BackendError>) {
        if let Some(completion) = self.0.take() {
            completion.finish(result);
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if let Some(completion) = self.0.take() {
            completion.finish(Err(BackendError::Protocol("backend dropped the request unfinished".into())));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completes_once_and_wakes_waiters() {
        let (completion, completer) = Completion::new();
        let waiter = {
            let completion = Arc::clone(&completion);
            std::thread::spawn(move || completion.wait(Duration::from_secs(5)))
        };
        completer.complete(Ok(()));
        assert!(matches!(waiter.join().unwrap(), Status::Done));
        assert!(completion.elapsed().is_some());
    }

    #[test]
    fn dropped_completer_fails_the_request() {
        let (completion, completer) = Completion::new();
        drop(completer);
        assert!(matches!(completion.status(), Status::Failed(_)));
    }

    #[test]
    fn wait_is_bounded() {
        let (completion, _completer) = Completion::new();
        let start = Instant::now();
        assert!(matches!(completion.wait(Duration::from_millis(30)), Status::InProgress));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
