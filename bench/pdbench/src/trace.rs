//! Replaying a request trace in the Mooncake format (FAST '25): one JSON object per line,
//!
//! ```text
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}
//! ```
//!
//! `timestamp` is the arrival in milliseconds, `input_length` and `output_length` are token
//! counts, and each hash id stands for one 512-token block of the prompt: equal ids in two
//! requests are equal content at the same position of a shared prefix.
//!
//! Parsing is pure and bounded (line length, number of blocks, lengths); every error names its
//! line. A [`Replay`] turns the parsed requests into prompts: each hash id becomes a fixed run of
//! words (one token each, under pd-sim's tokenizers and the shared word-level tokenizer.json),
//! `block_tokens` of them instead of 512, so equal ids give equal tokens and prefix sharing is
//! kept while prompts shrink to what this machine can serve.

use std::io::{BufRead, Read};
use std::sync::Arc;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::workload::{Conversation, WORDS};

/// Tokens per hash id in the trace format.
pub const TRACE_BLOCK_TOKENS: u64 = 512;
/// Longest line accepted (the public traces' longest is about 2 KB).
pub const MAX_LINE_BYTES: usize = 64 * 1024;
/// Most blocks of one request (2 M tokens).
pub const MAX_BLOCKS: usize = 4096;
/// Largest output length accepted.
pub const MAX_OUTPUT_LENGTH: u64 = 1 << 20;
/// Latest timestamp accepted: 30 days in milliseconds.
pub const MAX_TIMESTAMP_MS: u64 = 30 * 24 * 3600 * 1000;

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("line {line}: longer than {MAX_LINE_BYTES} bytes")]
    LineTooLong { line: usize },
    #[error("line {line}: not a trace record: {source}")]
    Json { line: usize, source: serde_json::Error },
    #[error("line {line}: no hash_ids")]
    NoBlocks { line: usize },
    #[error("line {line}: {blocks} hash_ids, more than {MAX_BLOCKS}")]
    TooManyBlocks { line: usize, blocks: usize },
    #[error("line {line}: input_length {input_length} is not in 1..={max} for {blocks} blocks of 512 tokens")]
    BadInputLength { line: usize, input_length: u64, blocks: usize, max: u64 },
    #[error("line {line}: output_length {output_length} is above {MAX_OUTPUT_LENGTH}")]
    OutputTooLong { line: usize, output_length: u64 },
    #[error("line {line}: timestamp {timestamp} is above {MAX_TIMESTAMP_MS} ms")]
    TimestampTooLate { line: usize, timestamp: u64 },
    #[error("line {line}: timestamp {timestamp} is before the previous request's {previous}")]
    TimestampBackwards { line: usize, timestamp: u64, previous: u64 },
    #[error("the trace holds no requests")]
    Empty,
}

/// Why replay options are unusable.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ReplayOptionsError {
    #[error("block tokens must be in 1..=512, not {0}")]
    BlockTokens(u64),
    #[error("the time scale must be a positive finite number, not {0}")]
    TimeScale(f64),
    #[error("the input and output caps must be at least 1")]
    ZeroCap,
}

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp: u64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
}

/// Parses one non-blank line (`line` is 1-based, for the errors).
pub fn parse_line(text: &str, line: usize) -> Result<TraceRequest, TraceError> {
    if text.len() > MAX_LINE_BYTES {
        return Err(TraceError::LineTooLong { line });
    }
    let r: TraceRequest = serde_json::from_str(text).map_err(|source| TraceError::Json { line, source })?;
    let blocks = r.hash_ids.len();
    if blocks == 0 {
        return Err(TraceError::NoBlocks { line });
    }
    if blocks > MAX_BLOCKS {
        return Err(TraceError::TooManyBlocks { line, blocks });
    }
    let max = blocks as u64 * TRACE_BLOCK_TOKENS;
    if r.input_length == 0 || r.input_length > max {
        return Err(TraceError::BadInputLength { line, input_length: r.input_length, blocks, max });
    }
    if r.output_length > MAX_OUTPUT_LENGTH {
        return Err(TraceError::OutputTooLong { line, output_length: r.output_length });
    }
    if r.timestamp > MAX_TIMESTAMP_MS {
        return Err(TraceError::TimestampTooLate { line, timestamp: r.timestamp });
    }
    Ok(r)
}

