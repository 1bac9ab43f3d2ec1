//! The only module that calls libfabric: provider discovery (`fi_getinfo`), one RDM endpoint
//! with its fabric, domain, address vector and completion queue, memory registrations, and the
//! operations in flight. Everything the provider may touch until a completion (operation
//! contexts, local memory, message buffers) is owned here until the CQ hands it back or the
//! endpoint is closed, so the safe API cannot free memory under the provider.
//!
//! An [`Endpoint`] is used by one thread at a time (`&mut self`), matching the
//! `FI_THREAD_DOMAIN` threading model asked for.

use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::ptr;
use std::sync::Arc;

use parking_lot::Mutex;

use xfer_core::{LocalRegion, MemSlice};
use xfer_libfabric_sys as sys;

/// A libfabric call that failed, with libfabric's own words for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {message} ({code})")]
pub struct FabricError {
    pub call: &'static str,
    /// The positive `FI_E*` / errno value.
    pub code: i32,
    pub message: String,
}

fn strerror(code: i32) -> String {
    // SAFETY: fi_strerror takes any number and returns a static NUL-terminated string.
    let text = unsafe { sys::fi_strerror(code) };
    if text.is_null() {
        return format!("error {code}");
    }
    // SAFETY: non-null, NUL-terminated and static (see above).
    unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
}

fn check(call: &'static str, ret: isize) -> Result<(), FabricError> {
    if ret >= 0 {
        return Ok(());
    }
    let code = i32::try_from(-ret).unwrap_or(i32::MAX);
    Err(FabricError { call, code, message: strerror(code) })
}

/// `FI_EAGAIN`: the provider has no room now; progress the CQ and post again.
const EAGAIN: i32 = libc::EAGAIN;
/// `FI_EAVAIL`: an error completion is waiting in the CQ's error queue.
const EAVAIL: i32 = sys::FI_EAVAIL as i32;

/// What the backend takes from the chosen provider's description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attrs {
    pub provider: String,
    pub fabric: String,
    pub domain: String,
    /// The `FI_MR_*` bits the provider needs from us.
    pub mr_mode: u32,
    /// Whether the provider moves device memory (FI_HMEM).
    pub hmem: bool,
    pub tx_size: usize,
    pub rx_size: usize,
    pub max_msg_size: u64,
    /// Local and remote iovecs one RMA operation may carry (the smaller of the two limits).
    pub max_iov: usize,
}

impl Attrs {
    pub fn virt_addr(&self) -> bool {
        self.mr_mode & sys::FI_MR_VIRT_ADDR != 0
    }
    pub fn prov_key(&self) -> bool {
        self.mr_mode & sys::FI_MR_PROV_KEY != 0
    }
    pub fn mr_local(&self) -> bool {
        self.mr_mode & sys::FI_MR_LOCAL != 0
    }
    pub fn mr_endpoint(&self) -> bool {
        self.mr_mode & sys::FI_MR_ENDPOINT != 0
    }
}

/// The `FI_MR_*` modes this backend handles; the provider keeps those it needs.
const MR_MODES: u32 =
    sys::FI_MR_LOCAL | sys::FI_MR_VIRT_ADDR | sys::FI_MR_ALLOCATED | sys::FI_MR_PROV_KEY | sys::FI_MR_ENDPOINT;

const CAPS: u64 = sys::FI_RMA as u64
    | sys::FI_MSG as u64
    | sys::FI_READ as u64
    | sys::FI_WRITE as u64
    | sys::FI_REMOTE_READ as u64
    | sys::FI_REMOTE_WRITE as u64
    | sys::FI_SEND as u64
    | sys::FI_RECV as u64;

/// An owned `fi_info` list.
struct InfoList(*mut sys::fi_info);

impl Drop for InfoList {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the list came from fi_getinfo or fi_dupinfo and is freed once, here.
            unsafe { sys::fi_freeinfo(self.0) };
        }
    }
}

fn dup_c(text: &str) -> Result<*mut libc::c_char, FabricError> {
    let owned = CString::new(text).map_err(|_| FabricError {
        call: "fi_getinfo",
        code: libc::EINVAL,
        message: format!("{text:?} holds a NUL byte"),
    })?;
    // SAFETY: strdup copies the NUL-terminated string into malloc'ed memory, which fi_freeinfo
    // frees with the hints.
    Ok(unsafe { libc::strdup(owned.as_ptr()) })
}

fn text(ptr: *const libc::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: libfabric's attribute strings are NUL-terminated and live as long as the info.
    unsafe { CStr::from_ptr(ptr) }.to_string_lossy().into_owned()
}

/// Every RDM endpoint description with RMA and messages, for `provider` (e.g. `tcp;ofi_rxm`)
/// and `domain` (e.g. `lo`) when given.
fn get_infos(provider: Option<&str>, domain: Option<&str>) -> Result<InfoList, FabricError> {
    // Ordered sends after writes where the provider offers it; otherwise the notification's
    // wait for the writes' completions alone orders them.
    // shm serves peers' RMA only inside our progress calls and reports nothing of it in the
    // CQ; remote RMA events let a counter show it (see `Endpoint::wait`), where offered.
    let events = provider == Some("shm");
    get_infos_with(provider, domain, true, events)
        .or_else(|_| get_infos_with(provider, domain, false, events))
        .or_else(|err| if events { get_infos_with(provider, domain, false, false) } else { Err(err) })
}

