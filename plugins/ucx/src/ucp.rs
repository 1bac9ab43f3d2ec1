//! The one thin safe layer over the UCP C API; every `unsafe` of this crate is in this file.
//!
//! Ownership mirrors UCX's own rules: a [`Context`] outlives its [`Worker`]s and
//! [`MemHandle`]s, a worker outlives its [`Endpoint`]s (both enforced with `Rc`). None of these
//! types is `Send` on its own. The owner keeps a worker and everything made from it in one
//! [`WorkerCell`], which moves between threads as a whole behind the owner's lock, so one
//! thread at a time makes UCP calls: the worker runs in `UCS_THREAD_MODE_SERIALIZED`. Other
//! threads wake a sleeping owner through a [`Signaler`].
//!
//! Memory handed to UCX for a put or get must stay valid until UCX is done with it, which a
//! caller cannot see from the call's return. So each operation takes its buffer (a
//! `LocalMem`, which holds its registration's pin) and drops it only once UCX completed the
//! request; an operation or send dropped unfinished parks its buffer with the worker until
//! UCX completes it (or the worker is destroyed), so no safe use can free memory under UCX.
//! One exception, checked here: when the endpoint's peer is a process on this host that has
//! exited, and the endpoint was closed at least [`ORPHAN_GRACE`] before, nothing can make UCX
//! touch the buffer any more, and it is let go (see [`Worker::progress`]). Without it, an
//! operation that UCX never completes (UCX 1.13 over shared memory cannot detect a dead
//! peer) would pin its registration until the backend shuts down.

use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_uint, c_void, CStr, CString};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr;
use std::rc::Rc;
use std::sync::{Arc, Once};
use std::time::Duration;

use parking_lot::Mutex;
use xfer_core::{BackendBuffer, LocalMem};
use xfer_ucx_sys as sys;

/// A UCS status other than `UCS_OK`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Status(pub sys::ucs_status_t);

impl Status {
    fn check(status: sys::ucs_status_t) -> Result<(), Status> {
        if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(Status(status))
        }
    }

    pub fn is_unreachable(self) -> bool {
        self.0 == sys::UCS_ERR_UNREACHABLE
    }

    /// The connection to the peer is gone (reset, unreachable, timed out at the link).
    pub fn is_peer_failure(self) -> bool {
        matches!(
            self.0,
            sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_ENDPOINT_TIMEOUT
                | sys::UCS_ERR_IO_ERROR
                | sys::UCS_ERR_CANCELED
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE..=sys::UCS_ERR_FIRST_LINK_FAILURE).contains(&self.0)
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated string for
        // every value, known or not.
        let text = unsafe { CStr::from_ptr(sys::ucs_status_string(self.0)) };
        write!(f, "{} ({})", text.to_string_lossy(), self.0)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// The UCX library's version, e.g. `(1, 13, 1)`.
pub fn version() -> (u32, u32, u32) {
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: the three pointers are valid for writes.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    (major, minor, release)
}

/// A UCP configuration read from the environment (`UCX_*`), then modified by parameters.
pub struct Config {
    raw: *mut sys::ucp_config_t,
}

impl Config {
    pub fn from_env() -> Result<Config, Status> {
        let mut raw = ptr::null_mut();
        // SAFETY: null prefix and file name select the defaults; `raw` is valid for a write.
        Status::check(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut raw) })?;
        Ok(Config { raw })
    }

    /// Sets a UCX option by its name without the `UCX_` prefix (`TLS`, `NET_DEVICES`, ...).
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), Status> {
        let (Ok(name), Ok(value)) = (CString::new(name), CString::new(value)) else {
            return Err(Status(sys::UCS_ERR_INVALID_PARAM));
        };
        // SAFETY: `raw` is a live configuration; both strings are NUL-terminated and outlive
        // the call (UCX copies the value).
        Status::check(unsafe { sys::ucp_config_modify(self.raw, name.as_ptr(), value.as_ptr()) })
    }
}

impl Drop for Config {
    fn drop(&mut self) {
        // SAFETY: `raw` came from ucp_config_read and is released once.
        unsafe { sys::ucp_config_release(self.raw) }
    }
}

struct ContextInner {
    raw: sys::ucp_context_h,
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every worker and memory handle holds an Rc of this, so none is left.
        unsafe { sys::ucp_cleanup(self.raw) }
    }
}

/// A UCP context with the RMA, active-message and wakeup features.
#[derive(Clone)]
pub struct Context {
    inner: Rc<ContextInner>,
}

