//! `pd_xfer._native`: xfer's agent, registrations, prepared descriptor lists and requests as
//! Python classes. Every call that can wait (transfers, polls that drive a backend, metadata
//! fetches over the side channel, deregistration) runs with the GIL released.
//!
//! The pure-Python package around it (`python/pd_xfer`) adds what is easier there: descriptors
//! from torch tensors and numpy arrays, and the NIXL-compatible `pd_xfer.nixl.nixl_agent`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use xfer::{BackendParams, Desc, MemType, Op, RequestOptions};

pyo3::create_exception!(
    _native,
    XferError,
    PyException,
    "An xfer error. `kind` names its category (unknown_peer, not_registered, refused, timed_out, ...); a refusal also has `code`."
);

/// The one conversion of xfer's typed errors into Python exceptions.
fn raise(err: xfer::XferError) -> PyErr {
    Python::attach(|py| {
        let exc = XferError::new_err(err.to_string());
        let value = exc.value(py);
        // Setting attributes on a fresh exception instance cannot fail short of memory exhaustion,
        // and then the message alone still reaches the caller.
        let _ = value.setattr("kind", err.kind());
        if let xfer::XferError::Refused { code, .. } = &err {
            let _ = value.setattr("code", code.to_string());
        }
        exc
    })
}

fn invalid(message: impl Into<String>) -> PyErr {
    raise(xfer::XferError::InvalidArgument(message.into()))
}

fn mem_type(name: &str) -> PyResult<MemType> {
    name.parse().map_err(|err: xfer::UnknownMemType| invalid(err.to_string()))
}

fn op(name: &str) -> PyResult<Op> {
    match name.to_ascii_uppercase().as_str() {
        "READ" => Ok(Op::Read),
        "WRITE" => Ok(Op::Write),
        _ => Err(invalid(format!("unknown operation {name:?} (expected READ or WRITE)"))),
    }
}

fn timeout(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| invalid(format!("timeout must be a finite number of seconds >= 0, not {seconds}")))
}

type DescTuple = (u64, u64, u64);

fn descs(tuples: &[DescTuple]) -> Vec<Desc> {
    tuples.iter().map(|&(addr, len, dev_id)| Desc::new(addr, len, dev_id)).collect()
}

fn options(notif: Option<&[u8]>, backend: Option<String>) -> RequestOptions {
    RequestOptions { notif: notif.map(<[u8]>::to_vec), backend }
}

/// A transfer agent (`xfer::Agent`).
#[pyclass(frozen, module = "pd_xfer._native")]
struct Agent {
    inner: xfer::Agent,
}

#[pymethods]
impl Agent {
    #[new]
    fn new(name: &str) -> PyResult<Self> {
        Ok(Agent { inner: xfer::Agent::new(name).map_err(raise)? })
    }

    /// Backends this build can attach (`posix`, `tcp`, and `ucx` when built with it).
    #[staticmethod]
    fn available_backends() -> Vec<&'static str> {
        xfer::BackendRegistry::default().names()
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// Attaches a backend by name; `params` are its `key=value` settings (unknown keys fail).
    /// `params_env` names an environment variable whose `key=value,...` settings come first,
    /// `params` winning where both set a key (how an engine's operator sets a backend that the
    /// engine creates with no settings: vLLM's NixlConnector does). With `ignore_unknown`, keys
    /// of `params` the backend does not take are left out instead (as NIXL does with its
    /// plugins' settings) and returned; the environment's settings stay checked.
    #[pyo3(signature = (name, params = None, params_env = None, ignore_unknown = false))]
    fn add_backend(
        &self,
        py: Python<'_>,
        name: &str,
        params: Option<HashMap<String, String>>,
        params_env: Option<&str>,
        ignore_unknown: bool,
    ) -> PyResult<Vec<String>> {
        let from_env = params_env.and_then(|var| std::env::var(var).ok().map(|text| (var, text)));
        let from_env = match from_env {
            Some((var, text)) => BackendParams::parse(&text).map_err(|e| invalid(format!("{var}={text:?}: {e}")))?,
            None => BackendParams::new(),
        };
        let mut params = params.unwrap_or_default();
        let mut ignored = Vec::new();
        // Each try drops one more of the caller's settings the backend refused as unknown (the
        // backend is the one that knows its keys, and refuses them before doing anything).
        loop {
            let mut backend_params = from_env.clone();
            for (key, value) in &params {
                backend_params.insert(key.clone(), value.clone());
            }
            match py.detach(|| self.inner.add_backend(name, backend_params)) {
                Ok(()) => return Ok(ignored),
                Err(err) => match err
                    .unknown_param()
                    .filter(|key| ignore_unknown && params.contains_key(*key) && !from_env.contains(key))
                {
                    Some(key) => {
                        let key = key.to_string();
                        params.remove(&key);
                        ignored.push(key);
                    }
                    None => return Err(raise(err)),
                },
            }
        }
    }

