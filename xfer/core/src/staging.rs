//! Staging: memory the CPU cannot address as bytes (GPU memory, ranges of files) crosses a
//! host-only wire through host buffers ("slots"), cut into segments of at most one slot, so that
//! the copy of one segment overlaps the wire moving the one before it.
//!
//! Three parts, so that the order of events is pure and testable without a GPU:
//! - [`schedule`] turns a list of pieces into [`Step`]s: which segment is copied into or out of
//!   which slot, and when the wire moves it. No I/O.
//! - A [`CopyLane`] carries out copies between slots and staged memory. `xfer-cuda` implements
//!   it with a CUDA stream and pinned slots; [`FileLane`] with `pread`/`pwrite`; tests with
//!   memcpy. Copies may be asynchronous: [`CopyLane::host`] waits for the slot's copies first.
//! - [`run`] executes a schedule against a lane and a [`Wire`] (a backend's socket).
//!
//! Sending (`Flow::ToWire`) with two slots: fill slot 0 with segment 0 and slot 1 with segment 1,
//! send slot 0 (its copy awaited, segment 1's still running), refill slot 0 with segment 2, send
//! slot 1, ... Receiving (`Flow::FromWire`): receive segment 0 into slot 0, start draining it to
//! its destination, receive segment 1 into slot 1 meanwhile, and before slot 0 takes segment 2
//! its drain is awaited. Host pieces go straight between the wire and their memory.

use std::fmt;
use std::sync::Arc;

use crate::backend::BackendParams;
use crate::error::{BackendError, DeviceError, FileIoError};
use crate::file_io;
use crate::mem::{LocalMem, MemSlice};

/// Which way the bytes cross the wire, from this side's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Local memory is the source: staged pieces are copied into slots, then sent.
    ToWire,
    /// Local memory is the destination: bytes are received into slots, then copied out.
    FromWire,
}

/// A run of one piece moved in one wire step: all of a host piece, or at most one slot of a
/// staged piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub piece: usize,
    pub offset: u64,
    pub len: u64,
    pub staged: bool,
}

/// One action of a staged transfer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Start the copy between `segment`'s memory and `slot` (into the slot when sending, out of
    /// it when receiving).
    Copy { segment: usize, slot: usize },
    /// Move `segment` over the wire, through `slot` when staged, else straight from or into its
    /// host memory.
    Wire { segment: usize, slot: Option<usize> },
}

/// Cuts pieces, given as `(staged, len)`, into segments: a staged piece into runs of at most
/// `slot_bytes`, a host piece whole. Empty pieces move nothing and get no segment.
pub fn segments(pieces: impl IntoIterator<Item = (bool, u64)>, slot_bytes: u64) -> Vec<Segment> {
    let slot_bytes = slot_bytes.max(1);
    let mut out = Vec::new();
    for (piece, (staged, len)) in pieces.into_iter().enumerate() {
        if !staged {
            if len > 0 {
                out.push(Segment { piece, offset: 0, len, staged });
            }
            continue;
        }
        let mut offset = 0;
        while offset < len {
            let run = slot_bytes.min(len - offset);
            out.push(Segment { piece, offset, len: run, staged });
            offset += run;
        }
    }
    out
}

/// The steps that move `segments` in order with `slots` staging slots (at least one; two or more
/// let copies overlap the wire).
pub fn schedule(flow: Flow, segments: &[Segment], slots: usize) -> Vec<Step> {
    let slots = slots.max(1);
    let staged: Vec<usize> = (0..segments.len()).filter(|&i| segments[i].staged).collect();
    let mut steps = Vec::with_capacity(segments.len() + staged.len());
    // The slot each staged segment uses: round robin in order, so a slot is reused only after
    // `slots - 1` other segments.
    let mut slot_of = vec![None; segments.len()];
    for (rank, &segment) in staged.iter().enumerate() {
        slot_of[segment] = Some(rank % slots);
    }
    match flow {
        Flow::ToWire => {
            // Prefetch one segment per slot; each send frees its slot for the next staged segment.
            let mut next_copy = 0;
            while next_copy < staged.len().min(slots) {
                steps.push(Step::Copy { segment: staged[next_copy], slot: next_copy % slots });
                next_copy += 1;
            }
            for (segment, slot) in slot_of.iter().enumerate() {
                steps.push(Step::Wire { segment, slot: *slot });
                if let Some(slot) = *slot {
                    if next_copy < staged.len() {
                        steps.push(Step::Copy { segment: staged[next_copy], slot });
                        next_copy += 1;
                    }
                }
            }
        }
        Flow::FromWire => {
            for (segment, slot) in slot_of.iter().enumerate() {
                steps.push(Step::Wire { segment, slot: *slot });
                if let Some(slot) = *slot {
                    steps.push(Step::Copy { segment, slot });
                }
            }
        }
    }
    steps
}

