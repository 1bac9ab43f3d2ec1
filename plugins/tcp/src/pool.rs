//! The initiator side: per peer, a pool of stream workers fed from one queue of chunks.
//!
//! A request is cut into chunks (by bytes, across descriptor boundaries); idle workers take the
//! next chunk, so large requests spread over the parallel streams and small ones go out as one
//! frame. Each chunk is one exchange on one connection; the request completes when the last
//! chunk does, and only then is its notification sent, on a separate control connection, so
//! the peer sees the data before the notification. A small single-chunk request of host memory
//! skips the queue: the caller's thread sends it and its waiter reads the answer
//! ([`crate::inline`]).

use std::io::IoSlice;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;
use xfer_core::credential::{ClusterCredential, ProofLabel, Transcript, AUTH_LEN};
use xfer_core::file_io;
use xfer_core::split::{even_sizes, split_by_sizes, Segment};
use xfer_core::staging::{check_files, needs_staging, Flow, Staging, StagingConfig};
use xfer_core::{BackendError, Completer, LocalMem, Op, RefusalCode, RemoteAgent, RemoteKey, RemoteSeg, TransferJob};

use crate::conn::{Conn, ConnError, SocketTuning};
use crate::frame::{self, Kind, WireDesc};
use crate::inline::{self, Inline};
use crate::keys::TcpRemoteKey;
use crate::memio;
use crate::readahead::{self, Offer};
use crate::staged::Lanes;

/// Tunables of the initiator.
#[derive(Clone, Copy, Debug)]
pub struct PoolConfig {
    pub streams: usize,
    /// Largest chunk one stream moves in one exchange.
    pub chunk_bytes: u64,
    /// Requests at least this large are split over the streams.
    pub split_bytes: u64,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub tuning: SocketTuning,
    pub staging: StagingConfig,
    /// How long a wait for an answer polls before it sleeps ([`crate::spin`]).
    pub spin: Duration,
    /// Single-chunk requests of host memory up to this size go inline (0: never).
    pub inline_bytes: u64,
}

/// Most descriptors per chunk, so frames stay far below the protocol limit.
const MAX_CHUNK_DESCS: usize = 8192;
/// Idle inline connections kept per peer (one per thread that posts small requests at once).
const MAX_IDLE_INLINE: usize = 16;
/// Requests one stream keeps in flight: a worker that finds more small requests queued sends
/// up to this many before it reads their answers, in order.
const PIPELINE_DEPTH: usize = 16;
/// Bytes of payload one pipelined run of requests may carry.
const PIPELINE_BYTES: u64 = 1 << 20;

pub(crate) struct PoolShared {
    local_name: String,
    peer: String,
    addr: SocketAddr,
    pub(crate) config: PoolConfig,
    staging: Arc<dyn Staging>,
    /// With a credential, every connection proves it in the hello.
    credential: Option<Arc<ClusterCredential>>,
    /// With `tls=on`: the config that pins the target's certificate.
    tls: Option<Arc<rustls::ClientConfig>>,
    closed: Arc<AtomicBool>,
    control: Mutex<Option<Pooled>>,
    next_request: AtomicU64,
    /// Random per pool; with `epoch`, tells the target which connections are current (see
    /// `fence.rs`).
    session_id: u64,
    epoch: AtomicU64,
    /// When the peer last failed an exchange (µs since `started`, 0 = never) and whether by
    /// timeout: chunks queued before then fail at once instead of each waiting out a timeout.
    started: Instant,
    failed_at: AtomicU64,
    failed_by_timeout: AtomicBool,
    pub(crate) queue: Sender<Work>,
    /// Connections for inline requests, idle.
    idle: Mutex<Vec<Pooled>>,
    /// Inline requests not finished yet, for the workers to adopt those nobody waits for.
    pub(crate) inline: Mutex<Vec<Arc<Inline>>>,
}

/// What the stream workers take from the queue.
pub(crate) enum Work {
    Chunk(Chunk),
    /// An inline request whose answer nobody on the caller's side will read.
    Adopt(Arc<Inline>),
}

pub struct PeerPool {
    shared: Arc<PoolShared>,
    receiver: Receiver<Work>,
    workers: OnceLock<()>,
}

