//! The POSIX backend through the real agent API: real files in a directory on disk, real
//! worker threads, every byte checked. Each test runs once per engine (`threads::…` and
//! `uring::…`, see `for_each_engine!` at the end).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use xfer::{Agent, BackendError, BackendParams, Desc, FileIoError, HostBuffer, MemType, Op, RequestOptions, XferError};

const WAIT: Duration = Duration::from_secs(120);

fn dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("xfer-posix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A file of this agent's test (agents are named per engine, so the engines' runs never share one).
fn path(agent: &Agent, name: &str) -> PathBuf {
    dir().join(format!("{}-{name}", agent.name()))
}

#[derive(Clone, Copy, Debug)]
enum Engine {
    Threads,
    Uring,
}

impl Engine {
    fn param(self) -> &'static str {
        match self {
            Engine::Threads => "threads",
            Engine::Uring => "uring",
        }
    }
}

fn agent(name: &str, engine: Engine) -> Agent {
    let agent = Agent::new(&format!("{name}-{}", engine.param())).unwrap();
    let params = format!("engine={},threads=4,iodepth=8,chunk_bytes=1048576", engine.param());
    agent.add_backend("posix", BackendParams::parse(&params).unwrap()).unwrap();
    agent
}

fn read_write(path: &PathBuf) -> Arc<File> {
    Arc::new(OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap())
}

/// Bytes no two offsets (mod 2^32) or seeds share by accident.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn run(agent: &Agent, op: Op, local: (MemType, &[Desc]), remote: (MemType, &[Desc])) -> Result<(), XferError> {
    let req = agent.create_request_between(op, local, agent.name(), remote, RequestOptions::default())?;
    req.post()?;
    req.wait(WAIT)
}

fn file_error(err: &XferError) -> &FileIoError {
    match err {
        XferError::Backend { source, .. } => match &**source {
            BackendError::File(file) => file,
            other => panic!("not a file error: {other}"),
        },
        other => panic!("not a backend error: {other}"),
    }
}

fn one_byte_to_256_mib_round_trip_through_a_file(engine: Engine) {
    let agent = agent("sizes", engine);
    for (index, len) in [1usize, 4099, 1 << 20, 16 << 20, 256 << 20].into_iter().enumerate() {
        let file_path = path(&agent, &format!("sizes-{index}"));
        let file = read_write(&file_path);
        let source = Arc::new(HostBuffer::new(len));
        let data = pattern(len, index as u64 + 1);
        source.write_at(0, &data);
        let back = Arc::new(HostBuffer::new(len));
        let _regs = (agent.register_buffer(&source).unwrap(), agent.register_buffer(&back).unwrap());
        let file_reg = agent.register_file(&file, 0, len as u64).unwrap();
        let file_desc = file_reg.descs()[0];
        assert_eq!(file_desc.dev_id, std::os::fd::AsRawFd::as_raw_fd(&*file) as u64);

        run(&agent, Op::Write, (MemType::Dram, &[source.desc()]), (MemType::File, &[file_desc])).unwrap();
        assert!(std::fs::read(&file_path).unwrap() == data, "file differs after WRITE of {len} bytes");
        run(&agent, Op::Read, (MemType::Dram, &[back.desc()]), (MemType::File, &[file_desc])).unwrap();
        assert!(back.to_vec() == data, "memory differs after READ of {len} bytes");
        drop(file_reg);
        std::fs::remove_file(&file_path).unwrap();
    }
}

/// A permutation of `0..n` (deterministic).
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let noise = pattern(n * 4, seed);
    for i in (1..n).rev() {
        let r = u32::from_le_bytes(noise[i * 4..i * 4 + 4].try_into().unwrap()) as usize;
        order.swap(i, r % (i + 1));
    }
    order
}