/// Copies between staging slots and memory the CPU does not address. One lane serves one
/// transfer at a time (a backend keeps one per connection or worker).
pub trait CopyLane: Send + fmt::Debug {
    /// Bytes per slot.
    fn slot_bytes(&self) -> usize;
    /// Number of slots.
    fn slots(&self) -> usize;
    /// Starts copying `len` bytes at `offset` of `src` into the start of `slot`.
    fn fill(&mut self, slot: usize, src: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError>;
    /// Starts copying the first `len` bytes of `slot` to `offset` of `dst`.
    fn drain(&mut self, slot: usize, dst: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError>;
    /// The slot's bytes, after every copy into or out of it has finished.
    fn host(&mut self, slot: usize) -> Result<&mut [u8], BackendError>;
    /// Waits for every copy this lane started.
    fn finish(&mut self) -> Result<(), BackendError>;
}

/// The byte stream a staged transfer moves over: a backend's connection, positioned at the
/// payload.
pub trait Wire {
    fn send(&mut self, bytes: &[u8]) -> Result<(), BackendError>;
    fn send_host(&mut self, slice: &MemSlice) -> Result<(), BackendError>;
    fn receive(&mut self, bytes: &mut [u8]) -> Result<(), BackendError>;
    fn receive_host(&mut self, slice: &mut MemSlice) -> Result<(), BackendError>;
}

/// Whether any piece needs staging (is not host memory).
pub fn needs_staging(pieces: &[LocalMem]) -> bool {
    pieces.iter().any(|piece| !matches!(piece, LocalMem::Host(_)))
}

/// Checks the file pieces of a staged transfer before any byte moves, so a backend can refuse
/// with the reason instead of failing half-way: open the right way (read when the files are the
/// source, `ToWire`; written when `FromWire`), within the file when read, addressable, and for
/// O_DIRECT files aligned (offset and length multiples of [`file_io::DIRECT_ALIGN`]).
pub fn check_files(flow: Flow, pieces: &[LocalMem]) -> Result<(), BackendError> {
    for piece in pieces {
        let LocalMem::File(file) = piece else { continue };
        let (fd, offset, len) = (file.fd(), file.offset(), file.len());
        if offset.checked_add(len).is_none_or(|end| end > i64::MAX as u64) {
            return Err(FileIoError::BadOffset { fd, offset, len }.into());
        }
        let mode = file_io::file_mode(fd)?;
        match flow {
            Flow::ToWire if !mode.readable => return Err(FileIoError::NotReadable { fd }.into()),
            Flow::FromWire if !mode.writable => return Err(FileIoError::NotWritable { fd }.into()),
            _ => {}
        }
        if mode.direct {
            for (what, value) in [("file offset", offset), ("length", len)] {
                if !value.is_multiple_of(file_io::DIRECT_ALIGN) {
                    let align = file_io::DIRECT_ALIGN;
                    return Err(FileIoError::Misaligned { fd, what, value, align }.into());
                }
            }
        }
        if flow == Flow::ToWire {
            let size = file_io::file_size(fd)?;
            if size < offset + len {
                return Err(FileIoError::ShortFile { fd, offset, len, got: size.saturating_sub(offset) }.into());
            }
        }
    }
    Ok(())
}

/// Moves `pieces` over `wire` in order, staging what is not host memory through `lane`.
///
/// Every copy started has finished when this returns, error or not: staged memory is never
/// released under a running copy. When receiving, a failed copy does not stop the wire: the rest
/// of the payload is still read (into a slot, then dropped) so the connection stays in step, and
/// the first error is returned. When sending, an error leaves the wire mid-payload; the caller
/// drops the connection.
pub fn run(
    flow: Flow,
    pieces: &mut [LocalMem],
    lane: &mut dyn CopyLane,
    wire: &mut dyn Wire,
) -> Result<(), BackendError> {
    let segs = segments(pieces.iter().map(|p| (!matches!(p, LocalMem::Host(_)), p.len())), lane.slot_bytes() as u64);
    let mut failed: Option<BackendError> = None;
    for step in schedule(flow, &segs, lane.slots()) {
        let result = match step {
            Step::Copy { .. } if failed.is_some() => Ok(()),
            Step::Copy { segment, slot } => {
                let seg = segs[segment];
                let len = seg.len as usize;
                match flow {
                    Flow::ToWire => lane.fill(slot, &pieces[seg.piece], seg.offset, len),
                    Flow::FromWire => lane.drain(slot, &pieces[seg.piece], seg.offset, len),
                }
            }
            Step::Wire { segment, slot: Some(slot) } => {
                let len = segs[segment].len as usize;
                match flow {
                    Flow::ToWire => lane.host(slot).and_then(|bytes| wire.send(&bytes[..len])),
                    Flow::FromWire => {
                        // A drain out of this slot that failed is reported here; the slot is
                        // free again, so the payload is still read into it.
                        if let Err(err) = lane.host(slot) {
                            failed.get_or_insert(err);
                        }
                        lane.host(slot).and_then(|bytes| wire.receive(&mut bytes[..len]))
                    }
                }
            }
            Step::Wire { segment, slot: None } => match (&mut pieces[segs[segment].piece], flow) {
                (LocalMem::Host(slice), Flow::ToWire) => wire.send_host(slice),
                (LocalMem::Host(slice), Flow::FromWire) if failed.is_none() => wire.receive_host(slice),
                (LocalMem::Host(slice), Flow::FromWire) => discard(wire, lane, slice.len()),
                (other, _) => Err(BackendError::MemoryNotMoved { backend: "staging", mem_type: other.mem_type() }),
            },
        };
        if let Err(err) = result {
            let wire_lost = matches!(step, Step::Wire { .. }) || flow == Flow::ToWire;
            failed.get_or_insert(err);
            if wire_lost {
                break;
            }
        }
    }
    let finished = lane.finish();
    match failed {
        Some(err) => Err(err),
        None => finished,
    }
}

/// Reads and drops `len` bytes of the wire through slot 0 (after a failed copy, to stay in step).
fn discard(wire: &mut dyn Wire, lane: &mut dyn CopyLane, mut len: usize) -> Result<(), BackendError> {
    while len > 0 {
        let bytes = lane.host(0)?;
        let run = len.min(bytes.len());
        wire.receive(&mut bytes[..run])?;
        len -= run;
    }
    Ok(())
}

/// A backend's staging parameters: `staging_slots` host slots per lane (2 or more overlap the
/// copy with the wire) of `staging_bytes` each (a multiple of 4096, so O_DIRECT files fit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagingConfig {
    pub slots: usize,
    pub slot_bytes: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig { slots: 2, slot_bytes: 1 << 20 }
    }
}