impl PeerPool {
    pub fn new(
        local_name: String,
        peer: String,
        addr: SocketAddr,
        config: PoolConfig,
        staging: Arc<dyn Staging>,
        credential: Option<Arc<ClusterCredential>>,
        tls: Option<Arc<rustls::ClientConfig>>,
    ) -> PeerPool {
        let (queue, receiver) = crossbeam_channel::unbounded();
        PeerPool {
            shared: Arc::new(PoolShared {
                local_name,
                peer,
                addr,
                config,
                staging,
                credential,
                tls,
                closed: Arc::new(AtomicBool::new(false)),
                control: Mutex::new(None),
                next_request: AtomicU64::new(1),
                session_id: crate::keys::random_u64(),
                epoch: AtomicU64::new(0),
                started: Instant::now(),
                failed_at: AtomicU64::new(0),
                failed_by_timeout: AtomicBool::new(false),
                queue,
                idle: Mutex::new(Vec::new()),
                inline: Mutex::new(Vec::new()),
            }),
            receiver,
            workers: OnceLock::new(),
        }
    }

    fn start_workers(&self) {
        self.workers.get_or_init(|| {
            for index in 0..self.shared.config.streams.max(1) {
                let shared = Arc::clone(&self.shared);
                let receiver = self.receiver.clone();
                let spawned = std::thread::Builder::new()
                    .name(format!("xfer-tcp-{index}"))
                    .spawn(move || worker(shared, receiver));
                if let Err(err) = spawned {
                    tracing::error!(%err, "cannot spawn a tcp stream worker");
                }
            }
        });
    }
}

impl Drop for PeerPool {
    fn drop(&mut self) {
        self.disconnect();
    }
}

impl PeerPool {
    /// Hands a chunk to the stream workers.
    fn queue(&self, chunk: Chunk) {
        if let Err(unsent) = self.shared.queue.send(Work::Chunk(chunk)) {
            if let Work::Chunk(chunk) = unsent.0 {
                chunk.tracker.finish_chunk(&self.shared, Err(self.shared.disconnected("pool closed")));
            }
        }
    }
}

impl RemoteAgent for PeerPool {
    fn unpack_key(&self, public: &[u8]) -> Result<RemoteKey, BackendError> {
        Ok(Arc::new(TcpRemoteKey::decode(public)?))
    }

    fn post(&self, job: TransferJob) {
        if self.shared.closed.load(Ordering::Acquire) {
            job.done.complete(Err(self.shared.disconnected("connection pool closed")));
            return;
        }
        let planned = match plan(job, &self.shared.config) {
            Ok(planned) => planned,
            Err((done, err)) => return done.complete(Err(err)),
        };
        self.start_workers();
        match planned {
            Planned::One(chunk) if inline::eligible(&self.shared, &chunk) => inline::post(&self.shared, chunk),
            Planned::One(chunk) => self.queue(chunk),
            Planned::Many(chunks) => chunks.into_iter().for_each(|chunk| self.queue(chunk)),
        }
    }

    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        self.shared.notify(message)
    }

    /// One connection per stream, each through TLS, hello and authentication, left idle: the
    /// first small request goes inline on one, and the stream workers of a large one take the
    /// others (a worker without a connection takes an idle one before it opens its own).
    fn connect_now(&self) -> Result<(), BackendError> {
        if self.shared.is_closed() {
            return Err(self.shared.disconnected("connection pool closed"));
        }
        let opened =
            (0..self.shared.config.streams.max(1)).map(|_| self.shared.check_out()).collect::<Result<Vec<_>, _>>()?;
        opened.into_iter().for_each(|pooled| self.shared.check_in(pooled));
        Ok(())
    }

    fn disconnect(&self) {
        self.shared.closed.store(true, Ordering::Release);
        if let Some(pooled) = self.shared.control.lock().take() {
            pooled.conn.shutdown();
        }
        for pooled in self.shared.idle.lock().drain(..) {
            pooled.conn.shutdown();
        }
    }
}

/// One exchange's worth of a request.
pub(crate) struct Chunk {
    op: Op,
    pub(crate) local: Vec<LocalMem>,
    remote: Vec<WireDesc>,
    pub(crate) bytes: u64,
    pub(crate) queued_at: Instant,
    pub(crate) tracker: Arc<Tracker>,
    /// The request's only chunk (the pieces of a split request go to different streams).
    whole: bool,
}

