//! The conformance suite against the UCX backend, twice: over UCX's TCP transport on loopback,
//! and over its shared-memory transports. The UCX settings travel as backend parameters, so the
//! peer process gets the same ones through `--params` (environment variables would be
//! process-wide, and the tests run in threads).
//!
//! Not run here: `bad_frames` (TCP's wire format) and `dereg_target_races_transfers`: over TCP
//! and shared memory UCX emulates put and get inside its own progress and never checks the
//! address against a registration, so the target cannot refuse a stale key (InfiniBand/RoCE
//! adapters do); see the crate docs of `xfer-ucx`. Grants (`grants`, `grant_writes`,
//! `late_read_storm`) do run: the holder refuses a revoked grant before posting, and revoke
//! waits for the holder's acknowledgement (the crate's revocation exchange).
//!
//! `ci/test.sh` runs this suite once more with the newest UCX release (PyPI's libucx-cu13,
//! `ci/ucx-latest.sh`) loaded in place of Debian's 1.13.
//!
//! Over shared memory UCX 1.13's posix transport cannot detect a failed peer: requests to a
//! killed or frozen peer end by `timeout_ms` (about 7 s, within the bound), and UCX never
//! completes the operations it had queued to it; the backend lets their memory go once the
//! peer process has exited (`shm_killed_peer_lets_go_of_memory` below), and a frozen peer's
//! complete when it resumes. `sigkill_mid_transfer` and `sigstop_mid_transfer` stay out over
//! shared memory all the same: in about one run in four of the SIGKILL scenario, requests to
//! the live peer stop completing from the moment of the kill (most likely a slot of the
//! initiator's receive FIFO that the dying peer had claimed but never published, which UCX,
//! reading the FIFO in order, waits behind for good), and its "live peer keeps working" check
//! fails; a SIGSTOP mid-transfer can do the same until SIGCONT.

#![cfg(feature = "ucx")]

const TCP: &str = "tls=tcp,net_devices=lo";
const SHM: &str = "tls=posix+cma+self";

mod over_tcp {
    xfer_conformance::conformance_tests!(
        "ucx",
        super::TCP,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            requests_in_flight,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            grants,
            grant_writes,
            late_read_storm,
            // Killed or frozen peers: only over transports that detect failed peers.
            make_connection_ahead,
            sigkill_mid_transfer,
            sigstop_mid_transfer,
            stalled_peer_times_out,
        ]
    );
}

mod over_shm {
    xfer_conformance::conformance_tests!(
        "ucx",
        super::SHM,
        [
            peer_protocol,
            transfer_matrix,
            transfer_large,
            requests_in_flight,
            notifications,
            api_errors,
            bad_remote_key,
            notif_once_across_stall,
            dereg_initiator_races_transfers,
            grants,
            grant_writes,
            late_read_storm,
            // Frozen while idle: the receive-FIFO stall described above cannot happen. UCX 1.22
            // writes into a frozen peer through cma (1.13 times out).
            stalled_peer_bounded,
        ]
    );
}