fn get_infos_with(
    provider: Option<&str>,
    domain: Option<&str>,
    ordered: bool,
    events: bool,
) -> Result<InfoList, FabricError> {
    // SAFETY: fi_allocinfo returns a zeroed fi_info with its attribute structs allocated (or
    // null); the fields set below are plain values or strings malloc'ed by `dup_c`, all freed
    // by fi_freeinfo with the hints.
    let hints = InfoList(unsafe { sys::xf_allocinfo() });
    if hints.0.is_null() {
        return Err(FabricError { call: "fi_allocinfo", code: libc::ENOMEM, message: strerror(libc::ENOMEM) });
    }
    let prov = provider.map(dup_c).transpose()?;
    let dom = domain.map(dup_c).transpose()?;
    // SAFETY: as above: every attribute pointer of a fresh fi_allocinfo is valid.
    unsafe {
        let h = &mut *hints.0;
        h.caps = if events { CAPS | sys::FI_RMA_EVENT } else { CAPS };
        h.mode = sys::FI_CONTEXT | sys::FI_CONTEXT2;
        (*h.ep_attr).type_ = sys::FI_EP_RDM;
        (*h.domain_attr).mr_mode = MR_MODES as i32;
        (*h.domain_attr).threading = sys::FI_THREAD_DOMAIN;
        // A notification sent after a write must not overtake its data at the target.
        if ordered {
            (*h.tx_attr).msg_order = u64::from(sys::FI_ORDER_SAW);
        }
        if let Some(prov) = prov {
            (*h.fabric_attr).prov_name = prov;
        }
        if let Some(dom) = dom {
            (*h.domain_attr).name = dom;
        }
    }
    let mut list = ptr::null_mut();
    // SAFETY: the hints are valid (above); fi_getinfo writes an owned list into `list`.
    let ret = unsafe { sys::fi_getinfo(sys::xf_header_version(), ptr::null(), ptr::null(), 0, hints.0, &mut list) };
    let list = InfoList(list);
    check("fi_getinfo", ret as isize)?;
    if list.0.is_null() {
        return Err(FabricError { call: "fi_getinfo", code: libc::ENODATA, message: "no provider matched".into() });
    }
    Ok(list)
}

/// One entry of an info list.
fn attrs_of(info: *const sys::fi_info) -> Attrs {
    // SAFETY: `info` is an entry of a live list; fi_getinfo fills in every attribute struct.
    unsafe {
        let i = &*info;
        Attrs {
            provider: text((*i.fabric_attr).prov_name),
            fabric: text((*i.fabric_attr).name),
            domain: text((*i.domain_attr).name),
            mr_mode: (*i.domain_attr).mr_mode as u32,
            hmem: i.caps & sys::FI_HMEM != 0,
            tx_size: (*i.tx_attr).size,
            rx_size: (*i.rx_attr).size,
            max_msg_size: (*i.ep_attr).max_msg_size as u64,
            max_iov: (*i.tx_attr).iov_limit.min((*i.tx_attr).rma_iov_limit).max(1),
        }
    }
}

/// Every candidate as `Attrs`, in libfabric's order.
pub fn candidates(provider: Option<&str>, domain: Option<&str>) -> Result<Vec<Attrs>, FabricError> {
    let list = get_infos(provider, domain)?;
    let mut out = Vec::new();
    let mut at = list.0.cast_const();
    while !at.is_null() {
        out.push(attrs_of(at));
        // SAFETY: `at` is an entry of the live list; `next` is the following entry or null.
        at = unsafe { (*at).next };
    }
    Ok(out)
}

/// A chosen provider description, ready for [`Endpoint::open`].
pub struct Info {
    list: InfoList,
    pub attrs: Attrs,
}

impl std::fmt::Debug for Info {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.attrs.fmt(f)
    }
}

impl Info {
    /// The entry `pick` chooses among the candidates (by their index in [`candidates`]).
    pub fn choose(
        provider: Option<&str>,
        domain: Option<&str>,
        pick: impl FnOnce(&[Attrs]) -> Option<usize>,
    ) -> Result<Info, FabricError> {
        let list = get_infos(provider, domain)?;
        let mut entries = Vec::new();
        let mut at = list.0;
        while !at.is_null() {
            entries.push(at);
            // SAFETY: as in `candidates`.
            at = unsafe { (*at).next };
        }
        let attrs: Vec<Attrs> = entries.iter().map(|&e| attrs_of(e)).collect();
        let index = pick(&attrs).ok_or_else(|| FabricError {
            call: "fi_getinfo",
            code: libc::ENODATA,
            message: "no candidate suits".into(),
        })?;
        let chosen = *entries.get(index).ok_or_else(|| FabricError {
            call: "fi_getinfo",
            code: libc::ENODATA,
            message: "no candidate suits".into(),
        })?;
        // SAFETY: fi_dupinfo deep-copies one entry (its `next` is not followed) into an owned
        // info freed by InfoList's drop.
        let one = InfoList(unsafe { sys::fi_dupinfo(chosen) });
        drop(list);
        if one.0.is_null() {
            return Err(FabricError { call: "fi_dupinfo", code: libc::ENOMEM, message: strerror(libc::ENOMEM) });
        }
        // SAFETY: the copy is a single entry; clearing `next` keeps fi_freeinfo to it.
        unsafe { (*one.0).next = ptr::null_mut() };
        Ok(Info { attrs: attrs_of(one.0), list: one })
    }
}

/// Direction of an RMA operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rma {
    Read,
    Write,
}

