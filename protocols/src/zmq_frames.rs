//! vLLM's KV-event transport over ZeroMQ, without the sockets: the 3-frame PUB message, the
//! replay protocol, a publisher's replay buffer and a subscriber's sequence check.
//!
//! PUB message: `[topic, sequence (u64 big-endian, from 0 per publisher), msgpack batch]`.
//! Replay (ROUTER): the client sends the start sequence (8 bytes big-endian); the publisher
//! answers `[seq, payload]` for each buffered batch from there on, then `[ff × 8, empty]`.
//! Data parallel: each rank has its own publisher (own sequence, own replay buffer) on the
//! configured endpoints offset by its rank ([`rank_endpoint`]).

use std::collections::VecDeque;

pub const REPLAY_END: [u8; 8] = [0xff; 8];

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: usize, got: usize },
    #[error("sequence frame of {0} bytes (expected 8)")]
    BadSequence(usize),
}

pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

pub fn parse_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| FrameError::BadSequence(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Splits a received PUB message into `(topic, sequence, payload)`.
pub fn parse_pub<F: AsRef<[u8]>>(frames: &[F]) -> Result<(&[u8], u64, &[u8]), FrameError> {
    match frames {
        [topic, seq, payload] => Ok((topic.as_ref(), parse_seq(seq.as_ref())?, payload.as_ref())),
        _ => Err(FrameError::FrameCount { expected: 3, got: frames.len() }),
    }
}

/// One replay reply: `Some((seq, payload))`, or `None` for the end marker.
pub fn parse_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<Option<(u64, &[u8])>, FrameError> {
    match frames {
        [seq, _] if seq.as_ref() == REPLAY_END => Ok(None),
        [seq, payload] => Ok(Some((parse_seq(seq.as_ref())?, payload.as_ref()))),
        _ => Err(FrameError::FrameCount { expected: 2, got: frames.len() }),
    }
}

/// The publisher's numbering and its bounded buffer of recent batches for replay.
#[derive(Debug)]
pub struct ReplayBuffer {
    capacity: usize,
    next_seq: u64,
    entries: VecDeque<(u64, Vec<u8>)>,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        ReplayBuffer { capacity: capacity.max(1), next_seq: 0, entries: VecDeque::new() }
    }

    /// Numbers a batch, keeps it for replay, returns its sequence.
    pub fn push(&mut self, payload: Vec<u8>) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.entries.len() == self.capacity {
            self.entries.pop_front();
        }
        self.entries.push_back((seq, payload));
        seq
    }

    /// Buffered batches from `start` on (fewer if the oldest were dropped).
    pub fn since(&self, start: u64) -> impl Iterator<Item = (u64, &[u8])> {
        self.entries.iter().filter(move |(seq, _)| *seq >= start).map(|(seq, p)| (*seq, p.as_slice()))
    }

    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
}

/// What a subscriber learns from the next sequence number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqCheck {
    /// The first message seen, or the one after the last.
    InOrder,
    /// Messages `expected .. got` were missed: replay them or rebuild.
    Gap { expected: u64, got: u64 },
    /// The sequence went backwards: the publisher restarted; rebuild its state.
    Restarted { got: u64 },
}

/// Tracks one publisher's sequence.
#[derive(Clone, Debug, Default)]
pub struct SeqTracker {
    last: Option<u64>,
}

impl SeqTracker {
    pub fn observe(&mut self, seq: u64) -> SeqCheck {
        let check = match self.last {
            // A subscriber joining late sees a nonzero first sequence: replay from 0 fills it.
            None if seq == 0 => SeqCheck::InOrder,
            None => SeqCheck::Gap { expected: 0, got: seq },
            Some(last) if seq == last.wrapping_add(1) => SeqCheck::InOrder,
            Some(last) if seq > last => SeqCheck::Gap { expected: last + 1, got: seq },
            Some(_) => SeqCheck::Restarted { got: seq },
        };
        self.last = Some(seq);
        check
    }

    pub fn last(&self) -> Option<u64> {
        self.last
    }
}

/// Why an endpoint has no form for a data-parallel rank.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RankEndpointError {
    #[error("{endpoint:?} has no port to offset by data-parallel rank {rank}")]
    NoPort { endpoint: String, rank: u32 },
    #[error("{endpoint:?} offset by data-parallel rank {rank} passes port 65535")]
    PortOverflow { endpoint: String, rank: u32 },
    #[error("{endpoint:?}: vLLM offsets only tcp and inproc endpoints by data-parallel rank")]
    Unsupported { endpoint: String },
}