impl Context {
    pub fn new(config: &Config) -> Result<Context, Status> {
        let params = sys::ucp_params_t {
            field_mask: u64::from(sys::UCP_PARAM_FIELD_FEATURES),
            features: u64::from(sys::UCP_FEATURE_RMA | sys::UCP_FEATURE_AM | sys::UCP_FEATURE_WAKEUP),
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: params is fully initialised (unused fields zero, excluded by field_mask),
        // config is live, `raw` is valid for a write.
        Status::check(unsafe { sys::ucp_init(&params, config.raw, &mut raw) })?;
        Ok(Context { inner: Rc::new(ContextInner { raw }) })
    }

    /// Whether this UCX build and its loaded transports can move CUDA device memory.
    pub fn supports_cuda(&self) -> bool {
        let mut attr =
            sys::ucp_context_attr_t { field_mask: u64::from(sys::UCP_ATTR_FIELD_MEMORY_TYPES), ..Default::default() };
        // SAFETY: live context; `attr` is valid for writes and asks for one field.
        let status = unsafe { sys::ucp_context_query(self.inner.raw, &mut attr) };
        status == sys::UCS_OK && attr.memory_types & (1u64 << sys::UCS_MEMORY_TYPE_CUDA) != 0
    }

    /// Registers `addr .. addr + len` with every transport (`cuda`: device memory).
    ///
    /// Registration itself never dereferences the range on its own; transfers through it are
    /// what must respect the memory's lifetime, and those go through pinned [`MemSlice`]s.
    pub fn mem_map(&self, addr: u64, len: u64, cuda: bool) -> Result<MemHandle, Status> {
        let length = usize::try_from(len).map_err(|_| Status(sys::UCS_ERR_INVALID_PARAM))?;
        let mut params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH),
            address: addr as usize as *mut c_void,
            length,
            ..Default::default()
        };
        if cuda {
            params.field_mask |= u64::from(sys::UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE);
            params.memory_type = sys::UCS_MEMORY_TYPE_CUDA;
        }
        let mut raw = ptr::null_mut();
        // SAFETY: live context; params describe an existing range (no ALLOCATE flag), `raw` is
        // valid for a write.
        Status::check(unsafe { sys::ucp_mem_map(self.inner.raw, &params, &mut raw) })?;
        Ok(MemHandle { raw, ctx: Rc::clone(&self.inner) })
    }

    /// Has UCX allocate `len` bytes of host memory and register it with every transport
    /// (`UCP_MEM_MAP_ALLOCATE`, no address hint): UCX picks the method by `UCX_ALLOC_PRIO`,
    /// shared-memory segments first when a shared-memory transport is loaded, which peers on
    /// this host then map to reach the memory with plain copies. Returns the handle and the
    /// range UCX allocated (at least `len` bytes), which stays mapped until the handle drops.
    pub fn mem_alloc(&self, len: u64) -> Result<(MemHandle, AllocatedRange), Status> {
        let length = usize::try_from(len).map_err(|_| Status(sys::UCS_ERR_INVALID_PARAM))?;
        if length == 0 {
            return Err(Status(sys::UCS_ERR_INVALID_PARAM));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS,
            ),
            address: ptr::null_mut(),
            length,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: live context; a null address with ALLOCATE asks UCX for fresh memory (no
        // existing range is touched); `raw` is valid for a write.
        Status::check(unsafe { sys::ucp_mem_map(self.inner.raw, &params, &mut raw) })?;
        let memh = MemHandle { raw, ctx: Rc::clone(&self.inner) };
        let (addr, got) = memh.range()?;
        if addr == 0 || got < len {
            // Dropping the handle unmaps what UCX gave.
            return Err(Status(sys::UCS_ERR_NO_MEMORY));
        }
        // Back every page now: a shared-memory segment larger than its file system can hold
        // would raise SIGBUS at the first touch of a missing page, and MADV_POPULATE_WRITE
        // (Linux 5.14) reports that as an error instead. Older kernels, and ranges that do not
        // start on a page, refuse the advice (EINVAL): the pages are then first touched when the
        // buffer is zeroed.
        // SAFETY: the range is the mapping UCX just made for us; populating allocates pages
        // (zero-filled, or the segment's existing ones) without changing any byte.
        let populated = unsafe { libc::madvise(addr as usize as *mut c_void, length, libc::MADV_POPULATE_WRITE) };
        if populated != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) {
                tracing::warn!(%err, len, "ucx allocation cannot be backed (is /dev/shm large enough?)");
                return Err(Status(sys::UCS_ERR_NO_MEMORY));
            }
        }
        Ok((memh, AllocatedRange { addr, len: got }))
    }
}

/// The range of a [`Context::mem_alloc`] allocation (only that makes one): mapped until its
/// handle drops.
#[derive(Debug)]
pub struct AllocatedRange {
    addr: u64,
    len: u64,
}

impl AllocatedRange {
    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    /// The application's view of the first `len` bytes (at most the range). `keep` must hold
    /// the allocation: the engine keeps the range's [`MemHandle`] (so the memory mapped) until
    /// `keep` drops, and longer while registrations inside it live (see
    /// `Engine::release_allocation`, reached only from `keep`'s drop).
    pub fn into_buffer(
        self,
        len: usize,
        backend: &'static str,
        keep: Box<dyn std::any::Any + std::marker::Send + Sync>,
    ) -> Option<BackendBuffer> {
        if len as u64 > self.len {
            return None;
        }
        // SAFETY: `addr .. addr + len` lies in memory UCX allocated for us (read and write,
        // host memory) and keeps mapped while `keep` lives (above); nothing in this crate hands
        // it out as Rust references, only the buffer's copies and UCX's own accesses touch it.
        Some(unsafe { BackendBuffer::new(self.addr as usize as *mut u8, len, backend, keep) })
    }
}

/// A registration (`ucp_mem_map`); unmapped on drop.
pub struct MemHandle {
    raw: sys::ucp_mem_h,
    ctx: Rc<ContextInner>,
}

