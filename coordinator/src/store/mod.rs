//! Where membership and leases live beyond this process. In memory (the default) there is
//! nothing here: the [`crate::cluster::Cluster`] is the store. With `--store etcd://…` every
//! registration is an etcd key under a lease, so several coordinators share the cluster.
//!
//! A [`Store`] writes what this coordinator decides and reports what changed, as
//! [`StoreEvent`]s; it never touches the daemon's state. The daemon applies the events
//! (`daemon/store.rs`).

pub mod etcd;
#[cfg(test)]
pub mod memory;

use std::future::Future;
use std::pin::Pin;

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::api::EngineSpecJson;
use crate::membership::EngineSpec;

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
    /// An engine was registered or renewed (through any coordinator). Boxed: a declaration is
    /// far larger than the other variants.
    Put(Box<Stored>),
    /// An engine's key went (lease expiry, graceful leave, a failed health check elsewhere).
    Deleted(String),
    /// The watch broke; a `Synced` follows once it is back.
    Interrupted(StoreError),
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd call timed out")]
    Timeout,
    #[error("etcd watch ended: {0}")]
    WatchEnded(String),
}

/// A store call in flight (boxed: the daemon holds the store as `dyn Store`).
pub type Call<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;
/// A store's watch, run as its own task.
pub type Watch = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Shared membership: what the daemon writes through and watches.
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Stores a registration under a fresh lease; returns the lease.
    fn register<'a>(&'a self, spec: &'a EngineSpec) -> Call<'a, i64>;
    /// Keeps the lease alive and rewrites the key (so other coordinators see the beat).
    /// `Ok(false)` when the lease is gone: the engine must register again.
    fn heartbeat<'a>(&'a self, spec: &'a EngineSpec, lease: i64) -> Call<'a, bool>;
    /// Removes an engine's key (and its lease).
    fn deregister<'a>(&'a self, id: &'a str, lease: Option<i64>) -> Call<'a, ()>;
    /// Tells `events` what changes, for as long as the receiver listens: a snapshot after
    /// every (re)connection, then each put and delete.
    fn watch(&self, events: mpsc::Sender<StoreEvent>) -> Watch;
}