/// Reads at most `limit` requests (blank lines skipped); timestamps must not go backwards.
pub fn read(mut input: impl BufRead, limit: usize) -> Result<Vec<TraceRequest>, TraceError> {
    let mut out = Vec::new();
    let mut buf = Vec::new();
    let mut line = 0;
    while out.len() < limit {
        buf.clear();
        line += 1;
        // One byte more than the limit tells an overlong line from one that just fits.
        let n = Read::take(&mut input, MAX_LINE_BYTES as u64 + 1).read_until(b'\n', &mut buf)?;
        if n == 0 {
            break;
        }
        if buf.len() > MAX_LINE_BYTES && buf.last() != Some(&b'\n') {
            return Err(TraceError::LineTooLong { line });
        }
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let r = parse_line(text, line)?;
        if let Some(prev) = out.last().map(|p: &TraceRequest| p.timestamp).filter(|&p| p > r.timestamp) {
            return Err(TraceError::TimestampBackwards { line, timestamp: r.timestamp, previous: prev });
        }
        out.push(r);
    }
    if out.is_empty() {
        return Err(TraceError::Empty);
    }
    Ok(out)
}

/// How trace requests become requests to send.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ReplayOptions {
    /// Tokens (words) each hash id stands for here, instead of 512; lengths scale alike.
    pub block_tokens: u64,
    /// Arrival times are the timestamps divided by this (2: twice as fast).
    pub time_scale: f64,
    /// Prompts longer than this many tokens (after scaling) keep only their head.
    pub max_input_tokens: u64,
    /// `max_tokens` is the trace's output length, capped at this.
    pub max_output_tokens: u64,
}

impl ReplayOptions {
    pub fn validate(&self) -> Result<(), ReplayOptionsError> {
        if !(1..=TRACE_BLOCK_TOKENS).contains(&self.block_tokens) {
            return Err(ReplayOptionsError::BlockTokens(self.block_tokens));
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(ReplayOptionsError::TimeScale(self.time_scale));
        }
        if self.max_input_tokens == 0 || self.max_output_tokens == 0 {
            return Err(ReplayOptionsError::ZeroCap);
        }
        Ok(())
    }
}

/// The words hash id `id` stands for: `n` of them, a function of `(id, n)` only.
pub fn block_words(id: u64, n: u64) -> impl Iterator<Item = &'static str> {
    let mut rng = StdRng::seed_from_u64(id ^ 0x7472_6163_6500_0000);
    (0..n).map(move |_| WORDS[rng.random_range(0..WORDS.len())])
}

/// A trace ready to replay.
#[derive(Debug, Clone)]
pub struct Replay {
    requests: Arc<[TraceRequest]>,
    opts: ReplayOptions,
}

impl Replay {
    pub fn new(requests: Vec<TraceRequest>, opts: ReplayOptions) -> Result<Replay, ReplayOptionsError> {
        opts.validate()?;
        Ok(Replay { requests: requests.into(), opts })
    }

