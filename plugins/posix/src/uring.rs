//! The io_uring engine: each worker owns a ring and keeps up to its depth of reads and writes
//! in flight, taken from as many queued tasks as fit, so one submission carries a batch and
//! the device sees a queue rather than one request at a time.
//!
//! A short read or write is resubmitted for the rest; a read that meets the end of the file is
//! `ShortFile`, an interrupted or would-block one is retried, every other errno maps as for
//! `pread`/`pwrite` ([`sys::os_error`]). The first error stops a request's unsubmitted runs;
//! the request completes once the ring has returned all of its submitted ones.

use std::collections::VecDeque;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use crossbeam_channel::{Receiver, TryRecvError};
use xfer_core::{BackendError, FileIoError};

use crate::pool::{Direction, Task, Tracker};
use crate::sys::ring::{Ring, RingIo, RingResult};
use crate::sys::{self};

/// Which task a piece belongs to and where its run started, for resubmitting the remainder and
/// for the numbers of a `ShortFile`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tag {
    task: usize,
    run_offset: u64,
    run_len: u64,
}

pub(crate) type UringRing = Ring<Tag>;

/// `count` rings of `depth` entries, or why this kernel or sandbox gives none.
pub(crate) fn rings(count: usize, depth: u32) -> io::Result<Vec<UringRing>> {
    (0..count).map(|_| Ring::new(depth)).collect()
}

/// A task whose runs are being moved.
struct Active {
    tracker: Arc<Tracker>,
    /// Runs (or remainders of runs) not yet handed to the ring.
    pending: VecDeque<RingIo<Tag>>,
    in_ring: usize,
}

/// Pause after `io_uring_enter` itself failed (not an I/O), so a broken ring does not spin.
const ENTER_RETRY: Duration = Duration::from_millis(1);

/// The worker's loop: until the queue is closed and every piece has come back.
pub(crate) fn run(receiver: Receiver<Task>, mut ring: UringRing) {
    let mut active: Vec<Option<Active>> = Vec::new();
    let mut completed = Vec::new();
    loop {
        while !ring.is_full() {
            if let Some(io) = next_pending(&mut active) {
                let index = io.tag.task;
                let pushed = ring.push(io);
                // The piece came from this slot, which stays taken while it has pieces.
                let Some(entry) = active[index].as_mut() else { continue };
                match pushed {
                    Ok(()) => entry.in_ring += 1,
                    Err(io) => {
                        entry.pending.push_front(io);
                        break;
                    }
                }
                continue;
            }
            // Nothing left to submit: another task, waiting for one only when the ring is idle.
            let task = if ring.in_flight() == 0 {
                match receiver.recv() {
                    Ok(task) => task,
                    Err(_) => return,
                }
            } else {
                match receiver.try_recv() {
                    Ok(task) => task,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            admit(&mut active, task);
        }
        if let Err(err) = ring.submit_and_reap(&mut completed) {
            for entry in active.iter().flatten() {
                entry.tracker.fail(BackendError::Io(io::Error::new(err.kind(), format!("io_uring_enter: {err}"))));
            }
            std::thread::sleep(ENTER_RETRY);
        }
        for (io, result) in completed.drain(..) {
            complete(&mut active, io, result);
        }
    }
}

/// Takes a task in: its runs become pending pieces under a free slot.
fn admit(active: &mut Vec<Option<Active>>, task: Task) {
    let index = active.iter().position(Option::is_none).unwrap_or_else(|| {
        active.push(None);
        active.len() - 1
    });
    let write = task.tracker.direction == Direction::HostToFile;
    let pending = task
        .ops
        .into_iter()
        .map(|op| RingIo {
            fd: op.fd,
            offset: op.file_offset,
            tag: Tag { task: index, run_offset: op.file_offset, run_len: op.host.len() as u64 },
            host: op.host,
            write,
        })
        .collect();
    active[index] = Some(Active { tracker: task.tracker, pending, in_ring: 0 });
    finish_if_done(active, index);
}

/// The next piece to submit, oldest task first; a stopped task's pieces are dropped.
fn next_pending(active: &mut [Option<Active>]) -> Option<RingIo<Tag>> {
    for index in 0..active.len() {
        let Some(entry) = active[index].as_mut() else { continue };
        if entry.tracker.stopped() {
            entry.pending.clear();
            finish_if_done(active, index);
            continue;
        }
        if let Some(io) = entry.pending.pop_front() {
            return Some(io);
        }
    }
    None
}

/// One completion: done, a remainder to resubmit, or the request's error.
fn complete(active: &mut [Option<Active>], mut io: RingIo<Tag>, result: RingResult) {
    let Tag { task, run_offset, run_len } = io.tag;
    // A piece's task stays active until its last piece is back.
    let Some(entry) = active[task].as_mut() else { return };
    entry.in_ring -= 1;
    let fd = io.fd;
    let op = if io.write { "write" } else { "read" };
    match result {
        Ok(n) if n == io.host.len() => {}
        Ok(0) if !io.write => {
            let got = io.offset - run_offset;
            entry.tracker.fail(FileIoError::ShortFile { fd, offset: run_offset, len: run_len, got }.into());
        }
        Ok(0) => {
            let err = io::Error::new(io::ErrorKind::WriteZero, "the file took no bytes");
            entry.tracker.fail(sys::os_error(fd, op, io.offset, io.host.len() as u64, err).into());
        }
        Ok(n) => {
            drop(io.host.split_front(n));
            io.offset += n as u64;
            entry.pending.push_front(io);
        }
        Err(err) if matches!(err.raw_os_error(), Some(libc::EINTR | libc::EAGAIN)) => entry.pending.push_front(io),
        Err(err) => entry.tracker.fail(sys::os_error(fd, op, io.offset, io.host.len() as u64, err).into()),
    }
    finish_if_done(active, task);
}

/// Completes the task once nothing of it is in the ring and nothing more will be submitted.
fn finish_if_done(active: &mut [Option<Active>], index: usize) {
    let Some(entry) = active[index].as_ref() else { return };
    if entry.in_ring > 0 || !(entry.pending.is_empty() || entry.tracker.stopped()) {
        return;
    }
    let Some(entry) = active[index].take() else { return };
    let tracker = Arc::clone(&entry.tracker);
    // Host pieces (and their pins) go before the request completes.
    drop(entry);
    tracker.finish_task();
}
