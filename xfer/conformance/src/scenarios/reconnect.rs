//! Forgetting a peer and loading it again, several times over one pair of processes: each
//! cycle moves checked bytes both ways with a notification after them, then invalidates the
//! peer (its connections close: a backend drops its address, e.g. from a libfabric AV), after
//! which a request to it fails as an unknown peer, never reaches a stale connection.

use std::time::Duration;

use xfer::{Op, RequestOptions, XferError};

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::{check_message, check_pattern, pattern_hash, write_pattern};

const SIZE: u64 = 1 << 20;
const CYCLES: u64 = 3;

pub fn reconnect_cycles(backend: &str, params: &str) {
    let init = Initiator::new("reconnect-init", backend, params, SIZE);
    let mut peer = spawn_peer("reconnect-peer", backend, params, SIZE);
    for cycle in 0..CYCLES {
        let name = init.connect(&peer);
        let seed = 40 + cycle;
        write_pattern(&init.buf, 0, seed, 0, SIZE);
        let message = check_message(&cycle.to_string(), 0, SIZE, pattern_hash(seed, 0, SIZE));
        let (local, remote) = ([init.desc(0, SIZE)], [peer.desc(0, SIZE)]);
        init.transfer(Op::Write, &local, &name, &remote, RequestOptions::notify(message), WAIT)
            .unwrap_or_else(|e| panic!("cycle {cycle}: write: {e}"));
        let notifs = peer.collect_notifs(1, Duration::from_secs(10)).expect("notifs");
        assert_eq!(notifs, [format!("{cycle}=ok")], "cycle {cycle}: the notification and its data");
        peer.fill(seed + 100, 0, SIZE).expect("fill");
        init.transfer(Op::Read, &local, &name, &remote, RequestOptions::default(), WAIT)
            .unwrap_or_else(|e| panic!("cycle {cycle}: read: {e}"));
        assert_eq!(check_pattern(&init.buf, 0, seed + 100, 0, SIZE), Ok(()), "cycle {cycle}: read bytes");

        init.agent.invalidate_remote(&name).expect("invalidate");
        let after = init.transfer(Op::Read, &local, &name, &remote, RequestOptions::default(), WAIT);
        assert!(matches!(after, Err(XferError::UnknownPeer(_))), "cycle {cycle}: after invalidating: {after:?}");
    }
    assert!(peer.is_alive(), "the peer died across the reconnections");
}
