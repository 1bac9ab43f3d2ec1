//! Applies what the store reports ([`StoreEvent`]) to the daemon's state: registrations and
//! renewals through other coordinators, engines whose key went, resynchronisation.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;

use super::state::{Coordinator, Origin};
use crate::membership::EngineSpec;
use crate::metrics::{inc, DeathCause};
use crate::store::{StoreEvent, Stored};

/// Events buffered between the store's watch and the daemon.
pub(super) const EVENTS: usize = 1024;

impl Coordinator {
    /// Applies the store's events until the store stops sending.
    pub(super) async fn apply_store_events(self: Arc<Self>, mut events: mpsc::Receiver<StoreEvent>) {
        while let Some(event) = events.recv().await {
            match event {
                StoreEvent::Synced(present) => self.store_sync(present),
                StoreEvent::Put(stored) => self.store_put(stored),
                StoreEvent::Deleted(id) => self.store_delete(&id),
                StoreEvent::Interrupted(err) => {
                    inc(&self.metrics.store_errors);
                    tracing::warn!(%err, "etcd watch interrupted; resynchronising");
                }
            }
        }
    }

    fn store_put(self: &Arc<Self>, stored: Stored) {
        let mut inner = self.inner.lock();
        self.apply_register(
            &mut inner,
            EngineSpec::from(&stored.spec),
            Origin::Registered,
            Some(stored.lease),
            Instant::now(),
        );
    }

    fn store_delete(self: &Arc<Self>, id: &str) {
        let jobs = {
            let mut inner = self.inner.lock();
            let Some(engine) = inner.cluster.membership.id_of(id) else { return };
            let alive = inner.cluster.membership.get(engine).is_some_and(|e| e.is_alive());
            if !alive || inner.meta[engine].origin == Origin::Static {
                return;
            }
            inner.meta[engine].lease_id = None;
            self.on_died(&mut inner, engine, DeathCause::Store, Instant::now())
        };
        self.spawn_releases(jobs);
    }

    /// After (re)connecting: every key present is registered; engines known through etcd
    /// whose key is gone have left.
    fn store_sync(self: &Arc<Self>, present: Vec<Stored>) {
        let ids: HashSet<String> = present.iter().map(|s| s.spec.id.clone()).collect();
        let gone: Vec<String> = {
            let inner = self.inner.lock();
            inner
                .cluster
                .membership
                .iter()
                .filter(|(i, e)| {
                    let meta = &inner.meta[*i];
                    e.is_alive()
                        && meta.origin == Origin::Registered
                        && meta.lease_id.is_some()
                        && !ids.contains(&e.spec.id)
                })
                .map(|(_, e)| e.spec.id.clone())
                .collect()
        };
        for stored in present {
            self.store_put(stored);
        }
        for id in gone {
            self.store_delete(&id);
        }
    }
}
