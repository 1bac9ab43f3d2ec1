//! TCP only: hand-made frames against the target's data port. Refusals keep the connection in
//! step; malformed or truncated input closes that one connection; the peer keeps serving.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::time::Duration;

use xfer::metadata::AgentMetadata;
use xfer::side_channel::{self, SideOp};
use xfer::{Op, RefusalCode, RequestOptions};
use xfer_tcp::frame::{self, Kind, WireDesc};
use xfer_tcp::TcpRemoteKey;

use super::{spawn_peer, within, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{hash, pattern, pattern_hash, write_pattern};
use crate::peer::Peer;

const SIZE: u64 = 1 << 20;
/// Bound on every raw socket operation (the target's own no-progress timeout is 5 s).
const IO: Duration = Duration::from_secs(10);

/// What a raw client needs: the data port and the registration's key, both from the metadata
/// blob the side channel serves.
fn target(peer: &Peer) -> (String, TcpRemoteKey) {
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], side_channel::IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("side channel get: {e}"));
    let md = AgentMetadata::decode(&blob).expect("decode metadata");
    let (index, info) = md.backends.iter().enumerate().find(|(_, b)| b.name == "tcp").expect("a tcp backend");
    let addr = String::from_utf8(info.conn_info.clone()).expect("tcp conn_info is UTF-8 host:port");
    let region = md.regions.first().expect("one registered region");
    let (_, public) = region.keys.iter().find(|(i, _)| usize::from(*i) == index).expect("a tcp key");
    (addr, TcpRemoteKey::decode(public).expect("tcp key"))
}

struct Raw {
    stream: TcpStream,
    next_id: u64,
}

impl Raw {
    fn connect(addr: &str) -> Raw {
        let sock = addr.to_socket_addrs().expect("resolve").next().expect("an address");
        let stream = TcpStream::connect_timeout(&sock, IO).expect("connect to the data port");
        stream.set_read_timeout(Some(IO)).and_then(|()| stream.set_write_timeout(Some(IO))).expect("timeouts");
        Raw { stream, next_id: 1 }
    }

    /// Connects and says hello to `to`; returns the reply's code and message.
    fn hello(addr: &str, to: &str) -> (Raw, u16, String) {
        let mut raw = Raw::connect(addr);
        let mut hello = Vec::new();
        frame::encode_hello("raw-tester", to, frame::Session::default(), &mut hello);
        raw.send(&hello);
        let mut fixed = [0u8; frame::HELLO_REPLY_LEN];
        raw.stream.read_exact(&mut fixed).expect("hello reply");
        let (code, len) = frame::decode_hello_reply(&fixed).expect("decode hello reply");
        let mut msg = vec![0u8; len];
        raw.stream.read_exact(&mut msg).expect("hello reply message");
        (raw, code, String::from_utf8_lossy(&msg).into_owned())
    }

    fn accepted(addr: &str, to: &str) -> Raw {
        let (raw, code, msg) = Raw::hello(addr, to);
        assert_eq!(code, 0, "hello refused: {msg}");
        raw
    }

    fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).expect("send to the data port");
    }

    /// Sends a request; returns (code, message, payload) of the response.
    fn request(&mut self, kind: Kind, descs: &[WireDesc], payload: &[u8]) -> (u16, String, Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        let declared = descs.iter().map(|d| d.len).sum();
        let mut out = Vec::new();
        frame::encode_request(kind, id, descs, declared, &mut out);
        out.extend_from_slice(payload);
        self.send(&out);
        let mut head = [0u8; frame::RESPONSE_LEN];
        self.stream.read_exact(&mut head).expect("response header");
        let response = frame::decode_response(&head).expect("decode response");
        assert_eq!(response.request_id, id, "response names another request");
        let mut msg = vec![0u8; response.tail_len()];
        self.stream.read_exact(&mut msg).expect("response message");
        msg.truncate(response.msg_len as usize);
        let mut body = vec![0u8; response.payload_len as usize];
        self.stream.read_exact(&mut body).expect("response payload");
        (response.code, String::from_utf8_lossy(&msg).into_owned(), body)
    }

    fn expect_refusal(&mut self, what: &str, kind: Kind, descs: &[WireDesc], code: RefusalCode) {
        let payload = if kind == Kind::Write { vec![0xa5; descs.iter().map(|d| d.len as usize).sum()] } else { vec![] };
        let (got, msg, body) = self.request(kind, descs, &payload);
        assert_eq!(RefusalCode::from_wire(got), code, "{what}: answered {msg:?}");
        assert!(body.is_empty(), "{what}: a refusal carries no payload");
        assert!(!msg.is_empty(), "{what}: a refusal says why");
    }

    /// The target must close this connection (EOF or reset), within the bound.
    fn expect_closed(mut self, what: &str) {
        let mut buf = [0u8; 256];
        loop {
            match self.stream.read(&mut buf) {
                Ok(0) => return,
                Ok(_) => continue,
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted) => return,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    panic!("{what}: the target kept the connection open for {IO:?}")
                }
                Err(e) => panic!("{what}: {e}"),
            }
        }
    }
}

