//! libfabric backend of `xfer`, over the system libfabric (OFI): AWS EFA, verbs, and on plain
//! machines `tcp;ofi_rxm` and `shm`, through one plugin.
//!
//! Each backend instance opens, per rail (one domain: a NIC or interface), a reliable-datagram
//! (FI_EP_RDM) endpoint with FI_RMA and FI_MSG on the chosen provider, with its own fabric,
//! domain, address vector and completion queue ([`fabric`], the only module that calls
//! libfabric). One engine thread per rail ([`engine`]) drives its endpoint: callers hand it jobs and registrations over a channel and wake it with `fi_cq_signal`;
//! it posts each job's `fi_readmsg`/`fi_writemsg` operations (consecutive descriptor pieces
//! as one vectored operation, up to the provider's iovec limits and `max_op_bytes`; 4 iovecs
//! with `tcp;ofi_rxm`), at most `max_in_flight` per job
//! and no more than the provider's transmit queue holds, reads the CQ (errors from
//! `fi_cq_readerr`), and, idle, blocks in `fi_cq_sread`, which keeps the provider's progress
//! (and so its service of peers' RMA) going. That needs a CQ wait object whose wait returns
//! when its timeout passes (an fd or a condition variable: `tcp;ofi_rxm`, `sockets`); a
//! provider that offers only others (shm: FI_WAIT_YIELD, whose `fi_cq_sread` ignores the
//! timeout and kept the engine thread away for good) gets a CQ without a wait object, which
//! the idle engine polls instead, sleeping 20 µs after activity and twice as long after each
//! quiet poll, up to 1 ms (an idle agent wakes 1000 times a second, as with a fixed 1 ms).
//! shm serves a peer's RMA inside our progress calls and puts nothing in our CQ for it, so
//! on shm a counter of remote RMA (FI_RMA_EVENT) counts as activity too; without it a
//! target answered each operation only at its next 1 ms poll. The agent metadata carries every
//! rail's endpoint address (`fi_getname`; peers insert it into their AV on connect) and, per
//! registration, its key on every rail.
//!
//! Each peer address is in a rail's AV once, however many connections use it (a metadata
//! reload connects before the old connection goes); the last disconnection (the agent
//! invalidating the peer, or reloading it) fails what is still queued for it and removes it
//! (`fi_av_remove`), and connections name peers by a handle the engine checks, so a request
//! racing the disconnection fails as `PeerDisconnected` instead of reaching whichever peer the
//! freed AV slot goes to next. Peers in the AV only to acknowledge their notifications leave it
//! after 30 s unused.
//!
//! Multi-rail (`domains=a+b`) and lanes (`lanes=N`: N endpoints on each domain, each a rail of
//! its own with its own fabric, domain, AV, CQ, engine thread and so its own provider
//! connections; the tcp provider carries one endpoint pair's traffic over one socket, which
//! lanes multiply): the rails are the domains' lanes, domain-major, and lane `l` of domain `d`
//! of one agent talks to lane `l` of domain `d` of its peer, on as many domains and lanes as
//! the side with fewer has (a side with more lanes leaves its extra ones idle for that peer;
//! the connection info carries the lane count). A request is cut into about equal shares of
//! consecutive bytes, one per rail in use (shares of at least 64 KiB, so small requests use
//! fewer rails), each run by its rail's engine; the request completes when all shares have,
//! and its notification goes, on a rail that is up, once every share's data has completed
//! ([`stripe`]).
//!
//! Failover between rails ([`failover`], pure; [`stripe`] applies it): a share whose rail
//! reports an error for the peer (`PeerDisconnected`), or completes nothing for the peer for
//! `failover_ms` (a link gone down stalls its TCP connection rather than breaking it), marks
//! that rail down for this peer (logged once, at warn) and runs again, whole, on a rail that
//! is up. So a request striped over several rails finishes while one rail survives, within
//! `failover_ms` plus the time to move the failed share over the survivors; it fails
//! (`PeerDisconnected`, "every one of its N libfabric rails is down") only when no rail is
//! up. New requests leave a down rail out until `rail_retry_ms` has passed; the next request
//! then gives it a share again as a probe: if that completes the rail is up again (logged),
//! if it fails its share moves and the wait doubles, up to 30 s. Errors that are not the
//! rail's (a refusal, a cancellation) fail the request as before. A peer reached over one rail
//! has nothing to fail over to: its requests fail after `timeout_ms` as always.
//!
//! Memory registration honours the provider's `mr_mode`, asking for what the backend handles
//! (`FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT`):
//! remote addresses are virtual addresses or offsets into the registration, as the peer's
//! provider wants (its connection info says which, its key carries the base); the key is the
//! provider's (`fi_mr_key`, published through the returned key bytes) or one we request,
//! unique per endpoint; MRs are bound to the endpoint and enabled where FI_MR_ENDPOINT asks;
//! local descriptors (`fi_mr_desc`) go with every operation and message buffer where
//! FI_MR_LOCAL asks.
//!
//! A notification is a small message (`fi_send`) sent after the job's data completed, which
//! the receiver answers with an acknowledgement once it has queued the notification; the
//! request (or `notify`) completes on the acknowledgement. Messages follow RMA in order
//! (FI_ORDER_SAW is asked for), and the data had completed before, so a notification never
//! overtakes its data. The sender's address travels in the message, so the target need not
//! have connected to answer.
//!
//! rxm passthru: with `FI_OFI_RXM_ENABLE_PASSTHRU=1` in the environment, libfabric 1.17's
//! `ofi_rxm` hands RDM calls straight to the tcp provider's own RDM endpoint instead of running
//! its rendezvous protocol over tcp's connected endpoints. It was ahead of rxm's protocol in one
//! session's runs and mixed in another's (bench/README.md), so the backend leaves libfabric's
//! default (off) alone rather than write the process environment behind the caller's back
//! (`set_var` while other threads may read it is not synchronised by glibc); set it before
//! the process starts to try it.
//!
//! Parameters (all optional; libfabric's own `FI_*` environment variables apply underneath):
//! | key | default | meaning |
//! |---|---|---|
//! | `provider` | the best available | libfabric provider, e.g. `tcp;ofi_rxm`, `verbs;ofi_rxm`, `efa`, `shm`, `sockets`; the default is the first of `efa`, `cxi`, `opx`, `psm3`, `psm2`, `verbs;ofi_rxm`, `verbs`, `tcp;ofi_rxm`, `tcp`, `sockets` that offers RDM with RMA (`tcp;ofi_rxm` on a plain Linux host) |
//! | `domain` | the provider's first | domain (NIC or interface), e.g. `lo`, `eth0`, `mlx5_0`, `rdmap0s6` |
//! | `domains` | one domain, `domain` | several domains, separated by `+` (e.g. `eth0+eth1`); requests are striped across them. Not together with `domain` |
//! | `lanes` | 1 | endpoints (rails) per domain, each with its own connection to the peer and engine thread; requests are striped across all of them. Domains × lanes at most 16 |
//! | `timeout_ms` | 5000 | a request with no completion for this long fails (TimedOut), as does a notification not acknowledged within it |
//! | `failover_ms` | 1000 | with several rails, a share whose rail completed nothing for the peer this long moves to another rail (at most `timeout_ms`) |
//! | `rail_retry_ms` | 1000 | a rail that failed is left out this long before a request tries it again; doubles while it keeps failing, up to 30 s |
//! | `max_in_flight` | 16 | operations one request keeps posted at once |
//! | `max_op_bytes` | 4194304 | longer descriptor pieces go as several operations; shorter consecutive ones are joined into one vectored operation up to this many bytes |
//! | `max_notif_bytes` | 16777216 | largest notification this side receives (published; a peer refuses to send longer) |
//! | `notif_chunk` | 16384 | payload bytes per notification message; longer notifications go as several, reassembled by the receiver. published: a peer sends this side chunks of the size it asks for |
//! | `recv_buffers` | 32 | receive buffers kept posted for notifications |
//! | `spin_us` | 200 | the engine polls this long after the last event before it blocks in `fi_cq_sread` |
//!
//! Figures against raw TCP and `fi_pingpong`, and the settings tried beside lanes and passthru,
//! are in bench/README.md ("libfabric against raw TCP").
//!
//! Limits:
//! - DRAM only. GPU memory is refused with the reason (`register` fails with `Unsupported`):
//!   FI_HMEM registration (`fi_mr_regattr` with `FI_HMEM_CUDA`) is not written yet, and the
//!   providers here (`tcp`, `shm`) lack FI_HMEM anyway. Files are not moved either.
//! - Rails pair by index: lane `l` of domain `d` must reach the peer's lane `l` of domain `d`
//!   (same network); rails are not matched by reachability (one that cannot reach its peer
//!   is found down by failover, and probed again now and then).
//! - A share that moves is run again whole, including what had already arrived. Its
//!   operations on the failed rail are not cancelled (libfabric offers no way here, see
//!   below): if the link comes back, the TCP
//!   connection delivers them late, the same bytes into the same places (for a READ, into
//!   local memory after the request completed). An application that reuses those buffers at
//!   once can see them overwritten by the old bytes; the rail is not reset (rxm carries on
//!   over the same connection), which is what lets it be used again.
//! - Over `tcp;ofi_rxm` a bad key drops the connection (below), which looks like a rail
//!   failure: with several rails the share moves and meets the same refusal on the next
//!   rail, so such a request fails as "every rail is down" and the rails wait out their retry.
//! - A notification is not moved: if its rail fails after the data, the request fails.
//! - The throughput bar (≥ 0.7× raw TCP at 1 MiB and 16 MiB over `tcp;ofi_rxm`) is met on
//!   a quiet machine, not reliably under load on the 2-CPU test machine (see the figures
//!   above: WRITE 1 MiB fell to 0.38×).
//! - A request that failed (timeout, dead peer) may still have operations in the provider;
//!   they keep their local memory pinned until the provider reports them (a deregistration
//!   waits for that) or the backend shuts down. Taking them back earlier was tried and is not
//!   done: `fi_cancel` reaches only posted receives, not RMA operations, and `fi_av_remove` of
//!   the peer while operations to it are in flight crashed inside rxm (a completion with a
//!   NULL operation context).
//! - Over `tcp;ofi_rxm` a bad key or an address outside the peer's registration is refused by
//!   the target's provider, which drops the connection: the request fails as
//!   `PeerDisconnected`, not as a refusal, and rxm reconnects for the next (a message sent
//!   right after may still meet the broken connection and fail the same way). A target
//!   deregistering while transfers run is thus seen as `PeerDisconnected` by them (tested:
//!   `dereg_target_races_transfers_disconnecting`). `sockets` refuses such keys as unknown
//!   (`Refused`), connection intact.
//! - Providers here (libfabric 1.17, `fi_info -c FI_RMA -t FI_EP_RDM`): `tcp;ofi_rxm` (the
//!   default, whole suite), `sockets` (RDM + RMA; transfers, notifications, bad keys, the
//!   target-side deregistration race and a killed peer are tested on it; its progress
//!   threads spin, so it is not the default) and `shm` (one host only; its CQ is polled, see
//!   above; the scenarios of `over_shm` in the conformance test file, which says why the
//!   others are not run on it). shm endpoints get names of their own (`xfer-PID-...`): shm
//!   names its region in /dev/shm after the pid and leaves it behind when the process is
//!   killed, so a later process with the same pid failed fi_enable (EBUSY); opening an endpoint
//!   removes the regions of our processes that are gone.
//! - shm faults (libfabric 1.17, traced with gdb on the hung conformance scenarios; from
//!   1.18 on, shm's posts take no lock in the peer's region, which ends (1)). (1) A post
//!   takes a spinlock in the peer's region, which the peer holds while it serves RMA; a
//!   peer killed or stopped right then holds it for good
//!   (or until SIGCONT), and our engine thread spun in `pthread_spin_lock` under `fi_readmsg`
//!   for good, with every other peer of the rail. The backend now looks up the peer's
//!   process (named in its address) before each shm post and send: gone fails the request at
//!   once (`PeerDisconnected`), stopped holds it back (it fails after `timeout_ms` like any
//!   silent peer's). That closes the case of a peer found dead or stopped, not a fault that
//!   strikes while the post already waits on the lock: under a stream of transfers it
//!   usually does (both `sigkill_mid_transfer` and `sigstop_mid_transfer` hit it). (2) The
//!   answers to an endpoint's operations come back in one queue, read in posting order and
//!   stopped at the first not answered yet; an operation a peer never answers (it died or is
//!   stopped, or it refused the key: shm drops an RMA whose key fails verification without
//!   answering, which is what a deregistration racing transfers produces) holds back every
//!   later completion of the endpoint, to any peer, for good. Such operations keep their
//!   local memory pinned, and so the agent's deregistration of it waiting, until the backend
//!   shuts down (dropping the endpoint): a stopped peer may still write it after SIGCONT,
//!   and nothing tells a refused operation from a slow one. Requests still end, unless (1)
//!   caught the engine: it fails them after `timeout_ms` (`TimedOut`). What would confine it: an endpoint per
//!   peer, so that a wedge stays with its peer.
//! - Local transfers (two registrations of one agent) are not offered.

