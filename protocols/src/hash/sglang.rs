//! SGLang's radix-cache page hashes as its KV events carry them (SGLang 0.5.23).
//!
//! Page `i`'s digest is SHA-256 of the previous page's digest followed by the page's token ids
//! as little-endian u32. A chain's first page has no previous digest, except under a cache salt:
//! then it is [`salt_root`] (SHA-256 of `"sglang-cache-salt-v1\0"` and the salt). An event
//! carries the digest's first 8 bytes read big-endian as a signed 64-bit integer; [`event_id`]
//! gives the same bits as u64 (the form `BlockHash::Int` keeps). Only full pages are hashed
//! here: a request's prefix can only match whole pages.
//!
//! Under a LoRA adapter SGLang publishes these ids passed through a keyed hash whose key comes
//! from the adapter's internal id (a uuid of its load), which no router can compute from the
//! adapter's name; the coordinator re-keys such events with [`page_digest`] instead.

use sha2::{Digest, Sha256};

use super::BlockDigest;

/// The digest of one page given its parent's (`None` for a chain's first page).
pub fn page_digest(parent: Option<&BlockDigest>, tokens: &[u32]) -> BlockDigest {
    let mut sha = Sha256::new();
    if let Some(parent) = parent {
        sha.update(parent);
    }
    for token in tokens {
        sha.update(token.to_le_bytes());
    }
    sha.finalize().into()
}

/// The digest a chain under cache salt `salt` starts from (SGLang's `"sglang-cache-salt-v1\0"`
/// seed).
pub fn salt_root(salt: &str) -> BlockDigest {
    let mut sha = Sha256::new();
    sha.update(b"sglang-cache-salt-v1\0");
    sha.update(salt.as_bytes());
    sha.finalize().into()
}

/// Digests of every full page of `tokens`.
pub fn page_hashes(tokens: &[u32], page_size: usize) -> Vec<BlockDigest> {
    page_hashes_from(None, tokens, page_size)
}

/// Digests of every full page of `tokens`, the first chained to `root` (a [`salt_root`], or a
/// parent page's digest).
pub fn page_hashes_from(root: Option<BlockDigest>, tokens: &[u32], page_size: usize) -> Vec<BlockDigest> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut parent = root;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            let digest = page_digest(parent.as_ref(), page);
            parent = Some(digest);
            digest
        })
        .collect()
}

/// The integer an event carries: the digest's first 8 bytes, big-endian (as u64 bits).
pub fn event_id(digest: &BlockDigest) -> u64 {
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference values computed with SGLang 0.5.23's own `get_hash_str` and
    /// `hash_str_to_int64` (page size 1 and 2).
    #[test]
    fn chains_match_sglangs_own_hashes() {
        let tokens = [1u32, 2, 3, 4];
        let ids: Vec<i64> = page_hashes(&tokens, 1).iter().map(|d| event_id(d) as i64).collect();
        assert_eq!(ids, REFERENCE_PAGE_1);
        let ids: Vec<i64> = page_hashes(&tokens, 2).iter().map(|d| event_id(d) as i64).collect();
        assert_eq!(ids, REFERENCE_PAGE_2);
    }

    /// Reference values computed with SGLang's own `get_hash_str` from the root its
    /// `compute_node_event_hash_values` uses under cache salt "tenant-a".
    #[test]
    fn salted_chains_match_sglangs_own_hashes() {
        let root = Some(salt_root("tenant-a"));
        let ids = |page| -> Vec<i64> {
            page_hashes_from(root, &[1, 2, 3, 4], page).iter().map(|d| event_id(d) as i64).collect()
        };
        assert_eq!(ids(1), REFERENCE_SALTED_PAGE_1);
        assert_eq!(ids(2), REFERENCE_SALTED_PAGE_2);
    }

    #[test]
    fn partial_pages_and_page_size_zero_hash_nothing() {
        assert_eq!(page_hashes(&[1, 2, 3], 2).len(), 1);
        assert!(page_hashes(&[1, 2, 3], 0).is_empty());
        assert!(page_hashes(&[], 1).is_empty());
    }

    const REFERENCE_PAGE_1: [i64; 4] =
        [7470307888890966271, -1634645291211865391, 7325169757385981536, -4123756397210254169];
    const REFERENCE_PAGE_2: [i64; 2] = [3817746824117602890, -4216701448867210342];
    const REFERENCE_SALTED_PAGE_1: [i64; 4] =
        [-2646080219873861990, -139608071693067518, -2762364562096477335, -2193405129088434666];
    const REFERENCE_SALTED_PAGE_2: [i64; 2] = [31502315585564397, -6358338539514506595];
}
