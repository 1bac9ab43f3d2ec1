//! The conformance suite against the libfabric backend over `tcp;ofi_rxm` on loopback, two
//! processes, every byte checked; and the agent's choice between libfabric and TCP.
//!
//! Not run: `bad_frames` (TCP's wire format). Over `tcp;ofi_rxm` the target's provider refuses
//! a stale key by dropping the connection, so the initiator sees its operations cancelled
//! (`PeerDisconnected`), not a refusal of deregistered memory: the target-side deregistration
//! race runs as `dereg_target_races_transfers_disconnecting`, which takes that as the refusal.
//!
//! Over `shm` (listed with RMA by `fi_info -p shm -c FI_RMA` here, libfabric 1.17) the
//! scenarios of `over_shm` run. shm's CQ waits by yielding (FI_WAIT_YIELD), whose
//! `fi_cq_sread` ignores its timeout; until the backend polled such CQs instead, the engine
//! thread never came back and `transfer_matrix` hung. Not run over shm, because shm 1.17
//! itself wedges (traced with gdb; the crate doc's limits give the detail):
//! `sigkill_mid_transfer` and `sigstop_mid_transfer` (a post waits on a spinlock the peer
//! held when it was killed or stopped: the engine thread spun in `pthread_spin_lock` for
//! good), and both target-side deregistration races (shm drops an RMA whose key fails
//! verification without answering it, and the endpoint's answers are read in posting order,
//! so every later completion waits behind it: requests end `TimedOut`, never refused, and
//! their memory stays pinned, so the initiator's deregistration waits until shutdown).
//! `shm_dead_peer_fails_without_wedging_the_endpoint` tests what the backend does about the
//! first: a peer found dead is refused before its region is touched. `bad_frames` is TCP's
//! wire format. Each shm endpoint is named by the backend (`xfer-PID-...`), since shm's
//! own pid-based names collided with regions killed peers left in /dev/shm once pids wrapped
//! (fi_enable: EBUSY, seen in CI); opening one removes those of processes that are gone.

#![cfg(feature = "libfabric")]

const TCP: &str = "provider=tcp;ofi_rxm,domain=lo";
const SHM: &str = "provider=shm";

mod over_tcp {
    xfer_conformance::conformance_tests!(
        "libfabric",
        super::TCP,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            requests_in_flight,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            dereg_target_races_transfers_disconnecting,
            sigkill_mid_transfer,
            sigstop_mid_transfer,
            stalled_peer_times_out,
            reconnect_cycles,
        ]
    );
}

/// `sockets` offers RDM endpoints with RMA here too (`fi_info -p sockets -c FI_RMA`); the
/// scenarios that differ most from `tcp;ofi_rxm` run on it (it refuses a deregistered key as
/// such, so the strict target-side deregistration race runs). Its progress threads spin, so
/// the rest of the suite is left to `tcp;ofi_rxm` to keep the run short.
mod over_sockets {
    xfer_conformance::conformance_tests!(
        "libfabric",
        "provider=sockets,domain=lo",
        [transfer_matrix, notifications, bad_remote_key, dereg_target_races_transfers, sigkill_mid_transfer]
    );
}

/// `shm` (one host, shared memory): the scenarios it passes; see the file's doc for the others.
mod over_shm {
    xfer_conformance::conformance_tests!(
        "libfabric",
        super::SHM,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            requests_in_flight,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            stalled_peer_times_out,
            reconnect_cycles,
        ]
    );
}

