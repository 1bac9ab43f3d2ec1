//! Authenticated agents: a peer process holding the cluster credential against strangers on
//! the same machine (no credential, or a wrong one). A stranger cannot fetch the metadata,
//! PUT, INVALIDATE, open a data connection (TCP), replay a recorded side-channel exchange, or
//! get a tampered blob accepted; each attempt is a typed refusal. A member does all of it.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::time::Duration;

use xfer::credential::{fresh_nonce, ClusterCredential, ProofLabel, Transcript, AUTH_LEN};
use xfer::metadata::{AgentMetadata, MetadataError};
use xfer::side_channel::{self, encode_auth_hello, ClientAuth, SideChannelError, SideOp};
use xfer::{Agent, BackendParams, BackendRegistry, HostBuffer, Op, RequestOptions, XferError};

use super::{within, WAIT};
use crate::pattern::{pattern_hash, write_pattern};
use crate::peer::{peer_exe, Peer, PeerConfig};

const SIZE: u64 = 64 << 10;
const IO: Duration = Duration::from_secs(10);

/// A secret file under the temp dir, removed on drop.
struct SecretFile(PathBuf);

impl SecretFile {
    fn new(tag: &str, byte: u8) -> SecretFile {
        let path = std::env::temp_dir().join(format!("xfer-auth-{}-{tag}.secret", std::process::id()));
        std::fs::write(&path, [byte; 48]).expect("write the secret file");
        SecretFile(path)
    }

    fn credential(&self) -> ClusterCredential {
        ClusterCredential::from_file(&self.0).expect("load the secret")
    }
}

impl Drop for SecretFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn agent(
    name: &str,
    backend: &str,
    params: &str,
    credential: Option<ClusterCredential>,
) -> (Agent, std::sync::Arc<HostBuffer>, xfer::Registration) {
    let agent =
        Agent::with_credential(name, BackendRegistry::default(), xfer::cuda::staging(), credential).expect("agent");
    agent.add_backend(backend, BackendParams::parse(params).expect("params")).expect("attach backend");
    let buf = std::sync::Arc::new(HostBuffer::new(SIZE as usize));
    let reg = agent.register_buffer(&buf).expect("register");
    (agent, buf, reg)
}

fn spawn(name: &str, backend: &str, params: &str, secret: &Path) -> Peer {
    let exe = peer_exe();
    Peer::spawn(&exe, &PeerConfig::new(name, backend, params, SIZE).credential(secret))
        .unwrap_or_else(|e| panic!("start peer {name}: {e}"))
}

fn side_error(result: Result<impl std::fmt::Debug, XferError>, what: &str) -> SideChannelError {
    match result {
        Err(XferError::SideChannel { source, .. }) => source,
        other => panic!("{what}: expected a side-channel refusal, got {other:?}"),
    }
}

