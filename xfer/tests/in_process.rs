//! Two agents in one process over real loopback sockets: the API end to end, fast.

use std::sync::Arc;
use std::time::Duration;

use xfer::{Agent, BackendParams, HostBuffer, MemType, Op, RequestOptions, XferError};

const WAIT: Duration = Duration::from_secs(10);

fn agent(name: &str) -> Agent {
    let agent = Agent::new(name).unwrap();
    agent.add_backend("tcp", BackendParams::new().with("listen", "127.0.0.1:0")).unwrap();
    agent
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn write_then_read_back_with_notification() {
    let (a, b) = (agent("a"), agent("b"));
    let (buf_a, buf_b) = (Arc::new(HostBuffer::new(1 << 20)), Arc::new(HostBuffer::new(1 << 20)));
    let _reg_a = a.register_buffer(&buf_a).unwrap();
    let _reg_b = b.register_buffer(&buf_b).unwrap();
    let sc = b.start_side_channel("127.0.0.1:0").unwrap();
    assert_eq!(a.fetch_remote_metadata(&sc.to_string()).unwrap(), "b");

    let data = pattern(1 << 20, 7);
    buf_a.write_at(0, &data);
    let req =
        a.create_request(Op::Write, &[buf_a.desc()], "b", &[buf_b.desc()], RequestOptions::notify(b"written")).unwrap();
    req.post().unwrap();
    req.wait(WAIT).unwrap();
    assert!(b.wait_notifs(WAIT));
    assert_eq!(b.get_notifs_from("a"), vec![b"written".to_vec()]);
    assert_eq!(buf_b.to_vec(), data);
    let telemetry = req.telemetry().unwrap();
    assert_eq!((telemetry.bytes, telemetry.descriptors, telemetry.backend), (1 << 20, 1, "tcp"));
    assert!(telemetry.duration.is_some());

    // Scattered READ of 4 KiB blocks in reverse order, through prepared lists.
    let blocks = 256;
    let local =
        a.prep_local(MemType::Dram, &(0..blocks).map(|i| buf_a.sub_desc(i * 4096, 4096)).collect::<Vec<_>>()).unwrap();
    let remote = a
        .prep_remote("b", MemType::Dram, &(0..blocks).map(|i| buf_b.sub_desc(i * 4096, 4096)).collect::<Vec<_>>())
        .unwrap();
    buf_a.write_at(0, &vec![0u8; 1 << 20]);
    let reversed: Vec<usize> = (0..blocks).rev().collect();
    let identity: Vec<usize> = (0..blocks).collect();
    let read = a.make_request(Op::Read, &local, &identity, &remote, &reversed, RequestOptions::default()).unwrap();
    read.post().unwrap();
    read.wait(WAIT).unwrap();
    let got = buf_a.to_vec();
    for i in 0..blocks {
        let j = blocks - 1 - i;
        assert_eq!(&got[i * 4096..(i + 1) * 4096], &data[j * 4096..(j + 1) * 4096], "block {i}");
    }
    // Reposting the same request works once finished.
    read.post().unwrap();
    read.wait(WAIT).unwrap();
}

#[test]
fn typed_errors() {
    let (a, b) = (agent("a2"), agent("b2"));
    let buf_a = Arc::new(HostBuffer::new(8192));
    let buf_b = Arc::new(HostBuffer::new(8192));
    let _ra = a.register_buffer(&buf_a).unwrap();
    let rb = b.register_buffer(&buf_b).unwrap();
    assert!(matches!(
        a.create_request(Op::Write, &[buf_a.desc()], "nobody", &[buf_b.desc()], Default::default()),
        Err(XferError::UnknownPeer(_))
    ));
    a.load_remote_metadata(&b.local_metadata()).unwrap();
    let outside = xfer::Desc::new(buf_b.addr() + 4096, 8192, 0);
    assert!(matches!(
        a.create_request(Op::Write, &[buf_a.desc()], "b2", &[outside], Default::default()),
        Err(XferError::NotRegistered { side: xfer::Side::Remote, .. })
    ));
    assert!(matches!(
        a.create_request(Op::Write, &[buf_a.sub_desc(0, 10)], "b2", &[buf_b.sub_desc(0, 11)], Default::default()),
        Err(XferError::LengthMismatch { local: 10, remote: 11 })
    ));
    let mut corrupt = b.local_metadata();
    let last = corrupt.len() - 1;
    corrupt[last] ^= 1;
    assert!(matches!(a.load_remote_metadata(&corrupt), Err(XferError::Metadata(_))));
    assert!(matches!(a.add_backend("warp", BackendParams::new()), Err(XferError::UnknownBackend(_))));
    assert!(matches!(
        Agent::new("x").unwrap().add_backend("tcp", BackendParams::new().with("stream", "2")),
        Err(XferError::Backend { .. })
    ));

    // The peer deregisters: the stale metadata's key is refused by the target.
    let req = a.create_request(Op::Write, &[buf_a.desc()], "b2", &[buf_b.desc()], Default::default()).unwrap();
    drop(rb);
    req.post().unwrap();
    assert!(matches!(req.wait(WAIT), Err(XferError::Refused { code: xfer::RefusalCode::UnknownKey, .. })));

    a.invalidate_remote("b2").unwrap();
    assert!(matches!(req.post().and_then(|()| req.wait(WAIT)), Err(XferError::PeerDisconnected { .. })));
    assert!(matches!(
        a.create_request(Op::Write, &[buf_a.desc()], "b2", &[buf_b.desc()], Default::default()),
        Err(XferError::UnknownPeer(_))
    ));
}

#[test]
fn standalone_notifications_keep_order() {
    let (a, b) = (agent("a3"), agent("b3"));
    a.load_remote_metadata(&b.local_metadata()).unwrap();
    for i in 0..100 {
        a.send_notif("b3", format!("n{i}").as_bytes()).unwrap();
    }
    let got = b.get_notifs_from("a3");
    let want: Vec<Vec<u8>> = (0..100).map(|i| format!("n{i}").into_bytes()).collect();
    assert_eq!(got, want);
}

#[test]
fn agent_and_requests_are_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Agent>();
    send_sync::<xfer::XferRequest>();
    send_sync::<xfer::Registration>();

    let (a, b) = (agent("a4"), agent("b4"));
    let (buf_a, buf_b) = (Arc::new(HostBuffer::new(8 << 20)), Arc::new(HostBuffer::new(8 << 20)));
    let _ra = a.register_buffer(&buf_a).unwrap();
    let _rb = b.register_buffer(&buf_b).unwrap();
    a.load_remote_metadata(&b.local_metadata()).unwrap();
    let data = pattern(8 << 20, 3);
    buf_a.write_at(0, &data);
    // Eight threads write their own MiB concurrently through the same agent.
    std::thread::scope(|scope| {
        for t in 0..8usize {
            let (a, buf_a, buf_b) = (&a, &buf_a, &buf_b);
            scope.spawn(move || {
                let local = [buf_a.sub_desc(t << 20, 1 << 20)];
                let remote = [buf_b.sub_desc(t << 20, 1 << 20)];
                let req = a.create_request(Op::Write, &local, "b4", &remote, Default::default()).unwrap();
                for _ in 0..5 {
                    req.post().unwrap();
                    req.wait(WAIT).unwrap();
                }
            });
        }
    });
    assert_eq!(buf_b.to_vec(), data);
}