/// One local slice and the peer's range it meets.
#[derive(Debug)]
pub struct RmaPiece {
    pub local: MemSlice,
    /// As the peer's provider addresses it (virtual address or offset).
    pub remote: u64,
    pub key: u64,
}

/// A finished operation, as the CQ reports it.
#[derive(Debug)]
pub enum Done {
    Rma {
        token: u64,
        result: Result<(), CqError>,
    },
    Sent {
        token: u64,
        result: Result<(), CqError>,
    },
    /// A message arrived (`Ok` holds its bytes); the buffer is posted again.
    Received {
        result: Result<Vec<u8>, CqError>,
    },
}

/// An error completion.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CqError {
    pub code: i32,
    pub message: String,
}

/// What an operation keeps alive until the CQ reports it (held, not read, for Rma and Send).
enum Kind {
    Rma(#[allow(dead_code)] Vec<RmaPiece>),
    Send(#[allow(dead_code)] MsgBuf),
    Recv(MsgBuf),
}

struct InFlight {
    // Boxed so its address, handed to the provider, stays put while the map moves.
    ctx: Box<sys::fi_context2>,
    token: u64,
    kind: Kind,
}

/// A message buffer, registered when the provider wants local descriptors (FI_MR_LOCAL).
struct MsgBuf {
    data: Box<[u8]>,
    mr: Option<Mr>,
}

struct Mr(*mut sys::fid_mr);

impl Mr {
    fn desc(&self) -> *mut c_void {
        // SAFETY: the MR is open (closed only by Drop).
        unsafe { sys::xf_mr_desc(self.0) }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: an open MR, closed once; no operation that names it is in flight (regions
        // are deregistered once idle, message buffers once their operation completed).
        let ret = unsafe { sys::xf_close(&mut (*self.0).fid) };
        if ret != 0 {
            tracing::warn!(ret, "fi_close of a memory registration");
        }
    }
}

/// A registered region: its key for peers and its local descriptor.
struct Region {
    mr: Mr,
}

/// One RDM endpoint and everything it owns.
pub struct Endpoint {
    attrs: Attrs,
    info: InfoList,
    fabric: *mut sys::fid_fabric,
    domain: *mut sys::fid_domain,
    av: *mut sys::fid_av,
    cq: *mut sys::fid_cq,
    /// Counts peers' RMA served here, where the CQ is polled and the provider offers it.
    served: *mut sys::fid_cntr,
    ep: *mut sys::fid_ep,
    in_flight: HashMap<usize, InFlight>,
    regions: HashMap<u64, Region>,
    next_key: u64,
    /// The CQ as other threads may signal it; cleared before the CQ closes.
    waker: Waker,
    /// Writes ask for FI_DELIVERY_COMPLETE until the provider refuses the flag.
    delivery_complete: bool,
    /// shm only: each peer's process, by AV handle (see [`Endpoint::peer_blocks`]).
    shm_peers: HashMap<u64, u32>,
    /// A polled CQ: the `served` count last seen, and the next sleep when idle.
    served_seen: u64,
    poll_sleep: std::time::Duration,
}

/// Wakes the thread blocked in [`Endpoint::wait`] (`fi_cq_signal`), from any thread.
#[derive(Clone, Debug, Default)]
pub struct Waker(Arc<Mutex<Option<CqPtr>>>);

#[derive(Debug)]
struct CqPtr(*mut sys::fid_cq);

// SAFETY: the pointer is only used for fi_cq_signal, which exists to wake a CQ's waiter from
// another thread, and only while the CQ is open (the endpoint clears it, under the lock,
// before closing the CQ).
unsafe impl Send for CqPtr {}

impl Waker {
    pub fn wake(&self) {
        if let Some(cq) = self.0.lock().as_ref() {
            // SAFETY: the CQ is open while it is published here (see CqPtr).
            let _ = unsafe { sys::xf_cq_signal(cq.0) };
        }
    }
}

// SAFETY: libfabric objects are not tied to the thread that opened them; `&mut self` on every
// call keeps access serialised, as FI_THREAD_DOMAIN requires. The MemSlices held are Send.
unsafe impl Send for Endpoint {}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint").field("attrs", &self.attrs).field("in_flight", &self.in_flight.len()).finish()
    }
}

/// The longest an idle engine sleeps between polls of a CQ it cannot block on: the latency a
/// new job or a peer's RMA may wait there, against a thread that wakes 1000 times a second.
/// shm's target serves RMA only when polled and sees no completion for it, so a fixed sleep
/// paces its RMA; instead the sleep starts at [`POLL_MIN`] after activity (a completion, or
/// the remote-RMA counter moving) and doubles per quiet poll up to this.
const POLL_SLEEP: std::time::Duration = std::time::Duration::from_millis(1);
/// The sleep right after activity.
const POLL_MIN: std::time::Duration = std::time::Duration::from_micros(20);

/// The wait object an open CQ uses: the provider's answer to `FI_GETWAITOBJ`, or else what it
/// wrote back into the attributes at open (shm and sockets do not answer the query).
///
/// # Safety
/// `cq` is an open CQ.
unsafe fn cq_wait_obj(cq: *mut sys::fid_cq, written_back: sys::fi_wait_obj) -> sys::fi_wait_obj {
    let mut obj: sys::fi_wait_obj = sys::FI_WAIT_UNSPEC;
    // SAFETY: FI_GETWAITOBJ writes one `enum fi_wait_obj` into `obj` (the caller keeps the CQ
    // open).
    let ret =
        unsafe { sys::xf_control(fid_of(cq), sys::FI_GETWAITOBJ as i32, (&mut obj as *mut sys::fi_wait_obj).cast()) };
    if ret == 0 {
        obj
    } else {
        written_back
    }
}

/// Whether `fi_cq_sread` on this wait object returns when its timeout passes.
fn blocking_wait(obj: sys::fi_wait_obj) -> bool {
    matches!(obj, sys::FI_WAIT_FD | sys::FI_WAIT_POLLFD | sys::FI_WAIT_MUTEX_COND)
}

fn fid_of<T>(object: *mut T) -> *mut sys::fid {
    // Every fid_* struct starts with its `struct fid`.
    object.cast()
}

impl Endpoint {
    /// Opens fabric, domain, AV, CQ and an enabled RDM endpoint, and posts `recv_buffers`
    /// receive buffers of `recv_len` bytes each.
    pub fn open(info: Info, recv_buffers: usize, recv_len: usize) -> Result<Endpoint, FabricError> {
        let Info { list, attrs } = info;
        let mut ep = Endpoint {
            attrs,
            info: list,
            fabric: ptr::null_mut(),
            domain: ptr::null_mut(),
            av: ptr::null_mut(),
            cq: ptr::null_mut(),
            ep: ptr::null_mut(),
            in_flight: HashMap::new(),
            regions: HashMap::new(),
            next_key: 1,
            waker: Waker::default(),
            delivery_complete: true,
            shm_peers: HashMap::new(),
            served: ptr::null_mut(),
            served_seen: 0,
            poll_sleep: POLL_MIN,
        };
        // SAFETY: `info` is a single live entry; each call writes the opened object into the
        // field named, which Drop closes (in reverse order) whatever step fails.
        unsafe {
            let info = ep.info.0;
            check("fi_fabric", sys::xf_fabric((*info).fabric_attr, &mut ep.fabric, ptr::null_mut()) as isize)?;
            check("fi_domain", sys::xf_domain(ep.fabric, info, &mut ep.domain, ptr::null_mut()) as isize)?;
            let mut cq_attr = sys::fi_cq_attr {
                size: (*(*info).tx_attr).size + (*(*info).rx_attr).size,
                format: sys::FI_CQ_FORMAT_DATA,
                wait_obj: sys::FI_WAIT_UNSPEC,
                ..Default::default()
            };
            // A CQ whose wait honours a timeout (an fd or a condition variable) lets the idle
            // thread block in fi_cq_sread, which still drives the provider's progress (serving
            // peers' RMA). Others are opened without a wait object and polled with short
            // sleeps: shm picks FI_WAIT_YIELD, whose fi_cq_sread ignores the timeout, so the
            // engine thread would not come back while nothing completes.
            let opened = sys::xf_cq_open(ep.domain, &mut cq_attr, &mut ep.cq, ptr::null_mut()) == 0;
            if opened && blocking_wait(cq_wait_obj(ep.cq, cq_attr.wait_obj)) {
                *ep.waker.0.lock() = Some(CqPtr(ep.cq));
            } else {
                if opened {
                    check("fi_close(cq)", sys::xf_close(fid_of(ep.cq)) as isize)?;
                }
                ep.cq = ptr::null_mut();
                cq_attr.wait_obj = sys::FI_WAIT_NONE;
                check("fi_cq_open", sys::xf_cq_open(ep.domain, &mut cq_attr, &mut ep.cq, ptr::null_mut()) as isize)?;
            }
            let mut av_attr = sys::fi_av_attr { type_: (*(*info).domain_attr).av_type, ..Default::default() };
            check("fi_av_open", sys::xf_av_open(ep.domain, &mut av_attr, &mut ep.av, ptr::null_mut()) as isize)?;
            check("fi_endpoint", sys::xf_endpoint(ep.domain, info, &mut ep.ep, ptr::null_mut()) as isize)?;
            if ep.attrs.provider == "shm" {
                let name = shm::fresh_name();
                let len = name.as_bytes_with_nul().len();
                // `name` outlives the call; shm copies it before fi_enable creates the region.
                check("fi_setname", sys::xf_setname(ep.ep, name.as_ptr().cast_mut().cast(), len) as isize)?;
            }
            check("fi_ep_bind(av)", sys::xf_ep_bind(ep.ep, fid_of(ep.av), 0) as isize)?;
            let flags = sys::FI_TRANSMIT as u64 | sys::FI_RECV as u64;
            check("fi_ep_bind(cq)", sys::xf_ep_bind(ep.ep, fid_of(ep.cq), flags) as isize)?;
            if ep.waker.0.lock().is_none() && (*info).caps & sys::FI_RMA_EVENT != 0 {
                let mut attr = sys::fi_cntr_attr {
                    events: sys::FI_CNTR_EVENTS_COMP,
                    wait_obj: sys::FI_WAIT_NONE,
                    ..Default::default()
                };
                check(
                    "fi_cntr_open",
                    sys::xf_cntr_open(ep.domain, &mut attr, &mut ep.served, ptr::null_mut()) as isize,
                )?;
                let flags = sys::FI_REMOTE_READ as u64 | sys::FI_REMOTE_WRITE as u64;
                check("fi_ep_bind(cntr)", sys::xf_ep_bind(ep.ep, fid_of(ep.served), flags) as isize)?;
            }
            check("fi_enable", sys::xf_enable(ep.ep) as isize)?;
        }
        for _ in 0..recv_buffers {
            let buf = ep.msg_buf(vec![0; recv_len])?;
            ep.post_recv(buf)?;
        }
        Ok(ep)
    }