impl StagingConfig {
    /// Takes `staging_slots` and `staging_bytes` from a backend's parameters, checked.
    pub fn take(params: &mut BackendParams) -> Result<StagingConfig, BackendError> {
        let defaults = StagingConfig::default();
        let slots: usize = params.take_parsed("staging_slots", defaults.slots)?;
        let slot_bytes: usize = params.take_parsed("staging_bytes", defaults.slot_bytes)?;
        let invalid =
            |name: &str, reason: &str| BackendError::InvalidParam { name: name.into(), reason: reason.into() };
        if !(1..=16).contains(&slots) {
            return Err(invalid("staging_slots", "must be 1..=16"));
        }
        if !(4096..=(256 << 20)).contains(&slot_bytes) || !slot_bytes.is_multiple_of(4096) {
            return Err(invalid("staging_bytes", "must be a multiple of 4096 in 4096..=268435456"));
        }
        Ok(StagingConfig { slots, slot_bytes })
    }
}

/// The lane of one worker or connection, created on first need and kept while the device stays
/// the same (a file-only transfer reuses whatever lane is there).
#[derive(Debug, Default)]
pub struct LaneCache {
    lane: Option<(Option<u64>, Box<dyn CopyLane>)>,
}

impl LaneCache {
    /// A lane for `pieces` (the device of their GPU memory, if any).
    pub fn get(
        &mut self,
        staging: &dyn Staging,
        config: StagingConfig,
        pieces: &[LocalMem],
    ) -> Result<&mut dyn CopyLane, BackendError> {
        let device = pieces.iter().find_map(LocalMem::device);
        let fits = matches!(&self.lane, Some((have, _)) if *have == device || device.is_none());
        if !fits {
            self.lane = None;
            self.lane = Some((device, staging.lane(device, config.slots, config.slot_bytes)?));
        }
        Ok(self.lane.as_mut().map(|(_, lane)| lane.as_mut()).expect("set above"))
    }

    /// Gives up the lane without freeing its slots: for when a copy engine or a peer may still
    /// touch them (an operation that did not finish in time), so their memory must stay valid.
    pub fn abandon(&mut self) {
        if let Some((_, lane)) = self.lane.take() {
            std::mem::forget(lane);
        }
    }
}

/// Makes copy lanes for a backend: the agent hands one to every backend it creates
/// ([`BackendContext::staging`](crate::BackendContext)), so backends stage GPU memory without
/// linking CUDA themselves.
pub trait Staging: Send + Sync + fmt::Debug {
    /// Whether GPU memory of `device` can be staged here; the typed reason when not (no driver,
    /// no such device).
    fn device_ready(&self, device: u64) -> Result<(), DeviceError>;
    /// A lane for transfers whose pieces include GPU memory of `device` (when `Some`) or only
    /// files (when `None`).
    fn lane(&self, device: Option<u64>, slots: usize, slot_bytes: usize) -> Result<Box<dyn CopyLane>, BackendError>;
}

/// Staging without GPUs: files through [`FileLane`]; GPU memory is refused with the reason.
#[derive(Debug, Clone)]
pub struct HostStaging {
    why_no_device: Arc<str>,
}

impl HostStaging {
    /// `why_no_device` is what a GPU-memory request is told.
    pub fn new(why_no_device: impl Into<Arc<str>>) -> Self {
        HostStaging { why_no_device: why_no_device.into() }
    }
}

impl Staging for HostStaging {
    fn device_ready(&self, _device: u64) -> Result<(), DeviceError> {
        Err(DeviceError::Unavailable(self.why_no_device.to_string()))
    }

    fn lane(&self, device: Option<u64>, slots: usize, slot_bytes: usize) -> Result<Box<dyn CopyLane>, BackendError> {
        if let Some(device) = device {
            self.device_ready(device)?;
        }
        Ok(Box::new(FileLane::new(slots, slot_bytes)))
    }
}