fn one_to_4096_scattered_descriptors(engine: Engine) {
    let agent = agent("descs", engine);
    for (round, count) in [1usize, 7, 64, 4096].into_iter().enumerate() {
        let block = 1000usize; // deliberately not a page or sector multiple
        let total = count * block;
        let file_path = path(&agent, &format!("descs-{count}"));
        let file = read_write(&file_path);
        let source = Arc::new(HostBuffer::new(total));
        let data = pattern(total, 100 + round as u64);
        source.write_at(0, &data);
        let back = Arc::new(HostBuffer::new(total));
        let _regs = (agent.register_buffer(&source).unwrap(), agent.register_buffer(&back).unwrap());
        let file_reg = agent.register_file(&file, 0, total as u64).unwrap();
        let fd = file_reg.descs()[0].dev_id;
        let local_order = shuffled(count, 7 + round as u64);
        let file_order = shuffled(count, 9 + round as u64);
        let local: Vec<Desc> = local_order.iter().map(|&i| source.sub_desc(i * block, block)).collect();
        let in_file: Vec<Desc> = file_order.iter().map(|&j| Desc::new((j * block) as u64, block as u64, fd)).collect();

        run(&agent, Op::Write, (MemType::Dram, &local), (MemType::File, &in_file)).unwrap();
        let written = std::fs::read(&file_path).unwrap();
        for (&i, &j) in local_order.iter().zip(&file_order) {
            assert!(written[j * block..][..block] == data[i * block..][..block], "block {i} → file block {j}");
        }
        let back_descs: Vec<Desc> = local_order.iter().map(|&i| back.sub_desc(i * block, block)).collect();
        run(&agent, Op::Read, (MemType::Dram, &back_descs), (MemType::File, &in_file)).unwrap();
        assert!(back.to_vec() == data, "{count} descriptors: memory differs after READ");
    }
}

fn boundaries_of_both_lists_need_not_line_up_and_file_can_be_local(engine: Engine) {
    let agent = agent("unaligned", engine);
    let file_path = path(&agent, "unaligned");
    let file = read_write(&file_path);
    let buf = Arc::new(HostBuffer::new(10_000));
    let data = pattern(10_000, 5);
    buf.write_at(0, &data);
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 10_000).unwrap();
    let fd = file_reg.descs()[0].dev_id;
    let local = [buf.sub_desc(0, 3_000), buf.sub_desc(3_000, 7_000)];
    let in_file = [Desc::new(0, 5_000, fd), Desc::new(5_000, 1, fd), Desc::new(5_001, 4_999, fd)];
    run(&agent, Op::Write, (MemType::Dram, &local), (MemType::File, &in_file)).unwrap();
    assert!(std::fs::read(&file_path).unwrap() == data);
    // The same bytes with the file as the local side: READ pulls host memory into the file.
    buf.write_at(0, &pattern(10_000, 6));
    run(&agent, Op::Read, (MemType::File, &in_file), (MemType::Dram, &local)).unwrap();
    assert!(std::fs::read(&file_path).unwrap() == pattern(10_000, 6));
    buf.write_at(0, &[0u8; 10_000]);
    run(&agent, Op::Write, (MemType::File, &in_file), (MemType::Dram, &local)).unwrap();
    assert!(buf.to_vec() == pattern(10_000, 6));
}

fn concurrent_requests_from_many_threads(engine: Engine) {
    let agent = agent("concurrent", engine);
    let file_path = path(&agent, "concurrent");
    let file = read_write(&file_path);
    const THREADS: usize = 8;
    const SLICE: usize = 256 << 10;
    let buf = Arc::new(HostBuffer::new(THREADS * SLICE * 2));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, (THREADS * SLICE) as u64).unwrap();
    let fd = file_reg.descs()[0].dev_id;
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let (agent, buf) = (agent.clone(), Arc::clone(&buf));
            scope.spawn(move || {
                for round in 0..10u64 {
                    let data = pattern(SLICE, t as u64 * 1000 + round);
                    let (src, dst) = (t * SLICE * 2, t * SLICE * 2 + SLICE);
                    buf.write_at(src, &data);
                    let in_file = [Desc::new((t * SLICE) as u64, SLICE as u64, fd)];
                    run(&agent, Op::Write, (MemType::Dram, &[buf.sub_desc(src, SLICE)]), (MemType::File, &in_file))
                        .unwrap();
                    run(&agent, Op::Read, (MemType::Dram, &[buf.sub_desc(dst, SLICE)]), (MemType::File, &in_file))
                        .unwrap();
                    let mut got = vec![0u8; SLICE];
                    buf.read_at(dst, &mut got);
                    assert!(got == data, "thread {t} round {round}");
                }
            });
        }
    });
}

