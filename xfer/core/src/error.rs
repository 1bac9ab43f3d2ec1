use std::fmt;

/// Why a target refused a request. Carried on the wire by backends that have error replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RefusalCode {
    /// The request named a remote key the target does not know (never registered or deregistered).
    UnknownKey,
    /// A descriptor reaches outside the registration its key names.
    OutOfBounds,
    /// The registration is being deregistered.
    Deregistered,
    /// The request is malformed in a way the target detected (length mismatch, too large).
    BadRequest,
    /// The target does not serve this kind of memory through this backend.
    Unsupported,
    /// The target is not the agent the initiator expected (stale metadata).
    WrongAgent,
    /// Any code this version does not know.
    Other(u16),
}

impl RefusalCode {
    pub fn to_wire(self) -> u16 {
        match self {
            RefusalCode::UnknownKey => 1,
            RefusalCode::OutOfBounds => 2,
            RefusalCode::Deregistered => 3,
            RefusalCode::BadRequest => 4,
            RefusalCode::Unsupported => 5,
            RefusalCode::WrongAgent => 6,
            RefusalCode::Other(code) => code,
        }
    }

    pub fn from_wire(code: u16) -> Self {
        match code {
            1 => RefusalCode::UnknownKey,
            2 => RefusalCode::OutOfBounds,
            3 => RefusalCode::Deregistered,
            4 => RefusalCode::BadRequest,
            5 => RefusalCode::Unsupported,
            6 => RefusalCode::WrongAgent,
            other => RefusalCode::Other(other),
        }
    }
}

impl fmt::Display for RefusalCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefusalCode::UnknownKey => f.write_str("unknown remote key"),
            RefusalCode::OutOfBounds => f.write_str("descriptor outside the registration"),
            RefusalCode::Deregistered => f.write_str("registration is being deregistered"),
            RefusalCode::BadRequest => f.write_str("bad request"),
            RefusalCode::Unsupported => f.write_str("unsupported"),
            RefusalCode::WrongAgent => f.write_str("wrong agent"),
            RefusalCode::Other(code) => write!(f, "error code {code}"),
        }
    }
}

/// Errors a backend reports. The `xfer` crate maps them onto its own error type one to one.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("refused by peer: {code}: {message}")]
    Refused { code: RefusalCode, message: String },
    #[error("peer {peer} disconnected: {reason}")]
    PeerDisconnected { peer: String, reason: String },
    #[error("timed out after {0:?}")]
    TimedOut(std::time::Duration),
    #[error("cancelled")]
    Cancelled,
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("invalid parameter {name}: {reason}")]
    InvalidParam { name: String, reason: String },
    #[error("invalid connection info or key: {0}")]
    InvalidMetadata(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
}
