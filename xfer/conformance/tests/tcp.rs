//! The conformance suite against the TCP backend: two processes over loopback. Another
//! backend's file is this one with its own name and parameters (minus `bad_frames`, which
//! speaks TCP's wire format).

use xfer_conformance::scenarios::{self, wire_tcp};

const BACKEND: &str = "tcp";
const PARAMS: &str = "listen=127.0.0.1:0";

fn setup() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
}

#[test]
fn peer_protocol() {
    setup();
    scenarios::peer_protocol(BACKEND, PARAMS);
}

#[test]
fn transfer_matrix() {
    setup();
    scenarios::transfer_matrix(BACKEND, PARAMS);
}

#[test]
fn transfer_large() {
    setup();
    scenarios::transfer_large(BACKEND, PARAMS);
}

#[test]
fn notifications() {
    setup();
    scenarios::notifications(BACKEND, PARAMS);
}

#[test]
fn api_errors() {
    setup();
    scenarios::api_errors(BACKEND, PARAMS);
}

#[test]
fn bad_remote_key() {
    setup();
    scenarios::bad_remote_key(BACKEND, PARAMS);
}

#[test]
fn bad_frames() {
    setup();
    wire_tcp::bad_frames(BACKEND, PARAMS);
}

#[test]
fn sigkill_mid_transfer() {
    setup();
    scenarios::sigkill_mid_transfer(BACKEND, PARAMS);
}

#[test]
fn sigstop_mid_transfer() {
    setup();
    scenarios::sigstop_mid_transfer(BACKEND, PARAMS);
}

#[test]
fn stalled_peer_times_out() {
    setup();
    scenarios::stalled_peer_times_out(BACKEND, PARAMS);
}

#[test]
fn notif_once_across_stall() {
    setup();
    scenarios::notif_once_across_stall(BACKEND, PARAMS);
}

#[test]
fn dereg_initiator_races_transfers() {
    setup();
    scenarios::dereg_initiator_races_transfers(BACKEND, PARAMS);
}

#[test]
fn dereg_target_races_transfers() {
    setup();
    scenarios::dereg_target_races_transfers(BACKEND, PARAMS);
}