fn reading_past_the_end_of_a_short_file_is_a_typed_error(engine: Engine) {
    let agent = agent("short", engine);
    let file_path = path(&agent, "short");
    std::fs::write(&file_path, pattern(100, 1)).unwrap();
    let file = Arc::new(File::open(&file_path).unwrap());
    let buf = Arc::new(HostBuffer::new(4096));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 4096).unwrap();
    let fd = file_reg.descs()[0].dev_id;
    let err =
        run(&agent, Op::Read, (MemType::Dram, &[buf.desc()]), (MemType::File, &[Desc::new(0, 4096, fd)])).unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::ShortFile { got: 100, len: 4096, .. }), "{err}");
    // What is there still reads.
    run(&agent, Op::Read, (MemType::Dram, &[buf.sub_desc(0, 100)]), (MemType::File, &[Desc::new(0, 100, fd)])).unwrap();
    let mut got = vec![0u8; 100];
    buf.read_at(0, &mut got);
    assert_eq!(got, pattern(100, 1));
}

fn bad_offsets_are_typed_errors(engine: Engine) {
    let agent = agent("offsets", engine);
    let file = read_write(&path(&agent, "offsets"));
    let buf = Arc::new(HostBuffer::new(4096));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 4096, 4096).unwrap();
    let fd = file_reg.descs()[0].dev_id;
    // Outside the registered range of the file: refused before the request exists.
    let err = agent
        .create_request_between(
            Op::Read,
            (MemType::Dram, &[buf.desc()]),
            agent.name(),
            (MemType::File, &[Desc::new(0, 4096, fd)]),
            RequestOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(err, XferError::NotRegistered { mem_type: MemType::File, .. }), "{err}");
    // Beyond what the file API addresses (off_t is signed).
    let huge = i64::MAX as u64 - 10;
    let far = agent.register_file(&file, huge, 100).unwrap();
    let err = run(&agent, Op::Write, (MemType::Dram, &[buf.sub_desc(0, 100)]), (MemType::File, &[far.descs()[0]]))
        .unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::BadOffset { .. }), "{err}");
    // Inside the registration but past the file's data: a short read of nothing.
    let err = run(&agent, Op::Read, (MemType::Dram, &[buf.desc()]), (MemType::File, &[Desc::new(4096, 4096, fd)]))
        .unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::ShortFile { got: 0, offset: 4096, .. }), "{err}");
}

fn writing_a_read_only_file_is_refused_and_reading_it_works(engine: Engine) {
    let agent = agent("read-only", engine);
    let file_path = path(&agent, "read-only");
    std::fs::write(&file_path, pattern(8192, 3)).unwrap();
    let file = Arc::new(File::open(&file_path).unwrap());
    let buf = Arc::new(HostBuffer::new(8192));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 8192).unwrap();
    let whole = [file_reg.descs()[0]];
    let err = run(&agent, Op::Write, (MemType::Dram, &[buf.desc()]), (MemType::File, &whole)).unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::NotWritable { .. }), "{err}");
    assert_eq!(std::fs::read(&file_path).unwrap(), pattern(8192, 3), "the file was touched");
    run(&agent, Op::Read, (MemType::Dram, &[buf.desc()]), (MemType::File, &whole)).unwrap();
    assert_eq!(buf.to_vec(), pattern(8192, 3));
    // Write-only: reading is refused the same way.
    let write_only = Arc::new(OpenOptions::new().write(true).open(&file_path).unwrap());
    let wo_reg = agent.register_file(&write_only, 0, 8192).unwrap();
    let err = run(&agent, Op::Read, (MemType::Dram, &[buf.desc()]), (MemType::File, &[wo_reg.descs()[0]])).unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::NotReadable { .. }), "{err}");
}

