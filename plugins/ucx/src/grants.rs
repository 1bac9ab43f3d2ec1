//! Revocable grants over UCX: the key a grant publishes, and the pure checks both sides make.
//!
//! A grant is its own memory handles: each granted range is mapped again (`ucp_mem_map`), so
//! it has an rkey of its own, and revoking unmaps them. On transports whose adapter enforces
//! keys (rc, ud, dc) that alone cuts a peer off. Over tcp and shared memory UCX emulates put and
//! get in the target's progress without looking at any key, so there a revocation is also an
//! exchange ([`crate::msg`]):
//! - the holder, loading the grant, sends `Hold` (its name and connection info) and waits for
//!   the target's acknowledgement before the grant is usable; the target thus knows every
//!   holder;
//! - `revoke` sends `Revoke` to each holder; a holder marks the grant revoked (later requests
//!   under it are refused with `Revoked` before any operation is posted), waits until its
//!   transfers in flight to the target are complete, destroys the grant's rkeys and
//!   acknowledges; the target unmaps the grant's handles once every holder acknowledged, or
//!   failed, or after the bound (see the crate docs).
//!
//! Key layout (integers little-endian):
//! ```text
//! "XUG1" | crc32 of the rest u32 | grant id u64 | deadline, Unix ms u64 | peer name len u8
//!        | peer name | pieces u16 | per piece: len u32 | a region key (`UcxRemoteKey`)
//! ```
//! A piece is a granted range with its own packed rkey, in the form of a region key.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use xfer_core::{BackendError, RefusalCode};

use crate::keys::{UcxRemoteKey, MAX_BLOB};

const MAGIC: [u8; 4] = *b"XUG1";
/// Pieces one grant may carry (one per merged range).
pub const MAX_PIECES: usize = 1 << 16;

/// A grant as published: who may use it, until when, and one key per granted range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxGrantKey {
    pub grant_id: u64,
    /// Milliseconds since the Unix epoch: the wall clock is what two processes share.
    pub deadline_ms: u64,
    pub peer: String,
    /// Sorted by base, not overlapping.
    pub pieces: Vec<UcxRemoteKey>,
}

fn bad(what: &str) -> BackendError {
    BackendError::InvalidMetadata(format!("ucx grant key: {what}"))
}

/// Why a descriptor under a grant is refused, before any operation is posted.
pub type Refusal = (RefusalCode, String);

impl UcxGrantKey {
    pub fn is_grant_key(bytes: &[u8]) -> bool {
        bytes.starts_with(&MAGIC)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.grant_id.to_le_bytes());
        out.extend_from_slice(&self.deadline_ms.to_le_bytes());
        let name = &self.peer.as_bytes()[..self.peer.len().min(255)];
        out.push(name.len() as u8);
        out.extend_from_slice(name);
        out.extend_from_slice(&(self.pieces.len().min(MAX_PIECES - 1) as u16).to_le_bytes());
        for piece in self.pieces.iter().take(MAX_PIECES - 1) {
            let key = piece.encode();
            out.extend_from_slice(&(key.len() as u32).to_le_bytes());
            out.extend_from_slice(&key);
        }
        let crc = crc32fast::hash(&out[8..]);
        out[4..8].copy_from_slice(&crc.to_le_bytes());
        out
    }

    /// Decodes untrusted bytes; never panics.
    pub fn decode(bytes: &[u8]) -> Result<UcxGrantKey, BackendError> {
        if !Self::is_grant_key(bytes) || bytes.len() < 8 {
            return Err(bad("bad magic or truncated"));
        }
        if crc32fast::hash(&bytes[8..]).to_le_bytes() != bytes[4..8] {
            return Err(bad("checksum mismatch"));
        }
        let mut rest = &bytes[8..];
        let mut take = |n: usize| -> Result<&[u8], BackendError> {
            if rest.len() < n {
                return Err(bad("truncated"));
            }
            let (head, tail) = rest.split_at(n);
            rest = tail;
            Ok(head)
        };
        let word = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        let grant_id = word(take(8)?);
        let deadline_ms = word(take(8)?);
        let name_len = usize::from(take(1)?[0]);
        let peer = String::from_utf8(take(name_len)?.to_vec()).map_err(|_| bad("peer name is not UTF-8"))?;
        let count = u16::from_le_bytes(take(2)?.try_into().unwrap_or([0; 2]));
        let mut pieces: Vec<UcxRemoteKey> = Vec::with_capacity(usize::from(count).min(1024));
        for _ in 0..count {
            let len = u32::from_le_bytes(take(4)?.try_into().unwrap_or([0; 4])) as usize;
            if len > MAX_BLOB + 64 {
                return Err(bad("piece too long"));
            }
            let piece = UcxRemoteKey::decode(take(len)?)?;
            if piece.is_local_only() || pieces.last().is_some_and(|last| last.base + last.len > piece.base) {
                return Err(bad("pieces unsorted, overlapping or without an rkey"));
            }
            pieces.push(piece);
        }
        if !rest.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(UcxGrantKey { grant_id, deadline_ms, peer, pieces })
    }

    /// Pure: whether `initiator` may move `len` bytes at `addr` under this grant at `now_ms`;
    /// `revoked` is what the initiator knows of it (`None`: never held, or long forgotten).
    /// Returns the piece whose rkey to use.
    pub fn admit(
        &self,
        initiator: &str,
        revoked: Option<bool>,
        now_ms: u64,
        addr: u64,
        len: u64,
    ) -> Result<&UcxRemoteKey, Refusal> {
        if self.peer != initiator {
            return Err((RefusalCode::UnknownKey, "key is not granted to this initiator".into()));
        }
        match revoked {
            Some(true) => return Err((RefusalCode::Revoked, "grant was revoked".into())),
            None => return Err((RefusalCode::Revoked, "grant is not held (revoked before it loaded)".into())),
            Some(false) => {}
        }
        if now_ms >= self.deadline_ms {
            return Err((RefusalCode::Revoked, "grant has expired".into()));
        }
        let candidate = self.pieces.partition_point(|p| p.base <= addr).checked_sub(1).map(|i| &self.pieces[i]);
        candidate
            .filter(|piece| piece.covers(addr, len))
            .ok_or_else(|| (RefusalCode::OutOfBounds, format!("remote {addr:#x}+{len} is outside the grant")))
    }

    /// The key ids of the pieces (the rkeys a holder unpacks).
    pub fn key_ids(&self) -> Vec<u64> {
        self.pieces.iter().map(|p| p.key_id).collect()
    }
}

