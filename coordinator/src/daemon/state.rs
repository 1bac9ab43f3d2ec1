//! The daemon's state around the sans-I/O [`Cluster`]: how each engine is known (cluster
//! file, registration, etcd), its health-check record and event ingestion, and the carrying out
//! of the [`Action`]s the cluster returns. The API operations are in `ops`.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::load::RequestSizes;
pub use crate::api::Origin;
use crate::api::{Endpoint, LoadJson, ReleaseNotice};
use crate::cluster::{Action, Cluster};
use crate::config::Config;
use crate::membership::{EngineSpec, Registered};
use crate::metrics::{DeathCause, Metrics};
use crate::prompt::PromptHasher;
use crate::store::Store;

/// An engine's KV-event ingester thread.
#[derive(Debug)]
pub(crate) struct IngestHandle {
    pub stop: Arc<AtomicBool>,
}

#[derive(Debug)]
pub(crate) struct Meta {
    pub origin: Origin,
    /// The cluster file's declaration (a static engine without a sidecar is revived from it
    /// when its /health answers again).
    pub static_spec: Option<EngineSpec>,
    /// Left gracefully: not revived by health checks until it registers again.
    pub left: bool,
    /// etcd lease holding the engine's key.
    pub lease_id: Option<i64>,
    pub health_failures: u32,
    pub load: Option<LoadJson>,
    pub ingest: Option<IngestHandle>,
}

pub(crate) struct Inner {
    pub cluster: Cluster,
    /// Parallel to the membership's engine numbers.
    pub meta: Vec<Meta>,
    pub(super) last_upkeep: Instant,
    /// Turns reported request counts into block estimates.
    pub(super) request_sizes: RequestSizes,
}

/// Everything the tasks and API edges share.
pub struct Coordinator {
    pub config: Config,
    pub(crate) inner: Mutex<Inner>,
    pub metrics: Metrics,
    pub(crate) hasher: PromptHasher,
    pub(crate) store: Option<Arc<dyn Store>>,
    pub(crate) http: reqwest::Client,
    pub(crate) zmq: zmq::Context,
    pub(crate) ingest_counters: Arc<crate::ingest::Counters>,
    /// Stops collector mode's threads (`--kv-events-listen`).
    pub(crate) collector_stop: Arc<std::sync::atomic::AtomicBool>,
    /// Collector mode's sockets bound so far: ranks 0 up to this (one per data-parallel rank
    /// an engine declared; see `events::listen_ranks`).
    pub(crate) collector_ranks: Mutex<u32>,
    pub(crate) runtime: tokio::runtime::Handle,
    /// The runtime's worker threads.
    pub(crate) workers: usize,
    /// KiB of prompt text being hashed off the runtime (`ops::LONG_HASHING_KIB` in all).
    pub(crate) long_hashing: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator").field("listen", &self.config.listen).finish_non_exhaustive()
    }
}

pub(super) fn engines(cluster: &Cluster) -> impl Iterator<Item = (usize, &crate::membership::Engine)> {
    cluster.membership.iter()
}

pub(super) fn endpoint(spec: &EngineSpec) -> Endpoint {
    Endpoint {
        id: spec.id.clone(),
        engine_url: spec.engine_url.clone(),
        sidecar_url: spec.sidecar_url.clone(),
        node: spec.node.clone(),
    }
}

