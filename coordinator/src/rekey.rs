//! SGLang's adapter blocks, re-keyed on their way into the index.
//!
//! Under a LoRA adapter SGLang publishes each page's id passed through a keyed hash whose key
//! comes from the adapter's internal id (a uuid of the adapter's load), so no router can compute
//! those ids from a prompt and the adapter's name. Its events carry what is needed instead: each
//! page's tokens, the parent page's id, the adapter's public `lora_name` and the `cache_salt`.
//! Each stored block gets the id of SGLang's own page chain without the key (what
//! `--block-hash sglang` computes for a prompt) and goes to the adapter's index. The block's
//! chain digest is kept, by holder and published id, while the engine holds the block: the next
//! page's id chains from it, and a removal names only the published id.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pd_protocols::hash::{sglang, BlockDigest};
use pd_protocols::kv_events::{BlockHash, KvEvent};

use crate::ranks;

#[derive(Debug, Clone)]
struct Rekeyed {
    index_key: Arc<str>,
    digest: BlockDigest,
}

/// The published ids of the adapter blocks the engines hold, and what they were re-keyed to.
#[derive(Debug, Default)]
pub struct Rekeyer {
    blocks: HashMap<(usize, u64), Rekeyed>,
    /// The index keys blocks went to, shared by their blocks (one per adapter).
    index_keys: HashSet<Arc<str>>,
}

/// Why a stored event could not be re-keyed (its blocks stay out of the index).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RekeyError {
    #[error("the parent block is not one this engine stored under an adapter (missed or evicted)")]
    UnknownParent,
    #[error("the event's tokens do not fill its blocks")]
    TokensDoNotFillBlocks,
    #[error("not a stored-blocks event")]
    NotStored,
}

/// A removal split by where its blocks are indexed.
#[derive(Debug, Default, PartialEq)]
pub struct Removal {
    /// Re-keyed blocks by the index they went to.
    pub rekeyed: Vec<(Arc<str>, Vec<BlockHash>)>,
    /// Blocks stored as published (they may be in any index of the model).
    pub published: Vec<BlockHash>,
}

