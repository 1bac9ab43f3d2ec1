//! What the backend publishes in the agent metadata, framed with a magic and a checksum so a
//! damaged blob is refused before any of it reaches libfabric (which reads addresses and keys
//! without lengths of its own):
//!
//! ```text
//! connection info: "XLF1" | crc32 of the rest u32 | flags u32 | max notification u32
//!                  | notification chunk u32
//!                  | provider len u16 | provider | address len u16 | address (fi_getname)
//! remote key:      "XLK1" | crc32 of the rest u32 | key u64 | base u64 | len u64
//! ```
//! `flags` bit 0: the peer's provider addresses remote memory by virtual address
//! (FI_MR_VIRT_ADDR); otherwise by offset from the registration's `base`.

use xfer_core::BackendError;

const CONN_MAGIC: [u8; 4] = *b"XLF1";
const KEY_MAGIC: [u8; 4] = *b"XLK1";
const KEY_LEN: usize = 4 + 4 + 8 + 8 + 8;
/// Far above any provider name or endpoint address (sockaddr_in6 is 28 bytes, shm names 256).
pub const MAX_FIELD: usize = 4096;
pub const FLAG_VIRT_ADDR: u32 = 1;

fn bad(what: &str) -> BackendError {
    BackendError::InvalidMetadata(format!("libfabric {what}"))
}

/// A peer's connection info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    pub flags: u32,
    pub max_notif: u32,
    /// Payload bytes per notification message this side receives.
    pub chunk: u32,
    pub provider: String,
    pub address: Vec<u8>,
}

impl ConnInfo {
    pub fn virt_addr(&self) -> bool {
        self.flags & FLAG_VIRT_ADDR != 0
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut rest = Vec::new();
        rest.extend_from_slice(&self.flags.to_le_bytes());
        rest.extend_from_slice(&self.max_notif.to_le_bytes());
        rest.extend_from_slice(&self.chunk.to_le_bytes());
        for field in [self.provider.as_bytes(), &self.address] {
            rest.extend_from_slice(&(field.len().min(MAX_FIELD) as u16).to_le_bytes());
            rest.extend_from_slice(&field[..field.len().min(MAX_FIELD)]);
        }
        framed(CONN_MAGIC, &rest)
    }

    pub fn decode(bytes: &[u8]) -> Result<ConnInfo, BackendError> {
        let mut rest = unframe(CONN_MAGIC, bytes, "connection info")?;
        let flags = take_u32(&mut rest).ok_or_else(|| bad("connection info: truncated"))?;
        let max_notif = take_u32(&mut rest).ok_or_else(|| bad("connection info: truncated"))?;
        let chunk = take_u32(&mut rest).filter(|&c| c > 0).ok_or_else(|| bad("connection info: chunk size"))?;
        let provider = take_field(&mut rest).ok_or_else(|| bad("connection info: truncated provider"))?;
        let address = take_field(&mut rest).ok_or_else(|| bad("connection info: truncated address"))?;
        if !rest.is_empty() || address.is_empty() {
            return Err(bad("connection info: bad length"));
        }
        let provider = String::from_utf8(provider.to_vec()).map_err(|_| bad("connection info: provider name"))?;
        Ok(ConnInfo { flags, max_notif, chunk, provider, address: address.to_vec() })
    }
}

/// A peer's registration as its key names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FabricRemoteKey {
    /// The provider's key (`fi_mr_key`).
    pub key: u64,
    /// The registration's address in the peer's address space.
    pub base: u64,
    pub len: u64,
}

impl FabricRemoteKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut rest = Vec::with_capacity(24);
        for v in [self.key, self.base, self.len] {
            rest.extend_from_slice(&v.to_le_bytes());
        }
        framed(KEY_MAGIC, &rest)
    }

    pub fn decode(bytes: &[u8]) -> Result<FabricRemoteKey, BackendError> {
        if bytes.len() != KEY_LEN {
            return Err(bad("remote key: bad length"));
        }
        let mut rest = unframe(KEY_MAGIC, bytes, "remote key")?;
        let mut next = || take_u64(&mut rest).ok_or_else(|| bad("remote key: truncated"));
        let (key, base, len) = (next()?, next()?, next()?);
        if base.checked_add(len).is_none() {
            return Err(bad("remote key: range wraps"));
        }
        Ok(FabricRemoteKey { key, base, len })
    }

    /// Whether `addr .. addr + len` lies inside the registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|end| end <= self.base + self.len)
    }
}

fn framed(magic: [u8; 4], rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + rest.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&crc32fast::hash(rest).to_le_bytes());
    out.extend_from_slice(rest);
    out
}

fn unframe<'a>(magic: [u8; 4], bytes: &'a [u8], what: &str) -> Result<&'a [u8], BackendError> {
    if bytes.len() < 8 || bytes[..4] != magic {
        return Err(bad(&format!("{what}: not ours (magic)")));
    }
    let crc = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
    let rest = &bytes[8..];
    if crc32fast::hash(rest) != crc {
        return Err(bad(&format!("{what}: checksum mismatch")));
    }
    Ok(rest)
}

fn take<'a>(rest: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    if rest.len() < n {
        return None;
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Some(head)
}

fn take_u32(rest: &mut &[u8]) -> Option<u32> {
    take(rest, 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn take_u64(rest: &mut &[u8]) -> Option<u64> {
    take(rest, 8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
}

fn take_field<'a>(rest: &mut &'a [u8]) -> Option<&'a [u8]> {
    let len = take(rest, 2).map(|b| u16::from_le_bytes([b[0], b[1]]))? as usize;
    if len > MAX_FIELD {
        return None;
    }
    take(rest, len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_info_round_trip_and_corruption() {
        let info = ConnInfo {
            flags: FLAG_VIRT_ADDR,
            max_notif: 16384,
            chunk: 4096,
            provider: "tcp;ofi_rxm".into(),
            address: vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1],
        };
        let bytes = info.encode();
        assert_eq!(ConnInfo::decode(&bytes).unwrap(), info);
        assert!(ConnInfo::decode(&bytes).unwrap().virt_addr());
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            assert!(ConnInfo::decode(&bad).is_err(), "flip at {at} accepted");
        }
        for len in 0..bytes.len() {
            assert!(ConnInfo::decode(&bytes[..len]).is_err(), "truncated to {len} accepted");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ConnInfo::decode(&longer).is_err());
    }

    #[test]
    fn key_round_trip_bounds_and_corruption() {
        let key = FabricRemoteKey { key: 7, base: 0x1000, len: 0x2000 };
        let bytes = key.encode();
        assert_eq!(FabricRemoteKey::decode(&bytes).unwrap(), key);
        assert!(key.covers(0x1000, 0x2000) && key.covers(0x2fff, 1) && key.covers(0x1800, 0));
        assert!(!key.covers(0xfff, 1) && !key.covers(0x2fff, 2) && !key.covers(u64::MAX, 2));
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x5a;
            assert!(FabricRemoteKey::decode(&bad).is_err(), "flip at {at} accepted");
        }
        assert!(FabricRemoteKey::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(FabricRemoteKey::decode(&[]).is_err());
        let wraps = FabricRemoteKey { key: 1, base: u64::MAX, len: 2 }.encode();
        assert!(FabricRemoteKey::decode(&wraps).is_err());
    }
}
