//! coordbench: the coordinator's KV prefix index and pairing at cluster scale, against issue 6's
//! bars (128 engines, 1 M indexed blocks: 128-block lookup p99 ≤ 20 µs, ingestion ≥ 2 M block
//! events/s, ≥ 50 k pairing decisions/s on one core, ≤ 64 bytes per (block, engine) entry).
//!
//! ```text
//! cargo run --release -p pd-coordinator --example coordbench [-- --json] [--engines 128]
//!     [--blocks 1000000] [--lookups 200000] [--decisions 200000] [--seed 1]
//! ```
//!
//! The workload: shared system prompts ("families", a popular few held by most engines, the
//! first one 128 blocks long and held by every engine) under conversations (8-160 blocks each,
//! held by the prefill and decode engine that served them, sometimes by one or three), until the
//! index holds the requested number of distinct blocks. Every engine's blocks arrive as vLLM
//! `BlockStored` events with their token ids, encoded with `pd_protocols::kv_events`; ingestion
//! is timed through `decode_batch` + `PrefixIndex::apply_batch` (as the coordinator applies each
//! batch it receives), and through `apply_batch` alone. Memory is
//! what a counting global allocator sees the index keep. Everything runs on one thread.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use pd_coordinator::cluster::{Cluster, PairRequest, Settings};
use pd_coordinator::index::PrefixIndex;
use pd_coordinator::membership::{EngineSpec, Role};
use pd_coordinator::pairing::Weights;
use pd_protocols::kv_events::{decode_batch, encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};

mod shared;

use shared::measure::{cpu_model, live_bytes, measure, Latency, Span, Summary};
use shared::workload::{build_batches, churn_batches, Rng, Universe, BLOCK_SIZE, REQUEST_BLOCKS};

struct Options {
    json: bool,
    engines: usize,
    blocks: usize,
    lookups: usize,
    decisions: usize,
    seed: u64,
    /// Skip the pairing run without events (it is the slow one to set up).
    events_only: bool,
    /// Only the pairing runs (skip ingestion, lookups, churn and memory).
    pairing_only: bool,
    /// Pairing cost weights (the coordinator's defaults unless given).
    weights: Weights,
}

