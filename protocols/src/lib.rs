//! The engines' wire facts (see `shared/PROTOCOLS.md`) as pure, I/O-free code shared by the
//! engine simulator, the sidecar and the coordinator:
//!
//! - [`hash`]: vLLM's prefix-cache block hashes (`sha256_cbor`), so a router computes the same
//!   keys as the engine;
//! - [`kv_events`]: vLLM's KV-cache event batches (msgpack), every historical form decoded;
//! - [`zmq_frames`]: the PUB message frames, sequence numbers and the replay protocol;
//! - [`kv_params`]: the `kv_transfer_params` that the P/D handoff carries.

#![forbid(unsafe_code)]

pub mod cbor;
pub mod hash;
pub mod kv_events;
pub mod kv_params;
pub mod zmq_frames;
