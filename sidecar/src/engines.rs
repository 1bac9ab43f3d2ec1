//! The engines a request can be sent to, each kind a handle of its own: the local engine's
//! ranks ([`EnginePool`], for the decode, releases and pass-through), the prefill engines known
//! without the coordinator ([`Prefills`], for routing) and the engines the coordinator reported
//! dead ([`DeadSet`], shared by routing, the leg executor and the coordinator link).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::RwLock;

use crate::allowlist::{Allowlist, HostPort};
use crate::target::Target;

/// The prefill engines known from the configuration: the static list (taken in rotation) and
/// the allowlist a routing header's targets are checked against; engines reported dead are
/// left out of the rotation.
#[derive(Debug)]
pub struct Prefills {
    statics: Vec<Target>,
    next: AtomicUsize,
    pub allowlist: Allowlist,
    pub dead: Arc<DeadSet>,
}

impl Prefills {
    pub fn new(statics: Vec<Target>, allowlist: Allowlist, dead: Arc<DeadSet>) -> Prefills {
        Prefills { statics, next: AtomicUsize::new(0), allowlist, dead }
    }

    /// The static list starting at the next round-robin position, without engines known dead.
    pub fn rotation(&self) -> Vec<Target> {
        let n = self.statics.len();
        if n == 0 {
            return Vec::new();
        }
        let start = self.next.fetch_add(1, Relaxed) % n;
        (0..n).map(|i| &self.statics[(start + i) % n]).filter(|t| !self.dead.is_dead(t)).cloned().collect()
    }

    /// The static entry at `hp` (it keeps its scheme and bootstrap port).
    pub fn listed(&self, hp: &HostPort) -> Option<Target> {
        self.statics.iter().find(|p| p.host_port == *hp).cloned()
    }

    pub fn len(&self) -> usize {
        self.statics.len()
    }

    pub fn is_empty(&self) -> bool {
        self.statics.is_empty()
    }
}

#[derive(Debug)]
pub struct EnginePool {
    ranks: Vec<Target>,
    busy: Arc<Vec<AtomicU64>>,
    next: AtomicUsize,
}

/// A rank in use (for as long as its response streams); gives it back on drop.
#[derive(Debug)]
pub struct RankGuard {
    busy: Arc<Vec<AtomicU64>>,
    pub index: usize,
}

impl Drop for RankGuard {
    fn drop(&mut self) {
        self.busy[self.index].fetch_sub(1, Relaxed);
    }
}

impl EnginePool {
    pub fn new(ranks: Vec<Target>) -> Self {
        let busy = Arc::new(ranks.iter().map(|_| AtomicU64::new(0)).collect());
        EnginePool { ranks, busy, next: AtomicUsize::new(0) }
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    pub fn rank(&self, i: usize) -> &Target {
        &self.ranks[i]
    }

    pub fn all(&self) -> &[Target] {
        &self.ranks
    }

    /// The rank for pass-through paths (models, metrics, …): the first.
    pub fn primary(&self) -> &Target {
        &self.ranks[0]
    }

    /// The least busy rank (ties rotate), skipping `exclude`.
    pub fn pick(&self, exclude: &[usize]) -> Option<RankGuard> {
        let n = self.ranks.len();
        let start = if n > 1 { self.next.fetch_add(1, Relaxed) % n } else { 0 };
        let index = (0..n)
            .map(|i| (start + i) % n)
            .filter(|i| !exclude.contains(i))
            .min_by_key(|&i| self.busy[i].load(Relaxed))?;
        self.busy[index].fetch_add(1, Relaxed);
        Some(RankGuard { busy: Arc::clone(&self.busy), index })
    }
}

/// Engines the coordinator reported dead (by id and by base URL), forgotten after a while so a
/// restarted engine comes back even without a new notice.
#[derive(Debug, Default)]
pub struct DeadSet {
    entries: RwLock<HashMap<String, Instant>>,
    changed: tokio::sync::Notify,
}

const DEAD_FOR: Duration = Duration::from_secs(30);

impl DeadSet {
    pub fn mark(&self, key: &str) {
        self.entries.write().insert(key.to_string(), Instant::now() + DEAD_FOR);
        self.changed.notify_waiters();
    }

