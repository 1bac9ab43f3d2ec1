//! Backend choice: an agent with the backend under test and TCP picks the backend for a peer
//! that has both, and falls back to TCP for a peer that has only TCP.

use std::sync::Arc;

use xfer::{Agent, BackendParams, HostBuffer, Op, Registration, RequestOptions};

use super::WAIT;

const SIZE: usize = 1 << 20;

fn agent(name: &str, backends: &[(&str, &str)]) -> (Agent, Arc<HostBuffer>, Registration) {
    let agent = Agent::new(name).expect("agent");
    for (backend, params) in backends {
        agent.add_backend(backend, BackendParams::parse(params).expect("params")).expect("attach");
    }
    let buf = Arc::new(HostBuffer::new(SIZE));
    let reg = agent.register_buffer(&buf).expect("register");
    (agent, buf, reg)
}

/// Every byte checked, notifications included; agents in this process (the choice, not the
/// wire, is under test).
pub fn picks_by_capability_and_falls_back_to_tcp(backend: &str, params: &str) {
    let tcp = ("tcp", "listen=127.0.0.1:0");
    let both_name = format!("{backend}-choice-both");
    let (both, buf, _reg) = agent(&both_name, &[(backend, params), tcp]);
    let (full_peer, full_buf, _r1) = agent(&format!("{backend}-choice-peer"), &[(backend, params), tcp]);
    let (tcp_peer, tcp_buf, _r2) = agent(&format!("{backend}-choice-tcp-peer"), &[tcp]);
    for (peer, peer_buf, want, seed) in [(&full_peer, &full_buf, backend, 1u8), (&tcp_peer, &tcp_buf, "tcp", 2u8)] {
        let name = both.load_remote_metadata(&peer.local_metadata()).expect("load peer");
        peer.load_remote_metadata(&both.local_metadata()).expect("peer loads us");
        let data: Vec<u8> = (0..SIZE).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect();
        buf.write_at(0, &data);
        let req = both
            .create_request(Op::Write, &[buf.desc()], &name, &[peer_buf.desc()], RequestOptions::notify([seed]))
            .expect("create");
        assert_eq!(req.backend(), want, "backend chosen for {name}");
        req.post().expect("post");
        req.wait(WAIT).unwrap_or_else(|e| panic!("write to {name}: {e}"));
        assert!(peer_buf.to_vec() == data, "bytes written to {name} through {want} differ");
        assert!(peer.wait_notifs(WAIT), "no notification at {name}");
        assert_eq!(peer.get_notifs_from(&both_name), vec![vec![seed]]);
    }
}