/// Over shared memory, a peer killed mid-transfer: requests to it fail within the bound, and
/// although UCX never completes the operations it had queued to the dead peer, the backend lets
/// their memory go once the process is gone, so deregistering the initiator's memory returns
/// (it used to wait until the backend shut down).
#[test]
fn shm_killed_peer_lets_go_of_memory() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use xfer::{Op, RequestOptions, XferError};
    use xfer_conformance::scenarios::{drop_within, spawn_peer, Initiator, FAILURE_BOUND};

    const BIG: u64 = 64 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    let mut init = Initiator::new("shm-kill-init", "ucx", SHM, 2 * BIG);
    let mut victim = spawn_peer("shm-kill-victim", "ucx", SHM, 2 * BIG);
    let name = init.connect(&victim);
    let completed = Arc::new(AtomicUsize::new(0));
    let streams: Vec<_> = [(Op::Write, 0), (Op::Read, BIG)]
        .into_iter()
        .map(|(op, off)| {
            let req = init
                .agent
                .create_request(op, &[init.desc(off, BIG)], &name, &[victim.desc(off, BIG)], RequestOptions::default())
                .expect("create");
            let completed = Arc::clone(&completed);
            std::thread::spawn(move || loop {
                let posted = Instant::now();
                match req.post().and_then(|()| req.wait(Duration::from_secs(30))) {
                    Ok(()) => _ = completed.fetch_add(1, Ordering::SeqCst),
                    Err(err) => return (op, posted, Instant::now(), err),
                }
            })
        })
        .collect();
    let started = Instant::now();
    while completed.load(Ordering::SeqCst) < 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "no transfer to the victim completed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let struck_at = Instant::now();
    victim.kill();
    let mut in_flight = 0;
    for stream in streams {
        let (op, posted, ended, err) = stream.join().expect("stream thread");
        let since = ended.saturating_duration_since(struck_at);
        eprintln!("{op} to the killed peer failed {since:?} after the kill: {err}");
        assert!(
            match err {
                XferError::PeerDisconnected { .. } => true,
                // The backend's own no-progress timeout, not our wait expiring.
                XferError::TimedOut(after) => after < Duration::from_secs(30),
                _ => false,
            },
            "{op}: {err:?}"
        );
        assert!(since < FAILURE_BOUND, "{op} failed {since:?} after the kill");
        in_flight += usize::from(posted < struck_at);
    }
    assert!(in_flight >= 1, "the kill hit no request in flight");
    // Failure, then the release grace (2 s), then the next check for exited peers.
    drop_within("deregistration after the peer was killed", Duration::from_secs(10), init.reg.take());
    // Not checked: that the initiator then works with another shared-memory peer. After a
    // kill mid-message it sometimes cannot (see the file's docs).
}

/// An agent with ucx and TCP attached picks ucx for a peer that has both, TCP for a
/// TCP-only peer.
#[test]
fn picks_by_capability_and_falls_back_to_tcp() {
    xfer_conformance::scenarios::picks_by_capability_and_falls_back_to_tcp("ucx", TCP);
}

/// Peers whose UCX TCP segments do not fit each other (a TX segment larger than the other
/// side's RX segment, which UCX itself never checks) never talk UCX: the connection is refused
/// (logged with the reason), so a request between them has no backend — or goes over TCP when
/// both have it; equal settings use UCX.
#[test]
fn tcp_segments_that_do_not_fit_are_refused() {
    use std::time::Duration;
    use xfer::{Agent, BackendParams, HostBuffer, Op, RequestOptions, XferError};
    let agent = |name: &str, backends: &[(&str, String)]| {
        let agent = Agent::new(name).expect("agent");
        for (backend, params) in backends {
            agent.add_backend(backend, BackendParams::parse(params).expect("params")).expect("attach");
        }
        let buf = std::sync::Arc::new(HostBuffer::new(4096));
        let reg = agent.register_buffer(&buf).expect("register");
        (agent, buf, reg)
    };
    let ucx = |seg: u32| ("ucx", format!("{TCP},tcp_seg_size={seg}"));
    let tcp = ("tcp", "listen=127.0.0.1:0".to_string());
    let (big, big_buf, _r1) = agent("seg-big", &[ucx(262_144), tcp.clone()]);
    let (small, small_buf, _r2) = agent("seg-small", &[ucx(65_536)]);
    let (small_tcp, small_tcp_buf, _r3) = agent("seg-small-tcp", &[ucx(65_536), tcp.clone()]);
    let (also_big, also_big_buf, _r4) = agent("seg-also-big", &[ucx(262_144)]);
    let write = |from: &Agent, buf: &HostBuffer, to: &Agent, to_buf: &HostBuffer| {
        let name = from.load_remote_metadata(&to.local_metadata()).expect("metadata loads");
        from.create_request(Op::Write, &[buf.desc()], &name, &[to_buf.desc()], RequestOptions::default())
    };
    match write(&big, &big_buf, &small, &small_buf) {
        Err(XferError::NoBackend(_)) => {}
        Err(other) => panic!("expected no backend, got {other}"),
        Ok(req) => panic!("UCX was used across unfit segments ({})", req.backend()),
    }
    match write(&small, &small_buf, &big, &big_buf) {
        Err(XferError::NoBackend(_)) => {}
        other => panic!("the other way round: {:?}", other.map(|r| r.backend())),
    }
    let req = write(&big, &big_buf, &small_tcp, &small_tcp_buf).expect("TCP serves instead");
    assert_eq!(req.backend(), "tcp");
    let req = write(&big, &big_buf, &also_big, &also_big_buf).expect("equal segments");
    assert_eq!(req.backend(), "ucx");
    big_buf.write_at(0, &[7u8; 4096]);
    req.post().expect("post");
    req.wait(Duration::from_secs(20)).expect("write with equal segments");
    assert_eq!(also_big_buf.to_vec(), vec![7u8; 4096]);
}