fn desc(key: &TcpRemoteKey, offset: u64, len: u64) -> WireDesc {
    WireDesc { key: key.key, offset, len }
}

/// Refusals, malformed frames and truncated ones, then proof the peer still serves.
pub fn bad_frames(backend: &str, params: &str) {
    assert_eq!(backend, "tcp", "hand-made frames speak the tcp backend's wire format");
    let init = Initiator::new("frames-init", backend, params, SIZE);
    let mut peer = spawn_peer("frames-peer", backend, params, SIZE);
    let name = init.connect(&peer);
    let (addr, key) = target(&peer);
    assert_eq!((key.base, key.len), (peer.buf_addr(), SIZE), "the key describes the registration");
    let before = peer.hash(0, SIZE).expect("hash");

    let mut raw = Raw::accepted(&addr, &name);
    let mut unknown = key;
    unknown.key[0] ^= 1;
    raw.expect_refusal("write, unknown key", Kind::Write, &[desc(&unknown, 0, 100)], RefusalCode::UnknownKey);
    raw.expect_refusal("read, unknown key", Kind::Read, &[desc(&unknown, 0, 100)], RefusalCode::UnknownKey);
    let mixed = [desc(&key, 0, 10), desc(&unknown, 10, 10)];
    raw.expect_refusal("write, second key unknown", Kind::Write, &mixed, RefusalCode::UnknownKey);
    assert_eq!(peer.hash(0, SIZE).expect("hash"), before, "a refused write changed target memory");

    // The same connection serves correct requests after a refusal.
    let data = pattern(11, 0, 100);
    let (code, msg, _) = raw.request(Kind::Write, &[desc(&key, 1000, 100)], &data);
    assert_eq!(code, 0, "correct write after a refusal: {msg}");
    assert_eq!(peer.hash(1000, 100).expect("hash"), hash(&data));
    let (code, msg, body) = raw.request(Kind::Read, &[desc(&key, 1000, 100)], &[]);
    assert_eq!((code, body.as_slice()), (0, data.as_slice()), "correct read after a refusal: {msg}");

    let written = peer.hash(0, SIZE).expect("hash");
    for (what, kind, descs) in [
        ("write straddling the end", Kind::Write, vec![desc(&key, SIZE - 10, 100)]),
        ("write past the end", Kind::Write, vec![desc(&key, SIZE, 1)]),
        ("write at a wrapping offset", Kind::Write, vec![desc(&key, u64::MAX - 5, 10)]),
        ("write, valid then out of bounds", Kind::Write, vec![desc(&key, 0, 50), desc(&key, SIZE - 1, 2)]),
        ("read straddling the end", Kind::Read, vec![desc(&key, SIZE - 1, 2)]),
        ("read at a huge offset", Kind::Read, vec![desc(&key, 1 << 62, 1)]),
    ] {
        raw.expect_refusal(what, kind, &descs, RefusalCode::OutOfBounds);
    }
    assert_eq!(peer.hash(0, SIZE).expect("hash"), written, "an out-of-bounds write changed target memory");
    let (code, msg, body) = raw.request(Kind::Read, &[desc(&key, 1000, 100)], &[]);
    assert_eq!((code, body.as_slice()), (0, data.as_slice()), "read after out-of-bounds refusals: {msg}");
    drop(raw);

    malformed(&addr, &name, &key);

    let (raw, code, msg) = Raw::hello(&addr, "someone-else");
    assert_eq!(RefusalCode::from_wire(code), RefusalCode::WrongAgent, "hello naming another agent: {msg:?}");
    raw.expect_closed("after a refused hello");
    stale_metadata(&init, &peer);

    still_serving(&init, &mut peer, &name);
    stalled_writer(&addr, &name, &key, &mut peer);
    assert!(peer.is_alive(), "the peer died deregistering");
}

