//! Membership in etcd: each engine is the key `{prefix}engines/{id}` holding its declaration,
//! attached to an etcd lease of the engine's lease length. A heartbeat through any coordinator
//! keeps the lease alive and rewrites the key, so every coordinator watching the prefix renews
//! its local lease; a key that goes (lease expiry, graceful leave, a coordinator seeing the
//! engine fail its health checks) is an engine that left, everywhere. Each coordinator still
//! ingests KV events and polls health itself.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, EventType, GetOptions, PutOptions, WatchOptions};
use tokio::sync::mpsc;

use super::{Call, Store, StoreError, StoreEvent, Stored, Watch};
use crate::api::EngineSpecJson;
use crate::membership::EngineSpec;

/// Bound on one etcd call.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Wait before re-establishing a failed watch.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    ttl_secs: i64,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("prefix", &self.prefix).field("ttl_secs", &self.ttl_secs).finish()
    }
}

async fn bounded<T>(call: impl std::future::Future<Output = Result<T, etcd_client::Error>>) -> Result<T, StoreError> {
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(result) => Ok(result?),
        Err(_) => Err(StoreError::Timeout),
    }
}

impl EtcdStore {
    /// Connects lazily: an etcd that is down now is retried by every call.
    pub async fn connect(endpoints: &[String], prefix: &str, lease: Duration) -> Result<EtcdStore, StoreError> {
        let options = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), CALL_TIMEOUT);
        let client = Client::connect(endpoints, Some(options)).await?;
        let prefix = if prefix.ends_with('/') { prefix.to_string() } else { format!("{prefix}/") };
        // etcd leases have whole seconds.
        let ttl_secs = lease.as_millis().div_ceil(1000).max(1) as i64;
        Ok(EtcdStore { client, prefix, ttl_secs })
    }

    fn engines_prefix(&self) -> String {
        format!("{}engines/", self.prefix)
    }

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.engines_prefix())
    }

    async fn put(&self, spec: &EngineSpec, lease: i64) -> Result<(), StoreError> {
        let value = serde_json::to_vec(&Stored { spec: EngineSpecJson::from(spec), lease }).expect("serializable");
        let mut client = self.client.clone();
        bounded(client.put(self.key(&spec.id), value, Some(PutOptions::new().with_lease(lease)))).await?;
        Ok(())
    }

    async fn register_spec(&self, spec: &EngineSpec) -> Result<i64, StoreError> {
        let mut client = self.client.clone();
        let lease = bounded(client.lease_grant(self.ttl_secs, None)).await?.id();
        self.put(spec, lease).await?;
        Ok(lease)
    }

    async fn keep_alive(&self, spec: &EngineSpec, lease: i64) -> Result<bool, StoreError> {
        let mut client = self.client.clone();
        let ttl = bounded(async {
            let (mut keeper, mut stream) = client.lease_keep_alive(lease).await?;
            keeper.keep_alive().await?;
            Ok(stream.message().await?.map_or(0, |r| r.ttl()))
        })
        .await?;
        if ttl <= 0 {
            return Ok(false);
        }
        self.put(spec, lease).await?;
        Ok(true)
    }

    async fn delete(&self, id: &str, lease: Option<i64>) -> Result<(), StoreError> {
        let mut client = self.client.clone();
        bounded(client.delete(self.key(id), None)).await?;
        if let Some(lease) = lease {
            // Already expired is fine.
            let _ = bounded(client.lease_revoke(lease)).await;
        }
        Ok(())
    }

    async fn watch_forever(self, events: mpsc::Sender<StoreEvent>) {
        loop {
            let err = match self.watch_once(&events).await {
                Ok(()) => return, // the daemon stopped listening
                Err(err) => err,
            };
            if events.send(StoreEvent::Interrupted(err)).await.is_err() {
                return;
            }
            tokio::time::sleep(RETRY).await;
        }
    }

    /// `Ok` once the receiver is gone; otherwise the error that ended the watch.
    async fn watch_once(&self, events: &mpsc::Sender<StoreEvent>) -> Result<(), StoreError> {
        let mut client = self.client.clone();
        let prefix = self.engines_prefix();
        let snapshot = bounded(client.get(prefix.clone(), Some(GetOptions::new().with_prefix()))).await?;
        let revision = snapshot.header().map_or(0, |h| h.revision());
        let present: Vec<Stored> = snapshot.kvs().iter().filter_map(|kv| parse(kv.value())).collect();
        if events.send(StoreEvent::Synced(present)).await.is_err() {
            return Ok(());
        }
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut stream = bounded(client.watch(prefix.clone(), Some(options))).await?;
        while let Some(response) = stream.message().await? {
            if response.canceled() {
                return Err(StoreError::WatchEnded(response.cancel_reason().to_string()));
            }
            for event in response.events() {
                let Some(kv) = event.kv() else { continue };
                let change = match event.event_type() {
                    EventType::Put => parse(kv.value()).map(|stored| StoreEvent::Put(Box::new(stored))),
                    EventType::Delete => {
                        let key = String::from_utf8_lossy(kv.key());
                        key.strip_prefix(&prefix).map(|id| StoreEvent::Deleted(id.to_string()))
                    }
                };
                if let Some(change) = change {
                    if events.send(change).await.is_err() {
                        return Ok(());
                    }
                }
            }
        }
        Err(StoreError::WatchEnded("stream closed".into()))
    }
}

impl Store for EtcdStore {
    fn register<'a>(&'a self, spec: &'a EngineSpec) -> Call<'a, i64> {
        Box::pin(self.register_spec(spec))
    }

    fn heartbeat<'a>(&'a self, spec: &'a EngineSpec, lease: i64) -> Call<'a, bool> {
        Box::pin(self.keep_alive(spec, lease))
    }

    fn deregister<'a>(&'a self, id: &'a str, lease: Option<i64>) -> Call<'a, ()> {
        Box::pin(self.delete(id, lease))
    }

    fn watch(&self, events: mpsc::Sender<StoreEvent>) -> Watch {
        Box::pin(self.clone().watch_forever(events))
    }
}

fn parse(value: &[u8]) -> Option<Stored> {
    match serde_json::from_slice::<Stored>(value) {
        Ok(stored) if stored.spec.validate().is_ok() => Some(stored),
        Ok(_) | Err(_) => {
            tracing::warn!("etcd: ignoring an engine key that does not hold a valid declaration");
            None
        }
    }
}
