//! TCP's `tls=on` against mismatched or forged peers: every attempt fails with a typed error
//! within a bound and leaves the peer's memory untouched, and the intact setup works after.
//! `params` are the plain TCP parameters; the scenario adds `tls=on` where it needs TLS. And
//! mutual TLS with a cluster CA, for TCP and QUIC (the identity both use is the TCP backend's).

use xfer::metadata::AgentMetadata;
use xfer::side_channel::{self, SideOp};
use xfer::{BackendError, Op, RefusalCode, RequestOptions, XferError};

use super::{spawn_peer, within, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{pattern_hash, write_pattern};
use crate::peer::Peer;
use crate::test_ca::TestCa;

const SIZE: u64 = 256 << 10;
/// What the TCP backend appends to its connection info under `tls=on`.
const FINGERPRINT_TAG: &str = "#tls-sha256=";

pub fn tls_mismatch_and_pinning(backend: &str, params: &str) {
    let tls_params = format!("{params},tls=on");

    // A plain initiator against a TLS target: refused in plain text, before any frame.
    let mut tls_peer = spawn_peer("tls-target", backend, &tls_params, SIZE);
    tls_peer.fill(0xbad, 0, SIZE).expect("fill");
    let plain = Initiator::new("tls-plain-init", backend, params, SIZE);
    write_pattern(&plain.buf, 0, 0x900d, 0, SIZE);
    let name = plain.connect(&tls_peer);
    let result = write_all(&plain, &name, &tls_peer, "a plain write to a TLS target");
    assert!(matches!(result, Err(XferError::Refused { code: RefusalCode::Unsupported, .. })), "{result:?}");
    assert_untouched(&mut tls_peer, "after a plain initiator");

    // A TLS initiator given a tampered fingerprint: the handshake fails on the certificate.
    let init = Initiator::new("tls-init", backend, &tls_params, SIZE);
    write_pattern(&init.buf, 0, 0x900d, 0, SIZE);
    let (blob, metadata) = metadata_of(&tls_peer, backend);
    let mut tampered = metadata.clone();
    edit_conn_info(&mut tampered, backend, |info| {
        let last = info.pop().expect("conn_info is not empty");
        info.push(if last == '0' { '1' } else { '0' });
    });
    let name = init.agent.load_remote_metadata(&tampered.encode()).expect("tampered metadata still decodes");
    let result = write_all(&init, &name, &tls_peer, "a write pinned to the wrong certificate");
    assert_tls_error(&result, "wrong fingerprint");
    assert_untouched(&mut tls_peer, "after a wrong fingerprint");

    // The intact metadata: TLS both ways, every byte arrives.
    let name = init.agent.load_remote_metadata(&blob).expect("intact metadata loads");
    write_all(&init, &name, &tls_peer, "a TLS write").unwrap_or_else(|e| panic!("TLS write: {e}"));
    assert_eq!(tls_peer.hash(0, SIZE).expect("hash"), pattern_hash(0x900d, 0, SIZE), "TLS write delivered");

    // A TLS initiator against a plain target: no fingerprint in its metadata, so no backend
    // serves it (no fallback to plain text) ...
    let mut plain_peer = spawn_peer("plain-target", backend, params, SIZE);
    plain_peer.fill(0xbad, 0, SIZE).expect("fill");
    let name = init.connect(&plain_peer);
    let result = write_all(&init, &name, &plain_peer, "a TLS write to a plain target");
    assert!(matches!(result, Err(XferError::NoBackend(_))), "{result:?}");
    // ... and one whose metadata was forged to carry a fingerprint meets a target that does
    // not answer the handshake.
    let (_, metadata) = metadata_of(&plain_peer, backend);
    let mut forged = metadata.clone();
    edit_conn_info(&mut forged, backend, |info| {
        info.push_str(FINGERPRINT_TAG);
        info.push_str(&"ab".repeat(32));
    });
    let name = init.agent.load_remote_metadata(&forged.encode()).expect("forged metadata decodes");
    let result = write_all(&init, &name, &plain_peer, "a TLS write to a plain target (forged fingerprint)");
    assert_tls_error(&result, "plain target");
    assert_untouched(&mut plain_peer, "after a TLS initiator");
}

/// Mutual TLS (`tls_ca`, `tls_cert`, `tls_key`): a target that trusts the cluster CA serves an
/// initiator holding a certificate of that CA, and refuses at the handshake one with TLS but no
/// certificate, and one whose certificate another CA signed, leaving its memory untouched.
/// `params` run TLS without client certificates (TCP's `tls=on`, QUIC's defaults).
pub fn tls_mutual_with_cluster_ca(backend: &str, params: &str) {
    let dir = std::env::temp_dir().join(format!("xfer-mtls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a folder for the certificates");
    let cluster = TestCa::new("cluster CA");
    let outsider = TestCa::new("another CA");
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, cluster.cert_pem()).expect("write the CA");
    // Every party trusts the cluster CA; each holds a certificate of `ca`.
    let mutual = |name: &str, ca: &TestCa| {
        let (cert, key) = ca.issue(name);
        let (cert_file, key_file) = (dir.join(format!("{name}.pem")), dir.join(format!("{name}.key")));
        std::fs::write(&cert_file, cert).expect("write a certificate");
        std::fs::write(&key_file, key).expect("write a key");
        format!("{params},tls_ca={},tls_cert={},tls_key={}", ca_file.display(), cert_file.display(), key_file.display())
    };

    // A backend given part of the files, a file that is not there, or tls=off with them, is
    // not created, and says why.
    let target_params = mutual("target", &cluster);
    let mut bad = vec![
        (format!("{params},tls_ca={}", ca_file.display()), "together"),
        (target_params.replace("target.key", "missing.key"), "missing.key"),
    ];
    if params.contains("tls=on") {
        bad.push((target_params.replace("tls=on", "tls=off"), "off"));
    }
    for (bad_params, says) in bad {
        let agent = xfer::Agent::new("mtls-bad").expect("agent");
        let parsed = xfer::BackendParams::parse(&bad_params).expect("the parameters parse");
        match agent.add_backend(backend, parsed) {
            Err(XferError::Backend { source, .. }) if matches!(&*source, BackendError::InvalidParam { reason, .. } if reason.contains(says)) =>
                {}
            other => panic!("{bad_params}: expected an invalid parameter naming {says:?}, got {other:?}"),
        }
    }

    let mut target = spawn_peer("mtls-target", backend, &target_params, SIZE);
    target.fill(0xbad, 0, SIZE).expect("fill");
    // The target refuses them at the handshake with a fatal alert: certificate_required (116)
    // and unknown_ca (48).
    let refused = [
        ("TLS without a client certificate", params.to_string(), "116"),
        ("a certificate of another CA", mutual("stranger", &outsider), "48"),
    ];
    for (what, init_params, alert) in refused {
        let init = Initiator::new("mtls-refused", backend, &init_params, SIZE);
        write_pattern(&init.buf, 0, 0x900d, 0, SIZE);
        let name = init.connect(&target);
        match write_all(&init, &name, &target, what) {
            Err(err) if err.to_string().contains(alert) => eprintln!("{what}: {err}"),
            other => panic!("{what}: expected the target's alert {alert}, got {other:?}"),
        }
        assert_untouched(&mut target, what);
    }

    let init = Initiator::new("mtls-init", backend, &mutual("initiator", &cluster), SIZE);
    write_pattern(&init.buf, 0, 0x900d, 0, SIZE);
    let name = init.connect(&target);
    write_all(&init, &name, &target, "a mutual-TLS write").unwrap_or_else(|e| panic!("mutual-TLS write: {e}"));
    assert_eq!(target.hash(0, SIZE).expect("hash"), pattern_hash(0x900d, 0, SIZE), "mutual-TLS write delivered");
    let _ = std::fs::remove_dir_all(&dir);
}

fn write_all(init: &Initiator, name: &str, peer: &Peer, what: &str) -> Result<(), XferError> {
    within(what, FAILURE_BOUND, || {
        init.transfer(Op::Write, &[init.desc(0, SIZE)], name, &[peer.desc(0, SIZE)], RequestOptions::default(), WAIT)
    })
}

fn assert_tls_error(result: &Result<(), XferError>, what: &str) {
    match result {
        Err(XferError::Backend { source, .. }) if matches!(**source, BackendError::Tls { .. }) => {
            eprintln!("{what}: {source}");
        }
        other => panic!("{what}: expected a TLS error, got {other:?}"),
    }
}

fn assert_untouched(peer: &mut Peer, what: &str) {
    assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(0xbad, 0, SIZE), "peer memory changed {what}");
}

fn metadata_of(peer: &Peer, backend: &str) -> (Vec<u8>, AgentMetadata) {
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], side_channel::IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("side channel get: {e}"));
    let metadata = AgentMetadata::decode(&blob).expect("the peer's metadata decodes");
    assert!(metadata.backends.iter().any(|b| b.name == backend), "the peer publishes {backend}");
    (blob, metadata)
}

fn edit_conn_info(metadata: &mut AgentMetadata, backend: &str, edit: impl Fn(&mut String)) {
    for info in metadata.backends.iter_mut().filter(|b| b.name == backend) {
        let mut text = String::from_utf8(info.conn_info.clone()).expect("tcp conn_info is UTF-8");
        edit(&mut text);
        info.conn_info = text.into_bytes();
    }
}
