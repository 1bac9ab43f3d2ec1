//! The data both processes agree on: a seekable pseudo-random byte pattern and a 64-bit hash.
//!
//! The pattern is counter-based (byte `p` of seed `s` depends only on `s` and `p`), so any
//! range of it can be produced without the bytes before it: the test and the peer generate the
//! same bytes for a range independently, and a transfer that moves bytes to the wrong place or
//! in the wrong order shows up as a mismatch.

use xfer::{BackendBuffer, HostBuffer, HostRegion};

/// Memory the pattern helpers read and write through copies: a `HostBuffer`, or a
/// `BackendBuffer` a backend allocated (both are a [`HostRegion`] underneath).
pub trait Buffer {
    fn region(&self) -> &HostRegion;
    fn len(&self) -> usize {
        self.region().len()
    }
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.region().read_at(offset, dst)
    }
    fn write_at(&self, offset: usize, src: &[u8]) {
        self.region().write_at(offset, src)
    }
}

impl Buffer for HostBuffer {
    fn region(&self) -> &HostRegion {
        self
    }
}

impl Buffer for BackendBuffer {
    fn region(&self) -> &HostRegion {
        self
    }
}

impl<T: Buffer + ?Sized> Buffer for std::sync::Arc<T> {
    fn region(&self) -> &HostRegion {
        (**self).region()
    }
}

/// Pieces large buffers are processed in, so 256 MiB checks never allocate 256 MiB. A multiple
/// of 8 so the hash's word boundaries do not depend on the piece size.
pub const PIECE: usize = 4 << 20;

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finaliser: a cheap, well-mixed bijection of `u64`.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn word(seed: u64, index: u64) -> [u8; 8] {
    mix(seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN))).to_le_bytes()
}

/// Writes bytes `pos .. pos + out.len()` of the pattern of `seed` into `out`.
pub fn fill_pattern(seed: u64, pos: u64, out: &mut [u8]) {
    let mut index = pos / 8;
    let skip = (pos % 8) as usize;
    let mut rest = out;
    if skip != 0 {
        let head = (8 - skip).min(rest.len());
        rest[..head].copy_from_slice(&word(seed, index)[skip..skip + head]);
        rest = &mut rest[head..];
        index += 1;
    }
    let mut words = rest.chunks_exact_mut(8);
    for chunk in &mut words {
        chunk.copy_from_slice(&word(seed, index));
        index += 1;
    }
    let tail = words.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&word(seed, index)[..n]);
}

/// `len` bytes of the pattern of `seed` from `pos` (for small ranges; large ones go by piece).
pub fn pattern(seed: u64, pos: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    fill_pattern(seed, pos, &mut out);
    out
}

/// A streaming 64-bit hash over little-endian words: each step is a bijection of the state, so
/// changing any single word always changes the result. Not cryptographic; it detects
/// corruption, misplacement and reordering, which is all a transfer check needs.
#[derive(Clone, Debug)]
pub struct Hasher {
    state: u64,
    pending: [u8; 8],
    pending_len: usize,
    total: u64,
}

impl Default for Hasher {
    fn default() -> Self {
        Hasher { state: GOLDEN, pending: [0; 8], pending_len: 0, total: 0 }
    }
}

impl Hasher {
    fn step(&mut self, w: u64) {
        self.state = (self.state ^ w).wrapping_mul(GOLDEN).rotate_left(29);
    }

    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total += bytes.len() as u64;
        if self.pending_len > 0 {
            let take = (8 - self.pending_len).min(bytes.len());
            self.pending[self.pending_len..self.pending_len + take].copy_from_slice(&bytes[..take]);
            self.pending_len += take;
            bytes = &bytes[take..];
            if self.pending_len < 8 {
                return;
            }
            self.step(u64::from_le_bytes(self.pending));
            self.pending_len = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for chunk in &mut words {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            self.step(u64::from_le_bytes(w));
        }
        let tail = words.remainder();
        self.pending[..tail.len()].copy_from_slice(tail);
        self.pending_len = tail.len();
    }

    pub fn finish(mut self) -> u64 {
        if self.pending_len > 0 {
            self.pending[self.pending_len..].fill(0);
            self.step(u64::from_le_bytes(self.pending));
        }
        // The length keeps a range and its zero-padded extension apart.
        mix(self.state ^ mix(self.total))
    }
}

pub fn hash(bytes: &[u8]) -> u64 {
    let mut hasher = Hasher::default();
    hasher.update(bytes);
    hasher.finish()
}

/// The hash of `len` pattern bytes of `seed` from `pos`, as the peer would compute it over a
/// range holding exactly those bytes.
pub fn pattern_hash(seed: u64, pos: u64, len: u64) -> u64 {
    let mut hasher = Hasher::default();
    let mut piece = vec![0u8; PIECE.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        fill_pattern(seed, pos + done, &mut piece[..n]);
        hasher.update(&piece[..n]);
        done += n as u64;
    }
    hasher.finish()
}

/// Whether `off .. off + len` lies inside `buf` (the peer checks this before touching memory:
/// `HostBuffer` panics on out-of-range access).
pub fn in_range(buf: &(impl Buffer + ?Sized), off: u64, len: u64) -> bool {
    off.checked_add(len).is_some_and(|end| end <= buf.len() as u64)
}

/// Writes pattern bytes `pos .. pos + len` of `seed` into `buf` at `off`. The range must be in
/// the buffer.
pub fn write_pattern(buf: &(impl Buffer + ?Sized), off: u64, seed: u64, pos: u64, len: u64) {
    let mut piece = vec![0u8; PIECE.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        fill_pattern(seed, pos + done, &mut piece[..n]);
        buf.write_at((off + done) as usize, &piece[..n]);
        done += n as u64;
    }
}