#[test]
fn wait_async_resolves_on_completion() {
    use std::future::Future;
    use std::task::{Context, Poll, Wake, Waker};

    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }

    let (a, b) = (agent("a5"), agent("b5"));
    let (buf_a, buf_b) = (Arc::new(HostBuffer::new(4 << 20)), Arc::new(HostBuffer::new(4 << 20)));
    let _ra = a.register_buffer(&buf_a).unwrap();
    let _rb = b.register_buffer(&buf_b).unwrap();
    a.load_remote_metadata(&b.local_metadata()).unwrap();
    buf_b.write_at(0, &pattern(4 << 20, 9));
    let req = a.create_request(Op::Read, &[buf_a.desc()], "b5", &[buf_b.desc()], Default::default()).unwrap();
    assert!(matches!(req.poll(), Err(XferError::NotPosted)));
    req.post().unwrap();
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(req.wait_async());
    let deadline = std::time::Instant::now() + WAIT;
    let result = loop {
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(result) => break result,
            Poll::Pending => {
                assert!(std::time::Instant::now() < deadline, "wait_async never resolved");
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    };
    result.unwrap();
    assert_eq!(buf_a.to_vec(), pattern(4 << 20, 9));
}

#[test]
fn cancel_and_backend_override() {
    let (a, b) = (agent("a6"), agent("b6"));
    let (buf_a, buf_b) = (Arc::new(HostBuffer::new(64 << 20)), Arc::new(HostBuffer::new(64 << 20)));
    let _ra = a.register_buffer(&buf_a).unwrap();
    let _rb = b.register_buffer(&buf_b).unwrap();
    a.load_remote_metadata(&b.local_metadata()).unwrap();
    let err = a
        .create_request(Op::Write, &[buf_a.desc()], "b6", &[buf_b.desc()], RequestOptions::default().backend("ucx"))
        .unwrap_err();
    assert!(matches!(err, XferError::UnknownBackend(_)), "{err}");
    // A 64 MiB request cut into many chunks, cancelled at once: it ends Cancelled (or Done if
    // every chunk was already on the wire), and never hangs.
    let req = a
        .create_request(Op::Write, &[buf_a.desc()], "b6", &[buf_b.desc()], RequestOptions::default().backend("tcp"))
        .unwrap();
    req.post().unwrap();
    req.cancel();
    match req.wait(WAIT) {
        Ok(()) | Err(XferError::Cancelled) => {}
        other => panic!("unexpected {other:?}"),
    }
    assert!(matches!(
        a.create_request(Op::Write, &[xfer::Desc::new(0, 0, 0)], "b6", &[], Default::default()),
        Err(XferError::NotRegistered { .. })
    ));
}