mod config;
mod engine;
mod fabric;
mod failover;
mod keys;
mod msg;
mod stripe;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use xfer_core::{
    Backend, BackendContext, BackendError, BackendFactory, Capabilities, LocalRegion, MemType, Op, RefusalCode,
    RemoteAgent, RemoteKey, TransferJob,
};

pub use config::Settings;
pub use keys::FabricRemoteKey;

use engine::{Cmd, Handle};
use fabric::{Attrs, Rma};
use failover::RailHealth;
use stripe::{Finish, PeerRail, PeerRails, Span, Stripe};

/// Registers the libfabric backend under the name `libfabric`.
#[derive(Clone, Copy, Debug, Default)]
pub struct LibfabricFactory;

impl BackendFactory for LibfabricFactory {
    fn name(&self) -> &'static str {
        "libfabric"
    }

    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
        Ok(Arc::new(LibfabricBackend::new(ctx)?))
    }
}

/// A provider and domain libfabric offers with RDM endpoints, RMA and messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProviderInfo {
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// The `FI_MR_*` bits the provider needs.
    pub mr_mode: u32,
    /// Whether it moves device memory (FI_HMEM).
    pub hmem: bool,
}

/// Every provider/domain that suits this backend (`provider`: only that one).
pub fn providers(provider: Option<&str>) -> Result<Vec<ProviderInfo>, BackendError> {
    let list = fabric::candidates(provider, None).map_err(unavailable)?;
    Ok(list
        .into_iter()
        .map(|a| ProviderInfo {
            provider: a.provider,
            fabric: a.fabric,
            domain: a.domain,
            mr_mode: a.mr_mode,
            hmem: a.hmem,
        })
        .collect())
}