    /// Forgets a death the coordinator has since taken back (the engine is in its live view or
    /// was just paired): without this a healed engine stayed skipped for [`DEAD_FOR`].
    pub fn revive(&self, t: &Target) {
        let mut entries = self.entries.write();
        if entries.is_empty() {
            return;
        }
        entries.remove(&t.base);
        if let Some(id) = &t.id {
            entries.remove(id);
        }
    }

    /// Resolves once `t` is marked dead (never, if it stays alive).
    pub async fn wait_dead(&self, t: &Target) {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_dead(t) {
                return;
            }
            notified.await;
        }
    }

    /// The keys (ids, base URLs) dead now; empty (no allocation) in the common case.
    pub fn snapshot(&self) -> Vec<String> {
        let entries = self.entries.read();
        if entries.is_empty() {
            return Vec::new();
        }
        let now = Instant::now();
        entries.iter().filter(|(_, until)| **until > now).map(|(k, _)| k.clone()).collect()
    }

    pub fn is_dead(&self, t: &Target) -> bool {
        let entries = self.entries.read();
        if entries.is_empty() {
            return false;
        }
        let now = Instant::now();
        let live = |k: &str| entries.get(k).is_some_and(|until| *until > now);
        live(&t.base) || t.id.as_deref().is_some_and(live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Target {
        Target::parse(s, "http", None).unwrap()
    }

    #[test]
    fn least_busy_rank_and_exclusion() {
        let pool = EnginePool::new(vec![t("a:1"), t("b:1"), t("c:1")]);
        let g1 = pool.pick(&[]).unwrap();
        let g2 = pool.pick(&[]).unwrap();
        let g3 = pool.pick(&[]).unwrap();
        let mut used = [g1.index, g2.index, g3.index];
        used.sort();
        assert_eq!(used, [0, 1, 2], "each busy rank is avoided");
        let freed = g2.index;
        drop(g2);
        assert_eq!(pool.pick(&[]).unwrap().index, freed);
        assert!(pool.pick(&[0, 1, 2]).is_none());
        assert_eq!(pool.pick(&[0, 2]).unwrap().index, 1);
    }

    #[test]
    fn the_static_list_rotates_without_the_dead() {
        let dead = Arc::new(DeadSet::default());
        let allowlist = Allowlist::parse::<&str>(&[]).unwrap();
        let p = Prefills::new(vec![t("a:1"), t("b:1"), t("c:1")], allowlist, Arc::clone(&dead));
        let bases = |v: Vec<Target>| v.into_iter().map(|t| t.base).collect::<Vec<_>>();
        assert_eq!(bases(p.rotation()), ["http://a:1", "http://b:1", "http://c:1"]);
        assert_eq!(bases(p.rotation()), ["http://b:1", "http://c:1", "http://a:1"]);
        dead.mark("http://a:1");
        assert_eq!(bases(p.rotation()), ["http://c:1", "http://b:1"]);
        assert_eq!(p.listed(&"b:1".parse().unwrap()).map(|t| t.base), Some("http://b:1".into()));
        dead.revive(&t("a:1"));
        assert_eq!(bases(p.rotation()).len(), 3, "a revived engine is back in the rotation");
        assert!(p.listed(&"d:1".parse().unwrap()).is_none());
        let none = Prefills::new(Vec::new(), Allowlist::parse::<&str>(&[]).unwrap(), dead);
        assert!(none.rotation().is_empty() && none.is_empty());
    }

    #[test]
    fn dead_engines_are_skipped() {
        let d = DeadSet::default();
        let mut p = t("p:1");
        assert!(!d.is_dead(&p));
        d.mark("http://p:1");
        assert!(d.is_dead(&p));
        let d = DeadSet::default();
        p.id = Some("prefill-0".into());
        d.mark("prefill-0");
        assert!(d.is_dead(&p));
        assert_eq!(d.snapshot(), ["prefill-0"]);
    }
}