pub fn strangers_are_refused(backend: &str, params: &str) {
    let secret = SecretFile::new("good", 0x5e);
    let wrong = SecretFile::new("wrong", 0x77);
    let mut peer = spawn("auth-peer", backend, params, &secret.0);
    let addr = peer.side_channel().to_string();

    // A member fetches the signed metadata and writes through an authenticated data path.
    let (member, member_buf, _member_reg) = agent("auth-member", backend, params, Some(secret.credential()));
    assert_eq!(member.fetch_remote_metadata(&addr).expect("member fetches metadata"), "auth-peer");
    write_pattern(&member_buf, 0, 0xa11, 0, SIZE);
    let local = [xfer::Desc::new(member_buf.addr(), SIZE, 0)];
    let remote = [xfer::Desc::new(peer.buf_addr(), SIZE, 0)];
    let req =
        member.create_request(Op::Write, &local, "auth-peer", &remote, RequestOptions::default()).expect("request");
    req.post().expect("post");
    within("member write", WAIT, || req.wait(WAIT)).expect("member write completes");
    assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(0xa11, 0, SIZE), "member's bytes arrived");
    member.send_local_metadata(&addr).expect("member PUTs its own metadata");

    // Strangers: no credential, and the wrong one.
    let (nobody, _b1, _r1) = agent("auth-nobody", backend, params, None);
    let (impostor, _b2, _r2) = agent("auth-impostor", backend, params, Some(wrong.credential()));
    for (who, stranger) in [("no credential", &nobody), ("wrong credential", &impostor)] {
        let fetch = side_error(stranger.fetch_remote_metadata(&addr), who);
        let put = side_error(stranger.send_local_metadata(&addr), who);
        let invalidate = side_error(stranger.invalidate_local_metadata(&addr), who);
        for (op, err) in [("fetch", fetch), ("put", put), ("invalidate", invalidate)] {
            // Without a credential the peer refuses us; with a wrong one we refuse the peer's
            // proof before sending anything.
            assert!(
                matches!(err, SideChannelError::Unauthenticated(_) | SideChannelError::ServerUnauthenticated),
                "{who} {op}: {err:?}"
            );
        }
    }
    // The raw unauthenticated GET any old client sends gets no keys.
    let raw = side_channel::call(&addr, SideOp::Get, &[], IO);
    assert!(matches!(raw, Err(SideChannelError::Unauthenticated(_))), "plain GET: {raw:?}");

    // A member may PUT and INVALIDATE only under its own name.
    let auth = ClientAuth { credential: &secret.credential(), name: "auth-member" };
    let blob = side_channel::call_as(&addr, SideOp::Get, &[], IO, Some(auth)).expect("member GET");
    let other_blob = {
        let (other, _b, _r) = agent("auth-other", backend, params, Some(secret.credential()));
        other.local_metadata()
    };
    let put_other = side_channel::call_as(&addr, SideOp::Put, &other_blob, IO, Some(auth));
    assert!(matches!(&put_other, Err(SideChannelError::Refused(t)) if t.contains("may not put")), "{put_other:?}");
    let inv_other = side_channel::call_as(&addr, SideOp::Invalidate, b"auth-other", IO, Some(auth));
    assert!(
        matches!(&inv_other, Err(SideChannelError::Refused(t)) if t.contains("may not invalidate")),
        "{inv_other:?}"
    );

    // A tampered blob: refused on load here, and refused by the peer on PUT.
    // Changed contents with a valid checksum under the original signature (a flipped byte
    // alone is already caught by the checksum).
    let signed = member.local_metadata();
    let mut contents = AgentMetadata::decode_for(&signed, Some(&secret.credential())).expect("own blob");
    contents.regions[0].desc.len += 4096;
    let mut tampered = signed[..4 + AUTH_LEN].to_vec();
    tampered.extend_from_slice(&contents.encode());
    let put_tampered = side_channel::call_as(&addr, SideOp::Put, &tampered, IO, Some(auth));
    assert!(matches!(&put_tampered, Err(SideChannelError::Refused(t)) if t.contains("signature")), "{put_tampered:?}");
    let mut served = AgentMetadata::decode_for(&blob, Some(&secret.credential())).expect("peer's blob");
    served.regions[0].desc.len += 4096;
    let mut fetched_tampered = blob[..4 + AUTH_LEN].to_vec();
    fetched_tampered.extend_from_slice(&served.encode());
    let load = member.load_remote_metadata(&fetched_tampered);
    assert!(matches!(load, Err(XferError::Metadata(MetadataError::BadSignature))), "{load:?}");
    assert!(matches!(
        nobody.load_remote_metadata(&blob),
        Err(XferError::Metadata(MetadataError::SignedWithoutCredential))
    ));

    replay_is_refused(&addr, &secret.credential());
    if backend == "tcp" {
        data_connection_refused(&blob, &secret.credential(), &wrong.credential());
    }
    if matches!(backend, "tcp" | "quic") {
        stranger_backend_refused(backend, params, &blob, &secret.credential(), &wrong.credential());
    }
    // Mixed: a member against a peer without a credential fails clearly on both paths.
    let mut plain = super::spawn_peer("auth-plain", backend, params, SIZE);
    let mixed = side_error(member.fetch_remote_metadata(plain.side_channel()), "mixed");
    assert!(matches!(&mixed, SideChannelError::Unauthenticated(t) if t.contains("no cluster credential")), "{mixed:?}");
    let plain_blob = side_channel::call(plain.side_channel(), SideOp::Get, &[], IO).expect("plain GET");
    let unsigned = member.load_remote_metadata(&plain_blob);
    assert!(matches!(unsigned, Err(XferError::Metadata(MetadataError::Unsigned))), "{unsigned:?}");
    if backend == "tcp" {
        // An initiator announcing the credential to a target without one: code 8, no challenge.
        let md = AgentMetadata::decode(&plain_blob).expect("plain metadata");
        let info = md.backends.iter().find(|b| b.name == "tcp").expect("tcp backend");
        let sock = String::from_utf8(info.conn_info.clone()).expect("address");
        let sock = sock.to_socket_addrs().expect("resolve").next().expect("address");
        let mut stream = TcpStream::connect_timeout(&sock, IO).expect("connect data port");
        stream.set_read_timeout(Some(IO)).expect("timeout");
        let mut hello = Vec::new();
        xfer_tcp::frame::encode_hello_with("auth-member", &md.name, Default::default(), true, &mut hello);
        stream.write_all(&hello).expect("hello");
        let mut reply = [0u8; xfer_tcp::frame::HELLO_REPLY_LEN];
        stream.read_exact(&mut reply).expect("reply");
        let (code, _) = xfer_tcp::frame::decode_hello_reply(&reply).expect("decode reply");
        assert_eq!(xfer::RefusalCode::from_wire(code), xfer::RefusalCode::Unauthenticated);
    }
    assert!(plain.hash(0, 8).is_ok(), "the plain peer is unharmed");
    let _ = plain.quit();

    // The peer still serves members after all of that.
    assert_eq!(member.fetch_remote_metadata(&addr).expect("member fetches again"), "auth-peer");
    let _ = peer.quit();
}

