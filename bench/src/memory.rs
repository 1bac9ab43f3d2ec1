//! Registered bench memory, written before anything is measured: host memory, memory the backend
//! allocates, a file, or GPU memory.
//!
//! Fresh anonymous memory reads as the kernel's shared zero page until it is written, so a
//! source buffer that was never written would be sent from one cache-hot page and inflate the
//! figures; first writes to a destination would pay page faults inside the measurement; and a
//! sparse file would read holes.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use xfer::cuda::{CudaStaging, DeviceBuffer};
use xfer::{Agent, BackendBuffer, Desc, HostBuffer, MemType, Op, Registration, Staging};

use crate::cli::{Alloc, MemKind};
use crate::units::format_total;

/// What untouched bench memory holds (any non-zero byte).
pub const FILL: u8 = 0xa5;

/// O_DIRECT's alignment of file offsets, lengths and buffer addresses (the largest common
/// logical block size).
pub const DIRECT_ALIGN: u64 = 4096;

const CHUNK: usize = 1 << 20;
const PAGE: usize = 4096;

/// How a side makes its registered memory (`--alloc`, `--file-dir`, `--direct`, `--device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemOptions {
    pub alloc: Alloc,
    /// Where FILE memory's file is created.
    pub file_dir: PathBuf,
    /// FILE memory is opened with O_DIRECT.
    pub direct: bool,
    /// CUDA ordinal of VRAM memory.
    pub device: u64,
}

/// What both sides of a run register.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunMemory {
    /// Bytes per side.
    pub bytes: u64,
    /// The initiator's kind.
    pub local: MemKind,
    /// The target's kind.
    pub remote: MemKind,
    pub options: MemOptions,
}

impl RunMemory {
    /// The memory kinds a case moves, source→destination ("FILE→DRAM"); empty when DRAM→DRAM.
    pub fn label(&self, op: Op) -> String {
        let (local, remote) = (self.local.mem_type(), self.remote.mem_type());
        let (source, destination) = match op {
            Op::Write => (local, remote),
            Op::Read => (remote, local),
        };
        if (source, destination) == (MemType::Dram, MemType::Dram) {
            String::new()
        } else {
            format!("{source}→{destination}")
        }
    }

    /// Fails with the typed reason (no driver, no such device) when VRAM is asked of this
    /// machine but cannot be had: the initiator's side, and the target's when it runs here.
    pub fn check_gpu(&self, target_here: bool) -> Result<()> {
        let mut sides = vec![(self.local, "--local-mem")];
        if target_here {
            sides.push((self.remote, "--remote-mem"));
        }
        for (_, flag) in sides.into_iter().filter(|(kind, _)| *kind == MemKind::Vram) {
            CudaStaging
                .device_ready(self.options.device)
                .with_context(|| format!("{flag} vram on CUDA device {}", self.options.device))?;
        }
        Ok(())
    }
}

/// A side's registered memory.
#[derive(Clone, Debug)]
pub enum BenchBuffer {
    /// From the global allocator (`--alloc host`).
    Host(Arc<HostBuffer>),
    /// Allocated by the backend (`--alloc backend`, `Agent::allocate`; UCX puts it in shared
    /// memory that a peer on the host maps).
    Backend(Arc<BackendBuffer>),
    /// A file (FILE memory): its descriptor is `(offset, len, fd)`.
    File(Arc<BenchFile>),
    /// GPU memory (VRAM): its descriptor is `(device pointer, len, device)`.
    Device(Arc<DeviceBuffer>),
}

/// An open file of FILE memory. Its name is removed as soon as it is open, so nothing is left
/// behind however the process ends.
#[derive(Debug)]
pub struct BenchFile {
    file: Arc<File>,
    len: usize,
    direct: bool,
}

