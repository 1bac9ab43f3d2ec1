//! The GDS backend through an agent. Without a GPU and cuFile (every CI machine) attaching it
//! is refused with the reason; with both (`ci/gpu-check.sh`), GPU memory goes to and from files.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use xfer::cuda::DeviceBuffer;
use xfer::{Agent, BackendError, BackendParams, Desc, FileIoError, MemType, Op, RequestOptions, XferError};

const WAIT: Duration = Duration::from_secs(30);

/// The agent with `gds` attached, or why it cannot be (printed straight to stderr, past the
/// harness's capture, so a skip is seen).
fn gds_agent(name: &str) -> Result<Agent, XferError> {
    gds_agent_with(name, BackendParams::new())
}

fn gds_agent_with(name: &str, params: BackendParams) -> Result<Agent, XferError> {
    let agent = Agent::new(name).unwrap();
    agent.add_backend("gds", params)?;
    Ok(agent)
}

#[test]
fn bad_parameters_are_refused_before_cufile_is_touched() {
    for (key, value) in [("batch_limit", "0"), ("batch_limit", "2000"), ("timeout_ms", "0"), ("max_request_bytes", "0")]
    {
        let err = gds_agent_with("gds-params", BackendParams::new().with(key, value)).unwrap_err();
        let XferError::Backend { source, .. } = &err else { panic!("{err}") };
        assert!(matches!(&**source, BackendError::InvalidParam { name, .. } if name == key), "{key}={value}: {err}");
    }
}

/// Many descriptors: 64 scattered GPU blocks to and from reversed file blocks, through cuFile's
/// batch API (`batch_limit` 16: four batches) and run by run (`batch_limit` 1), bytes checked.
#[test]
fn scattered_blocks_through_cufile_batches_and_run_by_run() {
    for limit in ["16", "1"] {
        let name = format!("gds-batch-{limit}");
        let agent = match gds_agent_with(&name, BackendParams::new().with("batch_limit", limit)) {
            Ok(agent) => agent,
            Err(err) => {
                let _ = writeln!(std::io::stderr(), "SKIPPED scattered_blocks_through_cufile_batches: {err}");
                return;
            }
        };
        let (block, blocks) = (64 * 1024 + 512, 64u64);
        let len = (block * blocks) as usize;
        let gpu = DeviceBuffer::new(0, len).unwrap();
        let gpu_desc = Desc::new(gpu.ptr(), len as u64, gpu.device());
        // SAFETY: the device buffer outlives the registration (both live to the end of the loop).
        let _gpu_reg = unsafe { agent.register_memory(MemType::Vram, &[gpu_desc]) }.unwrap();
        let path = std::env::temp_dir().join(format!("xfer-gds-batch-{limit}-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; len]).unwrap();
        let file = Arc::new(std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap());
        let file_reg = agent.register_file(&file, 0, len as u64).unwrap();
        let file_desc = file_reg.descs()[0];
        let gpu_blocks: Vec<Desc> = (0..blocks).map(|i| Desc::new(gpu.ptr() + i * block, block, 0)).collect();
        let file_blocks: Vec<Desc> =
            (0..blocks).rev().map(|i| Desc::new(file_desc.addr + i * block, block, file_desc.dev_id)).collect();
        let run = |op: Op| {
            let request = agent
                .create_request_between(
                    op,
                    (MemType::Vram, &gpu_blocks),
                    &name,
                    (MemType::File, &file_blocks),
                    RequestOptions::default(),
                )
                .unwrap();
            request.post().unwrap();
            request.wait(WAIT).unwrap();
        };
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
        gpu.write(0, &data).unwrap();
        run(Op::Write);
        let on_disk = std::fs::read(&path).unwrap();
        for i in 0..blocks as usize {
            let (from, to) = (i * block as usize, (blocks as usize - 1 - i) * block as usize);
            assert_eq!(on_disk[to..to + block as usize], data[from..from + block as usize], "block {i}, limit {limit}");
        }
        gpu.write(0, &vec![0u8; len]).unwrap();
        run(Op::Read);
        let mut back = vec![0u8; len];
        gpu.read(0, &mut back).unwrap();
        assert_eq!(back, data, "FILE → VRAM, limit {limit}");
        std::fs::remove_file(&path).unwrap();
    }
}

#[test]
fn without_cufile_attaching_is_refused_with_the_reason() {
    match gds_agent("gds-probe") {
        Ok(_) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED without_cufile_attaching_is_refused: cuFile is here");
        }
        Err(XferError::Backend { source, .. }) => {
            let BackendError::Device(err) = &*source else { panic!("not a device error: {source}") };
            let text = err.to_string();
            assert!(
                text.contains("not available") && (text.contains("libcuda") || text.contains("libcufile")),
                "{text}"
            );
        }
        Err(other) => panic!("unexpected error: {other}"),
    }
}

#[test]
fn gpu_memory_to_and_from_files_through_cufile() {
    let agent = match gds_agent("gds-data") {
        Ok(agent) => agent,
        Err(err) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED gpu_memory_to_and_from_files_through_cufile: {err}");
            return;
        }
    };
    let len = 8 << 20;
    let gpu = DeviceBuffer::new(0, len).unwrap();
    let gpu_desc = Desc::new(gpu.ptr(), len as u64, gpu.device());
    // SAFETY: the device buffer outlives the registration (both live to the end of the test).
    let _gpu_reg = unsafe { agent.register_memory(MemType::Vram, &[gpu_desc]) }.unwrap();
    let dir = std::env::temp_dir();
    let path = dir.join(format!("xfer-gds-{}", std::process::id()));
    std::fs::write(&path, vec![0u8; len]).unwrap();
    let file = Arc::new(std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap());
    let file_reg = agent.register_file(&file, 0, len as u64).unwrap();
    let run = |op: Op, local: (MemType, &[Desc]), remote: (MemType, &[Desc])| {
        let request = agent.create_request_between(op, local, "gds-data", remote, RequestOptions::default())?;
        request.post()?;
        request.wait(WAIT)
    };
    let data: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
    gpu.write(0, &data).unwrap();
    run(Op::Write, (MemType::Vram, &[gpu_desc]), (MemType::File, &file_reg.descs())).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), data, "VRAM → FILE");
    gpu.write(0, &vec![0u8; len]).unwrap();
    run(Op::Read, (MemType::Vram, &[gpu_desc]), (MemType::File, &file_reg.descs())).unwrap();
    let mut back = vec![0u8; len];
    gpu.read(0, &mut back).unwrap();
    assert_eq!(back, data, "FILE → VRAM");
    // A registration beyond the file's end: reading it is ShortFile.
    let short = Arc::new(std::fs::File::open(&path).unwrap());
    let short_reg = agent.register_file(&short, (len - 4096) as u64, 8192).unwrap();
    let gpu_piece = [Desc::new(gpu.ptr(), 8192, gpu.device())];
    let err = run(Op::Read, (MemType::Vram, &gpu_piece), (MemType::File, &short_reg.descs())).unwrap_err();
    let XferError::Backend { source, .. } = &err else { panic!("{err}") };
    assert!(matches!(&**source, BackendError::File(FileIoError::ShortFile { .. })), "{err}");
    // A read-only file is refused for WRITE.
    let err = run(Op::Write, (MemType::Vram, &gpu_piece), (MemType::File, &short_reg.descs())).unwrap_err();
    assert!(err.to_string().contains("not open for writing"), "{err}");
    std::fs::remove_file(&path).unwrap();
}
