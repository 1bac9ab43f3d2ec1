//! What the backend publishes in the agent metadata: its worker address and process identity
//! (connection info) and one packed remote key per registration, each framed with a magic, a
//! checksum and a length bound, because UCX parses worker addresses and packed keys without
//! lengths of its own.
//!
//! ```text
//! connection info: "XUC3" | crc32 of the rest u32 | host u64 | pid u32 | tcp tx segment u32
//!                  | tcp rx segment u32 | worker address
//! ```
//! `host` identifies the kernel boot and pid namespace (0: unknown), so a peer on the same
//! host can tell that the pid is one of its own namespace. The TCP segment sizes are those this
//! side's UCX uses (0: unknown, or TCP not selectable): UCX does not check that a peer's TX
//! segments fit its RX segments, so peers compare them before connecting ([`segments_fit`]).

use xfer_core::BackendError;

const CONN_MAGIC: [u8; 4] = *b"XUC3";
const CONN_HEADER: usize = 4 + 4 + 8 + 4 + 4 + 4;
const KEY_MAGIC: [u8; 4] = *b"XUK1";
/// Far above any real worker address or packed key (a few hundred bytes with many devices).
pub const MAX_BLOB: usize = 64 << 10;
const KEY_HEADER: usize = 4 + 8 + 8 + 8 + 4;

fn bad(what: &str) -> BackendError {
    BackendError::InvalidMetadata(format!("ucx {what}"))
}

/// A process as peers on the same host can recognise it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessId {
    /// The kernel boot and pid namespace; 0 when unknown.
    pub host: u64,
    pub pid: u32,
}

impl ProcessId {
    /// This process.
    pub fn current() -> ProcessId {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id");
        let namespace = std::fs::read_link("/proc/self/ns/pid");
        let host = match (boot, namespace) {
            (Ok(boot), Ok(namespace)) => {
                let namespace = namespace.to_string_lossy().into_owned();
                let high = crc32fast::hash(boot.trim().as_bytes());
                let low = crc32fast::hash(namespace.as_bytes());
                (u64::from(high) << 32 | u64::from(low)).max(1)
            }
            _ => 0,
        };
        ProcessId { host, pid: std::process::id() }
    }

    /// The peer's pid, when it means the same process here (same host and pid namespace).
    pub fn local_pid(&self, here: &ProcessId) -> Option<u32> {
        (self.host != 0 && self.host == here.host).then_some(self.pid)
    }
}

/// The segment sizes of UCX's TCP transport on one side; 0 where unknown.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpSegments {
    pub tx: u32,
    pub rx: u32,
}

/// Two sides' UCX TCP segments that do not fit each other (a TX segment larger than the other
/// side's RX segment; UCX does not check it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "UCX TCP segments do not fit: ours tx {} rx {}, the peer's tx {} rx {} (a TX segment larger than \
     the other side's RX segment; give both the same tcp_seg_size)",
    ours.tx, ours.rx, theirs.tx, theirs.rx
)]
pub struct SegmentsMisfit {
    pub ours: TcpSegments,
    pub theirs: TcpSegments,
}

/// Whether two sides' TCP segments fit each other (each side's TX segment within the other's
/// RX segment); unknown sizes are taken to fit.
pub fn segments_fit(ours: TcpSegments, theirs: TcpSegments) -> Result<(), SegmentsMisfit> {
    let too_big = |tx: u32, rx: u32| tx != 0 && rx != 0 && tx > rx;
    if too_big(ours.tx, theirs.rx) || too_big(theirs.tx, ours.rx) {
        return Err(SegmentsMisfit { ours, theirs });
    }
    Ok(())
}

/// What a peer needs to connect: the worker address, the process and its TCP segments.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    pub address: Vec<u8>,
    pub process: ProcessId,
    pub segments: TcpSegments,
}

/// Frames a worker address and process identity as connection info.
pub fn encode_conn_info(address: &[u8], process: ProcessId, segments: TcpSegments) -> Vec<u8> {
    let mut out = Vec::with_capacity(CONN_HEADER + address.len());
    out.extend_from_slice(&CONN_MAGIC);
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&process.host.to_le_bytes());
    out.extend_from_slice(&process.pid.to_le_bytes());
    out.extend_from_slice(&segments.tx.to_le_bytes());
    out.extend_from_slice(&segments.rx.to_le_bytes());
    out.extend_from_slice(address);
    let crc = crc32fast::hash(&out[8..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    out
}

/// The connection info's contents, checked.
pub fn decode_conn_info(info: &[u8]) -> Result<ConnInfo, BackendError> {
    if info.len() < CONN_HEADER || info[..4] != CONN_MAGIC {
        return Err(bad("connection info: bad magic or truncated"));
    }
    let address = &info[CONN_HEADER..];
    if address.is_empty() || address.len() > MAX_BLOB {
        return Err(bad("connection info: worker address of implausible length"));
    }
    if crc32fast::hash(&info[8..]).to_le_bytes() != info[4..8] {
        return Err(bad("connection info: checksum mismatch"));
    }
    let host = u64::from_le_bytes(info[8..16].try_into().expect("8 bytes"));
    let pid = u32::from_le_bytes(info[16..20].try_into().expect("4 bytes"));
    let tx = u32::from_le_bytes(info[20..24].try_into().expect("4 bytes"));
    let rx = u32::from_le_bytes(info[24..28].try_into().expect("4 bytes"));
    Ok(ConnInfo { address: address.to_vec(), process: ProcessId { host, pid }, segments: TcpSegments { tx, rx } })
}

/// A peer's registration as published: our key id, its range, and UCX's packed rkey (empty
/// for memory UCX cannot expose, see [`UcxRemoteKey::is_local_only`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxRemoteKey {
    pub key_id: u64,
    pub base: u64,
    pub len: u64,
    pub packed: Vec<u8>,
}