impl MemHandle {
    /// The packed remote key peers unpack to reach this memory.
    pub fn pack_rkey(&self) -> Result<Vec<u8>, Status> {
        let mut buf = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: live context and handle; both out-pointers are valid for writes.
        Status::check(unsafe { sys::ucp_rkey_pack(self.ctx.raw, self.raw, &mut buf, &mut size) })?;
        // SAFETY: on success UCX hands out `size` readable bytes at `buf`, copied here and then
        // released once.
        let packed = unsafe { std::slice::from_raw_parts(buf as *const u8, size).to_vec() };
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(packed)
    }
}

impl MemHandle {
    /// The start address and length of the mapped range (`ucp_mem_query`).
    pub fn range(&self) -> Result<(u64, u64), Status> {
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: u64::from(sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH),
            ..Default::default()
        };
        // SAFETY: live handle; `attr` is valid for writes and asks for two plain fields.
        Status::check(unsafe { sys::ucp_mem_query(self.raw, &mut attr) })?;
        Ok((attr.address as usize as u64, attr.length as u64))
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_mem_map on this context (kept alive by the Rc) and
        // is unmapped once. Transfers through it hold pins that the caller released first.
        let status = unsafe { sys::ucp_mem_unmap(self.ctx.raw, self.raw) };
        if status != sys::UCS_OK {
            tracing::warn!(status = %Status(status), "ucp_mem_unmap failed");
        }
    }
}

/// What UCX reported from inside `ucp_worker_progress`.
#[derive(Debug)]
pub enum Event {
    /// An active message with our id: its payload, and how to answer its sender (valid until
    /// the next [`Worker::progress`]).
    Message { payload: Vec<u8>, reply: Option<ReplyTo> },
    /// An endpoint failed (its id, see [`Endpoint::id`]).
    EndpointFailed { ep: usize, status: Status },
}

/// Where the C callbacks leave events; read by the worker's owner after each progress call.
#[derive(Default)]
struct EventSink {
    events: RefCell<Vec<Event>>,
    /// Counts progress calls: a [`ReplyTo`] is only good within the call that produced it.
    generation: Cell<u64>,
}

/// The endpoint UCX created for the sender of a message, to answer on. UCX may release it
/// during any later progress call, so it is usable only before the next one (checked).
#[derive(Debug)]
pub struct ReplyTo {
    ep: usize,
    generation: u64,
}

/// A request UCX still owns memory for: freed (and its keep-alive dropped) once complete, or
/// once its peer is known gone (see [`EpState::orphaned`]).
struct Parked {
    req: *mut c_void,
    _keep: Box<dyn std::any::Any>,
    ep: Option<Rc<EpState>>,
}

/// How long after an endpoint closed its abandoned requests may be let go, once its peer
/// process is gone: the worker keeps progressing meanwhile, so whatever the peer sent before
/// it died has been handled.
pub const ORPHAN_GRACE: Duration = Duration::from_secs(2);
/// How often parked requests are checked for a gone peer.
const ORPHAN_CHECK: Duration = Duration::from_millis(200);

/// What requests know of their endpoint: the peer's process, when it runs on this host, and
/// when the endpoint was closed.
#[derive(Debug, Default)]
struct EpState {
    /// The peer's pid, meaningful here (same boot and pid namespace, see [`connect`]).
    ///
    /// [`connect`]: Worker::connect
    local_pid: Option<u32>,
    closed_at: Cell<Option<std::time::Instant>>,
}

impl EpState {
    /// Whether UCX can no longer touch the buffers of this endpoint's unfinished requests: the
    /// endpoint is closed (no new traffic), for long enough that anything the peer sent before
    /// was handled, and the peer process has exited (it sends nothing more; a pid reused by
    /// another process reads as alive, which only keeps the memory pinned longer).
    fn orphaned(&self, now: std::time::Instant) -> bool {
        let closed_long_ago = self.closed_at.get().is_some_and(|at| now.saturating_duration_since(at) >= ORPHAN_GRACE);
        closed_long_ago && self.local_pid.is_some_and(process_exited)
    }
}

/// Whether process `pid` of this pid namespace has exited (gone, or a zombie).
fn process_exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(err) => err.kind() == std::io::ErrorKind::NotFound,
        Ok(stat) => stat.rsplit_once(") ").is_some_and(|(_, rest)| rest.starts_with(['Z', 'X'])),
    }
}

struct WorkerInner {
    raw: sys::ucp_worker_h,
    sink: Box<EventSink>,
    parked: RefCell<Vec<Parked>>,
    orphans_checked: Cell<Option<std::time::Instant>>,
    signal: Arc<Mutex<Option<SignalTarget>>>,
    _ctx: Rc<ContextInner>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        *self.signal.lock() = None;
        // SAFETY: every endpoint holds an Rc of this, so none is left; the sink outlives the
        // worker (dropped after this body), so no callback can see it freed.
        unsafe { sys::ucp_worker_destroy(self.raw) };
        // Destroying the worker released its requests: UCX no longer touches parked memory.
        self.parked.get_mut().clear();
    }
}

#[derive(Clone, Copy)]
struct SignalTarget(sys::ucp_worker_h);