/// A killed shm peer, idle when it died: requests to it fail at once as `PeerDisconnected`
/// (its process is gone) instead of being queued in its region, where libfabric 1.17's shm
/// would never answer them and would hold back every later completion of the endpoint; the
/// other peer stays served and the deregistration returns (nothing is left pinned).
#[test]
fn shm_dead_peer_fails_without_wedging_the_endpoint() {
    use std::time::{Duration, Instant};
    use xfer::{Op, XferError};
    use xfer_conformance::scenarios::{drop_within, spawn_peer, Initiator, FAILURE_BOUND, WAIT};

    const SIZE: u64 = 1 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let mut dead = spawn_peer("shm-dead", "libfabric", SHM, SIZE);
    let mut live = spawn_peer("shm-live", "libfabric", SHM, SIZE);
    let mut init = Initiator::new("shm-init", "libfabric", SHM, SIZE);
    let (dead_name, live_name) = (init.connect(&dead), init.connect(&live));
    init.write_checked(&mut dead, &dead_name, "d", 1, SIZE, "before the kill");
    let stale = dead.desc(0, SIZE);
    dead.kill();
    for op in [Op::Write, Op::Read] {
        let started = Instant::now();
        let result = init.transfer(op, &[init.desc(0, SIZE)], &dead_name, &[stale], Default::default(), WAIT);
        assert!(matches!(result, Err(XferError::PeerDisconnected { .. })), "{op} to the killed peer: {result:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "{op} to the killed peer took {:?}", started.elapsed());
    }
    for round in 0..3 {
        init.write_checked(&mut live, &live_name, "l", 10 + round, SIZE, "the live peer after the kill");
    }
    let reg = init.reg.take().expect("registered");
    drop_within("deregistration after the kill", FAILURE_BOUND, reg);
    live.quit().expect("live peer exits");
}

/// An agent with libfabric and TCP attached picks libfabric for a peer that has both, TCP for a
/// TCP-only peer.
#[test]
fn picks_by_capability_and_falls_back_to_tcp() {
    xfer_conformance::scenarios::picks_by_capability_and_falls_back_to_tcp("libfabric", TCP);
}

/// Two `tcp;ofi_rxm` rails, one per veth link between two network namespaces: bytes checked
/// and both links' interface counters showing their share (skipped loudly without root).
#[test]
fn two_rails() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    xfer_conformance::scenarios::two_rails("libfabric", "provider=tcp;ofi_rxm,domains=eth0+eth1");
}

/// Rail failover on the two links: link eth1 goes down under a 16 MiB WRITE (with a
/// notification), a 16 MiB READ and a 512-descriptor WRITE running at once; all finish over
/// eth0 within `failover_ms` plus the redo bound, bytes checked, and once eth1 is back and the
/// rail's retry time has passed, transfers use it again (skipped loudly without root).
#[test]
fn rail_failover() {
    use std::time::Duration;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let (failover, retry) = (Duration::from_millis(1000), Duration::from_millis(1000));
    let params = format!(
        "provider=tcp;ofi_rxm,domains=eth0+eth1,failover_ms={},rail_retry_ms={}",
        failover.as_millis(),
        retry.as_millis()
    );
    xfer_conformance::scenarios::rail_failover("libfabric", &params, failover, retry);
}

/// Sides with different lane counts (`lanes`, endpoints per domain) meet on as many lanes as
/// the side with fewer has: a 16 MiB WRITE with a notification, a READ and a scattered WRITE,
/// each striped over the lanes both have, every byte checked, in both directions of the
/// mismatch.
#[test]
fn mismatched_lanes() {
    use xfer::Op;
    use xfer_conformance::pattern::check_pattern;
    use xfer_conformance::scenarios::{scattered_write, spawn_peer, Initiator, WAIT};

    const SIZE: u64 = 16 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    for (ours, theirs) in [(3, 2), (1, 4)] {
        let mut peer = spawn_peer("lanes-peer", "libfabric", &format!("{TCP},lanes={theirs}"), SIZE);
        let init = Initiator::new("lanes-init", "libfabric", &format!("{TCP},lanes={ours}"), SIZE);
        let name = init.connect(&peer);
        let seed = 20 + ours;

        init.write_checked(&mut peer, &name, "w", seed, SIZE, &format!("lanes {ours} against {theirs}"));

        peer.fill(seed + 1, 0, SIZE).expect("fill");
        init.transfer(Op::Read, &[init.desc(0, SIZE)], &name, &[peer.desc(0, SIZE)], Default::default(), WAIT)
            .unwrap_or_else(|e| panic!("read, lanes {ours} against {theirs}: {e}"));
        assert_eq!(check_pattern(&init.buf, 0, seed + 1, 0, SIZE), Ok(()), "read bytes");

        // Many small descriptors: the stripe cuts between and inside them.
        scattered_write(&init, &mut peer, &name, 0, 512, 12_345, 100);
        drop(init);
        peer.quit().expect("peer exits");
    }
}
