//! The daemon's state around the sans-I/O [`Cluster`]: how each engine is known (cluster
//! file, registration, etcd), its health-check record, the deaths sidecars are told about, and
//! the held-block parameters needed to release a prefill's blocks. The API operations are in
//! `ops`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_json::value::RawValue;

use super::load::RequestSizes;
pub use crate::api::Origin;
use crate::api::{Endpoint, LoadJson, ReleaseNotice};
use crate::cluster::Cluster;
use crate::config::Config;
use crate::handoff::Action;
use crate::membership::{EngineSpec, Registered};
use crate::metrics::{DeathCause, Metrics};
use crate::prompt::PromptHasher;
use crate::store::etcd::EtcdStore;

/// Deaths and pending releases older than this are forgotten.
const NOTICE_MAX_AGE: Duration = Duration::from_secs(600);

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
    /// Deaths up to this sequence were told to this engine's sidecar.
    pub notice_seq: u64,
    pub ingest: Option<IngestHandle>,
}

#[derive(Debug)]
pub(super) struct Death {
    pub seq: u64,
    pub id: String,
    pub at: Instant,
}

#[derive(Debug)]
pub(super) struct HeldParams {
    pub params: Box<RawValue>,
    pub at: Instant,
}

/// A release to carry out: POST {sidecar_url}/pd/release, else a heartbeat notice.
#[derive(Debug)]
pub(crate) struct ReleaseJob {
    pub notice: ReleaseNotice,
    pub sidecar_url: Option<String>,
}

pub(crate) struct Inner {
    pub cluster: Cluster,
    /// Parallel to the membership's engine numbers.
    pub meta: Vec<Meta>,
    pub(super) deaths: VecDeque<Death>,
    pub(super) death_seq: u64,
    pub(super) params: HashMap<String, HeldParams>,
    pub(super) pending: HashMap<String, Vec<(ReleaseNotice, Instant)>>,
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
    pub(crate) store: Option<EtcdStore>,
    pub(crate) http: reqwest::Client,
    pub(crate) zmq: zmq::Context,
    pub(crate) ingest_counters: Arc<crate::ingest::Counters>,
    pub(crate) runtime: tokio::runtime::Handle,
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

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

impl Coordinator {
    pub fn new(
        config: Config,
        hasher: PromptHasher,
        store: Option<EtcdStore>,
        runtime: tokio::runtime::Handle,
    ) -> Result<Coordinator, reqwest::Error> {
        let http =
            reqwest::Client::builder().connect_timeout(Duration::from_millis(config.health_timeout_ms)).build()?;
        let cluster = Cluster::new(config.settings());
        Ok(Coordinator {
            inner: Mutex::new(Inner {
                cluster,
                meta: Vec::new(),
                deaths: VecDeque::new(),
                death_seq: 0,
                params: HashMap::new(),
                pending: HashMap::new(),
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
                    notice_seq: inner.death_seq,
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
        let death_seq = inner.death_seq;
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
            meta.notice_seq = death_seq;
            meta.load = None;
            self.restart_ingest(inner, engine);
        }
        engine
    }

    /// An engine left pairing: its ingestion stops, its index entries go, its handoffs end;
    /// returns the releases to carry out.
    pub(crate) fn on_died(&self, inner: &mut Inner, engine: usize, cause: DeathCause, now: Instant) -> Vec<ReleaseJob> {
        let Some(id) = inner.cluster.membership.get(engine).map(|e| e.spec.id.clone()) else { return Vec::new() };
        if let Some(meta) = inner.meta.get_mut(engine) {
            if let Some(ingest) = meta.ingest.take() {
                ingest.stop.store(true, std::sync::atomic::Ordering::Release);
            }
            meta.health_failures = 0;
            meta.load = None;
        }
        let actions = inner.cluster.engine_died(engine, now);
        inner.death_seq += 1;
        inner.deaths.push_back(Death { seq: inner.death_seq, id: id.clone(), at: now });
        self.metrics.death(cause);
        tracing::warn!(engine = %id, cause = cause.as_str(), "engine left pairing");
        self.release_jobs(inner, actions)
    }

    fn release_jobs(&self, inner: &mut Inner, actions: Vec<Action>) -> Vec<ReleaseJob> {
        let mut jobs = Vec::new();
        for action in actions {
            match action {
                Action::Release { request, prefill } => {
                    let Some(spec) = inner.cluster.membership.get(prefill).map(|e| &e.spec) else { continue };
                    let params = inner.params.remove(&request).map_or_else(null, |held| held.params);
                    jobs.push(ReleaseJob {
                        notice: ReleaseNotice {
                            request_id: request,
                            prefill: spec.id.clone(),
                            kv_transfer_params: params,
                        },
                        sidecar_url: spec.sidecar_url.clone(),
                    });
                }
                Action::Notify { request, dead, .. } => {
                    // The decode's sidecar learns of the death from its heartbeat notices.
                    let dead = inner.cluster.membership.get(dead).map(|e| e.spec.id.as_str()).unwrap_or("?");
                    tracing::debug!(request, dead, "prefill died under a request");
                }
            }
        }
        jobs
    }

    /// A release whose POST failed (or that has no sidecar to call) waits for the prefill's
    /// heartbeat.
    pub(crate) fn queue_release(&self, notice: ReleaseNotice) {
        let mut inner = self.inner.lock();
        let prefill = notice.prefill.clone();
        inner.pending.entry(prefill).or_default().push((notice, Instant::now()));
    }

    /// Lease expiry every tick; handoff and index upkeep about once a second.
    pub(crate) fn tick(self: &Arc<Self>, now: Instant) {
        let jobs = {
            let mut inner = self.inner.lock();
            let inner = &mut *inner;
            let mut jobs = Vec::new();
            for engine in inner.cluster.membership.expire(now) {
                jobs.extend(self.on_died(inner, engine, DeathCause::Lease, now));
            }
            if now.duration_since(inner.last_upkeep) >= Duration::from_secs(1) {
                inner.last_upkeep = now;
                let actions = inner.cluster.tick(now);
                jobs.extend(self.release_jobs(inner, actions));
                let max_age = Duration::from_secs_f64(self.config.handoff_max_age_secs) + Duration::from_secs(10);
                inner.params.retain(|_, held| now.duration_since(held.at) < max_age);
                inner.pending.retain(|_, list| {
                    list.retain(|(_, at)| now.duration_since(*at) < NOTICE_MAX_AGE);
                    !list.is_empty()
                });
                while inner.deaths.front().is_some_and(|d| now.duration_since(d.at) >= NOTICE_MAX_AGE) {
                    inner.deaths.pop_front();
                }
                self.forget_dead(inner, now);
            }
            jobs
        };
        self.spawn_releases(jobs);
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
            inner.pending.remove(&gone.spec.id);
            crate::metrics::inc(&self.metrics.forgotten);
            tracing::info!(engine = %gone.spec.id, "dead engine forgotten");
        }
    }

    pub(crate) fn spawn_releases(self: &Arc<Self>, jobs: Vec<ReleaseJob>) {
        for job in jobs {
            let this = Arc::clone(self);
            self.runtime.spawn(async move { this.release(job).await });
        }
    }
}
