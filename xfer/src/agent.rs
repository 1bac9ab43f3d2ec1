//! The agent: backends, registrations, peers, requests and notifications.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use xfer_core::credential::{ClusterCredential, SECRET_FILE_ENV};
use xfer_core::{
    Backend, BackendBuffer, BackendContext, BackendParams, Capabilities, Desc, HostMemory, LocalRegion, MemType,
    NotifSink, Op, RefusalCode, RemoteSeg, Staging,
};

use crate::error::{Side, XferError};
use crate::grant::{Grant, GrantEntry, GrantToken};
use crate::grant_offer::{next_claim_attempt, Claim, GrantOffer, OfferTable};
use crate::metadata::{AgentMetadata, BackendInfo, RegionInfo};
use crate::notifs::NotifQueues;
use crate::prepared::{pick, PreparedLocal, PreparedRemote};
use crate::registry::BackendRegistry;
use crate::request::{RequestOptions, XferRequest};
use crate::side_channel::{self, ClientAuth, SideChannelError, SideOp};
use crate::tables::{LocalEntry, LocalTable, Peer, PeerLink, PeerRegion, Slot};

/// A backend attached to the agent.
struct Attached {
    name: &'static str,
    backend: Arc<dyn Backend>,
    caps: Capabilities,
}

pub(crate) struct AgentInner {
    name: String,
    registry: BackendRegistry,
    /// Copy lanes handed to every backend for memory its wire cannot address.
    staging: Arc<dyn Staging>,
    /// Attach order is preference order; a slot index never changes.
    backends: ArcSwap<Vec<Arc<Attached>>>,
    local: ArcSwap<LocalTable>,
    peers: ArcSwap<HashMap<String, Arc<Peer>>>,
    /// Serialises writers of the tables above; readers never take it.
    writer: Mutex<()>,
    notifs: Arc<NotifQueues>,
    next_region_id: AtomicU64,
    side_channel: Mutex<Option<side_channel::Server>>,
    /// The cluster credential: signs our metadata, authenticates side-channel and data
    /// connections. `None`: unauthenticated, as before credentials existed.
    credential: Option<Arc<ClusterCredential>>,
    /// This agent as its own peer (the local-peer shortcut), built from its own metadata on
    /// first use after each change of backends or registrations.
    own: Mutex<OwnPeer>,
    /// Grants offered under a name for a peer to claim over the side channel.
    offers: Arc<OfferTable>,
}

/// The cached self-peer and the table generation it was built from.
#[derive(Default)]
struct OwnPeer {
    peer: Option<Arc<Peer>>,
    built_at: u64,
    /// Bumped by every change of backends or registrations.
    generation: u64,
}

/// A transfer agent. Cheap to clone; `Send + Sync`; the data path takes no agent-wide lock
/// (tables are read through atomically swapped snapshots).
#[derive(Clone)]
pub struct Agent {
    inner: Arc<AgentInner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &self.inner.name).finish_non_exhaustive()
    }
}

/// Registered memory. Dropping it deregisters the memory, waiting for transfers that still use
/// it; only then may the memory be freed.
pub struct Registration {
    agent: Arc<AgentInner>,
    entries: Vec<Arc<LocalEntry>>,
    /// What keeps the registered memory (a `HostMemory`) or file (an open `File`) alive.
    _owner: Option<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("descs", &self.descs()).finish_non_exhaustive()
    }
}

impl Registration {
    pub fn descs(&self) -> Vec<Desc> {
        self.entries.iter().map(|e| e.region.desc()).collect()
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.agent.deregister(&self.entries);
    }
}

/// Memory a backend allocated ([`Agent::allocate`]), registered with every backend of the
/// agent. Dropping the registration deregisters it; the memory is released once the buffer's
/// last `Arc` is gone too.
#[derive(Debug)]
pub struct Allocation {
    pub buffer: Arc<BackendBuffer>,
    pub registration: Registration,
}

const NAME_LIMIT: usize = 255;

impl Agent {
    /// An agent with the default backend registry (TCP always available). No backend is
    /// attached yet: call [`add_backend`](Agent::add_backend).
    pub fn new(name: &str) -> Result<Agent, XferError> {
        Self::with_registry(name, BackendRegistry::default())
    }

    pub fn with_registry(name: &str, registry: BackendRegistry) -> Result<Agent, XferError> {
        Self::with_staging(name, registry, xfer_cuda::staging())
    }

    /// An agent whose backends stage GPU memory and files through `staging` instead of CUDA's
    /// (tests stand host memory in for a GPU this way).
    /// The cluster credential comes from the file named by `XFER_CLUSTER_SECRET_FILE` when that
    /// is set (see [`with_credential`](Agent::with_credential)).
    pub fn with_staging(name: &str, registry: BackendRegistry, staging: Arc<dyn Staging>) -> Result<Agent, XferError> {
        let credential = ClusterCredential::from_env()?;
        Self::with_credential(name, registry, staging, credential)
    }

