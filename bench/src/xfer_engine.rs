//! The engine under test: one or more xfer agents with one backend, each with one local
//! registration for the whole run, and the targets' regions learned from their metadata.
//! Thread t posts from agent t mod agents to target t mod targets (see `Scheme`).

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::ProgressBar;
use xfer::{Agent, BackendParams, Desc, MemType, PreparedLocal, PreparedRemote, RequestOptions, XferRequest};

use crate::check;
use crate::layout::{Case, Layout};
use crate::measure::{measure, Measurement, Plan, Worker, REQUEST_TIMEOUT};
use crate::memory::{BenchBuffer, BenchRegistration, RunMemory};
use crate::raw::RawConn;
use crate::units::format_total;

/// One thread's requests, one per lane of its window, created once and reposted. The lanes
/// move the same blocks, so they carry the same bytes and `--check` still holds.
#[derive(Debug)]
struct XferWorker {
    lanes: Vec<XferRequest>,
}

impl Worker for XferWorker {
    fn post(&mut self, lane: usize) -> Result<()> {
        self.lanes[lane].post()?;
        Ok(())
    }

    fn wait(&mut self, lane: usize) -> Result<()> {
        self.lanes[lane].wait(REQUEST_TIMEOUT)?;
        Ok(())
    }
}

/// One initiator agent, its registered buffer and the targets it loaded.
#[derive(Debug)]
struct Initiator {
    agent: Agent,
    local: BenchBuffer,
    /// Per target: the peer's name and its region (of the remote memory type).
    targets: Vec<(String, Desc)>,
    remote_type: MemType,
    /// Keeps `local` registered (and alive) for the whole run.
    _registration: BenchRegistration,
}

#[derive(Debug)]
pub struct XferEngine {
    backend: String,
    initiators: Vec<Initiator>,
    /// Control connection to the (single) target for `--check` and `--grants`.
    control: Option<RawConn>,
    /// Each case runs under a grant of its remote blocks (`--grants`).
    pub grants: bool,
}

