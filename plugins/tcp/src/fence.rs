//! Fencing of abandoned connections. An initiator that gives up on a connection mid-exchange
//! (timeout) may have left a WRITE in the target's socket buffer; if the target was merely
//! frozen, it would apply those bytes late, after newer writes. So each connection says which
//! session (random per pool) and epoch (bumped per abandonment) it belongs to, and the target
//! lets only the initiator's current ones touch memory.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::frame::Session;

/// The current session of one initiator. Frames hold a read guard while they touch memory; a
/// newer connection takes the write guard to take over, so it waits for those frames to end
/// and every later frame of an older connection sees it is stale.
pub type Fence = Arc<RwLock<Session>>;

#[derive(Debug, Default)]
pub struct Fences {
    by_initiator: Mutex<HashMap<String, Fence>>,
}

impl Fences {
    /// Admits a new connection: a new session, or a later epoch of the current one, becomes
    /// current; an earlier epoch of the current session is refused (`None`).
    pub fn admit(&self, initiator: &str, session: Session) -> Option<Fence> {
        let fence = Arc::clone(self.by_initiator.lock().entry(initiator.to_string()).or_default());
        {
            let current = fence.read();
            if *current == session {
                return Some(Arc::clone(&fence));
            }
            if current.id == session.id && session.epoch < current.epoch {
                return None;
            }
        }
        *fence.write() = session;
        Some(fence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_connections_fence_older_ones() {
        let fences = Fences::default();
        let first = Session { id: 1, epoch: 0 };
        let fence = fences.admit("a", first).unwrap();
        assert!(fences.admit("a", first).is_some(), "parallel streams of one session coexist");
        assert_eq!(*fence.read(), first);
        let later = Session { id: 1, epoch: 2 };
        assert!(fences.admit("a", later).is_some());
        assert_ne!(*fence.read(), first, "the old connections now see they are stale");
        assert!(fences.admit("a", first).is_none(), "an older epoch cannot come back");
        let restarted = Session { id: 9, epoch: 0 };
        assert!(fences.admit("a", restarted).is_some(), "a new session (restarted initiator) takes over");
        assert!(fences.admit("b", first).is_some(), "initiators are independent");
    }
}