/// Host bytes that start on a page boundary, so O_DIRECT files can be read into them.
#[derive(Debug)]
struct PageSlot {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageSlot {
    fn new(len: usize) -> PageSlot {
        let storage = vec![0u8; len + file_io::DIRECT_ALIGN as usize];
        let start = storage.as_ptr().align_offset(file_io::DIRECT_ALIGN as usize);
        PageSlot { storage, start, len }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// A lane over plain (page-aligned) host slots that stages file ranges with `pread`/`pwrite` on
/// a thread of its own, so reading the next slot from the file overlaps sending this one (and
/// writing the last received slot overlaps receiving the next). A slot's buffer travels to that
/// thread and back by value: no memory is shared while the I/O runs.
#[derive(Debug)]
pub struct FileLane {
    slots: Vec<Option<PageSlot>>,
    slot_bytes: usize,
    io: Option<FileIo>,
    /// The first error of an I/O that finished, reported by the next `host` or `finish`.
    failed: Option<BackendError>,
}

/// One queued read or write of a file range through a slot's buffer.
#[derive(Debug)]
struct FileJob {
    slot: usize,
    buf: PageSlot,
    file: crate::mem::FileSlice,
    offset: u64,
    len: usize,
    write: bool,
}

type FileDone = (usize, PageSlot, Result<(), FileIoError>);

/// The lane's I/O thread and its queues (the thread ends when the lane drops its sender).
#[derive(Debug)]
struct FileIo {
    jobs: std::sync::mpsc::Sender<FileJob>,
    done: std::sync::mpsc::Receiver<FileDone>,
}

impl FileIo {
    fn start() -> Result<FileIo, BackendError> {
        let (jobs, queue) = std::sync::mpsc::channel::<FileJob>();
        let (report, done) = std::sync::mpsc::channel::<FileDone>();
        std::thread::Builder::new().name("xfer-file-lane".into()).spawn(move || {
            for mut job in queue {
                let buf = &mut job.buf.bytes()[..job.len];
                let result = if job.write {
                    file_io::write_all_at(&job.file, job.offset, buf)
                } else {
                    file_io::read_exact_at(&job.file, job.offset, buf)
                };
                if report.send((job.slot, job.buf, result)).is_err() {
                    return;
                }
            }
        })?;
        Ok(FileIo { jobs, done })
    }
}

impl FileLane {
    pub fn new(slots: usize, slot_bytes: usize) -> Self {
        let slot_bytes = slot_bytes.max(1);
        FileLane {
            slots: (0..slots.max(1)).map(|_| Some(PageSlot::new(slot_bytes))).collect(),
            slot_bytes,
            io: None,
            failed: None,
        }
    }

    /// Waits until `slot`'s buffer is back from the I/O thread.
    fn settle(&mut self, slot: usize) -> Result<(), BackendError> {
        let count = self.slots.len();
        if slot >= count {
            return Err(BackendError::Protocol(format!("staging slot {slot} of {count} does not exist")));
        }
        while self.slots[slot].is_none() {
            let io = self.io.as_ref().ok_or_else(|| BackendError::Protocol("file lane lost a slot".into()))?;
            let (done, buf, result) =
                io.done.recv().map_err(|_| BackendError::Protocol("the file lane's I/O thread ended".into()))?;
            self.slots[done] = Some(buf);
            if let Err(err) = result {
                self.failed.get_or_insert(err.into());
            }
        }
        Ok(())
    }

    /// The slot's bytes once its I/O is done, or the first error of an I/O that failed.
    fn slot_mut(&mut self, slot: usize) -> Result<&mut [u8], BackendError> {
        self.settle(slot)?;
        if let Some(err) = self.failed.take() {
            return Err(err);
        }
        Ok(self.slots[slot].as_mut().map(PageSlot::bytes).expect("settled above"))
    }

    /// Hands the slot's buffer to the I/O thread for `len` bytes at `offset` of `file`.
    fn queue(
        &mut self,
        slot: usize,
        piece: &LocalMem,
        offset: u64,
        len: usize,
        write: bool,
    ) -> Result<(), BackendError> {
        let LocalMem::File(file) = piece else {
            return Err(BackendError::MemoryNotMoved { backend: "staging", mem_type: piece.mem_type() });
        };
        if len > self.slot_bytes {
            return Err(BackendError::Protocol(format!("{len} bytes do not fit a {}-byte slot", self.slot_bytes)));
        }
        self.settle(slot)?;
        if self.io.is_none() {
            self.io = Some(FileIo::start()?);
        }
        let buf = self.slots[slot].take().expect("settled above");
        let job = FileJob { slot, buf, file: file.clone(), offset, len, write };
        let io = self.io.as_ref().expect("started above");
        io.jobs.send(job).map_err(|_| BackendError::Protocol("the file lane's I/O thread ended".into()))
    }
}

impl CopyLane for FileLane {
    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slots(&self) -> usize {
        self.slots.len()
    }

    fn fill(&mut self, slot: usize, src: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        self.queue(slot, src, offset, len, false)
    }

    fn drain(&mut self, slot: usize, dst: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        self.queue(slot, dst, offset, len, true)
    }

    fn host(&mut self, slot: usize) -> Result<&mut [u8], BackendError> {
        self.slot_mut(slot)
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        for slot in 0..self.slots.len() {
            self.settle(slot)?;
        }
        self.failed.take().map_or(Ok(()), Err)
    }
}

/// File ranges as the wire: bytes sent are written, and bytes received are read, at the next
/// position of `files` in order. Staging GPU memory to and from files within one agent (the
/// POSIX backend) is a staged transfer whose wire is this.
#[derive(Debug)]
pub struct FileWire<'a> {
    files: &'a [LocalMem],
    piece: usize,
    offset: u64,
}

impl<'a> FileWire<'a> {
    pub fn new(files: &'a [LocalMem]) -> Self {
        FileWire { files, piece: 0, offset: 0 }
    }