    /// Attached backends, in preference order.
    fn backends(&self) -> Vec<&'static str> {
        self.inner.backends()
    }

    /// Registers `(addr, len, dev_id)` regions of this process's memory with every attached
    /// backend that serves `mem_type`. The memory must stay valid until the registration is
    /// deregistered; `keep_alive` (e.g. the tensors) is held until then.
    #[pyo3(signature = (regions, mem_type = "DRAM", keep_alive = None))]
    fn register_memory(
        &self,
        py: Python<'_>,
        regions: Vec<DescTuple>,
        mem_type: &str,
        keep_alive: Option<Py<PyAny>>,
    ) -> PyResult<Registration> {
        let mem_type = self::mem_type(mem_type)?;
        let regions = descs(&regions);
        // SAFETY: as with NIXL's Python agent, the Python caller vouches that the regions are
        // memory of this process that stays valid while registered; `keep_alive` holds the
        // objects that own it (tensors, buffers) until `deregister`, which waits for transfers.
        let registration = py.detach(|| unsafe { self.inner.register_memory(mem_type, &regions) }).map_err(raise)?;
        Ok(Registration { inner: Mutex::new(Some(registration)), keep_alive: Mutex::new(keep_alive) })
    }

    /// This agent's metadata blob (backends' connection info, registrations' keys).
    fn local_metadata<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.local_metadata())
    }

    /// Loads or reloads a peer's metadata blob; returns the peer's name.
    fn load_remote_metadata(&self, blob: &[u8]) -> PyResult<String> {
        self.inner.load_remote_metadata(blob).map_err(raise)
    }

    /// Forgets a peer; later requests to it fail with kind `unknown_peer`.
    fn invalidate_remote(&self, name: &str) -> PyResult<()> {
        self.inner.invalidate_remote(name).map_err(raise)
    }

    fn peers(&self) -> Vec<String> {
        self.inner.peers()
    }

    /// A peer's published regions as `(mem_type, addr, len, dev_id)`.
    fn remote_regions(&self, peer: &str) -> PyResult<Vec<(String, u64, u64, u64)>> {
        let regions = self.inner.remote_regions(peer).map_err(raise)?;
        Ok(regions.into_iter().map(|(mem, d)| (mem.to_string(), d.addr, d.len, d.dev_id)).collect())
    }

    /// Serves this agent's metadata on `addr` ("host:port"); returns the bound (host, port).
    fn start_side_channel(&self, py: Python<'_>, addr: &str) -> PyResult<(String, u16)> {
        let bound = py.detach(|| self.inner.start_side_channel(addr)).map_err(raise)?;
        Ok((bound.ip().to_string(), bound.port()))
    }

    /// Fetches and loads a peer's metadata from its side channel; returns the peer's name.
    fn fetch_remote_metadata(&self, py: Python<'_>, addr: &str) -> PyResult<String> {
        py.detach(|| self.inner.fetch_remote_metadata(addr)).map_err(raise)
    }

    /// Pushes this agent's metadata to a peer's side channel.
    fn send_local_metadata(&self, py: Python<'_>, addr: &str) -> PyResult<()> {
        py.detach(|| self.inner.send_local_metadata(addr)).map_err(raise)
    }

    /// Tells a peer's side channel to forget this agent.
    fn invalidate_local_metadata(&self, py: Python<'_>, addr: &str) -> PyResult<()> {
        py.detach(|| self.inner.invalidate_local_metadata(addr)).map_err(raise)
    }

    /// Checks local descriptors against the registrations once, for requests by index.
    #[pyo3(signature = (descs, mem_type = "DRAM"))]
    fn prep_local(&self, descs: Vec<DescTuple>, mem_type: &str) -> PyResult<PreparedLocal> {
        let prepared = self.inner.prep_local(self::mem_type(mem_type)?, &self::descs(&descs)).map_err(raise)?;
        Ok(PreparedLocal { inner: prepared })
    }

    /// Checks a peer's descriptors against its metadata once, for requests by index.
    #[pyo3(signature = (peer, descs, mem_type = "DRAM"))]
    fn prep_remote(&self, peer: &str, descs: Vec<DescTuple>, mem_type: &str) -> PyResult<PreparedRemote> {
        let prepared = self.inner.prep_remote(peer, self::mem_type(mem_type)?, &self::descs(&descs)).map_err(raise)?;
        Ok(PreparedRemote { inner: prepared })
    }

    /// As `prep_remote`, but through the peer's published regions only, whatever grants are
    /// loaded: a list kept for later requests must not carry a grant's key that the peer will
    /// revoke.
    #[pyo3(signature = (peer, descs, mem_type = "DRAM"))]
    fn prep_remote_published(&self, peer: &str, descs: Vec<DescTuple>, mem_type: &str) -> PyResult<PreparedRemote> {
        let prepared =
            self.inner.prep_remote_published(peer, self::mem_type(mem_type)?, &self::descs(&descs)).map_err(raise)?;
        Ok(PreparedRemote { inner: prepared })
    }

    /// A READ or WRITE between DRAM descriptor lists of equal total length (not yet posted).
    #[pyo3(signature = (op, local, peer, remote, notif = None, backend = None))]
    fn create_request(
        &self,
        op: &str,
        local: Vec<DescTuple>,
        peer: &str,
        remote: Vec<DescTuple>,
        notif: Option<&[u8]>,
        backend: Option<String>,
    ) -> PyResult<Request> {
        let request = self
            .inner
            .create_request(self::op(op)?, &descs(&local), peer, &descs(&remote), options(notif, backend))
            .map_err(raise)?;
        Ok(Request::new(request))
    }

    /// A READ or WRITE between entries of prepared lists, chosen by index (not yet posted).
    #[pyo3(signature = (op, local, local_indices, remote, remote_indices, notif = None, backend = None))]
    #[allow(clippy::too_many_arguments)]
    fn make_request(
        &self,
        op: &str,
        local: &PreparedLocal,
        local_indices: Vec<usize>,
        remote: &PreparedRemote,
        remote_indices: Vec<usize>,
        notif: Option<&[u8]>,
        backend: Option<String>,
    ) -> PyResult<Request> {
        let request = self
            .inner
            .make_request(
                self::op(op)?,
                &local.inner,
                &local_indices,
                &remote.inner,
                &remote_indices,
                options(notif, backend),
            )
            .map_err(raise)?;
        Ok(Request::new(request))
    }

    /// Opens now what the first transfer to `peer` would open, through every common backend or
    /// only `backend` (`xfer::Agent::make_connection`): an unreachable or refusing peer fails
    /// here.
    #[pyo3(signature = (peer, backend = None))]
    fn make_connection(&self, py: Python<'_>, peer: &str, backend: Option<&str>) -> PyResult<()> {
        py.detach(|| self.inner.make_connection(peer, backend)).map_err(raise)
    }

    /// Sends a notification to a peer, in order with earlier ones to it.
    fn send_notif(&self, py: Python<'_>, peer: &str, message: &[u8]) -> PyResult<()> {
        py.detach(|| self.inner.send_notif(peer, message)).map_err(raise)
    }

    /// Drains every received notification: `{agent name: [bytes, ...]}` in arrival order.
    fn get_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        for (peer, messages) in self.inner.get_notifs() {
            let messages: Vec<Bound<'py, PyBytes>> = messages.iter().map(|m| PyBytes::new(py, m)).collect();
            out.set_item(peer, messages)?;
        }
        Ok(out)
    }

    /// Drains the notifications received from one agent.
    fn get_notifs_from<'py>(&self, py: Python<'py>, peer: &str) -> Vec<Bound<'py, PyBytes>> {
        self.inner.get_notifs_from(peer).iter().map(|m| PyBytes::new(py, m)).collect()
    }

    /// Waits up to `timeout` seconds for a notification; `False` when none came.
    fn wait_notifs(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = self::timeout(timeout)?;
        Ok(py.detach(|| self.inner.wait_notifs(timeout)))
    }

    /// Grants `peer` alone access to `ranges` (`(addr, len, dev_id)` inside registrations of
    /// `mem_type`) for `ttl` seconds; hand `token` to the peer and `revoke()` before reusing
    /// the memory.
    #[pyo3(signature = (peer, ranges, mem_type = "DRAM", ttl = 60.0))]
    fn grant(&self, py: Python<'_>, peer: &str, ranges: Vec<DescTuple>, mem_type: &str, ttl: f64) -> PyResult<Grant> {
        let (mem_type, ttl, ranges) = (self::mem_type(mem_type)?, timeout(ttl)?, descs(&ranges));
        let grant = py.detach(|| self.inner.grant(peer, mem_type, &ranges, ttl)).map_err(raise)?;
        Ok(Grant { token: grant.token(), inner: Mutex::new(Some(grant)) })
    }

    /// Loads a grant token from the peer that issued it (its metadata loaded first): requests
    /// to the granted ranges then go under the grant. Returns the peer's name.
    fn load_grant(&self, token: &[u8]) -> PyResult<String> {
        self.inner.load_grant(token).map_err(raise)
    }

    /// Offers a grant under `name` for `ttl` seconds, for the first peer that claims it over
    /// this agent's side channel (`claim_grant`); `revoke()` it before reusing the memory.
    #[pyo3(signature = (name, ttl = 60.0))]
    fn offer_grant(&self, name: &str, ttl: f64) -> PyResult<GrantOffer> {
        let ttl = timeout(ttl)?;
        Ok(GrantOffer { name: name.to_string(), inner: Mutex::new(Some(self.inner.offer_grant(name, ttl))) })
    }

    /// Claims the grant the peer serving the side channel at `addr` offered under `name`, over
    /// `ranges` of its memory, and loads it; returns the peer's name. A revoked or expired
    /// offer raises kind `refused`, code `revoked`.
    #[pyo3(signature = (addr, name, ranges, mem_type = "DRAM"))]
    fn claim_grant(
        &self,
        py: Python<'_>,
        addr: &str,
        name: &str,
        ranges: Vec<DescTuple>,
        mem_type: &str,
    ) -> PyResult<String> {
        let (mem_type, ranges) = (self::mem_type(mem_type)?, descs(&ranges));
        py.detach(|| self.inner.claim_grant(addr, name, mem_type, &ranges)).map_err(raise)
    }

    fn __repr__(&self) -> String {
        format!("Agent(name={:?}, backends={:?})", self.inner.name(), self.inner.backends())
    }
}