    pub fn attrs(&self) -> &Attrs {
        &self.attrs
    }

    pub fn waker(&self) -> Waker {
        self.waker.clone()
    }

    /// Like [`poll`](Endpoint::poll), but blocks up to `timeout_ms` for a completion (or a
    /// [`Waker::wake`]) where the CQ is waitable; otherwise sleeps [`POLL_SLEEP`] at most (a
    /// wake is not seen earlier), then polls.
    pub fn wait(&mut self, max: usize, timeout_ms: i32, out: &mut Vec<Done>) -> Result<usize, FabricError> {
        if self.waker.0.lock().is_none() {
            let timeout = std::time::Duration::from_millis(timeout_ms.max(0) as u64);
            std::thread::sleep(timeout.min(self.poll_sleep));
            let got = self.poll(max, out)?;
            // Back off while nothing happens here: completions, or peers' RMA served.
            if got > 0 || self.served_moved() {
                self.poll_sleep = POLL_MIN;
            } else {
                self.poll_sleep = (self.poll_sleep * 2).min(POLL_SLEEP);
            }
            return Ok(got);
        }
        let mut entries = [sys::fi_cq_data_entry::default(); 16];
        let want = max.clamp(1, entries.len());
        // SAFETY: as in `poll`; no wait condition.
        let ret = unsafe { sys::xf_cq_sread(self.cq, entries.as_mut_ptr().cast(), want, ptr::null(), timeout_ms) };
        self.completed(ret, &entries, out)
    }

