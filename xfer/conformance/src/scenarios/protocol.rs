//! The helper itself: `xfer-peer` answers every line, bad ones with `ERR`, and never dies of
//! them; a peer that cannot start says why instead of leaving the harness waiting.

use xfer::Op;

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::{escape, pattern_hash};
use crate::peer::{peer_exe, Peer, PeerConfig, PeerError};

pub fn peer_protocol(backend: &str, params: &str) {
    let mut peer = spawn_peer("protocol-peer", backend, params, 4096);
    for bad in [
        "",
        "bogus",
        "fill",
        "fill 1 2",
        "fill x 0 1",
        "fill 1 4000 97",
        "fill 1 18446744073709551615 2",
        "hash -1 2",
        "hash 0 4097",
        "hash 99999999999999999999 1",
        "notifs now",
        "dereg please",
    ] {
        match peer.command(bad) {
            Err(PeerError::Refused { .. }) => {}
            other => panic!("{bad:?} answered {other:?}, not ERR"),
        }
    }
    assert!(peer.is_alive(), "bad commands ended the peer");
    peer.fill(7, 100, 1000).expect("fill");
    assert_eq!(peer.hash(100, 1000).expect("hash"), pattern_hash(7, 0, 1000));
    assert_eq!(peer.hash(4096, 0).expect("empty range"), pattern_hash(0, 0, 0));

    let init = Initiator::new("protocol-init", backend, params, 4096);
    let name = init.connect(&peer);
    init.agent.send_notif(&name, b"check:not-a-check").expect("notif");
    init.agent.send_notif(&name, b"check:x:0:10:0000000000000000").expect("notif");
    init.agent.send_notif(&name, b"check:y:4090:10:0000000000000000").expect("notif");
    let got = peer.collect_notifs(3, WAIT).expect("notifs");
    assert_eq!(got, vec![escape(b"check:not-a-check"), "x=bad".into(), "y=bad".into()]);
    init.transfer(Op::Read, &[init.desc(0, 8)], &name, &[peer.desc(0, 8)], Default::default(), WAIT).expect("read");

    peer.dereg().expect("dereg");
    assert!(matches!(peer.dereg(), Err(PeerError::Refused { .. })), "a second dereg must be refused");
    let status = peer.quit().expect("quit");
    assert!(status.success(), "quit exits with {status}");

    let broken = PeerConfig::new("protocol-broken", backend, &format!("{params},no_such_param=1"), 4096);
    match Peer::spawn(&peer_exe(), &broken) {
        Err(err) => assert!(err.to_string().contains("no_such_param"), "startup failure unexplained: {err}"),
        Ok(_) => panic!("a peer with an unknown backend parameter started"),
    }
}
