//! Forgetting a peer and loading it again, several times over one pair of processes: each
//! cycle moves checked bytes both ways with a notification after them, then invalidates the
//! peer (its connections close: a backend drops its address, e.g. from a libfabric AV), after
//! which a request to it fails as an unknown peer, never reaches a stale connection.

use xfer::{Op, RequestOptions, XferError};

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::check_pattern;

const SIZE: u64 = 1 << 20;
const CYCLES: u64 = 3;

pub fn reconnect_cycles(backend: &str, params: &str) {
    let init = Initiator::new("reconnect-init", backend, params, SIZE);
    let mut peer = spawn_peer("reconnect-peer", backend, params, SIZE);
    for cycle in 0..CYCLES {
        let name = init.connect(&peer);
        let seed = 40 + cycle;
        init.write_checked(&mut peer, &name, &cycle.to_string(), seed, SIZE, &format!("cycle {cycle}"));
        let (local, remote) = ([init.desc(0, SIZE)], [peer.desc(0, SIZE)]);
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