    /// Whether peers' RMA was served here since the last look (false without a counter).
    fn served_moved(&mut self) -> bool {
        if self.served.is_null() {
            return false;
        }
        // SAFETY: an open counter (closed only by Drop).
        let now = unsafe { sys::xf_cntr_read(self.served) };
        let moved = now != self.served_seen;
        self.served_seen = now;
        moved
    }

    /// This endpoint's address, as peers insert it into their AV.
    pub fn name(&self) -> Result<Vec<u8>, FabricError> {
        let mut len = 0usize;
        // SAFETY: a null buffer of length 0 asks for the length (FI_ETOOSMALL is expected).
        let _ = unsafe { sys::xf_getname(self.ep, ptr::null_mut(), &mut len) };
        let mut buf = vec![0u8; len.max(1)];
        let mut got = buf.len();
        // SAFETY: `buf` is writable for `got` bytes.
        check("fi_getname", unsafe { sys::xf_getname(self.ep, buf.as_mut_ptr().cast(), &mut got) } as isize)?;
        buf.truncate(got);
        Ok(buf)
    }

    /// Inserts a peer's address; returns its `fi_addr_t`.
    pub fn insert(&mut self, address: &[u8]) -> Result<u64, FabricError> {
        let invalid = |message: &str| FabricError { call: "fi_av_insert", code: libc::EINVAL, message: message.into() };
        if address.is_empty() {
            return Err(invalid("empty address"));
        }
        let shm_pid = if self.attrs.provider == "shm" {
            // shm reads the address up to its NUL (strlen), and our peers are named after
            // their process.
            let name = CStr::from_bytes_with_nul(address).map_err(|_| invalid("not one NUL-terminated shm name"))?;
            Some(name.to_str().ok().and_then(shm::owner).ok_or_else(|| invalid("not an xfer shm endpoint name"))?)
        } else {
            None
        };
        let mut addr: sys::fi_addr_t = sys::FI_ADDR_UNSPEC;
        // SAFETY: one address of the provider's format (the peer's fi_getname; its length was
        // checked against the frame, and providers read only their address format's size) and
        // one slot for its handle.
        let ret = unsafe { sys::xf_av_insert(self.av, address.as_ptr().cast(), 1, &mut addr, 0, ptr::null_mut()) };
        if ret != 1 || addr == sys::FI_ADDR_UNSPEC {
            check("fi_av_insert", ret.min(-1) as isize)?;
        }
        if let Some(pid) = shm_pid {
            self.shm_peers.insert(addr, pid);
        }
        Ok(addr)
    }

    /// Whether an operation to `peer` must not be posted now. shm posts by taking a spinlock
    /// in the peer's region, which the peer holds while it serves RMA; a peer killed or
    /// stopped right then holds it for good (or until SIGCONT), and a post would spin on it
    /// forever, taking the engine thread, and so every other peer, with it (seen: the engine
    /// in `pthread_spin_lock` under `fi_readmsg` after a SIGKILL). So before each shm post the
    /// peer's process is looked up: gone is an error (ECONNRESET), stopped is no room now
    /// (the job waits, and fails after its stall bound like any other silent peer). Left open:
    /// a peer that stops between this look and the post, and a pid reused by another process
    /// within the stall bound.
    fn peer_blocks(&self, peer: u64, call: &'static str) -> Result<bool, FabricError> {
        let Some(&pid) = self.shm_peers.get(&peer) else { return Ok(false) };
        match shm::process_state(pid) {
            shm::Process::Running => Ok(false),
            shm::Process::Stopped => Ok(true),
            shm::Process::Gone => {
                Err(FabricError { call, code: libc::ECONNRESET, message: format!("shm peer process {pid} is gone") })
            }
        }
    }

    /// Takes a peer out of the AV (`fi_av_remove`); its handle is invalid afterwards.
    pub fn remove(&mut self, addr: u64) -> Result<(), FabricError> {
        self.shm_peers.remove(&addr);
        let mut addr = addr;
        // SAFETY: one handle this AV returned, not used again by the caller.
        check("fi_av_remove", unsafe { sys::xf_av_remove(self.av, &mut addr, 1, 0) } as isize)
    }

