//! GPU memory and files over TCP and UCX, staged, between two processes: this test binary runs
//! itself again as the target (`XFER_STAGED_TARGET=dir`). Both sides stand host memory in for GPU
//! memory (`HostAsDevice`), so the staging pipeline, the initiator's and the target's, runs on
//! machines without GPUs; the bytes are checked in the files and buffers themselves. Over UCX
//! (whose build here has no CUDA) only the initiator stages: the target's memory is DRAM.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use xfer::staging::HostAsDevice;
use xfer::{
    Agent, BackendParams, BackendRegistry, Desc, HostBuffer, MemType, Op, Registration, RequestOptions, XferError,
};

const WAIT: Duration = Duration::from_secs(20);
const SIZE: usize = 8 << 20;
const TARGET_ENV: &str = "XFER_STAGED_TARGET";
/// Set for a target that also serves UCX (`tls=tcp` over loopback).
#[cfg(feature = "ucx")]
const UCX_ENV: &str = "XFER_STAGED_UCX";
#[cfg(feature = "ucx")]
const UCX_PARAMS: &str = "tls=tcp,net_devices=lo,staging_bytes=65536,timeout_ms=10000";

/// Small chunks and slots, so one request spans chunks, streams and many staging rounds.
fn tcp_params() -> BackendParams {
    BackendParams::new()
        .with("listen", "127.0.0.1:0")
        .with("chunk_bytes", "1048576")
        .with("staging_bytes", "65536")
        .with("split_bytes", "65536")
}

fn stand_in_agent(name: &str) -> Agent {
    // SAFETY: every VRAM region these agents register is a HostBuffer the test keeps alive.
    let staging = Arc::new(unsafe { HostAsDevice::new() });
    let agent = Agent::with_staging(name, BackendRegistry::default(), staging).unwrap();
    agent.add_backend("tcp", tcp_params()).unwrap();
    agent
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| ((i * 131 + i / 4099) as u8).wrapping_add(seed)).collect()
}

/// A file of `contents`, open for reading (and writing, when `writable`).
fn file_with(path: &Path, contents: &[u8], writable: bool) -> Arc<std::fs::File> {
    std::fs::write(path, contents).unwrap();
    Arc::new(std::fs::OpenOptions::new().read(true).write(writable).open(path).unwrap())
}

/// A HostBuffer registered as (stand-in) VRAM of device 0.
fn stand_in_vram(agent: &Agent, len: usize) -> (Arc<HostBuffer>, Registration) {
    let buf = Arc::new(HostBuffer::new(len));
    // SAFETY: the buffer lives as long as the registration (both returned together and dropped
    // by the caller in that order); HostBuffer hands out no references.
    let registration = unsafe { agent.register_memory(MemType::Vram, &[buf.desc()]) }.unwrap();
    (buf, registration)
}

/// The target process: a writable FILE, a read-only FILE, stand-in VRAM and DRAM, served until
/// stdin says `quit`; `dump` writes the VRAM and DRAM bytes to `vram.bin` and `dram.bin`, and the
/// notifications received to `notifs.txt`, for the test to check.
fn target_main(dir: &Path) {
    let agent = stand_in_agent("staged-target");
    #[cfg(feature = "ucx")]
    if std::env::var_os(UCX_ENV).is_some() {
        agent.add_backend("ucx", BackendParams::parse(UCX_PARAMS).unwrap()).unwrap();
    }
    let dram = Arc::new(HostBuffer::new(SIZE));
    dram.write_at(0, &pattern(SIZE, 5));
    let _dram_reg = agent.register_buffer(&dram).unwrap();
    let file = file_with(&dir.join("target.bin"), &pattern(SIZE, 1), true);
    let _file_reg = agent.register_file(&file, 0, SIZE as u64).unwrap();
    let read_only = file_with(&dir.join("read-only.bin"), &pattern(4096, 2), false);
    let _read_only_reg = agent.register_file(&read_only, 0, 4096).unwrap();
    // Registered longer than it is: reading its end is refused before any byte moves.
    let short = file_with(&dir.join("short.bin"), &pattern(4096, 4), false);
    let _short_reg = agent.register_file(&short, 0, 12288).unwrap();
    let (vram, _vram_reg) = stand_in_vram(&agent, SIZE);
    vram.write_at(0, &pattern(SIZE, 3));
    let side_channel = agent.start_side_channel("127.0.0.1:0").unwrap();
    println!("READY {side_channel}");
    std::io::stdout().flush().unwrap();
    for line in std::io::stdin().lock().lines() {
        match line.unwrap().trim() {
            "dump" => {
                std::fs::write(dir.join("vram.bin"), vram.to_vec()).unwrap();
                std::fs::write(dir.join("dram.bin"), dram.to_vec()).unwrap();
                let notifs: Vec<String> = agent
                    .get_notifs()
                    .into_values()
                    .flatten()
                    .map(|n| String::from_utf8_lossy(&n).into_owned())
                    .collect();
                std::fs::write(dir.join("notifs.txt"), notifs.join("\n")).unwrap();
                println!("OK");
            }
            _ => break,
        }
        std::io::stdout().flush().unwrap();
    }
}

