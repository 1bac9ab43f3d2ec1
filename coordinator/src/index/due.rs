//! Blocks by the deadlines of their approximate entries, so that expiry visits what expired
//! instead of every slot.
//!
//! Each list counts the entries that still carry its deadline. Most guesses are confirmed by
//! events (or replaced) long before they expire; once a deadline has no entry left its list is
//! dropped at once, so expiry never walks it and its memory goes back early.

use std::collections::BTreeMap;

/// The blocks given one deadline (a block may be listed after its entry left), and how many
/// entries carry that deadline now.
#[derive(Debug, Default)]
struct List {
    entries: usize,
    hashes: Vec<u64>,
}

#[derive(Debug, Default)]
pub(super) struct Deadlines {
    lists: BTreeMap<i32, List>,
    /// The latest deadline's list, kept out of `lists` (a decision's blocks share one deadline,
    /// so most additions skip the map). A deadline is never in both.
    tail: (i32, List),
    /// Hashes listed, in `lists` and `tail`.
    hashes: usize,
}

impl Deadlines {
    /// Hashes listed (obsolete ones included).
    pub fn len(&self) -> usize {
        self.hashes
    }

    pub fn heap_bytes(&self) -> usize {
        self.lists.values().map(|l| l.hashes.capacity() * 8 + 48).sum::<usize>() + self.tail.1.hashes.capacity() * 8
    }

    /// An entry with deadline `at` was given to block `hash`.
    pub fn add(&mut self, at: i32, hash: u64) {
        if at != self.tail.0 || self.tail.1.entries == 0 {
            self.flush_tail();
            self.tail.0 = at;
            if let Some(list) = self.lists.remove(&at) {
                self.tail.1 = list;
            }
        }
        self.tail.1.entries += 1;
        self.tail.1.hashes.push(hash);
        self.hashes += 1;
    }

    /// `entries` entries with deadline `at` are on block `hash` (rebuilding the lists).
    pub fn list(&mut self, at: i32, hash: u64, entries: usize) {
        self.flush_tail();
        let list = self.lists.entry(at).or_default();
        list.entries += entries;
        list.hashes.push(hash);
        self.hashes += 1;
    }

    /// An entry with deadline `at` left (confirmed, replaced, reset or expired). Its list goes
    /// when it was the last; a list already handed out by [`Deadlines::pop_due`] is gone.
    pub fn unlist(&mut self, at: i32) {
        if at == self.tail.0 && self.tail.1.entries > 0 {
            self.tail.1.entries -= 1;
            if self.tail.1.entries == 0 {
                self.hashes -= self.tail.1.hashes.len();
                self.tail.1.hashes.clear(); // keep the buffer
            }
            return;
        }
        let Some(list) = self.lists.get_mut(&at) else { return };
        list.entries = list.entries.saturating_sub(1);
        if list.entries == 0 {
            self.hashes -= list.hashes.len();
            self.lists.remove(&at);
        }
    }

    /// The blocks of the earliest deadline at or before `now`, taken out.
    pub fn pop_due(&mut self, now: i32) -> Option<Vec<u64>> {
        self.flush_tail();
        let first = self.lists.first_entry()?;
        if *first.key() > now {
            return None;
        }
        let list = first.remove();
        self.hashes -= list.hashes.len();
        Some(list.hashes)
    }

    /// Forgets every list.
    pub fn clear(&mut self) {
        self.lists.clear();
        self.tail.1.entries = 0;
        self.tail.1.hashes.clear();
        self.hashes = 0;
    }

    fn flush_tail(&mut self) {
        if self.tail.1.entries == 0 {
            return;
        }
        let room = self.tail.1.hashes.len();
        let list = std::mem::replace(&mut self.tail.1, List { entries: 0, hashes: Vec::with_capacity(room) });
        let moved = self.lists.insert(self.tail.0, list);
        debug_assert!(moved.is_none(), "the tail's deadline is never in the map");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_without_entries_is_never_visited() {
        let mut d = Deadlines::default();
        d.add(10, 1);
        d.add(10, 2);
        d.add(20, 3);
        d.unlist(10);
        d.unlist(10);
        assert_eq!(d.len(), 1);
        assert_eq!(d.pop_due(100), Some(vec![3]));
        assert_eq!(d.pop_due(100), None);
        assert_eq!(d.len(), 0);
    }

    #[test]
    fn an_earlier_deadline_coming_back_joins_its_list() {
        let mut d = Deadlines::default();
        d.add(10, 1);
        d.add(20, 2);
        d.add(10, 3);
        d.unlist(10);
        assert_eq!(d.pop_due(15), Some(vec![1, 3]));
        d.unlist(20);
        assert_eq!(d.len(), 0);
        assert_eq!(d.pop_due(100), None);
    }

    #[test]
    fn lists_due_come_out_in_order_and_later_ones_stay() {
        let mut d = Deadlines::default();
        d.list(30, 7, 2);
        d.add(5, 1);
        d.add(20, 2);
        assert_eq!(d.pop_due(25), Some(vec![1]));
        assert_eq!(d.pop_due(25), Some(vec![2]));
        assert_eq!(d.pop_due(25), None);
        d.unlist(30);
        assert_eq!(d.len(), 1, "one of the two entries on block 7 is left");
        d.unlist(30);
        assert_eq!(d.len(), 0);
        // Unlisting what is no longer listed is harmless.
        d.unlist(5);
        d.clear();
        assert_eq!(d.pop_due(i32::MAX), None);
    }
}
