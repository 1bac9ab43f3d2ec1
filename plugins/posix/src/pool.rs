//! The workers that run a request's reads and writes (with `pread`/`pwrite`, or each driving
//! an io_uring), and the bookkeeping that completes the request once its last task is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};
use parking_lot::Mutex;
use xfer_core::{BackendError, Completer, LocalMem, MemSlice, NotifSink};

use crate::sys;
use crate::uring::{self, UringRing};

/// Which way the bytes of a request go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// `pread`: file → host memory.
    FileToHost,
    /// `pwrite`: host memory → file.
    HostToFile,
}

/// One read or write: the host piece holds its registration's pin.
#[derive(Debug)]
pub(crate) struct IoOp {
    pub fd: i32,
    pub file_offset: u64,
    pub host: MemSlice,
}

/// Completion bookkeeping shared by a request's tasks.
pub(crate) struct Tracker {
    pub direction: Direction,
    pub remaining: AtomicUsize,
    pub error: Mutex<Option<BackendError>>,
    pub done: Mutex<Option<Completer>>,
    pub notif: Option<(NotifSink, String, Vec<u8>)>,
    /// Keeps the file side's registrations pinned (deregistration waits) until the end.
    pub _file_side: Vec<LocalMem>,
}

impl Tracker {
    pub(crate) fn stopped(&self) -> bool {
        self.error.lock().is_some() || self.done.lock().as_ref().is_some_and(Completer::is_cancelled)
    }

    pub(crate) fn fail(&self, err: BackendError) {
        self.error.lock().get_or_insert(err);
    }

    /// Completes the request once the last task has finished.
    pub(crate) fn finish_task(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let Some(done) = self.done.lock().take() else { return };
        let result = match self.error.lock().take() {
            Some(err) => Err(err),
            None if done.is_cancelled() => Err(BackendError::Cancelled),
            None => Ok(()),
        };
        // The data is in place (every write returned): only then the notification.
        if result.is_ok() {
            if let Some((sink, agent, message)) = &self.notif {
                sink(agent, message.clone());
            }
        }
        done.complete(result);
    }
}

/// A share of a request for one worker.
pub(crate) struct Task {
    pub ops: Vec<IoOp>,
    pub tracker: Arc<Tracker>,
}

/// What the workers do the I/O with.
#[derive(Debug)]
pub(crate) enum Workers {
    /// This many threads, one blocking `pread`/`pwrite` at a time each.
    Threads(usize),
    /// One thread per ring, each keeping its ring's depth of I/O in flight.
    Uring(Vec<UringRing>),
}

/// Fixed worker threads fed by one queue; dropping every sender stops them.
pub(crate) struct Pool {
    sender: Mutex<Option<Sender<Task>>>,
}

impl Pool {
    pub fn start(workers: Workers) -> Result<Pool, BackendError> {
        let (sender, receiver) = crossbeam_channel::unbounded::<Task>();
        let spawn = |index: usize, work: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(format!("xfer-posix-{index}")).spawn(work)
        };
        match workers {
            Workers::Threads(threads) => {
                for index in 0..threads.max(1) {
                    let receiver: Receiver<Task> = receiver.clone();
                    spawn(index, Box::new(move || receiver.into_iter().for_each(run)))?;
                }
            }
            Workers::Uring(rings) => {
                for (index, ring) in rings.into_iter().enumerate() {
                    let receiver: Receiver<Task> = receiver.clone();
                    spawn(index, Box::new(move || uring::run(receiver, ring)))?;
                }
            }
        }
        Ok(Pool { sender: Mutex::new(Some(sender)) })
    }

    /// Queues the tasks; after `stop` they fail at once.
    pub fn submit(&self, tasks: Vec<Task>) {
        let sender = self.sender.lock().clone();
        for task in tasks {
            match &sender {
                Some(sender) => {
                    if let Err(unsent) = sender.send(task) {
                        refuse(unsent.0);
                    }
                }
                None => refuse(task),
            }
        }
    }

    /// Workers finish what is queued, then exit.
    pub fn stop(&self) {
        self.sender.lock().take();
    }
}

fn refuse(task: Task) {
    task.tracker.fail(BackendError::Unsupported("the posix backend has shut down".into()));
    task.tracker.finish_task();
}

fn run(mut task: Task) {
    let tracker = Arc::clone(&task.tracker);
    for op in &mut task.ops {
        if tracker.stopped() {
            break;
        }
        let result = match tracker.direction {
            Direction::FileToHost => sys::read_exact_at(op.fd, op.file_offset, &mut op.host),
            Direction::HostToFile => sys::write_all_at(op.fd, op.file_offset, &op.host),
        };
        if let Err(err) = result {
            tracker.fail(err.into());
        }
    }
    // Host pieces (and their pins) go before the request completes.
    drop(task);
    tracker.finish_task();
}
