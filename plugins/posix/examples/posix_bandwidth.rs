//! Bandwidth of the POSIX backend with 16 MiB blocks, buffered and O_DIRECT, DRAM→FILE then
//! FILE→DRAM. A measurement, not a check: compare it with `fio` or `dd` on the same file system
//! in the same run.
//!
//!     cargo run --release -p xfer-posix --example posix_bandwidth [-- DIR [BLOCKS]]

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::{Agent, BackendParams, Desc, HostBuffer, MemType, Op, RequestOptions};

const BLOCK: usize = 16 << 20;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().map(std::path::PathBuf::from).unwrap_or_else(std::env::temp_dir);
    let blocks: usize = args.next().map(|b| b.parse()).transpose()?.unwrap_or(32);
    for direct in [false, true] {
        let agent = Agent::new(if direct { "bw-direct" } else { "bw-buffered" })?;
        agent.add_backend("posix", BackendParams::new())?;
        let path = dir.join(format!("xfer-posix-bandwidth-{}", std::process::id()));
        let mut options = OpenOptions::new();
        options.read(true).write(true).create(true).truncate(true);
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        let file = Arc::new(options.open(&path)?);
        let buf = Arc::new(HostBuffer::new(BLOCK * blocks));
        buf.write_at(0, &vec![0x5a; BLOCK * blocks]);
        let _memory = agent.register_buffer(&buf)?;
        let registered = agent.register_file(&file, 0, (BLOCK * blocks) as u64)?;
        let fd = registered.descs()[0].dev_id;
        let local: Vec<Desc> = (0..blocks).map(|i| buf.sub_desc(i * BLOCK, BLOCK)).collect();
        let in_file: Vec<Desc> = (0..blocks).map(|i| Desc::new((i * BLOCK) as u64, BLOCK as u64, fd)).collect();
        for op in [Op::Write, Op::Read] {
            let request = agent.create_request_between(
                op,
                (MemType::Dram, &local),
                agent.name(),
                (MemType::File, &in_file),
                RequestOptions::default(),
            )?;
            let start = Instant::now();
            request.post()?;
            request.wait(Duration::from_secs(120))?;
            let gbps = (BLOCK * blocks) as f64 / start.elapsed().as_secs_f64() / 1e9;
            println!("posix {op:?} {} 16 MiB x {blocks}: {gbps:.2} GB/s", if direct { "O_DIRECT" } else { "buffered" });
        }
        drop(registered);
        std::fs::remove_file(&path)?;
    }
    Ok(())
}
