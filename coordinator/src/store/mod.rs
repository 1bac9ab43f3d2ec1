//! Where membership and leases live beyond this process. In memory (the default) there is
//! nothing here: the [`crate::cluster::Cluster`] is the store. With `--store etcd://…` every
//! registration is an etcd key under a lease, so several coordinators share the cluster.
//!
//! A store only reports what changed, as [`StoreEvent`]s; the daemon applies them
//! (`daemon/store.rs`).

pub mod etcd;

use serde::{Deserialize, Serialize};

use crate::api::EngineSpecJson;

/// The value of an engine's key: its declaration and the store's lease on it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stored {
    pub spec: EngineSpecJson,
    pub lease: i64,
}

/// A change the store saw.
#[derive(Debug)]
pub enum StoreEvent {
    /// (Re)connected: every engine the store holds now.
    Synced(Vec<Stored>),
    /// An engine was registered or renewed (through any coordinator).
    Put(Stored),
    /// An engine's key went (lease expiry, graceful leave, a failed health check elsewhere).
    Deleted(String),
    /// The watch broke; a `Synced` follows once it is back.
    Interrupted(etcd::StoreError),
}