/// Requests progress without anyone waiting: a waiting thread drives the worker itself, so
/// the progress thread must still move requests whose caller went on with other work (and
/// finish them), over both transports.
#[test]
fn requests_progress_while_nobody_waits() {
    use std::time::{Duration, Instant};
    use xfer::{Op, RequestOptions};
    use xfer_conformance::pattern::{check_pattern, pattern_hash, write_pattern};
    use xfer_conformance::scenarios::{spawn_peer, Initiator};

    const SIZE: u64 = 16 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    for (tag, params) in [("tcp", TCP), ("shm", SHM)] {
        let init = Initiator::new(&format!("unwaited-init-{tag}"), "ucx", params, 2 * SIZE);
        let mut peer = spawn_peer(&format!("unwaited-peer-{tag}"), "ucx", params, 2 * SIZE);
        let name = init.connect(&peer);
        write_pattern(&init.buf, 0, 3, 0, SIZE);
        peer.fill(4, SIZE, SIZE).expect("fill");
        let requests: Vec<_> = [(Op::Write, 0), (Op::Read, SIZE)]
            .into_iter()
            .map(|(op, off)| {
                let req = init
                    .agent
                    .create_request(
                        op,
                        &[init.desc(off, SIZE)],
                        &name,
                        &[peer.desc(off, SIZE)],
                        RequestOptions::default(),
                    )
                    .expect("create");
                req.post().expect("post");
                req
            })
            .collect();
        // Neither waited for nor polled: only the progress thread can finish them.
        let started = Instant::now();
        while requests.iter().any(|r| r.telemetry().is_some_and(|t| t.duration.is_none())) {
            assert!(started.elapsed() < Duration::from_secs(20), "{tag}: requests nobody waits for did not finish");
            std::thread::sleep(Duration::from_millis(10));
        }
        for req in &requests {
            req.wait(Duration::from_secs(1)).unwrap_or_else(|e| panic!("{tag} {}: {e}", req.op()));
        }
        assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(3, 0, SIZE), "{tag}: write");
        let read_back = check_pattern(&init.buf, SIZE, 4, 0, SIZE);
        assert_eq!(read_back, Ok(()), "{tag}: read");
    }
}

/// Starts a peer whose buffer UCX allocated (`xfer-peer --alloc backend`).
fn spawn_allocating_peer(name: &str, params: &str, size: u64) -> xfer_conformance::Peer {
    let config = xfer_conformance::PeerConfig::new(name, "ucx", params, size).backend_alloc();
    xfer_conformance::Peer::spawn(&xfer_conformance::peer_exe(), &config).expect("start the allocating peer")
}

/// An agent with UCX over `params` and `size` bytes allocated by it.
fn allocating_agent(name: &str, params: &str, size: usize) -> (xfer::Agent, xfer::Allocation) {
    let agent = xfer::Agent::new(name).expect("agent");
    agent.add_backend("ucx", xfer::BackendParams::parse(params).expect("params")).expect("attach ucx");
    let allocation = agent.allocate(size).expect("allocate through ucx");
    assert_eq!(allocation.buffer.backend(), "ucx");
    assert_eq!(allocation.buffer.len(), size);
    assert_eq!(allocation.registration.descs(), vec![allocation.buffer.desc()]);
    (agent, allocation)
}