    /// An agent with an explicit cluster credential (`None`: unauthenticated, with a warning).
    /// With one, the agent signs its metadata, answers and makes side-channel requests only
    /// after a challenge-response, accepts only signed metadata, and its backends authenticate
    /// their data connections. Peers must all hold the same secret.
    pub fn with_credential(
        name: &str,
        registry: BackendRegistry,
        staging: Arc<dyn Staging>,
        credential: Option<ClusterCredential>,
    ) -> Result<Agent, XferError> {
        if name.is_empty() || name.len() > NAME_LIMIT {
            return Err(XferError::InvalidArgument(format!("agent name must be 1..={NAME_LIMIT} bytes")));
        }
        if credential.is_none() {
            tracing::warn!(
                agent = name,
                "no cluster credential ({SECRET_FILE_ENV} unset): side channel and data connections are unauthenticated"
            );
        }
        Ok(Agent {
            inner: Arc::new(AgentInner {
                name: name.to_string(),
                registry,
                staging,
                backends: ArcSwap::from_pointee(Vec::new()),
                local: ArcSwap::from_pointee(LocalTable::default()),
                peers: ArcSwap::from_pointee(HashMap::new()),
                writer: Mutex::new(()),
                notifs: Arc::new(NotifQueues::default()),
                next_region_id: AtomicU64::new(1),
                side_channel: Mutex::new(None),
                credential: credential.map(Arc::new),
                own: Mutex::new(OwnPeer::default()),
                offers: Arc::new(OfferTable::default()),
            }),
        })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Attaches a backend by name with its parameters (unknown keys are an error).
    pub fn add_backend(&self, name: &str, params: BackendParams) -> Result<(), XferError> {
        let inner = &self.inner;
        let _writer = inner.writer.lock();
        if inner.backends.load().iter().any(|b| b.name == name) {
            return Err(XferError::BackendExists(name.to_string()));
        }
        let factory = inner.registry.get(name).ok_or_else(|| XferError::UnknownBackend(name.to_string()))?;
        let queues: Weak<NotifQueues> = Arc::downgrade(&inner.notifs);
        let notifs: NotifSink = Arc::new(move |peer: &str, message: Vec<u8>| {
            if let Some(queues) = queues.upgrade() {
                queues.push(peer, message);
            }
        });
        let ctx = BackendContext {
            agent_name: inner.name.clone(),
            params,
            notifs,
            staging: Arc::clone(&inner.staging),
            credential: inner.credential.clone(),
        };
        let backend = factory.create(ctx).map_err(|e| XferError::backend(name, e))?;
        let attached = Arc::new(Attached { name: factory.name(), caps: backend.capabilities(), backend });
        let mut backends = inner.backends.load().as_ref().clone();
        backends.push(attached);
        inner.backends.store(Arc::new(backends));
        inner.own.lock().generation += 1;
        Ok(())
    }

    /// Names of the attached backends, in preference order.
    pub fn backends(&self) -> Vec<&'static str> {
        self.inner.backends.load().iter().map(|b| b.name).collect()
    }

    /// Registers memory with every attached backend that supports its type.
    ///
    /// # Safety
    /// Each descriptor must describe memory of this process (for DRAM: readable and writable
    /// host memory) that stays valid until the returned [`Registration`] is dropped. Remote
    /// peers may read and write it at any time while registered.
    pub unsafe fn register_memory(&self, mem_type: MemType, descs: &[Desc]) -> Result<Registration, XferError> {
        // SAFETY: forwarded from this function's contract.
        unsafe { self.inner.register(mem_type, descs, None) }
    }

    /// Registers host memory (a `HostBuffer`, a `SharedFile`); the registration keeps it alive.
    pub fn register_buffer<M: HostMemory>(&self, memory: &Arc<M>) -> Result<Registration, XferError> {
        let owner: Arc<dyn Any + Send + Sync> = Arc::clone(memory) as Arc<dyn Any + Send + Sync>;
        // SAFETY: the registration holds an `Arc` of the memory, so it outlives the registration;
        // `HostMemory` types own their bytes and only hand out copies (the trait's contract).
        unsafe { self.inner.register(MemType::Dram, &[memory.desc()], Some(owner)) }
    }

    /// Registers a device buffer allocated here (`xfer::cuda::DeviceBuffer`) as VRAM; the
    /// registration holds the buffer, so it is freed only after deregistration. GPU memory from
    /// elsewhere (a torch tensor) goes through `unsafe` [`register_memory`](Agent::register_memory).
    pub fn register_device_buffer(&self, buffer: &Arc<xfer_cuda::DeviceBuffer>) -> Result<Registration, XferError> {
        let desc = Desc::new(buffer.ptr(), buffer.len() as u64, buffer.device());
        let owner: Arc<dyn Any + Send + Sync> = Arc::clone(buffer) as Arc<dyn Any + Send + Sync>;
        // SAFETY: the descriptor is exactly the device allocation, which the registration keeps
        // alive (it holds the `Arc`); the CPU never dereferences VRAM.
        unsafe { self.inner.register(MemType::Vram, &[desc], Some(owner)) }
    }

    /// Registers `len` bytes of an open file from `offset` as FILE memory: the descriptor is
    /// `(offset, len, file descriptor)` (see [`MemType::File`]); it is also in
    /// [`Registration::descs`]. The registration keeps the file open, so its descriptor number
    /// cannot be reused for another file meanwhile. Moved by backends whose capabilities name
    /// FILE (`posix`), between this agent's DRAM and the file: name this agent as the peer.
    pub fn register_file(&self, file: &Arc<File>, offset: u64, len: u64) -> Result<Registration, XferError> {
        let fd = u64::try_from(file.as_raw_fd()).map_err(|_| XferError::InvalidArgument("negative fd".into()))?;
        let owner: Arc<dyn Any + Send + Sync> = Arc::clone(file) as Arc<dyn Any + Send + Sync>;
        // SAFETY: FILE descriptors name no memory of this process: backends reach the file only
        // through its descriptor, which the registration keeps open (it holds the `File`).
        unsafe { self.inner.register(MemType::File, &[Desc::new(offset, len, fd)], Some(owner)) }
    }

    /// Allocates `len` bytes of host memory through the first attached backend that allocates
    /// (UCX does: shared-memory segments that peers on this host map, so their puts and gets
    /// are copies; TCP does not) and registers it with every backend, as
    /// [`register_buffer`](Agent::register_buffer) does. No fallback to a [`HostBuffer`]
    /// (`xfer_core::HostBuffer`): when no backend allocates, this fails with
    /// [`XferError::NoBackend`], and the caller chooses what ordinary memory to use instead.
    ///
    /// [`HostBuffer`]: xfer_core::HostBuffer
    pub fn allocate(&self, len: usize) -> Result<Allocation, XferError> {
        if len == 0 {
            return Err(XferError::InvalidArgument("cannot allocate 0 bytes".into()));
        }
        let backends = self.inner.backends.load();
        let mut reasons = Vec::new();
        for attached in backends.iter() {
            match attached.backend.allocate(len, MemType::Dram) {
                None => reasons.push(format!("{} does not allocate", attached.name)),
                Some(Err(err)) => {
                    tracing::warn!(backend = attached.name, %err, len, "backend allocation failed");
                    reasons.push(format!("{}: {err}", attached.name));
                }
                Some(Ok(buffer)) => {
                    let buffer = Arc::new(buffer);
                    let registration = self.register_buffer(&buffer)?;
                    return Ok(Allocation { buffer, registration });
                }
            }
        }
        if reasons.is_empty() {
            reasons.push("no backend attached".into());
        }
        Err(XferError::NoBackend(format!("no backend allocates {len} bytes of DRAM: {}", reasons.join("; "))))
    }

