//! vLLM's prefix-cache block hashes with `--prefix-caching-hash-algo sha256_cbor`.
//!
//! Only full blocks are hashed. Block `i`'s digest is SHA-256 of the canonical CBOR encoding of
//! `[parent digest, [token ids of block i], extra keys or null]`, where the first block's parent
//! is `NONE_HASH` = SHA-256(CBOR text "vllm-none-hash"), or of the `PYTHONHASHSEED` string when
//! that is set. KV events carry either the digest or its last 8 bytes as a big-endian u64.

use sha2::{Digest, Sha256};

use crate::cbor::{self, Item};

pub mod sglang;

pub type BlockDigest = [u8; 32];

/// A per-block extra key (LoRA name, multimodal hash, cache salt), hashed as given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExtraKey {
    Text(String),
    Int(i64),
    Bytes(Vec<u8>),
}

fn sha256(bytes: &[u8]) -> BlockDigest {
    Sha256::digest(bytes).into()
}

/// The root parent of every chain: from `PYTHONHASHSEED` when set, else "vllm-none-hash".
pub fn none_hash(pythonhashseed: Option<&str>) -> BlockDigest {
    let seed = pythonhashseed.unwrap_or("vllm-none-hash");
    let mut out = Vec::with_capacity(seed.len() + 9);
    cbor::encode(&Item::Text(seed), &mut out);
    sha256(&out)
}

/// The digest of one block given its parent's digest.
pub fn block_digest(parent: &BlockDigest, tokens: &[u32], extra: Option<&[ExtraKey]>) -> BlockDigest {
    let extra_item = match extra {
        None => Item::Null,
        Some(keys) => Item::Array(
            keys.iter()
                .map(|k| match k {
                    ExtraKey::Text(t) => Item::Text(t),
                    ExtraKey::Int(i) => Item::Int(*i),
                    ExtraKey::Bytes(b) => Item::Bytes(b),
                })
                .collect(),
        ),
    };
    let item = Item::Array(vec![
        Item::Bytes(parent),
        Item::Array(tokens.iter().map(|&t| Item::Uint(u64::from(t))).collect()),
        extra_item,
    ]);
    let mut out = Vec::with_capacity(48 + tokens.len() * 3);
    cbor::encode(&item, &mut out);
    sha256(&out)
}

/// Digests of every full block of `tokens`, chained from `root` (normally [`none_hash`]).
/// `extra(i)` gives block `i`'s extra keys (None for plain text prompts).
pub fn block_hashes_with(
    root: &BlockDigest,
    tokens: &[u32],
    block_size: usize,
    mut extra: impl FnMut(usize) -> Option<Vec<ExtraKey>>,
) -> Vec<BlockDigest> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = *root;
    tokens
        .chunks_exact(block_size)
        .enumerate()
        .map(|(i, block)| {
            let keys = extra(i);
            parent = block_digest(&parent, block, keys.as_deref());
            parent
        })
        .collect()
}

/// Digests of every full block of a plain prompt.
pub fn block_hashes(root: &BlockDigest, tokens: &[u32], block_size: usize) -> Vec<BlockDigest> {
    block_hashes_with(root, tokens, block_size, |_| None)
}

/// The integer form KV events carry by default: the digest's last 8 bytes, big-endian.
pub fn event_id(digest: &BlockDigest) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

pub fn to_hex(digest: &BlockDigest) -> String {
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Vectors confirmed with vLLM 0.32's own hashing functions (shared/PROTOCOLS.md §2).
    const NONE_HASH: &str = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0";
    const FIRST_BLOCK: &str = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749";

    #[test]
    fn matches_vllm_vectors() {
        let root = none_hash(None);
        assert_eq!(to_hex(&root), NONE_HASH);
        let tokens: Vec<u32> = (0..16).collect();
        let hashes = block_hashes(&root, &tokens, 16);
        assert_eq!(hashes.len(), 1);
        assert_eq!(to_hex(&hashes[0]), FIRST_BLOCK);
        assert_eq!(event_id(&hashes[0]), 2233398808101521225);
    }

    #[test]
    fn only_full_blocks_and_chained() {
        let root = none_hash(None);
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = block_hashes(&root, &tokens, 16);
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[1], block_digest(&hashes[0], &tokens[16..32], None));
        // Same block content under another parent hashes differently.
        assert_ne!(block_digest(&root, &tokens[16..32], None), hashes[1]);
        assert!(block_hashes(&root, &tokens, 0).is_empty());
    }

    #[test]
    fn seed_and_extra_keys_change_the_chain() {
        assert_ne!(none_hash(Some("0")), none_hash(None));
        let root = none_hash(None);
        let tokens: Vec<u32> = (0..16).collect();
        let salted = block_hashes_with(&root, &tokens, 16, |_| Some(vec![ExtraKey::Text("salt".into())]));
        assert_ne!(salted, block_hashes(&root, &tokens, 16));
    }
}
