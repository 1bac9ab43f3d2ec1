//! The plugin interface: what a transfer backend implements.

use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::completion::Completer;
use crate::error::BackendError;
use crate::host::BackendBuffer;
use crate::mem::{LocalMem, LocalRegion, MemType};
use crate::staging::Staging;

/// Direction of a transfer, from the initiator's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Remote → local.
    Read,
    /// Local → remote.
    Write,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Read => "read",
            Op::Write => "write",
        })
    }
}

/// What a backend can do; the agent picks a backend per request from these.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `(local, remote)` pairs of memory a request may join through this backend: TCP moves
    /// DRAM↔DRAM, POSIX DRAM↔FILE. The backend registers every type that appears on either
    /// side (it gets a key in the agent's metadata for each such region); registering a type
    /// does not imply moving it to every other.
    pub paths: Vec<(MemType, MemType)>,
    /// Transfers to other agents.
    pub remote: bool,
    /// Transfers between two registrations of the same agent.
    pub local: bool,
    /// Notifications delivered after the data.
    pub notifications: bool,
}

impl Capabilities {
    /// Whether the backend registers `mem_type` memory: it moves it on one side of a path.
    pub fn supports(&self, mem_type: MemType) -> bool {
        self.paths.iter().any(|&(local, remote)| local == mem_type || remote == mem_type)
    }

    /// Whether a request from `local` to `remote` memory (either direction) can go through it.
    pub fn moves(&self, local: MemType, remote: MemType) -> bool {
        self.paths.contains(&(local, remote))
    }
}

/// Receives notifications: `(sending agent's name, message)`.
pub type NotifSink = Arc<dyn Fn(&str, Vec<u8>) + Send + Sync>;

/// Key/value parameters of a backend. Every key must be consumed: leftovers are reported as
/// unknown, so a typo never silently falls back to a default.
#[derive(Clone, Debug, Default)]
pub struct BackendParams {
    values: BTreeMap<String, String>,
}

impl BackendParams {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.values.insert(key.into(), value.into());
        self
    }

    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.values.insert(key.into(), value.into());
    }

    /// Parses `k=v,k=v` (as given on command lines).
    pub fn parse(text: &str) -> Result<Self, BackendError> {
        let mut params = Self::new();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| BackendError::InvalidParam {
                name: pair.to_string(),
                reason: "expected key=value".into(),
            })?;
            params.insert(key.trim(), value.trim());
        }
        Ok(params)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.values.contains_key(key)
    }

    /// Removes and returns a raw value.
    pub fn take(&mut self, key: &str) -> Option<String> {
        self.values.remove(key)
    }

    /// Removes and returns every `(key, value)` whose key starts with `prefix` (for backends
    /// that pass a family of settings through, e.g. `ucx_*`), in key order.
    pub fn take_prefixed(&mut self, prefix: &str) -> Vec<(String, String)> {
        let keys: Vec<String> = self.values.keys().filter(|k| k.starts_with(prefix)).cloned().collect();
        keys.into_iter().filter_map(|k| self.values.remove_entry(&k)).collect()
    }

    /// Removes and parses a value, or returns `default` when absent.
    pub fn take_parsed<T: std::str::FromStr>(&mut self, key: &str, default: T) -> Result<T, BackendError>
    where
        T::Err: fmt::Display,
    {
        match self.values.remove(key) {
            None => Ok(default),
            Some(raw) => raw.parse().map_err(|err: T::Err| BackendError::InvalidParam {
                name: key.to_string(),
                reason: format!("{raw:?}: {err}"),
            }),
        }
    }

    /// Removes a millisecond value as a duration.
    pub fn take_millis(&mut self, key: &str, default: Duration) -> Result<Duration, BackendError> {
        let millis = self.take_parsed(key, default.as_millis() as u64)?;
        Ok(Duration::from_millis(millis))
    }

    /// Fails when keys remain that the backend did not take.
    pub fn finish(self, backend: &str) -> Result<(), BackendError> {
        match self.values.keys().next() {
            None => Ok(()),
            Some(key) => Err(BackendError::UnknownParam { name: key.clone(), backend: backend.to_string() }),
        }
    }
}

/// What a backend is created with.
#[derive(Clone)]
pub struct BackendContext {
    pub agent_name: String,
    pub params: BackendParams,
    pub notifs: NotifSink,
    /// Copy lanes for memory the backend's wire cannot address (GPU memory, files); the agent
    /// supplies CUDA's when the driver is present.
    pub staging: Arc<dyn Staging>,
    /// The cluster credential when the agent has one: backends authenticate their data
    /// connections with it.
    pub credential: Option<Arc<crate::credential::ClusterCredential>>,
}

impl fmt::Debug for BackendContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BackendContext")
            .field("agent_name", &self.agent_name)
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// Creates backends of one kind; agents look factories up by name.
pub trait BackendFactory: Send + Sync {
    fn name(&self) -> &'static str;
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>, BackendError>;
}

/// A backend's unpacked form of a peer's remote key (e.g. the TCP key and region base, or a
/// UCX rkey handle). Backends downcast their own type.
pub type RemoteKey = Arc<dyn Any + Send + Sync>;

