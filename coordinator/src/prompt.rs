//! A pair request's prompt → the block hashes the index is keyed by: token ids → the engines'
//! own chain (exact: their events carry the same ids) — vLLM's `sha256_cbor` or SGLang's page
//! hashes, as `--block-hash` says; prompt text → a tokenizer.json when one is configured
//! (exact), else a chain over text chunks (approximate: only the coordinator's own routing
//! records can match it).

use std::path::Path;

use pd_protocols::hash::{block_hashes_with, event_id, none_hash, sglang, BlockDigest, ExtraKey};

/// Whose block hashes the engines' KV events carry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum BlockHashScheme {
    /// vLLM's `sha256_cbor` chain (`--prefix-caching-hash-algo sha256_cbor`).
    #[default]
    Vllm,
    /// SGLang's radix-cache page chain (signed 64-bit ids). An adapter's blocks, which SGLang
    /// publishes under ids no router can compute, are re-keyed to this chain as they are indexed
    /// (coordinator `rekey` module); prompts under a cache salt are not modelled (they find no overlap).
    Sglang,
}

/// How a request's hashes were obtained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Engine-compatible: matches KV events.
    Exact,
    /// Text chunks: matches only routed-prefix records.
    Approximate,
}

#[derive(Debug)]
pub struct Hashed {
    pub hashes: Vec<u64>,
    pub prompt_tokens: u64,
    pub precision: Precision,
}

#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

#[derive(Debug)]
pub struct PromptHasher {
    root: BlockDigest,
    scheme: BlockHashScheme,
    tokenizer: Option<Box<tokenizers::Tokenizer>>,
    add_special_tokens: bool,
    chars_per_token: usize,
}