/// Memory UCX allocated on both sides (`Agent::allocate`; over shared memory the peer maps it
/// and puts and gets are copies): WRITE and READ with one descriptor and with 4,096 (the
/// remote blocks in reverse order), every byte checked, over both transports.
#[test]
fn backend_allocated_memory_moves_every_byte() {
    use xfer::{Desc, Op, RequestOptions};
    use xfer_conformance::pattern::{self, check_pattern, write_pattern};
    use xfer_conformance::scenarios::WAIT;

    const SIZE: u64 = 16 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    for (tag, params) in [("tcp", TCP), ("shm", SHM)] {
        let (agent, allocation) = allocating_agent(&format!("alloc-init-{tag}"), params, SIZE as usize);
        let buf = &allocation.buffer;
        assert!(buf.to_vec().iter().all(|&b| b == 0), "{tag}: a fresh allocation is zeroed");
        let mut peer = spawn_allocating_peer(&format!("alloc-peer-{tag}"), params, SIZE);
        let name = agent.fetch_remote_metadata(peer.side_channel()).expect("fetch the peer's metadata");
        let mut seed = 10u64;
        for count in [1u64, 4096] {
            let block = SIZE / count;
            // Local block i goes to remote slot count-1-i.
            let slot = |i: u64| count - 1 - i;
            let local: Vec<Desc> = (0..count).map(|i| buf.sub_desc((i * block) as usize, block as usize)).collect();
            let remote: Vec<Desc> = (0..count).map(|i| peer.desc(slot(i) * block, block)).collect();
            let run = |op: Op| {
                let req = agent.create_request(op, &local, &name, &remote, RequestOptions::default()).expect("create");
                assert_eq!(req.backend(), "ucx");
                req.post().expect("post");
                req.wait(WAIT).unwrap_or_else(|e| panic!("{tag} {op} x{count}: {e}"));
            };

            seed += 1;
            write_pattern(buf, 0, seed, 0, SIZE);
            run(Op::Write);
            let mut expected = vec![0u8; SIZE as usize];
            for i in 0..count {
                let at = (slot(i) * block) as usize;
                pattern::fill_pattern(seed, i * block, &mut expected[at..at + block as usize]);
            }
            let got = peer.hash(0, SIZE).expect("hash");
            assert_eq!(got, pattern::hash(&expected), "{tag}: WRITE with {count} descriptors: bytes differ");

            seed += 1;
            peer.fill(seed, 0, SIZE).expect("fill");
            write_pattern(buf, 0, seed + 1000, 0, SIZE);
            run(Op::Read);
            for i in 0..count {
                let check = check_pattern(buf, i * block, seed, slot(i) * block, block);
                assert_eq!(check, Ok(()), "{tag}: READ with {count} descriptors: block {i} differs");
            }
        }
        peer.quit().expect("peer quits");
    }
}

/// A peer frees (deregisters and drops) its UCX allocation while this agent holds its key, and
/// this agent drops its own allocation while a request uses it: no crash on either side, and
/// errors, not transfers, from then on: the peer's fresh metadata no longer has the region, a
/// request made before the local deregistration fails with a deregistration error.
///
/// Not tried: a transfer with the stale key after the peer freed the memory. Over shared memory
/// it would land in the pages this process mapped (which stay mapped until the key goes, so
/// nothing crashes, but nothing refuses it either); over UCX's TCP transport the peer's UCX
/// would write to unmapped memory: UCX emulates put and get there without checking the
/// registration (see the crate docs of `xfer-ucx`).
#[test]
fn backend_allocation_freed_while_peer_holds_key() {
    use xfer::{Op, RequestOptions, Side, XferError};
    use xfer_conformance::pattern::{pattern_hash, write_pattern};
    use xfer_conformance::scenarios::{drop_within, FAILURE_BOUND, WAIT};

    const SIZE: u64 = 1 << 20;
    xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
    for (tag, params) in [("tcp", TCP), ("shm", SHM)] {
        let (agent, allocation) = allocating_agent(&format!("free-init-{tag}"), params, SIZE as usize);
        let xfer::Allocation { buffer, registration } = allocation;
        let mut peer = spawn_allocating_peer(&format!("free-peer-{tag}"), params, SIZE);
        let name = agent.fetch_remote_metadata(peer.side_channel()).expect("fetch the peer's metadata");
        let (local, remote) = (buffer.desc(), peer.desc(0, SIZE));
        write_pattern(&buffer, 0, 5, 0, SIZE);
        let req =
            agent.create_request(Op::Write, &[local], &name, &[remote], RequestOptions::default()).expect("create");
        req.post().and_then(|()| req.wait(WAIT)).unwrap_or_else(|e| panic!("{tag}: first write: {e}"));
        assert_eq!(peer.hash(0, SIZE).expect("hash"), pattern_hash(5, 0, SIZE), "{tag}: first write");

        // The peer releases its allocation; this agent still holds the key (and, over shared
        // memory, has the peer's segment mapped).
        peer.free().expect("free");
        assert!(peer.is_alive(), "{tag}: the peer died releasing its allocation");
        assert!(peer.hash(0, 1).is_err(), "{tag}: the peer still hashes freed memory");
        let again = agent.fetch_remote_metadata(peer.side_channel()).expect("fetch the peer's metadata again");
        assert_eq!(again, name);
        assert!(agent.remote_regions(&name).expect("regions").is_empty(), "{tag}: the freed region is still published");
        let stale = agent.create_request(Op::Write, &[local], &name, &[remote], RequestOptions::default());
        assert!(matches!(stale, Err(XferError::NotRegistered { side: Side::Remote, .. })), "{tag}: {stale:?}");

        // This agent's own allocation goes while a request made before holds its descriptor.
        drop_within("deregistering an allocation", FAILURE_BOUND, registration);
        let reposted = req.post().and_then(|()| req.wait(WAIT));
        assert!(
            matches!(reposted, Err(XferError::Deregistered | XferError::NotRegistered { side: Side::Local, .. })),
            "{tag}: {reposted:?}"
        );
        let fresh = agent.create_request(Op::Write, &[local], &name, &[remote], RequestOptions::default());
        assert!(matches!(fresh, Err(XferError::NotRegistered { side: Side::Local, .. })), "{tag}: {fresh:?}");
        drop(req);
        drop(buffer);
        assert!(peer.is_alive(), "{tag}: the peer died");
        assert_eq!(peer.notifs().expect("the peer still answers"), Vec::<String>::new());
        peer.quit().expect("peer quits");
    }
}