/// A registration together with the memory it names, dropped in that order: GPU memory is
/// registered by address, so unlike host buffers and files the registration itself does not
/// keep it alive.
#[derive(Debug)]
pub struct BenchRegistration {
    _registration: Registration,
    _memory: BenchBuffer,
}

impl BenchBuffer {
    /// `len` bytes of `kind` memory made as `options` say, every byte written, registered with
    /// `agent`'s backends.
    pub fn register(
        agent: &Agent,
        kind: MemKind,
        options: &MemOptions,
        len: usize,
    ) -> Result<(BenchBuffer, BenchRegistration)> {
        let len = len.max(1);
        let size = format_total(len as u64);
        let (buffer, registration) = match (kind, options.alloc) {
            (MemKind::Dram, Alloc::Host) => {
                let buffer = Arc::new(HostBuffer::new(len));
                let registration = agent.register_buffer(&buffer).with_context(|| format!("registering {size}"))?;
                (BenchBuffer::Host(buffer), registration)
            }
            (MemKind::Dram, Alloc::Backend) => {
                let allocation = agent
                    .allocate(len)
                    .with_context(|| format!("allocating {size} through the backend (--alloc backend)"))?;
                (BenchBuffer::Backend(allocation.buffer), allocation.registration)
            }
            (MemKind::File, _) => {
                let file = Arc::new(BenchFile::create(agent.name(), options, len)?);
                let registration = agent
                    .register_file(&file.file, 0, len as u64)
                    .with_context(|| format!("registering a {size} file"))?;
                (BenchBuffer::File(file), registration)
            }
            (MemKind::Vram, _) => {
                let device = Arc::new(
                    DeviceBuffer::new(options.device, len)
                        .with_context(|| format!("allocating {size} on CUDA device {}", options.device))?,
                );
                let registration = agent
                    .register_device_buffer(&device)
                    .with_context(|| format!("registering {size} of GPU memory"))?;
                (BenchBuffer::Device(device), registration)
            }
        };
        buffer.fill()?;
        let held = BenchRegistration { _registration: registration, _memory: buffer.clone() };
        Ok((buffer, held))
    }

    pub fn len(&self) -> usize {
        match self {
            BenchBuffer::Host(b) => b.len(),
            BenchBuffer::Backend(b) => b.len(),
            BenchBuffer::File(f) => f.len,
            BenchBuffer::Device(d) => d.len(),
        }
    }

    pub fn mem_type(&self) -> MemType {
        match self {
            BenchBuffer::Host(_) | BenchBuffer::Backend(_) => MemType::Dram,
            BenchBuffer::File(_) => MemType::File,
            BenchBuffer::Device(_) => MemType::Vram,
        }
    }

    /// The descriptor of `offset .. offset + len`, as registered (a caller bug when out of range
    /// for host memory, which panics; the others are refused when used).
    pub fn sub_desc(&self, offset: usize, len: usize) -> Desc {
        match self {
            BenchBuffer::Host(b) => b.sub_desc(offset, len),
            BenchBuffer::Backend(b) => b.sub_desc(offset, len),
            BenchBuffer::File(f) => Desc::new(offset as u64, len as u64, f.fd()),
            BenchBuffer::Device(d) => Desc::new(d.ptr() + offset as u64, len as u64, d.device()),
        }
    }