    /// Runs `io(file, offset in it, start, len)` over the next `len` bytes of the files.
    fn advance(
        &mut self,
        len: usize,
        mut io: impl FnMut(&crate::mem::FileSlice, u64, usize, usize) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let mut done = 0;
        while done < len {
            let Some(piece) = self.files.get(self.piece) else {
                return Err(BackendError::Protocol(format!("file side ends {} bytes early", len - done)));
            };
            let LocalMem::File(file) = piece else {
                return Err(BackendError::MemoryNotMoved { backend: "staging", mem_type: piece.mem_type() });
            };
            let run = (file.len() - self.offset).min((len - done) as u64) as usize;
            io(file, self.offset, done, run)?;
            done += run;
            self.offset += run as u64;
            if self.offset == file.len() {
                self.piece += 1;
                self.offset = 0;
            }
        }
        Ok(())
    }
}

impl Wire for FileWire<'_> {
    fn send(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
        self.advance(bytes.len(), |file, at, start, len| {
            Ok(file_io::write_all_at(file, at, &bytes[start..start + len])?)
        })
    }

    fn send_host(&mut self, slice: &MemSlice) -> Result<(), BackendError> {
        let base = slice.as_ptr();
        self.advance(slice.len(), |file, at, start, len| {
            let at = file_io::file_offset(file, at, len)?;
            // SAFETY: `start + len` lies inside the pinned host slice; the kernel only reads it;
            // `at + len` fits `off_t` (checked above).
            Ok(unsafe { file_io::write_all_raw(file.fd(), at, base.add(start), len) }?)
        })
    }

    fn receive(&mut self, bytes: &mut [u8]) -> Result<(), BackendError> {
        self.advance(bytes.len(), |file, at, start, len| {
            Ok(file_io::read_exact_at(file, at, &mut bytes[start..start + len])?)
        })
    }

    fn receive_host(&mut self, slice: &mut MemSlice) -> Result<(), BackendError> {
        let base = slice.as_mut_ptr();
        self.advance(slice.len(), |file, at, start, len| {
            let at = file_io::file_offset(file, at, len)?;
            // SAFETY: as in `send_host`; the transfer owns these registered bytes while it runs.
            Ok(unsafe { file_io::read_exact_raw(file.fd(), at, base.add(start), len) }?)
        })
    }
}

/// Host memory standing in for GPU memory, so staged paths run on machines without GPUs: a
/// "device pointer" is a host address, and a lane's copies are `memcpy`s (files as in
/// [`FileLane`]). Every device is ready.
#[derive(Debug, Clone, Copy)]
pub struct HostAsDevice(());

impl HostAsDevice {
    /// # Safety
    /// Every VRAM region registered by an agent (or backend) using this staging must name host
    /// memory of this process that satisfies `LocalRegion::new`'s contract for DRAM.
    pub unsafe fn new() -> Self {
        HostAsDevice(())
    }
}

impl Staging for HostAsDevice {
    fn device_ready(&self, _device: u64) -> Result<(), DeviceError> {
        Ok(())
    }

    fn lane(&self, _device: Option<u64>, slots: usize, slot_bytes: usize) -> Result<Box<dyn CopyLane>, BackendError> {
        Ok(Box::new(HostAsDeviceLane(FileLane::new(slots, slot_bytes))))
    }
}

#[derive(Debug)]
struct HostAsDeviceLane(FileLane);

/// The host address of `len` bytes at `offset` of a stand-in device range.
fn stand_in(mem: &LocalMem, offset: u64, len: usize) -> Result<Option<*mut u8>, BackendError> {
    let LocalMem::Device(gpu) = mem else { return Ok(None) };
    if offset.checked_add(len as u64).is_none_or(|end| end > gpu.len()) {
        return Err(BackendError::Protocol(format!("staging {len} bytes at {offset} of a {}-byte range", gpu.len())));
    }
    Ok(Some((gpu.ptr() + offset) as usize as *mut u8))
}

impl CopyLane for HostAsDeviceLane {
    fn slot_bytes(&self) -> usize {
        self.0.slot_bytes()
    }

    fn slots(&self) -> usize {
        self.0.slots()
    }

    fn fill(&mut self, slot: usize, src: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        match stand_in(src, offset, len)? {
            Some(ptr) => {
                let dst = &mut self.0.slot_mut(slot)?[..len];
                // SAFETY: `ptr .. ptr + len` is registered host memory (the contract of
                // `HostAsDevice::new`), pinned by `src`, inside its range (checked); `dst` is this
                // lane's own slot.
                unsafe { std::ptr::copy_nonoverlapping(ptr, dst.as_mut_ptr(), len) };
                Ok(())
            }
            None => self.0.fill(slot, src, offset, len),
        }
    }