    /// This agent's metadata blob: name, backends' connection info, registrations' keys.
    /// Signed when the agent has a cluster credential.
    pub fn local_metadata(&self) -> Vec<u8> {
        self.inner.local_blob()
    }

    /// Loads (or reloads) a peer's metadata blob; returns the peer's name.
    pub fn load_remote_metadata(&self, blob: &[u8]) -> Result<String, XferError> {
        self.inner.load_remote(blob)
    }

    /// Forgets a peer: later requests to it fail with `UnknownPeer`; its connections close.
    pub fn invalidate_remote(&self, name: &str) -> Result<(), XferError> {
        self.inner.invalidate(name)
    }

    /// Names of the loaded peers.
    pub fn peers(&self) -> Vec<String> {
        self.inner.peers.load().keys().cloned().collect()
    }

    /// The regions a peer published.
    pub fn remote_regions(&self, peer: &str) -> Result<Vec<(MemType, Desc)>, XferError> {
        let peer = self.inner.peer(peer)?;
        Ok(peer.metadata.regions.iter().map(|r| (r.mem_type, r.desc)).collect())
    }

    /// Serves this agent's metadata on `addr` (e.g. `0.0.0.0:5600`); returns the bound address.
    pub fn start_side_channel(&self, addr: &str) -> Result<SocketAddr, XferError> {
        let handler: Arc<dyn side_channel::Handler> = Arc::new(SideChannelHandler(Arc::downgrade(&self.inner)));
        let auth = self.inner.credential.as_ref().map(|credential| side_channel::ServerAuth {
            credential: Arc::clone(credential),
            name: self.inner.name.clone(),
        });
        let server = side_channel::Server::start(addr, handler, auth)
            .map_err(|e| XferError::SideChannel { addr: addr.to_string(), source: e.into() })?;
        let bound = server.addr();
        *self.inner.side_channel.lock() = Some(server);
        Ok(bound)
    }

    /// Fetches and loads a peer's metadata from its side channel; returns the peer's name.
    pub fn fetch_remote_metadata(&self, addr: &str) -> Result<String, XferError> {
        let blob = side_channel::call_as(addr, SideOp::Get, &[], side_channel::IO_TIMEOUT, self.inner.client_auth())
            .map_err(|source| XferError::SideChannel { addr: addr.to_string(), source })?;
        self.load_remote_metadata(&blob)
    }

    /// Pushes this agent's metadata to a peer's side channel (the peer loads it).
    pub fn send_local_metadata(&self, addr: &str) -> Result<(), XferError> {
        side_channel::call_as(
            addr,
            SideOp::Put,
            &self.local_metadata(),
            side_channel::IO_TIMEOUT,
            self.inner.client_auth(),
        )
        .map(drop)
        .map_err(|source| XferError::SideChannel { addr: addr.to_string(), source })
    }

    /// Tells a peer's side channel to forget this agent.
    pub fn invalidate_local_metadata(&self, addr: &str) -> Result<(), XferError> {
        side_channel::call_as(
            addr,
            SideOp::Invalidate,
            self.inner.name.as_bytes(),
            side_channel::IO_TIMEOUT,
            self.inner.client_auth(),
        )
        .map(drop)
        .map_err(|source| XferError::SideChannel { addr: addr.to_string(), source })
    }

    /// Resolves local descriptors once for repeated use by index.
    pub fn prep_local(&self, mem_type: MemType, descs: &[Desc]) -> Result<PreparedLocal, XferError> {
        PreparedLocal::resolve(&self.inner.local.load(), mem_type, descs)
    }

    /// Resolves a peer's descriptors once for repeated use by index.
    /// A descriptor inside a grant loaded from the peer ([`Agent::load_grant`]) goes through
    /// the newest such grant.
    pub fn prep_remote(&self, peer: &str, mem_type: MemType, descs: &[Desc]) -> Result<PreparedRemote, XferError> {
        PreparedRemote::resolve(self.inner.peer(peer)?, mem_type, descs, true)
    }

    /// As [`Agent::prep_remote`], but through the peer's published regions only, whatever
    /// grants are loaded: for reads the peer serves without a grant, of memory this agent may
    /// also read under grants (which the peer revokes when it is done with them).
    pub fn prep_remote_published(
        &self,
        peer: &str,
        mem_type: MemType,
        descs: &[Desc],
    ) -> Result<PreparedRemote, XferError> {
        PreparedRemote::resolve(self.inner.peer(peer)?, mem_type, descs, false)
    }

    /// A request between host-memory descriptor lists of equal total length.
    pub fn create_request(
        &self,
        op: Op,
        local: &[Desc],
        peer: &str,
        remote: &[Desc],
        options: RequestOptions,
    ) -> Result<XferRequest, XferError> {
        let local = self.prep_local(MemType::Dram, local)?;
        let remote = self.prep_remote(peer, MemType::Dram, remote)?;
        self.inner.make_request(op, &local, None, &remote, None, options)
    }

    /// A request between descriptor lists of the given memory types, e.g. DRAM → FILE through
    /// `posix` with this agent as the peer (`create_request` is the DRAM↔DRAM case).
    pub fn create_request_between(
        &self,
        op: Op,
        local: (MemType, &[Desc]),
        peer: &str,
        remote: (MemType, &[Desc]),
        options: RequestOptions,
    ) -> Result<XferRequest, XferError> {
        let local = self.prep_local(local.0, local.1)?;
        let remote = self.prep_remote(peer, remote.0, remote.1)?;
        self.inner.make_request(op, &local, None, &remote, None, options)
    }