/// A revocable grant this agent issued. `revoke()` (idempotent; also on collection) returns
/// only once no transfer under it still touches the memory.
#[pyclass(frozen, module = "pd_xfer._native")]
struct Grant {
    token: Vec<u8>,
    inner: Mutex<Option<xfer::Grant>>,
}

#[pymethods]
impl Grant {
    /// The opaque token for the peer (`Agent.load_grant`).
    #[getter]
    fn token<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.token)
    }

    #[getter]
    fn revoked(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// Revokes, waiting with the GIL released for transfers under the grant.
    fn revoke(&self, py: Python<'_>) {
        let grant = self.inner.lock().take();
        py.detach(move || drop(grant));
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        if let Some(grant) = self.inner.get_mut().take() {
            Python::attach(|py| py.detach(move || drop(grant)));
        }
    }
}

/// A grant offered under a name (`Agent.offer_grant`). `revoke()` (idempotent; also on
/// collection) revokes every grant claimed under it, returning once none is in use.
#[pyclass(frozen, module = "pd_xfer._native")]
struct GrantOffer {
    name: String,
    inner: Mutex<Option<xfer::GrantOffer>>,
}

#[pymethods]
impl GrantOffer {
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// The peer that claimed the offer, or `None`.
    #[getter]
    fn claimant(&self) -> Option<String> {
        self.inner.lock().as_ref().and_then(xfer::GrantOffer::claimant)
    }

