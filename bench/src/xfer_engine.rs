//! The engine under test: an xfer agent with one backend, one local registration for the whole
//! run, and the target's region learned from its metadata.

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::ProgressBar;
use xfer::{Agent, BackendParams, Desc, HostBuffer, MemType, Registration, RequestOptions, XferRequest};

use crate::check;
use crate::layout::{Case, Layout};
use crate::measure::{measure, Measurement, Plan, Worker, REQUEST_TIMEOUT};
use crate::memory;
use crate::raw::RawConn;
use crate::units::format_total;

/// One thread's request, created once and reposted.
#[derive(Debug)]
struct XferWorker {
    request: XferRequest,
}

impl Worker for XferWorker {
    fn once(&mut self) -> Result<()> {
        self.request.post()?;
        self.request.wait(REQUEST_TIMEOUT)?;
        Ok(())
    }
}

#[derive(Debug)]
pub struct XferEngine {
    backend: String,
    agent: Agent,
    local: Arc<HostBuffer>,
    peer: String,
    remote: Desc,
    /// Control connection to the target for `--check`.
    control: Option<RawConn>,
    /// Keeps `local` registered (and alive) for the whole run.
    _registration: Registration,
}

impl XferEngine {
    /// Attaches `backend`, registers `mem` bytes and loads the target's metadata from `side`.
    pub fn connect(backend: &str, params: &str, side: &str, mem: u64, control: Option<RawConn>) -> Result<XferEngine> {
        let agent = Agent::new(&format!("xferbench-{}", std::process::id()))?;
        let params = BackendParams::parse(params).context("--params")?;
        agent.add_backend(backend, params).with_context(|| format!("attaching backend {backend}"))?;
        let local = memory::host_buffer(mem as usize);
        let registration =
            agent.register_buffer(&local).with_context(|| format!("registering {}", format_total(mem)))?;
        let peer =
            agent.fetch_remote_metadata(side).with_context(|| format!("fetching the target's metadata from {side}"))?;
        let regions = agent.remote_regions(&peer)?;
        let remote = regions
            .iter()
            .filter(|(mem_type, _)| *mem_type == MemType::Dram)
            .map(|(_, desc)| *desc)
            .max_by_key(|desc| desc.len)
            .ok_or_else(|| anyhow!("the target {peer} published no DRAM region"))?;
        if remote.len < mem {
            bail!(
                "the target's region is {} but this run needs {}: start the target with the same \
                 --block-sizes/--batch/--threads/--scatter (or a larger --mem)",
                format_total(remote.len),
                format_total(mem)
            );
        }
        Ok(XferEngine {
            backend: backend.to_string(),
            agent,
            local,
            peer,
            remote,
            control,
            _registration: registration,
        })
    }

    pub fn name(&self) -> &str {
        &self.backend
    }

    /// Prepares both sides' block lists once, creates one request per thread, then measures.
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
        let block = layout.block;
        let local_descs: Vec<Desc> =
            (0..layout.slots).map(|s| self.local.sub_desc(layout.offset(s) as usize, block as usize)).collect();
        let remote_descs: Vec<Desc> = (0..layout.slots)
            .map(|s| Desc::new(self.remote.addr + layout.offset(s), block, self.remote.dev_id))
            .collect();
        let local = self.agent.prep_local(MemType::Dram, &local_descs)?;
        let remote = self.agent.prep_remote(&self.peer, MemType::Dram, &remote_descs)?;
        let options = RequestOptions::default().backend(self.backend.clone());
        let mut workers = layout
            .local
            .iter()
            .zip(&layout.remote)
            .map(|(l, r)| {
                let request = self.agent.make_request(case.op, &local, l, &remote, r, options.clone())?;
                Ok(XferWorker { request })
            })
            .collect::<Result<Vec<_>>>()?;
        let control = match (check, self.control.as_mut()) {
            (false, _) => None,
            (true, Some(control)) => Some(control),
            (true, None) => bail!("--check needs the target's raw-tcp port"),
        };
        if let Some(control) = control {
            check::xfer_prepare(case.op, &layout, &self.local, control, seed)?;
        }
        let measured = measure(&mut workers, plan, progress)?;
        drop(workers);
        if let (true, Some(control)) = (check, self.control.as_mut()) {
            check::xfer_verify(case.op, &layout, &self.local, control, seed)
                .with_context(|| format!("{} {}", self.backend, case.label()))?;
        }
        Ok(measured)
    }
}
