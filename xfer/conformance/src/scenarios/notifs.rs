//! Notifications: each arrives after its data (the peer hashes the range the moment the
//! notification is delivered), none is lost, and the ones sent one after another keep their
//! order.

use std::collections::BTreeSet;
use std::time::Duration;

use rand::Rng;
use xfer::{Op, RequestOptions};

use super::{rng, spawn_peer, Initiator, WAIT};
use crate::pattern::{check_message, escape, pattern_hash, write_pattern};

const CONCURRENT: usize = 200;
/// Each concurrent write owns a slot this large on both sides, so none overwrites another.
const SLOT: u64 = 40_000;
const SEQUENTIAL: usize = 60;
const ARRIVAL: Duration = Duration::from_secs(15);

pub fn notifications(backend: &str, params: &str) {
    let size = SLOT * CONCURRENT as u64;
    let init = Initiator::new("notifs-init", backend, params, size);
    let mut peer = spawn_peer("notifs-peer", backend, params, size);
    let name = init.connect(&peer);
    let mut rng = rng("notifications");

    // Phase 1: all posted back to back, so many are in flight at once.
    let mut requests = Vec::with_capacity(CONCURRENT);
    for i in 0..CONCURRENT {
        let (off, len) = (i as u64 * SLOT, rng.random_range(1..SLOT));
        let seed: u64 = rng.random();
        write_pattern(&init.buf, off, seed, 0, len);
        let message = check_message(&i.to_string(), off, len, pattern_hash(seed, 0, len));
        let req = init
            .agent
            .create_request(
                Op::Write,
                &[init.desc(off, len)],
                &name,
                &[peer.desc(off, len)],
                RequestOptions::notify(message),
            )
            .expect("create");
        req.post().expect("post");
        requests.push(req);
    }
    for (i, req) in requests.iter().enumerate() {
        req.wait(WAIT).unwrap_or_else(|e| panic!("concurrent write {i}: {e}"));
    }
    let got = peer.collect_notifs(CONCURRENT, ARRIVAL).expect("peer notifs");
    let want: BTreeSet<String> = (0..CONCURRENT).map(|i| format!("{i}=ok")).collect();
    let bad: Vec<&String> = got.iter().filter(|entry| !want.contains(*entry)).collect();
    assert!(bad.is_empty(), "notifications that arrived before their data (or unexpected): {bad:?}");
    let unique: BTreeSet<String> = got.iter().cloned().collect();
    assert_eq!(got.len(), unique.len(), "duplicate notifications: {got:?}");
    let missing: Vec<&String> = want.difference(&unique).collect();
    assert!(missing.is_empty(), "notifications never delivered: {missing:?}");

    // Phase 2: one at a time, mixing checked writes, standalone messages (bytes the peer's line
    // protocol has to escape, one of 64 KiB) and a READ's notification; order must hold.
    let mut expected = Vec::new();
    for step in 0..SEQUENTIAL {
        // Own slots again: the peer verifies asynchronously, so a later write must not touch a
        // range whose check may still be pending.
        let (off, len) = (step as u64 * SLOT, rng.random_range(1..SLOT));
        match step % 4 {
            0 | 1 => {
                let seed: u64 = rng.random();
                write_pattern(&init.buf, off, seed, 0, len);
                let seq = format!("s{step}");
                let message = check_message(&seq, off, len, pattern_hash(seed, 0, len));
                init.transfer(
                    Op::Write,
                    &[init.desc(off, len)],
                    &name,
                    &[peer.desc(off, len)],
                    RequestOptions::notify(message),
                    WAIT,
                )
                .unwrap_or_else(|e| panic!("sequential write {step}: {e}"));
                expected.push(format!("{seq}=ok"));
            }
            2 => {
                let mut message = format!("plain {step},%\n\0").into_bytes();
                if step == 2 {
                    message.extend((0..64 * 1024).map(|i| (i % 251) as u8));
                }
                init.agent.send_notif(&name, &message).unwrap_or_else(|e| panic!("send_notif {step}: {e}"));
                expected.push(escape(&message));
            }
            _ => {
                let message = format!("read-{step}");
                init.transfer(
                    Op::Read,
                    &[init.desc(off, len)],
                    &name,
                    &[peer.desc(off, len)],
                    RequestOptions::notify(&message),
                    WAIT,
                )
                .unwrap_or_else(|e| panic!("sequential read {step}: {e}"));
                expected.push(message);
            }
        }
    }
    let got = peer.collect_notifs(expected.len(), ARRIVAL).expect("peer notifs");
    if let Some(i) = (0..got.len().max(expected.len())).find(|&i| got.get(i) != expected.get(i)) {
        panic!(
            "sequential notification {i} differs (order or content)\n got:  {:?}\n want: {:?}",
            short(&got),
            short(&expected)
        );
    }
}

/// A list for a panic message, long entries cut.
fn short(list: &[String]) -> Vec<String> {
    list.iter().map(|s| if s.len() > 80 { format!("{}...", &s[..80]) } else { s.clone() }).collect()
}
