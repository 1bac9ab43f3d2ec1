//! The cluster credential: a shared secret every agent of a cluster holds, and the pure
//! challenge-response and signing code built on it (HMAC-SHA256).
//!
//! Both ends of a connection send a fresh random nonce; each proves it knows the secret with
//! an HMAC over a direction label, both nonces and both agent names ([`Transcript`]). A proof
//! captured from one connection is useless on another: the other side's nonce is new.
//!
//! A shared secret authenticates *membership*, not identity: every holder of the secret can
//! compute a proof (or a metadata signature) for any agent name. Per-agent identity needs
//! mutual TLS with a cluster CA (future work).

use std::fmt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// Length of a nonce, a proof and a signature.
pub const AUTH_LEN: usize = 32;
pub type Nonce = [u8; AUTH_LEN];
pub type Proof = [u8; AUTH_LEN];

/// Environment variable naming the secret file, read by [`ClusterCredential::from_env`].
pub const SECRET_FILE_ENV: &str = "XFER_CLUSTER_SECRET_FILE";

/// Why a credential cannot be loaded or a nonce drawn.
#[derive(Debug, thiserror::Error)]
pub enum CredentialError {
    #[error("cluster secret is {len} bytes; at least {min} are required", min = ClusterCredential::MIN_LEN)]
    TooShort { len: usize },
    #[error("cannot read cluster secret file {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no randomness for a nonce: {0}")]
    Random(String),
}

/// What a proof is about; the label keeps a proof for one role from being accepted for another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProofLabel {
    /// A side-channel client proving itself to the serving agent.
    SideChannelClient,
    /// The serving agent proving itself to a side-channel client.
    SideChannelServer,
    /// A TCP initiator proving itself to the target in the data-connection hello.
    DataInitiator,
    /// A TCP target proving itself to the initiator.
    DataTarget,
}

impl ProofLabel {
    fn bytes(self) -> &'static [u8] {
        match self {
            ProofLabel::SideChannelClient => b"xfer side-channel client v1",
            ProofLabel::SideChannelServer => b"xfer side-channel server v1",
            ProofLabel::DataInitiator => b"xfer data initiator v1",
            ProofLabel::DataTarget => b"xfer data target v1",
        }
    }
}

/// Everything a proof binds: both nonces and both names. The connecting side is the client.
#[derive(Clone, Copy, Debug)]
pub struct Transcript<'a> {
    pub client_nonce: &'a Nonce,
    pub server_nonce: &'a Nonce,
    pub client_name: &'a str,
    pub server_name: &'a str,
}

/// The shared cluster secret. `Debug` never prints it.
#[derive(Clone)]
pub struct ClusterCredential {
    secret: Vec<u8>,
}

impl fmt::Debug for ClusterCredential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCredential").field("secret", &format_args!("<{} bytes>", self.secret.len())).finish()
    }
}

impl ClusterCredential {
    /// Shortest accepted secret.
    pub const MIN_LEN: usize = 32;

    pub fn from_bytes(secret: impl Into<Vec<u8>>) -> Result<ClusterCredential, CredentialError> {
        let secret = secret.into();
        if secret.len() < Self::MIN_LEN {
            return Err(CredentialError::TooShort { len: secret.len() });
        }
        Ok(ClusterCredential { secret })
    }

    /// Reads the secret file as raw bytes; a trailing newline is part of the secret, so every
    /// agent must read the same file content.
    pub fn from_file(path: &Path) -> Result<ClusterCredential, CredentialError> {
        let secret =
            std::fs::read(path).map_err(|source| CredentialError::Read { path: path.to_path_buf(), source })?;
        Self::from_bytes(secret)
    }

    /// The credential named by `XFER_CLUSTER_SECRET_FILE`, `None` when it is unset.
    pub fn from_env() -> Result<Option<ClusterCredential>, CredentialError> {
        match std::env::var_os(SECRET_FILE_ENV) {
            Some(path) if !path.is_empty() => Self::from_file(Path::new(&path)).map(Some),
            _ => Ok(None),
        }
    }

    fn mac(&self) -> HmacSha256 {
        HmacSha256::new_from_slice(&self.secret).expect("HMAC takes keys of any length")
    }

    fn transcript_mac(&self, label: ProofLabel, t: &Transcript<'_>) -> HmacSha256 {
        let mut mac = self.mac();
        put_field(&mut mac, label.bytes());
        put_field(&mut mac, t.client_nonce);
        put_field(&mut mac, t.server_nonce);
        put_field(&mut mac, t.client_name.as_bytes());
        put_field(&mut mac, t.server_name.as_bytes());
        mac
    }

    pub fn prove(&self, label: ProofLabel, transcript: &Transcript<'_>) -> Proof {
        self.transcript_mac(label, transcript).finalize().into_bytes().into()
    }

    /// Checks a proof in constant time.
    pub fn verify(&self, label: ProofLabel, transcript: &Transcript<'_>, proof: &[u8]) -> bool {
        self.transcript_mac(label, transcript).verify_slice(proof).is_ok()
    }