    #[getter]
    fn revoked(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// Ends the offer; returns how many grants were claimed under it (0 once revoked).
    fn revoke(&self, py: Python<'_>) -> usize {
        let offer = self.inner.lock().take();
        py.detach(move || offer.map_or(0, xfer::GrantOffer::revoke))
    }
}

impl Drop for GrantOffer {
    fn drop(&mut self) {
        if let Some(offer) = self.inner.get_mut().take() {
            Python::attach(|py| py.detach(move || drop(offer)));
        }
    }
}

/// Registered memory. `deregister()` waits for transfers that still use it; only then may the
/// memory be freed. Dropped without it, the registration ends when the object is collected.
#[pyclass(frozen, module = "pd_xfer._native")]
struct Registration {
    inner: Mutex<Option<xfer::Registration>>,
    keep_alive: Mutex<Option<Py<PyAny>>>,
}

#[pymethods]
impl Registration {
    /// The registered regions as `(addr, len, dev_id)`; empty once deregistered.
    fn descs(&self) -> Vec<DescTuple> {
        let inner = self.inner.lock();
        let descs = inner.as_ref().map(xfer::Registration::descs).unwrap_or_default();
        descs.into_iter().map(|d| (d.addr, d.len, d.dev_id)).collect()
    }

    #[getter]
    fn registered(&self) -> bool {
        self.inner.lock().is_some()
    }