/// A grant offered under a name: claimed by the first reader with the ranges it reads, bound
/// to it; revoking the offer refuses the claimant's next read and any later claim.
#[test]
fn offered_grants_are_claimed_then_revoked() {
    use xfer::RefusalCode;
    let (target, reader, stranger) = (agent("prefill"), agent("decode"), agent("stranger"));
    let (held, into) = (Arc::new(HostBuffer::new(64 << 10)), Arc::new(HostBuffer::new(64 << 10)));
    let _held_reg = target.register_buffer(&held).unwrap();
    let _into_reg = reader.register_buffer(&into).unwrap();
    let _stranger_reg = stranger.register_buffer(&into).unwrap();
    let side = target.start_side_channel("127.0.0.1:0").unwrap().to_string();
    reader.fetch_remote_metadata(&side).unwrap();
    stranger.fetch_remote_metadata(&side).unwrap();
    let data = pattern(64 << 10, 3);
    held.write_at(0, &data);
    let block = xfer::Desc::new(held.desc().addr + 4096, 8192, 0);
    let local = xfer::Desc::new(into.desc().addr, 8192, 0);

    let offer = target.offer_grant("req-1", Duration::from_secs(60));
    assert_eq!(reader.claim_grant(&side, "req-1", MemType::Dram, &[block]).unwrap(), "prefill");
    let read = |agent: &Agent| -> Result<(), XferError> {
        let req = agent.create_request(Op::Read, &[local], "prefill", &[block], RequestOptions::default())?;
        req.post()?;
        req.wait(WAIT)
    };
    read(&reader).unwrap();
    assert_eq!(&into.to_vec()[..8192], &data[4096..4096 + 8192]);
    let taken = stranger.claim_grant(&side, "req-1", MemType::Dram, &[block]).unwrap_err();
    assert!(matches!(taken, XferError::Refused { code: RefusalCode::WrongAgent, .. }), "{taken}");

    assert_eq!(offer.claimant().as_deref(), Some("decode"));
    assert_eq!(offer.revoke(), 1);
    into.write_at(0, &[0u8; 8192]);
    let late = read(&reader).unwrap_err();
    assert!(matches!(late, XferError::Refused { code: RefusalCode::Revoked, .. }), "{late}");
    assert_eq!(&into.to_vec()[..8192], &[0u8; 8192][..], "a refused read delivered bytes");
    let again = reader.claim_grant(&side, "req-1", MemType::Dram, &[block]).unwrap_err();
    assert!(matches!(again, XferError::Refused { code: RefusalCode::Revoked, .. }), "{again}");

    // The revoked grant stays loaded: a list prepared now still goes through it, one prepared
    // through the published region reads the same bytes with the region's key.
    let read_prepared = |remote: &xfer::PreparedRemote| -> Result<(), XferError> {
        let local = reader.prep_local(MemType::Dram, &[local])?;
        let req = reader.make_request(Op::Read, &local, &[0], remote, &[0], RequestOptions::default())?;
        req.post()?;
        req.wait(WAIT)
    };
    let through_grant = reader.prep_remote("prefill", MemType::Dram, &[block]).unwrap();
    let refused = read_prepared(&through_grant).unwrap_err();
    assert!(matches!(refused, XferError::Refused { code: RefusalCode::Revoked, .. }), "{refused}");
    let published = reader.prep_remote_published("prefill", MemType::Dram, &[block]).unwrap();
    read_prepared(&published).unwrap();
    assert_eq!(&into.to_vec()[..8192], &data[4096..4096 + 8192]);
}