fn unavailable(err: fabric::FabricError) -> BackendError {
    BackendError::Unsupported(format!("libfabric: {err}"))
}

pub struct LibfabricBackend {
    agent_name: String,
    settings: Settings,
    /// Every rail's endpoint, rail 0 first: each its own fabric, domain, AV, CQ and engine
    /// thread.
    rails: Vec<Rail>,
    conn_info: Vec<u8>,
    stopped: AtomicBool,
}

/// One domain (NIC) of the backend.
struct Rail {
    attrs: Attrs,
    engine: Arc<Handle>,
}

impl std::fmt::Debug for LibfabricBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibfabricBackend")
            .field("agent", &self.agent_name)
            .field("provider", &self.attrs().provider)
            .field("domains", &self.domains())
            .field("mr_mode", &format_args!("{:#x}", self.attrs().mr_mode))
            .finish_non_exhaustive()
    }
}

/// Bound on calls into the engine that do no I/O (registration, AV insertion).
const CALL_BOUND: Duration = Duration::from_secs(10);

/// Striped requests are cut into pieces of at least this many bytes per rail (smaller
/// requests go over fewer rails).
const MIN_STRIPE: u64 = 64 << 10;

impl LibfabricBackend {
    pub fn new(ctx: BackendContext) -> Result<Self, BackendError> {
        let BackendContext { agent_name, params, notifs, .. } = ctx;
        let settings = Settings::parse(params)?;
        let wanted: Vec<Option<&str>> = if settings.domains.is_empty() {
            vec![None]
        } else {
            settings.domains.iter().map(|d| Some(d.as_str())).collect()
        };
        let mut rails: Vec<Rail> = Vec::with_capacity(settings.rails());
        let mut addresses = Vec::with_capacity(settings.rails());
        for domain in wanted {
            for lane in 0..settings.lanes {
                // Every rail takes the provider rail 0 settled on; a domain's further lanes
                // take the domain its first lane settled on.
                let provider = rails.first().map(|r| r.attrs.provider.clone()).or_else(|| settings.provider.clone());
                let settled = (lane > 0).then(|| rails.last().map(|r| r.attrs.domain.clone())).flatten();
                let domain = settled.as_deref().or(domain);
                match Self::open_rail(&settings, provider.as_deref(), domain, &agent_name, &notifs) {
                    Ok((rail, address)) => {
                        rails.push(rail);
                        addresses.push(address);
                    }
                    Err(err) => {
                        for rail in &rails {
                            rail.engine.stop();
                        }
                        return Err(err);
                    }
                }
            }
        }
        let attrs = &rails[0].attrs;
        let flags = if attrs.virt_addr() { keys::FLAG_VIRT_ADDR } else { 0 };
        let conn_info = keys::ConnInfo {
            flags,
            max_notif: settings.max_notif_bytes as u32,
            chunk: settings.notif_chunk as u32,
            provider: attrs.provider.clone(),
            lanes: settings.lanes,
            addresses,
        }
        .encode();
        Ok(LibfabricBackend { agent_name, settings, rails, conn_info, stopped: AtomicBool::new(false) })
    }

