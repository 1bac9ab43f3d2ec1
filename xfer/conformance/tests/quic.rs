//! The conformance suite against the QUIC backend: two processes over loopback UDP, every
//! connection under TLS 1.3. The list is the TCP backend's (`tests/tcp.rs`) minus the two
//! scenarios that speak TCP's wire: `bad_frames` writes raw frames to a TCP data port (a QUIC
//! endpoint drops such datagrams before any frame is parsed) and `tls_mismatch_and_pinning`
//! forges the TCP backend's `tls=on` setting, which QUIC does not have (it always runs TLS; the
//! pinning is the same code, tested there). `strangers_are_refused` runs its backend-neutral
//! part here; its raw-hello checks of the data port are TCP's.

xfer_conformance::conformance_tests!(
    "quic",
    "listen=127.0.0.1:0",
    [
        peer_protocol,
        transfer_matrix,
        transfer_large,
        notifications,
        api_errors,
        bad_remote_key,
        strangers_are_refused,
        sigkill_mid_transfer,
        sigstop_mid_transfer,
        stalled_peer_times_out,
        notif_once_across_stall,
        dereg_initiator_races_transfers,
        dereg_target_races_transfers,
        grants,
        grant_writes,
        late_read_storm,
        completion_styles,
    ]
);