// SAFETY: the handle is only used for ucp_worker_signal, which UCX documents as safe from any
// thread; the Mutex<Option<..>> around it is cleared before the worker is destroyed.
unsafe impl std::marker::Send for SignalTarget {}

/// Wakes a thread waiting on the worker's event fd, from any thread (`ucp_worker_signal`).
#[derive(Clone)]
pub struct Signaler(Arc<Mutex<Option<SignalTarget>>>);

impl Signaler {
    /// Wakes the worker; a no-op once it is destroyed.
    pub fn signal(&self) {
        if let Some(target) = *self.0.lock() {
            // SAFETY: the worker is alive: its destructor clears this slot under the same lock
            // before destroying it. ucp_worker_signal may be called from any thread.
            unsafe { sys::ucp_worker_signal(target.0) };
        }
    }
}

impl fmt::Debug for Signaler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Signaler")
    }
}

/// Owns a worker's whole object graph (context, worker, endpoints, registrations, requests in
/// flight): the graph uses `Rc` and `RefCell` inside, so it must never be reached from two
/// threads at once, but as a whole it may move from thread to thread. Access goes through
/// [`WorkerCell::with`] on the thread that holds the cell (behind the owner's lock).
///
/// Nothing built from the graph can leave it: `build` and `with` take `Send` closures (they
/// cannot capture a non-`Send` place to stash an `Rc` in) and return `Send` values (which
/// cannot hold one). This crate never keeps UCX objects in thread-locals, the one way around.
pub struct WorkerCell<T> {
    value: T,
}

// SAFETY: every `Rc`/`RefCell` reachable from `value` was created inside `build`/`with` and
// stays inside `value` (see above), so moving the cell moves all of them together and their
// non-atomic counts are only ever touched by the thread holding the cell. UCX itself allows
// a serialized worker (and its context, endpoints, keys and requests) to be used by any one
// thread at a time.
unsafe impl<T> std::marker::Send for WorkerCell<T> {}

impl<T> WorkerCell<T> {
    /// Builds the graph (on this thread).
    pub fn build<E: std::marker::Send>(
        build: impl FnOnce() -> Result<T, E> + std::marker::Send,
    ) -> Result<WorkerCell<T>, E> {
        Ok(WorkerCell { value: build()? })
    }

    /// Runs `f` on the graph, on this thread.
    pub fn with<R: std::marker::Send>(&mut self, f: impl FnOnce(&mut T) -> R + std::marker::Send) -> R {
        f(&mut self.value)
    }

    /// Turns the graph into another one (what `f` keeps of it; the rest drops inside `f`, on
    /// this thread), handing out only `Send` values besides.
    pub fn map<U, R: std::marker::Send>(self, f: impl FnOnce(T) -> (U, R) + std::marker::Send) -> (WorkerCell<U>, R) {
        let (value, out) = f(self.value);
        (WorkerCell { value }, out)
    }
}

/// Waits until `fd` (a worker's event file descriptor, see [`Worker::event_fd`]) is readable
/// or `timeout` passes. Needs no access to the worker itself, so it runs without the owner's
/// lock; the worker must outlive the call (its owner guarantees that).
pub fn wait_readable(fd: RawFd, timeout: Duration) {
    let mut pollfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd on the stack. A stale fd number would only make poll report
    // POLLNVAL, never touch memory. EINTR and timeouts simply return; the caller decides again.
    unsafe { libc::poll(&mut pollfd, 1, millis) };
}

/// Active-message id of every xfer message (notifications and control).
const AM_ID: u32 = 0x78_66; // "xf"

/// A UCP worker in serialized mode (any thread, one at a time: see [`WorkerCell`]) with our
/// active-message handler installed.
pub struct Worker {
    inner: Rc<WorkerInner>,
}

impl Worker {
    pub fn new(ctx: &Context) -> Result<Worker, Status> {
        let params = sys::ucp_worker_params_t {
            field_mask: u64::from(sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE),
            thread_mode: sys::UCS_THREAD_MODE_SERIALIZED,
            ..Default::default()
        };
        let mut raw = ptr::null_mut();
        // SAFETY: live context; params initialised; `raw` valid for a write.
        Status::check(unsafe { sys::ucp_worker_create(ctx.inner.raw, &params, &mut raw) })?;
        let sink = Box::<EventSink>::default();
        let inner = Rc::new(WorkerInner {
            raw,
            signal: Arc::new(Mutex::new(Some(SignalTarget(raw)))),
            sink,
            parked: RefCell::new(Vec::new()),
            orphans_checked: Cell::new(None),
            _ctx: Rc::clone(&ctx.inner),
        });
        let handler = sys::ucp_am_handler_param_t {
            field_mask: u64::from(
                sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG
                    | sys::UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            ),
            id: AM_ID,
            flags: sys::UCP_AM_FLAG_WHOLE_MSG,
            cb: Some(on_message),
            arg: &*inner.sink as *const EventSink as *mut c_void,
        };
        // SAFETY: live worker; the handler's arg points into a Box owned by the worker's
        // inner state, which outlives the worker itself (see WorkerInner::drop).
        Status::check(unsafe { sys::ucp_worker_set_am_recv_handler(inner.raw, &handler) })?;
        Ok(Worker { inner })
    }