    /// Opens one domain's endpoint and starts its engine; returns the rail and its address.
    fn open_rail(
        settings: &Settings,
        provider: Option<&str>,
        domain: Option<&str>,
        agent_name: &str,
        notifs: &xfer_core::NotifSink,
    ) -> Result<(Rail, Vec<u8>), BackendError> {
        // The domain is matched here too: rxm does not filter on the hints' domain name.
        let info = fabric::Info::choose(provider, domain, |all| {
            let fits: Vec<usize> = (0..all.len()).filter(|&i| domain.is_none_or(|d| all[i].domain == d)).collect();
            let names: Vec<String> = fits.iter().map(|&i| all[i].provider.clone()).collect();
            let pick = if provider.is_some() { (!names.is_empty()).then_some(0) } else { settings.pick(&names) };
            pick.map(|at| fits[at])
        })
        .map_err(|err| match domain {
            Some(d) => BackendError::Unsupported(format!("libfabric domain {d}: {err}")),
            None => unavailable(err),
        })?;
        let recv_len = settings.notif_chunk + msg::NOTIF_OVERHEAD + 2 * keys::MAX_FIELD;
        let ep = fabric::Endpoint::open(info, settings.recv_buffers, recv_len).map_err(unavailable)?;
        let attrs = ep.attrs().clone();
        let address = ep.name().map_err(unavailable)?;
        tracing::debug!(agent = %agent_name, provider = %attrs.provider, domain = %attrs.domain, mr_mode = attrs.mr_mode, prov_key = attrs.prov_key(), "libfabric rail started");
        let engine = engine::start(ep, agent_name.to_string(), address.clone(), settings.clone(), Arc::clone(notifs))?;
        Ok((Rail { attrs, engine: Arc::new(engine) }, address))
    }

