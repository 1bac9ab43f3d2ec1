//! The conformance suite against the UCX backend, twice: over UCX's TCP transport on loopback,
//! and over its shared-memory transports. The UCX settings travel as backend parameters, so the
//! peer process gets the same ones through `--params` (environment variables would be
//! process-wide, and the tests run in threads).
//!
//! Not run here: `bad_frames` (TCP's wire format) and `dereg_target_races_transfers`: over TCP
//! and shared memory UCX's one-sided operations never reach the target's code, so it cannot
//! refuse a stale key (InfiniBand/RoCE adapters do); see the crate docs of `xfer-ucx`.
//! Over shared memory, the killed/frozen-peer scenarios are left out too: UCX 1.13's posix
//! transport cannot detect a failed peer, so such requests end by `timeout_ms` (about 7 s
//! after a SIGKILL, within the bound), but UCX never completes the operations it had queued
//! to the dead peer, and their memory stays pinned until the backend shuts down (a
//! deregistration waits for it).

#![cfg(feature = "ucx")]

const TCP: &str = "tls=tcp,net_devices=lo";
const SHM: &str = "tls=posix+cma+self";

mod over_tcp {
    xfer_conformance::conformance_tests!(
        "ucx",
        super::TCP,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            // Killed or frozen peers: only over transports that detect failed peers.
            sigkill_mid_transfer,
            sigstop_mid_transfer,
            stalled_peer_times_out,
        ]
    );
}

mod over_shm {
    xfer_conformance::conformance_tests!(
        "ucx",
        super::SHM,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
        ]
    );
}

/// An agent with UCX and TCP attached uses UCX with a peer that has both, and falls back to
/// TCP with a peer that has only TCP; every byte checked, notifications included.
#[test]
fn picks_by_capability_and_falls_back_to_tcp() {
    use std::sync::Arc;
    use std::time::Duration;
    use xfer::{Agent, BackendParams, HostBuffer, Op, RequestOptions};

    const SIZE: usize = 1 << 20;
    let agent = |name: &str, backends: &[(&str, &str)]| {
        let agent = Agent::new(name).expect("agent");
        for (backend, params) in backends {
            agent.add_backend(backend, BackendParams::parse(params).expect("params")).expect("attach");
        }
        let buf = Arc::new(HostBuffer::new(SIZE));
        let reg = agent.register_buffer(&buf).expect("register");
        (agent, buf, reg)
    };
    let tcp = ("tcp", "listen=127.0.0.1:0");
    let (both, buf, _reg) = agent("choice-both", &[("ucx", TCP), tcp]);
    let (ucx_peer, ucx_buf, _r1) = agent("choice-ucx-peer", &[("ucx", TCP), tcp]);
    let (tcp_peer, tcp_buf, _r2) = agent("choice-tcp-peer", &[tcp]);
    for (peer, peer_buf, want, seed) in [(&ucx_peer, &ucx_buf, "ucx", 1u8), (&tcp_peer, &tcp_buf, "tcp", 2u8)] {
        let name = both.load_remote_metadata(&peer.local_metadata()).expect("load peer");
        peer.load_remote_metadata(&both.local_metadata()).expect("peer loads us");
        let data: Vec<u8> = (0..SIZE).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        buf.write_at(0, &data);
        let req = both
            .create_request(Op::Write, &[buf.desc()], &name, &[peer_buf.desc()], RequestOptions::notify([seed]))
            .expect("create");
        assert_eq!(req.backend(), want, "backend chosen for {name}");
        req.post().expect("post");
        req.wait(Duration::from_secs(20)).unwrap_or_else(|e| panic!("write to {name}: {e}"));
        assert!(peer_buf.to_vec() == data, "bytes written to {name} through {want} differ");
        assert!(peer.wait_notifs(Duration::from_secs(10)), "no notification at {name}");
        assert_eq!(peer.get_notifs_from("choice-both"), vec![vec![seed]]);
    }
}
