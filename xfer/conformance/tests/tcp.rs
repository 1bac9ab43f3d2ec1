//! The conformance suite against the TCP backend: two processes over loopback. Another
//! backend's file is this one with its own name and parameters (minus `bad_frames`, which
//! speaks TCP's wire format).

xfer_conformance::conformance_tests!(
    "tcp",
    "listen=127.0.0.1:0",
    [
        peer_protocol,
        transfer_matrix,
        transfer_large,
        notifications,
        api_errors,
        bad_remote_key,
        bad_frames,
        strangers_are_refused,
        sigkill_mid_transfer,
        sigstop_mid_transfer,
        stalled_peer_times_out,
        notif_once_across_stall,
        dereg_initiator_races_transfers,
        dereg_target_races_transfers,
        grants,
        late_read_storm,
    ]
);