fn a_deleted_file_keeps_working_through_its_descriptor_and_a_closed_one_is_refused(engine: Engine) {
    let agent = agent("deleted", engine);
    let file_path = path(&agent, "deleted");
    let file = read_write(&file_path);
    let buf = Arc::new(HostBuffer::new(65536));
    buf.write_at(0, &pattern(65536, 8));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 65536).unwrap();
    std::fs::remove_file(&file_path).unwrap();
    // POSIX keeps the inode until the last close: the registration holds the File open.
    let whole = [file_reg.descs()[0]];
    run(&agent, Op::Write, (MemType::Dram, &[buf.desc()]), (MemType::File, &whole)).unwrap();
    buf.write_at(0, &[0u8; 65536]);
    run(&agent, Op::Read, (MemType::Dram, &[buf.desc()]), (MemType::File, &whole)).unwrap();
    assert_eq!(buf.to_vec(), pattern(65536, 8));
    // A descriptor that is not open (far above any process's limit): refused at registration.
    let closed = Desc::new(0, 4096, 2_000_000_000);
    // SAFETY: FILE descriptors name no memory of this process.
    let err = unsafe { agent.register_memory(MemType::File, &[closed]) }.unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::BadFd { fd: 2_000_000_000, .. }), "{err}");
}

fn o_direct_needs_aligned_transfers(engine: Engine) {
    let agent = agent("direct", engine);
    let file_path = path(&agent, "direct");
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&file_path);
    let file = match opened {
        Ok(file) => Arc::new(file),
        Err(err) => {
            eprintln!("SKIPPED o_direct_needs_aligned_transfers: {} refuses O_DIRECT: {err}", file_path.display());
            return;
        }
    };
    let len = 4 << 20;
    let buf = Arc::new(HostBuffer::new(len + 4096));
    buf.write_at(0, &pattern(len, 11));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, len as u64).unwrap();
    let fd = file_reg.descs()[0].dev_id;
    let whole = [Desc::new(0, len as u64, fd)];
    run(&agent, Op::Write, (MemType::Dram, &[buf.sub_desc(0, len)]), (MemType::File, &whole)).unwrap();
    buf.write_at(0, &vec![0u8; len]);
    run(&agent, Op::Read, (MemType::Dram, &[buf.sub_desc(0, len)]), (MemType::File, &whole)).unwrap();
    let mut got = vec![0u8; len];
    buf.read_at(0, &mut got);
    assert!(got == pattern(len, 11), "O_DIRECT round trip differs");
    let err =
        run(&agent, Op::Read, (MemType::Dram, &[buf.sub_desc(1, 4096)]), (MemType::File, &[Desc::new(0, 4096, fd)]))
            .unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::Misaligned { what: "buffer address", .. }), "{err}");
    let err =
        run(&agent, Op::Read, (MemType::Dram, &[buf.sub_desc(0, 100)]), (MemType::File, &[Desc::new(0, 100, fd)]))
            .unwrap_err();
    assert!(matches!(file_error(&err), FileIoError::Misaligned { what: "length", .. }), "{err}");
}

fn notifications_reach_the_agent_itself_after_the_data(engine: Engine) {
    let agent = agent("notify", engine);
    let file = read_write(&path(&agent, "notify"));
    let buf = Arc::new(HostBuffer::new(4096));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 4096).unwrap();
    let req = agent
        .create_request_between(
            Op::Write,
            (MemType::Dram, &[buf.desc()]),
            agent.name(),
            (MemType::File, &[file_reg.descs()[0]]),
            RequestOptions::notify(b"saved"),
        )
        .unwrap();
    req.post().unwrap();
    req.wait(WAIT).unwrap();
    assert_eq!(agent.get_notifs_from(agent.name()), vec![b"saved".to_vec()]);
    assert_eq!(req.backend(), "posix");
}