impl XferEngine {
    /// Attaches `backend` to `agents` agents, registers `memory.bytes` of `memory.local` in each
    /// and loads every target's metadata (and its `memory.remote` region) from its side channel
    /// in `sides`.
    pub fn connect(
        backend: &str,
        params: &str,
        sides: &[String],
        agents: u64,
        memory: &RunMemory,
        control: Option<RawConn>,
    ) -> Result<XferEngine> {
        let initiators = (0..agents)
            .map(|i| {
                let name = format!("xferbench-{}-{i}", std::process::id());
                Initiator::connect(&name, backend, params, sides, memory)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(XferEngine { backend: backend.to_string(), initiators, control, grants: false })
    }

    /// The backend's name, `+grants` with `--grants`.
    pub fn name(&self) -> String {
        match self.grants {
            true => format!("{}+grants", self.backend),
            false => self.backend.clone(),
        }
    }

    /// Has the target grant the (single) initiator exactly the layout's remote blocks, and
    /// loads the grant: descriptors prepared afterwards name it instead of the region's key.
    fn load_grant(&mut self, layout: &Layout) -> Result<()> {
        let control = self.control.as_mut().ok_or_else(|| anyhow!("--grants needs the target's raw-tcp port"))?;
        let initiator = &self.initiators[0];
        let ranges: Vec<(u64, u64)> =
            layout.remote.iter().flatten().map(|&slot| (layout.offset(slot), layout.block)).collect();
        let token = control.grant(initiator.agent.name(), &ranges)?;
        initiator.agent.load_grant(&token).context("loading the target's grant")?;
        Ok(())
    }

    /// Prepares the block lists once per (agent, target), creates `plan.window` requests per
    /// thread, then measures.
    pub fn run(
        &mut self,
        case: &Case,
        plan: Plan,
        threads: u64,
        seed: u64,
        check: bool,
        progress: &ProgressBar,
    ) -> Result<Measurement> {
        let layout = Layout::new(case, threads as usize, seed);
        if self.grants {
            self.load_grant(&layout)?;
        }
        let options = RequestOptions::default().backend(self.backend.clone());
        let mut prepared: HashMap<(usize, usize), (PreparedLocal, PreparedRemote)> = HashMap::new();
        let mut workers = Vec::new();
        for (thread, (l, r)) in layout.local.iter().zip(&layout.remote).enumerate() {
            let a = thread % self.initiators.len();
            let initiator = &self.initiators[a];
            let t = thread % initiator.targets.len();
            let (local, remote) = match prepared.entry((a, t)) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(initiator.prepare(&layout, t)?),
            };
            let lanes = (0..plan.window)
                .map(|_| initiator.agent.make_request(case.op, local, l, remote, r, options.clone()))
                .collect::<Result<Vec<_>, _>>()?;
            workers.push(XferWorker { lanes });
        }
        let control = match (check, self.control.as_mut()) {
            (false, _) => None,
            (true, Some(control)) => Some(control),
            (true, None) => bail!("--check needs the target's raw-tcp port"),
        };
        let first = &self.initiators[0].local;
        if let Some(control) = control {
            check::xfer_prepare(case.op, &layout, first, control, seed)?;
        }
        let measured = measure(&mut workers, plan, progress)?;
        drop(workers);
        if let (true, Some(control)) = (check, self.control.as_mut()) {
            check::xfer_verify(case.op, &layout, first, control, seed)
                .with_context(|| format!("{} {}", self.name(), case.label()))?;
        }
        Ok(measured)
    }
}

impl Initiator {
    fn connect(name: &str, backend: &str, params: &str, sides: &[String], memory: &RunMemory) -> Result<Initiator> {
        let agent = Agent::new(name)?;
        let params = BackendParams::parse(params).context("--params")?;
        agent.add_backend(backend, params).with_context(|| format!("attaching backend {backend}"))?;
        let (local, registration) =
            BenchBuffer::register(&agent, memory.local, &memory.options, memory.bytes as usize)?;
        let remote_type = memory.remote.mem_type();
        let targets = sides
            .iter()
            .map(|side| load_target(&agent, side, remote_type, memory.bytes))
            .collect::<Result<Vec<_>>>()?;
        Ok(Initiator { agent, local, targets, remote_type, _registration: registration })
    }

    /// Both sides' block lists of the layout, against target `t`.
    fn prepare(&self, layout: &Layout, t: usize) -> Result<(PreparedLocal, PreparedRemote)> {
        let (peer, region) = &self.targets[t];
        let block = layout.block;
        let local_descs: Vec<Desc> =
            (0..layout.slots).map(|s| self.local.sub_desc(layout.offset(s) as usize, block as usize)).collect();
        let remote_descs: Vec<Desc> =
            (0..layout.slots).map(|s| Desc::new(region.addr + layout.offset(s), block, region.dev_id)).collect();
        Ok((
            self.agent.prep_local(self.local.mem_type(), &local_descs)?,
            self.agent.prep_remote(peer, self.remote_type, &remote_descs)?,
        ))
    }
}

/// Loads a target's metadata; returns its name and largest region of `mem_type` (at least `mem`).
fn load_target(agent: &Agent, side: &str, mem_type: MemType, mem: u64) -> Result<(String, Desc)> {
    let peer =
        agent.fetch_remote_metadata(side).with_context(|| format!("fetching the target's metadata from {side}"))?;
    let regions = agent.remote_regions(&peer)?;
    let remote = regions
        .iter()
        .filter(|(published, _)| *published == mem_type)
        .map(|(_, desc)| *desc)
        .max_by_key(|desc| desc.len)
        .ok_or_else(|| {
            anyhow!("the target {peer} published no {mem_type} region: start it with the same --remote-mem")
        })?;
    if remote.len < mem {
        bail!(
            "the target's region is {} but this run needs {}: start the target with the same \
             --block-sizes/--batch/--threads/--scatter (or a larger --mem)",
            format_total(remote.len),
            format_total(mem)
        );
    }
    Ok((peer, remote))
}
