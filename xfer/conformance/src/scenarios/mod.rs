//! The conformance scenarios. Each takes the backend's name and its `k=v,...` parameters (used
//! by both the in-test initiator and the peer process) and panics with a precise message on the
//! first violation, so a backend's test file is one line per scenario.
//!
//! Everything here is backend-neutral except [`wire_tcp`], which hand-crafts TCP frames, and
//! `tls_tcp`, which forges TCP's TLS fingerprint. The
//! SIGSTOP scenarios assume the backend's no-progress timeout is the default 5 s (well under
//! [`FAILURE_BOUND`], and under the 6.5 s stall of [`notif_once_across_stall`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::SeedableRng;
use xfer::{Agent, BackendParams, HostBuffer, Op, Registration, RequestOptions, XferError};

use crate::peer::{peer_exe, Peer, PeerConfig};

mod auth;
mod choice;
mod claims;
mod connect_now;
mod dereg;
mod errors;
mod faults;
mod grants;
mod keys;
mod notifs;
mod protocol;
mod rail_failover;
mod rails;
mod reconnect;
mod stall;
mod tls_tcp;
mod transfers;
mod waits;
pub mod wire_tcp;

pub use auth::strangers_are_refused;
pub use choice::picks_by_capability_and_falls_back_to_tcp;
pub use claims::early_claims_hold_no_handler;
pub use connect_now::make_connection_ahead;
pub use dereg::{
    dereg_initiator_races_transfers, dereg_target_races_transfers, dereg_target_races_transfers_disconnecting,
};
pub use errors::api_errors;
pub use faults::{sigkill_mid_transfer, sigstop_mid_transfer};
pub use grants::{grant_writes, grants, late_read_storm};
pub use keys::bad_remote_key;
pub use notifs::notifications;
pub use protocol::peer_protocol;
pub use rail_failover::{rail_failover, REDO_BOUND};
pub use rails::{scattered_write, two_rails};
pub use reconnect::reconnect_cycles;
pub use stall::{notif_once_across_stall, stalled_peer_bounded, stalled_peer_times_out};
pub use tls_tcp::{tls_mismatch_and_pinning, tls_mutual_with_cluster_ca};
pub use transfers::{refusals_in_flight, requests_in_flight, transfer_large, transfer_matrix};
pub use waits::completion_styles;
pub use wire_tcp::bad_frames;

/// Bound on one ordinary request.
pub const WAIT: Duration = Duration::from_secs(20);
/// Bound on a backend noticing a dead peer: its no-progress timeout (5 s for TCP) plus slack.
pub const FAILURE_BOUND: Duration = Duration::from_secs(15);

/// The in-test initiator: an agent with the backend attached and one registered buffer.
#[derive(Debug)]
pub struct Initiator {
    pub agent: Agent,
    pub buf: Arc<HostBuffer>,
    pub reg: Option<Registration>,
}

impl Initiator {
    pub fn new(name: &str, backend: &str, params: &str, size: u64) -> Initiator {
        let agent = Agent::new(name).expect("agent");
        let parsed = BackendParams::parse(params).unwrap_or_else(|e| panic!("params {params:?}: {e}"));
        agent.add_backend(backend, parsed).unwrap_or_else(|e| panic!("attach {backend}: {e}"));
        let buf = Arc::new(HostBuffer::new(size as usize));
        let reg = Some(agent.register_buffer(&buf).expect("register the initiator's buffer"));
        Initiator { agent, buf, reg }
    }

    /// The descriptor of `off .. off + len` of the local buffer.
    pub fn desc(&self, off: u64, len: u64) -> xfer::Desc {
        xfer::Desc::new(self.buf.addr() + off, len, 0)
    }

    /// Loads a peer's metadata knowing only its side-channel address; returns its name.
    pub fn connect(&self, peer: &Peer) -> String {
        let name = self
            .agent
            .fetch_remote_metadata(peer.side_channel())
            .unwrap_or_else(|e| panic!("fetch metadata of {} from {}: {e}", peer.name(), peer.side_channel()));
        assert_eq!(name, peer.name(), "the side channel serves another agent's metadata");
        name
    }

    /// Posts one request and waits for it (bounded).
    pub fn transfer(
        &self,
        op: Op,
        local: &[xfer::Desc],
        peer: &str,
        remote: &[xfer::Desc],
        options: RequestOptions,
        bound: Duration,
    ) -> Result<(), XferError> {
        let req = self.agent.create_request(op, local, peer, remote, options)?;
        req.post()?;
        req.wait(bound)
    }

    /// WRITEs the first `len` bytes, filled with pattern `seed`, to the same place at `peer`
    /// with a notification the peer checks against what arrived; asserts the peer's bytes and
    /// that the notification came as `{tag}=ok` (after the data). `what` names the case.
    pub fn write_checked(&self, peer: &mut Peer, name: &str, tag: &str, seed: u64, len: u64, what: &str) {
        crate::pattern::write_pattern(&self.buf, 0, seed, 0, len);
        let expected = crate::pattern::pattern_hash(seed, 0, len);
        let message = crate::pattern::check_message(tag, 0, len, expected);
        self.transfer(
            Op::Write,
            &[self.desc(0, len)],
            name,
            &[peer.desc(0, len)],
            RequestOptions::notify(message),
            WAIT,
        )
        .unwrap_or_else(|e| panic!("{what}: write: {e}"));
        assert_eq!(peer.hash(0, len).expect("hash"), expected, "{what}: written bytes");
        let notifs = peer.collect_notifs(1, Duration::from_secs(10)).expect("notifs");
        assert_eq!(notifs, [format!("{tag}=ok")], "{what}: the notification did not follow its data");
    }
}

/// Starts a peer process with one registered buffer of `size` bytes.
pub fn spawn_peer(name: &str, backend: &str, params: &str, size: u64) -> Peer {
    let exe = peer_exe();
    Peer::spawn(&exe, &PeerConfig::new(name, backend, params, size))
        .unwrap_or_else(|e| panic!("start peer {name} ({}): {e}", exe.display()))
}

/// A random generator whose seed is printed (and can be pinned with `XFER_CONFORMANCE_SEED`)
/// so a failing layout can be replayed.
pub fn rng(scenario: &str) -> StdRng {
    let seed =
        std::env::var("XFER_CONFORMANCE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random::<u64>);
    eprintln!("{scenario}: XFER_CONFORMANCE_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// Drops `value` on another thread and panics unless that finished within `bound` (a drop
/// that waits, like a deregistration, must not hang the test).
pub fn drop_within<T: Send + 'static>(what: &str, bound: Duration, value: T) {
    let (done, finished) = crossbeam_channel::bounded(1);
    let started = Instant::now();
    std::thread::spawn(move || {
        drop(value);
        let _ = done.send(());
    });
    if finished.recv_timeout(bound).is_err() {
        panic!("{what} did not finish within {bound:?}");
    }
    eprintln!("{what} took {:?}", started.elapsed());
}

/// Panics unless `f` finished within `bound`; returns its value.
pub fn within<T>(what: &str, bound: Duration, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let value = f();
    let took = started.elapsed();
    assert!(took < bound, "{what} took {took:?}, more than {bound:?}");
    value
}