    /// Deregisters (idempotent), waiting with the GIL released for transfers using the memory.
    fn deregister(&self, py: Python<'_>) {
        let registration = self.inner.lock().take();
        py.detach(move || drop(registration));
        self.keep_alive.lock().take();
    }
}

/// Collected without `deregister()`: the deregistration still waits for transfers using the
/// memory, so it runs with the GIL released (other Python threads, and callbacks the transfers
/// may need, keep running).
impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(registration) = self.inner.get_mut().take() {
            Python::attach(|py| py.detach(move || drop(registration)));
        }
    }
}

/// A local descriptor list checked once against the registrations.
#[pyclass(frozen, module = "pd_xfer._native")]
struct PreparedLocal {
    inner: xfer::PreparedLocal,
}

#[pymethods]
impl PreparedLocal {
    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// A peer's descriptor list checked once against its metadata.
#[pyclass(frozen, module = "pd_xfer._native")]
struct PreparedRemote {
    inner: xfer::PreparedRemote,
}

#[pymethods]
impl PreparedRemote {
    fn __len__(&self) -> usize {
        self.inner.len()
    }

    #[getter]
    fn peer(&self) -> &str {
        self.inner.peer()
    }
}

/// A READ or WRITE request: `post()`, then `poll()` or `wait()`; `cancel()`; `release()`.
#[pyclass(frozen, module = "pd_xfer._native")]
struct Request {
    inner: Mutex<Option<Arc<xfer::XferRequest>>>,
}

impl Request {
    fn new(request: xfer::XferRequest) -> Self {
        Request { inner: Mutex::new(Some(Arc::new(request))) }
    }