/// Completion bookkeeping shared by a request's chunks.
pub(crate) struct Tracker {
    remaining: AtomicUsize,
    error: Mutex<Option<BackendError>>,
    pub(crate) done: Mutex<Option<Completer>>,
    notif: Option<Vec<u8>>,
}

impl Tracker {
    fn cancelled(&self) -> bool {
        self.done.lock().as_ref().is_some_and(Completer::is_cancelled)
    }

    fn failed(&self) -> bool {
        self.error.lock().is_some()
    }

    pub(crate) fn finish_chunk(&self, pool: &PoolShared, result: Result<(), BackendError>) {
        if let Err(err) = result {
            self.error.lock().get_or_insert(err);
        }
        if self.remaining.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        let Some(done) = self.done.lock().take() else { return };
        let outcome = match self.error.lock().take() {
            Some(err) => Err(err),
            None => match &self.notif {
                Some(message) => pool.notify(message),
                None => Ok(()),
            },
        };
        done.complete(outcome);
    }
}

/// A remote segment as a wire descriptor.
impl Segment for WireDesc {
    fn seg_len(&self) -> u64 {
        self.len
    }

    fn take_front(&mut self, n: u64) -> Self {
        let front = WireDesc { key: self.key, offset: self.offset, len: n };
        self.offset += n;
        self.len -= n;
        front
    }
}

/// A job's remote segments as wire descriptors (offsets inside the keys' regions, contiguous
/// pieces of one key merged), checked against the keys' bounds and the local byte count.
pub fn wire_descs(remote: &[RemoteSeg], local: &[LocalMem]) -> Result<Vec<WireDesc>, BackendError> {
    let mut wire: Vec<WireDesc> = Vec::with_capacity(remote.len());
    for seg in remote {
        let Some(key) = seg.key.downcast_ref::<TcpRemoteKey>() else {
            return Err(BackendError::InvalidMetadata("remote key is not a tcp key".into()));
        };
        let offset =
            seg.addr.checked_sub(key.base).filter(|off| off.checked_add(seg.len).is_some_and(|end| end <= key.len));
        let Some(offset) = offset else {
            let msg = format!("remote {:#x}+{} is outside its region", seg.addr, seg.len);
            return Err(BackendError::Refused { code: RefusalCode::OutOfBounds, message: msg });
        };
        match wire.last_mut() {
            Some(last) if last.key == key.key && last.offset + last.len == offset => last.len += seg.len,
            _ if seg.len == 0 => {}
            _ => wire.push(WireDesc { key: key.key, offset, len: seg.len }),
        }
    }
    let total: u64 = wire.iter().map(|d| d.len).sum();
    let local_total: u64 = local.iter().map(LocalMem::len).sum();
    if total != local_total {
        let msg = format!("local {local_total} bytes vs remote {total} bytes");
        return Err(BackendError::Refused { code: RefusalCode::BadRequest, message: msg });
    }
    Ok(wire)
}

/// A job cut into chunks; most are one, which needs no list.
enum Planned {
    One(Chunk),
    Many(Vec<Chunk>),
}

/// Turns a job into chunks: resolves remote keys, merges contiguous remote descriptors, cuts
/// by bytes. On error, hands the completer back with the error.
fn plan(job: TransferJob, config: &PoolConfig) -> Result<Planned, (Completer, BackendError)> {
    let TransferJob { op, mut local, remote, notif, done } = job;
    let wire = match wire_descs(&remote, &local) {
        Ok(wire) => wire,
        Err(err) => return Err((done, err)),
    };
    let total: u64 = wire.iter().map(|d| d.len).sum();
    let by_bytes = if total >= config.split_bytes {
        total.div_ceil(config.chunk_bytes.max(1)).max(config.streams as u64)
    } else {
        1
    };
    let by_descs = wire.len().max(local.len()).div_ceil(MAX_CHUNK_DESCS) as u64;
    let parts = by_bytes.max(by_descs).max(1) as usize;
    let new_tracker = |chunks: usize| {
        Arc::new(Tracker {
            remaining: AtomicUsize::new(chunks),
            error: Mutex::new(None),
            done: Mutex::new(Some(done)),
            notif,
        })
    };
    if total == 0 || parts == 1 {
        // One chunk (every small request): the job's own lists, not cut anew. An empty one still
        // carries the completion (and notification).
        local.retain(|piece| !piece.is_empty());
        let tracker = new_tracker(1);
        let chunk = Chunk { op, local, remote: wire, bytes: total, queued_at: Instant::now(), tracker, whole: true };
        return Ok(Planned::One(chunk));
    }
    // Cuts at 4 KiB multiples, so an O_DIRECT file's pieces stay aligned on every stream.
    let sizes = even_sizes(total, parts, file_io::DIRECT_ALIGN);
    let tracker = new_tracker(sizes.len());
    let locals = split_by_sizes(local, &sizes);
    let remotes = split_by_sizes(wire, &sizes);
    Ok(Planned::Many(
        locals
            .into_iter()
            .zip(remotes)
            .zip(&sizes)
            .map(|((local, remote), &bytes)| Chunk {
                op,
                local,
                remote,
                bytes,
                queued_at: Instant::now(),
                tracker: Arc::clone(&tracker),
                whole: false,
            })
            .collect(),
    ))
}

