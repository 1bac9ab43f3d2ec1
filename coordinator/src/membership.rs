//! Which engines exist and which are alive: declared statically or registered by sidecars, kept
//! alive by heartbeats under a lease. Engines get small stable ids (their position) that the
//! index and the pairing use.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// The wire contract's role: one definition for the core, the API and the sidecar.
pub use pd_api::Role;

/// An engine's declaration (from the cluster file or a sidecar's registration).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineSpec {
    pub id: String,
    pub role: Role,
    pub node: String,
    pub model: String,
    pub engine_url: String,
    pub sidecar_url: Option<String>,
    pub kv_events: Option<String>,
    pub kv_events_topic: Option<String>,
    pub replay: Option<String>,
    pub xfer_side_channel: Option<String>,
    pub block_size: u32,
    pub capacity_blocks: Option<u64>,
    /// vLLM data-parallel ranks behind `engine_url` (`None`: no data parallel).
    pub data_parallel_size: Option<u32>,
}

impl EngineSpec {
    /// Whether the engine declared a way to receive its KV events (an endpoint, or a topic for
    /// collector mode). An engine found only through the topic pattern is not known to publish
    /// until it does, so its routed prefixes are guessed like those of an engine without events.
    pub fn publishes_events(&self) -> bool {
        self.kv_events.is_some() || self.kv_events_topic.is_some()
    }

    /// Ranks with a KV cache of their own: 1 without data parallel.
    pub fn ranks(&self) -> u32 {
        self.data_parallel_size.unwrap_or(1).max(1)
    }