    /// A request from prepared lists and index lists (e.g. KV block ids).
    pub fn make_request(
        &self,
        op: Op,
        local: &PreparedLocal,
        local_indices: &[usize],
        remote: &PreparedRemote,
        remote_indices: &[usize],
        options: RequestOptions,
    ) -> Result<XferRequest, XferError> {
        self.inner.make_request(op, local, Some(local_indices), remote, Some(remote_indices), options)
    }

    /// Sends a standalone notification to a peer (in order with earlier ones to that peer).
    pub fn send_notif(&self, peer: &str, message: &[u8]) -> Result<(), XferError> {
        let peer = self.inner.peer(peer)?;
        let backends = self.inner.backends.load();
        let (attached, link) = peer
            .links
            .iter()
            .filter_map(|link| backends.get(link.slot).map(|b| (b, link)))
            .find(|(b, _)| b.caps.notifications)
            .ok_or_else(|| XferError::NoBackend(format!("no common backend with notifications to {}", peer.name)))?;
        link.remote.notify(message).map_err(|e| XferError::backend(attached.name, e))
    }

    /// Opens now what the first transfer to `peer` would open (the backends' connections and
    /// their handshakes: TLS, authentication), through every backend both agents have, or only
    /// `backend`: a peer that cannot be reached or refuses this agent fails here rather than
    /// in its first transfer, which then starts on an open connection (NIXL's
    /// `makeConnection`). What each backend opens is in its docs; one that opens nothing ahead
    /// of a transfer does nothing. A connection already open counts as it is: a peer that died
    /// since is noticed by the next transfer, as without this call.
    pub fn make_connection(&self, peer: &str, backend: Option<&str>) -> Result<(), XferError> {
        let peer = self.inner.peer(peer)?;
        let backends = self.inner.backends.load();
        let mut common = 0;
        for (attached, link) in peer.links.iter().filter_map(|link| backends.get(link.slot).map(|b| (b, link))) {
            if backend.is_some_and(|name| name != attached.name) {
                continue;
            }
            common += 1;
            link.remote.connect_now().map_err(|e| XferError::backend(attached.name, e))?;
        }
        if common == 0 {
            let which = backend.map_or_else(|| "no common backend".to_string(), |name| format!("no backend {name}"));
            return Err(XferError::NoBackend(format!("{which} to {}", peer.name)));
        }
        Ok(())
    }

    /// Drains every received notification, per sending agent, in arrival order.
    pub fn get_notifs(&self) -> HashMap<String, Vec<Vec<u8>>> {
        self.inner.notifs.drain_all()
    }

    /// Drains the notifications received from one agent.
    pub fn get_notifs_from(&self, peer: &str) -> Vec<Vec<u8>> {
        self.inner.notifs.drain_from(peer)
    }

    /// Waits until at least one notification is queued; `false` on timeout.
    pub fn wait_notifs(&self, timeout: Duration) -> bool {
        self.inner.notifs.wait_any(timeout)
    }
}

impl AgentInner {
    /// A loaded peer; this agent's own name needs no loading (the local-peer shortcut: requests
    /// to itself, e.g. DRAM↔FILE through `posix`, resolve against its own registrations).
    /// Loaded metadata under our own name wins, so NIXL's habit of loading one's own blob
    /// works the same.
    fn peer(&self, name: &str) -> Result<Arc<Peer>, XferError> {
        if let Some(peer) = self.peers.load().get(name) {
            return Ok(Arc::clone(peer));
        }
        if name == self.name {
            return self.own_peer();
        }
        Err(XferError::UnknownPeer(name.to_string()))
    }

    /// This agent as a peer, rebuilt from its current metadata when backends or registrations
    /// changed since the last build (links whose connection info is unchanged are kept).
    fn own_peer(&self) -> Result<Arc<Peer>, XferError> {
        let mut own = self.own.lock();
        if let Some(peer) = own.peer.as_ref().filter(|_| own.built_at == own.generation) {
            return Ok(Arc::clone(peer));
        }
        let generation = own.generation;
        let previous = own.peer.take();
        let peer = Arc::new(self.build_peer(self.metadata(), previous.as_ref())?);
        if let Some(previous) = previous {
            disconnect_unused(&previous, &peer);
        }
        own.peer = Some(Arc::clone(&peer));
        own.built_at = generation;
        Ok(peer)
    }