    /// Registers a DRAM region for local and remote access; returns its key for peers.
    pub fn register(&mut self, region: &LocalRegion) -> Result<u64, FabricError> {
        let desc = region.desc();
        let access =
            sys::FI_READ as u64 | sys::FI_WRITE as u64 | sys::FI_REMOTE_READ as u64 | sys::FI_REMOTE_WRITE as u64;
        let requested = self.next_key;
        self.next_key += 1;
        let mr = self.reg(desc.addr as usize as *const c_void, desc.len as usize, access, requested)?;
        // SAFETY: the MR is open.
        let key = unsafe { sys::xf_mr_key(mr.0) };
        self.regions.insert(region.id(), Region { mr });
        Ok(key)
    }

    /// Closes a region's registration (once idle: no operation on it is in flight).
    pub fn deregister(&mut self, region: u64) -> bool {
        self.regions.remove(&region).is_some()
    }

    fn reg(&mut self, buf: *const c_void, len: usize, access: u64, key: u64) -> Result<Mr, FabricError> {
        let mut mr = ptr::null_mut();
        // SAFETY: `buf .. buf + len` is memory that outlives the MR: a region's (LocalRegion's
        // contract keeps it allocated until it is closed and idle, and it is deregistered, so
        // the MR closed, before that returns to the agent) or a message buffer owned with it.
        let ret =
            unsafe { sys::xf_mr_reg(self.domain, buf, len, access, 0, key, 0, &mut mr, ptr::null_mut()) } as isize;
        check("fi_mr_reg", ret)?;
        let mr = Mr(mr);
        if self.attrs.mr_endpoint() {
            // SAFETY: an open MR and our endpoint; FI_MR_ENDPOINT wants it bound, then enabled.
            unsafe {
                check("fi_mr_bind", sys::xf_mr_bind(mr.0, fid_of(self.ep), 0) as isize)?;
                check("fi_mr_enable", sys::xf_mr_enable(mr.0) as isize)?;
            }
        }
        Ok(mr)
    }

    fn msg_buf(&mut self, data: Vec<u8>) -> Result<MsgBuf, FabricError> {
        let data = data.into_boxed_slice();
        let mr = if self.attrs.mr_local() {
            let access = sys::FI_SEND as u64 | sys::FI_RECV as u64;
            let key = self.next_key;
            self.next_key += 1;
            Some(self.reg(data.as_ptr().cast(), data.len(), access, key)?)
        } else {
            None
        };
        Ok(MsgBuf { data, mr })
    }

    fn track(&mut self, token: u64, kind: Kind) -> (*mut c_void, usize) {
        let mut ctx = Box::<sys::fi_context2>::default();
        let at = &mut *ctx as *mut sys::fi_context2 as *mut c_void;
        self.in_flight.insert(at as usize, InFlight { ctx, token, kind });
        (at, at as usize)
    }

    fn post_recv(&mut self, buf: MsgBuf) -> Result<(), FabricError> {
        let (ptr, len, desc) = (buf.data.as_ptr(), buf.data.len(), buf.mr.as_ref().map_or(ptr::null_mut(), Mr::desc));
        let (ctx, at) = self.track(0, Kind::Recv(buf));
        // SAFETY: the buffer and the context are owned by `in_flight` until the CQ reports the
        // receive (or the endpoint closes); `desc` is the buffer's MR or null.
        let ret = unsafe { sys::xf_recv(self.ep, ptr.cast_mut().cast(), len, desc, sys::FI_ADDR_UNSPEC, ctx) };
        if ret < 0 {
            self.in_flight.remove(&at);
        }
        check("fi_recv", ret)
    }

