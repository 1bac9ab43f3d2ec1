//! Text ↔ token ids: a real Hugging Face `tokenizer.json` when given (engine-compatible ids for
//! prefix routing), otherwise a simple deterministic word tokenizer.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("tokenizer failed: {0}")]
    Encode(String),
}

/// Words of the simple tokenizer's output text.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were",
];

/// Token ids of the simple tokenizer: words hash into this range.
const SIMPLE_VOCAB: u32 = 32_000;

#[derive(Debug)]
pub enum Tokenizer {
    HuggingFace(Box<tokenizers::Tokenizer>),
    /// Whitespace-separated words, each hashed (FNV-1a) to an id; output ids decode to words.
    Simple,
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

impl Tokenizer {
    pub fn load(path: &Path) -> Result<Tokenizer, TokenizerError> {
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Tokenizer::HuggingFace(Box::new(t)))
            .map_err(|e| TokenizerError::Load { path: path.display().to_string(), reason: e.to_string() })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::HuggingFace(t) => t
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode(e.to_string())),
            Tokenizer::Simple => Ok(text.split_whitespace().map(|w| fnv1a(w.as_bytes()) % SIMPLE_VOCAB).collect()),
        }
    }

    /// The text of one generated token (with its leading space for the simple tokenizer, so
    /// streamed pieces concatenate to the full text).
    pub fn decode_piece(&self, id: u32) -> String {
        match self {
            Tokenizer::HuggingFace(t) => t.decode(&[id], true).unwrap_or_default(),
            Tokenizer::Simple => format!(" {}", WORDS[id as usize % WORDS.len()]),
        }
    }

    pub fn vocab_size(&self) -> u32 {
        match self {
            Tokenizer::HuggingFace(t) => t.get_vocab_size(true).max(1) as u32,
            Tokenizer::Simple => SIMPLE_VOCAB,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_is_deterministic_and_word_based() {
        let t = Tokenizer::Simple;
        let a = t.encode("hello  world\nhello").unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a[0], a[2]);
        assert_eq!(a, t.encode("hello world hello").unwrap());
        assert!(t.decode_piece(5).starts_with(' '));
    }

    #[test]
    fn loads_a_word_level_tokenizer_json() {
        let dir = std::env::temp_dir().join(format!("pd-sim-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, crate::tokenizer::tests::WORD_LEVEL_JSON).unwrap();
        let t = Tokenizer::load(&path).unwrap();
        assert_eq!(t.encode("hello world unknownword").unwrap(), vec![1, 2, 0]);
        assert_eq!(t.decode_piece(2), "world");
        assert_eq!(t.vocab_size(), 3);
        assert!(Tokenizer::load(&dir.join("missing.json")).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    pub(crate) const WORD_LEVEL_JSON: &str = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
      "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}
    }"#;
}
