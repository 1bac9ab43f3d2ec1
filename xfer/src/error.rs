use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use xfer_core::{BackendError, Desc, MemType, RefusalCode};

use crate::metadata::MetadataError;

/// Which side of a transfer a descriptor belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Local,
    Remote,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Local => "local",
            Side::Remote => "remote",
        })
    }
}

/// Errors of the `xfer` API.
#[derive(Debug, thiserror::Error)]
pub enum XferError {
    #[error("unknown peer agent {0:?} (load its metadata first)")]
    UnknownPeer(String),
    #[error("unknown backend {0:?}")]
    UnknownBackend(String),
    #[error("backend {0:?} is already attached")]
    BackendExists(String),
    #[error("no backend can serve this request: {0}")]
    NoBackend(String),
    #[error("{side} descriptor {index} ({mem_type} addr={:#x} len={} dev={}) is outside any registration", desc.addr, desc.len, desc.dev_id)]
    NotRegistered { side: Side, index: usize, mem_type: MemType, desc: Desc },
    #[error("local and remote lists differ in total length: {local} vs {remote} bytes")]
    LengthMismatch { local: u64, remote: u64 },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("refused by peer: {code}: {message}")]
    Refused { code: RefusalCode, message: String },
    #[error("peer {peer} disconnected: {reason}")]
    PeerDisconnected { peer: String, reason: String },
    #[error("timed out after {0:?}")]
    TimedOut(Duration),
    #[error("cancelled")]
    Cancelled,
    #[error("request is still in progress")]
    Busy,
    #[error("request was never posted")]
    NotPosted,
    #[error("memory is being deregistered")]
    Deregistered,
    #[error("metadata: {0}")]
    Metadata(#[from] MetadataError),
    /// The cluster credential cannot be loaded.
    #[error("cluster credential: {0}")]
    Credential(#[from] xfer_core::credential::CredentialError),
    #[error("side channel {addr}: {source}")]
    SideChannel {
        addr: String,
        #[source]
        source: crate::side_channel::SideChannelError,
    },
    #[error("backend {backend}: {source}")]
    Backend {
        backend: String,
        #[source]
        source: Arc<BackendError>,
    },
}

impl XferError {
    /// A stable name for the error's category, for callers outside Rust (the Python bindings'
    /// exceptions carry it) and for logs and metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            XferError::UnknownPeer(_) => "unknown_peer",
            XferError::UnknownBackend(_) => "unknown_backend",
            XferError::BackendExists(_) => "backend_exists",
            XferError::NoBackend(_) => "no_backend",
            XferError::NotRegistered { .. } => "not_registered",
            XferError::LengthMismatch { .. } => "length_mismatch",
            XferError::InvalidArgument(_) => "invalid_argument",
            XferError::Refused { .. } => "refused",
            XferError::PeerDisconnected { .. } => "peer_disconnected",
            XferError::TimedOut(_) => "timed_out",
            XferError::Cancelled => "cancelled",
            XferError::Busy => "busy",
            XferError::NotPosted => "not_posted",
            XferError::Deregistered => "deregistered",
            XferError::Metadata(_) => "metadata",
            XferError::Credential(_) => "credential",
            XferError::SideChannel { .. } => "side_channel",
            XferError::Backend { .. } => "backend",
        }
    }

    /// The setting a backend refused because it does not take it ([`BackendError::UnknownParam`]).
    pub fn unknown_param(&self) -> Option<&str> {
        match self {
            XferError::Backend { source, .. } => match &**source {
                BackendError::UnknownParam { name, .. } => Some(name),
                _ => None,
            },
            _ => None,
        }
    }

    /// Maps a backend's error onto the API's categories, keeping the backend name for the rest.
    pub(crate) fn from_backend(backend: &str, err: Arc<BackendError>) -> XferError {
        match &*err {
            BackendError::Refused { code: RefusalCode::Deregistered, .. } => XferError::Deregistered,
            BackendError::Refused { code, message } => XferError::Refused { code: *code, message: message.clone() },
            BackendError::PeerDisconnected { peer, reason } => {
                XferError::PeerDisconnected { peer: peer.clone(), reason: reason.clone() }
            }
            BackendError::TimedOut(after) => XferError::TimedOut(*after),
            BackendError::Cancelled => XferError::Cancelled,
            _ => XferError::Backend { backend: backend.to_string(), source: err },
        }
    }

    pub(crate) fn backend(backend: &str, err: BackendError) -> XferError {
        Self::from_backend(backend, Arc::new(err))
    }
}
