use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// Received notifications, queued per sending agent in arrival order.
#[derive(Debug, Default)]
pub(crate) struct NotifQueues {
    queues: Mutex<HashMap<String, Vec<Vec<u8>>>>,
    arrived: Condvar,
}

impl NotifQueues {
    pub fn push(&self, peer: &str, message: Vec<u8>) {
        let mut queues = self.queues.lock();
        match queues.get_mut(peer) {
            Some(queue) => queue.push(message),
            None => {
                queues.insert(peer.to_string(), vec![message]);
            }
        }
        self.arrived.notify_all();
    }

    pub fn drain_all(&self) -> HashMap<String, Vec<Vec<u8>>> {
        std::mem::take(&mut *self.queues.lock())
    }

    pub fn drain_from(&self, peer: &str) -> Vec<Vec<u8>> {
        self.queues.lock().remove(peer).unwrap_or_default()
    }

    /// Waits until any notification is queued; `false` on timeout.
    pub fn wait_any(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut queues = self.queues.lock();
        while queues.values().all(Vec::is_empty) {
            if self.arrived.wait_until(&mut queues, deadline).timed_out() {
                return queues.values().any(|q| !q.is_empty());
            }
        }
        true
    }
}
