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
    /// The request named a grant that was revoked or has expired: no byte moved.
    Revoked,
    /// The connection did not prove the cluster credential (none, a wrong one, or only one
    /// side has one).
    Unauthenticated,
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
            RefusalCode::Revoked => 7,
            RefusalCode::Unauthenticated => 8,
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
            7 => RefusalCode::Revoked,
            8 => RefusalCode::Unauthenticated,
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
            RefusalCode::Revoked => f.write_str("grant revoked or expired"),
            RefusalCode::Unauthenticated => f.write_str("unauthenticated"),
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
    /// A setting the backend does not take: a typo, or a key written for another
    /// implementation (NIXL's plugins take keys xfer's backends do not).
    #[error("invalid parameter {name}: unknown parameter for backend {backend}")]
    UnknownParam { name: String, backend: String },
    #[error("invalid connection info or key: {0}")]
    InvalidMetadata(String),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The request involves a kind of memory this backend does not move (the agent's selection
    /// avoids this; a backend named explicitly, or a bug, meets it).
    #[error("backend {backend} does not move {mem_type} memory")]
    MemoryNotMoved { backend: &'static str, mem_type: crate::MemType },
    #[error("file i/o: {0}")]
    File(#[from] FileIoError),
    #[error("GPU memory: {0}")]
    Device(#[from] DeviceError),
    /// The encrypted data path could not be set up: a peer without TLS (or with it where this
    /// side has none), a certificate other than the one its metadata pins, a failed handshake.
    #[error("TLS with {peer} failed: {reason}")]
    Tls { peer: String, reason: String },
}

/// Why GPU memory cannot be used or moved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No CUDA driver here (or it would not initialise): GPU memory can be neither registered
    /// nor moved.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// The descriptor names a CUDA device ordinal this machine does not have.
    #[error("CUDA device {device} does not exist ({count} present)")]
    NoSuchDevice { device: u64, count: u64 },
    /// A CUDA driver call failed.
    #[error("{call}: {message}")]
    Driver { call: &'static str, message: String },
}

/// Why a read or write of a registered file failed.
#[derive(Debug, thiserror::Error)]
pub enum FileIoError {
    /// A read reached the end of the file before the requested range was complete.
    #[error("fd {fd}: file ends inside {len} bytes at offset {offset} (only {got} there)")]
    ShortFile { fd: i32, offset: u64, len: u64, got: u64 },
    /// The range cannot be addressed by the file API (beyond `i64::MAX`).
    #[error("fd {fd}: offset {offset} + {len} bytes is beyond the largest file offset")]
    BadOffset { fd: i32, offset: u64, len: u64 },
    /// A WRITE into a file opened without write access.
    #[error("fd {fd} is not open for writing")]
    NotWritable { fd: i32 },
    /// A READ from a file opened without read access.
    #[error("fd {fd} is not open for reading")]
    NotReadable { fd: i32 },
    /// The descriptor is not (or no longer) an open file.
    #[error("fd {fd} is not an open file: {source}")]
    BadFd {
        fd: i32,
        #[source]
        source: std::io::Error,
    },
    /// O_DIRECT I/O needs buffer address, length and file offset aligned.
    #[error("fd {fd} is open with O_DIRECT: {what} {value:#x} is not a multiple of {align}")]
    Misaligned { fd: i32, what: &'static str, value: u64, align: u64 },
    /// The kernel refused the read or write.
    #[error("fd {fd}: {op} of {len} bytes at offset {offset}: {source}")]
    Os {
        fd: i32,
        op: &'static str,
        offset: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
}
