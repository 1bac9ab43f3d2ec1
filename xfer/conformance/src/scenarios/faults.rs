//! A peer that dies (SIGKILL) or freezes (SIGSTOP) in the middle of large transfers: every
//! request to it ends with `PeerDisconnected` or the backend's `TimedOut` within a bound, and
//! another peer served by the same agent keeps working throughout.

use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use xfer::{Agent, Desc, HostBuffer, Op, RequestOptions, XferError};

use super::{spawn_peer, within, Initiator, FAILURE_BOUND, WAIT};
use crate::pattern::{check_pattern, pattern_hash, write_pattern};
use crate::peer::Peer;

const BIG: u64 = 64 << 20;
const LIVE: u64 = 1 << 20;
/// Longer than the bound asserted on failures, so a request that hangs shows up as our own
/// wait expiring.
pub(super) const HANG: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// SIGKILL: connections reset, the port refuses.
    Kill,
    /// SIGSTOP: connections stay open and silent; only the backend's timeout ends a request.
    Stop,
}

/// What one stream of requests to the victim saw.
#[derive(Debug)]
struct Outcome {
    op: Op,
    completed: usize,
    /// The first failure: when it was posted, when it ended, the error.
    failure: Option<(Instant, Instant, XferError)>,
    /// Requests posted after that failure: how long each took and how it ended.
    after: Vec<(Duration, Result<(), XferError>)>,
}

struct Stream {
    agent: Agent,
    op: Op,
    local: Desc,
    peer: String,
    remote: Desc,
    completed: Arc<AtomicUsize>,
    after: usize,
}

impl Stream {
    /// Posts requests back to back (reposting one request) until one fails, then `after`
    /// fresh ones, which must fail as well.
    fn run(self) -> Outcome {
        let Stream { agent, op, local, peer, remote, completed, after } = self;
        let create = || agent.create_request(op, &[local], &peer, &[remote], RequestOptions::default());
        let req = create().expect("create");
        let mut outcome = Outcome { op, completed: 0, failure: None, after: Vec::new() };
        let deadline = Instant::now() + HANG;
        while Instant::now() < deadline {
            let posted = Instant::now();
            match req.post().and_then(|()| req.wait(HANG)) {
                Ok(()) => {
                    outcome.completed += 1;
                    completed.fetch_add(1, Ordering::SeqCst);
                }
                Err(err) => {
                    outcome.failure = Some((posted, Instant::now(), err));
                    break;
                }
            }
        }
        // After a hang there is nothing more to learn, only more time to lose.
        let hung = outcome.failure.as_ref().is_some_and(|(_, _, err)| !is_disconnect(err));
        for _ in 0..if hung { 0 } else { after } {
            let started = Instant::now();
            let result = create().and_then(|req| req.post().and_then(|()| req.wait(HANG)));
            outcome.after.push((started.elapsed(), result));
        }
        outcome
    }
}

pub(super) fn is_disconnect(err: &XferError) -> bool {
    match err {
        XferError::PeerDisconnected { .. } => true,
        // The backend's own no-progress timeout, not our wait expiring.
        XferError::TimedOut(after) => *after < HANG,
        _ => false,
    }
}

/// Sends a signal by name with `kill(1)` (this crate has no `unsafe` for `libc::kill`).
pub(super) fn signal(peer: &Peer, name: &str) {
    let status = Command::new("kill").args([&format!("-{name}"), &peer.pid().to_string()]).status();
    assert!(status.as_ref().is_ok_and(|s| s.success()), "kill -{name} {}: {status:?}", peer.pid());
    if name == "STOP" {
        wait_all_threads_stopped(peer.pid());
    }
}