    fn drain(&mut self, slot: usize, dst: &LocalMem, offset: u64, len: usize) -> Result<(), BackendError> {
        match stand_in(dst, offset, len)? {
            Some(ptr) => {
                let src = &self.0.slot_mut(slot)?[..len];
                // SAFETY: as in `fill`, writing the registered memory as a transfer does.
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr, len) };
                Ok(())
            }
            None => self.0.drain(slot, dst, offset, len),
        }
    }

    fn host(&mut self, slot: usize) -> Result<&mut [u8], BackendError> {
        self.0.host(slot)
    }

    fn finish(&mut self) -> Result<(), BackendError> {
        self.0.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(piece: usize, offset: u64, len: u64, staged: bool) -> Segment {
        Segment { piece, offset, len, staged }
    }

    #[test]
    fn segments_cut_staged_pieces_at_the_slot_size_and_keep_host_pieces_whole() {
        // (pieces as (staged, len), slot bytes, segments)
        type Case<'a> = (&'a [(bool, u64)], u64, Vec<Segment>);
        let cases: &[Case] = &[
            (&[(true, 10)], 4, vec![seg(0, 0, 4, true), seg(0, 4, 4, true), seg(0, 8, 2, true)]),
            (&[(false, 10)], 4, vec![seg(0, 0, 10, false)]),
            (
                &[(true, 4), (false, 3), (true, 5)],
                4,
                vec![seg(0, 0, 4, true), seg(1, 0, 3, false), seg(2, 0, 4, true), seg(2, 4, 1, true)],
            ),
            (&[(true, 0), (false, 0), (true, 1)], 4, vec![seg(2, 0, 1, true)]),
            (&[], 4, vec![]),
            // A zero slot size is treated as one byte rather than looping forever.
            (&[(true, 2)], 0, vec![seg(0, 0, 1, true), seg(0, 1, 1, true)]),
        ];
        for (pieces, slot_bytes, want) in cases {
            assert_eq!(&segments(pieces.iter().copied(), *slot_bytes), want, "{pieces:?} / {slot_bytes}");
        }
    }

    use Step::{Copy, Wire};

    #[test]
    fn schedules_as_tables() {
        let staged3 = [seg(0, 0, 4, true), seg(0, 4, 4, true), seg(0, 8, 4, true)];
        let mixed = [seg(0, 0, 4, true), seg(1, 0, 9, false), seg(2, 0, 4, true)];
        let host_only = [seg(0, 0, 9, false)];
        let cases: Vec<(Flow, &[Segment], usize, Vec<Step>)> = vec![
            // Two slots, sending: both slots prefetched; each send refills the slot it freed.
            (
                Flow::ToWire,
                &staged3,
                2,
                vec![
                    Copy { segment: 0, slot: 0 },
                    Copy { segment: 1, slot: 1 },
                    Wire { segment: 0, slot: Some(0) },
                    Copy { segment: 2, slot: 0 },
                    Wire { segment: 1, slot: Some(1) },
                    Wire { segment: 2, slot: Some(0) },
                ],
            ),
            // One slot: no overlap, still correct.
            (
                Flow::ToWire,
                &staged3,
                1,
                vec![
                    Copy { segment: 0, slot: 0 },
                    Wire { segment: 0, slot: Some(0) },
                    Copy { segment: 1, slot: 0 },
                    Wire { segment: 1, slot: Some(0) },
                    Copy { segment: 2, slot: 0 },
                    Wire { segment: 2, slot: Some(0) },
                ],
            ),
            // Receiving: each segment's drain starts right after it arrives.
            (
                Flow::FromWire,
                &staged3,
                2,
                vec![
                    Wire { segment: 0, slot: Some(0) },
                    Copy { segment: 0, slot: 0 },
                    Wire { segment: 1, slot: Some(1) },
                    Copy { segment: 1, slot: 1 },
                    Wire { segment: 2, slot: Some(0) },
                    Copy { segment: 2, slot: 0 },
                ],
            ),
            // Host pieces go straight over the wire, between staged ones.
            (
                Flow::ToWire,
                &mixed,
                2,
                vec![
                    Copy { segment: 0, slot: 0 },
                    Copy { segment: 2, slot: 1 },
                    Wire { segment: 0, slot: Some(0) },
                    Wire { segment: 1, slot: None },
                    Wire { segment: 2, slot: Some(1) },
                ],
            ),
            (
                Flow::FromWire,
                &mixed,
                2,
                vec![
                    Wire { segment: 0, slot: Some(0) },
                    Copy { segment: 0, slot: 0 },
                    Wire { segment: 1, slot: None },
                    Wire { segment: 2, slot: Some(1) },
                    Copy { segment: 2, slot: 1 },
                ],
            ),
            (Flow::ToWire, &host_only, 2, vec![Wire { segment: 0, slot: None }]),
            (Flow::ToWire, &[], 2, vec![]),
            // Zero slots means one.
            (Flow::FromWire, &staged3[..1], 0, vec![Wire { segment: 0, slot: Some(0) }, Copy { segment: 0, slot: 0 }]),
        ];
        for (flow, segs, slots, want) in cases {
            assert_eq!(schedule(flow, segs, slots), want, "{flow:?} {segs:?} slots={slots}");
        }
    }

    /// The properties the pipeline rests on, over many shapes: every segment crosses the wire once
    /// and in order; a staged segment's slot holds its bytes when the wire moves it; a slot is
    /// never refilled before the wire has moved what it held; and with two or more slots, the
    /// next staged segment's copy is started before the current one is sent (the overlap).
    #[test]
    fn schedules_keep_order_slot_ownership_and_overlap() {
        for slots in 1..=4 {
            for n in 0..12usize {
                for flow in [Flow::ToWire, Flow::FromWire] {
                    let segs: Vec<Segment> = (0..n).map(|i| seg(i, 0, 1, i % 3 != 1)).collect();
                    let steps = schedule(flow, &segs, slots);
                    let wired: Vec<usize> = steps
                        .iter()
                        .filter_map(|s| match s {
                            Wire { segment, .. } => Some(*segment),
                            _ => None,
                        })
                        .collect();
                    assert_eq!(wired, (0..n).collect::<Vec<_>>());
                    // What each slot holds: Some(segment) once filled (sending) or received.
                    let mut holds: Vec<Option<usize>> = vec![None; slots];
                    let mut sent_or_drained: Vec<bool> = vec![true; slots];
                    for (at, step) in steps.iter().enumerate() {
                        match (*step, flow) {
                            (Copy { segment, slot }, Flow::ToWire) => {
                                assert!(sent_or_drained[slot], "slot {slot} refilled before sent: {steps:?}");
                                holds[slot] = Some(segment);
                                sent_or_drained[slot] = false;
                            }
                            (Wire { segment, slot: Some(slot) }, Flow::ToWire) => {
                                assert_eq!(holds[slot], Some(segment), "{steps:?}");
                                sent_or_drained[slot] = true;
                                if slots >= 2 {
                                    let next = (segment + 1..n).find(|&i| segs[i].staged);
                                    if let Some(next) = next {
                                        let copied_before = steps[..at]
                                            .iter()
                                            .any(|s| matches!(s, Copy { segment, .. } if *segment == next));
                                        assert!(copied_before, "no overlap for {next}: {steps:?}");
                                    }
                                }
                            }
                            (Wire { segment, slot: Some(slot) }, Flow::FromWire) => {
                                holds[slot] = Some(segment);
                                assert_eq!(steps.get(at + 1), Some(&Copy { segment, slot }));
                            }
                            (Copy { segment, slot }, Flow::FromWire) => assert_eq!(holds[slot], Some(segment)),
                            (Wire { segment, slot: None }, _) => assert!(!segs[segment].staged),
                        }
                    }
                    assert!(steps.iter().all(|s| !matches!(s, Wire { segment, slot: None } if segs[*segment].staged)));
                }
            }
        }
    }
    use std::collections::VecDeque;
    use std::io::Write as _;
    use std::os::fd::AsRawFd;

    use crate::mem::{Desc, LocalRegion, MemType};

    /// A wire that records what is sent and serves what is received from a queue.
    #[derive(Default)]
    struct VecWire {
        sent: Vec<u8>,
        inbox: VecDeque<u8>,
    }

    impl super::Wire for VecWire {
        fn send(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
            self.sent.extend_from_slice(bytes);
            Ok(())
        }

        fn send_host(&mut self, slice: &MemSlice) -> Result<(), BackendError> {
            // SAFETY: the test's buffers have no other users while the run lasts.
            self.sent.extend_from_slice(unsafe { slice.as_slice() });
            Ok(())
        }

        fn receive(&mut self, bytes: &mut [u8]) -> Result<(), BackendError> {
            for byte in bytes.iter_mut() {
                *byte = self.inbox.pop_front().ok_or(BackendError::Protocol("wire ran dry".into()))?;
            }
            Ok(())
        }

        fn receive_host(&mut self, slice: &mut MemSlice) -> Result<(), BackendError> {
            // SAFETY: as in `send_host`.
            self.receive(unsafe { slice.as_mut_slice() })
        }
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    /// A region over `buf` of the given type (VRAM stands in through `HostAsDevice`).
    fn region_over(buf: &mut [u8], mem_type: MemType, id: u64) -> Arc<LocalRegion> {
        let desc = Desc::new(buf.as_mut_ptr() as usize as u64, buf.len() as u64, 0);
        // SAFETY: every buffer outlives its region in these tests and is only read after the run.
        Arc::new(unsafe { LocalRegion::new(id, mem_type, desc) })
    }

    fn file_region(file: &std::fs::File, len: u64, id: u64) -> Arc<LocalRegion> {
        // SAFETY: a FILE region names no memory.
        Arc::new(unsafe { LocalRegion::new(id, MemType::File, Desc::new(0, len, file.as_raw_fd() as u64)) })
    }

    fn temp_file(name: &str, contents: &[u8], writable: bool) -> (std::path::PathBuf, std::fs::File) {
        let path = std::env::temp_dir().join(format!("xfer-staging-{name}-{}", std::process::id()));
        std::fs::File::create(&path).unwrap().write_all(contents).unwrap();
        let file = std::fs::OpenOptions::new().read(true).write(writable).open(&path).unwrap();
        (path, file)
    }

    #[test]
    fn runs_move_device_host_and_file_pieces_in_order_both_ways() {
        // SAFETY: the only VRAM regions below are over host buffers of this test.
        let staging = unsafe { HostAsDevice::new() };
        let mut device = pattern(10_000, 1);
        let mut host = pattern(300, 2);
        let file_bytes = pattern(5_000, 3);
        let (path, file) = temp_file("both-ways", &file_bytes, true);
        let want: Vec<u8> = [device.clone(), host.clone(), file_bytes.clone()].concat();
        for slots in [1, 2, 3] {
            let sent = {
                let gpu = region_over(&mut device, MemType::Vram, 1);
                let dram = region_over(&mut host, MemType::Dram, 2);
                let disk = file_region(&file, 5_000, 3);
                let (gpu, dram, disk) = (gpu.pin().unwrap(), dram.pin().unwrap(), disk.pin().unwrap());
                let mut pieces = vec![
                    gpu.local_at(gpu.region().desc().addr, 10_000).unwrap(),
                    dram.local_at(dram.region().desc().addr, 300).unwrap(),
                    disk.local_at(0, 5_000).unwrap(),
                ];
                let mut lane = staging.lane(Some(0), slots, 1024).unwrap();
                let mut wire = VecWire::default();
                run(Flow::ToWire, &mut pieces, lane.as_mut(), &mut wire).unwrap();
                wire.sent
            };
            assert_eq!(sent, want, "slots={slots}");
        }
        // Receiving: new bytes land in each piece.
        let incoming = pattern(15_300, 9);
        {
            let gpu = region_over(&mut device, MemType::Vram, 1);
            let dram = region_over(&mut host, MemType::Dram, 2);
            let disk = file_region(&file, 5_000, 3);
            let (gpu, dram, disk) = (gpu.pin().unwrap(), dram.pin().unwrap(), disk.pin().unwrap());
            let mut pieces = vec![
                gpu.local_at(gpu.region().desc().addr, 10_000).unwrap(),
                dram.local_at(dram.region().desc().addr, 300).unwrap(),
                disk.local_at(0, 5_000).unwrap(),
            ];
            let mut lane = staging.lane(Some(0), 2, 1024).unwrap();
            let mut wire = VecWire { inbox: incoming.iter().copied().collect(), ..VecWire::default() };
            run(Flow::FromWire, &mut pieces, lane.as_mut(), &mut wire).unwrap();
            assert!(wire.inbox.is_empty());
        }
        assert_eq!(device, incoming[..10_000]);
        assert_eq!(host, incoming[10_000..10_300]);
        assert_eq!(std::fs::read(&path).unwrap(), incoming[10_300..]);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_failed_copy_while_receiving_still_reads_the_whole_payload() {
        let staging = HostStaging::new("no GPU in this test");
        let (path, read_only) = temp_file("read-only", &[0u8; 4096], false);
        let mut host = vec![0u8; 100];
        let disk = file_region(&read_only, 4096, 1);
        let dram = region_over(&mut host, MemType::Dram, 2);
        let (disk, dram_pin) = (disk.pin().unwrap(), dram.pin().unwrap());
        let mut pieces = vec![disk.local_at(0, 4096).unwrap(), dram_pin.local_at(dram.desc().addr, 100).unwrap()];
        let mut lane = staging.lane(None, 2, 1000).unwrap();
        let mut wire = VecWire { inbox: pattern(4196, 5).into_iter().collect(), ..VecWire::default() };
        let err = run(Flow::FromWire, &mut pieces, lane.as_mut(), &mut wire).unwrap_err();
        assert!(matches!(err, BackendError::File(_)), "{err}");
        assert!(wire.inbox.is_empty(), "the wire is left in step");
        drop((pieces, dram_pin));
        assert_eq!(host, vec![0u8; 100], "nothing after the failure is stored");
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn host_staging_refuses_gpu_memory_with_the_reason_and_stages_files() {
        let staging = HostStaging::new("libcuda.so is not installed");
        let err = staging.device_ready(0).unwrap_err();
        assert_eq!(err.to_string(), "CUDA is not available: libcuda.so is not installed");
        assert!(matches!(staging.lane(Some(0), 2, 64), Err(BackendError::Device(DeviceError::Unavailable(_)))));
        let mut lane = staging.lane(None, 2, 64).unwrap();
        assert_eq!((lane.slots(), lane.slot_bytes()), (2, 64));
        assert!(lane.host(2).is_err(), "a slot outside the lane is an error, not a panic");
    }

    #[test]
    fn staging_params_parse_with_defaults_and_bounds() {
        let take = |text: &str| StagingConfig::take(&mut BackendParams::parse(text).unwrap());
        assert_eq!(take("").unwrap(), StagingConfig { slots: 2, slot_bytes: 1 << 20 });
        assert_eq!(take("staging_slots=4,staging_bytes=65536").unwrap(), StagingConfig { slots: 4, slot_bytes: 65536 });
        for (text, name) in [
            ("staging_slots=0", "staging_slots"),
            ("staging_slots=17", "staging_slots"),
            ("staging_bytes=4095", "staging_bytes"),
            ("staging_bytes=6000", "staging_bytes"),
            ("staging_bytes=536870912", "staging_bytes"),
        ] {
            let err = take(text).unwrap_err();
            assert!(matches!(&err, BackendError::InvalidParam { name: n, .. } if n == name), "{text}: {err}");
        }
        assert!(take("staging_slots=two").is_err());
    }

    #[test]
    fn a_lane_cache_keeps_its_lane_for_files_and_the_same_device() {
        let staging = HostStaging::new("no GPU in this test");
        let (path, file) = temp_file("lane-cache", &[0u8; 4096], true);
        let region = file_region(&file, 4096, 1);
        let pin = region.pin().unwrap();
        let pieces = [pin.local_at(0, 4096).unwrap()];
        let mut cache = LaneCache::default();
        let config = StagingConfig { slots: 3, slot_bytes: 8192 };
        let first = cache.get(&staging, config, &pieces).unwrap() as *const dyn CopyLane as *const u8;
        let again = cache.get(&staging, config, &pieces).unwrap();
        assert_eq!((again.slots(), again.slot_bytes()), (3, 8192));
        assert_eq!(again as *const dyn CopyLane as *const u8, first, "the same lane serves files again");
        cache.abandon();
        assert!(cache.get(&staging, config, &pieces).is_ok(), "a new lane after one is abandoned");
        drop((pieces, pin));
        std::fs::remove_file(path).unwrap();
    }
}
