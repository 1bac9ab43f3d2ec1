//! READ and WRITE of pseudo-random data over many sizes and descriptor shapes, every byte
//! checked, including the bytes around the destination that must stay untouched.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;
use xfer::{Op, RequestOptions};

use super::{rng, spawn_peer, Initiator, WAIT};
use crate::layout::{zip_runs, Layout};
use crate::pattern::{check_pattern, pattern_hash, write_pattern};
use crate::peer::Peer;

const SIZES: [u64; 4] = [1, 4096 + 3, 1 << 20, 16 << 20];
const COUNTS: [usize; 6] = [1, 2, 7, 64, 1024, 4096];
/// Local and remote lists with different numbers of descriptors.
const UNEVEN: [(usize, usize); 3] = [(7, 64), (4096, 1), (1, 4096)];
const LARGE: u64 = 256 << 20;
/// Bound on one 256 MiB request (a slow CI machine moves well over 100 MB/s on loopback).
const LARGE_WAIT: Duration = Duration::from_secs(60);

struct Bench {
    init: Initiator,
    peer: Peer,
    peer_name: String,
    rng: StdRng,
}

impl Bench {
    fn new(scenario: &str, backend: &str, params: &str, size: u64) -> Bench {
        let init = Initiator::new(&format!("{scenario}-init"), backend, params, size);
        let peer = spawn_peer(&format!("{scenario}-peer"), backend, params, size);
        let peer_name = init.connect(&peer);
        Bench { init, peer, peer_name, rng: rng(scenario) }
    }

    /// One request from `local` to `remote` (or back), then every byte checked.
    fn case(&mut self, op: Op, local: &Layout, remote: &Layout, bound: Duration) {
        let label = format!(
            "{op} of {} bytes, {} local / {} remote descriptors",
            local.total(),
            local.pieces.len(),
            remote.pieces.len()
        );
        let (seed, background): (u64, u64) = (self.rng.random(), self.rng.random());
        let buf = &self.init.buf;
        // Both windows start with known background bytes so stray writes show up.
        match op {
            Op::Write => {
                self.peer.fill(background, 0, remote.window).expect("peer fill");
                for p in &local.pieces {
                    write_pattern(buf, p.off, seed, p.pos, p.len);
                }
            }
            Op::Read => {
                self.peer.fill(seed, 0, remote.window).expect("peer fill");
                write_pattern(buf, 0, background, 0, local.window);
            }
        }
        let started = Instant::now();
        self.init
            .transfer(
                op,
                &local.descs(buf.addr()),
                &self.peer_name,
                &remote.descs(self.peer.buf_addr()),
                RequestOptions::default(),
                bound,
            )
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let took = started.elapsed();
        match op {
            Op::Write => self.check_remote(&label, seed, background, remote),
            Op::Read => check_local(&self.init, &label, seed, background, local, remote),
        }
        eprintln!("{label}: ok in {took:?}");
    }

    /// Each destination piece must hash like the stream bytes it carries, each gap like the
    /// background.
    fn check_remote(&mut self, label: &str, seed: u64, background: u64, remote: &Layout) {
        let gaps = remote.gaps();
        let mut ranges: Vec<(u64, u64)> = remote.pieces.iter().map(|p| (p.off, p.len)).collect();
        ranges.extend(&gaps);
        let mut want: Vec<u64> = remote.pieces.iter().map(|p| pattern_hash(seed, p.pos, p.len)).collect();
        want.extend(gaps.iter().map(|&(off, len)| pattern_hash(background, off, len)));
        let got = self.peer.hashes(&ranges).expect("peer hashes");
        let pieces = remote.pieces.len();
        for (i, ((got, want), (off, len))) in got.iter().zip(&want).zip(&ranges).enumerate() {
            let what = if i < pieces { format!("destination descriptor {i}") } else { "untouched gap".to_string() };
            assert_eq!(got, want, "{label}: {what} at remote offset {off} (+{len}) holds wrong bytes");
        }
    }
}

/// Every local byte must be the remote byte it maps to; gaps keep the background.
fn check_local(init: &Initiator, label: &str, seed: u64, background: u64, local: &Layout, remote: &Layout) {
    zip_runs(local, remote, |local_off, remote_off, len| {
        if let Err(at) = check_pattern(&init.buf, local_off, seed, remote_off, len) {
            panic!(
                "{label}: local byte at offset {} differs (run of {len} bytes from remote offset {remote_off})",
                local_off + at
            );
        }
    });
    for (off, len) in local.gaps() {
        if let Err(at) = check_pattern(&init.buf, off, background, off, len) {
            panic!("{label}: local byte at offset {} outside every descriptor was overwritten", off + at);
        }
    }
}

/// Sizes from 1 byte to 16 MiB, each with 1 to 4096 descriptors of random lengths at shuffled
/// positions (local and remote cut differently), in both directions.
pub fn transfer_matrix(backend: &str, params: &str) {
    let max = SIZES.iter().max().copied().unwrap_or(0);
    let mut bench = Bench::new("matrix", backend, params, Layout::max_window(max, 4096));
    let mut shapes: Vec<(u64, usize, usize)> = Vec::new();
    for total in SIZES {
        shapes.extend(COUNTS.iter().filter(|&&n| n as u64 <= total).map(|&n| (total, n, n)));
    }
    shapes.extend(UNEVEN.iter().map(|&(l, r)| (1 << 20, l, r)));
    for (total, local_count, remote_count) in shapes {
        for op in [Op::Write, Op::Read] {
            let local = Layout::scatter(&mut bench.rng, total, local_count);
            let remote = Layout::scatter(&mut bench.rng, total, remote_count);
            bench.case(op, &local, &remote, WAIT);
        }
    }
}

/// One 256 MiB request each way, off page on both sides.
pub fn transfer_large(backend: &str, params: &str) {
    let mut bench = Bench::new("large", backend, params, Layout::max_window(LARGE, 1));
    for op in [Op::Write, Op::Read] {
        let local = Layout::scatter(&mut bench.rng, LARGE, 1);
        let remote = Layout::scatter(&mut bench.rng, LARGE, 1);
        bench.case(op, &local, &remote, LARGE_WAIT);
    }
}