struct Target {
    child: Child,
    stdin: ChildStdin,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
    side_channel: String,
}

impl Target {
    fn spawn(dir: &Path) -> Target {
        Target::spawn_with(dir, &[])
    }

    fn spawn_with(dir: &Path, env: &[(&str, &str)]) -> Target {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "staged_target_process", "--nocapture", "--test-threads", "1"])
            .env(TARGET_ENV, dir)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let side_channel = loop {
            let line = lines.next().expect("the target exited before READY").unwrap();
            // libtest may have begun the line with the test's name.
            if let Some((_, addr)) = line.split_once("READY ") {
                break addr.trim().to_string();
            }
        };
        Target { child, stdin, lines, side_channel }
    }

    /// Has the target write out its memory and the notifications it received since the last dump;
    /// returns `name` (`vram.bin`, `dram.bin`, `notifs.txt`).
    fn dump(&mut self, dir: &Path, name: &str) -> Vec<u8> {
        writeln!(self.stdin, "dump").unwrap();
        loop {
            let line = self.lines.next().expect("target exited").unwrap();
            if line == "OK" {
                break;
            }
        }
        std::fs::read(dir.join(name)).unwrap()
    }

    fn dump_vram(&mut self, dir: &Path) -> Vec<u8> {
        self.dump(dir, "vram.bin")
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.child.wait();
    }
}

/// The target's registrations by type, from its metadata: (FILE of SIZE, read-only FILE, VRAM).
fn remote_regions(agent: &Agent) -> (Desc, Desc, Desc) {
    let regions = agent.remote_regions("staged-target").unwrap();
    let find = |mem_type: MemType, len: u64| {
        regions.iter().find(|(t, d)| *t == mem_type && d.len == len).map(|(_, d)| *d).unwrap()
    };
    (find(MemType::File, SIZE as u64), find(MemType::File, 4096), find(MemType::Vram, SIZE as u64))
}

fn transfer(agent: &Agent, op: Op, local: (MemType, &[Desc]), remote: (MemType, &[Desc])) -> Result<(), XferError> {
    let request = agent.create_request_between(op, local, "staged-target", remote, RequestOptions::default())?;
    request.post()?;
    request.wait(WAIT)
}

fn sub(desc: Desc, offset: u64, len: u64) -> Desc {
    Desc::new(desc.addr + offset, len, desc.dev_id)
}

#[test]
fn staged_target_process() {
    // Only a target when started by the test below; otherwise there is nothing to do here.
    if let Some(dir) = std::env::var_os(TARGET_ENV) {
        target_main(&PathBuf::from(dir));
    }
}