    fn attrs(&self) -> &Attrs {
        &self.rails[0].attrs
    }

    /// The provider and rail 0's domain.
    pub fn provider(&self) -> (&str, &str) {
        (&self.attrs().provider, &self.attrs().domain)
    }

    /// Every rail's domain, rail 0 first (a domain once per lane).
    pub fn domains(&self) -> Vec<&str> {
        self.rails.iter().map(|r| r.attrs.domain.as_str()).collect()
    }

    /// The provider's `FI_MR_*` mode bits.
    pub fn mr_mode(&self) -> u32 {
        self.attrs().mr_mode
    }

    /// How many peer addresses each rail's AV holds (connected peers, and for a while peers
    /// whose notifications were acknowledged).
    pub fn av_peers(&self) -> Result<Vec<usize>, BackendError> {
        self.rails.iter().map(|rail| rail.engine.call(CALL_BOUND, Cmd::Peers)).collect()
    }

    fn deregister_rails(&self, region: u64, rails: &[Rail]) {
        let answers: Vec<_> = rails
            .iter()
            .filter_map(|rail| {
                let (reply, answer) = crossbeam_channel::bounded(1);
                rail.engine.send(Cmd::Deregister(region, reply)).then_some(answer)
            })
            .collect();
        for answer in answers {
            if answer.recv_timeout(CALL_BOUND).is_err() {
                tracing::warn!(region, "libfabric deregistration did not finish in time");
            }
        }
    }
}

