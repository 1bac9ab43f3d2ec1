//! What the backend publishes in the agent metadata, framed with a magic and a checksum so a
//! damaged blob is refused before any of it reaches libfabric (which reads addresses and keys
//! without lengths of its own):
//!
//! ```text
//! connection info: "XLF3" | crc32 of the rest u32 | flags u32 | max notification u32
//!                  | notification chunk u32 | provider len u16 | provider | lanes u8
//!                  | rails u8 | rails × (address len u16 | address (fi_getname))
//! remote key:      "XLK2" | crc32 of the rest u32 | base u64 | len u64 | rails u8
//!                  | rails × key u64
//! ```
//! `flags` bit 0: the peer's provider addresses remote memory by virtual address
//! (FI_MR_VIRT_ADDR); otherwise by offset from the registration's `base`. The rails are the
//! domains' lanes, domain-major (rail `d × lanes + l` is lane `l` of domain `d`), so the rail
//! count is a multiple of `lanes`. Lane `l` of domain `d` talks to the peer's lane `l` of its
//! domain `d`, on as many domains and lanes as both sides have; a key holds the
//! registration's key on every rail.

use xfer_core::BackendError;

const CONN_MAGIC: [u8; 4] = *b"XLF3";
const KEY_MAGIC: [u8; 4] = *b"XLK2";
/// Far above any provider name or endpoint address (sockaddr_in6 is 28 bytes, shm names 256).
pub const MAX_FIELD: usize = 4096;
pub const FLAG_VIRT_ADDR: u32 = 1;
pub use crate::config::MAX_RAILS;

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
    /// Endpoints per domain (at least 1; divides the rail count).
    pub lanes: usize,
    /// Every rail's endpoint address, rail 0 first.
    pub addresses: Vec<Vec<u8>>,
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
        put_field(&mut rest, self.provider.as_bytes());
        rest.push(self.lanes.min(MAX_RAILS) as u8);
        let rails = self.addresses.len().min(MAX_RAILS);
        rest.push(rails as u8);
        for address in &self.addresses[..rails] {
            put_field(&mut rest, address);
        }
        framed(CONN_MAGIC, &rest)
    }

    pub fn decode(bytes: &[u8]) -> Result<ConnInfo, BackendError> {
        let mut rest = unframe(CONN_MAGIC, bytes, "connection info")?;
        let flags = take_u32(&mut rest).ok_or_else(|| bad("connection info: truncated"))?;
        let max_notif = take_u32(&mut rest).ok_or_else(|| bad("connection info: truncated"))?;
        let chunk = take_u32(&mut rest).filter(|&c| c > 0).ok_or_else(|| bad("connection info: chunk size"))?;
        let provider = take_field(&mut rest).ok_or_else(|| bad("connection info: truncated provider"))?;
        let lanes = take_rails(&mut rest).ok_or_else(|| bad("connection info: lane count"))?;
        let rails = take_rails(&mut rest)
            .filter(|rails| rails % lanes == 0)
            .ok_or_else(|| bad("connection info: rail count (not a multiple of the lanes)"))?;
        let mut addresses = Vec::with_capacity(rails);
        for _ in 0..rails {
            let address = take_field(&mut rest).ok_or_else(|| bad("connection info: truncated address"))?;
            if address.is_empty() {
                return Err(bad("connection info: empty address"));
            }
            addresses.push(address.to_vec());
        }
        if !rest.is_empty() {
            return Err(bad("connection info: bad length"));
        }
        let provider = String::from_utf8(provider.to_vec()).map_err(|_| bad("connection info: provider name"))?;
        Ok(ConnInfo { flags, max_notif, chunk, provider, lanes, addresses })
    }

    /// The rails two sides connect: (ours, the peer's) index pairs, lane `l` of domain `d`
    /// meeting lane `l` of the peer's domain `d`, on as many domains and lanes as both have.
    /// `our_rails` is a multiple of `our_lanes` (both at least 1).
    pub fn pairs(&self, our_rails: usize, our_lanes: usize) -> Vec<(usize, usize)> {
        let lanes = our_lanes.min(self.lanes);
        let domains = (our_rails / our_lanes.max(1)).min(self.addresses.len() / self.lanes.max(1));
        (0..domains).flat_map(|d| (0..lanes).map(move |l| (d * our_lanes + l, d * self.lanes + l))).collect()
    }
}

/// A peer's registration as its key names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FabricRemoteKey {
    /// The provider's key (`fi_mr_key`) on each of the peer's rails, rail 0 first.
    pub keys: Vec<u64>,
    /// The registration's address in the peer's address space.
    pub base: u64,
    pub len: u64,
}

impl FabricRemoteKey {
    pub fn encode(&self) -> Vec<u8> {
        let rails = self.keys.len().min(MAX_RAILS);
        let mut rest = Vec::with_capacity(17 + 8 * rails);
        for v in [self.base, self.len] {
            rest.extend_from_slice(&v.to_le_bytes());
        }
        rest.push(rails as u8);
        for key in &self.keys[..rails] {
            rest.extend_from_slice(&key.to_le_bytes());
        }
        framed(KEY_MAGIC, &rest)
    }