    /// # Safety
    /// See [`Agent::register_memory`].
    unsafe fn register(
        self: &Arc<Self>,
        mem_type: MemType,
        descs: &[Desc],
        owner: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Registration, XferError> {
        if descs.is_empty() {
            return Err(XferError::InvalidArgument("empty descriptor list".into()));
        }
        let _writer = self.writer.lock();
        let backends = self.backends.load();
        let capable: Vec<Slot> = (0..backends.len()).filter(|&slot| backends[slot].caps.supports(mem_type)).collect();
        if capable.is_empty() {
            return Err(XferError::NoBackend(format!("no attached backend supports {mem_type} memory")));
        }
        let table = self.local.load();
        let mut entries: Vec<Arc<LocalEntry>> = Vec::with_capacity(descs.len());
        for (index, desc) in descs.iter().enumerate() {
            let overlaps_new = entries.iter().any(|e| e.region.desc().overlaps(desc));
            let created = if desc.len == 0 || desc.end().is_none() || overlaps_new || table.overlaps(mem_type, desc) {
                Err(XferError::InvalidArgument(format!(
                    "descriptor {index} ({:#x}+{}) is empty, wraps, or overlaps a registration",
                    desc.addr, desc.len
                )))
            } else {
                // SAFETY: forwarded from this function's contract.
                unsafe { self.register_one(&backends, &capable, mem_type, desc) }
            };
            match created {
                Ok(entry) => entries.push(entry),
                Err(err) => {
                    drop(_writer);
                    self.deregister(&entries);
                    return Err(err);
                }
            }
        }
        self.local.store(Arc::new(table.with_added(&entries)));
        self.own.lock().generation += 1;
        Ok(Registration { agent: Arc::clone(self), entries, _owner: owner })
    }

    /// Registers one region with every capable backend, undoing partial work on failure.
    ///
    /// # Safety
    /// See [`Agent::register_memory`].
    unsafe fn register_one(
        &self,
        backends: &[Arc<Attached>],
        capable: &[Slot],
        mem_type: MemType,
        desc: &Desc,
    ) -> Result<Arc<LocalEntry>, XferError> {
        let id = self.next_region_id.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded from this function's contract.
        let region = Arc::new(unsafe { LocalRegion::new(id, mem_type, *desc) });
        let mut keys = Vec::with_capacity(capable.len());
        for &slot in capable {
            match backends[slot].backend.register(&region) {
                Ok(key) => keys.push((slot, key)),
                Err(err) => {
                    for (slot, _) in &keys {
                        backends[*slot].backend.deregister(&region);
                    }
                    return Err(XferError::backend(backends[slot].name, err));
                }
            }
        }
        Ok(Arc::new(LocalEntry { region, keys }))
    }

    fn deregister(&self, entries: &[Arc<LocalEntry>]) {
        if entries.is_empty() {
            return;
        }
        {
            let _writer = self.writer.lock();
            let ids: Vec<u64> = entries.iter().map(|e| e.region.id()).collect();
            let table = self.local.load().without(&ids);
            self.local.store(Arc::new(table));
            self.own.lock().generation += 1;
        }
        let backends = self.backends.load();
        for entry in entries {
            while !entry.region.close_and_wait(Duration::from_secs(10)) {
                tracing::warn!(
                    agent = %self.name,
                    users = entry.region.users(),
                    "deregistration waits for transfers still using the memory"
                );
            }
            for (slot, _) in &entry.keys {
                backends[*slot].backend.deregister(&entry.region);
            }
        }
    }

    fn metadata(&self) -> AgentMetadata {
        let backends = self.backends.load();
        let local = self.local.load();
        AgentMetadata {
            name: self.name.clone(),
            backends: backends
                .iter()
                .map(|b| BackendInfo { name: b.name.to_string(), conn_info: b.backend.conn_info() })
                .collect(),
            regions: local
                .entries()
                .iter()
                .map(|e| RegionInfo {
                    mem_type: e.region.mem_type(),
                    desc: e.region.desc(),
                    keys: e.keys.iter().map(|(slot, key)| (*slot as u16, key.clone())).collect(),
                })
                .collect(),
        }
    }

    fn local_blob(&self) -> Vec<u8> {
        self.metadata().encode_for(self.credential.as_deref())
    }

    fn client_auth(&self) -> Option<ClientAuth<'_>> {
        self.credential.as_deref().map(|credential| ClientAuth { credential, name: &self.name })
    }

    fn load_remote(&self, blob: &[u8]) -> Result<String, XferError> {
        self.load_decoded(AgentMetadata::decode_for(blob, self.credential.as_deref())?)
    }

    fn load_decoded(&self, md: AgentMetadata) -> Result<String, XferError> {
        let _writer = self.writer.lock();
        let previous = self.peers.load().get(&md.name).cloned();
        let name = md.name.clone();
        let peer = Arc::new(self.build_peer(md, previous.as_ref())?);
        let mut peers = self.peers.load().as_ref().clone();
        peers.insert(name.clone(), Arc::clone(&peer));
        self.peers.store(Arc::new(peers));
        if let Some(previous) = previous {
            disconnect_unused(&previous, &peer);
        }
        Ok(name)
    }

    /// Connects our backends to a peer described by `md` (reusing `previous`'s links whose
    /// connection info is unchanged) and unpacks its keys.
    fn build_peer(&self, md: AgentMetadata, previous: Option<&Arc<Peer>>) -> Result<Peer, XferError> {
        let backends = self.backends.load();
        let mut links = Vec::new();
        // remote backend index -> our slot
        let mut slot_of: Vec<Option<Slot>> = vec![None; md.backends.len()];
        for (remote_index, info) in md.backends.iter().enumerate() {
            let Some(slot) = backends.iter().position(|b| b.name == info.name) else { continue };
            // Backends that only move data within this agent (posix) skip other peers quietly,
            // and remote-only ones skip this agent.
            let to_self = md.name == self.name;
            let caps = &backends[slot].caps;
            if to_self && !caps.local || !to_self && !caps.remote {
                continue;
            }
            let reused = previous
                .and_then(|p| p.link(slot))
                .filter(|l| l.conn_info == info.conn_info)
                .map(|l| Arc::clone(&l.remote));
            let remote = match reused {
                Some(remote) => remote,
                None => match backends[slot].backend.connect(&md.name, &info.conn_info) {
                    Ok(remote) => remote,
                    Err(err) => {
                        tracing::warn!(peer = %md.name, backend = %info.name, %err, "cannot use backend for peer");
                        continue;
                    }
                },
            };
            slot_of[remote_index] = Some(slot);
            links.push(PeerLink { slot, conn_info: info.conn_info.clone(), remote });
        }
        let mut regions = Vec::with_capacity(md.regions.len());
        for region in &md.regions {
            let mut keys = Vec::new();
            for (remote_index, key) in &region.keys {
                let Some(slot) = slot_of.get(usize::from(*remote_index)).copied().flatten() else { continue };
                let link = links.iter().find(|l| l.slot == slot).expect("link exists for mapped slot");
                let unpacked = link.remote.unpack_key(key).map_err(|e| XferError::backend(backends[slot].name, e))?;
                keys.push((slot, unpacked));
            }
            regions.push(PeerRegion { mem_type: region.mem_type, desc: region.desc, keys });
        }
        Ok(Peer::new(md.name.clone(), md, links, regions, Vec::new()))
    }

    fn invalidate(&self, name: &str) -> Result<(), XferError> {
        let removed = {
            let _writer = self.writer.lock();
            let mut peers = self.peers.load().as_ref().clone();
            let removed = peers.remove(name).ok_or_else(|| XferError::UnknownPeer(name.to_string()))?;
            self.peers.store(Arc::new(peers));
            removed
        };
        for link in &removed.links {
            link.remote.disconnect();
        }
        Ok(())
    }