impl Backend for LibfabricBackend {
    fn name(&self) -> &'static str {
        "libfabric"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { paths: vec![(MemType::Dram, MemType::Dram)], remote: true, local: false, notifications: true }
    }

    fn conn_info(&self) -> Vec<u8> {
        self.conn_info.clone()
    }

    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
        match region.mem_type() {
            MemType::Dram => {}
            MemType::Vram => {
                let why = if self.rails.iter().all(|r| r.attrs.hmem) {
                    "this backend does not register device memory (FI_HMEM) yet"
                } else {
                    "the provider has no FI_HMEM"
                };
                return Err(BackendError::Unsupported(format!(
                    "libfabric provider {} cannot take GPU memory: {why}",
                    self.attrs().provider
                )));
            }
            other => return Err(BackendError::MemoryNotMoved { backend: "libfabric", mem_type: other }),
        }
        let mut keys = Vec::with_capacity(self.rails.len());
        for (at, rail) in self.rails.iter().enumerate() {
            match rail.engine.call(CALL_BOUND, |reply| Cmd::Register(Arc::clone(region), reply)) {
                Ok(key) => keys.push(key),
                Err(err) => {
                    self.deregister_rails(region.id(), &self.rails[..at]);
                    return Err(err);
                }
            }
        }
        let desc = region.desc();
        Ok(FabricRemoteKey { keys, base: desc.addr, len: desc.len }.encode())
    }

    fn deregister(&self, region: &LocalRegion) {
        self.deregister_rails(region.id(), &self.rails);
    }

    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
        let info = keys::ConnInfo::decode(conn_info)?;
        if info.provider != self.attrs().provider {
            return Err(BackendError::Unsupported(format!(
                "connecting to {peer}: it uses libfabric provider {}, this side {}",
                info.provider,
                self.attrs().provider
            )));
        }
        // Lane l of domain d meets the peer's lane l of domain d; extra domains or lanes on
        // either side stay idle for this peer.
        let pairs = info.pairs(self.rails.len(), self.settings.lanes);
        let mut rails: Vec<PeerRail> = Vec::with_capacity(pairs.len());
        for (ours, theirs) in pairs {
            let rail = &self.rails[ours];
            match rail.engine.call(CALL_BOUND, |reply| Cmd::Connect(info.addresses[theirs].clone(), reply)) {
                Ok(at) => rails.push(PeerRail { engine: Arc::clone(&rail.engine), address: at, remote: theirs }),
                Err(err) => {
                    for connected in &rails {
                        connected.engine.send(Cmd::Disconnect(connected.address));
                    }
                    return Err(err);
                }
            }
        }
        let health = Mutex::new(RailHealth::new(rails.len(), self.settings.rail_retry));
        Ok(Arc::new(FabricPeer {
            rails: Arc::new(PeerRails {
                name: peer.to_string(),
                rails,
                health,
                chunk: info.chunk as usize,
                timeout: self.settings.timeout,
                failover: self.settings.failover,
                closed: AtomicBool::new(false),
            }),
            virt_addr: info.virt_addr(),
            max_notif: info.max_notif as usize,
            max_op_bytes: self.settings.max_op_bytes,
            notify_bound: self.settings.timeout + Duration::from_secs(1),
        }))
    }

    fn shutdown(&self) {
        if !self.stopped.swap(true, Ordering::AcqRel) {
            for rail in &self.rails {
                rail.engine.stop();
            }
        }
    }
}

impl Drop for LibfabricBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A connected peer: its AV entry on every rail both sides have, and how it addresses memory.
struct FabricPeer {
    rails: Arc<PeerRails>,
    virt_addr: bool,
    max_notif: usize,
    max_op_bytes: usize,
    notify_bound: Duration,
}

impl std::fmt::Debug for FabricPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addresses: Vec<u64> = self.rails.rails.iter().map(|r| r.address).collect();
        f.debug_struct("FabricPeer").field("peer", &self.rails.name).field("addresses", &addresses).finish()
    }
}

impl FabricPeer {
    fn disconnected(&self) -> BackendError {
        BackendError::PeerDisconnected { peer: self.rails.name.clone(), reason: "disconnected by the agent".into() }
    }

    fn check_notif(&self, message: &[u8]) -> Result<(), BackendError> {
        if message.len() > self.max_notif {
            return Err(BackendError::Unsupported(format!(
                "a notification of {} bytes: peer {} takes at most {}",
                message.len(),
                self.rails.name,
                self.max_notif
            )));
        }
        Ok(())
    }

    /// Runs a request: over the peer's one rail, or cut into shares over the rails usable
    /// now, which a [`Stripe`] moves off rails that fail.
    fn run(&self, job: TransferJob) -> Result<(), (BackendError, xfer_core::Completer)> {
        let TransferJob { op, local, remote, notif, done } = job;
        if let Some(message) = notif.as_deref() {
            if let Err(err) = self.check_notif(message) {
                return Err((err, done));
            }
        }
        let peer = &self.rails;
        let usable = if peer.rails.len() == 1 { vec![0] } else { peer.health.lock().usable(Instant::now()) };
        if usable.is_empty() {
            let err = peer.all_down(&BackendError::PeerDisconnected {
                peer: peer.name.clone(),
                reason: "no rail's retry time has come yet".into(),
            });
            return Err((err, done));
        }
        let mut shares = match self.shares(local, &remote, &usable) {
            Ok(shares) => shares,
            Err(err) => return Err((err, done)),
        };
        let op = match op {
            Op::Read => Rma::Read,
            Op::Write => Rma::Write,
        };
        if peer.rails.len() == 1 {
            let spans = shares.pop().map(|(_, spans)| spans).unwrap_or_default();
            peer.run_on(0, op, &spans, notif, peer.timeout, Finish::Request(done));
            return Ok(());
        }
        if shares.is_empty() {
            // No bytes: a share of none still carries the notification after it.
            shares.push((usable[0], Vec::new()));
        }
        Stripe::start(peer, op, shares, done, notif);
        Ok(())
    }