    pub fn decode(bytes: &[u8]) -> Result<FabricRemoteKey, BackendError> {
        let mut rest = unframe(KEY_MAGIC, bytes, "remote key")?;
        let truncated = || bad("remote key: truncated");
        let base = take_u64(&mut rest).ok_or_else(truncated)?;
        let len = take_u64(&mut rest).ok_or_else(truncated)?;
        let rails = take_rails(&mut rest).ok_or_else(|| bad("remote key: rail count"))?;
        let keys = (0..rails).map(|_| take_u64(&mut rest).ok_or_else(truncated)).collect::<Result<Vec<_>, _>>()?;
        if !rest.is_empty() {
            return Err(bad("remote key: bad length"));
        }
        if base.checked_add(len).is_none() {
            return Err(bad("remote key: range wraps"));
        }
        Ok(FabricRemoteKey { keys, base, len })
    }

    /// Whether `addr .. addr + len` lies inside the registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|end| end <= self.base + self.len)
    }
}

fn put_field(out: &mut Vec<u8>, field: &[u8]) {
    let field = &field[..field.len().min(MAX_FIELD)];
    out.extend_from_slice(&(field.len() as u16).to_le_bytes());
    out.extend_from_slice(field);
}

/// A rail count: 1 ..= [`MAX_RAILS`].
fn take_rails(rest: &mut &[u8]) -> Option<usize> {
    let rails = *take(rest, 1)?.first()? as usize;
    (1..=MAX_RAILS).contains(&rails).then_some(rails)
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
            lanes: 1,
            addresses: vec![vec![2, 0, 0x1f, 0x90, 127, 0, 0, 1], vec![2, 0, 0x1f, 0x91, 10, 0, 0, 2]],
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
        let uneven = ConnInfo { lanes: 2, addresses: vec![vec![1]; 3], ..info.clone() };
        assert!(ConnInfo::decode(&uneven.encode()).is_err(), "3 rails in lanes of 2 accepted");
        let no_lanes = ConnInfo { lanes: 0, ..info.clone() };
        assert!(ConnInfo::decode(&no_lanes.encode()).is_err(), "0 lanes accepted");
        let none = ConnInfo { addresses: Vec::new(), ..info };
        assert!(ConnInfo::decode(&none.encode()).is_err(), "a peer without rails accepted");
    }

    #[test]
    fn rails_pair_by_domain_and_lane_up_to_what_both_have() {
        let peer = |domains: usize, lanes: usize| ConnInfo {
            flags: 0,
            max_notif: 1,
            chunk: 1,
            provider: "tcp;ofi_rxm".into(),
            lanes,
            addresses: vec![vec![1]; domains * lanes],
        };
        assert_eq!(peer(1, 1).pairs(1, 1), [(0, 0)]);
        assert_eq!(peer(1, 4).pairs(4, 4), [(0, 0), (1, 1), (2, 2), (3, 3)]);
        // We have 3 lanes, the peer 2: our third lane stays idle for it.
        assert_eq!(peer(1, 2).pairs(3, 3), [(0, 0), (1, 1)]);
        assert_eq!(peer(1, 3).pairs(2, 2), [(0, 0), (1, 1)]);
        // Two domains: our 2 lanes each against the peer's 3 lanes each.
        assert_eq!(peer(2, 3).pairs(4, 2), [(0, 0), (1, 1), (2, 3), (3, 4)]);
        // Two domains × 2 lanes against one domain × 1 lane.
        assert_eq!(peer(1, 1).pairs(4, 2), [(0, 0)]);
        let decoded = ConnInfo::decode(&peer(2, 3).encode()).unwrap();
        assert_eq!((decoded.lanes, decoded.addresses.len()), (3, 6));
    }

    #[test]
    fn key_round_trip_bounds_and_corruption() {
        let key = FabricRemoteKey { keys: vec![7, 9], base: 0x1000, len: 0x2000 };
        let bytes = key.encode();
        assert_eq!(FabricRemoteKey::decode(&bytes).unwrap(), key);
        assert!(key.covers(0x1000, 0x2000) && key.covers(0x2fff, 1) && key.covers(0x1800, 0));
        assert!(!key.covers(0xfff, 1) && !key.covers(0x2fff, 2) && !key.covers(u64::MAX, 2));
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x5a;
            assert!(FabricRemoteKey::decode(&bad).is_err(), "flip at {at} accepted");
        }
        for len in 0..bytes.len() {
            assert!(FabricRemoteKey::decode(&bytes[..len]).is_err(), "truncated to {len} accepted");
        }
        let no_rails = FabricRemoteKey { keys: Vec::new(), ..key.clone() }.encode();
        assert!(FabricRemoteKey::decode(&no_rails).is_err());
        let wraps = FabricRemoteKey { keys: vec![1], base: u64::MAX, len: 2 }.encode();
        assert!(FabricRemoteKey::decode(&wraps).is_err());
    }
}