/// Metadata naming another agent at this peer's address (a stale blob after a restart): the
/// target's hello check refuses every request, and the real peer is unaffected.
fn stale_metadata(init: &Initiator, peer: &Peer) {
    let blob = side_channel::call(peer.side_channel(), SideOp::Get, &[], side_channel::IO_TIMEOUT)
        .unwrap_or_else(|e| panic!("side channel get: {e}"));
    let mut md = AgentMetadata::decode(&blob).expect("decode metadata");
    md.name = "ghost".into();
    let ghost = init.agent.load_remote_metadata(&md.encode()).expect("load the forged blob");
    let result =
        init.transfer(Op::Write, &[init.desc(0, 64)], &ghost, &[peer.desc(0, 64)], RequestOptions::default(), WAIT);
    assert!(
        matches!(result, Err(xfer::XferError::Refused { code: RefusalCode::WrongAgent, .. })),
        "request to an agent that is not at that address: {result:?}"
    );
    init.agent.invalidate_remote(&ghost).expect("forget the ghost");
}

/// Inputs after which the target must drop the connection.
fn malformed(addr: &str, name: &str, key: &TcpRemoteKey) {
    let mut header = Vec::new();
    frame::encode_request(Kind::Write, 1, &[desc(key, 0, 1000)], 1000, &mut header);

    let mut raw = Raw::accepted(addr, name);
    raw.send(&header[..10]);
    raw.stream.shutdown(Shutdown::Write).expect("shutdown");
    raw.expect_closed("truncated header, then close");

    let mut raw = Raw::accepted(addr, name);
    raw.send(&header);
    raw.send(&[7u8; 500]);
    raw.stream.shutdown(Shutdown::Write).expect("shutdown");
    raw.expect_closed("half the payload, then close");

    let mut raw = Raw::connect(addr);
    let mut garbage = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    garbage.extend(pattern(3, 0, 200));
    raw.send(&garbage);
    raw.expect_closed("garbage instead of a hello");

    let mut bad_version = Vec::new();
    frame::encode_hello("raw-tester", name, frame::Session::default(), &mut bad_version);
    bad_version[4] = frame::VERSION + 1;
    let mut raw = Raw::connect(addr);
    raw.send(&bad_version);
    raw.expect_closed("hello of an unknown version");

    let mut raw = Raw::accepted(addr, name);
    raw.send(&pattern(4, 0, 300).iter().map(|b| b | 0x80).collect::<Vec<u8>>());
    raw.expect_closed("garbage after the hello");

    let mut mismatch = Vec::new();
    frame::encode_request(Kind::Write, 2, &[desc(key, 0, 10)], 11, &mut mismatch);
    let mut raw = Raw::accepted(addr, name);
    raw.send(&mismatch);
    raw.expect_closed("payload length differing from the descriptors");

    let mut notif = Vec::new();
    frame::encode_request(Kind::Notif, 3, &[desc(key, 0, 1)], 1, &mut notif);
    let mut raw = Raw::accepted(addr, name);
    raw.send(&notif);
    raw.expect_closed("descriptors in a notification");
}

/// The peer is alive and transfers through the API both ways.
fn still_serving(init: &Initiator, peer: &mut Peer, name: &str) {
    assert!(peer.is_alive(), "the peer died of bad input");
    let seed = 0xfeed;
    write_pattern(&init.buf, 0, seed, 0, SIZE / 2);
    init.transfer(
        Op::Write,
        &[init.desc(0, SIZE / 2)],
        name,
        &[peer.desc(SIZE / 2, SIZE / 2)],
        RequestOptions::default(),
        WAIT,
    )
    .unwrap_or_else(|e| panic!("write after bad input: {e}"));
    assert_eq!(peer.hash(SIZE / 2, SIZE / 2).expect("hash"), pattern_hash(seed, 0, SIZE / 2));
    init.transfer(
        Op::Read,
        &[init.desc(SIZE / 2, SIZE / 2)],
        name,
        &[peer.desc(SIZE / 2, SIZE / 2)],
        RequestOptions::default(),
        WAIT,
    )
    .unwrap_or_else(|e| panic!("read after bad input: {e}"));
    assert_eq!(crate::pattern::check_pattern(&init.buf, SIZE / 2, seed, 0, SIZE / 2), Ok(()));
}

/// A writer that stops mid-payload and keeps the connection open pins the region only until
/// the target's no-progress timeout: deregistration completes within the bound.
fn stalled_writer(addr: &str, name: &str, key: &TcpRemoteKey, peer: &mut Peer) {
    let mut frame_head = Vec::new();
    frame::encode_request(Kind::Write, 9, &[desc(key, 0, 1000)], 1000, &mut frame_head);
    let mut raw = Raw::accepted(addr, name);
    raw.send(&frame_head);
    raw.send(&[1u8; 500]);
    within("deregistration while a writer stalls", FAILURE_BOUND, || peer.dereg()).expect("dereg");
    raw.expect_closed("payload stalled halfway");
}
