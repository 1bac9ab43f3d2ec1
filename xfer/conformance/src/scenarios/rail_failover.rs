//! Rail failover, on the two-link hosts of [`two_rails`](super::two_rails): three requests
//! run at once over both rails (a 16 MiB WRITE with a notification, a 16 MiB READ and a WRITE
//! of 512 descriptors), each in its own quarter of the buffers, and link `eth1` goes down while
//! they run. Each must finish within `failover` (the backend's bound on a rail that moves
//! nothing) plus [`REDO_BOUND`], every byte checked, the notification after the data. Then the
//! link comes back, and once the rail's retry time has passed a new transfer must use it again
//! (both links carry their share). The quarters keep apart what a healed link may still
//! deliver of the requests that moved off it.

use std::time::{Duration, Instant};

use xfer::{Op, RequestOptions};

use super::rails::{both_links_carried, check_scattered, counters, per_link, scattered_descs, with_two_links, SIZE};
use super::WAIT;
use crate::pattern::{check_message, check_pattern, pattern_hash, write_pattern};

/// Time to move a failed rail's shares to the other rail and run them there, on a loaded
/// 2-CPU machine.
pub const REDO_BOUND: Duration = Duration::from_secs(5);
/// The link goes down once it has moved this many bytes of the requests (or after
/// [`CUT_WITHIN`]); slowed to [`SLOW_MBIT`], it carries its 24 MiB share for over a second.
const CUT_AFTER_BYTES: u64 = 1 << 20;
const CUT_WITHIN: Duration = Duration::from_secs(2);
const SLOW_MBIT: u32 = 150;
/// The failed link's TCP connection resumes only at its next retransmission after the link is
/// back; tries of the healed rail are spread over this long.
const BACK_WITHIN: Duration = Duration::from_secs(20);
const DESCS: u64 = 512;

/// Bytes link eth1 of `node` moved both ways since `before`.
fn link1_moved(net: &pdchaos::netns::Net, node: &str, before: &[(u64, u64)]) -> u64 {
    per_link(net, node, before, true)[1] + per_link(net, node, before, false)[1]
}

/// WRITEs `len = SIZE` bytes of pattern `seed` at `off` on both sides and checks them.
fn write_checked_at(init: &super::Initiator, peer: &mut crate::peer::Peer, name: &str, off: u64, seed: u64) {
    write_pattern(&init.buf, off, seed, 0, SIZE);
    init.transfer(Op::Write, &[init.desc(off, SIZE)], name, &[peer.desc(off, SIZE)], Default::default(), WAIT)
        .unwrap_or_else(|e| panic!("WRITE of pattern {seed}: {e}"));
    assert_eq!(peer.hash(off, SIZE).expect("hash"), pattern_hash(seed, 0, SIZE), "WRITE bytes of pattern {seed}");
}

pub fn rail_failover(backend: &str, params: &str, failover: Duration, retry: Duration) {
    with_two_links("failover", backend, params, 4 * SIZE, |net, init_node, init, peer, name| {
        let (w_at, r_at, s_at, back_at) = (0, SIZE, 2 * SIZE, 3 * SIZE);
        write_pattern(&init.buf, w_at, 31, 0, SIZE);
        let w_hash = pattern_hash(31, 0, SIZE);
        peer.fill(32, r_at, SIZE).expect("fill");
        let desc_len = SIZE / DESCS / 2;
        let (s_locals, s_remotes) = scattered_descs(init, peer, s_at, DESCS, desc_len, 300);
        let (w_remote, r_remote) = (peer.desc(w_at, SIZE), peer.desc(r_at, SIZE));

        // Both rails' connections up first, and eth1 slowed, so the link goes down under
        // moving data.
        write_checked_at(init, peer, name, back_at, 30);
        net.limit_link(init_node, 1, Some(SLOW_MBIT)).expect("slow link eth1 down (tc tbf)");

        let before = counters(net, init_node);
        let bound = failover + REDO_BOUND;
        let timed = |op, local: &[xfer::Desc], remote: &[xfer::Desc], options| {
            let started = Instant::now();
            init.transfer(op, local, name, remote, options, WAIT).map(|()| started.elapsed())
        };
        let (write, read, scattered, cut) = std::thread::scope(|scope| {
            let notify = RequestOptions::notify(check_message("fw", w_at, SIZE, w_hash));
            let write = scope.spawn(|| timed(Op::Write, &[init.desc(w_at, SIZE)], &[w_remote], notify));
            let read = scope.spawn(|| timed(Op::Read, &[init.desc(r_at, SIZE)], &[r_remote], Default::default()));
            let scattered = scope.spawn(|| timed(Op::Write, &s_locals, &s_remotes, Default::default()));
            let posted = Instant::now();
            while link1_moved(net, init_node, &before) < CUT_AFTER_BYTES && posted.elapsed() < CUT_WITHIN {}
            net.cut_link(init_node, 1).expect("take link eth1 down");
            net.limit_link(init_node, 1, None).expect("lift eth1's rate limit");
            let cut = (posted.elapsed(), link1_moved(net, init_node, &before));
            (write.join(), read.join(), scattered.join(), cut)
        });
        let (cut_at, moved_before_cut) = cut;
        eprintln!("eth1 cut {cut_at:?} after posting, {moved_before_cut} bytes in and out of it by then");
        let outage = (per_link(net, init_node, &before, true), per_link(net, init_node, &before, false));
        let join = |what: &str, joined: std::thread::Result<Result<Duration, xfer::XferError>>| {
            let took = joined
                .unwrap_or_else(|_| panic!("{what}: the request's thread panicked"))
                .unwrap_or_else(|e| panic!("{what} with link eth1 down: {e}"));
            eprintln!("{what}: done in {took:?} (bound {bound:?})");
            assert!(took <= bound, "{what} took {took:?}, over the failover bound {bound:?}");
        };
        join("16 MiB WRITE", write);
        join("16 MiB READ", read);
        join("512-descriptor WRITE", scattered);
        eprintln!("bytes per link (sent, received) while eth1 went down: {outage:?}");

        assert_eq!(peer.hash(w_at, SIZE).expect("hash"), w_hash, "WRITE bytes after failover");
        let notifs = peer.collect_notifs(1, Duration::from_secs(10)).expect("notifs");
        assert_eq!(notifs, ["fw=ok"], "the notification did not follow the data of the moved share");
        assert_eq!(check_pattern(&init.buf, r_at, 32, 0, SIZE), Ok(()), "READ bytes after failover");
        check_scattered(peer, s_at, DESCS, desc_len, 300);

        // Back up: once its retry time has passed, a transfer probes the rail and uses it.
        net.heal_link(init_node, 1).expect("bring link eth1 back");
        let healed = Instant::now();
        std::thread::sleep(retry);
        let mut tries = 0;
        loop {
            tries += 1;
            let before = counters(net, init_node);
            write_checked_at(init, peer, name, back_at, 40 + tries);
            let moved = per_link(net, init_node, &before, true);
            eprintln!("after healing, try {tries} at {:?}: bytes per link {moved:?}", healed.elapsed());
            // eth0 carrying only about its half shows the share on eth1 was not moved to it.
            if both_links_carried(&moved, SIZE) && moved[0] < SIZE * 3 / 4 {
                break;
            }
            assert!(healed.elapsed() < BACK_WITHIN, "eth1 was not used again within {BACK_WITHIN:?} of coming back");
            std::thread::sleep(retry);
        }
    });
}