/// Records the bytes a good client sends (hello, proof, GET) and resends them on a new
/// connection: the server's nonce is fresh, so the recorded proof fails.
fn replay_is_refused(addr: &str, credential: &ClusterCredential) {
    let connect = || {
        let sock = addr.to_socket_addrs().expect("resolve").next().expect("address");
        let stream = TcpStream::connect_timeout(&sock, IO).expect("connect side channel");
        stream.set_read_timeout(Some(IO)).and_then(|()| stream.set_write_timeout(Some(IO))).expect("timeouts");
        stream
    };
    let mut recorded = Vec::new();
    let mut good = connect();
    let client_nonce = fresh_nonce().expect("nonce");
    let hello = encode_auth_hello(&client_nonce, "auth-recorder");
    good.write_all(&hello).expect("hello");
    recorded.extend_from_slice(&hello);
    let mut status = [0u8; 1 + AUTH_LEN + 1];
    good.read_exact(&mut status).expect("challenge");
    assert_eq!(status[0], 0, "challenge status");
    let server_nonce: [u8; AUTH_LEN] = status[1..1 + AUTH_LEN].try_into().expect("nonce");
    let mut rest = vec![0u8; usize::from(status[1 + AUTH_LEN]) + AUTH_LEN];
    good.read_exact(&mut rest).expect("server name and proof");
    let server_name = std::str::from_utf8(&rest[..rest.len() - AUTH_LEN]).expect("server name").to_string();
    let transcript = Transcript {
        client_nonce: &client_nonce,
        server_nonce: &server_nonce,
        client_name: "auth-recorder",
        server_name: &server_name,
    };
    assert!(credential.verify(ProofLabel::SideChannelServer, &transcript, &rest[rest.len() - AUTH_LEN..]));
    let mut tail = credential.prove(ProofLabel::SideChannelClient, &transcript).to_vec();
    tail.extend_from_slice(b"XFSC\x01\0\0\0\0");
    good.write_all(&tail).expect("proof and GET");
    recorded.extend_from_slice(&tail);
    let mut ok = [0u8; 5];
    good.read_exact(&mut ok).expect("response");
    assert_eq!(ok[0], 0, "the recorded exchange itself succeeds");

    let mut replay = connect();
    replay.write_all(&recorded).expect("replay");
    let mut answer = Vec::new();
    let _ = replay.read_to_end(&mut answer);
    // A challenge (fresh nonce) then the refusal: status 2, "did not prove".
    assert_eq!(answer.first(), Some(&0), "challenge first: {answer:?}");
    let refusal = &answer[1 + AUTH_LEN + 1 + server_name.len() + AUTH_LEN..];
    assert_eq!(refusal.first(), Some(&2), "unauthenticated status after the replayed proof");
    assert!(String::from_utf8_lossy(&refusal[5..]).contains("did not prove"), "{:?}", String::from_utf8_lossy(refusal));
}

