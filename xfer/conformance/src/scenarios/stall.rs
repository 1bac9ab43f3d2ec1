//! A frozen target (SIGSTOP): requests and notifications end by the backend's timeout, once
//! each, and the target is served again after SIGCONT.

use std::time::{Duration, Instant};

use xfer::{Op, RequestOptions, XferError};

use super::faults::{is_disconnect, signal, HANG};
use super::{spawn_peer, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{pattern_hash, write_pattern};

const BIG: u64 = 64 << 20;
const SMALL: u64 = 1 << 20;

/// The smallest form of a frozen target: SIGSTOP, then one 64 MiB WRITE (cut into many
/// chunks by the backend) must fail by the backend's timeout within the bound, not once per
/// chunk, and so must a standalone notification; after SIGCONT the peer is served again.
pub fn stalled_peer_times_out(backend: &str, params: &str) {
    stalled_peer(backend, params, WriteToFrozen::TimesOut);
}

/// The same over a transport that writes into the target's memory without the target's CPU
/// (UCX 1.22's shared memory through `process_vm_writev`, as an RDMA adapter would): the WRITE
/// may complete while the target is frozen, and then its bytes must be there after SIGCONT; the
/// notification, which needs the target, still fails by the timeout.
pub fn stalled_peer_bounded(backend: &str, params: &str) {
    stalled_peer(backend, params, WriteToFrozen::TimesOutOrLands);
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum WriteToFrozen {
    TimesOut,
    TimesOutOrLands,
}

fn stalled_peer(backend: &str, params: &str, expected: WriteToFrozen) {
    let init = Initiator::new("stall-init", backend, params, BIG);
    let mut peer = spawn_peer("stall-peer", backend, params, BIG);
    let name = init.connect(&peer);
    write_pattern(&init.buf, 0, 5, 0, BIG);
    init.transfer(Op::Write, &[init.desc(0, SMALL)], &name, &[peer.desc(0, SMALL)], RequestOptions::default(), WAIT)
        .expect("write before the stop");
    // Opens the notification path, so the stalled one below reuses a live connection.
    init.agent.send_notif(&name, b"before").expect("notification before the stop");
    signal(&peer, "STOP");
    let notif = {
        let (agent, name) = (init.agent.clone(), name.clone());
        std::thread::spawn(move || {
            let started = Instant::now();
            let result = agent.send_notif(&name, b"stalled");
            (started.elapsed(), result)
        })
    };
    let started = Instant::now();
    let result =
        init.transfer(Op::Write, &[init.desc(0, BIG)], &name, &[peer.desc(0, BIG)], RequestOptions::default(), HANG);
    let took = started.elapsed();
    let (notif_took, notif_result) = notif.join().expect("notification thread");
    eprintln!("stalled peer: the write ended after {took:?}: {result:?}");
    eprintln!("stalled peer: the notification ended after {notif_took:?}: {notif_result:?}");
    signal(&peer, "CONT");
    assert!(took < FAILURE_BOUND, "write to a stopped peer took {took:?} to end");
    match result {
        Ok(()) if expected == WriteToFrozen::TimesOutOrLands => {
            assert_eq!(peer.hash(0, BIG).expect("hash"), pattern_hash(5, 0, BIG), "write into a stopped peer");
        }
        Ok(()) => panic!("a write to a stopped peer succeeded"),
        Err(err) => assert!(
            matches!(err, XferError::TimedOut(after) if after < HANG),
            "write to a stopped peer: {err:?} after {took:?}"
        ),
    }
    let err = notif_result.err().unwrap_or_else(|| panic!("a notification to a stopped peer succeeded"));
    assert!(is_disconnect(&err), "notification to a stopped peer: {err:?}");
    assert!(notif_took < FAILURE_BOUND, "notification to a stopped peer took {notif_took:?} to fail");
    write_pattern(&init.buf, 0, 9, 0, SMALL);
    init.transfer(Op::Write, &[init.desc(0, SMALL)], &name, &[peer.desc(0, SMALL)], RequestOptions::default(), WAIT)
        .unwrap_or_else(|e| panic!("write after SIGCONT: {e}"));
    assert_eq!(peer.hash(0, SMALL).expect("hash"), pattern_hash(9, 0, SMALL), "write after SIGCONT");
}

/// Longer than the backend's no-progress timeout (TCP: 5 s by default), short of two.
const STALL: Duration = Duration::from_millis(6500);

/// A notification sent while the target is frozen a little longer than the backend's
/// timeout must not arrive twice: a send that timed out may still be delivered once the
/// target runs again, so resending it is not safe.
pub fn notif_once_across_stall(backend: &str, params: &str) {
    let init = Initiator::new("once-init", backend, params, SMALL);
    let mut peer = spawn_peer("once-peer", backend, params, SMALL);
    let name = init.connect(&peer);
    init.agent.send_notif(&name, b"warm-up").expect("notification before the stop");
    assert_eq!(peer.collect_notifs(1, WAIT).expect("notifs"), vec!["warm-up".to_string()]);
    signal(&peer, "STOP");
    let sender = {
        let (agent, name) = (init.agent.clone(), name.clone());
        std::thread::spawn(move || agent.send_notif(&name, b"once"))
    };
    std::thread::sleep(STALL);
    signal(&peer, "CONT");
    let sent = sender.join().expect("sender thread");
    // Whatever is still in flight lands within a moment of the target running again.
    std::thread::sleep(Duration::from_millis(500));
    init.agent.send_notif(&name, b"marker").expect("notification after SIGCONT");
    let got = peer.collect_notifs(usize::MAX, Duration::from_secs(2)).expect("notifs");
    eprintln!("stall across a notification: send_notif returned {sent:?}; the peer received {got:?}");
    let copies = got.iter().filter(|m| *m == "once").count();
    assert!(copies <= 1, "one send_notif delivered {copies} copies ({sent:?}); the peer received {got:?}");
    if sent.is_ok() {
        assert_eq!(copies, 1, "send_notif succeeded but nothing arrived: {got:?}");
    }
    assert_eq!(got.last().map(String::as_str), Some("marker"), "order after the stall: {got:?}");
}