    fn make_request(
        &self,
        op: Op,
        local: &PreparedLocal,
        local_indices: Option<&[usize]>,
        remote: &PreparedRemote,
        remote_indices: Option<&[usize]>,
        options: RequestOptions,
    ) -> Result<XferRequest, XferError> {
        let local_segs = pick(&local.segs, local_indices, Side::Local)?;
        let remote_refs = pick(&remote.segs, remote_indices, Side::Remote)?;
        if local_segs.is_empty() || remote_refs.is_empty() {
            return Err(XferError::InvalidArgument("empty descriptor list".into()));
        }
        let local_bytes: u64 = local_segs.iter().map(|s| s.len).sum();
        let remote_bytes: u64 = remote_refs.iter().map(|s| s.len).sum();
        if local_bytes != remote_bytes {
            return Err(XferError::LengthMismatch { local: local_bytes, remote: remote_bytes });
        }
        let peer = &remote.peer;
        let backends = self.backends.load();
        let slot = self.choose_backend(&backends, local, &local_segs, remote, &remote_refs, &options)?;
        let link = peer.link(slot).expect("chosen backend has a link");
        let remote_segs: Vec<RemoteSeg> = remote_refs
            .iter()
            .map(|r| RemoteSeg {
                key: Arc::clone(peer.regions[r.region].key(slot).expect("chosen backend has every key")),
                addr: r.addr,
                len: r.len,
            })
            .collect();
        Ok(XferRequest::new(
            op,
            backends[slot].name,
            Arc::clone(&link.remote),
            local_segs,
            remote_segs,
            options.notif,
            local_bytes,
            Arc::clone(peer),
        ))
    }

    /// The first backend (in attach order, or the named one) that can serve every descriptor
    /// of the request on both sides.
    fn choose_backend(
        &self,
        backends: &[Arc<Attached>],
        local: &PreparedLocal,
        local_segs: &[crate::prepared::LocalSeg],
        remote: &PreparedRemote,
        remote_refs: &[crate::prepared::RemoteRef],
        options: &RequestOptions,
    ) -> Result<Slot, XferError> {
        let peer = &remote.peer;
        let to_self = peer.name == self.name;
        let mut reasons = Vec::new();
        for (slot, attached) in backends.iter().enumerate() {
            if options.backend.as_deref().is_some_and(|wanted| wanted != attached.name) {
                continue;
            }
            let caps = &attached.caps;
            let refusal = if !caps.moves(local.mem_type, remote.mem_type) {
                Some(format!("{} does not move {}→{}", attached.name, local.mem_type, remote.mem_type))
            } else if to_self && !caps.local || !to_self && !caps.remote {
                Some(format!("{} does not do {} transfers", attached.name, if to_self { "local" } else { "remote" }))
            } else if options.notif.is_some() && !caps.notifications {
                Some(format!("{} has no notifications", attached.name))
            } else if peer.link(slot).is_none() {
                Some(format!("peer {} has no {} backend", peer.name, attached.name))
            } else if !local_segs.iter().all(|s| s.entry.has(slot)) {
                Some(format!("local memory is not registered with {}", attached.name))
            } else if !remote_refs.iter().all(|r| peer.regions[r.region].key(slot).is_some()) {
                Some(format!("remote memory is not registered with {}", attached.name))
            } else {
                None
            };
            match refusal {
                None => return Ok(slot),
                Some(reason) => reasons.push(reason),
            }
        }
        if let Some(wanted) = &options.backend {
            if !backends.iter().any(|b| b.name == wanted) {
                return Err(XferError::UnknownBackend(wanted.clone()));
            }
        }
        if reasons.is_empty() {
            reasons.push("no backend attached".into());
        }
        Err(XferError::NoBackend(reasons.join("; ")))
    }
}

impl Drop for AgentInner {
    fn drop(&mut self) {
        self.side_channel.lock().take();
        let own = self.own.lock().peer.take();
        for peer in self.peers.load().values().chain(own.as_ref()) {
            for link in &peer.links {
                link.remote.disconnect();
            }
        }
        for attached in self.backends.load().iter() {
            attached.backend.shutdown();
        }
    }
}

/// Disconnects the links of `previous` that `current` no longer uses.
fn disconnect_unused(previous: &Peer, current: &Peer) {
    for link in &previous.links {
        if !current.links.iter().any(|l| Arc::ptr_eq(&l.remote, &link.remote)) {
            link.remote.disconnect();
        }
    }
}

/// Answers side-channel requests for an agent that may be gone.
struct SideChannelHandler(Weak<AgentInner>);

impl side_channel::Handler for SideChannelHandler {
    fn get(&self) -> Vec<u8> {
        self.0.upgrade().map(|agent| agent.local_blob()).unwrap_or_default()
    }

    fn put(&self, blob: &[u8], peer: Option<&str>) -> Result<String, SideChannelError> {
        let agent = self.0.upgrade().ok_or(SideChannelError::AgentGone)?;
        let agent_err = |e: XferError| SideChannelError::Agent(Box::new(e));
        let md = AgentMetadata::decode_for(blob, agent.credential.as_deref()).map_err(|e| agent_err(e.into()))?;
        if let Some(peer) = peer.filter(|peer| *peer != md.name) {
            return Err(SideChannelError::NotOwnMetadata { peer: peer.to_string(), named: md.name });
        }
        agent.load_decoded(md).map_err(agent_err)
    }

    fn invalidate(&self, name: &str, peer: Option<&str>) -> Result<(), SideChannelError> {
        let agent = self.0.upgrade().ok_or(SideChannelError::AgentGone)?;
        if let Some(peer) = peer.filter(|peer| *peer != name) {
            return Err(SideChannelError::NotOwnName { peer: peer.to_string(), named: name.to_string() });
        }
        agent.invalidate(name).map_err(|e| SideChannelError::Agent(Box::new(e)))
    }

