//! One KV-event ingester thread per engine that publishes events on its own endpoint (per rank
//! for an engine running data parallel: rank r publishes on the endpoints offset by r), and in
//! collector mode one more per bound socket that engines connect to (rank r's publisher dials
//! the listen endpoint offset by r, so there is one socket per rank any engine declared):
//! batches go into the index while the engine is alive and the same incarnation; a reset drops
//! the entries of the stream's rank.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pd_protocols::zmq_frames::{rank_endpoint, RankEndpointError};

use crate::config::ConfigError;
use crate::ingest::{self, IngestError, Route, Source, Update};
use crate::metrics::inc;
use crate::topic::{self, FirstSight, TopicPattern, UnknownTopics};

use super::state::{Coordinator, IngestHandle, Inner};

/// Wait before reconnecting after a socket error.
const RETRY: Duration = Duration::from_secs(1);

/// Why collector mode could not listen for a data-parallel rank.
#[derive(Debug, thiserror::Error)]
pub enum CollectorError {
    #[error("--kv-events-listen for data-parallel rank {rank}: {source}")]
    Endpoint { rank: u32, source: RankEndpointError },
    #[error("--kv-events-listen {endpoint}: {source}")]
    Bind { endpoint: String, source: IngestError },
    #[error(transparent)]
    Pattern(#[from] ConfigError),
    #[error("cannot start a KV-event collector thread: {0}")]
    Thread(#[from] std::io::Error),
}

impl Coordinator {
    /// Stops the engine's ingesters, if any, and starts new ones when it publishes events: one
    /// per data-parallel rank.
    pub(crate) fn restart_ingest(self: &Arc<Self>, inner: &mut Inner, engine: usize) {
        if let Some(old) = inner.meta[engine].ingest.take() {
            old.stop.store(true, Ordering::Release);
        }
        let Some(entry) = inner.cluster.membership.get(engine) else { return };
        let Some(endpoint) = entry.spec.kv_events.clone() else {
            // Collected: its ranks past the first dial sockets that may not be bound yet.
            self.listen_ranks_later(entry.spec.id.clone(), entry.spec.ranks());
            return;
        };
        let topic = entry.spec.kv_events_topic.clone().unwrap_or_else(|| self.config.kv_events_topic.clone());
        let incarnation = entry.incarnation;
        let id = entry.spec.id.clone();
        let (replay, ranks) = (entry.spec.replay.clone(), entry.spec.ranks());
        let stop = Arc::new(AtomicBool::new(false));
        inner.meta[engine].ingest = Some(IngestHandle { stop: Arc::clone(&stop) });
        for rank in 0..ranks {
            let offset = |e: &str| rank_endpoint(e, rank);
            let source = match (offset(&endpoint), replay.as_deref().map(offset).transpose()) {
                (Ok(endpoint), Ok(replay)) => Source { endpoint, replay, topic: topic.clone() },
                (Err(err), _) | (_, Err(err)) => {
                    tracing::error!(engine = id, rank, %err, "no KV events from this data-parallel rank");
                    continue;
                }
            };
            let (this, id, stop) = (Arc::clone(self), id.clone(), Arc::clone(&stop));
            let spawned = std::thread::Builder::new()
                .name(format!("kv-events-{engine}-{rank}"))
                .spawn(move || this.ingest_loop(engine, rank, incarnation, &id, &source, &stop));
            if let Err(err) = spawned {
                tracing::error!(%err, "cannot start a KV-event ingester thread");
            }
        }
    }

    fn ingest_loop(
        &self,
        engine: usize,
        rank: u32,
        incarnation: u64,
        id: &str,
        source: &Source,
        stop: &Arc<AtomicBool>,
    ) {
        tracing::info!(engine = id, rank, endpoint = %source.endpoint, replay = ?source.replay, "ingesting KV events");
        while !stop.load(Ordering::Acquire) {
            let result = ingest::run_counted(&self.zmq, source, stop, &self.ingest_counters, |update| {
                self.deliver(engine, Some(rank), incarnation, update);
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

    /// `stream`: the data-parallel rank whose stream brought `update` (a batch that names its
    /// rank itself is that rank's whatever its stream; see `ranks::batch_rank`).
    fn deliver(&self, engine: usize, stream: Option<u32>, incarnation: u64, update: Update) {
        if let Update::Malformed(reason) = &update {
            self.malformed(Some(engine), reason);
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
                self.metrics.block_events.fetch_add(batch.block_count() as u64, Ordering::Relaxed);
                if let Err(err) = inner.cluster.apply_events(engine, stream.unwrap_or(0), &batch) {
                    drop(inner);
                    self.malformed(Some(engine), &err.to_string());
                }
            }
            Update::Reset => match stream {
                Some(rank) => inner.cluster.reset_rank(engine, rank),
                None => inner.cluster.reset_index(engine),
            },
            Update::Malformed(_) => {}
        }
    }

    /// [`Coordinator::listen_ranks`] on a thread of its own when `ranks` are more than are bound:
    /// the caller holds the state lock, and binding up to 1,024 sockets (and starting a thread
    /// each) should not hold up pairings. vLLM's publishers dial again until the socket is there.
    fn listen_ranks_later(self: &Arc<Self>, engine: String, ranks: u32) {
        // A binder already at work holds the count: this thread then waits its turn, not the
        // caller.
        let bound = self.collector_ranks.try_lock().map(|bound| *bound);
        if self.config.kv_events_listen.is_none() || bound.is_some_and(|bound| bound >= ranks) {
            return;
        }
        let this = Arc::clone(self);
        let spawned = std::thread::Builder::new().name("kv-events-listen".into()).spawn(move || {
            if let Err(err) = this.listen_ranks(ranks) {
                tracing::error!(engine, %err, "KV events of some data-parallel ranks will be lost");
            }
        });
        if let Err(err) = spawned {
            tracing::error!(%err, "cannot start a thread to listen for data-parallel ranks");
        }
    }

    /// Collector mode: binds a socket for every data-parallel rank below `ranks` not bound yet,
    /// rank r's on the --kv-events-listen endpoint offset by r (where vLLM's rank r dials), and
    /// follows each on a thread of its own. Stops at the first rank it cannot listen for (the
    /// next registration tries again).
    pub(crate) fn listen_ranks(self: &Arc<Self>, ranks: u32) -> Result<(), CollectorError> {
        let Some(listen) = self.config.kv_events_listen.as_deref() else { return Ok(()) };
        let mut bound = self.collector_ranks.lock();
        if *bound >= ranks {
            return Ok(());
        }
        let pattern = self.config.topic_pattern()?;
        while *bound < ranks {
            let rank = *bound;
            let endpoint = rank_endpoint(listen, rank).map_err(|source| CollectorError::Endpoint { rank, source })?;
            let sub = ingest::bind_collector(&self.zmq, &endpoint)
                .map_err(|source| CollectorError::Bind { endpoint: endpoint.clone(), source })?;
            self.start_collector(sub, pattern.clone(), rank)?;
            if rank > 0 {
                tracing::info!(%endpoint, rank, "collecting a data-parallel rank's KV events");
            }
            *bound += 1;
        }
        Ok(())
    }

    /// Collector mode: follows every engine that publishes into `sub` (bound for data-parallel
    /// rank `rank`) on a thread of its own.
    fn start_collector(self: &Arc<Self>, sub: zmq::Socket, pattern: TopicPattern, rank: u32) -> std::io::Result<()> {
        let this = Arc::clone(self);
        std::thread::Builder::new().name(format!("kv-events-collector-{rank}")).spawn(move || {
            let mut unknown = UnknownTopics::default();
            let stop = &this.collector_stop;
            while !stop.load(Ordering::Acquire) {
                let result = ingest::collect(
                    &this.zmq,
                    &sub,
                    stop,
                    &this.ingest_counters,
                    |topic| this.route(topic, rank, &pattern, &mut unknown),
                    |route, update| match (route, update) {
                        (Some(route), update) => this.deliver(route.engine, Some(rank), route.epoch.0, update),
                        (None, Update::Malformed(reason)) => this.malformed(None, &reason),
                        (None, _) => {}
                    },
                );
                if let Err(err) = result {
                    tracing::warn!(%err, "KV-event collector socket failed; retrying");
                    std::thread::sleep(RETRY);
                }
            }
        })?;
        Ok(())
    }

    /// The engine a collected message's topic names (counted and logged once when none), with
    /// rank `rank`'s replay endpoint.
    fn route(&self, topic: &[u8], rank: u32, pattern: &TopicPattern, unknown: &mut UnknownTopics) -> Option<Route> {
        let found = {
            let inner = self.inner.lock();
            // Engines with an endpoint of their own are followed there, not here.
            let collected = inner.cluster.membership.iter().filter(|(_, e)| e.spec.kv_events.is_none());
            topic::resolve(topic, pattern, collected.map(|(i, e)| (i, &e.spec))).and_then(|engine| {
                let e = inner.cluster.membership.get(engine)?;
                // A replay endpoint vLLM does not offset (ipc) serves rank 0 only.
                let replay = e.spec.replay.as_deref().and_then(|replay| rank_endpoint(replay, rank).ok());
                Some(Route { engine, epoch: (e.incarnation, e.generation), replay })
            })
        };
        if found.is_none() {
            inc(&self.metrics.events_unknown_topic);
            match unknown.sight(topic) {
                FirstSight::New => tracing::warn!(
                    topic = %topic::printable(topic),
                    "KV events under a topic that names no registered engine: dropped (logged once per topic)"
                ),
                FirstSight::Full => tracing::warn!(
                    limit = UnknownTopics::CAPACITY,
                    "too many unknown KV-event topics; further ones are only counted"
                ),
                FirstSight::Known => {}
            }
        }
        found
    }

    fn malformed(&self, engine: Option<usize>, reason: &str) {
        inc(&self.metrics.events_malformed);
        tracing::debug!(?engine, %reason, "malformed KV-event message");
    }

    /// Stops every ingester (shutdown).
    pub(crate) fn stop_ingest(&self) {
        self.collector_stop.store(true, Ordering::Release);
        let mut inner = self.inner.lock();
        for meta in &mut inner.meta {
            if let Some(ingest) = meta.ingest.take() {
                ingest.stop.store(true, Ordering::Release);
            }
        }
    }
}
