//! The conformance suite against the libfabric backend over `tcp;ofi_rxm` on loopback, two
//! processes, every byte checked; and the agent's choice between libfabric and TCP.
//!
//! Not run: `bad_frames` (TCP's wire format) and `dereg_target_races_transfers`: over
//! `tcp;ofi_rxm` the target's provider does refuse a stale key, but by dropping the
//! connection, so the initiator sees its operations cancelled (`PeerDisconnected`), not a
//! refusal of deregistered memory; the scenario demands the latter.

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
