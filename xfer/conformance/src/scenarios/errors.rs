//! Typed errors through the public API: unknown peers, descriptors outside registrations and
//! corrupt metadata blobs, none of which may disturb what already works.

use xfer::metadata::{AgentMetadata, MetadataError, VERSION};
use xfer::side_channel::{self, SideOp};
use xfer::{Desc, Op, RequestOptions, Side, XferError};

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::{pattern_hash, write_pattern};
use crate::peer::Peer;

const SIZE: u64 = 1 << 20;

pub fn api_errors(backend: &str, params: &str) {
    let init = Initiator::new("errors-init", backend, params, SIZE);
    let mut peer = spawn_peer("errors-peer", backend, params, SIZE);
    let write = |peer: &str, remote: &[Desc]| {
        init.agent.create_request(Op::Write, &[init.desc(0, 64)], peer, remote, RequestOptions::default())
    };

    let unknown = write("nobody", &[peer.desc(0, 64)]);
    assert!(matches!(unknown, Err(XferError::UnknownPeer(ref n)) if n == "nobody"), "{unknown:?}");
    let notif = init.agent.send_notif("nobody", b"x");
    assert!(matches!(notif, Err(XferError::UnknownPeer(_))), "{notif:?}");
    assert!(matches!(init.agent.remote_regions("nobody"), Err(XferError::UnknownPeer(_))));

    let name = init.connect(&peer);
    for (what, remote, index) in [
        ("straddling the end", vec![peer.desc(SIZE - 10, 64)], 0),
        ("past the end", vec![Desc::new(peer.buf_addr() + SIZE + 4096, 64, 0)], 0),
        ("on another device", vec![Desc::new(peer.buf_addr(), 64, 1)], 0),
        ("third of three", vec![peer.desc(0, 16), peer.desc(100, 16), peer.desc(SIZE, 32)], 2),
    ] {
        let result = write(&name, &remote);
        assert!(
            matches!(result, Err(XferError::NotRegistered { side: Side::Remote, index: i, .. }) if i == index),
            "remote descriptor {what}: {result:?}"
        );
    }
    let local = init.agent.create_request(
        Op::Read,
        &[init.desc(SIZE - 8, 64)],
        &name,
        &[peer.desc(0, 64)],
        RequestOptions::default(),
    );
    assert!(matches!(local, Err(XferError::NotRegistered { side: Side::Local, .. })), "{local:?}");

    corrupt_metadata(&init, &peer);
    // Nothing above may have replaced or broken the loaded peer.
    assert_eq!(init.agent.peers(), vec![name.clone()]);
    write_and_check(&init, &mut peer, &name);
}

/// Every bit flip, every truncation and an unknown version are `Metadata` errors.
fn corrupt_metadata(init: &Initiator, peer: &Peer) {
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], side_channel::IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("side channel get: {e}"));
    assert!(AgentMetadata::decode(&blob).is_ok(), "the peer serves a blob it cannot decode itself");
    for i in 0..blob.len() {
        for bit in [0, 3, 7] {
            let mut bad = blob.clone();
            bad[i] ^= 1 << bit;
            let result = init.agent.load_remote_metadata(&bad);
            assert!(matches!(result, Err(XferError::Metadata(_))), "bit {bit} of byte {i} flipped: {result:?}");
        }
    }
    for len in 0..blob.len() {
        let result = init.agent.load_remote_metadata(&blob[..len]);
        assert!(matches!(result, Err(XferError::Metadata(_))), "truncated to {len} bytes: {result:?}");
    }
    let mut future = blob.clone();
    future[4..6].copy_from_slice(&(VERSION + 1).to_le_bytes());
    let result = init.agent.load_remote_metadata(&future);
    assert!(
        matches!(result, Err(XferError::Metadata(MetadataError::UnsupportedVersion { found })) if found == VERSION + 1),
        "unknown version: {result:?}"
    );
    let mut trailing = blob.clone();
    trailing.push(0);
    let result = init.agent.load_remote_metadata(&trailing);
    assert!(matches!(result, Err(XferError::Metadata(_))), "trailing byte: {result:?}");
}

pub(crate) fn write_and_check(init: &Initiator, peer: &mut Peer, name: &str) {
    let seed = 0x5eed;
    write_pattern(&init.buf, 0, seed, 0, 4099);
    init.transfer(Op::Write, &[init.desc(0, 4099)], name, &[peer.desc(7, 4099)], RequestOptions::default(), WAIT)
        .unwrap_or_else(|e| panic!("write after the error cases: {e}"));
    assert_eq!(peer.hash(7, 4099).expect("hash"), pattern_hash(seed, 0, 4099), "write after the error cases");
}