    /// The signing key of one agent's metadata, derived from the secret and the agent's name.
    fn metadata_mac(&self, agent_name: &str) -> HmacSha256 {
        let mut derive = self.mac();
        put_field(&mut derive, b"xfer metadata key v1");
        put_field(&mut derive, agent_name.as_bytes());
        let key = derive.finalize().into_bytes();
        HmacSha256::new_from_slice(&key).expect("HMAC takes keys of any length")
    }

    /// Signs a metadata blob published by `agent_name`.
    pub fn sign_metadata(&self, agent_name: &str, blob: &[u8]) -> Proof {
        let mut mac = self.metadata_mac(agent_name);
        mac.update(blob);
        mac.finalize().into_bytes().into()
    }

    pub fn verify_metadata(&self, agent_name: &str, blob: &[u8], signature: &[u8]) -> bool {
        let mut mac = self.metadata_mac(agent_name);
        mac.update(blob);
        mac.verify_slice(signature).is_ok()
    }
}

/// Length-prefixes every field so that no two different transcripts hash alike.
fn put_field(mac: &mut HmacSha256, field: &[u8]) {
    mac.update(&(field.len() as u32).to_le_bytes());
    mac.update(field);
}

/// A fresh random nonce from the OS.
pub fn fresh_nonce() -> Result<Nonce, CredentialError> {
    let mut nonce = [0u8; AUTH_LEN];
    getrandom::fill(&mut nonce).map_err(|e| CredentialError::Random(e.to_string()))?;
    Ok(nonce)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cred(byte: u8) -> ClusterCredential {
        ClusterCredential::from_bytes(vec![byte; 32]).unwrap()
    }

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mut mac = HmacSha256::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn short_secrets_are_refused_and_debug_hides_the_secret() {
        assert!(matches!(ClusterCredential::from_bytes(vec![1; 31]), Err(CredentialError::TooShort { len: 31 })));
        let shown = format!("{:?}", cred(0x41));
        assert!(!shown.contains("AAAA") && shown.contains("32 bytes"), "{shown}");
    }

    #[test]
    fn proofs_bind_secret_label_nonces_and_names() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let t = Transcript { client_nonce: &a, server_nonce: &b, client_name: "decode", server_name: "prefill" };
        let proof = cred(7).prove(ProofLabel::SideChannelClient, &t);
        // Fixed vector (computed independently with Python's hmac module): the proof format
        // must not drift silently, peers of other builds compute it too.
        assert_eq!(hex(&proof), "f420db25a641bdbd7c6df891126215cb35e4606e523530c3255dff42ce309fc0");
        assert!(cred(7).verify(ProofLabel::SideChannelClient, &t, &proof));
        assert!(!cred(8).verify(ProofLabel::SideChannelClient, &t, &proof), "wrong secret");
        assert!(!cred(7).verify(ProofLabel::SideChannelServer, &t, &proof), "other direction");
        assert!(!cred(7).verify(ProofLabel::DataInitiator, &t, &proof), "other protocol");
        let replayed = Transcript { server_nonce: &[3u8; 32], ..t };
        assert!(!cred(7).verify(ProofLabel::SideChannelClient, &replayed, &proof), "fresh server nonce");
        let renamed = Transcript { client_name: "decodeX", ..t };
        assert!(!cred(7).verify(ProofLabel::SideChannelClient, &renamed, &proof), "other name");
        // Moving a byte between adjacent names changes the transcript (length prefixes).
        let shifted = Transcript { client_name: "decodep", server_name: "refill", ..t };
        assert!(!cred(7).verify(ProofLabel::SideChannelClient, &shifted, &proof));
        let mut flipped = proof;
        flipped[0] ^= 1;
        assert!(!cred(7).verify(ProofLabel::SideChannelClient, &t, &flipped));
        assert!(!cred(7).verify(ProofLabel::SideChannelClient, &t, &proof[..31]), "truncated");
    }

    #[test]
    fn metadata_signatures_bind_the_agent_name_and_every_byte() {
        let blob = b"XFMD example blob".to_vec();
        let sig = cred(9).sign_metadata("prefill-0", &blob);
        assert_eq!(hex(&sig), "3370bcb2abfc573f5d8822821e8292c36d1532f7e935d40f86f69a9a0f733e5d");
        assert!(cred(9).verify_metadata("prefill-0", &blob, &sig));
        assert!(!cred(9).verify_metadata("prefill-1", &blob, &sig));
        assert!(!cred(1).verify_metadata("prefill-0", &blob, &sig));
        for i in 0..blob.len() {
            let mut bad = blob.clone();
            bad[i] ^= 0x80;
            assert!(!cred(9).verify_metadata("prefill-0", &bad, &sig), "byte {i}");
        }
    }

    #[test]
    fn nonces_are_fresh() {
        assert_ne!(fresh_nonce().unwrap(), fresh_nonce().unwrap());
    }
}
