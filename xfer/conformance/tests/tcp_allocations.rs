//! Heap allocations per small TCP request, end to end on the initiator's side: the agent, the
//! backend's pool and its connection, counted by a global allocator in this process while the
//! target is an `xfer-peer` process over loopback. Allocations cost more than the syscalls of a
//! 4 KiB request on a busy machine, so their number is held to a bound. Every byte is checked.

use std::time::{Duration, Instant};

use xfer::{Op, RequestOptions};
use xfer_conformance::pattern::{check_pattern, pattern_hash, write_pattern};
use xfer_conformance::scenarios::{spawn_peer, Initiator, WAIT};

// The coordinator's benchmark allocator (one definition); this test uses its counter only.
#[allow(dead_code)]
#[path = "../../../coordinator/examples/shared/measure.rs"]
mod measure;

const SIZE: u64 = 4096;
const WARM_UP: usize = 50;
const REQUESTS: usize = 400;
/// Most allocations one 4 KiB READ or WRITE may make on the initiator, posted again and waited
/// for (how a transfer engine reuses its requests; the backend's whole path).
const MAX_REPOSTED: f64 = 12.0;
/// The same, for a request created each time (the agent's descriptor lists included).
const MAX_FRESH: f64 = 16.0;

#[test]
fn small_requests_allocate_little() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let started = Instant::now();
    let init = Initiator::new("alloc-init", "tcp", "listen=127.0.0.1:0", SIZE);
    let mut peer = spawn_peer("alloc-peer", "tcp", "listen=127.0.0.1:0", SIZE);
    let name = init.connect(&peer);
    let local = [init.desc(0, SIZE)];
    let remote = [peer.desc(0, SIZE)];
    // Allocations per request: `count` requests created each time, then one request posted
    // `count` times.
    let per_request = |op: Op| {
        let fresh = || init.transfer(op, &local, &name, &remote, RequestOptions::default(), WAIT);
        let request =
            init.agent.create_request(op, &local, &name, &remote, RequestOptions::default()).expect("request");
        let repost = || request.post().and_then(|()| request.wait(WAIT));
        let mut counts = [0.0; 2];
        for (count, run) in counts.iter_mut().zip([&fresh as &dyn Fn() -> _, &repost]) {
            for _ in 0..WARM_UP {
                run().unwrap_or_else(|e| panic!("{op} of {SIZE} bytes: {e}"));
            }
            let before = measure::allocations();
            for _ in 0..REQUESTS {
                run().unwrap_or_else(|e| panic!("{op} of {SIZE} bytes: {e}"));
            }
            *count = (measure::allocations() - before) as f64 / REQUESTS as f64;
        }
        counts
    };

    // WRITE: the peer must hold the pattern afterwards.
    write_pattern(&init.buf, 0, 1, 0, SIZE);
    let writes = per_request(Op::Write);
    assert_eq!(peer.hash(0, SIZE).expect("peer hash"), pattern_hash(1, 0, SIZE), "written bytes");
    // READ: the initiator must hold the peer's pattern afterwards.
    peer.fill(2, 0, SIZE).expect("peer fill");
    let reads = per_request(Op::Read);
    check_pattern(&init.buf, 0, 2, 0, SIZE).unwrap_or_else(|at| panic!("read byte {at} differs"));

    eprintln!(
        "allocations per {SIZE}-byte request (created each time / posted again): WRITE {:.1} / {:.1}, READ {:.1} / {:.1} ({:?})",
        writes[0],
        writes[1],
        reads[0],
        reads[1],
        started.elapsed()
    );
    for (op, [fresh, reposted]) in [("WRITE", writes), ("READ", reads)] {
        assert!(fresh <= MAX_FRESH, "a fresh {op} makes {fresh:.1} allocations, more than {MAX_FRESH}");
        assert!(reposted <= MAX_REPOSTED, "a reposted {op} makes {reposted:.1} allocations, more than {MAX_REPOSTED}");
    }
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
}