    /// Whether requests are sent to a rank by header (the engine runs data parallel).
    pub fn has_ranks(&self) -> bool {
        self.ranks() > 1
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Alive { lease_until: Instant },
    Dead { since: Instant },
}

#[derive(Clone, Debug)]
pub struct Engine {
    pub spec: EngineSpec,
    pub liveness: Liveness,
    /// Times the engine was (re)registered; a restart shows as a new generation.
    pub generation: u64,
    /// Unique over the membership's whole life (a forgotten engine's number is reused by the
    /// next new one): work started for one incarnation (health checks, event ingestion) checks
    /// it before touching the engine again.
    pub incarnation: u64,
}

impl Engine {
    pub fn is_alive(&self) -> bool {
        matches!(self.liveness, Liveness::Alive { .. })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    New(usize),
    /// Known id; `changed` when its declaration differs (the engine restarted elsewhere).
    Renewed {
        engine: usize,
        changed: bool,
        was_dead: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine {0:?}")]
pub struct UnknownEngine(pub String);

#[derive(Debug)]
pub struct Membership {
    lease: Duration,
    /// By engine number; `None` where a forgotten engine was (its number is reused).
    engines: Vec<Option<Engine>>,
    by_id: HashMap<String, usize>,
    /// Numbers of forgotten engines, for the next new ones.
    free: Vec<usize>,
    incarnations: u64,
    /// Live engines by model, by number, rebuilt whenever one is born, dies or changes: every
    /// pairing decision lists them twice, and walking every engine's record each time showed in
    /// its profile.
    roster: HashMap<String, Vec<(usize, Role)>>,
}

impl Membership {
    pub fn new(lease: Duration) -> Self {
        Membership {
            lease,
            engines: Vec::new(),
            by_id: HashMap::new(),
            free: Vec::new(),
            incarnations: 0,
            roster: HashMap::new(),
        }
    }

    fn rebuild_roster(&mut self) {
        for members in self.roster.values_mut() {
            members.clear();
        }
        for (engine, entry) in self.engines.iter().enumerate() {
            let Some(entry) = entry.as_ref().filter(|e| e.is_alive()) else { continue };
            let member = (engine, entry.spec.role);
            match self.roster.get_mut(&entry.spec.model) {
                Some(members) => members.push(member),
                None => {
                    self.roster.insert(entry.spec.model.clone(), vec![member]);
                }
            }
        }
        self.roster.retain(|_, members| !members.is_empty());
    }

    fn next_incarnation(&mut self) -> u64 {
        self.incarnations += 1;
        self.incarnations
    }

    pub fn register(&mut self, spec: EngineSpec, now: Instant) -> Registered {
        let lease_until = now + self.lease;
        match self.by_id.get(&spec.id).copied() {
            Some(engine) => {
                let incarnation = self.next_incarnation();
                let entry = self.engines[engine].as_mut().expect("by_id names live slots");
                let changed = entry.spec != spec;
                let was_dead = !entry.is_alive();
                if changed || was_dead {
                    entry.generation += 1;
                    entry.incarnation = incarnation;
                }
                entry.spec = spec;
                entry.liveness = Liveness::Alive { lease_until };
                if changed || was_dead {
                    self.rebuild_roster();
                }
                Registered::Renewed { engine, changed, was_dead }
            }
            None => {
                let incarnation = self.next_incarnation();
                let entry = Engine { spec, liveness: Liveness::Alive { lease_until }, generation: 1, incarnation };
                let engine = match self.free.pop() {
                    Some(engine) => engine,
                    None => {
                        self.engines.push(None);
                        self.engines.len() - 1
                    }
                };
                self.by_id.insert(entry.spec.id.clone(), engine);
                self.engines[engine] = Some(entry);
                self.rebuild_roster();
                Registered::New(engine)
            }
        }
    }

    /// Extends a live engine's lease. A dead engine must register again (its state was dropped).
    pub fn heartbeat(&mut self, id: &str, now: Instant) -> Result<usize, UnknownEngine> {
        let engine = *self.by_id.get(id).ok_or_else(|| UnknownEngine(id.to_string()))?;
        let entry = self.engines[engine].as_mut().ok_or_else(|| UnknownEngine(id.to_string()))?;
        match &mut entry.liveness {
            Liveness::Alive { lease_until } => {
                *lease_until = now + self.lease;
                Ok(engine)
            }
            Liveness::Dead { .. } => Err(UnknownEngine(id.to_string())),
        }
    }

    /// Marks an engine dead now (failed health check, sidecar report, node loss). Returns
    /// whether it was alive.
    pub fn mark_dead(&mut self, engine: usize, now: Instant) -> bool {
        let Some(entry) = self.engines.get_mut(engine).and_then(Option::as_mut) else { return false };
        let was_alive = entry.is_alive();
        if was_alive {
            entry.liveness = Liveness::Dead { since: now };
            self.rebuild_roster();
        }
        was_alive
    }

    /// Engines whose lease ran out by `now`, now marked dead.
    pub fn expire(&mut self, now: Instant) -> Vec<usize> {
        let mut died = Vec::new();
        for (engine, entry) in self.engines.iter_mut().enumerate() {
            let Some(entry) = entry else { continue };
            if let Liveness::Alive { lease_until } = entry.liveness {
                if lease_until <= now {
                    entry.liveness = Liveness::Dead { since: now };
                    died.push(engine);
                }
            }
        }
        if !died.is_empty() {
            self.rebuild_roster();
        }
        died
    }

    /// Dead engines whose death is at least `after` old by `now`: candidates to forget.
    pub fn dead_for(&self, after: Duration, now: Instant) -> Vec<usize> {
        self.iter()
            .filter(|(_, e)| matches!(e.liveness, Liveness::Dead { since } if now.saturating_duration_since(since) >= after))
            .map(|(engine, _)| engine)
            .collect()
    }

    /// Removes a dead engine altogether: its id is unknown from now on and its number goes to
    /// the next new engine. Returns the forgotten engine, `None` when it is alive or unknown.
    pub fn forget(&mut self, engine: usize) -> Option<Engine> {
        let slot = self.engines.get_mut(engine)?;
        if slot.as_ref().is_none_or(Engine::is_alive) {
            return None;
        }
        let entry = slot.take()?;
        self.by_id.remove(&entry.spec.id);
        self.free.push(engine);
        Some(entry)
    }

    /// Every engine on a node, for node-level failures.
    pub fn on_node(&self, node: &str) -> Vec<usize> {
        self.iter().filter(|(_, e)| e.spec.node == node).map(|(engine, _)| engine).collect()
    }

    pub fn get(&self, engine: usize) -> Option<&Engine> {
        self.engines.get(engine).and_then(Option::as_ref)
    }

    /// Every known engine (alive or dead) with its number, by number.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &Engine)> + Clone {
        self.engines.iter().enumerate().filter_map(|(i, e)| e.as_ref().map(|e| (i, e)))
    }

    pub fn id_of(&self, id: &str) -> Option<usize> {
        self.by_id.get(id).copied()
    }

    /// Live engines serving `model` that can take `role`'s part.
    pub fn live(&self, model: &str, wants: impl Fn(Role) -> bool) -> Vec<usize> {
        self.live_iter(model, wants).collect()
    }

    /// [`Membership::live`] without collecting.
    pub fn live_iter<'a>(
        &'a self,
        model: &'a str,
        wants: impl Fn(Role) -> bool + 'a,
    ) -> impl Iterator<Item = usize> + 'a {
        self.roster.get(model).into_iter().flatten().filter(move |&&(_, role)| wants(role)).map(|&(engine, _)| engine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(id: &str, role: Role, node: &str) -> EngineSpec {
        EngineSpec {
            id: id.into(),
            role,
            node: node.into(),
            model: "m".into(),
            engine_url: format!("http://{id}"),
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

    #[test]
    fn leases_expire_without_heartbeats() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        assert_eq!(m.register(spec("p0", Role::Prefill, "n1"), t0), Registered::New(0));
        assert_eq!(m.register(spec("d0", Role::Decode, "n2"), t0), Registered::New(1));
        m.heartbeat("p0", t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(m.expire(t0 + Duration::from_secs(4)), vec![1]);
        assert_eq!(m.live("m", Role::prefills), vec![0]);
        assert!(m.live("m", Role::decodes).is_empty());
        assert!(m.heartbeat("d0", t0 + Duration::from_secs(4)).is_err(), "dead engines re-register");
        assert!(m.heartbeat("nobody", t0).is_err());
        let again = m.register(spec("d0", Role::Decode, "n2"), t0 + Duration::from_secs(5));
        assert_eq!(again, Registered::Renewed { engine: 1, changed: false, was_dead: true });
        assert_eq!(m.get(1).unwrap().generation, 2);
    }

    #[test]
    fn nodes_and_roles() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        m.register(spec("a", Role::Both, "n1"), t0);
        m.register(spec("b", Role::Decode, "n1"), t0);
        m.register(spec("c", Role::Prefill, "n2"), t0);
        assert_eq!(m.on_node("n1"), vec![0, 1]);
        assert_eq!(m.live("m", Role::prefills), vec![0, 2]);
        assert_eq!(m.live("other", Role::prefills), Vec::<usize>::new());
        assert!(m.mark_dead(0, t0));
        assert!(!m.mark_dead(0, t0));
        let moved = m.register(spec("c", Role::Prefill, "n3"), t0);
        assert_eq!(moved, Registered::Renewed { engine: 2, changed: true, was_dead: false });
    }

    #[test]
    fn dead_engines_are_forgotten_after_a_bound_and_their_numbers_reused() {
        let t0 = Instant::now();
        let minute = Duration::from_secs(60);
        let mut m = Membership::new(Duration::from_secs(3));
        m.register(spec("a", Role::Prefill, "n1"), t0);
        m.register(spec("b", Role::Decode, "n1"), t0);
        assert!(m.dead_for(minute, t0).is_empty());
        assert!(m.forget(0).is_none(), "alive engines are never forgotten");
        m.mark_dead(0, t0);
        assert!(m.dead_for(minute, t0 + Duration::from_secs(59)).is_empty());
        assert_eq!(m.dead_for(minute, t0 + minute), vec![0]);
        // Coming back before the bound revives it under the same number.
        let back = m.register(spec("a", Role::Prefill, "n1"), t0 + Duration::from_secs(30));
        assert_eq!(back, Registered::Renewed { engine: 0, changed: false, was_dead: true });
        m.mark_dead(0, t0 + Duration::from_secs(40));
        let old = m.get(0).unwrap().incarnation;
        assert_eq!(m.forget(0).map(|e| e.spec.id), Some("a".into()));
        assert!(m.get(0).is_none() && m.id_of("a").is_none());
        assert!(m.heartbeat("a", t0).is_err());
        assert_eq!(m.iter().map(|(i, _)| i).collect::<Vec<_>>(), vec![1]);
        assert_eq!(m.on_node("n1"), vec![1]);
        // The next new engine takes the number, as a new incarnation.
        assert_eq!(m.register(spec("c", Role::Prefill, "n2"), t0), Registered::New(0));
        assert!(m.get(0).unwrap().incarnation > old);
        assert_eq!(m.get(0).unwrap().generation, 1);
        assert_eq!(m.register(spec("a", Role::Prefill, "n1"), t0), Registered::New(2));
    }

    #[test]
    fn the_live_list_follows_every_change() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::from_secs(3));
        m.register(spec("a", Role::Prefill, "n1"), t0);
        m.register(spec("b", Role::Decode, "n1"), t0);
        m.register(EngineSpec { model: "other".into(), ..spec("c", Role::Both, "n2") }, t0);
        assert_eq!(m.live("m", |_| true), vec![0, 1]);
        assert_eq!(m.live("other", Role::decodes), vec![2]);
        // A role change and a model change take effect at once.
        m.register(spec("a", Role::Decode, "n1"), t0);
        assert_eq!(m.live("m", Role::decodes), vec![0, 1]);
        assert!(m.live("m", Role::prefills).is_empty());
        m.register(spec("c", Role::Both, "n2"), t0);
        assert!(m.live("other", |_| true).is_empty());
        assert_eq!(m.live("m", Role::prefills), vec![2]);
        // Deaths by lease and by mark, then a revival and a forgotten number reused.
        m.heartbeat("a", t0 + Duration::from_secs(2)).unwrap();
        m.heartbeat("c", t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(m.expire(t0 + Duration::from_secs(4)), vec![1]);
        assert_eq!(m.live("m", |_| true), vec![0, 2]);
        m.mark_dead(0, t0);
        assert_eq!(m.live("m", |_| true), vec![2]);
        m.register(spec("b", Role::Decode, "n1"), t0 + Duration::from_secs(5));
        assert_eq!(m.live("m", |_| true), vec![1, 2]);
        m.forget(0);
        assert_eq!(m.register(spec("d", Role::Prefill, "n3"), t0), Registered::New(0));
        assert_eq!(m.live("m", Role::prefills), vec![0, 2]);
    }
}