#[test]
fn backend_selection_refuses_what_nothing_moves_with_the_reason() {
    let agent = Agent::new("selection").unwrap();
    agent.add_backend("posix", BackendParams::new()).unwrap();
    agent.add_backend("tcp", BackendParams::parse("listen=127.0.0.1:0").unwrap()).unwrap();
    let file = read_write(&dir().join("selection"));
    let buf = Arc::new(HostBuffer::new(8192));
    let _reg = agent.register_buffer(&buf).unwrap();
    let file_reg = agent.register_file(&file, 0, 4096).unwrap();
    let file_desc = [file_reg.descs()[0]];
    // DRAM→FILE: TCP could stage it over loopback, but posix comes first in attach order.
    let to_file = |options: RequestOptions| {
        agent.create_request_between(
            Op::Write,
            (MemType::Dram, &[buf.sub_desc(0, 4096)]),
            "selection",
            (MemType::File, &file_desc),
            options,
        )
    };
    assert_eq!(to_file(RequestOptions::default()).unwrap().backend(), "posix");
    assert_eq!(to_file(RequestOptions::default().backend("tcp")).unwrap().backend(), "tcp");
    // Naming posix for DRAM→DRAM: it does not move it.
    let dram_to_dram = |options: RequestOptions| {
        agent.create_request(Op::Write, &[buf.sub_desc(0, 4096)], "selection", &[buf.sub_desc(4096, 4096)], options)
    };
    let err = dram_to_dram(RequestOptions::default().backend("posix")).unwrap_err();
    assert!(matches!(&err, XferError::NoBackend(reason) if reason.contains("posix does not move DRAM→DRAM")), "{err}");
    assert_eq!(dram_to_dram(RequestOptions::default()).unwrap().backend(), "tcp");
    // BLK: no attached backend registers it.
    // SAFETY: the registration is refused before anything could touch the (absent) device.
    let err = unsafe { agent.register_memory(MemType::Blk, &[Desc::new(0, 4096, 0)]) }.unwrap_err();
    assert!(matches!(&err, XferError::NoBackend(reason) if reason.contains("BLK")), "{err}");
}

#[test]
fn engine_parameter_is_checked() {
    let agent = Agent::new("engine-param").unwrap();
    let err = agent.add_backend("posix", BackendParams::parse("engine=aio").unwrap()).unwrap_err();
    match &err {
        XferError::Backend { source, .. } => {
            assert!(matches!(&**source, BackendError::InvalidParam { name, .. } if name == "engine"), "{err}")
        }
        other => panic!("not a backend error: {other}"),
    }
    agent.add_backend("posix", BackendParams::parse("engine=auto").unwrap()).unwrap();
}

/// Whether this kernel gives the posix backend io_uring; where not, says so on stderr (a test
/// that cannot run is never a silent pass). `XFER_POSIX_REQUIRE_URING=1` makes that a failure.
fn uring_available(test: &str) -> bool {
    let probe = Agent::new("uring-probe").unwrap();
    let Err(err) = probe.add_backend("posix", BackendParams::parse("engine=uring").unwrap()) else { return true };
    assert!(std::env::var_os("XFER_POSIX_REQUIRE_URING").is_none(), "io_uring required but unavailable: {err}");
    eprintln!("SKIPPED uring::{test}: io_uring is not available here: {err}");
    false
}

macro_rules! for_each_engine {
    ($($test:ident),* $(,)?) => {
        mod threads {
            $(#[test]
            fn $test() {
                super::$test(super::Engine::Threads)
            })*
        }
        mod uring {
            $(#[test]
            fn $test() {
                if super::uring_available(stringify!($test)) {
                    super::$test(super::Engine::Uring)
                }
            })*
        }
    };
}

for_each_engine!(
    one_byte_to_256_mib_round_trip_through_a_file,
    one_to_4096_scattered_descriptors,
    boundaries_of_both_lists_need_not_line_up_and_file_can_be_local,
    concurrent_requests_from_many_threads,
    reading_past_the_end_of_a_short_file_is_a_typed_error,
    bad_offsets_are_typed_errors,
    writing_a_read_only_file_is_refused_and_reading_it_works,
    a_deleted_file_keeps_working_through_its_descriptor_and_a_closed_one_is_refused,
    o_direct_needs_aligned_transfers,
    notifications_reach_the_agent_itself_after_the_data,
);

