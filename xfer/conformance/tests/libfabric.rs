//! The conformance suite against the libfabric backend over `tcp;ofi_rxm` on loopback, two
//! processes, every byte checked; and the agent's choice between libfabric and TCP.
//!
//! Not run: `bad_frames` (TCP's wire format) and `dereg_target_races_transfers`: over
//! `tcp;ofi_rxm` the target's provider does refuse a stale key, but by dropping the
//! connection, so the initiator sees its operations cancelled (`PeerDisconnected`), not a
//! refusal of deregistered memory; the scenario demands the latter.
//!
//! Not run over `shm`, although `fi_info -p shm -c FI_RMA` lists it here (libfabric 1.17):
//! tried with the same scenarios, `transfer_matrix` hung (operations that never completed) and
//! `api_errors`/`bad_remote_key` then waited for good in a deregistration (their memory stayed
//! pinned by operations the provider never reported). Not investigated further yet.

#![cfg(feature = "libfabric")]

const TCP: &str = "provider=tcp;ofi_rxm,domain=lo";

mod over_tcp {
    xfer_conformance::conformance_tests!(
        "libfabric",
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
            sigkill_mid_transfer,
            sigstop_mid_transfer,
            stalled_peer_times_out,
        ]
    );
}

/// An agent with libfabric and TCP attached uses libfabric with a peer that has both, and
/// falls back to TCP with a peer that has only TCP; every byte checked, notifications included.
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
    let (both, buf, _reg) = agent("lf-choice-both", &[("libfabric", TCP), tcp]);
    let (lf_peer, lf_buf, _r1) = agent("lf-choice-lf-peer", &[("libfabric", TCP), tcp]);
    let (tcp_peer, tcp_buf, _r2) = agent("lf-choice-tcp-peer", &[tcp]);
    for (peer, peer_buf, want, seed) in [(&lf_peer, &lf_buf, "libfabric", 1u8), (&tcp_peer, &tcp_buf, "tcp", 2u8)] {
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
        assert_eq!(peer.get_notifs_from("lf-choice-both"), vec![vec![seed]]);
    }
}