/// A stop signal reaches a busy process's threads asynchronously; on a loaded machine one may
/// still answer a request right after `kill` returns. Wait until /proc shows every thread
/// stopped (bounded), so the scenarios test a peer that is really frozen.
fn wait_all_threads_stopped(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(5);
    let stopped = |state: &str| state.split(") ").nth(1).is_some_and(|rest| rest.starts_with('T'));
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).map(|dir| {
            dir.filter_map(Result::ok)
                .all(|task| std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| stopped(&stat)))
        });
        if tasks.unwrap_or(true) {
            return;
        }
        assert!(Instant::now() < deadline, "peer {pid} did not stop within 5 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Round after round against the live peer: write a fresh pattern, read it back elsewhere,
/// compare. Returns the rounds' end times.
fn live_rounds(agent: Agent, buf: Arc<HostBuffer>, peer: String, remote: Desc, stop: Arc<AtomicBool>) -> Vec<Instant> {
    let base = buf.addr();
    let local = Desc::new(base + 2 * BIG, LIVE, 0);
    let back = Desc::new(base + 2 * BIG + LIVE, LIVE, 0);
    let mut ends = Vec::new();
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        write_pattern(&buf, 2 * BIG, round, 0, LIVE);
        for (op, from) in [(Op::Write, local), (Op::Read, back)] {
            agent
                .create_request(op, &[from], &peer, &[remote], RequestOptions::default())
                .and_then(|req| req.post().and_then(|()| req.wait(WAIT)))
                .unwrap_or_else(|e| panic!("live peer, round {round}, {op}: {e}"));
        }
        assert_eq!(check_pattern(&buf, 2 * BIG + LIVE, round, 0, LIVE), Ok(()), "live peer, round {round}");
        ends.push(Instant::now());
        round += 1;
        // Leave the CPU to the streams under test (CI machines have two cores).
        std::thread::sleep(Duration::from_millis(5));
    }
    ends
}