    /// The address peers create endpoints from.
    pub fn address(&self) -> Result<Vec<u8>, Status> {
        let mut attr =
            sys::ucp_worker_attr_t { field_mask: u64::from(sys::UCP_WORKER_ATTR_FIELD_ADDRESS), ..Default::default() };
        // SAFETY: live worker; `attr` valid for writes.
        Status::check(unsafe { sys::ucp_worker_query(self.inner.raw, &mut attr) })?;
        // SAFETY: on success UCX provides `address_length` readable bytes at `address`.
        let bytes = unsafe { std::slice::from_raw_parts(attr.address as *const u8, attr.address_length).to_vec() };
        // SAFETY: the address came from ucp_worker_query on this worker; released once.
        unsafe { sys::ucp_worker_release_address(self.inner.raw, attr.address) };
        Ok(bytes)
    }

    pub fn signaler(&self) -> Signaler {
        Signaler(Arc::clone(&self.inner.signal))
    }

    /// Runs UCX's progress once; returns how many events it processed. Completed parked
    /// requests are released here too, and (every [`ORPHAN_CHECK`]) those whose peer process
    /// has exited.
    pub fn progress(&self) -> u32 {
        let sink = &self.inner.sink;
        sink.generation.set(sink.generation.get() + 1);
        // SAFETY: live worker, used by one thread at a time (it is in a WorkerCell).
        let count = unsafe { sys::ucp_worker_progress(self.inner.raw) };
        let mut parked = self.inner.parked.borrow_mut();
        if parked.is_empty() {
            return count;
        }
        let now = std::time::Instant::now();
        let checked = self.inner.orphans_checked.get();
        let check_orphans = checked.is_none_or(|at| now.saturating_duration_since(at) >= ORPHAN_CHECK);
        if check_orphans {
            self.inner.orphans_checked.set(Some(now));
        }
        parked.retain(|parked| match request_status(parked.req) {
            None if check_orphans && parked.ep.as_ref().is_some_and(|ep| ep.orphaned(now)) => {
                tracing::debug!("ucx: letting go of a request whose peer process exited");
                // SAFETY: a request we own, released once (then dropped from the list, which
                // drops its buffer's keep-alive). UCX frees an unfinished request once it
                // completes; it cannot touch the buffer any more (see EpState::orphaned).
                unsafe { sys::ucp_request_free(parked.req) };
                false
            }
            None => true,
            Some(_) => {
                // SAFETY: a completed request we own, freed once (then dropped from the list).
                unsafe { sys::ucp_request_free(parked.req) };
                false
            }
        });
        count
    }

    /// Events since the last call, in order.
    pub fn take_events(&self) -> Vec<Event> {
        std::mem::take(&mut *self.inner.sink.events.borrow_mut())
    }

    /// Whether parked requests are still running.
    pub fn has_parked(&self) -> bool {
        !self.inner.parked.borrow().is_empty()
    }

    /// Arms the worker's event file descriptor: `true` when armed (safe to wait on
    /// [`event_fd`](Worker::event_fd)), `false` when events are pending and the caller should
    /// progress instead.
    pub fn arm(&self) -> Result<bool, Status> {
        // SAFETY: live worker (created with the WAKEUP feature), one thread at a time.
        match unsafe { sys::ucp_worker_arm(self.inner.raw) } {
            sys::UCS_OK => Ok(true),
            sys::UCS_ERR_BUSY => Ok(false),
            other => Err(Status(other)),
        }
    }

    /// The file descriptor that turns readable when the armed worker has an event or
    /// [`Signaler::signal`] is called (see [`wait_readable`]); valid while the worker lives.
    pub fn event_fd(&self) -> Result<RawFd, Status> {
        let mut fd: RawFd = -1;
        // SAFETY: live worker (created with the WAKEUP feature); `fd` valid for a write.
        Status::check(unsafe { sys::ucp_worker_get_efd(self.inner.raw, &mut fd) })?;
        Ok(fd)
    }

    /// Answers a message's sender with an eager active message. Fails with
    /// `UCS_ERR_NO_ELEM` once the worker has progressed since the message arrived.
    pub fn reply(&self, to: &ReplyTo, payload: Vec<u8>) -> Result<Send, Status> {
        if to.generation != self.inner.sink.generation.get() {
            return Err(Status(sys::UCS_ERR_NO_ELEM));
        }
        let ep = to.ep as sys::ucp_ep_h;
        Ok(Send(am_send(ep, payload, false, &self.inner)))
    }