    /// Copies the bytes at `offset` into `dst`.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        match self {
            BenchBuffer::Host(b) => b.read_at(offset, dst),
            BenchBuffer::Backend(b) => b.read_at(offset, dst),
            BenchBuffer::File(f) => {
                f.read_at(offset, dst).with_context(|| self.io_context("reading", offset, dst.len()))?
            }
            BenchBuffer::Device(d) => {
                d.read(offset, dst).with_context(|| self.io_context("reading", offset, dst.len()))?
            }
        }
        Ok(())
    }

    /// Copies `src` to `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range(offset, src.len())?;
        match self {
            BenchBuffer::Host(b) => b.write_at(offset, src),
            BenchBuffer::Backend(b) => b.write_at(offset, src),
            BenchBuffer::File(f) => {
                f.write_at(offset, src).with_context(|| self.io_context("writing", offset, src.len()))?
            }
            BenchBuffer::Device(d) => {
                d.write(offset, src).with_context(|| self.io_context("writing", offset, src.len()))?
            }
        }
        Ok(())
    }

    fn io_context(&self, what: &str, offset: usize, len: usize) -> String {
        format!("{what} {len} bytes at {offset} of the {} region", self.mem_type())
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            bail!("{len} bytes at {offset} are outside the {}-byte {} region", self.len(), self.mem_type());
        }
        Ok(())
    }

    /// Writes [`FILL`] over the whole region, so every page is resident (every block of a file
    /// allocated).
    fn fill(&self) -> Result<()> {
        let len = self.len();
        let chunk = vec![FILL; CHUNK.min(len)];
        for start in (0..len).step_by(CHUNK) {
            self.write_at(start, &chunk[..CHUNK.min(len - start)])?;
        }
        Ok(())
    }
}

impl BenchFile {
    /// A new file of `len` bytes in `options.file_dir`, open for reading and writing (with
    /// O_DIRECT when `options.direct`), its name already removed.
    fn create(owner: &str, options: &MemOptions, len: usize) -> Result<BenchFile> {
        let path = options.file_dir.join(format!("{owner}.mem"));
        let mut open = OpenOptions::new();
        open.read(true).write(true).create_new(true);
        if options.direct {
            open.custom_flags(libc::O_DIRECT);
        }
        let file = open.open(&path).with_context(|| {
            format!("creating {}{}", path.display(), if options.direct { " with O_DIRECT (--direct)" } else { "" })
        })?;
        std::fs::remove_file(&path).with_context(|| format!("removing {} (it stays open)", path.display()))?;
        file.set_len(len as u64).with_context(|| format!("sizing {} to {len} bytes", path.display()))?;
        Ok(BenchFile { file: Arc::new(file), len, direct: options.direct })
    }

    fn fd(&self) -> u64 {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd() as u64
    }

    /// O_DIRECT needs an aligned buffer: such reads and writes go through one.
    fn read_at(&self, offset: usize, dst: &mut [u8]) -> std::io::Result<()> {
        if self.direct {
            let mut aligned = PageBuf::new(dst.len());
            self.file.read_exact_at(&mut aligned, offset as u64)?;
            dst.copy_from_slice(&aligned);
            Ok(())
        } else {
            self.file.read_exact_at(dst, offset as u64)
        }
    }

    fn write_at(&self, offset: usize, src: &[u8]) -> std::io::Result<()> {
        if self.direct {
            let mut aligned = PageBuf::new(src.len());
            aligned.copy_from_slice(src);
            self.file.write_all_at(&aligned, offset as u64)
        } else {
            self.file.write_all_at(src, offset as u64)
        }
    }
}

/// A plain buffer that starts on a page boundary, as registered memory does, with every page
/// written. (Where a buffer starts within its page changes loopback copy rates severalfold on
/// some machines, so the baseline's buffers are aligned like the xfer engine's.)
#[derive(Debug, Default)]
pub struct PageBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageBuf {
    pub fn new(len: usize) -> PageBuf {
        let storage = vec![FILL; len + PAGE];
        let start = storage.as_ptr().align_offset(PAGE);
        PageBuf { storage, start, len }
    }