/// Why the client for sidecars and engines could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("--tls-ca: {0}")]
    Tls(#[from] pd_http::tls::TlsError),
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

impl Coordinator {
    pub fn new(
        config: Config,
        hasher: PromptHasher,
        store: Option<Arc<dyn Store>>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Coordinator, ClientError> {
        // Health checks and release calls reach https sidecars and engines through --tls-ca.
        let tls = pd_http::tls::client_config(config.tls_ca.as_deref())?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(config.health_timeout_ms))
            .use_preconfigured_tls(tls)
            .build()?;
        let cluster = Cluster::new(config.settings());
        let workers =
            config.workers.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from)).max(1);
        Ok(Coordinator {
            workers,
            long_hashing: Arc::new(tokio::sync::Semaphore::new(super::ops::LONG_HASHING_KIB)),
            inner: Mutex::new(Inner {
                cluster,
                meta: Vec::new(),
                last_upkeep: Instant::now(),
                request_sizes: RequestSizes::default(),
            }),
            config,
            metrics: Metrics::default(),
            hasher,
            store,
            http,
            zmq: zmq::Context::new(),
            ingest_counters: Arc::default(),
            collector_stop: Arc::default(),
            collector_ranks: Mutex::new(0),
            runtime,
        })
    }

    /// Registers (or renews) an engine in the local state; starts or restarts its event
    /// ingestion when it is new, changed or back from the dead.
    pub(crate) fn apply_register(
        self: &Arc<Self>,
        inner: &mut Inner,
        spec: EngineSpec,
        origin: Origin,
        lease_id: Option<i64>,
        now: Instant,
    ) -> usize {
        let static_spec = (origin == Origin::Static).then(|| spec.clone());
        let (engine, fresh) = match inner.cluster.register(spec, now) {
            Registered::New(engine) => {
                let meta = Meta {
                    origin,
                    static_spec: None,
                    left: false,
                    lease_id: None,
                    health_failures: 0,
                    load: None,
                    ingest: None,
                };
                // A forgotten engine's number is reused: its record is replaced.
                match inner.meta.get_mut(engine) {
                    Some(old) => *old = meta,
                    None => inner.meta.push(meta),
                }
                (engine, true)
            }
            Registered::Renewed { engine, changed, was_dead } => (engine, changed || was_dead),
        };
        let meta = &mut inner.meta[engine];
        if static_spec.is_some() {
            meta.static_spec = static_spec;
            meta.origin = Origin::Static;
        }
        if lease_id.is_some() {
            meta.lease_id = lease_id;
        }
        meta.left = false;
        if fresh {
            meta.health_failures = 0;
            meta.load = None;
            self.restart_ingest(inner, engine);
        }
        engine
    }

    /// An engine left pairing (`cause`): the cluster drops it; returns what to carry out.
    pub(crate) fn on_died(&self, inner: &mut Inner, engine: usize, cause: DeathCause, now: Instant) -> Vec<Action> {
        let actions = inner.cluster.engine_died(engine, now);
        self.after_death(inner, engine, cause);
        actions
    }

    /// The daemon's side of a death: ingestion stops, the health and load records go.
    fn after_death(&self, inner: &mut Inner, engine: usize, cause: DeathCause) {
        let Some(id) = inner.cluster.membership.get(engine).map(|e| e.spec.id.clone()) else { return };
        if let Some(meta) = inner.meta.get_mut(engine) {
            if let Some(ingest) = meta.ingest.take() {
                ingest.stop.store(true, std::sync::atomic::Ordering::Release);
            }
            meta.health_failures = 0;
            meta.load = None;
        }
        self.metrics.death(cause);
        tracing::warn!(engine = %id, cause = cause.as_str(), "engine left pairing");
    }

    /// A release whose POST failed (or that has no sidecar to call) waits for the prefill's
    /// heartbeat.
    pub(crate) fn queue_release(&self, notice: ReleaseNotice) {
        self.inner.lock().cluster.release_failed(notice, Instant::now());
    }

    /// Lease expiry every tick; handoff, index and notice upkeep about once a second.
    pub(crate) fn tick(self: &Arc<Self>, now: Instant) {
        let actions = {
            let mut inner = self.inner.lock();
            let inner = &mut *inner;
            let upkeep = now.duration_since(inner.last_upkeep) >= Duration::from_secs(1);
            let actions = if upkeep {
                inner.last_upkeep = now;
                inner.cluster.tick(now)
            } else {
                inner.cluster.expire(now)
            };
            for action in &actions {
                if let Action::Died { engine } = action {
                    self.after_death(inner, *engine, DeathCause::Lease);
                }
            }
            if upkeep {
                self.forget_dead(inner, now);
            }
            actions
        };
        self.carry_out(actions);
    }

    /// Removes registered engines dead longer than `--forget-dead-after-secs` (0: never):
    /// their ids become unknown (a sidecar must register as new), their numbers, index
    /// bitset positions and load slots go to the next new engine. Static engines stay: the
    /// cluster file declares them and health checks revive them.
    fn forget_dead(&self, inner: &mut Inner, now: Instant) {
        if self.config.forget_dead_after_secs <= 0.0 {
            return;
        }
        let after = Duration::from_secs_f64(self.config.forget_dead_after_secs);
        for engine in inner.cluster.membership.dead_for(after, now) {
            if inner.meta.get(engine).is_none_or(|m| m.origin == Origin::Static) {
                continue;
            }
            let Some(gone) = inner.cluster.forget(engine) else { continue };
            if let Some(ingest) = inner.meta[engine].ingest.take() {
                ingest.stop.store(true, std::sync::atomic::Ordering::Release);
            }
            inner.meta[engine].lease_id = None;
            inner.meta[engine].load = None;
            crate::metrics::inc(&self.metrics.forgotten);
            tracing::info!(engine = %gone.spec.id, "dead engine forgotten");
        }
    }

    /// Carries out the cluster's actions (outside the lock): releases run as tasks.
    pub(crate) fn carry_out(self: &Arc<Self>, actions: Vec<Action>) {
        for action in actions {
            match action {
                // Handled under the lock, where the death was seen.
                Action::Died { .. } => {}
                Action::Release { notice, sidecar_url } => {
                    let this = Arc::clone(self);
                    self.runtime.spawn(async move { this.release(notice, sidecar_url).await });
                }
                Action::PrefillDied { request, dead } => {
                    tracing::debug!(request, dead, "prefill died under a request");
                }
            }
        }
    }
}