    /// Creates an endpoint to a peer's worker address. With `peer_errors`, in peer
    /// error-handling mode: failures are reported as [`Event::EndpointFailed`] (UCX then
    /// accepts only transports that can detect a failed peer). `local_pid`: the peer's process
    /// id when it runs on this host in this pid namespace (checked by the caller: it lets
    /// requests to the peer go once it has exited).
    pub fn connect(&self, address: &[u8], peer_errors: bool, local_pid: Option<u32>) -> Result<Endpoint, Status> {
        let mut params = sys::ucp_ep_params_t {
            field_mask: u64::from(
                sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            address: address.as_ptr() as *const sys::ucp_address_t,
            err_mode: sys::UCP_ERR_HANDLING_MODE_PEER,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(on_endpoint_error),
                arg: &*self.inner.sink as *const EventSink as *mut c_void,
            },
            ..Default::default()
        };
        if !peer_errors {
            params.field_mask = u64::from(sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
        }
        let mut raw = ptr::null_mut();
        // SAFETY: live worker; the address bytes are read during the call only. UCX parses
        // them without a length, so callers pass only addresses checked by our own framing
        // (a worker address as another UCX worker published it). The error handler's arg
        // outlives every endpoint (owned by the worker).
        Status::check(unsafe { sys::ucp_ep_create(self.inner.raw, &params, &mut raw) })?;
        let state = Rc::new(EpState { local_pid, closed_at: Cell::new(None) });
        Ok(Endpoint { raw, worker: Rc::clone(&self.inner), state })
    }

    /// [`Worker::connect`] in peer error-handling mode, asked only to learn whether the
    /// transports can detect a failed peer: when none can (UCX 1.13's shared memory), the
    /// refusal is `UCS_ERR_UNREACHABLE` and the caller connects without it. UCX also logs that
    /// refusal at ERROR level, which on a healthy connection would tell an operator something
    /// is broken; the log lines of transport selection this call causes are dropped.
    pub fn connect_probing(&self, address: &[u8], local_pid: Option<u32>) -> Result<Endpoint, Status> {
        static HANDLER: Once = Once::new();
        HANDLER.call_once(|| {
            let handler: LogHandler = drop_probe_refusal;
            // SAFETY: UCS calls the handler with these seven arguments; the last, a `va_list`,
            // is passed as one pointer-sized value on the ABIs UCX runs on (a pointer on
            // x86-64 and ppc64le; on aarch64 a 32-byte struct, which AAPCS64 passes by
            // reference), and the handler never reads it, so declaring it a `*mut c_void`
            // changes nothing at the call. Pushed once per process and never popped.
            unsafe {
                sys::ucs_log_push_handler(std::mem::transmute::<Option<LogHandler>, sys::ucs_log_func_t>(Some(handler)))
            };
        });
        PROBING.set(true);
        let probe = self.connect(address, true, local_pid);
        PROBING.set(false);
        probe
    }
}

thread_local! {
    /// Set while this thread runs [`Worker::connect_probing`].
    static PROBING: Cell<bool> = const { Cell::new(false) };
}

/// `ucs_log_func_t` with its `va_list` as an opaque pointer (see [`Worker::connect_probing`]).
type LogHandler = unsafe extern "C" fn(
    *const c_char,
    c_uint,
    *const c_char,
    sys::ucs_log_level_t,
    *const sys::ucs_log_component_config_t,
    *const c_char,
    *mut c_void,
) -> sys::ucs_log_func_rc_t;

/// Stops UCS's error lines from transport selection (`wireup/select.c`) on a thread that is
/// probing; every other line goes on to UCS's own handler.
unsafe extern "C" fn drop_probe_refusal(
    file: *const c_char,
    _line: c_uint,
    _function: *const c_char,
    level: sys::ucs_log_level_t,
    _component: *const sys::ucs_log_component_config_t,
    _message: *const c_char,
    _args: *mut c_void,
) -> sys::ucs_log_func_rc_t {
    if level != sys::UCS_LOG_LEVEL_ERROR || !PROBING.get() || file.is_null() {
        return sys::UCS_LOG_FUNC_RC_CONTINUE;
    }
    // SAFETY: UCS passes its `__FILE__`, a static NUL-terminated string.
    let file = unsafe { CStr::from_ptr(file) };
    if file.to_bytes().ends_with(b"select.c") {
        sys::UCS_LOG_FUNC_RC_STOP
    } else {
        sys::UCS_LOG_FUNC_RC_CONTINUE
    }
}

/// An eager active-message send on `ep` (one of ours, or a reply endpoint before the next
/// progress call).
fn am_send(ep: sys::ucp_ep_h, payload: Vec<u8>, want_reply: bool, worker: &Rc<WorkerInner>) -> Pending {
    let mut flags = sys::UCP_AM_SEND_FLAG_EAGER;
    if want_reply {
        flags |= sys::UCP_AM_SEND_FLAG_REPLY;
    }
    let param = sys::ucp_request_param_t { op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS, flags, ..Default::default() };
    // SAFETY: `ep` is live (see the callers); the payload's heap buffer moves into the Pending
    // below (moving a Vec does not move its heap bytes) and lives until UCX completes the send.
    let ptr = unsafe {
        sys::ucp_am_send_nbx(ep, AM_ID, ptr::null(), 0, payload.as_ptr() as *const c_void, payload.len(), &param)
    };
    Pending::new(started(ptr), Box::new(payload), worker, None)
}

/// Status of a request: `None` while in progress.
fn request_status(req: *mut c_void) -> Option<Result<(), Status>> {
    // SAFETY: `req` is a live request returned by a UCP call and not yet freed.
    match unsafe { sys::ucp_request_check_status(req) } {
        sys::UCS_INPROGRESS => None,
        status => Some(Status::check(status)),
    }
}

/// The address UCX reads or writes for `local`: host memory's, or a device pointer. Files have
/// none (`Conn::start` never passes one; refused as unsupported all the same).
fn local_address(local: &LocalMem) -> Result<u64, Status> {
    local.address().ok_or(Status(sys::UCS_ERR_UNSUPPORTED))
}

/// Turns a `ucs_status_ptr_t` into done (`None`), a request, or an error.
fn started(ptr: sys::ucs_status_ptr_t) -> Result<Option<*mut c_void>, Status> {
    if sys::ucs_ptr_is_err(ptr) {
        Err(Status(sys::ucs_ptr_status(ptr)))
    } else if ptr.is_null() {
        Ok(None)
    } else {
        Ok(Some(ptr))
    }
}

unsafe extern "C" fn on_message(
    arg: *mut c_void,
    _header: *const c_void,
    _header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> sys::ucs_status_t {
    // SAFETY: UCX passes back the arg we installed: the worker's EventSink, alive while the
    // worker is. Callbacks run inside ucp_worker_progress on the thread holding the worker, while no
    // borrow of the sink is held.
    let sink = unsafe { &*(arg as *const EventSink) };
    // SAFETY: UCX passes a valid parameter struct for the duration of the callback.
    let attr = unsafe { (*param).recv_attr };
    if attr & u64::from(sys::UCP_AM_RECV_ATTR_FLAG_RNDV) != 0 || (data.is_null() && length != 0) {
        // Our senders use eager messages only; a rendezvous one is not ours to fetch. Returning
        // OK lets UCX release its descriptor.
        tracing::warn!(length, "ignoring an active message that is not eager");
        return sys::UCS_OK;
    }
    let reply_ep = if attr & u64::from(sys::UCP_AM_RECV_ATTR_FIELD_REPLY_EP) != 0 {
        // SAFETY: as above.
        unsafe { (*param).reply_ep }
    } else {
        ptr::null_mut()
    };
    let reply = (!reply_ep.is_null()).then(|| ReplyTo { ep: reply_ep as usize, generation: sink.generation.get() });
    let payload = if length == 0 {
        Vec::new()
    } else {
        // SAFETY: with the DATA flag, `data` holds `length` readable bytes during the callback.
        unsafe { std::slice::from_raw_parts(data as *const u8, length).to_vec() }
    };
    sink.events.borrow_mut().push(Event::Message { payload, reply });
    sys::UCS_OK
}

unsafe extern "C" fn on_endpoint_error(arg: *mut c_void, ep: sys::ucp_ep_h, status: sys::ucs_status_t) {
    // SAFETY: as in `on_message`: the arg is the worker's sink, used by the thread holding the worker.
    let sink = unsafe { &*(arg as *const EventSink) };
    sink.events.borrow_mut().push(Event::EndpointFailed { ep: ep as usize, status: Status(status) });
}

/// A peer's registration, unpacked on one endpoint (`ucp_ep_rkey_unpack`).
pub struct Rkey {
    raw: sys::ucp_rkey_h,
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: the handle came from ucp_ep_rkey_unpack and is destroyed once.
        unsafe { sys::ucp_rkey_destroy(self.raw) }
    }
}

/// An endpoint to one peer worker.
pub struct Endpoint {
    raw: sys::ucp_ep_h,
    worker: Rc<WorkerInner>,
    state: Rc<EpState>,
}

impl Endpoint {
    /// Identifies this endpoint in [`Event::EndpointFailed`].
    pub fn id(&self) -> usize {
        self.raw as usize
    }

