//! The bench's own plain-TCP protocol between initiator and target: the raw-tcp baseline's
//! data requests and the control requests of `--check`. All integers little-endian u64.
//!
//! A request header is three words padded to [`HEADER_LEN`] bytes. The padding is deliberate:
//! where a payload starts in the stream changes the kernel's copy rate severalfold on some
//! machines (bench/README.md, "Payload alignment"), and the baseline is meant to show the
//! machine's ceiling. A READ's payload comes back with nothing in front of it.
//!
//! | request | header `(cmd, len, seed)` then | target answers |
//! |---|---|---|
//! | WRITE | `len` payload bytes | a [`Reply`] (the ack) |
//! | READ | — | `len` payload bytes |
//! | FILL / VERIFY | — | a [`Reply`]; acts on the connection's raw buffer `[0, len)` |
//! | REGION_FILL | — | a [`Reply`]; fills the registered region `[0, len)` |
//! | REGION_VERIFY | `len` ranges of `(offset, length)` | a [`Reply`] |
//! | GRANT | `seed` bytes of the initiator agent's name, `len` ranges | a [`Reply`]; on `Ok`, a token length word and the token |

/// What a request asks the target to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmd {
    Write = 1,
    Read = 2,
    Fill = 3,
    Verify = 4,
    RegionFill = 5,
    RegionVerify = 6,
    /// Grant the initiator agent the ranges of the registered region (`--grants`).
    Grant = 7,
}

impl Cmd {
    fn from_code(code: u64) -> Option<Cmd> {
        [Cmd::Write, Cmd::Read, Cmd::Fill, Cmd::Verify, Cmd::RegionFill, Cmd::RegionVerify, Cmd::Grant]
            .into_iter()
            .find(|c| *c as u64 == code)
    }
}

/// A request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub cmd: Cmd,
    /// Payload bytes, buffer bytes, or the number of ranges (REGION_VERIFY).
    pub len: u64,
    /// Pattern seed of the check requests.
    pub seed: u64,
}

/// A header or reply that is not one of ours.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("unknown command {0}")]
    UnknownCommand(u64),
    #[error("bad reply ({status}, {detail})")]
    BadReply { status: u64, detail: u64 },
}

pub const HEADER_LEN: usize = 128;
pub const REPLY_LEN: usize = 16;
pub const RANGE_LEN: usize = 16;

impl Header {
    pub fn new(cmd: Cmd, len: u64) -> Header {
        Header { cmd, len, seed: 0 }
    }

    pub fn encode(&self) -> [u8; HEADER_LEN] {
        words([self.cmd as u64, self.len, self.seed])
    }

    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
        let [cmd, len, seed] = unwords(bytes);
        let cmd = Cmd::from_code(cmd).ok_or(WireError::UnknownCommand(cmd))?;
        Ok(Header { cmd, len, seed })
    }
}

/// Why the target refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Larger than the target's memory cap.
    TooLarge = 1,
    /// No registered region (a raw-tcp-only target).
    NoRegion = 2,
    /// A range outside the registered region.
    OutOfRange = 3,
    /// Reading or writing the region failed (a file or GPU error; the target prints it).
    RegionIo = 4,
    /// The backend would not issue the grant (the target prints why).
    Grant = 5,
}

/// The target's answer to a request that has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reply {
    Ok,
    /// The first byte that differs from the pattern, as an offset in the checked buffer/region.
    Mismatch(u64),
    Refused(Refusal),
}

impl Reply {
    pub fn encode(&self) -> [u8; REPLY_LEN] {
        let pair = match *self {
            Reply::Ok => [0, 0],
            Reply::Mismatch(offset) => [1, offset],
            Reply::Refused(why) => [2, why as u64],
        };
        words(pair)
    }

    pub fn decode(bytes: &[u8; REPLY_LEN]) -> Result<Reply, WireError> {
        match unwords(bytes) {
            [0, _] => Ok(Reply::Ok),
            [1, offset] => Ok(Reply::Mismatch(offset)),
            [2, 1] => Ok(Reply::Refused(Refusal::TooLarge)),
            [2, 2] => Ok(Reply::Refused(Refusal::NoRegion)),
            [2, 3] => Ok(Reply::Refused(Refusal::OutOfRange)),
            [2, 4] => Ok(Reply::Refused(Refusal::RegionIo)),
            [2, 5] => Ok(Reply::Refused(Refusal::Grant)),
            [status, detail] => Err(WireError::BadReply { status, detail }),
        }
    }
}

/// Encodes REGION_VERIFY's `(offset, length)` ranges.
pub fn encode_ranges(ranges: &[(u64, u64)]) -> Vec<u8> {
    ranges.iter().flat_map(|&(offset, len)| words::<RANGE_LEN, 2>([offset, len])).collect()
}

/// Decodes ranges encoded by [`encode_ranges`].
pub fn decode_ranges(bytes: &[u8]) -> Vec<(u64, u64)> {
    bytes
        .chunks_exact(RANGE_LEN)
        .map(|chunk| {
            let [offset, len] = unwords::<RANGE_LEN, 2>(chunk.try_into().expect("exact chunk"));
            (offset, len)
        })
        .collect()
}

fn words<const B: usize, const W: usize>(values: [u64; W]) -> [u8; B] {
    let mut out = [0u8; B];
    for (chunk, value) in out.chunks_exact_mut(8).zip(values) {
        chunk.copy_from_slice(&value.to_le_bytes());
    }
    out
}

fn unwords<const B: usize, const W: usize>(bytes: &[u8; B]) -> [u64; W] {
    let mut out = [0u64; W];
    for (value, chunk) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        *value = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let header = Header { cmd: Cmd::RegionVerify, len: 2048, seed: u64::MAX };
        let encoded = header.encode();
        assert!(encoded[24..].iter().all(|&b| b == 0), "zero padding");
        assert_eq!(Header::decode(&encoded), Ok(header));
        let mut bad = Header::new(Cmd::Write, 1).encode();
        bad[0] = 99;
        assert!(Header::decode(&bad).is_err());
    }

    #[test]
    fn replies_round_trip() {
        for reply in
            [Reply::Ok, Reply::Mismatch(12345), Reply::Refused(Refusal::OutOfRange), Reply::Refused(Refusal::Grant)]
        {
            assert_eq!(Reply::decode(&reply.encode()), Ok(reply));
        }
        assert!(Reply::decode(&words([2, 9])).is_err());
    }

    #[test]
    fn ranges_round_trip() {
        let ranges = vec![(0, 4096), (1 << 40, 16384)];
        let bytes = encode_ranges(&ranges);
        assert_eq!(bytes.len(), 2 * RANGE_LEN);
        assert_eq!(decode_ranges(&bytes), ranges);
    }
}
