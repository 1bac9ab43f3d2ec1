//! Plugin-facing core of `xfer`.
//!
//! Everything a transfer backend needs to implement and nothing more: memory types and
//! descriptors, registered regions and the pins that keep them alive during a transfer, the
//! [`Backend`] and [`RemoteAgent`] traits, transfer jobs and their completion. The user-facing
//! `Agent` lives in the `xfer` crate, which re-exports these types.

mod backend;
mod completion;
pub mod credential;
mod error;
pub mod file_io;
mod host;
mod mem;
pub mod own;
mod shared_file;
pub mod split;
pub mod staging;

pub use backend::{
    Backend, BackendContext, BackendFactory, BackendParams, Capabilities, NotifSink, Op, RemoteAgent, RemoteKey,
    RemoteSeg, TransferJob,
};
pub use completion::{Completer, Completion, Progress, Status};
pub use error::{BackendError, DeviceError, FileIoError, RefusalCode};
pub use host::{BackendBuffer, HostBuffer, HostMemory, HostRegion};
pub use mem::{Desc, DeviceSlice, FileSlice, LocalMem, LocalRegion, MemSlice, MemType, Pin, UnknownMemType};
pub use shared_file::SharedFile;
pub use staging::{CopyLane, HostStaging, Staging};
