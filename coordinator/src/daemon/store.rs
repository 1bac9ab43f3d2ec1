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
const EVENTS: usize = 1024;

impl Coordinator {
    /// Starts the store's watch and the task applying what it reports (none without a store).
    pub(super) fn follow_store(self: &Arc<Self>) -> Vec<tokio::task::JoinHandle<()>> {
        let Some(store) = &self.store else { return Vec::new() };
        let (tx, rx) = mpsc::channel(EVENTS);
        vec![tokio::spawn(store.watch(tx)), tokio::spawn(Arc::clone(self).apply_store_events(rx))]
    }

    /// Applies the store's events until the store stops sending.
    async fn apply_store_events(self: Arc<Self>, mut events: mpsc::Receiver<StoreEvent>) {
        while let Some(event) = events.recv().await {
            match event {
                StoreEvent::Synced(present) => self.store_sync(present),
                StoreEvent::Put(stored) => self.store_put(*stored),
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
        let actions = {
            let mut inner = self.inner.lock();
            let Some(engine) = inner.cluster.membership.id_of(id) else { return };
            let alive = inner.cluster.membership.get(engine).is_some_and(|e| e.is_alive());
            if !alive || inner.meta[engine].origin == Origin::Static {
                return;
            }
            inner.meta[engine].lease_id = None;
            self.on_died(&mut inner, engine, DeathCause::Store, Instant::now())
        };
        self.carry_out(actions);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::Config;
    use crate::membership::Role;
    use crate::prompt::PromptHasher;
    use crate::store::memory::MemoryStore;
    use crate::store::Store;

    fn spec(id: &str) -> EngineSpec {
        EngineSpec {
            id: id.into(),
            role: Role::Both,
            node: "n".into(),
            model: "m".into(),
            engine_url: format!("http://{id}:8000"),
            sidecar_url: None,
            kv_events: None,
            kv_events_topic: None,
            replay: None,
            xfer_side_channel: None,
            block_size: 16,
            capacity_blocks: None,
            data_parallel_size: None,
        }
    }

    fn coordinator(store: Arc<MemoryStore>) -> Arc<Coordinator> {
        let config = Config::from_args(vec!["pd-coordinator".into()]).expect("defaults");
        let hasher = PromptHasher::new(None, None, false, config.approx_chars_per_token).expect("hasher");
        let store: Arc<dyn Store> = store;
        Arc::new(Coordinator::new(config, hasher, Some(store), tokio::runtime::Handle::current()).expect("client"))
    }

    /// `(id, alive)` of every engine the coordinator knows, in id order.
    fn known(c: &Coordinator) -> Vec<(String, bool)> {
        let mut list: Vec<_> = c.list().into_iter().map(|e| (e.spec.id, e.alive)).collect();
        list.sort();
        list
    }

    /// Waits until the watch has delivered what the store reported.
    async fn settles(c: &Coordinator, want: &[(&str, bool)]) {
        let want: Vec<(String, bool)> = want.iter().map(|&(id, alive)| (id.to_string(), alive)).collect();
        for _ in 0..200 {
            if known(c) == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(known(c), want);
    }

    #[tokio::test]
    async fn the_daemon_applies_what_the_store_reports() {
        let store = Arc::new(MemoryStore::default());
        // Known to the store before this coordinator starts: the first snapshot brings it.
        store.register(&spec("early")).await.unwrap();
        let c = coordinator(Arc::clone(&store));
        let tasks = c.follow_store();
        settles(&c, &[("early", true)]).await;

        // Registered through another coordinator.
        store.register(&spec("other")).await.unwrap();
        settles(&c, &[("early", true), ("other", true)]).await;
        let lease = store.lease_of("other");
        assert!(lease.is_some());
        assert_eq!(c.inner.lock().meta[1].lease_id, lease, "the store's lease is kept");

        // Its lease ran out in the store: it leaves pairing here too.
        store.expire("other");
        settles(&c, &[("early", true), ("other", false)]).await;
        assert!(c.metrics.render(&Default::default()).contains(r#"cause="store"} 1"#));

        // Registered here: written through the store, which is then asked on heartbeats.
        c.register(crate::api::EngineSpecJson::from(&spec("mine"))).await.unwrap();
        assert!(store.lease_of("mine").is_some());
        c.heartbeat("mine", None).await.unwrap();
        store.expire("mine");
        assert!(c.heartbeat("mine", None).await.is_err(), "a lease gone from the store is a death");
        settles(&c, &[("early", true), ("mine", false), ("other", false)]).await;

        // Leaving removes the key.
        c.deregister("early").await.unwrap();
        assert!(store.lease_of("early").is_none());
        settles(&c, &[("early", false), ("mine", false), ("other", false)]).await;
        for task in tasks {
            task.abort();
        }
    }
}