/// The endpoint data-parallel rank `rank` of a vLLM engine publishes on (or serves replay on)
/// when configured with `endpoint`: vLLM adds the rank to a tcp port (bind and connect forms
/// alike) and appends `_dp{rank}` to an inproc name; rank 0 keeps the endpoint as it is.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, RankEndpointError> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    let Some(rest) = endpoint.strip_prefix("tcp://") else {
        return Err(RankEndpointError::Unsupported { endpoint: endpoint.to_string() });
    };
    let no_port = || RankEndpointError::NoPort { endpoint: endpoint.to_string(), rank };
    let (host, port) = rest.rsplit_once(':').ok_or_else(no_port)?;
    let port: u16 = port.parse().map_err(|_| no_port())?;
    let offset = u16::try_from(rank)
        .ok()
        .and_then(|r| port.checked_add(r))
        .ok_or_else(|| RankEndpointError::PortOverflow { endpoint: endpoint.to_string(), rank })?;
    Ok(format!("tcp://{host}:{offset}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pub_frames_and_replay_replies() {
        let frames = [b"kv-events".to_vec(), seq_frame(5).to_vec(), b"payload".to_vec()];
        assert_eq!(parse_pub(&frames), Ok((&b"kv-events"[..], 5, &b"payload"[..])));
        assert!(parse_pub(&frames[..2]).is_err());
        assert_eq!(parse_seq(&[0; 7]), Err(FrameError::BadSequence(7)));
        assert_eq!(parse_replay_reply(&[REPLAY_END.to_vec(), vec![]]), Ok(None));
        assert_eq!(parse_replay_reply(&[seq_frame(3).to_vec(), b"x".to_vec()]), Ok(Some((3, &b"x"[..]))));
    }

    #[test]
    fn replay_buffer_is_bounded() {
        let mut buffer = ReplayBuffer::new(3);
        for i in 0..5u8 {
            assert_eq!(buffer.push(vec![i]), u64::from(i));
        }
        let kept: Vec<u64> = buffer.since(0).map(|(s, _)| s).collect();
        assert_eq!(kept, vec![2, 3, 4]);
        assert_eq!(buffer.since(4).count(), 1);
        assert_eq!(buffer.next_seq(), 5);
    }

    #[test]
    fn sequence_checks() {
        let mut tracker = SeqTracker::default();
        assert_eq!(tracker.observe(0), SeqCheck::InOrder);
        assert_eq!(tracker.observe(1), SeqCheck::InOrder);
        assert_eq!(tracker.observe(4), SeqCheck::Gap { expected: 2, got: 4 });
        assert_eq!(tracker.observe(0), SeqCheck::Restarted { got: 0 });
        let mut late = SeqTracker::default();
        assert_eq!(late.observe(7), SeqCheck::Gap { expected: 0, got: 7 });
    }

    #[test]
    fn rank_endpoints_follow_vllm() {
        assert_eq!(rank_endpoint("tcp://*:5557", 0).unwrap(), "tcp://*:5557");
        assert_eq!(rank_endpoint("tcp://*:5557", 3).unwrap(), "tcp://*:5560");
        assert_eq!(rank_endpoint("tcp://[::1]:5557", 1).unwrap(), "tcp://[::1]:5558");
        assert_eq!(rank_endpoint("tcp://collector:6000", 2).unwrap(), "tcp://collector:6002");
        assert_eq!(rank_endpoint("inproc://cache", 2).unwrap(), "inproc://cache_dp2");
        assert_eq!(rank_endpoint("ipc:///tmp/e", 0).unwrap(), "ipc:///tmp/e");
        assert!(matches!(rank_endpoint("ipc:///tmp/e", 1), Err(RankEndpointError::Unsupported { .. })));
        assert!(matches!(rank_endpoint("tcp://host", 1), Err(RankEndpointError::NoPort { .. })));
        assert!(matches!(rank_endpoint("tcp://host:x", 1), Err(RankEndpointError::NoPort { .. })));
        assert!(matches!(rank_endpoint("tcp://h:65535", 1), Err(RankEndpointError::PortOverflow { .. })));
        assert!(matches!(rank_endpoint("tcp://h:1", 70_000), Err(RankEndpointError::PortOverflow { .. })));
    }
}
