//! Descriptor lists resolved once against the registration tables, then used by index
//! (how vLLM moves KV blocks: prepare every block once, transfer block ids).

use std::sync::Arc;

use xfer_core::{Desc, MemType};

use crate::error::{Side, XferError};
use crate::tables::{LocalEntry, LocalTable, Peer};

/// A local descriptor resolved to its registration.
#[derive(Clone, Debug)]
pub(crate) struct LocalSeg {
    pub entry: Arc<LocalEntry>,
    pub addr: u64,
    pub len: u64,
}

/// A remote descriptor resolved to one of the peer's regions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteRef {
    pub region: usize,
    pub addr: u64,
    pub len: u64,
}

/// A local descriptor list checked against this agent's registrations.
#[derive(Clone, Debug)]
pub struct PreparedLocal {
    pub(crate) mem_type: MemType,
    pub(crate) segs: Vec<LocalSeg>,
}

/// A remote descriptor list checked against a peer's metadata.
#[derive(Clone, Debug)]
pub struct PreparedRemote {
    pub(crate) mem_type: MemType,
    pub(crate) peer: Arc<Peer>,
    pub(crate) segs: Vec<RemoteRef>,
}

impl PreparedLocal {
    pub(crate) fn resolve(table: &LocalTable, mem_type: MemType, descs: &[Desc]) -> Result<Self, XferError> {
        let segs = descs
            .iter()
            .enumerate()
            .map(|(index, desc)| match table.find(mem_type, desc) {
                Some(entry) => Ok(LocalSeg { entry: Arc::clone(entry), addr: desc.addr, len: desc.len }),
                None => Err(XferError::NotRegistered { side: Side::Local, index, mem_type, desc: *desc }),
            })
            .collect::<Result<_, _>>()?;
        Ok(PreparedLocal { mem_type, segs })
    }

    pub fn len(&self) -> usize {
        self.segs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }
}

impl PreparedRemote {
    /// `through_grants`: a descriptor goes through the newest loaded grant covering it
    /// ([`Peer::find`]); otherwise through the published region alone.
    pub(crate) fn resolve(
        peer: Arc<Peer>,
        mem_type: MemType,
        descs: &[Desc],
        through_grants: bool,
    ) -> Result<Self, XferError> {
        let find = |desc: &Desc| {
            if through_grants {
                peer.find(mem_type, desc)
            } else {
                peer.find_published(mem_type, desc)
            }
        };
        let segs = descs
            .iter()
            .enumerate()
            .map(|(index, desc)| match find(desc) {
                Some(region) => Ok(RemoteRef { region, addr: desc.addr, len: desc.len }),
                None => Err(XferError::NotRegistered { side: Side::Remote, index, mem_type, desc: *desc }),
            })
            .collect::<Result<_, _>>()?;
        Ok(PreparedRemote { mem_type, peer, segs })
    }

    pub fn peer(&self) -> &str {
        &self.peer.name
    }

    pub fn len(&self) -> usize {
        self.segs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.segs.is_empty()
    }
}

/// Picks `indices` out of `items`, failing on an out-of-range index.
pub(crate) fn pick<T: Clone>(items: &[T], indices: Option<&[usize]>, side: Side) -> Result<Vec<T>, XferError> {
    match indices {
        None => Ok(items.to_vec()),
        Some(indices) => indices
            .iter()
            .map(|&i| {
                items.get(i).cloned().ok_or_else(|| {
                    XferError::InvalidArgument(format!(
                        "{side} index {i} out of range for a prepared list of {}",
                        items.len()
                    ))
                })
            })
            .collect(),
    }
}