/// The hash of `buf[off .. off + len]`. The range must be in the buffer.
pub fn hash_range(buf: &(impl Buffer + ?Sized), off: u64, len: u64) -> u64 {
    let mut hasher = Hasher::default();
    let mut piece = vec![0u8; PIECE.min(len as usize)];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        buf.read_at((off + done) as usize, &mut piece[..n]);
        hasher.update(&piece[..n]);
        done += n as u64;
    }
    hasher.finish()
}

/// Compares `buf[off .. off + len]` with pattern bytes `pos .. pos + len` of `seed`; on a
/// mismatch returns the index (from `off`) of the first differing byte.
pub fn check_pattern(buf: &(impl Buffer + ?Sized), off: u64, seed: u64, pos: u64, len: u64) -> Result<(), u64> {
    let size = PIECE.min(len as usize);
    let (mut have, mut want) = (vec![0u8; size], vec![0u8; size]);
    let mut done = 0;
    while done < len {
        let n = (len - done).min(PIECE as u64) as usize;
        buf.read_at((off + done) as usize, &mut have[..n]);
        fill_pattern(seed, pos + done, &mut want[..n]);
        if have[..n] != want[..n] {
            let at = have[..n].iter().zip(&want[..n]).position(|(a, b)| a != b).unwrap_or(0);
            return Err(done + at as u64);
        }
        done += n as u64;
    }
    Ok(())
}

/// Makes a notification printable on one line of the peer protocol: bytes outside `!..=~`,
/// and `,` and `%`, become `%XX`.
pub fn escape(message: &[u8]) -> String {
    let mut out = String::with_capacity(message.len());
    for &b in message {
        if (0x21..=0x7e).contains(&b) && b != b',' && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The notification the peer checks on arrival: the hash it must find in that range.
pub fn check_message(seq: &str, off: u64, len: u64, hash: u64) -> String {
    format!("check:{seq}:{off}:{len}:{hash:016x}")
}

/// A parsed `check:SEQ:OFF:LEN:HASH` notification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub seq: String,
    pub off: u64,
    pub len: u64,
    pub hash: u64,
}

impl Check {
    pub fn parse(message: &[u8]) -> Option<Check> {
        let text = std::str::from_utf8(message).ok()?.strip_prefix("check:")?;
        let mut parts = text.split(':');
        let check = Check {
            seq: parts.next()?.to_string(),
            off: parts.next()?.parse().ok()?,
            len: parts.next()?.parse().ok()?,
            hash: u64::from_str_radix(parts.next()?, 16).ok()?,
        };
        parts.next().is_none().then_some(check)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_seekable() {
        let whole = pattern(42, 0, 1000);
        for pos in [0u64, 1, 7, 8, 9, 15, 500, 999] {
            for len in [0usize, 1, 3, 8, 17] {
                let end = (pos as usize + len).min(1000);
                assert_eq!(pattern(42, pos, end - pos as usize), &whole[pos as usize..end], "{pos}+{len}");
            }
        }
        assert_ne!(pattern(42, 0, 64), pattern(43, 0, 64));
    }

    #[test]
    fn hash_is_independent_of_piece_boundaries() {
        let data = pattern(7, 3, 10_007);
        let whole = hash(&data);
        for split in [1usize, 5, 8, 13, 4096] {
            let mut hasher = Hasher::default();
            for piece in data.chunks(split) {
                hasher.update(piece);
            }
            assert_eq!(hasher.finish(), whole, "split {split}");
        }
        assert_eq!(pattern_hash(7, 3, 10_007), whole);
    }

    #[test]
    fn hash_sees_single_changes_and_length() {
        let data = pattern(1, 0, 4099);
        let base = hash(&data);
        for i in [0usize, 7, 8, 4098] {
            let mut bad = data.clone();
            bad[i] ^= 0x80;
            assert_ne!(hash(&bad), base, "byte {i}");
        }
        assert_ne!(hash(&[]), hash(&[0]));
        assert_ne!(hash(&[0]), hash(&[0, 0]));
        let mut swapped = data.clone();
        swapped.swap(0, 8);
        assert_ne!(hash(&swapped), base);
    }

    #[test]
    fn buffer_helpers_agree() {
        let buf = HostBuffer::new(9000);
        write_pattern(&buf, 11, 5, 100, 8000);
        assert_eq!(hash_range(&buf, 11, 8000), pattern_hash(5, 100, 8000));
        assert_eq!(check_pattern(&buf, 11, 5, 100, 8000), Ok(()));
        buf.write_at(20, &[0]);
        assert!(check_pattern(&buf, 11, 5, 100, 8000).is_err());
        assert!(!in_range(&buf, 8999, 2) && in_range(&buf, 8999, 1) && !in_range(&buf, u64::MAX, 2));
    }

    #[test]
    fn messages_escape_and_parse() {
        assert_eq!(escape(b"a,b%c d\n"), "a%2Cb%25c%20d%0A");
        let msg = check_message("17", 4096, 10, 0xabc);
        assert_eq!(Check::parse(msg.as_bytes()), Some(Check { seq: "17".into(), off: 4096, len: 10, hash: 0xabc }));
        assert_eq!(Check::parse(b"check:1:2:3"), None);
        assert_eq!(Check::parse(b"check:1:2:3:4:5"), None);
        assert_eq!(Check::parse(b"hello"), None);
    }
}
