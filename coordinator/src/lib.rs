//! The coordinator's sans-I/O core: the KV-block prefix index fed by engines' events and the
//! pairing cost model. Time is passed in (`now`), so every rule is testable without sockets.
//!
//! The daemon around it (membership, event ingestion, APIs) is built on these pieces.

#![forbid(unsafe_code)]

pub mod index;
pub mod pairing;
