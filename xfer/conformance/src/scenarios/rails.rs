//! Multi-rail: two hosts joined by two separate links, each host a network namespace built by
//! pd-chaos (`eth0` on 10.77.0.0/24, `eth1` on 10.77.1.0/24, each link its own bridge), the
//! backend given both interfaces in `params`. Every byte is checked, a notification must
//! follow the data of both rails, and each link's interface counters must show it carried its
//! share of the payload. Needs root and `ip netns`; without root it says so loudly and skips.

use pdchaos::netns::Net;
use xfer::Op;

use super::{Initiator, WAIT};
use crate::pattern::{check_pattern, pattern_hash, write_pattern};
use crate::peer::{peer_exe, Peer, PeerConfig};

const SIZE: u64 = 16 << 20;
const LINKS: usize = 2;
/// Each link must carry at least this fraction of a transfer's payload.
const MIN_SHARE: f64 = 0.4;

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// Bytes each link of `node` moved (received, or sent) since `before`.
fn per_link(net: &Net, node: &str, before: &[(u64, u64)], sent: bool) -> Vec<u64> {
    (0..LINKS)
        .map(|link| {
            let (rx, tx) = net.link_bytes(node, link).expect("interface counters");
            if sent {
                tx - before[link].1
            } else {
                rx - before[link].0
            }
        })
        .collect()
}

fn counters(net: &Net, node: &str) -> Vec<(u64, u64)> {
    (0..LINKS).map(|link| net.link_bytes(node, link).expect("interface counters")).collect()
}

fn assert_both_links(what: &str, moved: &[u64]) {
    eprintln!("{what}: bytes per link {moved:?} for a payload of {SIZE}");
    for (link, &bytes) in moved.iter().enumerate() {
        assert!(
            bytes as f64 >= MIN_SHARE * SIZE as f64,
            "{what}: link eth{link} carried {bytes} bytes, under {MIN_SHARE} of the {SIZE}-byte payload ({moved:?})"
        );
    }
}

pub fn two_rails(backend: &str, params: &str) {
    if !is_root() {
        eprintln!(
            "SKIPPED two_rails: needs root to build network namespaces and veth links (run as root; the CI does)"
        );
        return;
    }
    let net = Net::create_with_links(&["init", "peer"], LINKS).expect("namespaces with two links (ip netns, veth)");
    let (init_node, peer_node) = (net.node("init").expect("init").clone(), net.node("peer").expect("peer").clone());
    let config =
        PeerConfig::new("rails-peer", backend, params, SIZE).in_netns(&peer_node.netns, &format!("{}:0", peer_node.ip));
    let mut peer = Peer::spawn(&peer_exe(), &config).expect("peer in its namespace");
    std::thread::scope(|scope| {
        // Only this thread (and what it starts: the agent's threads, libfabric's) enters the
        // initiator's namespace.
        let run = scope.spawn(|| {
            net.enter(&init_node.name).expect("enter the initiator's namespace");
            let init = Initiator::new("rails-init", backend, params, SIZE);
            let name = init.connect(&peer);

            let before = counters(&net, &init_node.name);
            init.write_checked(&mut peer, &name, "w", 11, SIZE, "WRITE over two rails");
            assert_both_links("WRITE", &per_link(&net, &init_node.name, &before, true));

            let before = counters(&net, &init_node.name);
            peer.fill(12, 0, SIZE).expect("fill");
            init.transfer(Op::Read, &[init.desc(0, SIZE)], &name, &[peer.desc(0, SIZE)], Default::default(), WAIT)
                .expect("read over two rails");
            assert_eq!(check_pattern(&init.buf, 0, 12, 0, SIZE), Ok(()), "read bytes");
            assert_both_links("READ", &per_link(&net, &init_node.name, &before, false));

            // Many small descriptors: the stripe cuts between them.
            let (count, len) = (1024u64, SIZE / 1024 / 2);
            let locals: Vec<xfer::Desc> = (0..count).map(|i| init.desc(i * 2 * len, len)).collect();
            let remotes: Vec<xfer::Desc> = (0..count).map(|i| peer.desc(i * 2 * len + len, len)).collect();
            for i in 0..count {
                write_pattern(&init.buf, i * 2 * len, 100 + i, 0, len);
            }
            init.transfer(Op::Write, &locals, &name, &remotes, Default::default(), WAIT).expect("scattered write");
            let ranges: Vec<(u64, u64)> = (0..count).map(|i| (i * 2 * len + len, len)).collect();
            let hashes = peer.hashes(&ranges).expect("hashes");
            for (i, got) in hashes.into_iter().enumerate() {
                assert_eq!(got, pattern_hash(100 + i as u64, 0, len), "descriptor {i} of the scattered write");
            }
        });
        if let Err(panic) = run.join() {
            std::panic::resume_unwind(panic);
        }
    });
    peer.quit().expect("peer exits");
}
