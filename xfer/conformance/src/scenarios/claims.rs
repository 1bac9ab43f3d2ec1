//! Grants claimed over the side channel, two processes: the peer offers a grant by name
//! (`offer` on its stdin); the initiator claims it with the ranges it reads.
//! - `early_claims_hold_no_handler`: 64 threads claim names the peer never offers, each asking
//!   again for the claim wait (2 s). The peer answers each ask at once, so its side channel
//!   never holds a handler thread per pending claim (on average over the wait, at most a
//!   quarter of them run at once: each ask is short, though under load several can overlap),
//!   a metadata fetch is answered promptly meanwhile, every early claim ends `UnknownKey`
//!   within the wait, and a claim sent before its offer exists succeeds once the peer offers
//!   it and reads the peer's bytes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::grant_offer::CLAIM_WAIT;
use xfer::{MemType, Op, RefusalCode, RequestOptions, XferError};

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::{check_pattern, write_pattern};

const EARLY_CLAIMS: usize = 64;
const BLOCK: u64 = 16 << 10;

/// Side-channel handler threads alive in process `pid` (each request runs on its own).
fn side_channel_handlers(pid: u32) -> usize {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == "xfer-side-conn")
        .count()
}

pub fn early_claims_hold_no_handler(backend: &str, params: &str) {
    let init = Initiator::new("claims-init", backend, params, BLOCK);
    let mut peer = spawn_peer("claims-peer", backend, params, 1 << 20);
    let name = init.connect(&peer);
    let side = peer.side_channel().to_string();
    peer.fill(0x51, 0, BLOCK).expect("fill");

    let done = Arc::new(AtomicBool::new(false));
    // Sampled every 2 ms until the claims end: (samples, handlers summed, most at once).
    let watcher = {
        let (done, pid) = (Arc::clone(&done), peer.pid());
        std::thread::spawn(move || {
            let (mut samples, mut sum, mut most) = (0usize, 0usize, 0usize);
            while !done.load(Ordering::Acquire) {
                let now = side_channel_handlers(pid);
                (samples, sum, most) = (samples + 1, sum + now, most.max(now));
                std::thread::sleep(Duration::from_millis(2));
            }
            (samples, sum, most)
        })
    };
    let started = Instant::now();
    let claimants: Vec<_> = (0..EARLY_CLAIMS)
        .map(|i| {
            let (agent, side, range) = (init.agent.clone(), side.clone(), peer.desc(0, BLOCK));
            std::thread::spawn(move || {
                let result = agent.claim_grant(&side, &format!("never-{i}"), MemType::Dram, &[range]);
                (result, started.elapsed())
            })
        })
        .collect();
    // A claim sent before its offer: the peer offers it a moment later.
    let late = {
        let (agent, side, range) = (init.agent.clone(), side.clone(), peer.desc(0, BLOCK));
        std::thread::spawn(move || agent.claim_grant(&side, "late", MemType::Dram, &[range]))
    };
    std::thread::sleep(Duration::from_millis(300));
    let fetch_started = Instant::now();
    assert_eq!(init.agent.fetch_remote_metadata(&side).expect("fetch during the claims"), name);
    let fetch_took = fetch_started.elapsed();
    peer.command("offer late 30000").expect("offer");

    assert_eq!(late.join().expect("late claimant").expect("a claim sent before its offer"), name);
    write_pattern(&init.buf, 0, 0xdead, 0, BLOCK);
    let local = [init.desc(0, BLOCK)];
    init.transfer(Op::Read, &local, &name, &[peer.desc(0, BLOCK)], RequestOptions::default(), WAIT)
        .unwrap_or_else(|e| panic!("read under the claimed grant: {e}"));
    check_pattern(&init.buf, 0, 0x51, 0, BLOCK).unwrap_or_else(|at| panic!("claimed bytes wrong at {at}"));

    for claimant in claimants {
        let (result, took) = claimant.join().expect("early claimant");
        assert!(
            matches!(result, Err(XferError::Refused { code: RefusalCode::UnknownKey, .. })),
            "a claim for a name never offered: {result:?}"
        );
        assert!(took < CLAIM_WAIT + Duration::from_secs(3), "an early claim gave up after {took:?}");
    }
    let claims_took = started.elapsed();
    done.store(true, Ordering::Release);
    let (samples, sum, most) = watcher.join().expect("watcher");
    let mean = sum as f64 / samples.max(1) as f64;
    println!(
        "{EARLY_CLAIMS} early claims over {claims_took:?}: {mean:.1} side-channel handlers on average \
         ({samples} samples), at most {most} at once; a metadata fetch meanwhile took {fetch_took:?}"
    );
    assert!(claims_took >= CLAIM_WAIT - Duration::from_millis(200), "early claims gave up after {claims_took:?}");
    // A handler held per pending claim would average near EARLY_CLAIMS over the wait.
    assert!(
        mean <= (EARLY_CLAIMS / 4) as f64,
        "{mean:.1} side-channel handlers on average (at most {most}) for {EARLY_CLAIMS} pending claims"
    );
    assert!(fetch_took < Duration::from_secs(2), "a metadata fetch during the claims took {fetch_took:?}");
    assert_eq!(peer.command("revoke-offer late").expect("revoke the offer"), "1", "grants claimed under the offer");
}