    fn claim(&self, body: &[u8], peer: Option<&str>) -> Result<Vec<u8>, SideChannelError> {
        let agent = self.0.upgrade().ok_or(SideChannelError::AgentGone)?;
        let claim = Claim::decode(body).map_err(|e| SideChannelError::Agent(Box::new(e)))?;
        let claimant = match peer {
            Some(peer) if claim.claimant.is_empty() || claim.claimant == peer => peer,
            Some(peer) => {
                return Err(SideChannelError::NotOwnName { peer: peer.to_string(), named: claim.claimant });
            }
            None => claim.claimant.as_str(),
        };
        let agent = Agent { inner: agent };
        let reply = agent
            .inner
            .offers
            .claim(&claim.name, claimant, |ttl| agent.grant(claimant, claim.mem_type, &claim.ranges, ttl));
        Ok(crate::grant_offer::encode_reply(&reply))
    }
}

/// `(addr, len)` ranges of one grant inside one region.
type GrantRanges = Vec<(u64, u64)>;

/// Grants ([`crate::grant`]): the target issues them, the initiator loads their tokens.
impl Agent {
    /// Grants `peer` alone access to `ranges` (each inside one registered region of
    /// `mem_type`) for `ttl`. Every attached backend holding those regions must issue it
    /// (TCP and UCX do; others refuse with `Unsupported`). Send [`Grant::token`] to the
    /// peer; revoke (or drop) the grant before reusing the memory.
    pub fn grant(&self, peer: &str, mem_type: MemType, ranges: &[Desc], ttl: Duration) -> Result<Grant, XferError> {
        if ranges.is_empty() {
            return Err(XferError::InvalidArgument("empty grant".into()));
        }
        let expires = std::time::Instant::now() + ttl;
        let local = self.inner.local.load();
        // Ranges grouped by the region that holds them.
        let mut by_region: Vec<(Arc<LocalEntry>, GrantRanges)> = Vec::new();
        for (index, range) in ranges.iter().enumerate() {
            let entry = local.find(mem_type, range).ok_or_else(|| {
                XferError::InvalidArgument(format!("grant range {index} is not inside a registration"))
            })?;
            match by_region.iter_mut().find(|(e, _)| Arc::ptr_eq(e, entry)) {
                Some((_, list)) => list.push((range.addr, range.len)),
                None => by_region.push((Arc::clone(entry), vec![(range.addr, range.len)])),
            }
        }
        // The token counts a region's ranges in 16 bits.
        if let Some((_, list)) = by_region.iter().find(|(_, list)| list.len() > usize::from(u16::MAX)) {
            return Err(XferError::InvalidArgument(format!(
                "a grant holds at most {} ranges per registration, not {}",
                u16::MAX,
                list.len()
            )));
        }
        let backends = self.inner.backends.load();
        let mut grant = Grant { token: GrantToken { agent: self.inner.name.clone(), entries: vec![] }, issued: vec![] };
        for (entry, list) in &by_region {
            for (slot, _) in &entry.keys {
                let attached = &backends[*slot];
                // The backend checks each wire descriptor against one range, and initiators
                // merge contiguous descriptors: it gets the ranges merged. The token keeps them
                // as given, so a re-grant of the same ranges replaces the loaded one.
                let key = attached
                    .backend
                    .grant(&entry.region, peer, &crate::grant::merged(list), expires)
                    .map_err(|e| XferError::backend(attached.name, e))?;
                grant.issued.push((Arc::clone(&attached.backend), key.clone()));
                grant.token.entries.push(GrantEntry {
                    backend: attached.name.to_string(),
                    mem_type,
                    region: entry.region.desc(),
                    ranges: list.clone(),
                    key,
                });
            }
        }
        Ok(grant)
    }

    /// Loads a grant token from the agent that issued it (whose metadata must be loaded):
    /// requests to the granted regions then name the grant instead of the region's key, so
    /// the peer admits only the granted ranges, only until it revokes. Returns the peer's name.
    /// Loading the peer's metadata again drops loaded grants.
    pub fn load_grant(&self, token: &[u8]) -> Result<String, XferError> {
        let token = GrantToken::decode(token)?;
        let inner = &self.inner;
        let _writer = inner.writer.lock();
        let peer = inner.peer(&token.agent)?;
        let backends = inner.backends.load();
        let copy = |r: &PeerRegion| PeerRegion { mem_type: r.mem_type, desc: r.desc, keys: r.keys.clone() };
        let mut granted: Vec<PeerRegion> = Vec::new();
        for entry in &token.entries {
            let Some(slot) = backends.iter().position(|b| b.name == entry.backend) else { continue };
            let Some(link) = peer.link(slot) else { continue };
            if !peer.published().iter().any(|r| r.mem_type == entry.mem_type && r.desc == entry.region) {
                return Err(XferError::InvalidArgument(format!(
                    "grant token names a region {:#x}+{} that {} has not published",
                    entry.region.addr, entry.region.len, token.agent
                )));
            }
            let key = link.remote.unpack_key(&entry.key).map_err(|e| XferError::backend(backends[slot].name, e))?;
            // An empty range grants no byte; the lookup's index holds only non-empty ones.
            for &(addr, len) in entry.ranges.iter().filter(|(_, len)| *len > 0) {
                let desc = Desc::new(addr, len, entry.region.dev_id);
                if !entry.region.contains(&desc) {
                    return Err(XferError::InvalidArgument(format!(
                        "grant token grants {addr:#x}+{len} outside its region {:#x}+{}",
                        entry.region.addr, entry.region.len
                    )));
                }
                granted.push(PeerRegion { mem_type: entry.mem_type, desc, keys: vec![(slot, Arc::clone(&key))] });
            }
        }
        // Earlier grants of exactly the same ranges are replaced (a re-grant after reuse).
        let regranted: HashSet<(MemType, Desc)> = granted.iter().map(|r| (r.mem_type, r.desc)).collect();
        let mut loaded: Vec<PeerRegion> =
            peer.granted().iter().filter(|old| !regranted.contains(&(old.mem_type, old.desc))).map(copy).collect();
        loaded.extend(granted);
        let links = peer
            .links
            .iter()
            .map(|l| PeerLink { slot: l.slot, conn_info: l.conn_info.clone(), remote: Arc::clone(&l.remote) })
            .collect();
        let published = peer.published().iter().map(copy).collect();
        let updated = Peer::new(peer.name.clone(), peer.metadata.clone(), links, published, loaded);
        let mut peers = inner.peers.load().as_ref().clone();
        peers.insert(token.agent.clone(), Arc::new(updated));
        inner.peers.store(Arc::new(peers));
        Ok(token.agent)
    }