/// A stranger's own backend (no credential, or a wrong one) that knows the peer's connection
/// info cannot open a data connection: its first use is refused `Unauthenticated` at hello,
/// whatever the wire (for backends that authenticate their data connections).
fn stranger_backend_refused(
    backend: &str,
    params: &str,
    blob: &[u8],
    good: &ClusterCredential,
    wrong: &ClusterCredential,
) {
    let md = AgentMetadata::decode_for(blob, Some(good)).expect("decode signed metadata");
    let info = md.backends.iter().find(|b| b.name == backend).expect("the backend's connection info");
    let registry = BackendRegistry::default();
    let factory = registry.get(backend).expect("backend registered");
    for (who, credential) in [("no credential", None), ("wrong credential", Some(wrong.clone()))] {
        let ctx = xfer::BackendContext {
            agent_name: "auth-stranger".into(),
            params: BackendParams::parse(params).expect("params"),
            notifs: std::sync::Arc::new(|_: &str, _: Vec<u8>| {}),
            staging: xfer::cuda::staging(),
            credential: credential.map(std::sync::Arc::new),
        };
        let stranger = factory.create(ctx).expect("stranger's backend");
        let remote = stranger.connect(&md.name, &info.conn_info).expect("connect (lazy)");
        let sent = within("stranger's notification", WAIT, || remote.notify(b"from a stranger"));
        assert!(
            matches!(sent, Err(xfer::BackendError::Refused { code: xfer::RefusalCode::Unauthenticated, .. })),
            "{who}: {sent:?}"
        );
        remote.disconnect();
        stranger.shutdown();
    }
}

/// Hellos without the credential flag, and with it but a proof from the wrong secret, are both
/// refused `Unauthenticated` (code 8) before any request is read.
fn data_connection_refused(blob: &[u8], good: &ClusterCredential, wrong: &ClusterCredential) {
    use xfer_tcp::frame;
    let md = AgentMetadata::decode_for(blob, Some(good)).expect("decode signed metadata");
    let info = md.backends.iter().find(|b| b.name == "tcp").expect("tcp backend");
    let addr = String::from_utf8(info.conn_info.clone()).expect("tcp address");
    let sock = addr.to_socket_addrs().expect("resolve").next().expect("address");
    for with_flag in [false, true] {
        let mut stream = TcpStream::connect_timeout(&sock, IO).expect("connect data port");
        stream.set_read_timeout(Some(IO)).expect("timeout");
        let session = frame::Session { id: 42, epoch: 1 };
        let mut hello = Vec::new();
        frame::encode_hello_with("auth-stranger", &md.name, session, with_flag, &mut hello);
        stream.write_all(&hello).expect("hello");
        let mut reply = [0u8; frame::HELLO_REPLY_LEN];
        stream.read_exact(&mut reply).expect("reply");
        if with_flag {
            assert_eq!(reply[0], frame::CHALLENGE_STATUS, "challenge");
            let mut nonce = [0u8; AUTH_LEN];
            stream.read_exact(&mut nonce).expect("nonce");
            let transcript = Transcript {
                client_nonce: &frame::session_nonce(session),
                server_nonce: &nonce,
                client_name: "auth-stranger",
                server_name: &md.name,
            };
            stream.write_all(&wrong.prove(ProofLabel::DataInitiator, &transcript)).expect("proof");
            stream.read_exact(&mut reply).expect("final reply");
        }
        let (code, _) = frame::decode_hello_reply(&reply).expect("decode reply");
        assert_eq!(xfer::RefusalCode::from_wire(code), xfer::RefusalCode::Unauthenticated, "flag {with_flag}");
    }
}