fn options() -> Options {
    let mut o = Options {
        json: false,
        engines: 128,
        blocks: 1_000_000,
        lookups: 200_000,
        decisions: 200_000,
        seed: 1,
        events_only: false,
        pairing_only: false,
        weights: Weights::default(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = |name: &str| -> usize {
            args.next().and_then(|v| v.replace('_', "").parse().ok()).unwrap_or_else(|| panic!("{name} needs a number"))
        };
        match arg.as_str() {
            "--json" => o.json = true,
            "--engines" => o.engines = value("--engines").clamp(2, 4096),
            "--blocks" => o.blocks = value("--blocks").max(1000),
            "--lookups" => o.lookups = value("--lookups").max(100),
            "--decisions" => o.decisions = value("--decisions").max(100),
            "--seed" => o.seed = value("--seed") as u64,
            "--events-only" => o.events_only = true,
            "--pairing-only" => o.pairing_only = true,
            "--weights" => {
                let given = args.next().unwrap_or_default();
                let parsed = given.split_once(',').and_then(|(s, c)| Some((s.parse().ok()?, c.parse().ok()?)));
                let (prefill_scale, overlap_credit) =
                    parsed.unwrap_or_else(|| panic!("--weights needs PREFILL_SCALE,OVERLAP_CREDIT, got {given:?}"));
                o.weights = Weights { prefill_scale, overlap_credit, ..Weights::default() };
            }
            "-h" | "--help" => {
                println!(
                    "coordbench [--json] [--engines 128] [--blocks 1000000] [--lookups 200000] [--decisions 200000] [--seed 1] [--events-only] [--pairing-only] [--weights PREFILL_SCALE,OVERLAP_CREDIT]"
                );
                std::process::exit(0);
            }
            other => panic!("unknown argument {other:?} (try --help)"),
        }
    }
    o
}

struct Report {
    rows: Vec<(String, String, String)>,
    json: String,
}

impl Report {
    fn print(&self, json: bool) {
        if json {
            println!("{{{}}}", self.json);
            return;
        }
        println!("coordbench: {}", machine());
        let width = self.rows.iter().map(|r| r.0.chars().count()).max().unwrap_or(0);
        for (what, figure, bar) in &self.rows {
            let pad = width - what.chars().count();
            if bar.is_empty() {
                println!("{what}{:pad$}  {figure}", "");
            } else {
                println!("{what}{:pad$}  {figure}   [bar: {bar}]", "");
            }
        }
    }

    fn row(&mut self, what: &str, figure: String, bar: &str) {
        self.rows.push((what.into(), figure, bar.into()));
    }

    fn field(&mut self, key: &str, value: impl std::fmt::Display) {
        if !self.json.is_empty() {
            self.json.push_str(", ");
        }
        let _ = write!(self.json, "\"{key}\": {value}");
    }

    fn latency(&mut self, key: &str, what: &str, s: &Summary, bar: &str) {
        self.row(
            what,
            format!(
                "p50 {:.2} µs, p99 {:.2} µs, p99.9 {:.2} µs, max {:.1} µs",
                s.p50_us, s.p99_us, s.p999_us, s.max_us
            ),
            bar,
        );
        for (name, v) in [("p50_us", s.p50_us), ("p99_us", s.p99_us), ("p999_us", s.p999_us), ("max_us", s.max_us)] {
            self.field(&format!("{key}_{name}"), format!("{v:.3}"));
        }
        self.field(&format!("{key}_mean_us"), format!("{:.3}", s.mean_us));
    }
}

fn machine() -> String {
    let threads = std::thread::available_parallelism().map_or(0, usize::from);
    format!("{}, {threads} threads available (the benchmark uses one)", cpu_model())
}

fn main() {
    let o = options();
    let mut rng = Rng(o.seed);
    let mut report = Report { rows: Vec::new(), json: String::new() };
    let progress = |what: &str| {
        if !o.json {
            eprintln!("coordbench: {what}");
        }
    };

    progress("generating the workload");
    let universe = Universe::generate(&mut rng, o.engines, o.blocks);
    let batches = build_batches(&universe, o.engines, &mut rng);
    let encoded: Vec<(usize, Vec<u8>)> =
        batches.iter().map(|(e, b)| (*e, encode_batch(b, EventFormat::TaggedMap))).collect();
    let events: usize = batches.iter().map(|(_, b)| b.block_count()).sum();
    let payload: usize = encoded.iter().map(|(_, p)| p.len()).sum();
    report.field("engines", o.engines);
    report.field("distinct_blocks", universe.distinct_blocks());
    report.field("entries", universe.entries());
    report.field("batches", batches.len());
    report.field("block_events", events);
    if o.pairing_only {
        drop(encoded);
        pairing_rows(&mut report, &universe, &batches, &o, &mut rng);
        report.print(o.json);
        return;
    }

    // Decoding alone (what the ingest threads do before handing batches on).
    progress("decoding");
    let decode_only = measure(|| {
        for (_, payload) in &encoded {
            std::hint::black_box(decode_batch(payload).expect("our own encoding decodes"));
        }
    });

    // Ingestion, decode + apply, into a fresh index.
    progress("ingesting: decode + apply");
    let mut decoded_index = PrefixIndex::default();
    let decode_apply = measure(|| {
        for (engine, payload) in &encoded {
            let batch = decode_batch(payload).expect("our own encoding decodes");
            decoded_index.apply_batch(*engine, &batch.events);
        }
    });
    drop(decoded_index);
    drop(encoded);

    // Ingestion, apply only (pre-decoded), into the index the lookups use; its heap is measured.
    progress("ingesting: apply only");
    let before = live_bytes();
    let mut index = PrefixIndex::default();
    let apply_only = measure(|| {
        for (engine, batch) in &batches {
            index.apply_batch(*engine, &batch.events);
        }
    });
    let heap = live_bytes() - before;
    assert_eq!(index.len(), universe.distinct_blocks(), "every distinct block indexed");
    assert_eq!(index.entries(), universe.entries(), "every (block, engine) entry indexed");
    let per_entry = heap as f64 / index.entries() as f64;
    report.row(
        "index",
        format!("{} distinct blocks, {} (block, engine) entries, {} engines", index.len(), index.entries(), o.engines),
        "",
    );
    report.row(
        "ingestion, decode + apply",
        format!(
            "{} ({events} events, {:.0} MB of msgpack with token ids)",
            decode_apply.describe(events, "block events"),
            payload as f64 / 1e6
        ),
        "≥ 2 M/s",
    );
    report.row("decoding only", decode_only.describe(events, "block events"), "");
    report.row("ingestion, apply only", apply_only.describe(events, "block events"), "");
    for (key, span) in [("ingest_decode_apply", decode_apply), ("decode", decode_only), ("ingest_apply", apply_only)] {
        let (wall, cpu) = span.rates(events);
        report.field(&format!("{key}_events_per_s"), format!("{wall:.0}"));
        if let Some(cpu) = cpu {
            report.field(&format!("{key}_events_per_cpu_s"), format!("{cpu:.0}"));
        }
    }
    report.row(
        "memory",
        format!(
            "{per_entry:.1} bytes per (block, engine) entry ({:.1} MB live heap; {:.1} bytes per block)",
            heap as f64 / 1e6,
            heap as f64 / index.len() as f64
        ),
        "≤ 64 B",
    );
    report.field("heap_bytes", heap);
    report.field("heap_bytes_reported", index.heap_bytes());
    report.field("bytes_per_entry", format!("{per_entry:.2}"));

    // Lookups.
    progress("lookups");
    let now = Instant::now();
    let mut request = Vec::with_capacity(REQUEST_BLOCKS);
    let mut matches = Vec::new();
    for _ in 0..o.lookups / 10 {
        universe.request(&mut rng, &mut request);
        index.prefix_matches(&request, now, &mut matches);
    }
    let (mut fast, mut map) = (Latency::default(), Latency::default());
    let mut matched_engines = 0usize;
    for _ in 0..o.lookups {
        universe.request(&mut rng, &mut request);
        fast.time(|| index.prefix_matches(&request, now, &mut matches));
        matched_engines += matches.len();
        universe.request(&mut rng, &mut request);
        std::hint::black_box(map.time(|| index.overlaps(&request, now)));
    }
    let hot = &universe.families[0].blocks;
    let (mut hot_fast, mut hot_map) = (Latency::default(), Latency::default());
    for _ in 0..o.lookups / 10 {
        hot_fast.time(|| index.prefix_matches(hot, now, &mut matches));
        std::hint::black_box(hot_map.time(|| index.overlaps(hot, now)));
    }
    assert!(matches.iter().all(|&(_, n)| n == REQUEST_BLOCKS) && matches.len() == universe.families[0].holders.len());
    let (fast, map, hot_fast, hot_map) = (fast.summary(), map.summary(), hot_fast.summary(), hot_map.summary());
    report.latency("lookup", "lookup, 128 blocks (prefix_matches)", &fast, "p99 ≤ 20 µs");
    report.latency("lookup_map", "lookup, 128 blocks (overlaps → HashMap)", &map, "p99 ≤ 20 µs");
    report.latency("lookup_all_held", "lookup, 128 blocks all held by all engines", &hot_fast, "");
    report.latency("lookup_all_held_map", "  same through overlaps → HashMap", &hot_map, "");
    report.field("lookup_mean_matched_engines", format!("{:.2}", matched_engines as f64 / fast.count as f64));

    // Steady-state churn: stores of new conversations with per-block evictions of old ones.
    progress("churn");
    let churn = churn_batches(&universe, &mut rng, 20_000.min(universe.conversations.len()));
    let churn_events: usize = churn.iter().map(|(_, b)| b.block_count()).sum();
    let churn_encoded: Vec<(usize, Vec<u8>)> =
        churn.iter().map(|(e, b)| (*e, encode_batch(b, EventFormat::TaggedMap))).collect();
    let mut churn_index = PrefixIndex::default();
    for (engine, batch) in &batches {
        churn_index.apply_batch(*engine, &batch.events);
    }
    let churn_decode_apply = measure(|| {
        for (engine, payload) in &churn_encoded {
            let batch = decode_batch(payload).expect("decodes");
            churn_index.apply_batch(*engine, &batch.events);
        }
    });
    drop(churn_index);
    let churn_apply = measure(|| {
        for (engine, batch) in &churn {
            index.apply_batch(*engine, &batch.events);
        }
    });
    report.row(
        "churn (store + 1-block removals), decode + apply",
        format!("{} ({churn_events} events)", churn_decode_apply.describe(churn_events, "block events")),
        "",
    );
    report.row("churn, apply only", churn_apply.describe(churn_events, "block events"), "");
    for (key, span) in [("churn_decode_apply", churn_decode_apply), ("churn_apply", churn_apply)] {
        let (wall, cpu) = span.rates(churn_events);
        report.field(&format!("{key}_events_per_s"), format!("{wall:.0}"));
        if let Some(cpu) = cpu {
            report.field(&format!("{key}_events_per_cpu_s"), format!("{cpu:.0}"));
        }
    }
    drop((churn, churn_encoded, index));

    // Worst case for memory: every block on exactly one engine.
    progress("memory, one holder per block");
    let hashes: Vec<u64> = (0..o.blocks).map(|_| rng.next()).collect();
    let before = live_bytes();
    let mut single = PrefixIndex::default();
    for (k, chunk) in hashes.chunks(64).enumerate() {
        let event = KvEvent::BlockStored {
            block_hashes: chunk.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: BLOCK_SIZE as u32,
            lora_id: None,
            medium: None,
            lora_name: None,
            cache_salt: None,
        };
        single.apply(k % o.engines, &event);
    }
    let single_heap = live_bytes() - before;
    let single_per_entry = single_heap as f64 / single.entries() as f64;
    report.row(
        "memory, worst case (one engine per block)",
        format!("{single_per_entry:.1} bytes per entry ({} entries)", single.entries()),
        "",
    );
    report.field("bytes_per_entry_single_holder", format!("{single_per_entry:.2}"));
    drop((single, hashes));

    pairing_rows(&mut report, &universe, &batches, &o, &mut rng);
    report.print(o.json);
}

/// The pairing runs and their rows.
fn pairing_rows(report: &mut Report, universe: &Universe, batches: &[(usize, EventBatch)], o: &Options, rng: &mut Rng) {
    let progress = |what: &str| {
        if !o.json {
            eprintln!("coordbench: {what}");
        }
    };
    // Pairing through the Cluster, with engines publishing events (the usual case) and without
    // (approximate mode: every guess lives its full time to live).
    progress("pairing, engines publishing events");
    let with_events = pairing(universe, batches, o, rng, true);
    let mut runs = vec![("pair", "pairing through Cluster::pair, one thread", with_events, "≥ 50 k/s")];
    if !o.events_only {
        progress("pairing, no events");
        let without = pairing(universe, batches, o, rng, false);
        runs.push(("pair_no_events", "  same, engines without events (guesses live 2 s)", without, ""));
    }
    let event_rate = runs[0].2.event_rate;
    for (key, what, p, bar) in &runs {
        let (per_s, per_cpu_s) = p.span.rates(p.count);
        report.row(
            what,
            format!(
                "{:.0} k decisions/s{} (p50 {:.2} µs, p99 {:.2} µs; {:.0} % disaggregated, {:.1} of 128 blocks cached)",
                per_s / 1e3,
                per_cpu_s.map_or(String::new(), |c| format!(", {:.0} k per CPU-second", c / 1e3)),
                p.latency.p50_us,
                p.latency.p99_us,
                100.0 * p.disaggregated,
                p.cached_blocks
            ),
            bar,
        );
        report.field(&format!("{key}_decisions_per_s"), format!("{per_s:.0}"));
        if let Some(c) = per_cpu_s {
            report.field(&format!("{key}_decisions_per_cpu_s"), format!("{c:.0}"));
        }
        report.field(&format!("{key}_p50_us"), format!("{:.3}", p.latency.p50_us));
        report.field(&format!("{key}_p99_us"), format!("{:.3}", p.latency.p99_us));
    }
    report.row(
        "  events applied meanwhile (not in the figure)",
        format!("{:.2} M block events/s", event_rate / 1e6),
        "",
    );
}

/// An identity hasher for sets of block hashes (they are random already).
#[derive(Default)]
struct Identity(u64);

impl std::hash::Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type BlockSet = std::collections::HashSet<u64, std::hash::BuildHasherDefault<Identity>>;

struct Pairing {
    latency: Summary,
    /// The measured rounds' time, and how many decisions they made.
    span: Span,
    count: usize,
    disaggregated: f64,
    cached_blocks: f64,
    /// Block events applied by simulated engines during the run, per second of applying.
    event_rate: f64,
}

/// Decisions through `Cluster::pair` on 64 prefill + 64 decode engines (for 128) holding the
/// universe. With `events`, each engine publishes `BlockStored` for the blocks a decision sent
/// it, 50 ms (simulated) after the decision, and evicts its oldest blocks past its capacity with
/// `BlockRemoved`; the coordinator applies those outside the timed region. Requests finish after
/// 2000 are in flight; upkeep (`tick`) runs every 100 ms of simulated time, inside the timed
/// region. Speculative entries live 2 s; the run warms up for that long (at one decision per
/// 20 µs, the bar's rate) before measuring.
fn pairing(universe: &Universe, batches: &[(usize, EventBatch)], o: &Options, rng: &mut Rng, events: bool) -> Pairing {
    let mut cluster = Cluster::new(Settings { weights: o.weights, ..Settings::default() });
    let t0 = Instant::now();
    for engine in 0..o.engines {
        let role = if engine < o.engines / 2 { Role::Prefill } else { Role::Decode };
        cluster.register(
            EngineSpec {
                id: format!("engine-{engine}"),
                role,
                node: format!("node-{}", engine / 8),
                model: "m".into(),
                engine_url: format!("http://node-{}:{}", engine / 8, 8000 + engine % 8),
                sidecar_url: None,
                // Declared publishers: the coordinator then trusts their events for what they hold.
                kv_events: events.then(|| format!("tcp://node-{}:{}", engine / 8, 5557 + engine % 8)),
                kv_events_topic: None,
                replay: None,
                xfer_side_channel: None,
                block_size: BLOCK_SIZE as u32,
                capacity_blocks: None,
                data_parallel_size: None,
            },
            t0,
        );
    }
    // What each engine holds, oldest first, for its events.
    let mut resident: Vec<(std::collections::VecDeque<u64>, BlockSet)> =
        (0..o.engines).map(|_| Default::default()).collect();
    for (engine, batch) in batches {
        cluster.apply_events(*engine, 0, batch).expect("engines without data parallel take every batch");
        for event in &batch.events {
            if let KvEvent::BlockStored { block_hashes, .. } = event {
                let (order, set) = &mut resident[*engine];
                for h in block_hashes {
                    if set.insert(h.as_u64()) {
                        order.push_back(h.as_u64());
                    }
                }
            }
        }
    }
    let capacity = resident.iter().map(|(order, _)| order.len()).max().unwrap_or(0) + 1000;
    let step = Duration::from_micros(20);
    let delay = 2500; // decisions: 50 ms
    let warmup = (Settings::default().speculative_ttl.as_micros() / step.as_micros()) as usize + 5000;
    let total = warmup + o.decisions;
    let ids: Vec<String> = (0..total).map(|i| format!("req-{i}")).collect();
    let names: Vec<String> = (0..o.engines).map(|engine| format!("engine-{engine}")).collect();
    let mut in_flight = std::collections::VecDeque::new();
    let mut pending: std::collections::VecDeque<(usize, usize, Vec<u64>)> = std::collections::VecDeque::new();
    let mut latency = Latency::default();
    let (mut disaggregated, mut cached, mut measured) = (0usize, 0u64, 0usize);
    let (mut applied, mut applying) = (0usize, Duration::ZERO);
    let (mut wall, mut cpu) = (Duration::ZERO, Some(Duration::ZERO));
    let mut now = t0;
    const ROUND: usize = 1000;
    for round in (0..total).step_by(ROUND) {
        // Requests are drawn before the round, events delivered after it: only the
        // coordinator's work is inside.
        let range = round..total.min(round + ROUND);
        let requests: Vec<(Vec<u64>, [f64; 2])> = range
            .clone()
            .map(|_| {
                let mut request = Vec::with_capacity(REQUEST_BLOCKS);
                universe.request(rng, &mut request);
                (request, [rng.unit(), rng.unit()])
            })
            .collect();
        let mut decisions = Vec::with_capacity(ROUND);
        let timed = round >= warmup;
        let span = measure(|| {
            for (i, (request, uniform)) in range.clone().zip(&requests) {
                now += step;
                // One request's coordinator work: the decision, finishing the oldest request
                // once 2000 are in flight, and (amortised) upkeep.
                let mut run = || {
                    let req = PairRequest {
                        request_id: &ids[i],
                        model: "m",
                        block_hashes: request,
                        prompt_tokens: (REQUEST_BLOCKS * BLOCK_SIZE) as u64,
                        block_size: BLOCK_SIZE as u32,
                        lora_name: None,
                    };
                    let decision = cluster.pair(req, now, *uniform).expect("a decode is live");
                    in_flight.push_back(i);
                    if in_flight.len() > 2000 {
                        cluster.handoffs.finished(&ids[in_flight.pop_front().expect("not empty")]);
                    }
                    if i % 5000 == 0 {
                        // No sidecars renew leases here; renew them so that upkeep keeps them.
                        for name in &names {
                            let _ = cluster.membership.heartbeat(name, now);
                        }
                        cluster.tick(now);
                    }
                    decision
                };
                decisions.push(if timed { latency.time(run) } else { run() });
            }
        });
        if timed {
            wall += span.wall;
            cpu = cpu.zip(span.cpu).map(|(a, b)| a + b);
            measured += decisions.len();
            disaggregated += decisions.iter().filter(|d| d.prefill.is_some()).count();
            cached += decisions.iter().map(|d| d.decode_overlap_blocks.max(d.prefill_overlap_blocks)).sum::<u64>();
        }
        if !events {
            continue;
        }
        for (i, (decision, (request, _))) in range.clone().zip(decisions.iter().zip(requests)) {
            for engine in std::iter::once(decision.decode).chain(decision.prefill) {
                pending.push_back((i + delay, engine, request.clone()));
            }
        }
        let until = range.end + ROUND;
        while pending.front().is_some_and(|p| p.0 < until) {
            let (_, engine, blocks) = pending.pop_front().expect("not empty");
            let (order, set) = &mut resident[engine];
            let fresh: Vec<u64> = blocks.into_iter().filter(|&h| set.insert(h)).collect();
            order.extend(&fresh);
            let mut batch_events = Vec::new();
            if !fresh.is_empty() {
                batch_events.push(KvEvent::BlockStored {
                    block_hashes: fresh.iter().map(|&h| BlockHash::Int(h)).collect(),
                    parent_block_hash: None,
                    token_ids: Vec::new(),
                    block_size: BLOCK_SIZE as u32,
                    lora_id: None,
                    medium: Some("GPU".into()),
                    lora_name: None,
                    cache_salt: None,
                });
            }
            while order.len() > capacity {
                let old = order.pop_front().expect("over capacity");
                set.remove(&old);
                batch_events.push(KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(old)], medium: None });
            }
            let batch = EventBatch { ts: 0.0, events: batch_events, dp_rank: Some(0) };
            let start = Instant::now();
            cluster.apply_events(engine, 0, &batch).expect("engines without data parallel take every batch");
            applying += start.elapsed();
            applied += batch.block_count();
        }
    }
    Pairing {
        latency: latency.summary(),
        span: Span { wall, cpu },
        count: measured,
        disaggregated: disaggregated as f64 / measured as f64,
        cached_blocks: cached as f64 / measured as f64,
        event_rate: applied as f64 / applying.as_secs_f64().max(1e-9),
    }
}