    pub fn options(&self) -> &ReplayOptions {
        &self.opts
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Prompt tokens of request `i`: its input length scaled, capped, at least 1.
    pub fn prompt_tokens(&self, i: usize) -> u64 {
        let r = &self.requests[i];
        (r.input_length * self.opts.block_tokens).div_ceil(TRACE_BLOCK_TOKENS).clamp(1, self.opts.max_input_tokens)
    }

    pub fn max_tokens(&self, i: usize) -> u64 {
        self.requests[i].output_length.clamp(1, self.opts.max_output_tokens)
    }

    /// When request `i` is sent, from the start of the run (the first request's timestamp).
    pub fn offset(&self, i: usize) -> Duration {
        let t0 = self.requests[0].timestamp;
        Duration::from_secs_f64((self.requests[i].timestamp - t0) as f64 / 1e3 / self.opts.time_scale)
    }

    pub fn offsets(&self) -> Vec<Duration> {
        (0..self.len()).map(|i| self.offset(i)).collect()
    }

    /// The prompt of request `i`: its blocks' words, cut at its (scaled) input length.
    pub fn prompt(&self, i: usize) -> String {
        let (b, n) = (self.opts.block_tokens, self.prompt_tokens(i));
        let mut words = self.requests[i].hash_ids.iter().flat_map(|&id| block_words(id, b)).take(n as usize);
        let mut s = String::with_capacity(n as usize * 5);
        if let Some(w) = words.next() {
            s.push_str(w);
        }
        for w in words {
            s.push(' ');
            s.push_str(w);
        }
        s
    }

    /// Request `i` as a one-turn conversation. Its prefix id (pd-prefix-affinity's key) is its
    /// second block, the first after a prompt every request may share, so the requests of one
    /// conversation share it.
    pub fn conversation(&self, i: usize) -> Conversation {
        let ids = &self.requests[i].hash_ids;
        let key = ids.get(1).unwrap_or(&ids[0]);
        Conversation {
            id: i,
            prefix_id: Some(*key as usize),
            system: None,
            user_turns: vec![self.prompt(i)],
            max_tokens: vec![self.max_tokens(i)],
        }
    }

    /// Distinct blocks of the whole replay, in the simulator's `kv_block_tokens`-token KV
    /// blocks (what every prompt's cache would take at once).
    pub fn distinct_kv_blocks(&self, kv_block_tokens: u64) -> u64 {
        let mut ids: Vec<u64> = self.requests.iter().flat_map(|r| r.hash_ids.iter().copied()).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len() as u64 * self.opts.block_tokens.div_ceil(kv_block_tokens)
    }

    /// The longest prompt plus output, in tokens.
    pub fn max_request_tokens(&self) -> u64 {
        (0..self.len()).map(|i| self.prompt_tokens(i) + self.max_tokens(i)).max().unwrap_or(0)
    }

    /// The summary for the report: requests, span, mean prompt and output tokens.
    pub fn describe(&self) -> String {
        let n = self.len().max(1) as f64;
        let prompt: u64 = (0..self.len()).map(|i| self.prompt_tokens(i)).sum();
        let output: u64 = (0..self.len()).map(|i| self.max_tokens(i)).sum();
        let span = self.len().checked_sub(1).map_or(Duration::ZERO, |last| self.offset(last));
        let o = &self.opts;
        format!(
            "{} trace requests over {:.1} s (time scale {}), {} tokens per 512-token block, prompts capped at {} \
             tokens (mean {:.0}), outputs capped at {} (mean {:.0})",
            self.len(),
            span.as_secs_f64(),
            o.time_scale,
            o.block_tokens,
            o.max_input_tokens,
            prompt as f64 / n,
            o.max_output_tokens,
            output as f64 / n
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("../tests/data/mooncake_conversation_head.jsonl");

    fn opts(block_tokens: u64) -> ReplayOptions {
        ReplayOptions { block_tokens, time_scale: 2.0, max_input_tokens: 1 << 20, max_output_tokens: 64 }
    }

    fn line(s: &str) -> Result<TraceRequest, TraceError> {
        parse_line(s, 7)
    }

    #[test]
    fn reads_the_public_sample() {
        let rs = read(SAMPLE.as_bytes(), usize::MAX).unwrap();
        assert_eq!(rs.len(), 200);
        assert_eq!(rs[0].input_length, 6758);
        assert_eq!(rs[0].hash_ids, (0..14).collect::<Vec<u64>>());
        assert_eq!(read(SAMPLE.as_bytes(), 20).unwrap(), rs[..20]);
        // The limit stops reading: garbage after it is never seen.
        let with_garbage = format!("{}\nnot json\n", SAMPLE.lines().next().unwrap());
        assert_eq!(read(with_garbage.as_bytes(), 1).unwrap().len(), 1);
    }

    #[test]
    fn garbage_lines_are_typed_errors_naming_the_line() {
        assert!(matches!(line("not json"), Err(TraceError::Json { line: 7, .. })));
        assert!(matches!(line("{}"), Err(TraceError::Json { .. })));
        assert!(matches!(line("[1, 2]"), Err(TraceError::Json { .. })));
        let ok = r#"{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}"#;
        assert_eq!(line(ok).unwrap().hash_ids, [1, 2]);
        let bad = |s: &str| line(&ok.replace(s.split('|').next().unwrap(), s.split('|').nth(1).unwrap()));
        assert!(matches!(bad("\"timestamp\": 5|\"timestamp\": -5"), Err(TraceError::Json { .. })));
        assert!(matches!(bad("\"input_length\": 600|\"input_length\": \"600\""), Err(TraceError::Json { .. })));
        assert!(matches!(bad("[1, 2]|[1.5]"), Err(TraceError::Json { .. })));
        assert!(matches!(bad("[1, 2]|[]"), Err(TraceError::NoBlocks { line: 7 })));
        assert!(matches!(
            bad("\"input_length\": 600|\"input_length\": 1025"),
            Err(TraceError::BadInputLength { input_length: 1025, blocks: 2, max: 1024, .. })
        ));
        assert!(matches!(bad("\"input_length\": 600|\"input_length\": 0"), Err(TraceError::BadInputLength { .. })));
        assert!(matches!(
            bad("\"output_length\": 3|\"output_length\": 9999999999"),
            Err(TraceError::OutputTooLong { .. })
        ));
        assert!(matches!(
            bad("\"timestamp\": 5|\"timestamp\": 99999999999999"),
            Err(TraceError::TimestampTooLate { .. })
        ));
        let many = format!("[{}]", vec!["1"; MAX_BLOCKS + 1].join(","));
        assert!(matches!(line(&ok.replace("[1, 2]", &many)), Err(TraceError::TooManyBlocks { blocks: 4097, .. })));
        // Unknown extra fields are tolerated (other traces of the format carry more).
        assert!(line(&ok.replace("{", "{\"session\": 3, ")).is_ok());

        // Through the reader: blank lines are skipped but counted, errors name the file line.
        let text = format!("{ok}\n\n{ok}\n{{\"timestamp\": 1\n");
        assert!(matches!(read(text.as_bytes(), 10), Err(TraceError::Json { line: 4, .. })));
        let earlier = ok.replace("\"timestamp\": 5", "\"timestamp\": 4");
        assert!(matches!(
            read(format!("{ok}\n{earlier}\n").as_bytes(), 10),
            Err(TraceError::TimestampBackwards { line: 2, timestamp: 4, previous: 5 })
        ));
        assert!(matches!(read("\n\n".as_bytes(), 10), Err(TraceError::Empty)));
        let long = format!("{ok}\n{}\n", " ".repeat(MAX_LINE_BYTES + 10));
        assert!(matches!(read(long.as_bytes(), 10), Err(TraceError::LineTooLong { line: 2 })));
        assert!(matches!(read(&[0xff, 0xfe, b'\n'][..], 10), Err(TraceError::Json { line: 1, .. })));
        // Every prefix of a valid line is an error or the line itself, never a panic.
        for cut in 0..ok.len() {
            let _ = read(&ok.as_bytes()[..cut], 10);
        }
    }

    #[test]
    fn equal_hash_ids_are_equal_words_and_lengths_scale() {
        let rs = read(SAMPLE.as_bytes(), 200).unwrap();
        let replay = Replay::new(rs.clone(), opts(32)).unwrap();
        // Request 0: 6758 of 14 × 512 tokens → 423 of 14 × 32 words.
        assert_eq!(replay.prompt_tokens(0), 423);
        let p0 = replay.prompt(0);
        assert_eq!(p0.split(' ').count(), 423);
        assert!(p0.split(' ').all(|w| WORDS.contains(&w)));
        // Requests 0 and 1 share hash id 0 only: their first 32 words agree, the next block not.
        let p1 = replay.prompt(1);
        let w0: Vec<&str> = p0.split(' ').collect();
        let w1: Vec<&str> = p1.split(' ').collect();
        assert_eq!(w0[..32], w1[..32]);
        assert_ne!(w0[32..64], w1[32..64]);
        // A request that shares a longer prefix shares exactly its blocks' words.
        let (i, j, shared) = (0..rs.len())
            .flat_map(|j| (0..j).map(move |i| (i, j)))
            .map(|(i, j)| (i, j, rs[i].hash_ids.iter().zip(&rs[j].hash_ids).take_while(|(a, b)| a == b).count()))
            .max_by_key(|&(_, _, s)| s)
            .unwrap();
        assert!(shared > 1, "the sample has a conversation continued");
        let (pi, pj) = (replay.prompt(i), replay.prompt(j));
        let common = pi.split(' ').zip(pj.split(' ')).take_while(|(a, b)| a == b).count();
        assert!(common >= (shared as u64 * 32).min(replay.prompt_tokens(i)) as usize, "{common} {shared}");
        assert_eq!(replay.prompt(i), Replay::new(rs.clone(), opts(32)).unwrap().prompt(i), "deterministic");
        // Output capped, arrivals compressed by the time scale.
        assert_eq!(replay.max_tokens(0), 64);
        assert_eq!(replay.max_tokens(4), 3);
        assert_eq!(replay.offset(0), Duration::ZERO);
        assert_eq!(replay.offsets().last().copied(), Some(Duration::from_millis(rs[199].timestamp / 2)));
        // The input cap keeps the head of the prompt.
        let capped = Replay::new(rs, ReplayOptions { max_input_tokens: 40, ..opts(32) }).unwrap();
        assert_eq!(capped.prompt(0), w0[..40].join(" "));
        let c = capped.conversation(1);
        assert_eq!((c.prefix_id, c.max_tokens.as_slice(), c.user_turns.len()), (Some(14), &[64][..], 1));
        assert!(
            capped.describe().starts_with("200 trace requests over 36.0 s (time scale 2)"),
            "{}",
            capped.describe()
        );
    }

    #[test]
    fn options_are_checked() {
        let rs = read(SAMPLE.as_bytes(), 1).unwrap();
        assert_eq!(Replay::new(rs.clone(), opts(0)).unwrap_err(), ReplayOptionsError::BlockTokens(0));
        assert_eq!(Replay::new(rs.clone(), opts(513)).unwrap_err(), ReplayOptionsError::BlockTokens(513));
        let nan = ReplayOptions { time_scale: f64::NAN, ..opts(16) };
        assert!(matches!(Replay::new(rs.clone(), nan), Err(ReplayOptionsError::TimeScale(_))));
        let zero = ReplayOptions { max_output_tokens: 0, ..opts(16) };
        assert_eq!(Replay::new(rs.clone(), zero).unwrap_err(), ReplayOptionsError::ZeroCap);
        let r = Replay::new(rs, opts(24)).unwrap();
        // 14 distinct ids of 24 tokens: 2 KV blocks of 16 each.
        assert_eq!(r.distinct_kv_blocks(16), 28);
        // 6758 × 24 / 512 = 316.8 prompt tokens, rounded up, and 500 output tokens capped at 64.
        assert_eq!(r.max_request_tokens(), 317 + 64);
    }
}
