//! The block pool's bookkeeping, without memory or I/O: reference counts, the prefix cache
//! (digest → block) and one eviction queue, as vLLM keeps them. Blocks with no user sit in the
//! queue; allocation takes from the front, so cached blocks freed long ago are evicted first and
//! blocks that never held a full, hashed block are reused before any cached one.

use std::collections::HashMap;

use crate::content::Digest;

const NIL: u32 = u32::MAX;

pub type BlockId = u32;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("KV cache full: {wanted} blocks wanted, {free} free")]
pub struct PoolFull {
    pub wanted: usize,
    pub free: usize,
}

/// A doubly linked queue over block ids, stored in two arrays (O(1) removal from the middle,
/// which a prefix hit on a free cached block needs).
#[derive(Debug)]
struct Queue {
    prev: Vec<u32>,
    next: Vec<u32>,
    queued: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Queue {
    fn new(n: usize) -> Self {
        let mut q =
            Queue { prev: vec![NIL; n], next: vec![NIL; n], queued: vec![false; n], head: NIL, tail: NIL, len: 0 };
        for id in 0..n as u32 {
            q.push_back(id);
        }
        q
    }

    fn push_back(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.queued[i]);
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        match self.tail {
            NIL => self.head = id,
            t => self.next[t as usize] = id,
        }
        self.tail = id;
        self.queued[i] = true;
        self.len += 1;
    }

    fn push_front(&mut self, id: u32) {
        let i = id as usize;
        debug_assert!(!self.queued[i]);
        self.next[i] = self.head;
        self.prev[i] = NIL;
        match self.head {
            NIL => self.tail = id,
            h => self.prev[h as usize] = id,
        }
        self.head = id;
        self.queued[i] = true;
        self.len += 1;
    }

    fn remove(&mut self, id: u32) {
        let i = id as usize;
        if !self.queued[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        match p {
            NIL => self.head = n,
            p => self.next[p as usize] = n,
        }
        match n {
            NIL => self.tail = p,
            n => self.prev[n as usize] = p,
        }
        self.queued[i] = false;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.remove(id);
        Some(id)
    }
}

/// What an operation did to the prefix cache (the engine turns it into KV events).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CacheChanges {
    pub removed: Vec<Digest>,
}

