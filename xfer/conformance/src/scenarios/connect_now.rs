//! `Agent::make_connection`: opening ahead of the first transfer what it would open. For
//! backends that connect ahead (TCP, QUIC: their connection; UCX: its endpoint's wire-up): it
//! succeeds against a live peer and the write after it is delivered, it names what it cannot
//! find, and a peer that was never reached and is gone fails it within the failure bound.

use std::time::Instant;

use xfer::XferError;

use super::errors::write_and_check;
use super::{spawn_peer, Initiator, FAILURE_BOUND};

const SIZE: u64 = 1 << 20;

pub fn make_connection_ahead(backend: &str, params: &str) {
    let init = Initiator::new("ahead-init", backend, params, SIZE);
    let mut peer = spawn_peer("ahead-peer", backend, params, SIZE);
    let unknown = init.agent.make_connection("nobody", None);
    assert!(matches!(unknown, Err(XferError::UnknownPeer(ref n)) if n == "nobody"), "{unknown:?}");
    let name = init.connect(&peer);
    let other = init.agent.make_connection(&name, Some("no-such-backend"));
    assert!(matches!(other, Err(XferError::NoBackend(_))), "{other:?}");
    init.agent.make_connection(&name, None).unwrap_or_else(|e| panic!("make_connection to a live peer: {e}"));
    init.agent.make_connection(&name, Some(backend)).unwrap_or_else(|e| panic!("again, naming {backend}: {e}"));
    write_and_check(&init, &mut peer, &name);

    // Metadata loaded, then the peer killed before anything connected to it.
    let mut gone = spawn_peer("ahead-gone", backend, params, SIZE);
    let gone_name = init.connect(&gone);
    gone.kill();
    let started = Instant::now();
    let result = init.agent.make_connection(&gone_name, None);
    assert!(
        matches!(result, Err(XferError::PeerDisconnected { .. } | XferError::TimedOut(_))),
        "make_connection to a dead peer: {result:?}"
    );
    assert!(started.elapsed() < FAILURE_BOUND, "a dead peer took {:?} to fail make_connection", started.elapsed());
    // The live peer is still served.
    write_and_check(&init, &mut peer, &name);
}
