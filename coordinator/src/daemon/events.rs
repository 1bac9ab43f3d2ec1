//! One KV-event ingester thread per engine that publishes events: batches go into the index
//! while the engine is alive and the same incarnation; a reset drops its entries.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::ingest::{self, Source, Update};
use crate::metrics::inc;

use super::state::{Coordinator, IngestHandle, Inner};

/// Wait before reconnecting after a socket error.
const RETRY: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Stops the engine's ingester, if any, and starts a new one when it publishes events.
    pub(crate) fn restart_ingest(self: &Arc<Self>, inner: &mut Inner, engine: usize) {
        if let Some(old) = inner.meta[engine].ingest.take() {
            old.stop.store(true, Ordering::Release);
        }
        let Some(entry) = inner.cluster.membership.get(engine) else { return };
        let Some(endpoint) = entry.spec.kv_events.clone() else { return };
        let source = Source { endpoint, replay: entry.spec.replay.clone(), topic: self.config.kv_events_topic.clone() };
        let incarnation = entry.incarnation;
        let id = entry.spec.id.clone();
        let stop = Arc::new(AtomicBool::new(false));
        inner.meta[engine].ingest = Some(IngestHandle { stop: Arc::clone(&stop) });
        let this = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name(format!("kv-events-{engine}"))
            .spawn(move || this.ingest_loop(engine, incarnation, &id, &source, &stop));
        if let Err(err) = spawned {
            tracing::error!(%err, "cannot start a KV-event ingester thread");
        }
    }

    fn ingest_loop(&self, engine: usize, incarnation: u64, id: &str, source: &Source, stop: &Arc<AtomicBool>) {
        tracing::info!(engine = id, endpoint = %source.endpoint, replay = ?source.replay, "ingesting KV events");
        while !stop.load(Ordering::Acquire) {
            let result = ingest::run_counted(&self.zmq, source, stop, &self.ingest_counters, |update| {
                self.deliver(engine, incarnation, update);
            });
            match result {
                Ok(()) => break,
                Err(err) => {
                    tracing::warn!(engine = id, %err, "KV-event subscription failed; retrying");
                    std::thread::sleep(RETRY);
                }
            }
        }
        tracing::debug!(engine = id, "KV-event ingester stopped");
    }

    fn deliver(&self, engine: usize, incarnation: u64, update: Update) {
        if let Update::Malformed(reason) = &update {
            inc(&self.metrics.events_malformed);
            tracing::debug!(engine, %reason, "malformed KV-event message");
            return;
        }
        let mut inner = self.inner.lock();
        let current =
            inner.cluster.membership.get(engine).is_some_and(|e| e.is_alive() && e.incarnation == incarnation);
        if !current {
            return;
        }
        match update {
            Update::Batch(batch) => {
                inc(&self.metrics.event_batches);
                self.metrics.events.fetch_add(batch.events.len() as u64, Ordering::Relaxed);
                let blocks: usize = batch
                    .events
                    .iter()
                    .map(|event| match event {
                        pd_protocols::kv_events::KvEvent::BlockStored { block_hashes, .. }
                        | pd_protocols::kv_events::KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.len(),
                        _ => 0,
                    })
                    .sum();
                self.metrics.block_events.fetch_add(blocks as u64, Ordering::Relaxed);
                inner.cluster.apply_events(engine, &batch);
            }
            Update::Reset => inner.cluster.reset_index(engine),
            Update::Malformed(_) => {}
        }
    }

    /// Stops every ingester (shutdown).
    pub(crate) fn stop_ingest(&self) {
        let mut inner = self.inner.lock();
        for meta in &mut inner.meta {
            if let Some(ingest) = meta.ingest.take() {
                ingest.stop.store(true, Ordering::Release);
            }
        }
    }
}