impl Rekeyer {
    /// `event` (a `BlockStored` of `holder` for the index `index_key`) with its block and parent
    /// ids re-keyed; remembers each block.
    pub fn store(&mut self, holder: usize, index_key: &str, event: &KvEvent) -> Result<KvEvent, RekeyError> {
        let KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, cache_salt, .. } = event
        else {
            return Err(RekeyError::NotStored);
        };
        let page = *block_size as usize;
        if page == 0 || token_ids.len() != block_hashes.len() * page {
            return Err(RekeyError::TokensDoNotFillBlocks);
        }
        let mut parent = match parent_block_hash {
            Some(p) => Some(self.blocks.get(&(holder, p.as_u64())).ok_or(RekeyError::UnknownParent)?.digest),
            None => cache_salt.as_deref().map(sglang::salt_root),
        };
        let new_parent = parent_block_hash.as_ref().and(parent.as_ref()).map(|d| BlockHash::Int(sglang::event_id(d)));
        let index_key = match self.index_keys.get(index_key) {
            Some(key) => Arc::clone(key),
            None => {
                let key: Arc<str> = Arc::from(index_key);
                self.index_keys.insert(Arc::clone(&key));
                key
            }
        };
        let mut rekeyed = Vec::with_capacity(block_hashes.len());
        for (published, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(page)) {
            let digest = sglang::page_digest(parent.as_ref(), tokens);
            self.blocks.insert((holder, published.as_u64()), Rekeyed { index_key: Arc::clone(&index_key), digest });
            rekeyed.push(BlockHash::Int(sglang::event_id(&digest)));
            parent = Some(digest);
        }
        let mut out = event.clone();
        if let KvEvent::BlockStored { block_hashes, parent_block_hash, .. } = &mut out {
            *block_hashes = rekeyed;
            *parent_block_hash = new_parent;
        }
        Ok(out)
    }

    /// Splits `holder`'s removed blocks into re-keyed ones (forgotten here) and the rest.
    pub fn remove(&mut self, holder: usize, hashes: &[BlockHash]) -> Removal {
        let mut removal = Removal::default();
        for hash in hashes {
            match self.blocks.remove(&(holder, hash.as_u64())) {
                Some(r) => {
                    let id = BlockHash::Int(sglang::event_id(&r.digest));
                    match removal.rekeyed.iter_mut().find(|(key, _)| *key == r.index_key) {
                        Some((_, ids)) => ids.push(id),
                        None => removal.rekeyed.push((r.index_key, vec![id])),
                    }
                }
                None => removal.published.push(hash.clone()),
            }
        }
        removal
    }

    /// Forgets `holder`'s blocks (it cleared its cache, or its stream had a gap).
    pub fn clear(&mut self, holder: usize) {
        self.blocks.retain(|(h, _), _| *h != holder);
    }

    /// Forgets every rank's blocks of `engine`.
    pub fn clear_engine(&mut self, engine: usize) {
        self.blocks.retain(|(h, _), _| ranks::engine_of(*h) != engine);
    }

    /// Blocks remembered (for tests and metrics).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], salt: Option<&str>) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| BlockHash::Int(h)).collect(),
            parent_block_hash: parent.map(BlockHash::Int),
            token_ids: tokens.to_vec(),
            block_size: 1,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: Some("sql".into()),
            cache_salt: salt.map(str::to_owned),
        }
    }

    fn ids(event: &KvEvent) -> (Vec<u64>, Option<u64>) {
        let KvEvent::BlockStored { block_hashes, parent_block_hash, .. } = event else { panic!("{event:?}") };
        (block_hashes.iter().map(BlockHash::as_u64).collect(), parent_block_hash.as_ref().map(BlockHash::as_u64))
    }

    #[test]
    fn chains_across_events_to_sglangs_page_ids() {
        let tokens = [5u32, 6, 7, 8];
        let want: Vec<u64> = sglang::page_hashes(&tokens, 1).iter().map(sglang::event_id).collect();
        let mut r = Rekeyer::default();
        let first = r.store(0, "m#lora=sql", &stored(&[901, 902], None, &tokens[..2], None)).unwrap();
        assert_eq!(ids(&first), (want[..2].to_vec(), None));
        let second = r.store(0, "m#lora=sql", &stored(&[903, 904], Some(902), &tokens[2..], None)).unwrap();
        assert_eq!(ids(&second), (want[2..].to_vec(), Some(want[1])));
        // Another holder's chain does not continue this one.
        assert_eq!(r.store(1, "m#lora=sql", &stored(&[905], Some(904), &[9], None)), Err(RekeyError::UnknownParent));
        let removal = r.remove(0, &[BlockHash::Int(904), BlockHash::Int(77)]);
        assert_eq!(removal.rekeyed, vec![(Arc::from("m#lora=sql"), vec![BlockHash::Int(want[3])])]);
        assert_eq!(removal.published, vec![BlockHash::Int(77)]);
        assert_eq!(r.len(), 3);
        r.clear(0);
        assert!(r.is_empty());
    }

    #[test]
    fn a_salt_seeds_the_chain() {
        let mut r = Rekeyer::default();
        let event = r.store(0, "k", &stored(&[1, 2], None, &[1, 2], Some("tenant-a"))).unwrap();
        let root = sglang::salt_root("tenant-a");
        let want: Vec<u64> = sglang::page_hashes_from(Some(root), &[1, 2], 1).iter().map(sglang::event_id).collect();
        assert_eq!(ids(&event), (want, None));
    }

    #[test]
    fn malformed_events_are_refused() {
        let mut r = Rekeyer::default();
        assert_eq!(r.store(0, "k", &stored(&[1, 2], None, &[1], None)), Err(RekeyError::TokensDoNotFillBlocks));
        assert_eq!(r.store(0, "k", &KvEvent::AllBlocksCleared), Err(RekeyError::NotStored));
        assert!(r.is_empty());
    }

    #[test]
    fn clearing_an_engine_clears_its_ranks() {
        let mut r = Rekeyer::default();
        r.store(ranks::holder(3, 1), "k", &stored(&[1], None, &[1], None)).unwrap();
        r.store(ranks::holder(4, 0), "k", &stored(&[1], None, &[1], None)).unwrap();
        r.clear_engine(3);
        assert_eq!(r.len(), 1);
    }
}