/// GPU memory ↔ FILE, staged through a lane, with host memory standing in for the GPU: a
/// scattered VRAM list into a file and back, through both request orientations.
#[test]
fn gpu_memory_to_and_from_files_is_staged() {
    // SAFETY: the only VRAM region is a HostBuffer this test keeps alive past the agent's use.
    let staging = Arc::new(unsafe { xfer::staging::HostAsDevice::new() });
    let agent = Agent::with_staging("gpu-files", xfer::BackendRegistry::default(), staging).unwrap();
    agent.add_backend("posix", BackendParams::parse("chunk_bytes=65536").unwrap()).unwrap();
    let len = (3 << 20) + 4093;
    let gpu = Arc::new(HostBuffer::new(len));
    // SAFETY: as above.
    let gpu_reg = unsafe { agent.register_memory(MemType::Vram, &[gpu.desc()]) }.unwrap();
    let gpu_desc = gpu_reg.descs()[0];
    let file = read_write(&dir().join("gpu-files"));
    let file_reg = agent.register_file(&file, 0, len as u64).unwrap();
    let file_desc = file_reg.descs()[0];
    let data = pattern(len, 77);
    gpu.write_at(0, &data);
    // Scattered: the GPU side in 97 pieces, reversed, to the file in order.
    let piece = len as u64 / 97;
    let mut pieces: Vec<Desc> =
        (0..97).map(|i| Desc::new(gpu_desc.addr + i * piece, piece, gpu_desc.dev_id)).rev().collect();
    let tail = len as u64 - 97 * piece;
    pieces.push(Desc::new(gpu_desc.addr + 97 * piece, tail, gpu_desc.dev_id));
    run(&agent, Op::Write, (MemType::Vram, &pieces), (MemType::File, &[file_desc])).unwrap();
    let want: Vec<u8> = pieces
        .iter()
        .flat_map(|d| data[(d.addr - gpu_desc.addr) as usize..(d.addr - gpu_desc.addr + d.len) as usize].to_vec())
        .collect();
    assert_eq!(std::fs::read(dir().join("gpu-files")).unwrap(), want, "VRAM → FILE");
    // FILE (local) → VRAM (remote side of the request): the file's bytes land in order.
    gpu.write_at(0, &vec![0u8; len]);
    run(&agent, Op::Write, (MemType::File, &[file_desc]), (MemType::Vram, &[gpu_desc])).unwrap();
    assert_eq!(gpu.to_vec(), want, "FILE → VRAM");
    // READ the other way: VRAM local, the file remote.
    gpu.write_at(0, &vec![0u8; len]);
    run(&agent, Op::Read, (MemType::Vram, &[gpu_desc]), (MemType::File, &[file_desc])).unwrap();
    assert_eq!(gpu.to_vec(), want, "READ FILE → VRAM");
    // A length mismatch is refused before any byte moves.
    let short = [Desc::new(file_desc.addr, file_desc.len - 1, file_desc.dev_id)];
    let err = run(&agent, Op::Write, (MemType::Vram, &[gpu_desc]), (MemType::File, &short)).unwrap_err();
    assert!(matches!(&err, XferError::LengthMismatch { .. } | XferError::Refused { .. }), "{err}");
}

#[test]
fn gpu_memory_without_cuda_is_refused_with_the_reason() {
    if xfer::cuda::why_no_gpu().is_none() {
        use std::io::Write as _;
        let _ =
            writeln!(std::io::stderr(), "SKIPPED gpu_memory_without_cuda_is_refused_with_the_reason: a GPU is here");
        return;
    }
    let agent = Agent::new("gpu-none").unwrap();
    agent.add_backend("posix", BackendParams::new()).unwrap();
    // SAFETY: refused before anything touches the address.
    let err = unsafe { agent.register_memory(MemType::Vram, &[Desc::new(1 << 40, 4096, 0)]) }.unwrap_err();
    assert!(err.to_string().contains("CUDA is not available"), "{err}");
}