    /// Matches the local and remote byte streams into spans of at most `max_op_bytes`, cut
    /// into one share per rail in `usable` of about equal size (at least [`MIN_STRIPE`]
    /// bytes), consecutive bytes in the same share; shares with no bytes are left out.
    fn shares(
        &self,
        local: Vec<xfer_core::LocalMem>,
        remote: &[xfer_core::RemoteSeg],
        usable: &[usize],
    ) -> Result<Vec<(usize, Vec<Span>)>, BackendError> {
        let rails = usable.len();
        let total = remote.iter().fold(0u64, |sum, seg| sum.saturating_add(seg.len));
        let op_limit = if rails > 1 {
            (self.max_op_bytes as u64).min(total.div_ceil(rails as u64).max(MIN_STRIPE)) as usize
        } else {
            self.max_op_bytes
        };
        let mut locals = VecDeque::with_capacity(local.len());
        for mem in local {
            locals.push_back(mem.into_host("libfabric")?);
        }
        let needed = self.rails.rails.iter().map(|r| r.remote + 1).max().unwrap_or(1);
        let mut parts: Vec<Vec<Span>> = (0..rails).map(|_| Vec::new()).collect();
        let mut before = 0u64;
        for seg in remote {
            let key = seg
                .key
                .downcast_ref::<FabricRemoteKey>()
                .ok_or_else(|| BackendError::InvalidMetadata("a remote key that is not libfabric's".into()))?;
            if !key.covers(seg.addr, seg.len) {
                return Err(BackendError::Refused {
                    code: RefusalCode::OutOfBounds,
                    message: format!("{:#x}+{} is outside the peer's registration", seg.addr, seg.len),
                });
            }
            if key.keys.len() < needed {
                return Err(BackendError::InvalidMetadata(format!(
                    "a key for {} rails of peer {}, which has at least {needed}",
                    key.keys.len(),
                    self.rails.name,
                )));
            }
            let keys: Arc<[u64]> = key.keys.as_slice().into();
            let mut remote_at = if self.virt_addr { seg.addr } else { seg.addr - key.base };
            let mut left = seg.len;
            while left > 0 {
                while locals.front().is_some_and(|l| l.is_empty()) {
                    locals.pop_front();
                }
                let front = locals.front_mut().ok_or_else(|| {
                    BackendError::Protocol("the local descriptors hold fewer bytes than the remote".into())
                })?;
                let n = (left.min(front.len() as u64) as usize).min(op_limit);
                let slice = if n == front.len() {
                    locals.pop_front().ok_or_else(|| BackendError::Protocol("lost a local piece".into()))?
                } else {
                    front.split_front(n)
                };
                let share = ((u128::from(before) * rails as u128 / u128::from(total.max(1))) as usize).min(rails - 1);
                parts[share].push(Span { local: slice, remote: remote_at, keys: Arc::clone(&keys) });
                remote_at += n as u64;
                left -= n as u64;
                before += n as u64;
            }
        }
        if locals.iter().any(|l| !l.is_empty()) {
            return Err(BackendError::Protocol("the local descriptors hold more bytes than the remote".into()));
        }
        Ok(usable.iter().copied().zip(parts).filter(|(_, spans)| !spans.is_empty()).collect())
    }
}