fn fault_mid_transfer(backend: &str, params: &str, fault: Fault) {
    let tag = format!("{fault:?}").to_lowercase();
    let init = Initiator::new(&format!("{tag}-init"), backend, params, 2 * BIG + 2 * LIVE);
    let mut victim = spawn_peer(&format!("{tag}-victim"), backend, params, 2 * BIG);
    let mut live = spawn_peer(&format!("{tag}-live"), backend, params, LIVE);
    let victim_name = init.connect(&victim);
    let live_name = init.connect(&live);

    let completed = Arc::new(AtomicUsize::new(0));
    let streams: Vec<JoinHandle<Outcome>> = [(Op::Write, 0), (Op::Read, BIG)]
        .into_iter()
        .map(|(op, off)| {
            let stream = Stream {
                agent: init.agent.clone(),
                op,
                local: init.desc(off, BIG),
                peer: victim_name.clone(),
                remote: victim.desc(off, BIG),
                completed: Arc::clone(&completed),
                // After a freeze every fresh request costs a full timeout; `stalled_peer_times_out`
                // covers those.
                after: if fault == Fault::Kill { 2 } else { 0 },
            };
            std::thread::spawn(move || stream.run())
        })
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let live_thread = {
        let (agent, buf, peer, remote) =
            (init.agent.clone(), Arc::clone(&init.buf), live_name.clone(), live.desc(0, LIVE));
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || live_rounds(agent, buf, peer, remote, stop))
    };

    // Strike once both streams are moving data, so requests are in flight.
    let started = Instant::now();
    while completed.load(Ordering::SeqCst) < 2 {
        assert!(started.elapsed() < HANG, "no transfer to the victim completed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let struck_at = Instant::now();
    match fault {
        Fault::Kill => victim.kill(),
        Fault::Stop => signal(&victim, "STOP"),
    }

    let outcomes: Vec<Outcome> = streams.into_iter().map(|t| t.join().expect("stream thread")).collect();
    // Let the live peer work on a little after the failures, then check it.
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::SeqCst);
    let ends = live_thread.join().expect("the live peer failed");
    assert!(ends.iter().any(|&t| t > struck_at), "the live peer completed no round after the {fault:?}");

    let mut in_flight = 0;
    for outcome in &outcomes {
        let op = outcome.op;
        let (posted, ended, err) = outcome.failure.as_ref().unwrap_or_else(|| panic!("{outcome:?}: never failed"));
        assert!(is_disconnect(err), "{op} to the {fault:?} peer failed with {err:?} (our wait is {HANG:?})");
        let since = ended.saturating_duration_since(struck_at);
        let after: Vec<Duration> = outcome.after.iter().map(|(took, _)| *took).collect();
        eprintln!("{fault:?}: {op} failed {since:?} after it ({err}); later requests failed in {after:?}");
        assert!(since < FAILURE_BOUND, "{op} in flight failed {since:?} after the {fault:?} ({err})");
        in_flight += usize::from(*posted < struck_at);
        for (took, result) in &outcome.after {
            let err = result.as_ref().err().unwrap_or_else(|| panic!("{op} to the {fault:?} peer succeeded"));
            assert!(is_disconnect(err), "{op} posted after the {fault:?} failed with {err:?}");
            assert!(*took < FAILURE_BOUND, "{op} posted after the {fault:?} took {took:?} to fail ({err})");
        }
    }
    assert!(in_flight >= 1, "the {fault:?} hit no request in flight: {outcomes:?}");

    match fault {
        Fault::Kill => {
            // The agent forgets the dead peer cleanly.
            within("invalidate the dead peer", FAILURE_BOUND, || init.agent.invalidate_remote(&victim_name))
                .expect("invalidate");
            let gone = init.agent.create_request(
                Op::Write,
                &[init.desc(0, 1)],
                &victim_name,
                &[victim.desc(0, 1)],
                RequestOptions::default(),
            );
            assert!(matches!(gone, Err(XferError::UnknownPeer(_))), "{gone:?}");
            // A replacement under the same name is reached through its new metadata.
            let mut reborn = spawn_peer(&victim_name, backend, params, LIVE);
            assert_eq!(init.connect(&reborn), victim_name);
            write_pattern(&init.buf, 0, 6, 0, LIVE);
            init.transfer(
                Op::Write,
                &[init.desc(0, LIVE)],
                &victim_name,
                &[reborn.desc(0, LIVE)],
                RequestOptions::default(),
                WAIT,
            )
            .unwrap_or_else(|e| panic!("write to the replacement peer: {e}"));
            assert_eq!(reborn.hash(0, LIVE).expect("hash"), pattern_hash(6, 0, LIVE), "write to the replacement");
        }
        Fault::Stop => {
            // Once it runs again, the same peer serves new requests on fresh connections.
            signal(&victim, "CONT");
            write_pattern(&init.buf, 0, 5, 0, LIVE);
            init.transfer(
                Op::Write,
                &[init.desc(0, LIVE)],
                &victim_name,
                &[victim.desc(0, LIVE)],
                RequestOptions::default(),
                WAIT,
            )
            .unwrap_or_else(|e| panic!("write to the resumed peer: {e}"));
            assert_eq!(victim.hash(0, LIVE).expect("hash"), pattern_hash(5, 0, LIVE), "write to the resumed peer");
        }
    }
    write_pattern(&init.buf, 2 * BIG, 77, 0, LIVE);
    init.transfer(
        Op::Write,
        &[init.desc(2 * BIG, LIVE)],
        &live_name,
        &[live.desc(0, LIVE)],
        RequestOptions::default(),
        WAIT,
    )
    .expect("live peer at the end");
    assert_eq!(live.hash(0, LIVE).expect("hash"), pattern_hash(77, 0, LIVE));
}

/// SIGKILL of the target while two threads stream 64 MiB WRITEs and READs to it.
pub fn sigkill_mid_transfer(backend: &str, params: &str) {
    fault_mid_transfer(backend, params, Fault::Kill);
}

/// SIGSTOP of the target mid-transfer (a hung host: nothing resets, nothing answers), then
/// SIGCONT: requests end by the backend's timeout, and the peer is usable again afterwards.
pub fn sigstop_mid_transfer(backend: &str, params: &str) {
    fault_mid_transfer(backend, params, Fault::Stop);
}