/// What a holder knows of a grant it loaded (or heard revoked).
#[derive(Clone, Debug)]
pub struct Held {
    /// The connection (peer id) it was held through, where transfers under it run.
    pub peer_id: Option<u64>,
    /// The ids of its pieces' rkeys.
    pub key_ids: Vec<u64>,
    pub revoked: bool,
    /// Forgotten after this (its deadline refuses it by then anyway).
    pub forget_after: std::time::Instant,
}

/// How long past its deadline a grant is remembered by either side.
pub const REMEMBER_AFTER_EXPIRY: Duration = Duration::from_secs(60);

/// Milliseconds since the Unix epoch of `at` (0 before it).
pub fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The wall-clock deadline of a grant that lasts `ttl` from now.
pub fn deadline_after(ttl: Duration) -> u64 {
    unix_ms(SystemTime::now()).saturating_add(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX))
}

/// A fresh grant id: unguessable enough that a stray revocation names no other grant (the
/// hasher's keys come from the operating system's randomness).
pub fn fresh_id(counter: u64) -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(counter);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(key_id: u64, base: u64, len: u64) -> UcxRemoteKey {
        UcxRemoteKey { key_id, base, len, packed: vec![9; 20] }
    }

    fn grant() -> UcxGrantKey {
        UcxGrantKey {
            grant_id: 77,
            deadline_ms: 10_000,
            peer: "decode-0".into(),
            pieces: vec![piece(3, 0x1000, 0x1000), piece(4, 0x8000, 16)],
        }
    }

    #[test]
    fn keys_round_trip_and_reject_corruption() {
        let key = grant();
        let bytes = key.encode();
        assert!(UcxGrantKey::is_grant_key(&bytes));
        assert_eq!(UcxGrantKey::decode(&bytes).unwrap(), key);
        for cut in 0..bytes.len() {
            assert!(UcxGrantKey::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for at in 0..bytes.len() {
            let mut flipped = bytes.clone();
            flipped[at] ^= 0x20;
            assert!(UcxGrantKey::decode(&flipped).is_err(), "flip at {at}");
        }
        let overlapping = UcxGrantKey { pieces: vec![piece(1, 0, 100), piece(2, 50, 100)], ..grant() };
        assert!(UcxGrantKey::decode(&overlapping.encode()).is_err());
        let region = piece(1, 0, 100).encode();
        assert!(!UcxGrantKey::is_grant_key(&region) && UcxGrantKey::decode(&region).is_err());
    }

    #[test]
    fn admits_only_the_peer_inside_live_pieces() {
        let key = grant();
        let admit = |who: &str, revoked, now, addr, len| key.admit(who, revoked, now, addr, len).map(|p| p.key_id);
        assert_eq!(admit("decode-0", Some(false), 5, 0x1000, 0x1000), Ok(3));
        assert_eq!(admit("decode-0", Some(false), 5, 0x8008, 8), Ok(4));
        let code = |r: Result<u64, Refusal>| r.unwrap_err().0;
        assert_eq!(code(admit("decode-0", Some(false), 5, 0xfff, 2)), RefusalCode::OutOfBounds);
        assert_eq!(code(admit("decode-0", Some(false), 5, 0x1800, 0x1000)), RefusalCode::OutOfBounds);
        assert_eq!(code(admit("decode-0", Some(false), 5, 0x8008, 9)), RefusalCode::OutOfBounds);
        assert_eq!(code(admit("decode-0", Some(false), 5, u64::MAX, 2)), RefusalCode::OutOfBounds);
        assert_eq!(code(admit("other", Some(false), 5, 0x1000, 1)), RefusalCode::UnknownKey);
        assert_eq!(code(admit("decode-0", Some(true), 5, 0x1000, 1)), RefusalCode::Revoked);
        assert_eq!(code(admit("decode-0", None, 5, 0x1000, 1)), RefusalCode::Revoked);
        assert_eq!(code(admit("decode-0", Some(false), 10_000, 0x1000, 1)), RefusalCode::Revoked);
    }

    #[test]
    fn fresh_ids_differ() {
        assert_ne!(fresh_id(1), fresh_id(1));
        assert!(deadline_after(Duration::from_secs(1)) > unix_ms(SystemTime::now()));
    }
}
