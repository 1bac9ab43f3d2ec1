//! Lookup tables: local registrations and loaded peers, both sorted for binary search.

use std::sync::Arc;

use xfer_core::{Desc, LocalRegion, MemType, RemoteAgent, RemoteKey};

use crate::grant_index::GrantIndex;
use crate::metadata::AgentMetadata;

/// Index of a backend in the agent's attach order.
pub(crate) type Slot = usize;

/// A local registered region and its public key per backend.
#[derive(Debug)]
pub(crate) struct LocalEntry {
    pub region: Arc<LocalRegion>,
    pub keys: Vec<(Slot, Vec<u8>)>,
}

impl LocalEntry {
    pub fn has(&self, slot: Slot) -> bool {
        self.keys.iter().any(|(s, _)| *s == slot)
    }
}

/// Sort key shared by both tables: memory type, device, start address.
fn order(mem_type: MemType, desc: &Desc) -> (MemType, u64, u64) {
    (mem_type, desc.dev_id, desc.addr)
}

/// Position of the entry containing `desc`, in a slice sorted by [`order`].
fn find_containing<T>(
    items: &[T],
    place: impl Fn(&T) -> (MemType, Desc),
    mem_type: MemType,
    desc: &Desc,
) -> Option<usize> {
    let target = order(mem_type, desc);
    let after = items.partition_point(|item| {
        let (t, d) = place(item);
        order(t, &d) <= target
    });
    let candidate = after.checked_sub(1)?;
    let (t, d) = place(&items[candidate]);
    (t == mem_type && d.contains(desc)).then_some(candidate)
}

#[derive(Debug, Default)]
pub(crate) struct LocalTable {
    entries: Vec<Arc<LocalEntry>>,
}

impl LocalTable {
    pub fn entries(&self) -> &[Arc<LocalEntry>] {
        &self.entries
    }

    pub fn find(&self, mem_type: MemType, desc: &Desc) -> Option<&Arc<LocalEntry>> {
        find_containing(&self.entries, |e| (e.region.mem_type(), e.region.desc()), mem_type, desc)
            .map(|i| &self.entries[i])
    }

    /// Whether any registered region of that type and device overlaps `desc`.
    pub fn overlaps(&self, mem_type: MemType, desc: &Desc) -> bool {
        let end = desc.end().unwrap_or(u64::MAX);
        self.entries.iter().any(|e| {
            let d = e.region.desc();
            e.region.mem_type() == mem_type
                && d.dev_id == desc.dev_id
                && d.addr < end
                && desc.addr < d.end().unwrap_or(u64::MAX)
        })
    }

    pub fn with_added(&self, added: &[Arc<LocalEntry>]) -> LocalTable {
        let mut entries: Vec<_> = self.entries.iter().chain(added).cloned().collect();
        entries.sort_by_key(|e| order(e.region.mem_type(), &e.region.desc()));
        LocalTable { entries }
    }

    pub fn without(&self, ids: &[u64]) -> LocalTable {
        LocalTable { entries: self.entries.iter().filter(|e| !ids.contains(&e.region.id())).cloned().collect() }
    }
}

/// A backend connection to a peer.
pub(crate) struct PeerLink {
    pub slot: Slot,
    pub conn_info: Vec<u8>,
    pub remote: Arc<dyn RemoteAgent>,
}

/// One of a peer's registered regions with the keys our backends unpacked.
pub(crate) struct PeerRegion {
    pub mem_type: MemType,
    pub desc: Desc,
    pub keys: Vec<(Slot, RemoteKey)>,
}

impl PeerRegion {
    pub fn key(&self, slot: Slot) -> Option<&RemoteKey> {
        self.keys.iter().find(|(s, _)| *s == slot).map(|(_, k)| k)
    }
}

/// A loaded peer agent.
pub(crate) struct Peer {
    pub name: String,
    pub metadata: AgentMetadata,
    pub links: Vec<PeerLink>,
    /// The published regions (sorted), then the granted ranges loaded since
    /// (`Agent::load_grant`), newest last, each with its grant's keys.
    pub regions: Vec<PeerRegion>,
    published: usize,
    grant_index: GrantIndex,
}

impl Peer {
    /// A peer with its `published` regions and the `granted` ranges loaded from its grant
    /// tokens, oldest first.
    pub fn new(
        name: String,
        metadata: AgentMetadata,
        links: Vec<PeerLink>,
        mut published: Vec<PeerRegion>,
        granted: Vec<PeerRegion>,
    ) -> Peer {
        published.sort_by_key(|r| order(r.mem_type, &r.desc));
        let grant_index = GrantIndex::new(&granted);
        let count = published.len();
        published.extend(granted);
        Peer { name, metadata, links, regions: published, published: count, grant_index }
    }

    pub fn published(&self) -> &[PeerRegion] {
        &self.regions[..self.published]
    }

    /// The loaded granted ranges, oldest first.
    pub fn granted(&self) -> &[PeerRegion] {
        &self.regions[self.published..]
    }

    /// The region (or granted range) a descriptor goes through: the newest grant containing
    /// it, else the newest overlapping it (the peer then refuses the part outside), else the
    /// published region containing it.
    pub fn find(&self, mem_type: MemType, desc: &Desc) -> Option<usize> {
        if let Some(index) = self.grant_index.find(self.granted(), mem_type, desc) {
            return Some(self.published + index);
        }
        self.find_published(mem_type, desc)
    }

    /// The published region containing a descriptor, whatever grants are loaded.
    pub fn find_published(&self, mem_type: MemType, desc: &Desc) -> Option<usize> {
        find_containing(self.published(), |r| (r.mem_type, r.desc), mem_type, desc)
    }

    pub fn link(&self, slot: Slot) -> Option<&PeerLink> {
        self.links.iter().find(|l| l.slot == slot)
    }
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("name", &self.name).field("regions", &self.regions.len()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, addr: u64, len: u64, dev: u64) -> Arc<LocalEntry> {
        // SAFETY: these regions are never pinned or dereferenced; only their bounds are used.
        let region = unsafe { LocalRegion::new(id, MemType::Dram, Desc::new(addr, len, dev)) };
        Arc::new(LocalEntry { region: Arc::new(region), keys: vec![] })
    }

    #[test]
    fn finds_the_containing_region() {
        let table =
            LocalTable::default().with_added(&[entry(1, 1000, 100, 0), entry(2, 0, 100, 0), entry(3, 1000, 100, 1)]);
        let find = |addr, len, dev| table.find(MemType::Dram, &Desc::new(addr, len, dev)).map(|e| e.region.id());
        assert_eq!(find(0, 100, 0), Some(2));
        assert_eq!(find(1050, 50, 0), Some(1));
        assert_eq!(find(1050, 51, 0), None);
        assert_eq!(find(1000, 10, 1), Some(3));
        assert_eq!(find(500, 1, 0), None);
        assert_eq!(table.find(MemType::Vram, &Desc::new(0, 1, 0)).map(|e| e.region.id()), None);
        assert!(table.overlaps(MemType::Dram, &Desc::new(90, 20, 0)));
        assert!(!table.overlaps(MemType::Dram, &Desc::new(100, 900, 0)));
        assert_eq!(table.without(&[2]).entries().len(), 2);
    }
}
