//! READ and WRITE of pseudo-random data over many sizes and descriptor shapes, every byte
//! checked, including the bytes around the destination that must stay untouched; and many small
//! requests in flight at once, in runs of each direction.

use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;
use xfer::{Op, RefusalCode, RequestOptions, XferError};

use super::{drop_within, rng, spawn_peer, Initiator, WAIT};
use crate::layout::{zip_runs, Layout};
use crate::pattern::{check_pattern, pattern_hash, write_pattern};
use crate::peer::Peer;

const SIZES: [u64; 4] = [1, 4096 + 3, 1 << 20, 16 << 20];
const COUNTS: [usize; 6] = [1, 2, 7, 64, 1024, 4096];
/// Local and remote lists with different numbers of descriptors.
const UNEVEN: [(usize, usize); 3] = [(7, 64), (4096, 1), (1, 4096)];
/// Lists of runs ([`Layout::runs`]): bytes, local and remote descriptors.
const RUNS: [(u64, usize, usize); 2] = [(1 << 20, 65536, 65536), (1 << 20, 65536, 7)];
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
/// positions (local and remote cut differently), in both directions; then 1 MiB as 65,536
/// descriptors in stream order, most continuing the one before.
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
    for (total, local_count, remote_count) in RUNS {
        for op in [Op::Write, Op::Read] {
            let local = Layout::runs(&mut bench.rng, total, local_count);
            let remote = Layout::runs(&mut bench.rng, total, remote_count);
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

/// Small requests in flight at once (backends may send several on one connection before their
/// answers): each has its own region on both sides.
const IN_FLIGHT: usize = 96;
/// Room per request; the sizes cycle through small, odd and chunk-sized ones.
const IN_FLIGHT_SLOT: u64 = 80 << 10;
const IN_FLIGHT_SIZES: [u64; 5] = [4096, 65536, 1000, 32768 + 5, 1];

/// `IN_FLIGHT` requests made once, WRITEs and READs in uneven runs (so a run of one direction
/// is cut where the next starts), local and remote slots in different orders (so an answer
/// landing in another request's place shows).
struct InFlight {
    bench: Bench,
    requests: Vec<Placed>,
}

/// One request of [`InFlight`] and where its bytes go: `local` and `remote` offsets, `len` bytes.
struct Placed {
    req: xfer::XferRequest,
    op: Op,
    local: u64,
    remote: u64,
    len: u64,
}

impl InFlight {
    fn new(scenario: &str, backend: &str, params: &str) -> InFlight {
        let bench = Bench::new(scenario, backend, params, IN_FLIGHT as u64 * IN_FLIGHT_SLOT);
        let requests = (0..IN_FLIGHT)
            .map(|i| {
                let op = if i % 7 < 4 { Op::Write } else { Op::Read };
                let local = i as u64 * IN_FLIGHT_SLOT;
                let remote = ((i * 37) % IN_FLIGHT) as u64 * IN_FLIGHT_SLOT + 3;
                let len = IN_FLIGHT_SIZES[i % IN_FLIGHT_SIZES.len()];
                let (local_desc, remote_desc) = ([bench.init.desc(local, len)], [bench.peer.desc(remote, len)]);
                let req = bench.init.agent.create_request(
                    op,
                    &local_desc,
                    &bench.peer_name,
                    &remote_desc,
                    RequestOptions::default(),
                );
                Placed { req: req.unwrap_or_else(|e| panic!("request {i}: {e}")), op, local, remote, len }
            })
            .collect();
        InFlight { bench, requests }
    }

    fn post_all(&self, what: &str) {
        for (i, placed) in self.requests.iter().enumerate() {
            placed.req.post().unwrap_or_else(|e| panic!("{what}: post {i}: {e}"));
        }
    }

    /// New data everywhere, every request posted before any is waited for, every byte checked.
    fn round(&mut self, round: u64) {
        let base: u64 = self.bench.rng.random();
        let seed = |i: usize| base ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for (i, &Placed { op, local, remote, len, .. }) in self.requests.iter().enumerate() {
            match op {
                Op::Write => write_pattern(&self.bench.init.buf, local, seed(i), 0, len),
                Op::Read => self.bench.peer.fill(seed(i), remote, len).expect("peer fill"),
            }
        }
        self.post_all(&format!("round {round}"));
        for (i, Placed { req, op, len, .. }) in self.requests.iter().enumerate() {
            req.wait(WAIT).unwrap_or_else(|e| panic!("round {round}: request {i} ({op:?}, {len} bytes): {e}"));
        }
        let writes: Vec<(usize, u64, u64)> = (self.requests.iter().enumerate())
            .filter(|(_, placed)| placed.op == Op::Write)
            .map(|(i, placed)| (i, placed.remote, placed.len))
            .collect();
        let ranges: Vec<(u64, u64)> = writes.iter().map(|&(_, remote, len)| (remote, len)).collect();
        let got = self.bench.peer.hashes(&ranges).expect("peer hashes");
        for (&(i, remote, len), got) in writes.iter().zip(got) {
            assert_eq!(
                got,
                pattern_hash(seed(i), 0, len),
                "round {round}: WRITE {i} left wrong bytes at remote offset {remote}"
            );
        }
        for (i, &Placed { op, local, len, .. }) in self.requests.iter().enumerate() {
            if op == Op::Read {
                if let Err(at) = check_pattern(&self.bench.init.buf, local, seed(i), 0, len) {
                    panic!("round {round}: READ {i} has a wrong byte at local offset {}", local + at);
                }
            }
        }
    }
}

/// Three rounds of `IN_FLIGHT` small requests in flight at once, reposting the same requests.
pub fn requests_in_flight(backend: &str, params: &str) {
    let mut in_flight = InFlight::new("in-flight", backend, params);
    for round in 0..3 {
        in_flight.round(round);
    }
}

/// For a backend whose target checks every request against its registrations: after a round
/// of requests in flight the peer deregisters, and the same requests, all in flight again, are
/// each refused on their own (the stream stays in step from one refusal to the next); the
/// initiator's registration then drops within the bound.
pub fn refusals_in_flight(backend: &str, params: &str) {
    let mut in_flight = InFlight::new("refusals-in-flight", backend, params);
    in_flight.round(0);
    in_flight.bench.peer.dereg().expect("peer dereg");
    in_flight.post_all("after the peer's deregistration");
    for (i, placed) in in_flight.requests.iter().enumerate() {
        match placed.req.wait(WAIT) {
            Err(XferError::Deregistered | XferError::Refused { code: RefusalCode::UnknownKey, .. }) => {}
            other => panic!("request {i} to a deregistered region: {other:?}, not a refusal"),
        }
    }
    drop_within("the initiator's requests and registration", WAIT, in_flight);
}