    /// Unpacks a peer's packed remote key. The bytes must be a key that a UCX peer packed
    /// (UCX trusts their inner lengths); callers check their own framing and checksum first.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<Rkey, Status> {
        let mut raw = ptr::null_mut();
        // SAFETY: live endpoint; `packed` is readable for the call; `raw` valid for a write.
        Status::check(unsafe { sys::ucp_ep_rkey_unpack(self.raw, packed.as_ptr() as *const c_void, &mut raw) })?;
        Ok(Rkey { raw })
    }

    fn rma_param(memh: Option<&MemHandle>) -> sys::ucp_request_param_t {
        let mut param = sys::ucp_request_param_t::default();
        if let Some(memh) = memh {
            param.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_MEMH;
            param.memh = memh.raw;
        }
        param
    }

    /// Starts writing `local` to the peer at `remote_addr`. The returned operation keeps the
    /// slice until UCX completes it (a completed put no longer reads its buffer; remote
    /// visibility needs a [`flush`](Self::flush)). `memh` is the local registration holding
    /// `local`, when known.
    pub fn put(
        &mut self,
        local: LocalMem,
        remote_addr: u64,
        rkey: &Rkey,
        memh: Option<&MemHandle>,
    ) -> Result<Rma, Status> {
        let param = Self::rma_param(memh);
        let addr = local_address(&local)?;
        // SAFETY: live endpoint and rkey; `local` is pinned registered memory (host, or device
        // memory of a CUDA-enabled UCX: `Conn::start` refuses anything else), kept by the
        // returned Rma (or parked with the worker) until UCX has completed the put.
        let ptr = unsafe {
            sys::ucp_put_nbx(
                self.raw,
                addr as usize as *const c_void,
                local.len() as usize,
                remote_addr,
                rkey.raw,
                &param,
            )
        };
        self.rma_started(ptr, local)
    }

