//! A peer's metadata with a damaged remote key for the backend under test: loading it fails
//! with a typed error, or a request through the key does and the peer's memory stays
//! untouched (or, where the damage hits a field the backend does not need, the request
//! succeeds and writes exactly its own range); the intact metadata works afterwards.

use xfer::metadata::AgentMetadata;
use xfer::side_channel::{self, SideOp};
use xfer::{Op, RequestOptions, XferError};

use super::{spawn_peer, within, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{pattern_hash, write_pattern};

const SIZE: u64 = 64 << 10;

pub fn bad_remote_key(backend: &str, params: &str) {
    let init = Initiator::new("badkey-init", backend, params, SIZE);
    let mut peer = spawn_peer("badkey-peer", backend, params, SIZE);
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], side_channel::IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("side channel get: {e}"));
    let metadata = AgentMetadata::decode(&blob).expect("the peer's metadata decodes");
    let index = metadata.backends.iter().position(|b| b.name == backend).expect("the peer publishes the backend");
    let key = metadata.regions[0].keys.iter().find(|(i, _)| usize::from(*i) == index).expect("key").1.clone();

    let mut variants: Vec<(String, Vec<u8>)> = vec![
        ("every byte replaced".into(), vec![0xa5; key.len()]),
        ("truncated by one byte".into(), key[..key.len() - 1].to_vec()),
        ("empty".into(), Vec::new()),
    ];
    for at in [0, key.len() / 2, key.len() - 1] {
        let mut flipped = key.clone();
        flipped[at] ^= 0x5a;
        variants.push((format!("byte {at} of {} flipped", key.len()), flipped));
    }
    peer.fill(0xbad, 0, SIZE).expect("fill");
    write_pattern(&init.buf, 0, 0x900d, 0, SIZE);
    for (what, bad_key) in variants {
        let mut damaged = metadata.clone();
        for (i, key) in &mut damaged.regions[0].keys {
            if usize::from(*i) == index {
                key.clone_from(&bad_key);
            }
        }
        match init.agent.load_remote_metadata(&damaged.encode()) {
            Err(err) => eprintln!("remote key {what}: refused at load: {err}"),
            Ok(name) => {
                let result = within(&format!("a request through a key {what}"), FAILURE_BOUND, || {
                    init.transfer(
                        Op::Write,
                        &[init.desc(0, SIZE)],
                        &name,
                        &[peer.desc(0, SIZE)],
                        RequestOptions::default(),
                        WAIT,
                    )
                });
                match result {
                    Err(XferError::TimedOut(_)) => panic!("remote key {what}: a write through it timed out"),
                    Err(err) => eprintln!("remote key {what}: refused at transfer: {err}"),
                    Ok(()) => {
                        eprintln!("remote key {what}: still names the registration; the write went through");
                        let got = peer.hash(0, SIZE).expect("hash");
                        assert_eq!(
                            got,
                            pattern_hash(0x900d, 0, SIZE),
                            "key {what}: a write succeeded with wrong bytes"
                        );
                        peer.fill(0xbad, 0, SIZE).expect("fill");
                    }
                }
            }
        }
        assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(0xbad, 0, SIZE), "key {what}: memory changed");
    }

    let name = init.agent.load_remote_metadata(&blob).expect("the intact metadata loads");
    init.transfer(Op::Write, &[init.desc(0, SIZE)], &name, &[peer.desc(0, SIZE)], RequestOptions::default(), WAIT)
        .unwrap_or_else(|e| panic!("write with the intact key: {e}"));
    assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(0x900d, 0, SIZE), "write with the intact key");
}
