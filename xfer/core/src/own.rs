//! For backends that move data within their own agent (POSIX, GDS): a remote key is the
//! region's id, and a request's "remote" side resolves against the backend's own registrations.

use std::sync::Arc;

use crate::backend::{RemoteKey, RemoteSeg};
use crate::error::{BackendError, RefusalCode};
use crate::mem::{LocalMem, LocalRegion, Pin};

/// A region id as published in the agent's metadata and unpacked from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionIdKey(pub u64);

impl RegionIdKey {
    pub fn encode(region: &LocalRegion) -> Vec<u8> {
        region.id().to_le_bytes().to_vec()
    }

    pub fn unpack(public: &[u8], backend: &str) -> Result<RemoteKey, BackendError> {
        let id: [u8; 8] =
            public.try_into().map_err(|_| BackendError::InvalidMetadata(format!("{backend} key is not 8 bytes")))?;
        Ok(Arc::new(RegionIdKey(u64::from_le_bytes(id))))
    }

    /// The id a segment's key names, or the refusal of a key that is not one.
    pub fn of(seg: &RemoteSeg, backend: &str) -> Result<u64, BackendError> {
        seg.key
            .downcast_ref::<RegionIdKey>()
            .map(|key| key.0)
            .ok_or_else(|| BackendError::InvalidMetadata(format!("remote key is not a {backend} key")))
    }
}

/// The remote segments as this agent's own memory, pinned; `region(id)` looks a registration up.
pub fn resolve_own(
    remote: &[RemoteSeg],
    backend: &str,
    region: impl Fn(u64) -> Option<Arc<LocalRegion>>,
) -> Result<Vec<LocalMem>, BackendError> {
    let mut out = Vec::with_capacity(remote.len());
    let mut pinned: Option<(u64, Pin)> = None;
    for (index, seg) in remote.iter().enumerate() {
        let id = RegionIdKey::of(seg, backend)?;
        let pin = match &pinned {
            Some((have, pin)) if *have == id => pin.clone(),
            _ => {
                let entry = region(id).ok_or_else(|| BackendError::Refused {
                    code: RefusalCode::UnknownKey,
                    message: format!("remote descriptor {index}: region {id} is not registered"),
                })?;
                let pin = entry.pin().ok_or_else(|| BackendError::Refused {
                    code: RefusalCode::Deregistered,
                    message: format!("remote descriptor {index}: region is being deregistered"),
                })?;
                pinned = Some((id, pin.clone()));
                pin
            }
        };
        let mem = pin.local_at(seg.addr, seg.len).ok_or_else(|| BackendError::Refused {
            code: RefusalCode::OutOfBounds,
            message: format!("remote descriptor {index} ({:#x}+{}) is outside its region", seg.addr, seg.len),
        })?;
        out.push(mem);
    }
    Ok(out)
}

/// What tells one own-agent backend instance from another process's agent of the same name:
/// published as its connection info, and checked when a "peer" is connected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance(Vec<u8>);

impl Instance {
    /// A fresh id: this process's pid and a per-process counter.
    pub fn fresh() -> Instance {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut id = std::process::id().to_le_bytes().to_vec();
        id.extend(NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed).to_le_bytes());
        Instance(id)
    }

    pub fn conn_info(&self) -> Vec<u8> {
        self.0.clone()
    }

    /// Accepts only the agent itself, as published by this very instance.
    pub fn admit(&self, backend: &str, agent: &str, peer: &str, conn_info: &[u8]) -> Result<(), BackendError> {
        if peer != agent || conn_info != self.0.as_slice() {
            return Err(BackendError::Unsupported(format!(
                "{backend} moves data within its own agent {agent:?} only, not to {peer:?}"
            )));
        }
        Ok(())
    }
}

/// The one memory type of a request's side (`None` when empty); mixing types is refused.
pub fn side_type(side: &[LocalMem], backend: &str) -> Result<Option<crate::mem::MemType>, BackendError> {
    let mut types = side.iter().map(LocalMem::mem_type);
    let Some(first) = types.next() else { return Ok(None) };
    if let Some(other) = types.find(|t| *t != first) {
        return Err(BackendError::Unsupported(format!("{backend} cannot mix {first} and {other} on one side")));
    }
    Ok(Some(first))
}