/// One transfer engine instance attached to an agent.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;
    /// Connection info published in the agent's metadata (address, worker address, ...).
    fn conn_info(&self) -> Vec<u8>;
    /// Makes a region reachable through this backend; returns its public key bytes, published
    /// in the agent's metadata.
    fn register(&self, region: &Arc<LocalRegion>) -> Result<Vec<u8>, BackendError>;
    /// Stops serving a region. Called after the region is closed and idle.
    fn deregister(&self, region: &LocalRegion);
    /// Prepares transfers to a peer from its published connection info.
    fn connect(&self, peer: &str, conn_info: &[u8]) -> Result<Arc<dyn RemoteAgent>, BackendError>;
    /// Allocates `len` bytes of `mem_type` memory that this backend moves best (UCX: memory in
    /// shared-memory segments that peers on the host map, so their puts and gets are copies).
    /// `None`: this backend does not allocate (the default). The allocation must outlive
    /// `shutdown`: it is released when the buffer is dropped.
    fn allocate(&self, len: usize, mem_type: MemType) -> Option<Result<BackendBuffer, BackendError>> {
        let _ = (len, mem_type);
        None
    }
    /// Issues a revocable grant: `peer` alone may reach the byte ranges `ranges` (absolute
    /// addresses inside `region`) until `expires`. Returns the grant's public key bytes, in the
    /// same form as [`Backend::register`]'s, so an initiator uses them in place of the region's
    /// key. Backends that cannot enforce grants refuse (the default).
    fn grant(
        &self,
        region: &Arc<LocalRegion>,
        peer: &str,
        ranges: &[(u64, u64)],
        expires: std::time::Instant,
    ) -> Result<Vec<u8>, BackendError> {
        let _ = (region, peer, ranges, expires);
        Err(BackendError::Unsupported(format!("backend {} does not issue grants", self.name())))
    }
    /// Revokes a grant by the public key bytes [`Backend::grant`] returned. Returns only once no
    /// transfer under the grant still touches its memory.
    fn revoke(&self, public: &[u8]) {
        let _ = public;
    }
    /// Stops serving and releases resources; transfers in flight fail.
    fn shutdown(&self) {}
}

/// A backend's connection to one peer agent.
pub trait RemoteAgent: Send + Sync {
    /// Turns a key the peer published for one of its regions into a usable form.
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError>;
    /// Starts a transfer. Never blocks for the data; every outcome, including errors found while
    /// posting, is reported through `job.done`.
    fn post(&self, job: TransferJob);
    /// Sends a standalone notification; returns once the peer has queued it (bounded by the
    /// backend's timeout).
    fn notify(&self, message: &[u8]) -> Result<(), BackendError>;
    /// Drops connections; transfers in flight fail.
    fn disconnect(&self);
    /// Opens now what the first transfer would open (a connection, its handshakes), so that a
    /// peer that cannot be reached or refuses this agent fails here, bounded by the backend's
    /// timeouts. Backends that open nothing ahead of a transfer do nothing.
    fn connect_now(&self) -> Result<(), BackendError> {
        Ok(())
    }
}

/// A piece of a peer's registered memory.
#[derive(Clone)]
pub struct RemoteSeg {
    pub key: RemoteKey,
    /// Absolute address in the peer's address space (its descriptor's address).
    pub addr: u64,
    pub len: u64,
}

impl fmt::Debug for RemoteSeg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteSeg").field("addr", &self.addr).field("len", &self.len).finish_non_exhaustive()
    }
}

/// A posted transfer as handed to a backend. Local and remote lists cover the same number of
/// bytes; their segment boundaries need not line up (the byte streams are matched in order).
/// Local pieces come in the form of their memory type; a backend meets only the kinds its
/// [`Capabilities::paths`] name, unless a request named it explicitly.
#[derive(Debug)]
pub struct TransferJob {
    pub op: Op,
    pub local: Vec<LocalMem>,
    pub remote: Vec<RemoteSeg>,
    /// Delivered to the peer only after the data is visible there.
    pub notif: Option<Vec<u8>>,
    pub done: Completer,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_parse_and_reject_unknown_keys() {
        let mut params = BackendParams::parse("streams=4, timeout_ms=250").unwrap();
        assert_eq!(params.take_parsed("streams", 1u32).unwrap(), 4);
        assert_eq!(params.take_millis("timeout_ms", Duration::from_secs(5)).unwrap(), Duration::from_millis(250));
        assert_eq!(params.take_parsed("absent", 9u8).unwrap(), 9);
        params.clone().finish("tcp").unwrap();
        params.insert("strams", "2");
        let err = params.finish("tcp").unwrap_err();
        assert!(err.to_string().contains("strams"), "{err}");
        assert!(matches!(&err, BackendError::UnknownParam { name, backend } if name == "strams" && backend == "tcp"));
        assert!(BackendParams::parse("novalue").is_err());
        let mut family = BackendParams::parse("ucx_b=2,ucx_a=1,other=3").unwrap();
        assert_eq!(family.take_prefixed("ucx_"), vec![("ucx_a".into(), "1".into()), ("ucx_b".into(), "2".into())]);
        assert_eq!(family.take("other").as_deref(), Some("3"));
        let mut bad = BackendParams::new().with("streams", "many");
        assert!(bad.take_parsed("streams", 1u32).is_err());
    }
}
