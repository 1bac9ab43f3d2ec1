//! The coordinator's sans-I/O core: membership and leases, the KV-block prefix index fed by
//! engines' events, the pairing cost model, P→D handoff bookkeeping, and what deaths leave behind
//! (`cleanup`: releases, notices). Time is passed in (`now`), so every rule is testable without sockets.
//!
//! The daemon around it (`daemon`: static membership, health polling, event ingestion,
//! carrying out the core's actions; `api`: HTTP/JSON and gRPC; `store`: the `Store` trait and etcd)
//! is built on these pieces.

// Two uses, both hints about memory in `index::pages` (the huge-page advice, a call to the
// kernel; the cache-line prefetch, a CPU instruction), are allowed where they are made.
#![deny(unsafe_code)]

pub mod api;
pub mod cleanup;
pub mod cluster;
pub mod config;
pub mod daemon;
pub mod handoff;
pub mod index;
pub mod ingest;
pub mod membership;
pub mod metrics;
pub mod pairing;
pub mod placement;
pub mod prompt;
pub mod ranks;
pub mod rekey;
pub mod store;
pub mod topic;
