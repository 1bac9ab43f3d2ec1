//! Bandwidth of the POSIX backend with 16 MiB blocks, buffered and O_DIRECT: one request of
//! DRAM→FILE (WRITE), then one of FILE→DRAM (READ). A measurement, not a check:
//! `bench/posix-vs-fio.sh` runs it beside `fio` on the same file.
//!
//!     cargo run --release -p xfer-posix --example posix_bandwidth -- [OPTIONS]
//!
//! | option | default | meaning |
//! |---|---|---|
//! | `--dir DIR` | `$TMPDIR` | where the file goes (a new one per run, deleted after) |
//! | `--file PATH` | | use this file instead, written over in place and kept |
//! | `--size BYTES` | `512M` | bytes per request (K/M/G: binary) |
//! | `--block BYTES` | `16M` | bytes per descriptor |
//! | `--mode buffered\|direct\|both` | `both` | open the file without or with `O_DIRECT` |
//! | `--op write\|read\|both` | `both` | which requests |
//! | `--params k=v,...` | | the posix backend's parameters (e.g. `engine=threads`) |
//! | `--json` | | one JSON object per measurement instead of a sentence |
//!
//! How it counts, the same way as `fio --end_fsync=1 --invalidate=1`: a WRITE's time runs from
//! posting the request to the end of `fsync` of the file; before a READ the file's cached pages
//! are dropped (`posix_fadvise(DONTNEED)`, clean after that fsync), so a buffered READ comes
//! from the device too. Registering and filling the memory happen before the clock starts.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use xfer::{Agent, BackendParams, Desc, HostBuffer, MemType, Op, RequestOptions};

const WAIT: Duration = Duration::from_secs(600);

struct Options {
    dir: PathBuf,
    file: Option<PathBuf>,
    size: usize,
    block: usize,
    modes: Vec<bool>,
    ops: Vec<Op>,
    params: String,
    json: bool,
}

fn bytes(value: &str) -> anyhow::Result<usize> {
    let (digits, scale) = match value.as_bytes().last() {
        Some(b'K') => (&value[..value.len() - 1], 1 << 10),
        Some(b'M') => (&value[..value.len() - 1], 1 << 20),
        Some(b'G') => (&value[..value.len() - 1], 1 << 30),
        _ => (value, 1),
    };
    let n: usize = digits.parse().with_context(|| format!("{value:?} is not a size"))?;
    n.checked_mul(scale).with_context(|| format!("{value} is too large"))
}

fn options() -> anyhow::Result<Options> {
    let mut options = Options {
        dir: std::env::temp_dir(),
        file: None,
        size: 512 << 20,
        block: 16 << 20,
        modes: vec![false, true],
        ops: vec![Op::Write, Op::Read],
        params: String::new(),
        json: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--json" {
            options.json = true;
            continue;
        }
        let value = args.next().with_context(|| format!("{flag} needs a value"))?;
        match (flag.as_str(), value.as_str()) {
            ("--dir", dir) => options.dir = dir.into(),
            ("--file", file) => options.file = Some(file.into()),
            ("--size", size) => options.size = bytes(size)?,
            ("--block", block) => options.block = bytes(block)?,
            ("--mode", "buffered") => options.modes = vec![false],
            ("--mode", "direct") => options.modes = vec![true],
            ("--mode", "both") => options.modes = vec![false, true],
            ("--op", "write") => options.ops = vec![Op::Write],
            ("--op", "read") => options.ops = vec![Op::Read],
            ("--op", "both") => options.ops = vec![Op::Write, Op::Read],
            ("--params", params) => options.params = params.to_string(),
            _ => bail!("unknown option {flag} {value} (see the doc comment of posix_bandwidth.rs)"),
        }
    }
    if options.block == 0 || options.size == 0 || !options.size.is_multiple_of(options.block) {
        bail!("--size {} must be a non-zero multiple of --block {}", options.size, options.block);
    }
    Ok(options)
}

fn open(path: &PathBuf, direct: bool, truncate: bool) -> anyhow::Result<File> {
    let mut options = OpenOptions::new();
    options.read(true).write(true).create(true).truncate(truncate);
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options.open(path).with_context(|| format!("opening {}", path.display()))
}

/// Drops the file's pages from the page cache (they are clean after `fsync`).
fn drop_cached_pages(file: &File) -> anyhow::Result<()> {
    // SAFETY: posix_fadvise takes integers only and reads or writes no memory of the process.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!("posix_fadvise(DONTNEED): {}", std::io::Error::from_raw_os_error(rc));
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let options = options()?;
    let blocks = options.size / options.block;
    let params = BackendParams::parse(&options.params)?;
    for &direct in &options.modes {
        let mode = if direct { "direct" } else { "buffered" };
        let agent = Agent::new(&format!("bw-{mode}"))?;
        agent.add_backend("posix", params.clone())?;
        let (path, keep) = match &options.file {
            Some(file) => (file.clone(), true),
            None => (options.dir.join(format!("xfer-posix-bandwidth-{}", std::process::id())), false),
        };
        let file = Arc::new(open(&path, direct, !keep)?);
        let buf = Arc::new(HostBuffer::new(options.size));
        buf.write_at(0, &vec![0x5a; options.size]);
        let _memory = agent.register_buffer(&buf)?;
        let registered = agent.register_file(&file, 0, options.size as u64)?;
        let fd = registered.descs()[0].dev_id;
        let block = options.block;
        let local: Vec<Desc> = (0..blocks).map(|i| buf.sub_desc(i * block, block)).collect();
        let in_file: Vec<Desc> = (0..blocks).map(|i| Desc::new((i * block) as u64, block as u64, fd)).collect();
        for &op in &options.ops {
            let request = agent.create_request_between(
                op,
                (MemType::Dram, &local),
                agent.name(),
                (MemType::File, &in_file),
                RequestOptions::default(),
            )?;
            if op == Op::Read {
                drop_cached_pages(&file)?;
            }
            let start = Instant::now();
            request.post()?;
            request.wait(WAIT)?;
            if op == Op::Write {
                file.sync_all()?;
            }
            let seconds = start.elapsed().as_secs_f64();
            let mbps = options.size as f64 / seconds / 1e6;
            let op_name = if op == Op::Write { "write" } else { "read" };
            if options.json {
                println!(
                    "{{\"tool\":\"xfer-posix\",\"params\":{:?},\"mode\":\"{mode}\",\"op\":\"{op_name}\",\"bytes\":{},\"block\":{block},\"seconds\":{seconds:.6},\"mbps\":{mbps:.1}}}",
                    options.params, options.size
                );
            } else {
                println!("posix {op_name} {mode} {block} B x {blocks}: {mbps:.0} MB/s");
            }
        }
        drop(registered);
        if !keep {
            std::fs::remove_file(&path)?;
        }
    }
    Ok(())
}