/// An allocation outlives its agent (and so its backend's shutdown): the memory stays usable
/// until the buffer drops, and is released then.
#[test]
fn backend_allocation_outlives_its_agent() {
    for params in [TCP, SHM] {
        let (agent, allocation) = allocating_agent("outlives", params, 3 << 20);
        let xfer::Allocation { buffer, registration } = allocation;
        drop(registration);
        drop(agent);
        buffer.write_at((3 << 20) - 4, &[1, 2, 3, 4]);
        let mut back = [0u8; 4];
        buffer.read_at((3 << 20) - 4, &mut back);
        assert_eq!(back, [1, 2, 3, 4]);
        drop(buffer);
    }
}

/// The bound on `revoke` when a holder is gone (its agent shut down after it loaded and used
/// the grant): the revocation cannot be acknowledged, and `revoke` returns all the same, within
/// `timeout_ms` plus 1 s, with the grant's memory unmapped. Both agents run in this process.
#[test]
fn revoke_with_a_gone_holder_returns_within_the_bound() {
    use std::time::{Duration, Instant};
    use xfer::{MemType, Op, RequestOptions};
    use xfer_conformance::pattern::{check_pattern, write_pattern};
    use xfer_conformance::scenarios::{Initiator, WAIT};

    const TIMEOUT: Duration = Duration::from_millis(1000);
    for (tag, transports) in [("tcp", TCP), ("shm", SHM)] {
        let params = format!("{transports},timeout_ms={}", TIMEOUT.as_millis());
        let target = Initiator::new(&format!("gone-target-{tag}"), "ucx", &params, 1 << 16);
        let holder_name = format!("gone-holder-{tag}");
        let holder = Initiator::new(&holder_name, "ucx", &params, 1 << 16);
        let name = holder.agent.load_remote_metadata(&target.agent.local_metadata()).expect("metadata");
        write_pattern(&target.buf, 0, 91, 0, 1 << 16);
        let granted = target.desc(4096, 8192);
        let grant =
            target.agent.grant(&holder_name, MemType::Dram, &[granted], Duration::from_secs(20)).expect("grant");
        holder.agent.load_grant(&grant.token()).expect("load grant");
        holder
            .transfer(Op::Read, &[holder.desc(0, 8192)], &name, &[granted], RequestOptions::default(), WAIT)
            .unwrap_or_else(|e| panic!("{tag}: read under the grant: {e}"));
        check_pattern(&holder.buf, 0, 91, 4096, 8192).unwrap_or_else(|at| panic!("{tag}: bytes differ at {at}"));
        drop(holder);
        let started = Instant::now();
        grant.revoke();
        let took = started.elapsed();
        eprintln!("{tag}: revoke with the holder gone took {took:?}");
        assert!(took < TIMEOUT + Duration::from_secs(3), "{tag}: revoke took {took:?}");
    }
}