/// A connection and the epoch it was opened in.
pub(crate) struct Pooled {
    epoch: u64,
    pub(crate) conn: Conn,
}

fn worker(shared: Arc<PoolShared>, receiver: Receiver<Work>) {
    let mut conn: Option<Pooled> = None;
    let mut lanes = Lanes::default();
    // A chunk taken from the queue that could not join the run before it.
    let mut held: Option<Chunk> = None;
    loop {
        let first = match held.take() {
            Some(chunk) => chunk,
            None => match receiver.recv_timeout(Duration::from_millis(250)) {
                Ok(Work::Chunk(chunk)) => chunk,
                Ok(Work::Adopt(inline)) => {
                    inline.finish();
                    continue;
                }
                Err(RecvTimeoutError::Timeout) if shared.closed.load(Ordering::Acquire) => {
                    return inline::adopt_unclaimed(&shared, Duration::ZERO);
                }
                Err(RecvTimeoutError::Timeout) => {
                    inline::adopt_unclaimed(&shared, inline::ADOPT_AFTER);
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => return,
            },
        };
        if !pipelines(&shared.config, &first) {
            let mut chunk = first;
            let result = match unsendable(&shared, &chunk) {
                Some(err) => Err(err),
                None => {
                    run_chunk(&shared, &mut conn, &mut lanes, &mut chunk).inspect_err(|err| shared.record_failure(err))
                }
            };
            finish(&shared, chunk, result);
            inline::adopt_unclaimed(&shared, inline::ADOPT_AFTER);
            continue;
        }
        let mut run = vec![first];
        let mut bytes = run[0].bytes;
        // A fair share of what is queued, so the other streams get work too.
        let share = (receiver.len() + 1).div_ceil(shared.config.streams.max(1)).clamp(1, PIPELINE_DEPTH);
        while run.len() < share && bytes < PIPELINE_BYTES {
            match receiver.try_recv() {
                // One direction per run: a READ's answers and a WRITE's requests both carry
                // payload, and two sides each blocked writing to the other would stall.
                Ok(Work::Chunk(next)) if next.op == run[0].op && pipelines(&shared.config, &next) => {
                    bytes += next.bytes;
                    run.push(next);
                }
                Ok(Work::Chunk(next)) => {
                    held = Some(next);
                    break;
                }
                Ok(Work::Adopt(inline)) => inline.finish(),
                Err(_) => break,
            }
        }
        run_pipelined(&shared, &mut conn, run);
        inline::adopt_unclaimed(&shared, inline::ADOPT_AFTER);
    }
}

/// Whether `chunk` may share a stream with other requests in flight: a small request of host
/// memory, whole.
fn pipelines(config: &PoolConfig, chunk: &Chunk) -> bool {
    chunk.whole
        && chunk.bytes > 0
        && chunk.bytes < config.split_bytes.min(PIPELINE_BYTES)
        && !needs_staging(&chunk.local)
}

/// Why `chunk` must not be sent, if it must not.
fn unsendable(shared: &PoolShared, chunk: &Chunk) -> Option<BackendError> {
    if shared.closed.load(Ordering::Acquire) {
        Some(shared.disconnected("connection pool closed"))
    } else if chunk.tracker.failed() || chunk.tracker.cancelled() {
        // The request already has its outcome (the first error is kept).
        Some(BackendError::Cancelled)
    } else {
        shared.failed_since(chunk.queued_at)
    }
}

/// Completes a chunk; its pins go before the completion, so a waiter that deregisters next
/// never waits.
pub(crate) fn finish(shared: &PoolShared, chunk: Chunk, result: Result<(), BackendError>) {
    let Chunk { tracker, local, .. } = chunk;
    drop(local);
    tracker.finish_chunk(shared, result);
}

/// Sends every request of `run` on one connection in one write, then reads their answers in
/// order. A refusal answers its own request and leaves the stream in step; any other failure
/// abandons the connection and fails every request of the run not answered yet.
fn run_pipelined(shared: &PoolShared, slot: &mut Option<Pooled>, run: Vec<Chunk>) {
    let mut sendable = Vec::with_capacity(run.len());
    for chunk in run {
        match unsendable(shared, &chunk) {
            Some(err) => finish(shared, chunk, Err(err)),
            None => sendable.push(chunk),
        }
    }
    let heads: Vec<(u64, Vec<u8>)> = sendable.iter().map(|chunk| request_head(shared, chunk)).collect();
    let sent = shared.current(slot).and_then(|conn| {
        let mut iov = Vec::with_capacity(2 * heads.len());
        for (chunk, (_, head)) in sendable.iter().zip(&heads) {
            iov.push(IoSlice::new(head));
            if chunk.op == Op::Write {
                iov.extend(memio::send_from(&chunk.local));
            }
        }
        conn.write_all_vectored(&mut iov).map_err(|e| shared.conn_error(e))
    });
    // The write's own error goes to the run's first request, a copy of it to the others.
    let (mut broken, mut write_failure) = (None, None);
    if let Err(err) = sent {
        shared.record_failure(&err);
        shared.abandon(slot);
        broken = Some(shared.same_failure(&err));
        write_failure = Some(err);
    }
    for (mut chunk, (request_id, _)) in sendable.into_iter().zip(heads) {
        let result = match (broken.as_ref(), slot.as_mut()) {
            (Some(err), _) => Err(write_failure.take().unwrap_or_else(|| shared.same_failure(err))),
            (None, None) => Err(shared.disconnected("no connection")),
            (None, Some(pooled)) => receive_host(shared, &mut pooled.conn, &mut chunk, request_id),
        };
        if let Err(err) = &result {
            if broken.is_none() && !matches!(err, BackendError::Refused { .. }) {
                shared.record_failure(err);
                shared.abandon(slot);
                broken = Some(shared.same_failure(err));
            }
        }
        finish(shared, chunk, result);
    }
}

fn run_chunk(
    shared: &PoolShared,
    slot: &mut Option<Pooled>,
    lanes: &mut Lanes,
    chunk: &mut Chunk,
) -> Result<(), BackendError> {
    if chunk.bytes == 0 && chunk.remote.is_empty() {
        return Ok(());
    }
    let result = exchange(shared, shared.current(slot)?, lanes, chunk);
    if let Err(err) = &result {
        // A refusal leaves the stream in step; anything else may not.
        if !matches!(err, BackendError::Refused { .. }) {
            shared.abandon(slot);
        }
    }
    result
}

fn exchange(shared: &PoolShared, conn: &mut Conn, lanes: &mut Lanes, chunk: &mut Chunk) -> Result<(), BackendError> {
    let (request_id, head) = request_head(shared, chunk);
    let io = |e: ConnError| shared.conn_error(e);
    let staging = &*shared.staging;
    let config = shared.config.staging;
    match chunk.op {
        Op::Write if needs_staging(&chunk.local) => {
            check_files(Flow::ToWire, &chunk.local)?;
            conn.write_all(&head).map_err(io)?;
            lanes.run(staging, config, Flow::ToWire, &mut chunk.local, conn, &io)?;
            read_response(shared, conn, request_id, 0)?;
        }
        Op::Read if needs_staging(&chunk.local) => {
            check_files(Flow::FromWire, &chunk.local)?;
            conn.write_all(&head).map_err(io)?;
            read_response(shared, conn, request_id, chunk.bytes)?;
            lanes.run(staging, config, Flow::FromWire, &mut chunk.local, conn, &io)?;
        }
        Op::Write | Op::Read => {
            send_host(shared, conn, chunk, &head)?;
            receive_host(shared, conn, chunk, request_id)?;
        }
    }
    Ok(())
}

/// Sends a request of host memory (a WRITE with its payload); the answer is read by
/// [`receive_host`].
pub(crate) fn send_host(shared: &PoolShared, conn: &mut Conn, chunk: &Chunk, head: &[u8]) -> Result<(), BackendError> {
    let io = |e: ConnError| shared.conn_error(e);
    match chunk.op {
        Op::Write => memio::with_send_slices(head, &chunk.local, |iov| conn.write_all_vectored(iov)).map_err(io),
        Op::Read => conn.write_all(head).map_err(io),
    }
}

/// Reads the answer to a request of host memory (a READ's payload into its memory).
pub(crate) fn receive_host(
    shared: &PoolShared,
    conn: &mut Conn,
    chunk: &mut Chunk,
    request_id: u64,
) -> Result<(), BackendError> {
    match chunk.op {
        Op::Write => read_response(shared, conn, request_id, 0),
        Op::Read => {
            // A payload the read-ahead buffer cannot hold whole is read straight into place,
            // with the padding before it: buffering its front would cost a copy and save no
            // read(2).
            let offer = if chunk.bytes >= readahead::CAPACITY as u64 { Offer::Exact } else { Offer::Buffer };
            let padding = read_response_until(shared, conn, request_id, chunk.bytes, offer)?;
            let mut front = [0u8; frame::ALIGN];
            memio::with_receive_slices(&mut front[..padding], &mut chunk.local, |iov| conn.read_exact_vectored(iov))
                .map_err(|e| shared.conn_error(e))
        }
    }
}

/// A request's frame header, with a fresh request id.
pub(crate) fn request_head(shared: &PoolShared, chunk: &Chunk) -> (u64, Vec<u8>) {
    let request_id = shared.next_request.fetch_add(1, Ordering::Relaxed);
    let kind = match chunk.op {
        Op::Write => Kind::Write,
        Op::Read => Kind::Read,
    };
    let mut head = Vec::new();
    frame::encode_request(kind, request_id, &chunk.remote, chunk.bytes, &mut head);
    (request_id, head)
}

/// Reads a response header and its tail; a refusal becomes an error, a mismatched one breaks
/// the stream.
fn read_response(
    shared: &PoolShared,
    conn: &mut Conn,
    request_id: u64,
    expect_payload: u64,
) -> Result<(), BackendError> {
    read_response_until(shared, conn, request_id, expect_payload, Offer::Buffer).map(drop)
}

/// [`read_response`], except that with [`Offer::Exact`] an accepted answer's padding is left
/// unread, for the caller to read with the payload straight into place; returns its length.
fn read_response_until(
    shared: &PoolShared,
    conn: &mut Conn,
    request_id: u64,
    expect_payload: u64,
    offer: Offer,
) -> Result<usize, BackendError> {
    let mut buf = [0u8; frame::RESPONSE_LEN];
    conn.read_answer(&mut buf, offer).map_err(|e| shared.conn_error(e))?;
    let response = frame::decode_response(&buf).map_err(|e| BackendError::Protocol(e.to_string()))?;
    let accepted = response.code == 0 && response.request_id == request_id && response.payload_len == expect_payload;
    // The padding fits the caller's front buffer (no more than ALIGN, however long a message
    // a peer puts in an accepted answer).
    if offer == Offer::Exact && accepted && response.tail_len() <= frame::ALIGN {
        return Ok(response.tail_len());
    }
    // An accepted answer's tail is padding at most: only a refusal's message needs the heap.
    let (mut small, mut large) = ([0u8; frame::ALIGN], Vec::new());
    let tail = match response.tail_len() {
        len if len <= small.len() => &mut small[..len],
        len => {
            large.resize(len, 0);
            &mut large[..]
        }
    };
    conn.read_exact(tail).map_err(|e| shared.conn_error(e))?;
    let message = &tail[..response.msg_len as usize];
    if response.request_id != request_id {
        return Err(BackendError::Protocol(format!(
            "response for request {} while waiting for {request_id}",
            response.request_id
        )));
    }
    if response.code != 0 {
        return Err(BackendError::Refused {
            code: RefusalCode::from_wire(response.code),
            message: String::from_utf8_lossy(message).into_owned(),
        });
    }
    if response.payload_len != expect_payload {
        return Err(BackendError::Protocol(format!(
            "peer sends {} bytes, expected {expect_payload}",
            response.payload_len
        )));
    }
    Ok(0)
}

impl PoolShared {
    /// The slot's connection: when it is missing or from an abandoned epoch, an idle one (one
    /// that `connect_now` or an inline exchange left), else a new one.
    fn current<'a>(&self, slot: &'a mut Option<Pooled>) -> Result<&'a mut Conn, BackendError> {
        let epoch = self.epoch.load(Ordering::Acquire);
        if slot.as_ref().is_none_or(|p| p.epoch != epoch) {
            if let Some(stale) = slot.take() {
                stale.conn.shutdown();
            }
            loop {
                let idle = self.idle.lock().pop();
                match idle {
                    Some(idle) if idle.epoch == epoch => {
                        *slot = Some(idle);
                        break;
                    }
                    Some(stale) => stale.conn.shutdown(),
                    None => break,
                }
            }
        }
        match slot {
            Some(pooled) => Ok(&mut pooled.conn),
            None => Ok(&mut slot.insert(Pooled { epoch, conn: self.connect(epoch)? }).conn),
        }
    }

    /// An idle inline connection of the current epoch, else a new one.
    pub(crate) fn check_out(&self) -> Result<Pooled, BackendError> {
        let mut slot = self.idle.lock().pop();
        self.current(&mut slot)?;
        slot.ok_or_else(|| self.disconnected("no connection"))
    }

    /// Returns an inline connection after a complete exchange (or a refusal, which leaves the
    /// stream in step).
    pub(crate) fn check_in(&self, pooled: Pooled) {
        let mut idle = self.idle.lock();
        if self.closed.load(Ordering::Acquire) || idle.len() >= MAX_IDLE_INLINE {
            pooled.conn.shutdown();
        } else {
            idle.push(pooled);
        }
    }

    /// Gives up a connection mid-exchange: a new epoch, so the target fences the old one.
    pub(crate) fn abandon(&self, slot: &mut Option<Pooled>) {
        if let Some(pooled) = slot.take() {
            self.epoch.fetch_max(pooled.epoch + 1, Ordering::AcqRel);
            pooled.conn.shutdown();
        }
    }

    /// Remembers that the peer failed an exchange by timeout or disconnection.
    pub(crate) fn record_failure(&self, err: &BackendError) {
        let by_timeout = match err {
            BackendError::TimedOut(_) => true,
            BackendError::PeerDisconnected { .. } => false,
            _ => return,
        };
        self.failed_by_timeout.store(by_timeout, Ordering::Release);
        let micros = self.started.elapsed().as_micros() as u64 + 1;
        self.failed_at.fetch_max(micros, Ordering::AcqRel);
    }

    /// The error for a chunk queued at `queued_at` if the peer has failed since.
    pub(crate) fn failed_since(&self, queued_at: Instant) -> Option<BackendError> {
        let failed_at = self.failed_at.load(Ordering::Acquire);
        let queued = queued_at.saturating_duration_since(self.started).as_micros() as u64 + 1;
        if failed_at == 0 || failed_at < queued {
            return None;
        }
        Some(if self.failed_by_timeout.load(Ordering::Acquire) {
            BackendError::TimedOut(self.config.timeout)
        } else {
            self.disconnected("peer failed while this request was queued")
        })
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    pub(crate) fn disconnected(&self, reason: impl Into<String>) -> BackendError {
        BackendError::PeerDisconnected { peer: self.peer.clone(), reason: reason.into() }
    }

    /// The error the other requests on a stream fail with once `err` broke it (applied to its
    /// own result, the same error again).
    fn same_failure(&self, err: &BackendError) -> BackendError {
        match err {
            BackendError::TimedOut(after) => BackendError::TimedOut(*after),
            BackendError::Tls { reason, .. } => BackendError::Tls { peer: self.peer.clone(), reason: reason.clone() },
            BackendError::PeerDisconnected { reason, .. } => self.disconnected(reason.clone()),
            other => self.disconnected(format!("its stream broke: {other}")),
        }
    }

    fn conn_error(&self, err: ConnError) -> BackendError {
        match err {
            ConnError::TimedOut(after) => BackendError::TimedOut(after),
            ConnError::Tls(err) => BackendError::Tls { peer: self.peer.clone(), reason: err.to_string() },
            other => self.disconnected(other.to_string()),
        }
    }

    fn connect(&self, epoch: u64) -> Result<Conn, BackendError> {
        let config = &self.config;
        let mut conn =
            Conn::connect(self.addr, config.connect_timeout, config.timeout, config.tuning, Arc::clone(&self.closed))
                .map_err(|e| self.disconnected(format!("connect to {}: {e}", self.addr)))?;
        if let Some(config) = &self.tls {
            let tls = crate::tls::connect(config)
                .map_err(|e| BackendError::Tls { peer: self.peer.clone(), reason: e.to_string() })?;
            conn.start_tls_client(tls).map_err(|e| self.conn_error(e))?;
        }
        let mut hello = Vec::new();
        let session = frame::Session { id: self.session_id, epoch };
        frame::encode_hello_with(&self.local_name, &self.peer, session, self.credential.is_some(), &mut hello);
        conn.write_all(&hello).map_err(|e| self.conn_error(e))?;
        let mut reply = [0u8; frame::HELLO_REPLY_LEN];
        conn.read_exact(&mut reply).map_err(|e| self.conn_error(e))?;
        if reply[0] == frame::CHALLENGE_STATUS {
            let Some(credential) = self.credential.as_ref() else {
                return Err(BackendError::Protocol(
                    "authentication challenge, but this agent has no credential".into(),
                ));
            };
            let fixed = frame::decode_hello_reply(&reply).map_err(|e| BackendError::Protocol(e.to_string()))?;
            if fixed != (0, AUTH_LEN) {
                return Err(BackendError::Protocol(format!("malformed authentication challenge {fixed:?}")));
            }
            let mut nonce = [0u8; AUTH_LEN];
            conn.read_exact(&mut nonce).map_err(|e| self.conn_error(e))?;
            let transcript = Transcript {
                client_nonce: &frame::session_nonce(session),
                server_nonce: &nonce,
                client_name: &self.local_name,
                server_name: &self.peer,
            };
            let proof = credential.prove(ProofLabel::DataInitiator, &transcript);
            conn.write_all(&proof).map_err(|e| self.conn_error(e))?;
            conn.read_exact(&mut reply).map_err(|e| self.conn_error(e))?;
        }
        let (code, msg_len) = frame::decode_hello_reply(&reply).map_err(|e| BackendError::Protocol(e.to_string()))?;
        let mut message = vec![0u8; msg_len];
        conn.read_exact(&mut message).map_err(|e| self.conn_error(e))?;
        if code != 0 {
            return Err(BackendError::Refused {
                code: RefusalCode::from_wire(code),
                message: String::from_utf8_lossy(&message).into_owned(),
            });
        }
        conn.set_spin(self.config.spin);
        Ok(conn)
    }

    /// Sends a notification on the control connection and waits for the peer to queue it.
    /// A reused connection found closed is replaced once.
    fn notify(&self, message: &[u8]) -> Result<(), BackendError> {
        if message.len() as u64 > frame::MAX_NOTIF {
            return Err(BackendError::Unsupported(format!("notification of {} bytes", message.len())));
        }
        let mut control = self.control.lock();
        for attempt in 0..2 {
            if self.closed.load(Ordering::Acquire) {
                return Err(self.disconnected("connection pool closed"));
            }
            let reused = control.as_ref().is_some_and(|p| p.epoch == self.epoch.load(Ordering::Acquire));
            let conn = self.current(&mut control)?;
            let request_id = self.next_request.fetch_add(1, Ordering::Relaxed);
            let mut head = Vec::new();
            frame::encode_request(Kind::Notif, request_id, &[], message.len() as u64, &mut head);
            let sent = conn
                .write_all_vectored(&mut [IoSlice::new(&head), IoSlice::new(message)])
                .map_err(|e| self.conn_error(e))
                .and_then(|()| read_response(self, conn, request_id, 0));
            match sent {
                Ok(()) => return Ok(()),
                Err(err @ BackendError::Refused { .. }) => return Err(err),
                Err(err) => {
                    self.abandon(&mut control);
                    // Only a stale pooled connection (closed or reset before we used it) is
                    // worth one retry; after a timeout the peer may still deliver the first
                    // copy, and a resend would deliver it twice.
                    let stale = reused && matches!(err, BackendError::PeerDisconnected { .. });
                    if !stale || attempt == 1 {
                        return Err(err);
                    }
                }
            }
        }
        Err(self.disconnected("notification not delivered"))
    }
}