#[derive(Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    digest: Vec<Option<Digest>>,
    by_digest: HashMap<Digest, BlockId>,
    free: Queue,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        assert!(num_blocks < NIL as usize, "block ids are u32");
        BlockPool {
            refs: vec![0; num_blocks],
            digest: vec![None; num_blocks],
            by_digest: HashMap::new(),
            free: Queue::new(num_blocks),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.refs.len()
    }

    /// Blocks that some request (or lease) holds.
    pub fn used(&self) -> usize {
        self.refs.len() - self.free.len
    }

    /// Full blocks currently findable by digest (held or not).
    pub fn cached(&self) -> usize {
        self.by_digest.len()
    }

    /// How many leading digests are cached.
    pub fn longest_prefix(&self, digests: &[Digest]) -> usize {
        digests.iter().take_while(|d| self.by_digest.contains_key(*d)).count()
    }

    /// Takes a reference on the cached blocks of these digests (all must be cached: call
    /// [`longest_prefix`](Self::longest_prefix) first).
    pub fn acquire_cached(&mut self, digests: &[Digest]) -> Vec<BlockId> {
        digests
            .iter()
            .map(|d| {
                let id = self.by_digest[d];
                if self.refs[id as usize] == 0 {
                    self.free.remove(id);
                }
                self.refs[id as usize] += 1;
                id
            })
            .collect()
    }

    /// Takes `n` unused blocks, evicting cached ones from the front of the queue.
    pub fn allocate(&mut self, n: usize, changes: &mut CacheChanges) -> Result<Vec<BlockId>, PoolFull> {
        if n > self.free.len {
            return Err(PoolFull { wanted: n, free: self.free.len });
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free.pop_front().expect("length checked");
            if let Some(d) = self.digest[id as usize].take() {
                self.by_digest.remove(&d);
                changes.removed.push(d);
            }
            self.refs[id as usize] = 1;
            out.push(id);
        }
        Ok(out)
    }

    /// Records that a held block now holds the full block with this digest. `false` when the
    /// digest is already cached in another block (two requests computed the same prefix at
    /// once): this block then stays uncached, as in vLLM.
    pub fn commit(&mut self, id: BlockId, digest: Digest) -> bool {
        if self.by_digest.contains_key(&digest) || self.digest[id as usize].is_some() {
            return false;
        }
        self.by_digest.insert(digest, id);
        self.digest[id as usize] = Some(digest);
        true
    }

    /// Drops one reference from each block. A block nobody holds returns to the queue: at the
    /// back when cached (evicted last), at the front otherwise (reused first). Releasing a
    /// block nobody holds is ignored (and reported by the return value).
    pub fn release(&mut self, ids: &[BlockId]) -> usize {
        let mut ignored = 0;
        // Reverse order: a chain's tail blocks are evicted before its head, as in vLLM.
        for &id in ids.iter().rev() {
            let i = id as usize;
            if i >= self.refs.len() || self.refs[i] == 0 {
                ignored += 1;
                continue;
            }
            self.refs[i] -= 1;
            if self.refs[i] == 0 {
                match self.digest[i] {
                    Some(_) => self.free.push_back(id),
                    None => self.free.push_front(id),
                }
            }
        }
        ignored
    }

    /// Forgets every digest (`/reset_prefix_cache`); held blocks stay held but uncached.
    pub fn clear_cache(&mut self) -> usize {
        let n = self.by_digest.len();
        self.by_digest.clear();
        self.digest.iter_mut().for_each(|d| *d = None);
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(i: u8) -> Digest {
        [i; 32]
    }

    #[test]
    fn prefix_hits_eviction_order_and_release() {
        let mut pool = BlockPool::new(4);
        let mut ch = CacheChanges::default();
        let a = pool.allocate(3, &mut ch).unwrap();
        assert!(pool.commit(a[0], d(1)) && pool.commit(a[1], d(2)));
        assert_eq!(pool.used(), 3);
        pool.release(&a);
        assert_eq!((pool.used(), pool.cached()), (0, 2));
        assert_eq!(pool.longest_prefix(&[d(1), d(2), d(3)]), 2);
        assert_eq!(pool.longest_prefix(&[d(2)]), 1);
        // Uncached blocks are reused first: a[2] and the never-used block 3.
        let b = pool.allocate(2, &mut ch).unwrap();
        assert!(ch.removed.is_empty());
        assert!(b.contains(&a[2]) && b.contains(&3));
        // Then the LRU cached block: the chain tail (d(2)) went back first.
        let c = pool.allocate(1, &mut ch).unwrap();
        assert_eq!((c[0], ch.removed.clone()), (a[1], vec![d(2)]));
        assert_eq!(pool.allocate(2, &mut ch), Err(PoolFull { wanted: 2, free: 1 }));
        // A hit on a free cached block takes it out of the queue.
        let hit = pool.acquire_cached(&[d(1)]);
        assert_eq!((hit[0], pool.used()), (a[0], 4));
        assert_eq!(pool.release(&[hit[0], hit[0]]), 1, "double release is ignored");
    }

    #[test]
    fn duplicate_digest_stays_uncached_and_clear_forgets() {
        let mut pool = BlockPool::new(2);
        let mut ch = CacheChanges::default();
        let a = pool.allocate(2, &mut ch).unwrap();
        assert!(pool.commit(a[0], d(9)));
        assert!(!pool.commit(a[1], d(9)));
        assert_eq!(pool.clear_cache(), 1);
        assert_eq!(pool.longest_prefix(&[d(9)]), 0);
        pool.release(&a);
        assert_eq!(pool.used(), 0);
    }
}