    /// Offers a grant under `name` for `ttl`: the first peer to claim it over this agent's
    /// side channel ([`Agent::claim_grant`]) gets a grant over the ranges it names, bound to
    /// it. Revoke (or drop) the offer before reusing the memory.
    pub fn offer_grant(&self, name: &str, ttl: Duration) -> GrantOffer {
        self.inner.offers.open(name, ttl)
    }

    /// Claims the grant a peer offered under `name`, over `ranges` of its memory, from its side
    /// channel at `addr`, and loads it ([`Agent::load_grant`]); returns the peer's name. A
    /// revoked or expired offer is refused with `Refused { code: Revoked }`, one another peer
    /// claimed with `WrongAgent`, a name never offered with `UnknownKey` (after asking again,
    /// backing off, for up to [`crate::grant_offer::CLAIM_WAIT`]).
    pub fn claim_grant(&self, addr: &str, name: &str, mem_type: MemType, ranges: &[Desc]) -> Result<String, XferError> {
        let claim =
            Claim { name: name.to_string(), claimant: self.inner.name.clone(), mem_type, ranges: ranges.to_vec() };
        let body = claim.encode()?;
        let started = std::time::Instant::now();
        let mut attempts = 0;
        let token = loop {
            let reply =
                side_channel::call_as(addr, SideOp::Claim, &body, side_channel::IO_TIMEOUT, self.inner.client_auth())
                    .map_err(|source| XferError::SideChannel { addr: addr.to_string(), source })?;
            attempts += 1;
            let answer = crate::grant_offer::decode_reply(&reply);
            // Not offered yet: the target may learn of the memory after we learn where to read.
            let not_yet = matches!(answer, Err(XferError::Refused { code: RefusalCode::UnknownKey, .. }));
            match next_claim_attempt(started, std::time::Instant::now(), attempts).filter(|_| not_yet) {
                Some(pause) => std::thread::sleep(pause),
                None => break answer?,
            }
        };
        self.load_grant(&token)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use xfer_core::{BackendError, BackendFactory, HostBuffer, RemoteAgent};

    use super::*;

    /// A backend that only allocates (from a `HostBuffer`) and counts its registrations.
    struct Allocating {
        registered: Arc<AtomicUsize>,
    }

    impl Backend for Allocating {
        fn name(&self) -> &'static str {
            "allocating"
        }
        fn capabilities(&self) -> Capabilities {
            Capabilities {
                paths: vec![(MemType::Dram, MemType::Dram)],
                remote: true,
                local: true,
                notifications: false,
            }
        }
        fn conn_info(&self) -> Vec<u8> {
            Vec::new()
        }
        fn register(&self, _region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError> {
            self.registered.fetch_add(1, Ordering::SeqCst);
            Ok(Vec::new())
        }
        fn deregister(&self, _region: &LocalRegion) {
            self.registered.fetch_sub(1, Ordering::SeqCst);
        }
        fn connect(&self, _peer: &str, _conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError> {
            Err(BackendError::Unsupported("test backend".into()))
        }
        fn allocate(&self, len: usize, mem_type: MemType) -> Option<Result<BackendBuffer, BackendError>> {
            if mem_type != MemType::Dram {
                return None;
            }
            let memory = HostBuffer::new(len);
            let ptr = memory.addr() as usize as *mut u8;
            // SAFETY: the HostBuffer (at least `len` bytes) moves into the buffer and lives as
            // long as it.
            Some(Ok(unsafe { BackendBuffer::new(ptr, len, "allocating", Box::new(memory)) }))
        }
    }

    struct AllocatingFactory(Arc<AtomicUsize>);

    impl BackendFactory for AllocatingFactory {
        fn name(&self) -> &'static str {
            "allocating"
        }
        fn create(&self, _ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError> {
            Ok(Arc::new(Allocating { registered: Arc::clone(&self.0) }))
        }
    }

    #[test]
    fn allocate_registers_with_every_backend_or_fails_typed() {
        let registered = Arc::new(AtomicUsize::new(0));
        let mut registry = BackendRegistry::default();
        registry.register(Arc::new(AllocatingFactory(Arc::clone(&registered))));
        let agent = Agent::with_registry("alloc-test", registry).unwrap();
        assert!(matches!(agent.allocate(4096), Err(XferError::NoBackend(_))));
        agent.add_backend("tcp", BackendParams::parse("listen=127.0.0.1:0").unwrap()).unwrap();
        let err = agent.allocate(4096).unwrap_err();
        assert!(matches!(&err, XferError::NoBackend(reason) if reason.contains("tcp does not allocate")), "{err}");
        assert!(matches!(agent.allocate(0), Err(XferError::InvalidArgument(_))));

        agent.add_backend("allocating", BackendParams::new()).unwrap();
        let Allocation { buffer, registration } = agent.allocate(10_000).unwrap();
        assert_eq!(buffer.backend(), "allocating");
        assert_eq!(registration.descs(), vec![buffer.desc()]);
        assert_eq!(registered.load(Ordering::SeqCst), 1);
        // TCP serves the same memory: its key is in the metadata next to the other backend's.
        let metadata = AgentMetadata::decode(&agent.local_metadata()).unwrap();
        assert_eq!(metadata.regions.len(), 1);
        assert_eq!(metadata.regions[0].desc, buffer.desc());
        assert_eq!(metadata.regions[0].keys.len(), 2);
        buffer.write_at(9_999, &[7]);
        drop(registration);
        assert_eq!(registered.load(Ordering::SeqCst), 0);
        assert!(agent.local_metadata().len() < metadata.encode().len(), "the region is still published");
    }
}
