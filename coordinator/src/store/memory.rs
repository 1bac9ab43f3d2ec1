//! A [`Store`] in this process, for tests: what etcd would hold and tell, without etcd. A test
//! plays the other coordinators by calling it directly (and [`MemoryStore::expire`] for a lease
//! running out), and sees whether the daemon applies what the watch reports.

use std::collections::HashMap;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::{Call, Store, StoreEvent, Stored, Watch};
use crate::api::EngineSpecJson;
use crate::membership::EngineSpec;

#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    keys: HashMap<String, Stored>,
    last_lease: i64,
    watchers: Vec<mpsc::Sender<StoreEvent>>,
}

impl State {
    /// Tells every watcher; one that stopped listening is dropped.
    fn tell(&mut self, event: impl Fn() -> StoreEvent) {
        self.watchers.retain(|w| w.try_send(event()).is_ok());
    }

    fn put(&mut self, stored: Stored) {
        self.keys.insert(stored.spec.id.clone(), stored.clone());
        self.tell(|| StoreEvent::Put(Box::new(stored.clone())));
    }

    fn remove(&mut self, id: &str) {
        if self.keys.remove(id).is_some() {
            self.tell(|| StoreEvent::Deleted(id.to_string()));
        }
    }
}

impl MemoryStore {
    /// An engine's lease ran out.
    pub fn expire(&self, id: &str) {
        self.state.lock().remove(id);
    }

    /// The lease an engine's key is under, if it has one.
    pub fn lease_of(&self, id: &str) -> Option<i64> {
        self.state.lock().keys.get(id).map(|s| s.lease)
    }
}

impl Store for MemoryStore {
    fn register<'a>(&'a self, spec: &'a EngineSpec) -> Call<'a, i64> {
        let mut state = self.state.lock();
        state.last_lease += 1;
        let lease = state.last_lease;
        state.put(Stored { spec: EngineSpecJson::from(spec), lease });
        Box::pin(std::future::ready(Ok(lease)))
    }

    fn heartbeat<'a>(&'a self, spec: &'a EngineSpec, lease: i64) -> Call<'a, bool> {
        let mut state = self.state.lock();
        let held = state.keys.get(&spec.id).is_some_and(|s| s.lease == lease);
        if held {
            state.put(Stored { spec: EngineSpecJson::from(spec), lease });
        }
        Box::pin(std::future::ready(Ok(held)))
    }

    fn deregister<'a>(&'a self, id: &'a str, _lease: Option<i64>) -> Call<'a, ()> {
        self.state.lock().remove(id);
        Box::pin(std::future::ready(Ok(())))
    }

    fn watch(&self, events: mpsc::Sender<StoreEvent>) -> Watch {
        let mut state = self.state.lock();
        let snapshot = state.keys.values().cloned().collect();
        if events.try_send(StoreEvent::Synced(snapshot)).is_ok() {
            state.watchers.push(events.clone());
        }
        Box::pin(async move { events.closed().await })
    }
}
