//! The conformance suite against the QUIC backend: two processes over loopback UDP, every
//! connection under TLS 1.3. The list is the TCP backend's (`tests/tcp.rs`) minus the two
//! scenarios that speak TCP's wire: `bad_frames` writes raw frames to a TCP data port (a QUIC
//! endpoint drops such datagrams before any frame is parsed) and `tls_mismatch_and_pinning`
//! forges the TCP backend's `tls=on` setting, which QUIC does not have (it always runs TLS; the
//! pinning is the same code, tested there). `strangers_are_refused` runs its backend-neutral
//! part here; its raw-hello checks of the data port are TCP's, and QUIC's own are below: a raw
//! quinn client that completes the TLS handshake (the pinned certificate is public) but skips or
//! fails the hello. Below too: a killed peer is noticed within the idle bound.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::metadata::AgentMetadata;
use xfer::side_channel::{self, SideOp};
use xfer::{Op, RequestOptions, XferError};
use xfer_conformance::pattern::{check_pattern, pattern_hash, write_pattern};
use xfer_conformance::scenarios::{spawn_peer, Initiator, WAIT};
use xfer_conformance::Peer;
use xfer_tcp::frame::{self, Kind, WireDesc};
use xfer_tcp::keys::TcpRemoteKey;
use xfer_tcp::tls::{self, TlsIdentity};

xfer_conformance::conformance_tests!(
    "quic",
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
        tls_mutual_with_cluster_ca,
    ]
);

const SIZE: u64 = 1 << 20;
/// The target's `REFUSED` close code (plugins/quic/src/target.rs).
const REFUSED: u32 = 1;

/// What a stranger learns from a peer without a credential (its side channel serves anyone):
/// the QUIC address, the pinned fingerprint, and the key of its buffer.
fn quic_target(peer: &Peer) -> (SocketAddr, tls::Fingerprint, WireDesc) {
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], WAIT).expect("plain GET");
    let meta = AgentMetadata::decode(&blob).expect("metadata");
    let index = meta.backends.iter().position(|b| b.name == "quic").expect("a quic backend");
    let info = std::str::from_utf8(&meta.backends[index].conn_info).expect("text");
    let (addr, fingerprint) = tls::decode_conn_info(info).expect("connection info");
    let region = meta.regions.iter().find(|r| r.desc.addr == peer.buf_addr()).expect("the peer's buffer");
    let (_, public) = region.keys.iter().find(|(i, _)| usize::from(*i) == index).expect("its quic key");
    let key = TcpRemoteKey::decode(public).expect("key");
    (addr.parse().expect("address"), fingerprint.expect("pinned"), WireDesc { key: key.key, offset: 0, len: SIZE })
}

/// A raw QUIC connection to `addr` that passes TLS (pinning `fingerprint`) and nothing else.
async fn raw_connect(addr: SocketAddr, fingerprint: tls::Fingerprint) -> (quinn::Endpoint, quinn::Connection) {
    let identity = TlsIdentity::generate().expect("identity");
    let rustls = identity.client_config(fingerprint).expect("client config");
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(rustls).expect("quic crypto");
    let endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().expect("addr")).expect("endpoint");
    let connecting = endpoint.connect_with(quinn::ClientConfig::new(Arc::new(crypto)), addr, tls::SERVER_NAME);
    let conn = connecting.expect("connect").await.expect("the TLS handshake passes");
    (endpoint, conn)
}

fn refused_close(err: &quinn::ConnectionError) -> bool {
    matches!(err, quinn::ConnectionError::ApplicationClosed(close) if close.error_code == quinn::VarInt::from_u32(REFUSED))
}

fn block_on<T>(work: impl std::future::Future<Output = T>) -> T {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async { tokio::time::timeout(WAIT, work).await.expect("the stranger's exchange is bounded") })
}

/// A stranger that knows the address, the certificate and a real key but opens its first stream
/// with a request instead of a hello: the connection is closed with `REFUSED`; a READ gets no
/// byte, a WRITE changes none, and the target lets no more than a hello's window of it in.
#[test]
fn requests_before_hello_are_refused() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let mut peer = spawn_peer("nohello-peer", "quic", "listen=127.0.0.1:0", SIZE);
    peer.fill(0x5a, 0, SIZE).expect("fill");
    let before = peer.hash(0, SIZE).expect("hash");
    let (addr, fingerprint, desc) = quic_target(&peer);
    block_on(async {
        for op in [Kind::Read, Kind::Write] {
            let (_endpoint, conn) = raw_connect(addr, fingerprint).await;
            let (mut send, mut recv) = conn.open_bi().await.expect("the first stream");
            let mut request = Vec::new();
            frame::encode_request(op, 1, &[desc], SIZE, &mut request);
            let payload = if op == Kind::Write { vec![0xee; SIZE as usize] } else { Vec::new() };
            // The writes stall once the target's hello window is spent, until it closes.
            let sent = async {
                send.write_all(&request).await?;
                send.write_all(&payload).await?;
                send.finish().map_err(|_| quinn::WriteError::ClosedStream)
            };
            let (sent, answer) = tokio::join!(sent, recv.read_to_end(SIZE as usize * 2));
            let reason = conn.closed().await;
            eprintln!("{op:?} before hello: sent {sent:?}, answer {answer:?}, closed {reason}");
            assert!(answer.is_err(), "{op:?} before hello was answered: {answer:?}");
            assert!(refused_close(&reason), "{op:?} before hello: connection closed by {reason:?}");
            let out = conn.stats().udp_tx.bytes;
            assert!(out < 64 << 10, "{op:?} before hello: the target let {out} bytes in");
        }
    });
    assert_eq!(peer.hash(0, SIZE).expect("hash"), before, "a stranger's WRITE changed the target's bytes");
}

