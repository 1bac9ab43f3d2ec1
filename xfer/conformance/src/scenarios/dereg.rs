//! Deregistration racing transfers, on either side: no crash, every request either completes
//! with correct data or fails with a deregistration error, and nothing succeeds afterwards.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xfer::{Op, RefusalCode, RequestOptions, Side, XferError};

use super::{drop_within, spawn_peer, within, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{check_pattern, pattern_hash, write_pattern};
use crate::peer::Peer;

const PIECE: u64 = 2 << 20;
/// How long a racing thread may go on before it must have seen the deregistration.
const RACE_LIMIT: Duration = Duration::from_secs(60);
/// How long a provider that dropped a connection may take to carry messages again.
const RECONNECT: Duration = Duration::from_secs(5);

/// Waits (bounded) until `counter` reaches `n`.
fn await_count(counter: &AtomicUsize, n: usize, what: &str) {
    let started = Instant::now();
    while counter.load(Ordering::SeqCst) < n {
        assert!(started.elapsed() < RACE_LIMIT, "{what}: only {} transfers completed", counter.load(Ordering::SeqCst));
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The initiator drops its registration while two threads use it: one reposting a request
/// made before the drop (WRITE), one making a new request each time (READ).
pub fn dereg_initiator_races_transfers(backend: &str, params: &str) {
    let init = Initiator::new("dereg-local-init", backend, params, 2 * PIECE);
    let peer = spawn_peer("dereg-local-peer", backend, params, 3 * PIECE);
    let name = init.connect(&peer);
    let read_seed = 0x0dd;
    let peer = Arc::new(Mutex::new(peer));
    peer.lock().expect("peer").fill(read_seed, 2 * PIECE, PIECE).expect("fill");
    let completed = Arc::new(AtomicUsize::new(0));

    let writer: JoinHandle<Vec<XferError>> = {
        let (agent, buf, peer, name, completed) =
            (init.agent.clone(), Arc::clone(&init.buf), Arc::clone(&peer), name.clone(), Arc::clone(&completed));
        let (local, remote) = (init.desc(0, PIECE), peer.lock().expect("peer").desc(0, PIECE));
        std::thread::spawn(move || {
            let req = agent.create_request(Op::Write, &[local], &name, &[remote], RequestOptions::default());
            let req = req.expect("create before the drop");
            let started = Instant::now();
            let mut errors = Vec::new();
            for seed in 1u64.. {
                assert!(started.elapsed() < RACE_LIMIT, "the deregistration never reached the writer");
                write_pattern(&buf, 0, seed, 0, PIECE);
                match req.post().and_then(|()| req.wait(WAIT)) {
                    Ok(()) => {
                        let got = peer.lock().expect("peer").hash(0, PIECE).expect("hash");
                        assert_eq!(got, pattern_hash(seed, 0, PIECE), "write {seed} completed with wrong bytes");
                        completed.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(err) => errors.push(err),
                }
                if errors.len() == 3 {
                    break;
                }
            }
            errors
        })
    };
    let reader: JoinHandle<Vec<XferError>> = {
        let (agent, buf, name, completed) =
            (init.agent.clone(), Arc::clone(&init.buf), name.clone(), Arc::clone(&completed));
        let (local, remote) = (init.desc(PIECE, PIECE), peer.lock().expect("peer").desc(2 * PIECE, PIECE));
        std::thread::spawn(move || {
            let started = Instant::now();
            let mut errors = Vec::new();
            for round in 0u64.. {
                assert!(started.elapsed() < RACE_LIMIT, "the deregistration never reached the reader");
                write_pattern(&buf, PIECE, round, 0, PIECE);
                let result = agent
                    .create_request(Op::Read, &[local], &name, &[remote], RequestOptions::default())
                    .and_then(|req| req.post().and_then(|()| req.wait(WAIT)));
                match result {
                    Ok(()) => {
                        let check = check_pattern(&buf, PIECE, read_seed, 0, PIECE);
                        assert_eq!(check, Ok(()), "read {round} completed with wrong bytes");
                        completed.fetch_add(1, Ordering::SeqCst);
                    }
                    Err(err) => errors.push(err),
                }
                if errors.len() == 3 {
                    break;
                }
            }
            errors
        })
    };

    await_count(&completed, 4, "before the local deregistration");
    let mut init = init;
    let reg = init.reg.take().expect("registered");
    drop_within("local deregistration under load", FAILURE_BOUND, reg);

    for (what, thread) in [("writer", writer), ("reader", reader)] {
        for err in thread.join().unwrap_or_else(|_| panic!("the {what} thread panicked")) {
            let allowed = matches!(err, XferError::Deregistered | XferError::NotRegistered { side: Side::Local, .. });
            assert!(allowed, "{what} failed with {err:?}, not a deregistration error");
        }
    }
    let after =
        init.agent.create_request(Op::Write, &[init.desc(0, 1)], &name, &[init.desc(0, 1)], RequestOptions::default());
    // The remote descriptor here is never looked at: the local one fails first.
    assert!(matches!(after, Err(XferError::NotRegistered { side: Side::Local, .. })), "{after:?}");

    // Registering the same memory again works as new.
    init.reg = Some(init.agent.register_buffer(&init.buf).expect("register again"));
    let mut peer = peer.lock().expect("peer");
    write_pattern(&init.buf, 0, 99, 0, PIECE);
    init.transfer(Op::Write, &[init.desc(0, PIECE)], &name, &[peer.desc(0, PIECE)], RequestOptions::default(), WAIT)
        .expect("write after registering again");
    assert_eq!(peer.hash(0, PIECE).expect("hash"), pattern_hash(99, 0, PIECE));
}

/// One request's outcome while the target deregisters.
fn refused_by_target(err: &XferError) -> bool {
    matches!(err, XferError::Deregistered | XferError::Refused { code: RefusalCode::UnknownKey, .. })
}

/// The peer drops its registration while the initiator keeps writing and reading it.
pub fn dereg_target_races_transfers(backend: &str, params: &str) {
    target_races(backend, params, refused_by_target, false);
}

/// The same for a backend whose target answers a stale key by dropping the connection (the
/// libfabric `tcp;ofi_rxm` provider): the initiator sees that as `PeerDisconnected`, which
/// stands for the refusal here; everything else holds as above (no crash, typed failures,
/// completed bytes right, the peer alive and reachable, its fresh metadata empty).
pub fn dereg_target_races_transfers_disconnecting(backend: &str, params: &str) {
    target_races(
        backend,
        params,
        |err| refused_by_target(err) || matches!(err, XferError::PeerDisconnected { .. }),
        true,
    );
}

const WRITE_SEED: u64 = 0x5eed;
const READ_SEED: u64 = 0xbead;

/// `disconnects`: the target refuses by dropping the connection, so messages sent right after a
/// refusal may still meet the broken connection, until the provider connects anew (bounded).
fn target_races(backend: &str, params: &str, refused: fn(&XferError) -> bool, disconnects: bool) {
    let init = Initiator::new("dereg-remote-init", backend, params, 2 * PIECE);
    let mut peer = spawn_peer("dereg-remote-peer", backend, params, 2 * PIECE);
    let name = init.connect(&peer);
    // Every write carries the same bytes, so whatever completed (or half-landed) leaves them.
    write_pattern(&init.buf, 0, WRITE_SEED, 0, PIECE);
    peer.fill(READ_SEED, PIECE, PIECE).expect("fill");
    let (completed, writes) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let threads: Vec<JoinHandle<Vec<XferError>>> = [(Op::Write, 0), (Op::Read, PIECE)]
        .into_iter()
        .map(|(op, off)| {
            let (agent, buf, name, completed, writes) =
                (init.agent.clone(), Arc::clone(&init.buf), name.clone(), Arc::clone(&completed), Arc::clone(&writes));
            let (local, remote) = (init.desc(off, PIECE), peer.desc(off, PIECE));
            std::thread::spawn(move || {
                let req = agent.create_request(op, &[local], &name, &[remote], RequestOptions::default());
                let req = req.expect("create");
                let started = Instant::now();
                let mut errors = Vec::new();
                while errors.len() < 3 {
                    assert!(started.elapsed() < RACE_LIMIT, "{op}: the peer's deregistration never showed");
                    if op == Op::Read {
                        write_pattern(&buf, PIECE, 0, 0, PIECE);
                    }
                    match req.post().and_then(|()| req.wait(WAIT)) {
                        Ok(()) if errors.is_empty() => {
                            if op == Op::Read {
                                let check = check_pattern(&buf, PIECE, READ_SEED, 0, PIECE);
                                assert_eq!(check, Ok(()), "a read completed with wrong bytes");
                            } else {
                                writes.fetch_add(1, Ordering::SeqCst);
                            }
                            completed.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok(()) => panic!("{op} succeeded after the target refused it: {errors:?}"),
                        Err(err) => errors.push(err),
                    }
                }
                errors
            })
        })
        .collect();

    await_count(&completed, 4, "before the peer's deregistration");
    within("the peer's deregistration under load", FAILURE_BOUND, || peer.dereg()).expect("dereg");
    for thread in threads {
        for err in thread.join().expect("a racing thread panicked") {
            assert!(refused(&err), "failed with {err:?}, not a refusal of deregistered memory");
        }
    }
    if writes.load(Ordering::SeqCst) > 0 {
        let got = peer.hash(0, PIECE).expect("hash");
        assert_eq!(got, pattern_hash(WRITE_SEED, 0, PIECE), "the bytes of the completed writes");
    }
    after_target_dereg(&init, &mut peer, &name, refused, disconnects);
}

/// The peer lives on without its registration: stale keys are refused as unknown, fresh
/// metadata has no region, notifications still flow.
fn after_target_dereg(
    init: &Initiator,
    peer: &mut Peer,
    name: &str,
    refused: fn(&XferError) -> bool,
    disconnects: bool,
) {
    assert!(peer.is_alive(), "the peer died deregistering under load");
    peer.hash(0, 64).expect("the peer still answers");
    let stale =
        init.transfer(Op::Read, &[init.desc(0, 64)], name, &[peer.desc(0, 64)], RequestOptions::default(), WAIT);
    assert!(
        stale.as_ref().err().is_some_and(|e| !matches!(e, XferError::Deregistered) && refused(e)),
        "stale key after deregistration: {stale:?}"
    );
    // A provider that dropped the connection needs a moment to notice and connect anew.
    let started = Instant::now();
    let mut sent = init.agent.send_notif(name, b"still-here");
    while disconnects && matches!(sent, Err(XferError::PeerDisconnected { .. })) && started.elapsed() < RECONNECT {
        std::thread::sleep(Duration::from_millis(100));
        sent = init.agent.send_notif(name, b"still-here");
    }
    sent.expect("notification after deregistration");
    assert_eq!(peer.collect_notifs(1, Duration::from_secs(10)).expect("notifs"), vec!["still-here".to_string()]);
    init.connect(peer);
    assert!(init.agent.remote_regions(name).expect("regions").is_empty(), "deregistered memory is still published");
    let fresh =
        init.agent.create_request(Op::Read, &[init.desc(0, 64)], name, &[peer.desc(0, 64)], RequestOptions::default());
    assert!(matches!(fresh, Err(XferError::NotRegistered { side: Side::Remote, .. })), "{fresh:?}");
}
