//! Revocable grants ([`crate::Agent::grant`]): the token an initiator loads, and the handle
//! the target revokes with.
//!
//! Token layout (all integers little-endian):
//! `"XG1"` | agent name len u16 | name | entries u16 | per entry: backend name len u8 | name |
//! mem type len u8 | mem type | region addr u64 | region len u64 | region dev u64 | ranges u16 |
//! per range: addr u64 | len u64 | key len u16 | key bytes (the backend's grant key, in the form
//! of its region keys).

use std::sync::Arc;

use xfer_core::{Backend, Desc, MemType};

use crate::error::XferError;

const MAGIC: &[u8; 3] = b"XG1";

/// One backend's grant over one registered region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GrantEntry {
    pub backend: String,
    pub mem_type: MemType,
    pub region: Desc,
    /// Granted `(addr, len)` ranges inside `region`.
    pub ranges: Vec<(u64, u64)>,
    pub key: Vec<u8>,
}

/// What a token says: whose memory, and the grant key per backend and region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct GrantToken {
    pub agent: String,
    pub entries: Vec<GrantEntry>,
}

pub(crate) fn bad(reason: &str) -> XferError {
    XferError::InvalidArgument(format!("grant token: {reason}"))
}

impl GrantToken {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&(self.agent.len() as u16).to_le_bytes());
        out.extend_from_slice(self.agent.as_bytes());
        out.extend_from_slice(&(self.entries.len() as u16).to_le_bytes());
        for entry in &self.entries {
            let mem_type = entry.mem_type.to_string();
            out.push(entry.backend.len() as u8);
            out.extend_from_slice(entry.backend.as_bytes());
            out.push(mem_type.len() as u8);
            out.extend_from_slice(mem_type.as_bytes());
            for word in [entry.region.addr, entry.region.len, entry.region.dev_id] {
                out.extend_from_slice(&word.to_le_bytes());
            }
            out.extend_from_slice(&(entry.ranges.len() as u16).to_le_bytes());
            for &(addr, len) in &entry.ranges {
                out.extend_from_slice(&addr.to_le_bytes());
                out.extend_from_slice(&len.to_le_bytes());
            }
            out.extend_from_slice(&(entry.key.len() as u16).to_le_bytes());
            out.extend_from_slice(&entry.key);
        }
        out
    }

    /// Decodes untrusted bytes; never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self, XferError> {
        let mut reader = Reader(bytes);
        if reader.take(3)? != MAGIC {
            return Err(bad("not a grant token"));
        }
        let agent_len = reader.u16()? as usize;
        let agent = reader.text(agent_len)?;
        let count = reader.u16()?;
        let mut entries = Vec::with_capacity(usize::from(count).min(64));
        for _ in 0..count {
            let backend_len = reader.take(1)?[0] as usize;
            let backend = reader.text(backend_len)?;
            let mem_len = reader.take(1)?[0] as usize;
            let mem_type = reader.text(mem_len)?.parse::<MemType>().map_err(|_| bad("unknown memory type"))?;
            let region = Desc::new(reader.u64()?, reader.u64()?, reader.u64()?);
            let range_count = reader.u16()?;
            let mut ranges = Vec::with_capacity(usize::from(range_count).min(1024));
            for _ in 0..range_count {
                ranges.push((reader.u64()?, reader.u64()?));
            }
            let key_len = reader.u16()? as usize;
            let key = reader.take(key_len)?.to_vec();
            entries.push(GrantEntry { backend, mem_type, region, ranges, key });
        }
        if !reader.0.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(GrantToken { agent, entries })
    }
}

/// A bounded reader over untrusted bytes: every read checks the length first.
pub(crate) struct Reader<'a>(pub &'a [u8]);

impl<'a> Reader<'a> {
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], XferError> {
        if self.0.len() < n {
            return Err(bad("truncated"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    pub fn u16(&mut self) -> Result<u16, XferError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().map_err(|_| bad("truncated"))?))
    }
    pub fn u64(&mut self) -> Result<u64, XferError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| bad("truncated"))?))
    }
    pub fn text(&mut self, n: usize) -> Result<String, XferError> {
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad("name is not UTF-8"))
    }
}

/// `(addr, len)` ranges sorted, with overlapping and adjacent ones merged: the same bytes.
pub(crate) fn merged(ranges: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut sorted: Vec<(u64, u64)> = ranges.iter().copied().filter(|&(_, len)| len > 0).collect();
    sorted.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(sorted.len());
    for (addr, len) in sorted {
        match out.last_mut() {
            Some((start, n)) if addr <= start.saturating_add(*n) => {
                *n = (*n).max(addr.saturating_add(len) - *start);
            }
            _ => out.push((addr, len)),
        }
    }
    out
}

/// Lower-case hex, the token's text form (fit for JSON `kv_transfer_params`).
pub fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses [`to_hex`]'s form.
pub fn from_hex(text: &str) -> Result<Vec<u8>, XferError> {
    let text = text.trim();
    if !text.len().is_multiple_of(2) || !text.is_ascii() {
        return Err(bad("hex of odd length"));
    }
    (0..text.len()).step_by(2).map(|at| u8::from_str_radix(&text[at..at + 2], 16).map_err(|_| bad("not hex"))).collect()
}

/// A revocable grant this agent issued. [`Grant::revoke`] (or dropping it) returns only once
/// no transfer under the grant still touches the memory: it may be reused right after.
pub struct Grant {
    pub(crate) token: GrantToken,
    pub(crate) issued: Vec<(Arc<dyn Backend>, Vec<u8>)>,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant").field("regions", &self.token.entries.len()).finish_non_exhaustive()
    }
}

impl Grant {
    /// The opaque token for the peer ([`crate::Agent::load_grant`]).
    pub fn token(&self) -> Vec<u8> {
        self.token.encode()
    }

    /// The token as hex text.
    pub fn token_hex(&self) -> String {
        to_hex(&self.token())
    }

    /// Revokes now; blocks until transfers under the grant are done with the memory.
    pub fn revoke(mut self) {
        self.revoke_all();
    }

    fn revoke_all(&mut self) {
        for (backend, key) in self.issued.drain(..) {
            backend.revoke(&key);
        }
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.revoke_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip_and_reject_garbage() {
        let token = GrantToken {
            agent: "prefill-0".into(),
            entries: vec![GrantEntry {
                backend: "tcp".into(),
                mem_type: MemType::Dram,
                region: Desc::new(0x1000, 1 << 20, 0),
                ranges: vec![(0x2000, 4096), (0x8000, 100)],
                key: vec![7; 32],
            }],
        };
        let bytes = token.encode();
        assert_eq!(GrantToken::decode(&bytes).unwrap(), token);
        assert_eq!(from_hex(&to_hex(&bytes)).unwrap(), bytes);
        for cut in 0..bytes.len() {
            assert!(GrantToken::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert!(from_hex("abc").is_err());
        assert!(from_hex("zz").is_err());
    }

    #[test]
    fn ranges_merge_when_they_touch_or_overlap() {
        let blocks = [(0x3000, 0x1000), (0x1000, 0x1000), (0x2000, 0x1000), (0x8000, 16), (0x8008, 4), (0x9000, 0)];
        assert_eq!(merged(&blocks), vec![(0x1000, 0x3000), (0x8000, 16)]);
        assert_eq!(merged(&[(u64::MAX - 1, 1), (u64::MAX - 2, 1)]), vec![(u64::MAX - 2, 2)]);
        assert!(merged(&[]).is_empty());
    }
}