    /// Starts reading the peer's `remote_addr` into `local`; kept like [`put`](Self::put).
    pub fn get(
        &mut self,
        local: LocalMem,
        remote_addr: u64,
        rkey: &Rkey,
        memh: Option<&MemHandle>,
    ) -> Result<Rma, Status> {
        let param = Self::rma_param(memh);
        let addr = local_address(&local)?;
        // SAFETY: as in `put`; UCX writes `local.len()` bytes into the pinned memory, which no
        // Rust reference aliases while the transfer owns it.
        let ptr = unsafe {
            sys::ucp_get_nbx(
                self.raw,
                addr as usize as *mut c_void,
                local.len() as usize,
                remote_addr,
                rkey.raw,
                &param,
            )
        };
        self.rma_started(ptr, local)
    }

    fn rma_started(&mut self, ptr: sys::ucs_status_ptr_t, local: LocalMem) -> Result<Rma, Status> {
        // Completed in place or failed to start: UCX is done with the buffer, which drops
        // here; otherwise the operation keeps it until UCX completes the request.
        let started = started(ptr)?;
        Ok(Rma(Pending::new(Ok(started), Box::new(local), &self.worker, Some(&self.state))))
    }

    /// Starts a flush: complete once every earlier put and get is complete locally and
    /// remotely.
    pub fn flush(&mut self) -> Flush {
        let param = sys::ucp_request_param_t::default();
        // SAFETY: live endpoint; no callback is requested.
        let ptr = unsafe { sys::ucp_ep_flush_nbx(self.raw, &param) };
        Flush(Pending::new(started(ptr), Box::new(()), &self.worker, Some(&self.state)))
    }

    /// Sends an eager active message carrying `payload`, which the receiver can answer (it
    /// gets a [`ReplyTo`]); the send owns the bytes.
    pub fn send(&self, payload: Vec<u8>) -> Send {
        let mut pending = am_send(self.raw, payload, true, &self.worker);
        pending.ep = Some(Rc::clone(&self.state));
        Send(pending)
    }

    /// Closes the endpoint. `force`: without flushing, failing its outstanding operations.
    pub fn close(mut self, force: bool) -> Close {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: if force { sys::UCP_EP_CLOSE_FLAG_FORCE } else { 0 },
            ..Default::default()
        };
        // SAFETY: live endpoint, closed once (`self` is consumed and Drop skips closed ones).
        let ptr = unsafe { sys::ucp_ep_close_nbx(self.raw, &param) };
        self.raw = ptr::null_mut();
        self.state.closed_at.set(Some(std::time::Instant::now()));
        Close(Pending::new(started(ptr), Box::new(()), &self.worker, None))
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: live endpoint, force-closed once; a pending close is parked until complete.
        let ptr = unsafe { sys::ucp_ep_close_nbx(self.raw, &param) };
        self.state.closed_at.set(Some(std::time::Instant::now()));
        drop(Pending::new(started(ptr), Box::new(()), &self.worker, None));
    }
}

/// A request in flight and what UCX may touch until it completes.
struct Pending {
    req: Option<*mut c_void>,
    result: Option<Result<(), Status>>,
    keep: Option<Box<dyn std::any::Any>>,
    worker: Rc<WorkerInner>,
    /// The endpoint it runs on (none for endpoint closes and replies on UCX's endpoints).
    ep: Option<Rc<EpState>>,
}

impl Pending {
    fn new(
        started: Result<Option<*mut c_void>, Status>,
        keep: Box<dyn std::any::Any>,
        worker: &Rc<WorkerInner>,
        ep: Option<&Rc<EpState>>,
    ) -> Self {
        let (req, result) = match started {
            Ok(Some(req)) => (Some(req), None),
            Ok(None) => (None, Some(Ok(()))),
            Err(status) => (None, Some(Err(status))),
        };
        Pending { req, result, keep: Some(keep), worker: Rc::clone(worker), ep: ep.map(Rc::clone) }
    }

    /// `Some` once complete (the request is then freed).
    fn poll(&mut self) -> Option<Result<(), Status>> {
        if let Some(req) = self.req {
            let result = request_status(req)?;
            // SAFETY: a completed request we own, freed once.
            unsafe { sys::ucp_request_free(req) };
            self.req = None;
            self.result = Some(result);
        }
        self.result
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let (Some(req), Some(keep)) = (self.req.take(), self.keep.take()) {
            self.worker.parked.borrow_mut().push(Parked { req, _keep: keep, ep: self.ep.take() });
        }
    }
}

/// A put or get: its completion shows progress (its buffer stays with the endpoint's next
/// flush).
pub struct Rma(Pending);

impl Rma {
    pub fn poll(&mut self) -> Option<Result<(), Status>> {
        self.0.poll()
    }
}

/// A flush in flight.
pub struct Flush(Pending);

impl Flush {
    pub fn poll(&mut self) -> Option<Result<(), Status>> {
        self.0.poll()
    }
}

/// An active-message send in flight.
pub struct Send(Pending);

impl Send {
    pub fn poll(&mut self) -> Option<Result<(), Status>> {
        self.0.poll()
    }
}

/// An endpoint close in flight.
pub struct Close(Pending);

impl Close {
    pub fn poll(&mut self) -> Option<Result<(), Status>> {
        self.0.poll()
    }
}