    fn get(&self) -> PyResult<Arc<xfer::XferRequest>> {
        self.inner.lock().clone().ok_or_else(|| invalid("the request was released"))
    }
}

/// Collected without `release()`: a posting in flight is cancelled and waited for, with the GIL
/// released, as `release()` does.
impl Drop for Request {
    fn drop(&mut self) {
        if let Some(request) = self.inner.get_mut().take() {
            Python::attach(|py| py.detach(move || drop(request)));
        }
    }
}

#[pymethods]
impl Request {
    /// Starts the transfer; a finished request may be posted again.
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        let request = self.get()?;
        py.detach(|| request.post()).map_err(raise)
    }

    /// `True` when done, `False` while in progress; raises the error when it failed.
    fn poll(&self, py: Python<'_>) -> PyResult<bool> {
        let request = self.get()?;
        py.detach(|| request.poll()).map_err(raise)
    }

    /// Waits up to `timeout` seconds; raises kind `timed_out` (the transfer goes on) or the
    /// transfer's error.
    fn wait(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = self::timeout(timeout)?;
        let request = self.get()?;
        py.detach(|| request.wait(timeout)).map_err(raise)
    }

    /// Asks the backend to stop; `poll`/`wait` then report kind `cancelled`.
    fn cancel(&self) -> PyResult<()> {
        self.get()?.cancel();
        Ok(())
    }

    /// Releases the request (idempotent); a posting still in flight is cancelled.
    fn release(&self, py: Python<'_>) {
        let request = self.inner.lock().take();
        py.detach(move || drop(request));
    }

    #[getter]
    fn released(&self) -> bool {
        self.inner.lock().is_none()
    }

    #[getter]
    fn op(&self) -> PyResult<&'static str> {
        Ok(match self.get()?.op() {
            Op::Read => "READ",
            Op::Write => "WRITE",
        })
    }

    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.get()?.backend())
    }

    #[getter]
    fn bytes(&self) -> PyResult<u64> {
        Ok(self.get()?.bytes())
    }

    #[getter]
    fn peer(&self) -> PyResult<String> {
        Ok(self.get()?.peer().to_string())
    }

    /// The current (or last) posting: `{backend, bytes, descriptors, posted_at_us (Unix time),
    /// duration_us (None while in progress)}`; `None` before the first post.
    fn telemetry<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(telemetry) = self.get()?.telemetry() else {
            return Ok(None);
        };
        let posted_at = SystemTime::now().checked_sub(telemetry.posted_at.elapsed()).unwrap_or(UNIX_EPOCH);
        let posted_at_us = posted_at.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64;
        let out = PyDict::new(py);
        out.set_item("backend", telemetry.backend)?;
        out.set_item("bytes", telemetry.bytes)?;
        out.set_item("descriptors", telemetry.descriptors)?;
        out.set_item("posted_at_us", posted_at_us)?;
        out.set_item("duration_us", telemetry.duration.map(|d| d.as_micros() as u64))?;
        Ok(Some(out))
    }
}

#[pymodule]
fn _native(module: &Bound<'_, PyModule>) -> PyResult<()> {
    module.add_class::<Agent>()?;
    module.add_class::<Registration>()?;
    module.add_class::<PreparedLocal>()?;
    module.add_class::<PreparedRemote>()?;
    module.add_class::<Request>()?;
    module.add_class::<Grant>()?;
    module.add_class::<GrantOffer>()?;
    module.add("XferError", module.py().get_type::<XferError>())?;
    Ok(())
}
