//! Polls every engine's `GET /health`. Consecutive failures mark an engine dead (also one a
//! live sidecar still heartbeats for); a success renews the lease of an engine that has no
//! sidecar to heartbeat for it, and revives a static one that had died.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::future::join_all;

use crate::metrics::{inc, DeathCause};

use super::state::{Coordinator, Origin};

struct Target {
    engine: usize,
    incarnation: u64,
    url: String,
}

impl Coordinator {
    pub(crate) async fn health_loop(self: Arc<Self>) {
        let interval = Duration::from_millis(self.config.health_interval_ms);
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            self.health_round().await;
        }
    }

    async fn health_round(self: &Arc<Self>) {
        let targets: Vec<Target> = {
            let inner = self.inner.lock();
            inner
                .cluster
                .membership
                .iter()
                .filter(|(i, e)| {
                    let meta = &inner.meta[*i];
                    let revivable = meta.origin == Origin::Static && e.spec.sidecar_url.is_none() && !meta.left;
                    e.is_alive() || revivable
                })
                .map(|(engine, e)| Target {
                    engine,
                    incarnation: e.incarnation,
                    url: format!("{}/health", e.spec.engine_url),
                })
                .collect()
        };
        if targets.is_empty() {
            return;
        }
        let timeout = Duration::from_millis(self.config.health_timeout_ms);
        let checks = targets.iter().map(|t| {
            let request = self.http.get(&t.url).timeout(timeout).send();
            async move { matches!(request.await, Ok(response) if response.status().is_success()) }
        });
        let results = join_all(checks).await;
        let mut revoke = Vec::new();
        let actions = {
            let mut inner = self.inner.lock();
            let inner = &mut *inner;
            let now = Instant::now();
            let mut actions = Vec::new();
            for (target, healthy) in targets.iter().zip(results) {
                let Some(entry) = inner.cluster.membership.get(target.engine) else { continue };
                if entry.incarnation != target.incarnation {
                    continue;
                }
                let alive = entry.is_alive();
                let has_sidecar = entry.spec.sidecar_url.is_some();
                let id = entry.spec.id.clone();
                if healthy {
                    inner.meta[target.engine].health_failures = 0;
                    if alive && !has_sidecar {
                        let _ = inner.cluster.membership.heartbeat(&id, now);
                    } else if !alive {
                        if let Some(spec) = inner.meta[target.engine].static_spec.clone() {
                            tracing::info!(engine = %id, "static engine healthy again");
                            self.apply_register(inner, spec, Origin::Static, None, now);
                        }
                    }
                    continue;
                }
                if !alive {
                    continue;
                }
                inc(&self.metrics.health_failures);
                let meta = &mut inner.meta[target.engine];
                meta.health_failures += 1;
                if meta.health_failures >= self.config.health_failures {
                    if let Some(lease) = meta.lease_id.take() {
                        revoke.push((id, lease));
                    }
                    actions.extend(self.on_died(inner, target.engine, DeathCause::Health, now));
                }
            }
            actions
        };
        self.carry_out(actions);
        // Other coordinators learn of the death through etcd.
        if let Some(store) = &self.store {
            for (id, lease) in revoke {
                if let Err(err) = store.deregister(&id, Some(lease)).await {
                    inc(&self.metrics.store_errors);
                    tracing::warn!(%err, engine = %id, "etcd: cannot remove a dead engine");
                }
            }
        }
    }
}