    /// Makes the buffer at least `len` bytes long (a new allocation when it grows).
    pub fn grow(&mut self, len: usize) {
        if self.len < len {
            *self = PageBuf::new(len);
        }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(direct: bool) -> MemOptions {
        MemOptions { alloc: Alloc::Host, file_dir: std::env::temp_dir(), direct, device: 0 }
    }

    fn tcp_agent(name: &str) -> Agent {
        let agent = Agent::new(name).unwrap();
        agent.add_backend("tcp", xfer::BackendParams::parse("listen=127.0.0.1:0").unwrap()).unwrap();
        agent
    }

    #[test]
    fn buffers_hold_the_fill_byte() {
        let agent = tcp_agent("memory-test");
        let (bench, _registration) = BenchBuffer::register(&agent, MemKind::Dram, &options(false), CHUNK + 7).unwrap();
        assert_eq!((bench.len(), bench.mem_type()), (CHUNK + 7, MemType::Dram));
        let mut all = vec![0u8; CHUNK + 7];
        bench.read_at(0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == FILL));
        assert!(bench.read_at(CHUNK, &mut all).is_err(), "out of range is an error");
        // TCP allocates nothing: --alloc backend is an error there, not a silent host buffer.
        let backend = MemOptions { alloc: Alloc::Backend, ..options(false) };
        let err = BenchBuffer::register(&agent, MemKind::Dram, &backend, 4096).unwrap_err();
        assert!(format!("{err:#}").contains("does not allocate"), "{err:#}");
        let mut plain = PageBuf::new(10);
        assert_eq!(plain.as_ptr() as usize % PAGE, 0);
        assert_eq!(*plain, [FILL; 10]);
        plain.grow(20);
        assert_eq!(plain.as_ptr() as usize % PAGE, 0);
        assert_eq!(*plain, [FILL; 20]);
        plain[3] = 0;
        plain.grow(5);
        assert_eq!((plain.len(), plain[3]), (20, 0), "never shrinks");
    }

    #[test]
    fn files_are_filled_read_and_written_and_leave_no_name_behind() {
        let agent = tcp_agent("memory-file-test");
        // Temp dirs on tmpfs refuse O_DIRECT.
        let probe = std::env::temp_dir().join(format!("memory-direct-probe-{}", std::process::id()));
        let direct_here = OpenOptions::new().write(true).create(true).custom_flags(libc::O_DIRECT).open(&probe).is_ok();
        std::fs::remove_file(&probe).ok();
        if !direct_here {
            eprintln!("SKIPPED the O_DIRECT half: {} does not open files with O_DIRECT", probe.display());
        }
        for direct in [false, true].into_iter().filter(|&direct| !direct || direct_here) {
            let len = 2 * CHUNK + 8192;
            let (file, registration) = BenchBuffer::register(&agent, MemKind::File, &options(direct), len).unwrap();
            assert_eq!((file.len(), file.mem_type()), (len, MemType::File));
            assert!(!std::env::temp_dir().join("memory-file-test.mem").exists(), "removed once open");
            let desc = file.sub_desc(4096, 8192);
            assert_eq!((desc.addr, desc.len), (4096, 8192));
            let mut back = vec![0u8; 8192];
            file.read_at(CHUNK, &mut back).unwrap();
            assert!(back.iter().all(|&b| b == FILL));
            let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
            file.write_at(4096, &data).unwrap();
            file.read_at(4096, &mut back).unwrap();
            assert_eq!(back, data, "direct: {direct}");
            drop(registration);
        }
    }

    #[test]
    fn gpu_memory_without_cuda_is_the_typed_reason() {
        let agent = tcp_agent("memory-vram-test");
        match xfer::cuda::why_no_gpu() {
            Some(reason) => {
                let err = BenchBuffer::register(&agent, MemKind::Vram, &options(false), 4096).unwrap_err();
                let text = format!("{err:#}");
                assert!(text.contains("CUDA is not available") && text.contains(&reason), "{text}");
            }
            None => {
                let (gpu, _registration) = BenchBuffer::register(&agent, MemKind::Vram, &options(false), 8192).unwrap();
                assert_eq!(gpu.mem_type(), MemType::Vram);
                let mut back = vec![0u8; 8192];
                gpu.read_at(0, &mut back).unwrap();
                assert!(back.iter().all(|&b| b == FILL));
            }
        }
    }
}
