//! SGLang-style pairing by bootstrap room: the prefill holds a room's blocks until the decode
//! with the same room pulls them (or a timeout); rooms in flight are unique per engine.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::pool::BlockId;

/// The notification a decode sends the prefill after reading a room's blocks.
pub fn room_done(room: i64) -> String {
    format!("ROOM:{room}")
}

pub fn parse_room_done(msg: &[u8]) -> Option<i64> {
    std::str::from_utf8(msg).ok()?.strip_prefix("ROOM:")?.parse().ok()
}

/// What the prefill's bootstrap server tells a decode about a room.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomInfo {
    pub engine_id: String,
    pub xfer_host: String,
    pub xfer_port: u16,
    pub block_ids: Vec<BlockId>,
    pub num_tokens: usize,
}

#[derive(Debug)]
struct Room {
    blocks: Vec<BlockId>,
    num_tokens: usize,
    pulled: Arc<Notify>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bootstrap_room {0} is already in flight")]
pub struct DuplicateRoom(pub i64);

#[derive(Debug, Default)]
pub struct RoomTable {
    /// Prefill side: rooms whose blocks wait for their decode.
    held: HashMap<i64, Room>,
    /// Both sides: rooms with a request in flight (duplicates are refused).
    in_flight: HashSet<i64>,
}

impl RoomTable {
    /// Claims a room for a request; released by [`end`](Self::end).
    pub fn begin(&mut self, room: i64) -> Result<(), DuplicateRoom> {
        if self.in_flight.insert(room) {
            Ok(())
        } else {
            Err(DuplicateRoom(room))
        }
    }

    /// Ends a request's claim; returns the room's held blocks, if any, for release.
    pub fn end(&mut self, room: i64) -> Vec<BlockId> {
        self.in_flight.remove(&room);
        self.held.remove(&room).map(|r| r.blocks).unwrap_or_default()
    }

    /// Prefill: publishes a room's blocks; the returned `Notify` fires when the decode pulled.
    pub fn hold(&mut self, room: i64, blocks: Vec<BlockId>, num_tokens: usize) -> Arc<Notify> {
        let pulled = Arc::new(Notify::new());
        self.held.insert(room, Room { blocks, num_tokens, pulled: Arc::clone(&pulled) });
        pulled
    }

    pub fn lookup(&self, room: i64) -> Option<(Vec<BlockId>, usize)> {
        self.held.get(&room).map(|r| (r.blocks.clone(), r.num_tokens))
    }

    pub fn mark_pulled(&mut self, room: i64) {
        if let Some(r) = self.held.get(&room) {
            // notify_one keeps a permit when the prefill is not waiting yet: no lost wake-up.
            r.pulled.notify_one();
        }
    }

    pub fn len(&self) -> usize {
        self.in_flight.len()
    }

    pub fn is_empty(&self) -> bool {
        self.in_flight.is_empty()
    }

    pub fn held_blocks(&self) -> usize {
        self.held.values().map(|r| r.blocks.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rooms_pair_once_and_release() {
        let mut t = RoomTable::default();
        t.begin(-5).unwrap();
        assert_eq!(t.begin(-5), Err(DuplicateRoom(-5)));
        let pulled = t.hold(-5, vec![1, 2], 20);
        assert_eq!(t.lookup(-5), Some((vec![1, 2], 20)));
        assert_eq!(parse_room_done(room_done(-5).as_bytes()), Some(-5));
        t.mark_pulled(-5);
        tokio::time::timeout(std::time::Duration::from_secs(1), pulled.notified()).await.unwrap();
        assert_eq!((t.held_blocks(), t.end(-5), t.len()), (2, vec![1, 2], 0));
        assert_eq!(parse_room_done(b"ROOM:x"), None);
    }
}
