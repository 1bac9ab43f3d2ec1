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