    /// Posts one RMA operation over `pieces` (at most [`Attrs::max_iov`] of them, each a local
    /// slice and `len` bytes at the peer's `remote`, as its mr_mode addresses it, under `key`):
    /// one `fi_readmsg`/`fi_writemsg` with as many local and remote iovecs. `Ok(Err(pieces))`:
    /// no room now (FI_EAGAIN); progress and try again. The slices are kept until the
    /// operation completes.
    pub fn post_rma(
        &mut self,
        op: Rma,
        pieces: Vec<RmaPiece>,
        peer: u64,
        token: u64,
    ) -> Result<Result<(), Vec<RmaPiece>>, FabricError> {
        if self.peer_blocks(peer, if op == Rma::Read { "fi_readmsg" } else { "fi_writemsg" })? {
            return Ok(Err(pieces));
        }
        let mut iovs = Vec::with_capacity(pieces.len());
        let mut descs = Vec::with_capacity(pieces.len());
        let mut rmas = Vec::with_capacity(pieces.len());
        for piece in &pieces {
            let region = piece.local.pin().region().id();
            let desc = match self.regions.get(&region) {
                Some(r) => r.mr.desc(),
                None if self.attrs.mr_local() => {
                    return Err(FabricError {
                        call: "fi_readmsg/fi_writemsg",
                        code: libc::ENOKEY,
                        message: format!("local region {region} is not registered with this backend"),
                    })
                }
                None => ptr::null_mut(),
            };
            let len = piece.local.len();
            iovs.push(libc::iovec { iov_base: piece.local.as_ptr().cast_mut().cast(), iov_len: len });
            descs.push(desc);
            rmas.push(sys::fi_rma_iov { addr: piece.remote, len, key: piece.key });
        }
        let (ctx, at) = self.track(token, Kind::Rma(pieces));
        let msg = sys::fi_msg_rma {
            msg_iov: iovs.as_ptr().cast(),
            desc: descs.as_mut_ptr(),
            iov_count: iovs.len(),
            addr: peer,
            rma_iov: rmas.as_ptr(),
            rma_iov_count: rmas.len(),
            context: ctx,
            data: 0,
        };
        // A write completes once the target has it (visible there), not once it left here;
        // a provider without that flag completes writes as its default says (tcp: on its ack).
        let post = |delivery: bool| {
            let flags = match op {
                Rma::Write if delivery => u64::from(sys::FI_COMPLETION) | u64::from(sys::FI_DELIVERY_COMPLETE),
                _ => u64::from(sys::FI_COMPLETION),
            };
            // SAFETY: the message's arrays live for the call (providers copy them); the local
            // memory (pinned registered DRAM slices) and the context stay owned by
            // `in_flight` until the CQ reports the operation or the endpoint closes.
            unsafe {
                match op {
                    Rma::Read => sys::xf_readmsg(self.ep, &msg, flags),
                    Rma::Write => sys::xf_writemsg(self.ep, &msg, flags),
                }
            }
        };
        let mut ret = post(self.delivery_complete);
        if op == Rma::Write && self.delivery_complete && ret == -(sys::FI_EBADFLAGS as isize) {
            tracing::info!(provider = %self.attrs.provider, "libfabric: no FI_DELIVERY_COMPLETE for writes");
            self.delivery_complete = false;
            ret = post(false);
        }
        if ret == -(EAGAIN as isize) {
            return match self.in_flight.remove(&at).map(|f| f.kind) {
                Some(Kind::Rma(pieces)) => Ok(Err(pieces)),
                _ => Err(FabricError { call: "post_rma", code: libc::EINVAL, message: "lost its pieces".into() }),
            };
        }
        if ret < 0 {
            self.in_flight.remove(&at);
        }
        check(if op == Rma::Read { "fi_readmsg" } else { "fi_writemsg" }, ret).map(|()| Ok(()))
    }

    /// Sends a message. `Ok(false)`: no room now (FI_EAGAIN).
    pub fn send(&mut self, peer: u64, message: &[u8], token: u64) -> Result<bool, FabricError> {
        if self.peer_blocks(peer, "fi_send")? {
            return Ok(false);
        }
        let buf = self.msg_buf(message.to_vec())?;
        let (ptr, len, desc) = (buf.data.as_ptr(), buf.data.len(), buf.mr.as_ref().map_or(ptr::null_mut(), Mr::desc));
        let (ctx, at) = self.track(token, Kind::Send(buf));
        // SAFETY: as in `post_recv`, for a buffer the provider reads.
        let ret = unsafe { sys::xf_send(self.ep, ptr.cast_mut().cast(), len, desc, peer, ctx) };
        if ret < 0 {
            self.in_flight.remove(&at);
        }
        if ret == -(EAGAIN as isize) {
            return Ok(false);
        }
        check("fi_send", ret).map(|()| true)
    }

    /// Reads up to `max` completions (an error completion counts as one) into `out`.
    pub fn poll(&mut self, max: usize, out: &mut Vec<Done>) -> Result<usize, FabricError> {
        let mut entries = [sys::fi_cq_data_entry::default(); 16];
        let want = max.min(entries.len());
        // SAFETY: `entries` has room for `want` entries of the CQ's format (FI_CQ_FORMAT_DATA).
        let ret = unsafe { sys::xf_cq_read(self.cq, entries.as_mut_ptr().cast(), want) };
        let got = self.completed(ret, &entries, out)?;
        if got > 0 {
            self.poll_sleep = POLL_MIN;
        }
        Ok(got)
    }

    fn completed(
        &mut self,
        ret: isize,
        entries: &[sys::fi_cq_data_entry],
        out: &mut Vec<Done>,
    ) -> Result<usize, FabricError> {
        // Nothing now; a wait that timed out or was signalled (FI_EINTR on some providers).
        if ret == -(EAGAIN as isize) || ret == -(libc::ETIMEDOUT as isize) || ret == -(libc::EINTR as isize) {
            return Ok(0);
        }
        if ret == -(EAVAIL as isize) {
            return self.read_error(out).map(|()| 1);
        }
        check("fi_cq_read", ret)?;
        let got = ret as usize;
        for entry in &entries[..got] {
            self.finish(entry.op_context as usize, Ok(entry.len), out)?;
        }
        Ok(got)
    }

    fn read_error(&mut self, out: &mut Vec<Done>) -> Result<(), FabricError> {
        let mut err = sys::fi_cq_err_entry::default();
        // SAFETY: one writable error entry; err_data_size 0 lets the provider keep its own.
        let ret = unsafe { sys::xf_cq_readerr(self.cq, &mut err, 0) };
        if ret == -(EAGAIN as isize) {
            return Ok(());
        }
        check("fi_cq_readerr", ret)?;
        let mut message = strerror(err.err);
        if err.prov_errno != 0 {
            let mut buf = [0 as libc::c_char; 256];
            // SAFETY: the entry is the one just read; `buf` is writable for its length.
            let prov = unsafe { sys::xf_cq_strerror(self.cq, err.prov_errno, err.err_data, buf.as_mut_ptr(), 256) };
            message = format!("{message}; provider: {} ({})", text(prov), err.prov_errno);
        }
        self.finish(err.op_context as usize, Err(CqError { code: err.err, message }), out)
    }