/// A holder whose connection to the target is never idle (reads outside the grant, posted ahead
/// in windows from several threads, keep jobs in flight) still acknowledges a revocation once the jobs posted before it
/// are done: `revoke` returns by the acknowledgement, far within the `timeout_ms` plus 1 s bound.
/// (A holder used to wait for its connection to go idle; here the engine still found idle
/// moments, so this passes without that change too.)
#[test]
fn revoke_is_acknowledged_while_the_holder_stays_busy() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    use xfer::{MemType, Op, RequestOptions};
    use xfer_conformance::scenarios::{Initiator, WAIT};

    const TIMEOUT: Duration = Duration::from_secs(10);
    const READERS: usize = 4;
    const WINDOW: usize = 8;
    const PIECE: u64 = 64 << 10;
    for (tag, transports) in [("tcp", TCP), ("shm", SHM)] {
        let params = format!("{transports},timeout_ms={}", TIMEOUT.as_millis());
        let target = Initiator::new(&format!("busy-target-{tag}"), "ucx", &params, 1 << 20);
        let holder_name = format!("busy-holder-{tag}");
        let holder = Arc::new(Initiator::new(&holder_name, "ucx", &params, 1 << 20));
        let name = holder.agent.load_remote_metadata(&target.agent.local_metadata()).expect("metadata");
        let granted = target.desc(0, 8192);
        let grant =
            target.agent.grant(&holder_name, MemType::Dram, &[granted], Duration::from_secs(60)).expect("grant");
        holder.agent.load_grant(&grant.token()).expect("load grant");
        holder
            .transfer(Op::Read, &[holder.desc(0, 8192)], &name, &[granted], RequestOptions::default(), WAIT)
            .unwrap_or_else(|e| panic!("{tag}: read under the grant: {e}"));

        let stop = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicUsize::new(0));
        let readers: Vec<_> = (0..READERS as u64)
            .map(|i| {
                let (holder, name, stop, reads) =
                    (Arc::clone(&holder), name.clone(), Arc::clone(&stop), Arc::clone(&reads));
                let (local, remote) = (holder.desc((i + 1) * PIECE, PIECE), target.desc((i + 1) * PIECE, PIECE));
                std::thread::spawn(move || {
                    // A window of requests posted ahead, so the connection always has jobs in
                    // flight (the bytes are not checked: every read lands the same ones).
                    let mut window = std::collections::VecDeque::new();
                    let wait_oldest = |window: &mut std::collections::VecDeque<xfer::XferRequest>| {
                        let oldest = window.pop_front().expect("a request in the window");
                        oldest.wait(WAIT).unwrap_or_else(|e| panic!("read outside the grant: {e}"));
                        reads.fetch_add(1, Ordering::Relaxed);
                    };
                    while !stop.load(Ordering::Relaxed) {
                        let request = holder
                            .agent
                            .create_request(Op::Read, &[local], &name, &[remote], RequestOptions::default())
                            .expect("a read outside the grant");
                        request.post().expect("post");
                        window.push_back(request);
                        if window.len() >= WINDOW {
                            wait_oldest(&mut window);
                        }
                    }
                    while !window.is_empty() {
                        wait_oldest(&mut window);
                    }
                })
            })
            .collect();
        while reads.load(Ordering::Relaxed) < 50 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let started = Instant::now();
        grant.revoke();
        let took = started.elapsed();
        let during = reads.load(Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Relaxed);
        for reader in readers {
            reader.join().expect("reader");
        }
        let after = reads.load(Ordering::Relaxed);
        eprintln!("{tag}: revoke with {READERS} readers busy took {took:?}; reads {during} by then, {after} in all");
        assert!(after > during, "{tag}: the readers stopped moving during the test");
        assert!(
            took < Duration::from_secs(3),
            "{tag}: revoke took {took:?}, not acknowledged while the holder was busy"
        );
        let refused = holder
            .transfer(Op::Read, &[holder.desc(0, 8192)], &name, &[granted], RequestOptions::default(), WAIT)
            .expect_err("a read under the revoked grant");
        assert!(
            matches!(refused, xfer::XferError::Refused { code: xfer::RefusalCode::Revoked, .. }),
            "{tag}: {refused}"
        );
    }
}
