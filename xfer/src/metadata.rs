//! The agent metadata blob: what a peer needs to reach an agent and its registered memory.
//!
//! Layout (all integers little-endian):
//! ```text
//! magic "XFMD" | version u16 | body length u32 | crc32 of body u32 | body (postcard)
//! ```
//! The body is [`AgentMetadata`]. Decoding is bounded and never panics: wrong magic, an unknown
//! version, a truncated or corrupt blob and inconsistent contents are each a distinct error.
//!
//! An agent with a cluster credential publishes a signed blob:
//! ```text
//! magic "XFMS" | HMAC-SHA256 [32] | blob as above
//! ```
//! The HMAC key is derived from the cluster secret and the agent name inside the blob, so a
//! blob re-labelled with another name, or changed in any byte, is refused. Every holder of the
//! secret can sign for any name: the signature proves cluster membership, not identity.

use serde::{Deserialize, Serialize};
use xfer_core::credential::{ClusterCredential, AUTH_LEN};
use xfer_core::{Desc, MemType};

pub const MAGIC: [u8; 4] = *b"XFMD";
/// Magic of a signed blob (see the module docs).
pub const SIGNED_MAGIC: [u8; 4] = *b"XFMS";
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
    #[error("metadata is not signed, and this agent requires signed metadata (it has a cluster credential)")]
    Unsigned,
    #[error("metadata is signed, but this agent has no cluster credential to verify it")]
    SignedWithoutCredential,
    #[error("metadata signature does not verify (tampered, or signed with another cluster secret)")]
    BadSignature,
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

    /// The blob, signed when a credential is given.
    pub fn encode_for(&self, credential: Option<&ClusterCredential>) -> Vec<u8> {
        let blob = self.encode();
        let Some(credential) = credential else { return blob };
        let mut out = Vec::with_capacity(SIGNED_MAGIC.len() + AUTH_LEN + blob.len());
        out.extend_from_slice(&SIGNED_MAGIC);
        out.extend_from_slice(&credential.sign_metadata(&self.name, &blob));
        out.extend_from_slice(&blob);
        out
    }

    /// Decodes a blob from [`encode_for`](Self::encode_for): with a credential only a signed
    /// blob whose signature verifies for the agent it names; without one only an unsigned blob.
    pub fn decode_for(blob: &[u8], credential: Option<&ClusterCredential>) -> Result<AgentMetadata, MetadataError> {
        let signed = blob.starts_with(&SIGNED_MAGIC);
        let Some(credential) = credential else {
            return if signed { Err(MetadataError::SignedWithoutCredential) } else { Self::decode(blob) };
        };
        if !signed {
            return match Self::decode(blob) {
                Ok(_) => Err(MetadataError::Unsigned),
                Err(err) => Err(err),
            };
        }
        let header = SIGNED_MAGIC.len() + AUTH_LEN;
        if blob.len() < header {
            return Err(MetadataError::Truncated { have: blob.len(), need: header });
        }
        let (signature, inner) = (&blob[SIGNED_MAGIC.len()..header], &blob[header..]);
        let md = Self::decode(inner)?;
        if !credential.verify_metadata(&md.name, inner, signature) {
            return Err(MetadataError::BadSignature);
        }
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
    fn signed_blobs_verify_and_refuse_tampering() {
        let cred = ClusterCredential::from_bytes(vec![5; 32]).unwrap();
        let other = ClusterCredential::from_bytes(vec![6; 32]).unwrap();
        let md = sample();
        let signed = md.encode_for(Some(&cred));
        assert_eq!(AgentMetadata::decode_for(&signed, Some(&cred)).unwrap(), md);
        assert_eq!(AgentMetadata::decode_for(&signed, Some(&other)), Err(MetadataError::BadSignature));
        assert_eq!(AgentMetadata::decode_for(&signed, None), Err(MetadataError::SignedWithoutCredential));
        assert_eq!(AgentMetadata::decode_for(&md.encode(), Some(&cred)), Err(MetadataError::Unsigned));
        assert_eq!(AgentMetadata::decode_for(&md.encode_for(None), None).unwrap(), md);
        // A blob renamed to another agent, even with a valid checksum, fails the signature.
        let mut renamed = md.clone();
        renamed.name = "prefill-1".into();
        let mut forged = signed[..36].to_vec();
        forged.extend_from_slice(&renamed.encode());
        assert_eq!(AgentMetadata::decode_for(&forged, Some(&cred)), Err(MetadataError::BadSignature));
        for i in 4..signed.len() {
            let mut bad = signed.clone();
            bad[i] ^= 0x01;
            assert!(AgentMetadata::decode_for(&bad, Some(&cred)).is_err(), "byte {i}");
        }
        assert!(matches!(AgentMetadata::decode_for(&signed[..20], Some(&cred)), Err(MetadataError::Truncated { .. })));
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
