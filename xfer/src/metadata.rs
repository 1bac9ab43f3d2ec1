//! The agent metadata blob: what a peer needs to reach an agent and its registered memory.
//!
//! Layout (all integers little-endian):
//! ```text
//! magic "XFMD" | version u16 | body length u32 | crc32 of body u32 | body (postcard)
//! ```
//! The body is [`AgentMetadata`]. Decoding is bounded and never panics: wrong magic, an unknown
//! version, a truncated or corrupt blob and inconsistent contents are each a distinct error.

use serde::{Deserialize, Serialize};
use xfer_core::{Desc, MemType};

pub const MAGIC: [u8; 4] = *b"XFMD";
pub const VERSION: u16 = 1;
const HEADER_LEN: usize = 14;
/// Upper bound on a blob; a million registrations fit comfortably.
pub const MAX_BLOB_LEN: usize = 64 << 20;
const MAX_NAME_LEN: usize = 255;
const MAX_BACKENDS: usize = 32;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentMetadata {
    pub name: String,
    pub backends: Vec<BackendInfo>,
    pub regions: Vec<RegionInfo>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendInfo {
    pub name: String,
    pub conn_info: Vec<u8>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionInfo {
    pub mem_type: MemType,
    pub desc: Desc,
    /// `(index into backends, the backend's public key for this region)`.
    pub keys: Vec<(u16, Vec<u8>)>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    #[error("not an xfer metadata blob (bad magic)")]
    BadMagic,
    #[error("unsupported metadata version {found} (this build reads version {VERSION})")]
    UnsupportedVersion { found: u16 },
    #[error("truncated metadata: {have} of {need} bytes")]
    Truncated { have: usize, need: usize },
    #[error("metadata too large: {0} bytes")]
    TooLarge(usize),
    #[error("metadata checksum mismatch (corrupt blob)")]
    Checksum,
    #[error("metadata body does not decode: {0}")]
    Decode(String),
    #[error("inconsistent metadata: {0}")]
    Invalid(String),
}

impl AgentMetadata {
    pub fn encode(&self) -> Vec<u8> {
        let body = postcard::to_stdvec(self).expect("metadata serialises into a Vec");
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    pub fn decode(blob: &[u8]) -> Result<AgentMetadata, MetadataError> {
        if blob.len() > MAX_BLOB_LEN {
            return Err(MetadataError::TooLarge(blob.len()));
        }
        if blob.len() < HEADER_LEN {
            if blob.len() >= 4 && blob[..4] != MAGIC {
                return Err(MetadataError::BadMagic);
            }
            return Err(MetadataError::Truncated { have: blob.len(), need: HEADER_LEN });
        }
        if blob[..4] != MAGIC {
            return Err(MetadataError::BadMagic);
        }
        let version = u16::from_le_bytes([blob[4], blob[5]]);
        if version != VERSION {
            return Err(MetadataError::UnsupportedVersion { found: version });
        }
        let body_len = u32::from_le_bytes([blob[6], blob[7], blob[8], blob[9]]) as usize;
        let crc = u32::from_le_bytes([blob[10], blob[11], blob[12], blob[13]]);
        let body = &blob[HEADER_LEN..];
        if body.len() < body_len {
            return Err(MetadataError::Truncated { have: blob.len(), need: HEADER_LEN + body_len });
        }
        if body.len() > body_len {
            return Err(MetadataError::Invalid(format!("{} trailing bytes", body.len() - body_len)));
        }
        if crc32fast::hash(body) != crc {
            return Err(MetadataError::Checksum);
        }
        let md: AgentMetadata = postcard::from_bytes(body).map_err(|e| MetadataError::Decode(e.to_string()))?;
        md.validate()?;
        Ok(md)
    }

    fn validate(&self) -> Result<(), MetadataError> {
        let invalid = |m: String| Err(MetadataError::Invalid(m));
        if self.name.is_empty() || self.name.len() > MAX_NAME_LEN {
            return invalid(format!("agent name length {}", self.name.len()));
        }
        if self.backends.len() > MAX_BACKENDS {
            return invalid(format!("{} backends", self.backends.len()));
        }
        for region in &self.regions {
            if region.desc.end().is_none() {
                return invalid(format!("region {:#x}+{} wraps", region.desc.addr, region.desc.len));
            }
            if let Some((index, _)) = region.keys.iter().find(|(i, _)| usize::from(*i) >= self.backends.len()) {
                return invalid(format!("region key names backend #{index} of {}", self.backends.len()));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "prefill-0".into(),
            backends: vec![BackendInfo { name: "tcp".into(), conn_info: b"127.0.0.1:4000".to_vec() }],
            regions: vec![RegionInfo {
                mem_type: MemType::Dram,
                desc: Desc::new(0x1000, 4096, 0),
                keys: vec![(0, vec![7; 16])],
            }],
        }
    }

    #[test]
    fn round_trips() {
        let md = sample();
        assert_eq!(AgentMetadata::decode(&md.encode()).unwrap(), md);
    }

    #[test]
    fn refuses_bad_blobs() {
        let blob = sample().encode();
        assert_eq!(AgentMetadata::decode(b"nope"), Err(MetadataError::BadMagic));
        assert!(matches!(AgentMetadata::decode(&blob[..10]), Err(MetadataError::Truncated { .. })));
        assert!(matches!(AgentMetadata::decode(&blob[..blob.len() - 1]), Err(MetadataError::Truncated { .. })));
        let mut version = blob.clone();
        version[4] = 9;
        assert_eq!(AgentMetadata::decode(&version), Err(MetadataError::UnsupportedVersion { found: 9 }));
        let mut flipped = blob.clone();
        *flipped.last_mut().unwrap() ^= 0x40;
        assert_eq!(AgentMetadata::decode(&flipped), Err(MetadataError::Checksum));
        let mut trailing = blob.clone();
        trailing.push(0);
        assert!(matches!(AgentMetadata::decode(&trailing), Err(MetadataError::Invalid(_))));
    }

    #[test]
    fn refuses_inconsistent_contents() {
        let mut md = sample();
        md.regions[0].keys[0].0 = 3;
        assert!(matches!(AgentMetadata::decode(&md.encode()), Err(MetadataError::Invalid(_))));
        let mut md = sample();
        md.name.clear();
        assert!(matches!(AgentMetadata::decode(&md.encode()), Err(MetadataError::Invalid(_))));
    }

    #[test]
    fn every_single_byte_corruption_is_an_error_not_a_panic() {
        let blob = sample().encode();
        for i in 0..blob.len() {
            for bit in 0..8 {
                let mut bad = blob.clone();
                bad[i] ^= 1 << bit;
                assert!(AgentMetadata::decode(&bad).is_err(), "byte {i} bit {bit}");
            }
        }
    }
}