#[test]
fn gpu_memory_and_files_cross_tcp_staged_on_both_sides() {
    let dir = std::env::temp_dir().join(format!("xfer-staged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut target = Target::spawn(&dir);
    let agent = stand_in_agent("staged-init");
    assert_eq!(agent.fetch_remote_metadata(&target.side_channel).unwrap(), "staged-target");
    let (remote_file, remote_read_only, remote_vram) = remote_regions(&agent);

    let dram = Arc::new(HostBuffer::new(SIZE));
    let _dram_reg = agent.register_buffer(&dram).unwrap();
    let local_file = file_with(&dir.join("local.bin"), &vec![0u8; SIZE], true);
    let file_reg = agent.register_file(&local_file, 0, SIZE as u64).unwrap();
    let local_file_desc = file_reg.descs()[0];
    let (vram, vram_reg) = stand_in_vram(&agent, SIZE);
    let local_vram_desc = vram_reg.descs()[0];

    // DRAM → remote FILE, at an odd offset and length.
    let data = pattern(3 * 1024 * 1024 + 17, 10);
    dram.write_at(0, &data);
    let len = data.len() as u64;
    transfer(
        &agent,
        Op::Write,
        (MemType::Dram, &[dram.sub_desc(0, data.len())]),
        (MemType::File, &[sub(remote_file, 4093, len)]),
    )
    .unwrap();
    let on_disk = std::fs::read(dir.join("target.bin")).unwrap();
    assert_eq!(on_disk[4093..4093 + data.len()], data[..], "DRAM → remote FILE");
    assert_eq!(on_disk[..4093], pattern(SIZE, 1)[..4093], "bytes before the range are untouched");

    // Remote FILE → local (stand-in) VRAM: the whole file.
    transfer(&agent, Op::Read, (MemType::Vram, &[local_vram_desc]), (MemType::File, &[remote_file])).unwrap();
    assert_eq!(vram.to_vec(), on_disk, "remote FILE → local VRAM");

    // Local VRAM → remote VRAM, then remote VRAM → local FILE.
    vram.write_at(0, &pattern(SIZE, 20));
    transfer(&agent, Op::Write, (MemType::Vram, &[local_vram_desc]), (MemType::Vram, &[remote_vram])).unwrap();
    assert_eq!(target.dump_vram(&dir), pattern(SIZE, 20), "local VRAM → remote VRAM");
    transfer(&agent, Op::Read, (MemType::File, &[local_file_desc]), (MemType::Vram, &[remote_vram])).unwrap();
    assert_eq!(std::fs::read(dir.join("local.bin")).unwrap(), pattern(SIZE, 20), "remote VRAM → local FILE");

    // Scattered: 257 local FILE pieces of 4096 + 13 bytes into one remote VRAM range, reversed.
    let piece = 4096 + 13;
    let locals: Vec<Desc> = (0..257).rev().map(|i| sub(local_file_desc, i * piece, piece)).collect();
    transfer(&agent, Op::Write, (MemType::File, &locals), (MemType::Vram, &[sub(remote_vram, 0, 257 * piece)]))
        .unwrap();
    let local_bytes = pattern(SIZE, 20);
    let want: Vec<u8> = (0..257u64)
        .rev()
        .flat_map(|i| local_bytes[(i * piece) as usize..((i + 1) * piece) as usize].to_vec())
        .collect();
    assert_eq!(target.dump_vram(&dir)[..want.len()], want[..], "scattered FILE → VRAM");

    // KV blocks the vLLM way, with GPU memory: prepared lists of (stand-in) VRAM blocks here and
    // FILE blocks there, moved by block-id index lists.
    let block = 64 * 1024 + 512;
    let gpu_blocks: Vec<Desc> = (0..64).map(|i| sub(local_vram_desc, i * block, block)).collect();
    let file_blocks: Vec<Desc> = (0..64).map(|i| sub(remote_file, i * block, block)).collect();
    let prepared_gpu = agent.prep_local(MemType::Vram, &gpu_blocks).unwrap();
    let prepared_file = agent.prep_remote("staged-target", MemType::File, &file_blocks).unwrap();
    vram.write_at(0, &pattern(SIZE, 30));
    let (ids_here, ids_there) = ([3usize, 60, 7, 7 + 1], [50usize, 2, 33, 34]);
    let request = agent
        .make_request(Op::Write, &prepared_gpu, &ids_here, &prepared_file, &ids_there, RequestOptions::default())
        .unwrap();
    assert_eq!(request.backend(), "tcp");
    request.post().unwrap();
    request.wait(WAIT).unwrap();
    let on_disk = std::fs::read(dir.join("target.bin")).unwrap();
    let gpu_bytes = pattern(SIZE, 30);
    for (&here, &there) in ids_here.iter().zip(&ids_there) {
        let (from, to) = (here * block as usize, there * block as usize);
        assert_eq!(on_disk[to..to + block as usize], gpu_bytes[from..from + block as usize], "block {here} → {there}");
    }

    // A WRITE into a read-only file is refused with the reason, and the link keeps working.
    let err =
        transfer(&agent, Op::Write, (MemType::Dram, &[dram.sub_desc(0, 4096)]), (MemType::File, &[remote_read_only]))
            .unwrap_err();
    assert!(matches!(&err, XferError::Refused { message, .. } if message.contains("not open for writing")), "{err}");
    transfer(&agent, Op::Read, (MemType::Dram, &[dram.sub_desc(0, 4096)]), (MemType::File, &[remote_read_only]))
        .unwrap();
    assert_eq!(dram.to_vec()[..4096], pattern(4096, 2)[..], "the read-only file reads");
    // Reading past the end of a remote file: a refusal with the reason, the link still in step.
    let short = agent.remote_regions("staged-target").unwrap().into_iter().find(|(_, d)| d.len == 12288).unwrap().1;
    let err =
        transfer(&agent, Op::Read, (MemType::Dram, &[dram.sub_desc(0, 12288)]), (MemType::File, &[short])).unwrap_err();
    assert!(matches!(&err, XferError::Refused { message, .. } if message.contains("file ends")), "{err}");
    transfer(&agent, Op::Read, (MemType::Dram, &[dram.sub_desc(0, 4096)]), (MemType::File, &[sub(short, 0, 4096)]))
        .unwrap();
    assert_eq!(dram.to_vec()[..4096], pattern(4096, 4)[..], "its first block reads");

    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// UCX without CUDA stages the initiator's files and (stand-in) GPU memory like TCP does, each
/// slot a get or a put of its own; the target's DRAM is reached one-sidedly as usual.
#[cfg(feature = "ucx")]
#[test]
fn files_and_gpu_memory_cross_ucx_staged_from_the_initiator() {
    let dir = std::env::temp_dir().join(format!("xfer-staged-ucx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut target = Target::spawn_with(&dir, &[(UCX_ENV, "1")]);
    // SAFETY: every VRAM region this agent registers is a HostBuffer the test keeps alive.
    let staging = Arc::new(unsafe { HostAsDevice::new() });
    let agent = Agent::with_staging("staged-init", BackendRegistry::default(), staging).unwrap();
    agent.add_backend("ucx", BackendParams::parse(UCX_PARAMS).unwrap()).unwrap();
    // The target's FILE and VRAM regions carry UCX keys that say they are not reachable.
    assert_eq!(agent.fetch_remote_metadata(&target.side_channel).unwrap(), "staged-target");
    let regions = agent.remote_regions("staged-target").unwrap();
    let remote_dram = regions.iter().find(|(t, d)| *t == MemType::Dram && d.len == SIZE as u64).unwrap().1;
    let (remote_file, _, _) = remote_regions(&agent);

    let local_file = file_with(&dir.join("local.bin"), &pattern(SIZE, 50), true);
    let file_reg = agent.register_file(&local_file, 0, SIZE as u64).unwrap();
    let local_file_desc = file_reg.descs()[0];
    let (vram, vram_reg) = stand_in_vram(&agent, SIZE);
    let local_vram_desc = vram_reg.descs()[0];
    let dram = Arc::new(HostBuffer::new(SIZE));
    let _dram_reg = agent.register_buffer(&dram).unwrap();
    let run = |op: Op, local: (MemType, &[Desc]), remote: &[Desc], notif: Option<&str>| {
        let options = notif.map(RequestOptions::notify).unwrap_or_default();
        let request =
            agent.create_request_between(op, local, "staged-target", (MemType::Dram, remote), options).unwrap();
        assert_eq!(request.backend(), "ucx");
        request.post().unwrap();
        request.wait(WAIT)
    };

    // FILE → remote DRAM, the whole file, then a notification.
    run(Op::Write, (MemType::File, &[local_file_desc]), &[remote_dram], Some("file-done")).unwrap();
    assert_eq!(target.dump(&dir, "dram.bin"), pattern(SIZE, 50), "FILE → remote DRAM");
    // The same dump wrote the notifications (the target hands each out once).
    assert_eq!(std::fs::read(dir.join("notifs.txt")).unwrap(), b"file-done", "the notification after the data");

    // Remote DRAM → FILE at an odd offset and length.
    let len = 3 * 65536 + 4099;
    run(Op::Read, (MemType::File, &[sub(local_file_desc, 4093, len)]), &[sub(remote_dram, 4096, len)], None).unwrap();
    let on_disk = std::fs::read(dir.join("local.bin")).unwrap();
    let mut want = pattern(SIZE, 50);
    want[4093..4093 + len as usize].copy_from_slice(&pattern(SIZE, 50)[4096..4096 + len as usize]);
    assert_eq!(on_disk, want, "remote DRAM → FILE");

    // Scattered (stand-in) VRAM pieces, reversed, into one remote DRAM range.
    vram.write_at(0, &pattern(SIZE, 60));
    let piece = 4096 + 13;
    let locals: Vec<Desc> = (0..257).rev().map(|i| sub(local_vram_desc, i * piece, piece)).collect();
    run(Op::Write, (MemType::Vram, &locals), &[sub(remote_dram, 0, 257 * piece)], None).unwrap();
    let vram_bytes = pattern(SIZE, 60);
    let want: Vec<u8> =
        (0..257u64).rev().flat_map(|i| vram_bytes[(i * piece) as usize..((i + 1) * piece) as usize].to_vec()).collect();
    assert_eq!(target.dump(&dir, "dram.bin")[..want.len()], want[..], "scattered VRAM → remote DRAM");

    // Remote DRAM → VRAM, whole.
    let remote_bytes = target.dump(&dir, "dram.bin");
    run(Op::Read, (MemType::Vram, &[local_vram_desc]), &[remote_dram], None).unwrap();
    assert_eq!(vram.to_vec(), remote_bytes, "remote DRAM → VRAM");

    // The target's FILE is not reachable through UCX: no path, and named explicitly a clear error.
    let err = agent
        .create_request_between(
            Op::Write,
            (MemType::Dram, &[dram.sub_desc(0, 4096)]),
            "staged-target",
            (MemType::File, &[sub(remote_file, 0, 4096)]),
            RequestOptions::default(),
        )
        .unwrap_err();
    assert!(matches!(err, XferError::NoBackend(_)), "{err}");
    let err = agent
        .create_request_between(
            Op::Write,
            (MemType::Dram, &[dram.sub_desc(0, 4096)]),
            "staged-target",
            (MemType::File, &[sub(remote_file, 0, 4096)]),
            RequestOptions::default().backend("ucx"),
        )
        .unwrap_err();
    assert!(err.to_string().contains("ucx does not move DRAM→FILE"), "{err}");

    // A READ into a read-only local file is refused before any byte moves; the link still works.
    let read_only = file_with(&dir.join("read-only-local.bin"), &pattern(4096, 80), false);
    let read_only_reg = agent.register_file(&read_only, 0, 4096).unwrap();
    let err = run(Op::Read, (MemType::File, &read_only_reg.descs()), &[sub(remote_dram, 0, 4096)], None).unwrap_err();
    assert!(err.to_string().contains("not open for writing"), "{err}");
    run(Op::Write, (MemType::File, &[sub(local_file_desc, 0, 4096)]), &[sub(remote_dram, 0, 4096)], None).unwrap();
    assert_eq!(target.dump(&dir, "dram.bin")[..4096], on_disk[..4096], "the link keeps working");

    // A dead target fails a staged request within the backend's timeout, and nothing hangs.
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let started = std::time::Instant::now();
    let err = run(Op::Write, (MemType::File, &[local_file_desc]), &[remote_dram], Some("never")).unwrap_err();
    assert!(started.elapsed() < WAIT, "{err} after {:?}", started.elapsed());
    drop(target);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn without_cuda_gpu_memory_is_refused_with_the_reason() {
    if let Some(reason) = xfer::cuda::why_no_gpu() {
        let agent = Agent::new("no-gpu").unwrap();
        agent.add_backend("tcp", tcp_params()).unwrap();
        // SAFETY: the registration is refused before anything could touch the address.
        let err = unsafe { agent.register_memory(MemType::Vram, &[Desc::new(1 << 40, 4096, 0)]) }.unwrap_err();
        let text = err.to_string();
        assert!(text.contains("CUDA is not available") && text.contains(&reason), "{text}");
    } else {
        use std::io::Write as _;
        let _ =
            writeln!(std::io::stderr(), "SKIPPED without_cuda_gpu_memory_is_refused_with_the_reason: a GPU is here");
    }
}

/// Real GPU memory through CUDA's lanes (pinned slots, one stream each), both sides in this
/// process over loopback: VRAM → remote DRAM, VRAM → remote VRAM, remote DRAM → VRAM. Skips
/// loudly without a GPU; `ci/gpu-check.sh` runs it with `XFER_REQUIRE_GPU=1`.
#[test]
fn real_gpu_memory_crosses_tcp_through_cuda_lanes() {
    use xfer::cuda::{gpu_or_skip, DeviceBuffer};
    if !gpu_or_skip("real_gpu_memory_crosses_tcp_through_cuda_lanes") {
        return;
    }
    let len = 48 << 20;
    let (a, b) = (Agent::new("gpu-a").unwrap(), Agent::new("gpu-b").unwrap());
    for agent in [&a, &b] {
        agent.add_backend("tcp", BackendParams::new().with("listen", "127.0.0.1:0")).unwrap();
    }
    a.add_backend("posix", BackendParams::new()).unwrap();
    // The registration is returned with the descriptor: dropping it deregisters the memory.
    let register_gpu = |agent: &Agent, buf: &DeviceBuffer| {
        let desc = Desc::new(buf.ptr(), buf.len() as u64, buf.device());
        // SAFETY: the device buffer outlives the registration (both live to the end of the test).
        (desc, unsafe { agent.register_memory(MemType::Vram, &[desc]) }.unwrap())
    };
    let gpu_a = DeviceBuffer::new(0, len).unwrap();
    let gpu_b = DeviceBuffer::new(0, len).unwrap();
    let ((desc_a, _reg_a), (desc_b, _reg_b)) = (register_gpu(&a, &gpu_a), register_gpu(&b, &gpu_b));
    let host_b = Arc::new(HostBuffer::new(len));
    let _host_reg = b.register_buffer(&host_b).unwrap();
    let side_channel = b.start_side_channel("127.0.0.1:0").unwrap();
    a.fetch_remote_metadata(&side_channel.to_string()).unwrap();
    let run = |op: Op, remote: (MemType, Desc)| {
        let request = a
            .create_request_between(
                op,
                (MemType::Vram, &[desc_a]),
                "gpu-b",
                (remote.0, &[remote.1]),
                Default::default(),
            )
            .unwrap();
        request.post().unwrap();
        request.wait(WAIT).unwrap();
    };
    let data = pattern(len, 40);
    gpu_a.write(0, &data).unwrap();
    run(Op::Write, (MemType::Dram, host_b.desc()));
    assert_eq!(host_b.to_vec(), data, "VRAM → remote DRAM");
    run(Op::Write, (MemType::Vram, desc_b));
    let mut back = vec![0u8; len];
    gpu_b.read(0, &mut back).unwrap();
    assert_eq!(back, data, "VRAM → remote VRAM");
    host_b.write_at(0, &pattern(len, 41));
    run(Op::Read, (MemType::Dram, host_b.desc()));
    gpu_a.read(0, &mut back).unwrap();
    assert_eq!(back, pattern(len, 41), "remote DRAM → VRAM");
    // VRAM → this agent's own file through posix (staged), and back.
    let path = std::env::temp_dir().join(format!("xfer-gpu-file-{}", std::process::id()));
    let file = file_with(&path, &vec![0u8; len], true);
    let file_reg = a.register_file(&file, 0, len as u64).unwrap();
    let to_file = a
        .create_request_between(
            Op::Write,
            (MemType::Vram, &[desc_a]),
            "gpu-a",
            (MemType::File, &file_reg.descs()),
            RequestOptions::default().backend("posix"),
        )
        .unwrap();
    to_file.post().unwrap();
    to_file.wait(WAIT).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), pattern(len, 41), "VRAM → FILE (posix)");
    std::fs::remove_file(&path).unwrap();
}
