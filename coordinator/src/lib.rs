//! The coordinator's sans-I/O core: membership and leases, the KV-block prefix index fed by
//! engines' events, the pairing cost model, and P→D handoff bookkeeping. Time is passed in (`now`), so every rule is testable without sockets.
//!
//! The daemon around it (membership, event ingestion, APIs) is built on these pieces.

#![forbid(unsafe_code)]

pub mod cluster;
pub mod handoff;
pub mod index;
pub mod ingest;
pub mod membership;
pub mod pairing;
