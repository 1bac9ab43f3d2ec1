//! Prefill-side holding of KV blocks for a decode engine that will pull them (vLLM's
//! NixlConnector behaviour): a lease per request, extended by heartbeats, ended by the decode's
//! "done" notification or by expiry. Sans-I/O: time is passed in.
//!
//! A lease may carry a fence `F` (the engine's revocable xfer grant over the blocks): whoever
//! ends a lease gets the fence back with the blocks and must lift it before the blocks are
//! reused. A fenced lease never outlives its fence's deadline, heartbeats or not.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::pool::BlockId;

/// A notification the prefill's agent received from a decode engine.
#[derive(Debug, PartialEq, Eq)]
pub enum Notif<'a> {
    /// `"{request_id}:{decode_world_size}"`: one decode rank finished reading.
    Done { request_id: &'a str, world_size: u32 },
    /// `"HB:{request_id}"`: the decode still wants the blocks.
    Heartbeat { request_id: &'a str },
}

impl<'a> Notif<'a> {
    pub fn parse(msg: &'a [u8]) -> Option<Notif<'a>> {
        let text = std::str::from_utf8(msg).ok()?;
        if let Some(id) = text.strip_prefix("HB:") {
            return (!id.is_empty()).then_some(Notif::Heartbeat { request_id: id });
        }
        let (id, n) = text.rsplit_once(':')?;
        let world_size = n.parse().ok().filter(|&n| n > 0)?;
        (!id.is_empty()).then_some(Notif::Done { request_id: id, world_size })
    }
}

#[derive(Debug)]
struct Lease<F> {
    blocks: Vec<BlockId>,
    fence: Option<(F, Instant)>,
    expires: Instant,
    done_notifs: u32,
}

/// What an ended lease gives back: lift the fence (if any), then reuse the blocks.
#[derive(Debug, PartialEq, Eq)]
pub struct Released<F> {
    pub blocks: Vec<BlockId>,
    pub fence: Option<F>,
}

impl<F> From<Lease<F>> for Released<F> {
    fn from(lease: Lease<F>) -> Self {
        Released { blocks: lease.blocks, fence: lease.fence.map(|(fence, _)| fence) }
    }
}

#[derive(Debug)]
pub struct LeaseTable<F> {
    duration: Duration,
    extension: Duration,
    leases: HashMap<String, Lease<F>>,
}

impl<F> LeaseTable<F> {
    pub fn new(duration: Duration, extension: Duration) -> Self {
        LeaseTable { duration, extension, leases: HashMap::new() }
    }

    /// How long a lease lasts without heartbeats (a fence should last as long).
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// Starts holding `blocks` for `request_id`, optionally fenced until the fence's deadline;
    /// returns the expiry. A second lease with the same id gives back the first one (the
    /// caller lifts its fence and releases its blocks).
    pub fn insert(
        &mut self,
        request_id: String,
        blocks: Vec<BlockId>,
        fence: Option<(F, Instant)>,
        now: Instant,
    ) -> (Instant, Option<Released<F>>) {
        let mut expires = now + self.duration;
        if let Some((_, deadline)) = &fence {
            expires = expires.min(*deadline);
        }
        let old = self.leases.insert(request_id, Lease { blocks, fence, expires, done_notifs: 0 });
        (expires, old.map(Released::from))
    }

    /// Applies a notification; returns what to release when it ended a lease. Unknown ids
    /// (already expired, or never ours) are ignored.
    pub fn on_notif(&mut self, notif: &Notif<'_>, now: Instant) -> Option<Released<F>> {
        match *notif {
            Notif::Heartbeat { request_id } => {
                if let Some(lease) = self.leases.get_mut(request_id) {
                    let mut wanted = now + self.extension;
                    // The fence cannot be extended, so neither can the lease past it.
                    if let Some((_, deadline)) = &lease.fence {
                        wanted = wanted.min(*deadline);
                    }
                    lease.expires = lease.expires.max(wanted);
                }
                None
            }
            Notif::Done { request_id, world_size } => {
                let lease = self.leases.get_mut(request_id)?;
                lease.done_notifs += 1;
                if lease.done_notifs < world_size {
                    return None;
                }
                self.leases.remove(request_id).map(Released::from)
            }
        }
    }

    /// Removes and returns every lease whose time is up.
    pub fn expire(&mut self, now: Instant) -> Vec<(String, Released<F>)> {
        let ids: Vec<String> = self.leases.iter().filter(|(_, l)| l.expires <= now).map(|(id, _)| id.clone()).collect();
        ids.into_iter().filter_map(|id| self.leases.remove(&id).map(|l| (id, Released::from(l)))).collect()
    }

    /// Ends a lease early (the engine is shutting down or the caller changed its mind).
    pub fn remove(&mut self, request_id: &str) -> Option<Released<F>> {
        self.leases.remove(request_id).map(Released::from)
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    pub fn held_blocks(&self) -> usize {
        self.leases.values().map(|l| l.blocks.len()).sum()
    }

    pub fn expiry_of(&self, request_id: &str) -> Option<Instant> {
        self.leases.get(request_id).map(|l| l.expires)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn parses_notifications() {
        assert_eq!(Notif::parse(b"cmpl-1-0-ab:1"), Some(Notif::Done { request_id: "cmpl-1-0-ab", world_size: 1 }));
        assert_eq!(Notif::parse(b"HB:cmpl-1"), Some(Notif::Heartbeat { request_id: "cmpl-1" }));
        for bad in [&b"nocolon"[..], b":1", b"x:0", b"x:y", b"HB:", b"\xff:1"] {
            assert_eq!(Notif::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn done_releases_heartbeat_extends_expiry_expires() {
        let t0 = Instant::now();
        let mut t = LeaseTable::<()>::new(30 * S, 20 * S);
        t.insert("a".into(), vec![1, 2], None, t0);
        t.insert("b".into(), vec![3], None, t0);
        assert_eq!(t.held_blocks(), 3);
        // A heartbeat at 25 s pushes b's expiry to 45 s; an early one does not shorten it.
        t.on_notif(&Notif::Heartbeat { request_id: "b" }, t0 + 25 * S);
        t.on_notif(&Notif::Heartbeat { request_id: "b" }, t0 + S);
        assert_eq!(t.expiry_of("b"), Some(t0 + 45 * S));
        assert_eq!(t.on_notif(&Notif::Done { request_id: "zzz", world_size: 1 }, t0), None);
        let released = |blocks: Vec<BlockId>| Released { blocks, fence: None };
        assert_eq!(t.expire(t0 + 31 * S), vec![("a".to_string(), released(vec![1, 2]))]);
        assert_eq!(t.on_notif(&Notif::Done { request_id: "b", world_size: 2 }, t0), None, "1 of 2 ranks");
        assert_eq!(t.on_notif(&Notif::Done { request_id: "b", world_size: 2 }, t0), Some(released(vec![3])));
        assert!(t.is_empty());
    }

    #[test]
    fn a_fence_comes_back_with_the_blocks_and_caps_the_lease() {
        let t0 = Instant::now();
        let mut t = LeaseTable::<&str>::new(30 * S, 20 * S);
        // The fence's deadline (10 s) is earlier than the lease's (30 s): it wins.
        let (expires, old) = t.insert("a".into(), vec![1], Some(("grant-a", t0 + 10 * S)), t0);
        assert_eq!((expires, old), (t0 + 10 * S, None));
        // Heartbeats cannot carry a fenced lease past its fence.
        t.on_notif(&Notif::Heartbeat { request_id: "a" }, t0 + 5 * S);
        assert_eq!(t.expiry_of("a"), Some(t0 + 10 * S));
        // The same id again gives back the first lease, fence and all.
        let (_, old) = t.insert("a".into(), vec![2], Some(("grant-a2", t0 + 40 * S)), t0);
        assert_eq!(old, Some(Released { blocks: vec![1], fence: Some("grant-a") }));
        assert_eq!(t.expiry_of("a"), Some(t0 + 30 * S));
        assert_eq!(t.remove("a"), Some(Released { blocks: vec![2], fence: Some("grant-a2") }));
        t.insert("b".into(), vec![3], Some(("grant-b", t0 + 10 * S)), t0);
        assert_eq!(
            t.expire(t0 + 10 * S),
            vec![("b".to_string(), Released { blocks: vec![3], fence: Some("grant-b") })]
        );
    }
}
