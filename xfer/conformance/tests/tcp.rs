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
        requests_in_flight,
        refusals_in_flight,
        notifications,
        api_errors,
        make_connection_ahead,
        bad_remote_key,
        bad_frames,
        strangers_are_refused,
        tls_mismatch_and_pinning,
        sigkill_mid_transfer,
        sigstop_mid_transfer,
        stalled_peer_times_out,
        notif_once_across_stall,
        dereg_initiator_races_transfers,
        dereg_target_races_transfers,
        grants,
        grant_writes,
        late_read_storm,
        early_claims_hold_no_handler,
        completion_styles,
    ]
);

/// The same suite with every data connection under TLS 1.3 (`tls=on`). Left out: `bad_frames`,
/// which writes raw TCP frames to the data port (a TLS target refuses them before any frame is
/// parsed, so it would test nothing of the frame decoder). Everything else speaks through the
/// agent API and runs unchanged.
mod tls {
    xfer_conformance::conformance_tests!(
        "tcp",
        "listen=127.0.0.1:0,tls=on",
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            requests_in_flight,
            refusals_in_flight,
            notifications,
            api_errors,
            make_connection_ahead,
            bad_remote_key,
            sigkill_mid_transfer,
            sigstop_mid_transfer,
            stalled_peer_times_out,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            dereg_target_races_transfers,
            completion_styles,
            tls_mutual_with_cluster_ca,
        ]
    );
}

/// The parts of the suite that cross the waits, with busy-polling off (`spin_us=0`; the rest
/// runs with the default spin): data, notifications, every way of waiting, and a peer killed
/// mid-transfer.
mod no_spin {
    xfer_conformance::conformance_tests!(
        "tcp",
        "listen=127.0.0.1:0,spin_us=0",
        [transfer_matrix, requests_in_flight, notifications, completion_styles, sigkill_mid_transfer]
    );
}