/// A stranger whose hello is refused (it names another agent) cannot slip a request stream in
/// beside it: until a hello passes the target allows one stream, so the second never opens; and
/// what it pushes after its hello, while the target answers and closes, stops at the 16 KiB
/// window before the hello (with the full window, a 1 MiB push got through).
#[test]
fn no_request_stream_beside_a_refused_hello() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let peer = spawn_peer("sidestream-peer", "quic", "listen=127.0.0.1:0", SIZE);
    let (addr, fingerprint, _) = quic_target(&peer);
    block_on(async {
        let (_endpoint, conn) = raw_connect(addr, fingerprint).await;
        let (mut send, mut recv) = conn.open_bi().await.expect("the hello stream");
        let mut hello = Vec::new();
        frame::encode_hello_with("stranger", "not-this-peer", frame::Session { id: 7, epoch: 0 }, false, &mut hello);
        send.write_all(&hello).await.expect("hello");
        let reply = async {
            let mut fixed = [0u8; frame::HELLO_REPLY_LEN];
            recv.read_exact(&mut fixed).await.map(|()| frame::decode_hello_reply(&fixed))
        };
        let flood = async {
            send.write_all(&vec![0xee; SIZE as usize]).await?;
            send.finish().map_err(|_| quinn::WriteError::ClosedStream)
        };
        let (side, reply, flood) = tokio::join!(conn.open_bi(), reply, flood);
        let reason = conn.closed().await;
        let out = conn.stats().udp_tx.bytes;
        eprintln!("refused hello: push {flood:?}, closed {reason}, {out} bytes sent");
        assert!(flood.is_err(), "a 1 MiB push beside a refused hello went through");
        assert!(out < 64 << 10, "the target let {out} bytes in beside a refused hello");
        let (code, _) = reply.expect("a hello reply").expect("decodes");
        assert_eq!(xfer::RefusalCode::from_wire(code), xfer::RefusalCode::WrongAgent, "the hello's refusal");
        match side {
            Err(err) => assert!(refused_close(&err), "the side stream: {err:?}"),
            Ok(_) => panic!("a second stream opened beside a refused hello"),
        }
    });
}

/// The default idle bound (`idle_timeout_ms`).
const IDLE: Duration = Duration::from_secs(3);

/// A SIGKILLed peer sends nothing, keep-alives included: a request posted right after the kill
/// fails with `TimedOut` within the idle bound, long before its own timeout (30 s here).
#[test]
fn killed_peer_is_noticed_within_the_idle_timeout() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let params = "listen=127.0.0.1:0,timeout_ms=30000";
    let init = Initiator::new("idle-init", "quic", params, SIZE);
    let mut peer = spawn_peer("idle-peer", "quic", params, SIZE);
    let name = init.connect(&peer);
    write_pattern(&init.buf, 0, 3, 0, SIZE);
    let (local, remote) = ([init.desc(0, SIZE)], [peer.desc(0, SIZE)]);
    init.transfer(Op::Write, &local, &name, &remote, RequestOptions::default(), WAIT).expect("write before the kill");
    assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(3, 0, SIZE), "write before the kill");
    peer.kill();
    let killed = Instant::now();
    let result = init.transfer(Op::Read, &local, &name, &remote, RequestOptions::default(), WAIT);
    let took = killed.elapsed();
    eprintln!("killed peer: the read ended {took:?} after the kill: {result:?}");
    assert!(matches!(result, Err(XferError::TimedOut(after)) if after == IDLE), "read from a killed peer: {result:?}");
    // The margin covers a loaded machine's scheduling; the request's own bound is 30 s.
    assert!(took < IDLE + Duration::from_secs(2), "a killed peer was noticed after {took:?}");
}

/// A target whose `conn_buffer` is one chunk (1 MiB) holds one stream's payload at a time: a
/// 16 MiB WRITE and READ (16 streams in flight) still complete with every byte right, the
/// streams waiting their turn for room; chunks larger than the budget are refused `BadRequest`.
#[test]
fn conn_buffer_bounds_what_the_target_holds() {
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    const BIG: u64 = 16 << 20;
    let mut peer = spawn_peer("budget-peer", "quic", "listen=127.0.0.1:0,conn_buffer=1048576", BIG);
    let init = Initiator::new("budget-init", "quic", "listen=127.0.0.1:0", 2 * BIG);
    let name = init.connect(&peer);
    write_pattern(&init.buf, 0, 11, 0, BIG);
    let remote = [peer.desc(0, BIG)];
    init.transfer(Op::Write, &[init.desc(0, BIG)], &name, &remote, RequestOptions::default(), WAIT)
        .expect("a WRITE under a 1 MiB budget");
    assert_eq!(peer.hash(0, BIG).expect("hash"), pattern_hash(11, 0, BIG), "WRITE under a 1 MiB budget");
    init.transfer(Op::Read, &[init.desc(BIG, BIG)], &name, &remote, RequestOptions::default(), WAIT)
        .expect("a READ under a 1 MiB budget");
    assert_eq!(check_pattern(&init.buf, BIG, 11, 0, BIG), Ok(()), "READ under a 1 MiB budget");

    let wide = Initiator::new("budget-wide", "quic", "listen=127.0.0.1:0,chunk_bytes=2097152", BIG);
    let name = wide.connect(&peer);
    let result = wide.transfer(Op::Write, &[wide.desc(0, BIG)], &name, &remote, RequestOptions::default(), WAIT);
    assert!(
        matches!(result, Err(XferError::Refused { code: xfer::RefusalCode::BadRequest, .. })),
        "2 MiB chunks to a 1 MiB budget: {result:?}"
    );
}
