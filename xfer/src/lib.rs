//! `xfer`: a NIXL-style transfer library for KV-cache traffic.
//!
//! An [`Agent`] registers memory, publishes [metadata](metadata) describing how peers reach it,
//! loads its peers' metadata, and moves bytes with READ/WRITE [requests](XferRequest) through
//! pluggable backends (TCP and POSIX are always available). Notifications reach a peer only after the data
//! they follow is visible there.
//!
//! ```no_run
//! use xfer::{Agent, BackendParams, HostBuffer, Op, RequestOptions};
//! use std::sync::Arc;
//! # fn main() -> Result<(), xfer::XferError> {
//! let agent = Agent::new("decode-0")?;
//! agent.add_backend("tcp", BackendParams::new())?;
//! let buf = Arc::new(HostBuffer::new(1 << 20));
//! let _reg = agent.register_buffer(&buf)?;
//! let peer = agent.fetch_remote_metadata("127.0.0.1:5600")?;
//! let remote = agent.remote_regions(&peer)?;
//! let req = agent.create_request(Op::Read, &[buf.desc()], &peer, &[remote[0].1], RequestOptions::notify(b"done"))?;
//! req.post()?;
//! req.wait(std::time::Duration::from_secs(5))?;
//! # Ok(()) }
//! ```

#![forbid(unsafe_op_in_unsafe_fn)]

mod agent;
mod error;
pub mod grant;
mod grant_index;
pub mod grant_offer;
pub mod metadata;
mod notifs;
mod prepared;
mod registry;
mod request;
pub mod side_channel;
mod tables;

pub use agent::{Agent, Allocation, Registration};
pub use error::{Side, XferError};
pub use grant::Grant;
pub use grant_offer::GrantOffer;
pub use prepared::{PreparedLocal, PreparedRemote};
pub use registry::BackendRegistry;
pub use request::{RequestOptions, Telemetry, XferRequest};
pub use xfer_core::credential;
pub use xfer_core::staging;
pub use xfer_core::{
    Backend, BackendBuffer, BackendContext, BackendError, BackendFactory, BackendParams, Capabilities, Desc,
    DeviceError, FileIoError, HostBuffer, HostMemory, HostRegion, LocalMem, MemType, Op, RefusalCode, SharedFile,
    Staging, UnknownMemType,
};
/// CUDA: the driver found at run time, device buffers, the staging lanes backends get.
pub use xfer_cuda as cuda;
