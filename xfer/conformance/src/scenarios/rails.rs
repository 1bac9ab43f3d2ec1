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

pub(super) const SIZE: u64 = 16 << 20;
const LINKS: usize = 2;
/// Each link must carry at least this fraction of a transfer's payload.
const MIN_SHARE: f64 = 0.4;

fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// Bytes each link of `node` moved (received, or sent) since `before`.
pub(super) fn per_link(net: &Net, node: &str, before: &[(u64, u64)], sent: bool) -> Vec<u64> {
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

pub(super) fn counters(net: &Net, node: &str) -> Vec<(u64, u64)> {
    (0..LINKS).map(|link| net.link_bytes(node, link).expect("interface counters")).collect()
}

/// Whether every link carried at least [`MIN_SHARE`] of a `payload`-byte transfer.
pub(super) fn both_links_carried(moved: &[u64], payload: u64) -> bool {
    moved.iter().all(|&bytes| bytes as f64 >= MIN_SHARE * payload as f64)
}

fn assert_both_links(what: &str, moved: &[u64], payload: u64) {
    eprintln!("{what}: bytes per link {moved:?} for a payload of {payload}");
    assert!(
        both_links_carried(moved, payload),
        "{what}: a link carried under {MIN_SHARE} of the {payload}-byte payload ({moved:?})"
    );
}

/// Builds two hosts joined by two links, starts the peer (one buffer of `size` bytes) in one
/// and runs `body` in a thread inside the other with an initiator connected to the peer.
/// `false` (said loudly) without root.
pub(super) fn with_two_links(
    scenario: &str,
    backend: &str,
    params: &str,
    size: u64,
    body: impl FnOnce(&Net, &str, &Initiator, &mut Peer, &str) + Send,
) -> bool {
    if !is_root() {
        eprintln!(
            "SKIPPED {scenario}: needs root to build network namespaces and veth links (run as root; the CI does)"
        );
        return false;
    }
    // pd-chaos names a process's namespaces by its pid: one set at a time per test binary.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let net = Net::create_with_links(&["init", "peer"], LINKS).expect("namespaces with two links (ip netns, veth)");
    let (init_node, peer_node) = (net.node("init").expect("init").clone(), net.node("peer").expect("peer").clone());
    let config = PeerConfig::new(&format!("{scenario}-peer"), backend, params, size)
        .in_netns(&peer_node.netns, &format!("{}:0", peer_node.ip));
    let mut peer = Peer::spawn(&peer_exe(), &config).expect("peer in its namespace");
    std::thread::scope(|scope| {
        // Only this thread (and what it starts: the agent's threads, libfabric's) enters the
        // initiator's namespace.
        let run = scope.spawn(|| {
            net.enter(&init_node.name).expect("enter the initiator's namespace");
            let init = Initiator::new(&format!("{scenario}-init"), backend, params, size);
            let name = init.connect(&peer);
            body(&net, &init_node.name, &init, &mut peer, &name);
        });
        if let Err(panic) = run.join() {
            std::panic::resume_unwind(panic);
        }
    });
    peer.quit().expect("peer exits");
    true
}

pub fn two_rails(backend: &str, params: &str) {
    with_two_links("rails", backend, params, SIZE, |net, init_node, init, peer, name| {
        let before = counters(net, init_node);
        init.write_checked(peer, name, "w", 11, SIZE, "WRITE over two rails");
        assert_both_links("WRITE", &per_link(net, init_node, &before, true), SIZE);

        let before = counters(net, init_node);
        peer.fill(12, 0, SIZE).expect("fill");
        init.transfer(Op::Read, &[init.desc(0, SIZE)], name, &[peer.desc(0, SIZE)], Default::default(), WAIT)
            .expect("read over two rails");
        assert_eq!(check_pattern(&init.buf, 0, 12, 0, SIZE), Ok(()), "read bytes");
        assert_both_links("READ", &per_link(net, init_node, &before, false), SIZE);

        // Many small descriptors: the stripe cuts between them.
        scattered_write(init, peer, name, 0, 1024, SIZE / 1024 / 2, 100);
    });
}

/// WRITEs `count` descriptors of `len` bytes, every other `len` bytes from `off` on both sides
/// (the local ones at even, the remote ones at odd positions), each its own pattern from
/// `first_seed` on; checks every descriptor at the peer.
pub fn scattered_write(init: &Initiator, peer: &mut Peer, name: &str, off: u64, count: u64, len: u64, first_seed: u64) {
    let (locals, remotes) = scattered_descs(init, peer, off, count, len, first_seed);
    init.transfer(Op::Write, &locals, name, &remotes, Default::default(), WAIT).expect("scattered write");
    check_scattered(peer, off, count, len, first_seed);
}

/// The descriptors of [`scattered_write`], the local ones filled.
pub(super) fn scattered_descs(
    init: &Initiator,
    peer: &Peer,
    off: u64,
    count: u64,
    len: u64,
    first_seed: u64,
) -> (Vec<xfer::Desc>, Vec<xfer::Desc>) {
    for i in 0..count {
        write_pattern(&init.buf, off + i * 2 * len, first_seed + i, 0, len);
    }
    let locals = (0..count).map(|i| init.desc(off + i * 2 * len, len)).collect();
    let remotes = (0..count).map(|i| peer.desc(off + i * 2 * len + len, len)).collect();
    (locals, remotes)
}

pub(super) fn check_scattered(peer: &mut Peer, off: u64, count: u64, len: u64, first_seed: u64) {
    let ranges: Vec<(u64, u64)> = (0..count).map(|i| (off + i * 2 * len + len, len)).collect();
    let hashes = peer.hashes(&ranges).expect("hashes");
    for (i, got) in hashes.into_iter().enumerate() {
        assert_eq!(got, pattern_hash(first_seed + i as u64, 0, len), "descriptor {i} of the scattered write");
    }
}
