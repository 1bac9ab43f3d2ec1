//! vLLM data parallel: one engine URL in front of N ranks, each with its own KV cache and its
//! own KV-event stream. The index tracks each rank's cache as a holder of its own; pairing
//! scores every rank and lets an engine's best rank stand for it (load is the engine's), and
//! the decision names that rank so the request reaches the cache that holds its prefix.
//!
//! A holder number packs the engine and the rank; rank 0's is the engine's own number, so an
//! engine without data parallel is its own only holder and nothing changes for it.

use std::collections::HashMap;

use crate::index::PrefixIndex;

/// Low bits carry the engine, high bits the rank (ranks stay far below 2^16, engines below
/// 2^32 on 64-bit targets).
const RANK_SHIFT: u32 = usize::BITS / 2;
const ENGINE_MASK: usize = (1 << RANK_SHIFT) - 1;

/// The index holder of `engine`'s rank `rank`.
pub fn holder(engine: usize, rank: u32) -> usize {
    debug_assert!(engine <= ENGINE_MASK && (rank as usize) < 1 << RANK_SHIFT);
    engine | (rank as usize) << RANK_SHIFT
}

pub fn engine_of(holder: usize) -> usize {
    holder & ENGINE_MASK
}

pub fn rank_of(holder: usize) -> u32 {
    (holder >> RANK_SHIFT) as u32
}

/// The holders `index` knows for `engine` (every rank that ever held a block there).
pub fn holders_of(index: &PrefixIndex, engine: usize) -> Vec<usize> {
    index.holders().filter(|&h| engine_of(h) == engine).collect()
}

/// Blocks `index` holds per engine, all ranks together (one pass over its holders).
pub fn blocks_by_engine(index: &PrefixIndex) -> HashMap<usize, usize> {
    let mut blocks = HashMap::new();
    for holder in index.holders() {
        *blocks.entry(engine_of(holder)).or_default() += index.engine_blocks(holder);
    }
    blocks
}

/// A batch from a rank the engine did not declare: indexing it would name a rank that does
/// not exist.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("a KV-event batch of data-parallel rank {rank} from an engine declaring {declared} rank(s)")]
pub struct UndeclaredRank {
    pub rank: u32,
    pub declared: u32,
}

/// The rank a batch's blocks belong to: the rank the batch names (vLLM's `dp_rank`), else the
/// rank whose stream it came on. An engine without data parallel has rank 0 only, whatever its
/// batches say (vLLM publishes `dp_rank` 0 even then).
pub fn batch_rank(declared: u32, stream_rank: u32, named: Option<i64>) -> Result<u32, UndeclaredRank> {
    if declared <= 1 {
        return Ok(0);
    }
    let rank = match named {
        Some(named) => u32::try_from(named).unwrap_or(u32::MAX),
        None => stream_rank,
    };
    if rank < declared {
        Ok(rank)
    } else {
        Err(UndeclaredRank { rank, declared })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holders_pack_engine_and_rank() {
        assert_eq!(holder(7, 0), 7, "rank 0 is the engine itself");
        let h = holder(7, 3);
        assert_ne!(h, 7);
        assert_eq!((engine_of(h), rank_of(h)), (7, 3));
        assert_eq!((engine_of(holder(0, 1023)), rank_of(holder(0, 1023))), (0, 1023));
    }

    #[test]
    fn batch_ranks() {
        assert_eq!(batch_rank(1, 0, Some(5)), Ok(0), "no data parallel: one cache");
        assert_eq!(batch_rank(2, 1, None), Ok(1));
        assert_eq!(batch_rank(2, 0, Some(1)), Ok(1), "the batch's own word wins");
        assert_eq!(batch_rank(2, 0, Some(2)), Err(UndeclaredRank { rank: 2, declared: 2 }));
        assert_eq!(batch_rank(4, 0, Some(-1)), Err(UndeclaredRank { rank: u32::MAX, declared: 4 }));
    }
}
