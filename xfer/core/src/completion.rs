//! Completion of a posted transfer, shared between the request handle and the backend.
//!
//! A backend whose progress can run on any thread (e.g. a UCX worker) attaches a [`Progress`]
//! hook to its completions: a thread that waits then drives the backend itself instead of
//! sleeping until the backend's own thread finishes the request and wakes it (two cross-thread
//! wake-ups per request, which cost more than moving a megabyte through shared memory). The
//! TCP backend attaches one to small requests its caller's thread sent (the waiter reads the
//! answer, a poller hands it to the backend's threads).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
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

/// Lets the threads that wait for or poll a request make its backend progress.
pub trait Progress: Send + Sync {
    /// Makes whatever progress is possible right now without blocking (from `poll`). May do
    /// nothing, e.g. when another thread is driving the backend.
    fn progress(&self);

    /// Called by a thread about to wait for `completion` until `deadline`: drives the backend
    /// on this thread until the completion finishes or the deadline passes, or returns earlier
    /// to leave the rest to the backend's own threads (the caller then blocks as usual, so
    /// returning at once is always correct).
    fn drive(&self, completion: &Completion, deadline: Instant);
}

/// The shared completion record of one posting.
pub struct Completion {
    state: Mutex<State>,
    finished: Condvar,
    /// Set once the status is final: a lock-free check for drivers and pollers.
    done: AtomicBool,
    cancel: AtomicBool,
    posted_at: Instant,
    progress: OnceLock<Arc<dyn Progress>>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("state", &self.state)
            .field("cancel", &self.cancel)
            .field("posted_at", &self.posted_at)
            .field("progress_hook", &self.progress.get().is_some())
            .finish_non_exhaustive()
    }
}

impl Completion {
    /// A new in-progress completion and the backend's half of it.
    pub fn new() -> (Arc<Completion>, Completer) {
        let completion = Arc::new(Completion {
            state: Mutex::new(State { status: Status::InProgress, finished_at: None, waker: None }),
            finished: Condvar::new(),
            done: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            posted_at: Instant::now(),
            progress: OnceLock::new(),
        });
        let completer = Completer(Some(Arc::clone(&completion)));
        (completion, completer)
    }

    pub fn status(&self) -> Status {
        self.state.lock().status.clone()
    }

    /// Whether the status is final (`Done` or `Failed`); lock-free.
    pub fn is_finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    /// Runs the backend's [`Progress::progress`] when it attached a hook, then returns the
    /// status (for pollers).
    pub fn progress_and_status(&self) -> Status {
        if !self.is_finished() {
            if let Some(hook) = self.progress.get() {
                hook.progress();
            }
        }
        self.status()
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

    /// Blocks until finished or `timeout` passes; returns the status at that point. When the
    /// backend attached a [`Progress`] hook, this thread drives it first.
    pub fn wait(&self, timeout: Duration) -> Status {
        let now = Instant::now();
        let deadline = now.checked_add(timeout).unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
        if !self.is_finished() {
            if let Some(hook) = self.progress.get() {
                hook.drive(self, deadline);
            }
        }
        let mut state = self.state.lock();
        while !state.status.is_finished() {
            if self.finished.wait_until(&mut state, deadline).timed_out() {
                break;
            }
        }
        state.status.clone()
    }

    /// Async readiness: `Ready` with the final status once finished. Runs the backend's
    /// [`Progress::progress`] first, as [`Completion::progress_and_status`] does.
    pub fn poll_finished(&self, cx: &mut Context<'_>) -> Poll<Status> {
        if !self.is_finished() {
            if let Some(hook) = self.progress.get() {
                hook.progress();
            }
        }
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
            self.done.store(true, Ordering::Release);
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
    /// Attaches the backend's progress hook, used by threads that wait for or poll this
    /// request. Only the first call counts.
    pub fn set_progress(&self, hook: Arc<dyn Progress>) {
        if let Some(completion) = &self.0 {
            let _ = completion.progress.set(hook);
        }
    }

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

    /// A hook that completes the request from the waiting (or polling) thread itself.
    struct Inline(Mutex<Option<Completer>>, std::sync::atomic::AtomicUsize);

    impl Progress for Inline {
        fn progress(&self) {
            self.1.fetch_add(1, Ordering::Relaxed);
        }

        fn drive(&self, completion: &Completion, _deadline: Instant) {
            assert!(!completion.is_finished());
            if let Some(done) = self.0.lock().take() {
                done.complete(Ok(()));
            }
            assert!(completion.is_finished());
        }
    }

    #[test]
    fn a_progress_hook_runs_on_the_waiting_thread() {
        let (completion, completer) = Completion::new();
        let (_, other) = Completion::new();
        let hook = Arc::new(Inline(Mutex::new(Some(other)), Default::default()));
        completer.set_progress(hook.clone());
        assert!(matches!(completion.progress_and_status(), Status::InProgress));
        assert_eq!(hook.1.load(Ordering::Relaxed), 1);
        *hook.0.lock() = Some(completer);
        let start = Instant::now();
        assert!(matches!(completion.wait(Duration::from_secs(5)), Status::Done));
        assert!(start.elapsed() < Duration::from_secs(1));
        // Finished: neither waiting nor polling calls the hook again.
        assert!(matches!(completion.wait(Duration::MAX), Status::Done));
        assert!(matches!(completion.progress_and_status(), Status::Done));
        assert_eq!(hook.1.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn wait_is_bounded() {
        let (completion, _completer) = Completion::new();
        let start = Instant::now();
        assert!(matches!(completion.wait(Duration::from_millis(30)), Status::InProgress));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