impl RemoteAgent for FabricPeer {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        Ok(Arc::new(FabricRemoteKey::decode(public)?))
    }

    fn post(&self, job: TransferJob) {
        if self.rails.is_closed() {
            return job.done.complete(Err(self.disconnected()));
        }
        if let Err((err, done)) = self.run(job) {
            done.complete(Err(err));
        }
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        if self.rails.is_closed() {
            return Err(self.disconnected());
        }
        self.check_notif(message)?;
        let at = self.rails.health.lock().notify_rail(Instant::now());
        let rail = &self.rails.rails[at];
        rail.engine.call(self.notify_bound, |reply| Cmd::Notify {
            peer: rail.address,
            peer_name: self.rails.name.clone(),
            chunk: self.rails.chunk,
            message: message.to_vec(),
            reply,
        })
    }

    fn disconnect(&self) {
        if !self.rails.closed.swap(true, Ordering::AcqRel) {
            for rail in &self.rails.rails {
                rail.engine.send(Cmd::Disconnect(rail.address));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use xfer_core::{BackendParams, HostStaging};

    fn backend(params: &str) -> Result<LibfabricBackend, BackendError> {
        LibfabricBackend::new(BackendContext {
            agent_name: "unit".into(),
            params: BackendParams::parse(params)?,
            notifs: Arc::new(|_: &str, _: Vec<u8>| {}),
            staging: Arc::new(HostStaging::new("no GPU in unit tests")),
            credential: None,
        })
    }

    #[test]
    fn lists_providers_and_picks_tcp_by_default_here() {
        let all = providers(None).expect("fi_getinfo");
        assert!(all.iter().any(|p| p.provider == "tcp;ofi_rxm"), "{all:?}");
        let b = backend("").expect("default provider");
        // Debian's libfabric offers nothing better than tcp;ofi_rxm on these machines.
        assert!(config::PREFERENCE.contains(&b.provider().0), "{:?}", b.provider());
        let b = backend("provider=tcp;ofi_rxm,domain=lo").expect("tcp on lo");
        assert_eq!(b.provider(), ("tcp;ofi_rxm", "lo"));
        let caps = b.capabilities();
        assert!(caps.moves(MemType::Dram, MemType::Dram) && !caps.supports(MemType::Vram));
        let info = keys::ConnInfo::decode(&b.conn_info()).expect("own conn info");
        assert_eq!(info.provider, "tcp;ofi_rxm");
        assert_eq!((info.lanes, info.addresses.len()), (config::DEFAULT_LANES, config::DEFAULT_LANES));
        assert!(info.addresses.iter().all(|a| !a.is_empty()));
    }

    #[test]
    fn refuses_bad_parameters_and_missing_providers() {
        assert!(matches!(backend("provider=no-such-provider"), Err(BackendError::Unsupported(_))));
        assert!(matches!(backend("timeout_ms=soon"), Err(BackendError::InvalidParam { .. })));
    }

    #[test]
    fn connect_refuses_garbage_and_other_providers() {
        let b = backend("provider=tcp;ofi_rxm,domain=lo").expect("backend");
        assert!(matches!(b.connect("p", b"nonsense"), Err(BackendError::InvalidMetadata(_))));
        let mut other = keys::ConnInfo::decode(&b.conn_info()).expect("decode");
        other.provider = "efa".into();
        assert!(matches!(b.connect("p", &other.encode()), Err(BackendError::Unsupported(_))));
        let peer = b.connect("self", &b.conn_info()).expect("connect to own address");
        assert!(peer.unpack_key(b"junk").is_err());
        b.shutdown();
    }

    #[test]
    fn av_keeps_only_connected_peers() {
        let a = backend("provider=tcp;ofi_rxm,domain=lo").expect("backend a");
        let b = backend("provider=tcp;ofi_rxm,domain=lo").expect("backend b");
        // One AV per rail (every lane); each holds the peer once.
        let (none, one) = (vec![0; a.rails.len()], vec![1; a.rails.len()]);
        assert_eq!(a.av_peers().unwrap(), none);
        let first = a.connect("b", &b.conn_info()).expect("connect");
        let second = a.connect("b", &b.conn_info()).expect("connect again (a metadata reload)");
        assert_eq!(a.av_peers().unwrap(), one, "one entry per address");
        first.disconnect();
        assert_eq!(a.av_peers().unwrap(), one, "still used by the second connection");
        second.disconnect();
        assert_eq!(a.av_peers().unwrap(), none, "the last disconnection removes the address");
        assert!(matches!(second.notify(b"late"), Err(BackendError::PeerDisconnected { .. })));
        let again = a.connect("b", &b.conn_info()).expect("reconnect");
        assert_eq!(a.av_peers().unwrap(), one);
        again.notify(b"after reconnecting").expect("a notification after reconnecting");
        again.disconnect();
        assert_eq!(a.av_peers().unwrap(), none);
    }

    #[test]
    fn lanes_open_one_endpoint_each_and_pair_with_fewer() {
        let a = backend("provider=tcp;ofi_rxm,domain=lo,lanes=3").expect("three lanes");
        let b = backend("provider=tcp;ofi_rxm,domain=lo,lanes=2").expect("two lanes");
        assert_eq!(a.domains(), ["lo", "lo", "lo"]);
        let info = keys::ConnInfo::decode(&a.conn_info()).expect("own conn info");
        assert_eq!((info.lanes, info.addresses.len()), (3, 3));
        let distinct: std::collections::HashSet<&Vec<u8>> = info.addresses.iter().collect();
        assert_eq!(distinct.len(), 3, "every lane has its own endpoint address");
        let peer = a.connect("b", &b.conn_info()).expect("connect three lanes to two");
        assert_eq!(a.av_peers().unwrap(), [1, 1, 0], "the third lane stays idle for a two-lane peer");
        peer.disconnect();
        assert_eq!(a.av_peers().unwrap(), [0, 0, 0]);
        assert!(matches!(backend("lanes=0"), Err(BackendError::InvalidParam { .. })));
    }
}
