//! What staging costs over TCP on a machine without a GPU: WRITE bandwidth of DRAM→remote DRAM
//! (the baseline) beside stand-in VRAM→remote DRAM (host memory staged through the same lanes
//! a GPU uses, so the slot copies and the pipeline are real and only the device is not) and
//! FILE→remote DRAM (page-cache reads into slots), all in one run between two agents of this
//! process over loopback. Prints a table and the ratios to the baseline.
//!
//!     cargo run --release -p xfer --example staged_bandwidth [-- MIB_PER_REQUEST ROUNDS]

use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::staging::HostAsDevice;
use xfer::{Agent, BackendParams, BackendRegistry, Desc, HostBuffer, MemType, Op, RequestOptions};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(256);
    let rounds: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(7);
    let len = mib << 20;
    // SAFETY: the only VRAM region registered below is a HostBuffer alive until the end.
    let staging = Arc::new(unsafe { HostAsDevice::new() });
    let sender = Agent::with_staging("staged-bw-send", BackendRegistry::default(), staging)?;
    let receiver = Agent::new("staged-bw-recv")?;
    for agent in [&sender, &receiver] {
        agent.add_backend("tcp", BackendParams::new().with("listen", "127.0.0.1:0"))?;
    }
    let dram = Arc::new(HostBuffer::new(len));
    dram.write_at(0, &vec![0x5a; len]);
    let _dram_reg = sender.register_buffer(&dram)?;
    let vram = Arc::new(HostBuffer::new(len));
    vram.write_at(0, &vec![0x3c; len]);
    // SAFETY: as above.
    let _vram_reg = unsafe { sender.register_memory(MemType::Vram, &[vram.desc()]) }?;
    let path = std::env::temp_dir().join(format!("xfer-staged-bw-{}", std::process::id()));
    std::fs::write(&path, vec![0x1e; len])?;
    let file = Arc::new(std::fs::OpenOptions::new().read(true).write(true).open(&path)?);
    let file_reg = sender.register_file(&file, 0, len as u64)?;
    let target = Arc::new(HostBuffer::new(len));
    let _target_reg = receiver.register_buffer(&target)?;
    let side_channel = receiver.start_side_channel("127.0.0.1:0")?;
    sender.fetch_remote_metadata(&side_channel.to_string())?;

    let cases: [(&str, MemType, Desc); 3] = [
        ("DRAM→DRAM", MemType::Dram, dram.desc()),
        ("VRAM(stand-in)→DRAM", MemType::Vram, vram.desc()),
        ("FILE→DRAM", MemType::File, file_reg.descs()[0]),
    ];
    let mut best = [0f64; 3];
    // Rounds interleave the cases, so drift on a shared machine touches them alike.
    for _ in 0..rounds {
        for (index, (_, mem_type, desc)) in cases.iter().enumerate() {
            let request = sender.create_request_between(
                Op::Write,
                (*mem_type, &[*desc]),
                "staged-bw-recv",
                (MemType::Dram, &[target.desc()]),
                RequestOptions::default(),
            )?;
            let started = Instant::now();
            request.post()?;
            request.wait(Duration::from_secs(60))?;
            best[index] = best[index].max(len as f64 / started.elapsed().as_secs_f64() / 1e9);
        }
    }
    println!("| path | GB/s (best of {rounds}, {mib} MiB requests) | ÷ DRAM→DRAM |");
    println!("|---|---|---|");
    for ((name, ..), gbps) in cases.iter().zip(best) {
        println!("| {name} | {gbps:.2} | {:.2} |", gbps / best[0]);
    }
    std::fs::remove_file(&path)?;
    Ok(())
}