impl UcxRemoteKey {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(KEY_HEADER + self.packed.len());
        out.extend_from_slice(&KEY_MAGIC);
        out.extend_from_slice(&self.key_id.to_le_bytes());
        out.extend_from_slice(&self.base.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&[0; 4]);
        out.extend_from_slice(&self.packed);
        let crc = crc32fast::hash(&out[4..]);
        out[KEY_HEADER - 4..KEY_HEADER].copy_from_slice(&crc.to_le_bytes());
        out
    }

    pub fn decode(bytes: &[u8]) -> Result<UcxRemoteKey, BackendError> {
        if bytes.len() < KEY_HEADER || bytes[..4] != KEY_MAGIC {
            return Err(bad("remote key: bad magic or truncated"));
        }
        if bytes.len() - KEY_HEADER > MAX_BLOB {
            return Err(bad("remote key: packed key too long"));
        }
        let mut zeroed = bytes[4..].to_vec();
        let crc_at = KEY_HEADER - 4 - 4;
        let stored = u32::from_le_bytes(zeroed[crc_at..crc_at + 4].try_into().expect("4 bytes"));
        zeroed[crc_at..crc_at + 4].fill(0);
        if crc32fast::hash(&zeroed) != stored {
            return Err(bad("remote key: checksum mismatch"));
        }
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
        let key = UcxRemoteKey { key_id: word(4), base: word(12), len: word(20), packed: bytes[KEY_HEADER..].to_vec() };
        if key.base.checked_add(key.len).is_none() {
            return Err(bad("remote key: range wraps around"));
        }
        Ok(key)
    }

    /// A key for memory this side's UCX cannot expose (a file; GPU memory without CUDA): it
    /// moves only from this side, staged, and peers cannot reach it through UCX.
    pub fn is_local_only(&self) -> bool {
        self.packed.is_empty()
    }

    /// Whether `addr .. addr + len` lies inside the registration.
    pub fn covers(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.checked_add(len).is_some_and(|end| end <= self.base + self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_info_round_trip_and_corruption() {
        let here = ProcessId::current();
        assert_eq!(here.pid, std::process::id());
        assert_ne!(here.host, 0, "this test needs /proc");
        let segments = TcpSegments { tx: 262_144, rx: 262_144 };
        let info = encode_conn_info(b"worker-address", here, segments);
        let decoded = decode_conn_info(&info).unwrap();
        assert_eq!(decoded, ConnInfo { address: b"worker-address".to_vec(), process: here, segments });
        assert_eq!(decoded.process.local_pid(&here), Some(here.pid));
        let elsewhere = ProcessId { host: here.host ^ 1, pid: 1 };
        assert_eq!(elsewhere.local_pid(&here), None);
        assert_eq!(ProcessId { host: 0, pid: 1 }.local_pid(&ProcessId { host: 0, pid: 2 }), None);
        for i in 0..info.len() {
            let mut bad = info.clone();
            bad[i] ^= 0x10;
            assert!(decode_conn_info(&bad).is_err(), "flip at {i}");
        }
        for len in 0..info.len() {
            assert!(decode_conn_info(&info[..len]).is_err(), "truncated to {len}");
        }
        assert!(decode_conn_info(&encode_conn_info(b"", here, segments)).is_err());
    }

    #[test]
    fn tcp_segments_fit_when_each_tx_fits_the_other_rx() {
        let seg = |tx, rx| TcpSegments { tx, rx };
        assert!(segments_fit(seg(262_144, 262_144), seg(262_144, 262_144)).is_ok());
        // UCX's defaults on the other side (8 KiB TX, 64 KiB RX): our 256 KiB TX does not fit.
        let err = segments_fit(seg(262_144, 262_144), seg(8192, 65_536)).unwrap_err();
        assert!(err.to_string().contains("tcp_seg_size"), "{err}");
        assert!(segments_fit(seg(8192, 65_536), seg(262_144, 262_144)).is_err(), "symmetric");
        assert!(segments_fit(seg(8192, 65_536), seg(65_536, 65_536)).is_ok());
        // Unknown sizes (0) are taken to fit.
        assert!(segments_fit(seg(0, 0), seg(262_144, 262_144)).is_ok());
        assert!(segments_fit(seg(262_144, 0), seg(8192, 65_536)).is_err());
    }

    #[test]
    fn key_round_trip_bounds_and_corruption() {
        let key = UcxRemoteKey { key_id: 7, base: 0x1000, len: 4096, packed: vec![1, 2, 3, 4, 5] };
        let bytes = key.encode();
        assert_eq!(UcxRemoteKey::decode(&bytes).unwrap(), key);
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x01;
            assert!(UcxRemoteKey::decode(&bad).is_err(), "flip at {i}");
        }
        for len in 0..bytes.len() {
            assert!(UcxRemoteKey::decode(&bytes[..len]).is_err(), "truncated to {len}");
        }
        assert!(key.covers(0x1000, 4096) && key.covers(0x1fff, 1) && key.covers(0x1800, 0));
        assert!(!key.covers(0xfff, 2) && !key.covers(0x1fff, 2) && !key.covers(u64::MAX, 2));
        let local_only = UcxRemoteKey { packed: Vec::new(), ..key.clone() };
        let decoded = UcxRemoteKey::decode(&local_only.encode()).unwrap();
        assert!(decoded.is_local_only() && !key.is_local_only());
        let wraps = UcxRemoteKey { base: u64::MAX, len: 2, ..key };
        assert!(UcxRemoteKey::decode(&wraps.encode()).is_err());
    }
}