    fn finish(&mut self, ctx: usize, result: Result<usize, CqError>, out: &mut Vec<Done>) -> Result<(), FabricError> {
        let Some(done) = self.in_flight.remove(&ctx) else {
            tracing::warn!(ctx, "libfabric completion for no operation of ours");
            return Ok(());
        };
        let _ = &done.ctx;
        match done.kind {
            Kind::Rma(_) => out.push(Done::Rma { token: done.token, result: result.map(drop) }),
            Kind::Send(_) => out.push(Done::Sent { token: done.token, result: result.map(drop) }),
            Kind::Recv(buf) => {
                let received = result.map(|len| buf.data[..len.min(buf.data.len())].to_vec());
                out.push(Done::Received { result: received });
                // A canceled receive (endpoint closing) is not posted again.
                if !matches!(&out.last(), Some(Done::Received { result: Err(e) }) if e.code == libc::ECANCELED) {
                    self.post_recv(buf)?;
                }
            }
        }
        Ok(())
    }

    /// Operations the provider still owns.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // The endpoint first: once closed, the provider touches none of the buffers and
        // contexts in flight, which are dropped after it; MRs before the domain.
        *self.waker.0.lock() = None;
        let objects = [
            ("endpoint", fid_of(self.ep)),
            ("av", fid_of(self.av)),
            ("cq", fid_of(self.cq)),
            ("cntr", fid_of(self.served)),
        ];
        for (name, fid) in objects {
            if name == "av" {
                self.regions.clear();
                for (_, f) in self.in_flight.drain() {
                    drop(f);
                }
            }
            if !fid.is_null() {
                // SAFETY: an object opened by `open`, closed once, children before parents.
                let ret = unsafe { sys::xf_close(fid) };
                if ret != 0 {
                    tracing::warn!(ret, object = name, "fi_close");
                }
            }
        }
        self.regions.clear();
        self.in_flight.clear();
        for (name, fid) in [("domain", fid_of(self.domain)), ("fabric", fid_of(self.fabric))] {
            if !fid.is_null() {
                // SAFETY: as above.
                let ret = unsafe { sys::xf_close(fid) };
                if ret != 0 {
                    tracing::warn!(ret, object = name, "fi_close");
                }
            }
        }
    }
}

/// Names for `shm` endpoints. shm names its region (a file in /dev/shm) after the process id
/// and never removes it when the process is killed; a later process given the same pid (they
/// wrap at 32768 here) then fails fi_enable with EBUSY. So each endpoint gets a name of its own,
/// and opening one removes the regions ours left behind in processes that are gone (they
/// would otherwise hold their memory, 16 MiB each, until reboot).
mod shm {
    use std::ffi::CString;
    use std::sync::atomic::{AtomicU64, Ordering};

    const DIR: &str = "/dev/shm";
    const PREFIX: &str = "xfer-";

    pub(super) fn fresh_name() -> CString {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        remove_orphans();
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let name = format!("{PREFIX}{}-{nanos:x}-{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
        CString::new(name).expect("no NUL in a formatted name")
    }

    /// The process that created region `name`, if it is one of ours.
    pub(super) fn owner(name: &str) -> Option<u32> {
        name.strip_prefix(PREFIX)?.split('-').next()?.parse().ok()
    }

    /// What `/proc` says of a peer's process.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Process {
        Running,
        /// Stopped (SIGSTOP) or traced: it serves nothing until it runs again.
        Stopped,
        /// Exited, killed, or a zombie.
        Gone,
    }

    pub(super) fn process_state(pid: u32) -> Process {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return Process::Gone };
        // "pid (comm) S ...": the comm may hold spaces and parentheses; the state follows the
        // last ')'.
        match stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next()) {
            Some('T' | 't') => Process::Stopped,
            Some('Z' | 'X' | 'x') | None => Process::Gone,
            Some(_) => Process::Running,
        }
    }

    fn remove_orphans() {
        let Ok(entries) = std::fs::read_dir(DIR) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name.to_str().and_then(owner) else { continue };
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                // Best effort: another process may be removing it at the same time.
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn names_are_fresh_and_name_their_process() {
            let (a, b) = (fresh_name(), fresh_name());
            assert_ne!(a, b);
            let a = a.into_string().unwrap();
            assert_eq!(owner(&a), Some(std::process::id()));
            assert!(a.len() < 64, "{a}");
            assert_eq!(owner("1002:0:0"), None, "shm's own names are not ours to remove");
            assert_eq!(owner("xfer-notapid-1-2"), None);
        }

        #[test]
        fn reads_process_states() {
            assert_eq!(process_state(std::process::id()), Process::Running);
            assert_eq!(process_state(u32::MAX), Process::Gone);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_takes_only_our_nul_terminated_names() {
        let info = Info::choose(Some("shm"), None, |all| (!all.is_empty()).then_some(0)).expect("shm is offered");
        let mut ep = Endpoint::open(info, 1, 64).expect("shm endpoint");
        let own = ep.name().expect("own name");
        assert_eq!(own.last(), Some(&0), "shm names end in NUL");
        // shm would read past an address without its NUL.
        assert_eq!(ep.insert(&own[..own.len() - 1]).map_err(|e| e.code), Err(libc::EINVAL));
        assert_eq!(ep.insert(b"1002:0:0\0").map_err(|e| e.code), Err(libc::EINVAL), "not one of ours");
        let at = ep.insert(&own).expect("our own name");
        assert!(!ep.peer_blocks(at, "test").expect("we are running"));
        ep.remove(at).expect("fi_av_remove");
    }
}