/// FNV-1a over `bytes`, continuing from `state`.
fn fnv1a(state: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(state, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// Separates approximate keys from engine block ids (which are SHA-256 based).
const APPROX_SEED: u64 = 0x6170_7072_6f78_2d31; // "approx-1"

impl PromptHasher {
    pub fn new(
        pythonhashseed: Option<&str>,
        tokenizer: Option<&Path>,
        add_special_tokens: bool,
        chars_per_token: usize,
    ) -> Result<PromptHasher, PromptError> {
        let tokenizer = tokenizer
            .map(|path| {
                tokenizers::Tokenizer::from_file(path)
                    .map(Box::new)
                    .map_err(|e| PromptError::Load { path: path.display().to_string(), reason: e.to_string() })
            })
            .transpose()?;
        Ok(PromptHasher {
            root: none_hash(pythonhashseed),
            scheme: BlockHashScheme::Vllm,
            tokenizer,
            add_special_tokens,
            chars_per_token: chars_per_token.max(1),
        })
    }

    /// Hashes token ids the way `scheme`'s engines do.
    pub fn with_scheme(mut self, scheme: BlockHashScheme) -> PromptHasher {
        self.scheme = scheme;
        self
    }

    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
    }

    /// The engines' block ids of every full block of `tokens`. Under a LoRA adapter vLLM puts
    /// the adapter's name first in every block's extra keys (the only key for a text prompt).
    pub fn token_hashes(&self, tokens: &[u32], block_size: u32, lora_name: Option<&str>) -> Vec<u64> {
        let block_size = block_size.max(1) as usize;
        match self.scheme {
            BlockHashScheme::Vllm => {
                let extra = |_| lora_name.map(|name| vec![ExtraKey::Text(name.to_owned())]);
                block_hashes_with(&self.root, tokens, block_size, extra).iter().map(event_id).collect()
            }
            BlockHashScheme::Sglang => sglang::page_hashes(tokens, block_size).iter().map(sglang::event_id).collect(),
        }
    }

    /// Hashes for a prompt given as text.
    pub fn text_hashes(&self, text: &str, block_size: u32, lora_name: Option<&str>) -> Result<Hashed, PromptError> {
        if let Some(tokenizer) = &self.tokenizer {
            let encoding =
                tokenizer.encode_fast(text, self.add_special_tokens).map_err(|e| PromptError::Encode(e.to_string()))?;
            let tokens = encoding.get_ids();
            return Ok(Hashed {
                hashes: self.token_hashes(tokens, block_size, lora_name),
                prompt_tokens: tokens.len() as u64,
                precision: Precision::Exact,
            });
        }
        Ok(self.approximate(text, block_size, lora_name))
    }

    /// A chain over chunks of about `block_size` tokens' worth of text (cut on character
    /// boundaries); only full chunks are hashed, as only full blocks are cached. An adapter's
    /// name seeds the chain, as it keys vLLM's.
    fn approximate(&self, text: &str, block_size: u32, lora_name: Option<&str>) -> Hashed {
        let chunk_bytes = (block_size.max(1) as usize).saturating_mul(self.chars_per_token);
        let mut hashes = Vec::with_capacity(text.len() / chunk_bytes + 1);
        let mut parent = lora_name.map_or(APPROX_SEED, |name| fnv1a(APPROX_SEED, name.as_bytes()));
        let mut start = 0;
        let bytes = text.as_bytes();
        while text.len() - start >= chunk_bytes {
            let mut end = start + chunk_bytes;
            while !text.is_char_boundary(end) {
                end += 1;
            }
            parent = fnv1a(fnv1a(parent ^ 0x9e37_79b9_7f4a_7c15, &parent.to_le_bytes()), &bytes[start..end]);
            hashes.push(parent);
            start = end;
        }
        let chars = text.chars().count() as u64;
        Hashed { hashes, prompt_tokens: chars.div_ceil(self.chars_per_token as u64), precision: Precision::Approximate }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_hash_like_vllm() {
        let hasher = PromptHasher::new(None, None, false, 4).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = hasher.token_hashes(&tokens, 16, None);
        // PROTOCOLS.md §2: the first block of tokens 0..15 (block size 16).
        assert_eq!(hashes.len(), 2);
        assert_eq!(hashes[0], 2_233_398_808_101_521_225);
        // An adapter's blocks: the name is every block's extra key, as vLLM hashes them.
        let adapted = hasher.token_hashes(&tokens, 16, Some("sql-lora"));
        let root = none_hash(None);
        let first = pd_protocols::hash::block_digest(&root, &tokens[..16], Some(&[ExtraKey::Text("sql-lora".into())]));
        let second =
            pd_protocols::hash::block_digest(&first, &tokens[16..32], Some(&[ExtraKey::Text("sql-lora".into())]));
        assert_eq!(adapted, vec![event_id(&first), event_id(&second)]);
        assert_ne!(adapted[0], hashes[0]);
        assert_ne!(hasher.token_hashes(&tokens, 16, Some("other"))[0], adapted[0]);
    }

    /// The ids a real SGLang 0.5.23 (page size 1) published for tokens 11..=15 (e2e/tests/sglang.rs
    /// checks the same against the live engine).
    #[test]
    fn token_ids_hash_like_sglang() {
        let hasher = PromptHasher::new(None, None, false, 4).unwrap().with_scheme(BlockHashScheme::Sglang);
        let ids: Vec<i64> = hasher.token_hashes(&[11, 12, 13, 14, 15], 1, None).iter().map(|&h| h as i64).collect();
        assert_eq!(
            ids,
            [
                -3805285395451375351,
                7506513167249350507,
                -3077916588206928548,
                -1670714019215540768,
                -3183329780511295086
            ]
        );
        assert_eq!(hasher.token_hashes(&[11, 12, 13], 2, None).len(), 1, "only full pages");
    }

    #[test]
    fn approximate_chunks_share_prefixes() {
        let hasher = PromptHasher::new(None, None, false, 4).unwrap();
        let a = hasher.text_hashes(&"word ".repeat(100), 16, None).unwrap();
        let b = hasher.text_hashes(&format!("{}tail", "word ".repeat(64)), 16, None).unwrap();
        let adapted = hasher.text_hashes(&"word ".repeat(100), 16, Some("sql-lora")).unwrap();
        assert!(adapted.hashes.iter().all(|h| !a.hashes.contains(h)), "an adapter's chunks never match the base's");
        assert_eq!(a.precision, Precision::Approximate);
        assert_eq!(a.hashes.len(), 500 / 64);
        assert_eq!(a.hashes[..5], b.hashes[..5]);
        assert_eq!(a.prompt_tokens, 125);
        let unicode = hasher.text_hashes(&"é".repeat(100), 16, None).unwrap();
        assert_eq!(unicode.hashes.len(), 3);
    }
}
