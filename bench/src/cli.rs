//! Command-line flags and the run settings checked from them.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Parser, ValueEnum};
use xfer::{BackendParams, MemType, Op};

use crate::layout::{region_bytes, Case};
use crate::memory::{MemOptions, RunMemory, DIRECT_ALIGN};
use crate::units::{format_total, parse_block_size, parse_bytes, MIB};

/// The backend name of the plain-TCP baseline (no xfer involved).
pub const RAW_TCP: &str = "raw-tcp";

/// The KV-shaped preset: many small scattered blocks vs one contiguous request of equal size.
pub const KV_BLOCK: u64 = 16 << 10;
pub const KV_BATCH: u64 = 2048;
pub const KV_CONTIGUOUS: u64 = 32 * MIB;

#[derive(Parser, Debug, Clone)]
#[command(name = "xferbench", version, about = "Transfer benchmark for xfer backends (nixlbench-style)")]
pub struct Args {
    /// Backend: an xfer backend name (tcp, ...) or raw-tcp (plain TCP baseline, no xfer)
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Backend parameters, k=v,... (given to both sides)
    #[arg(long, default_value = "")]
    pub params: String,
    /// Direction, seen from the initiator; both = read, then write
    #[arg(long, value_enum, default_value_t = OpArg::Write)]
    pub op: OpArg,
    /// Block sizes, 4K..64M (K/M suffixes or bytes)
    #[arg(long, value_delimiter = ',', value_parser = parse_block_size, default_value = "64K,1M,16M")]
    pub block_sizes: Vec<u64>,
    /// Descriptors (blocks) per request
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub batch: u64,
    /// Initiator threads, each posting its own requests
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub threads: u64,
    /// Requests each initiator thread keeps in flight (an xfer backend's; raw-tcp has one)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub window: u64,
    /// Measured requests per thread per block size [default: enough to move about 1 GiB]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub iters: Option<u64>,
    /// Runs of every case (alternating engines with --compare); the median run by GB/s is reported
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub repeat: u64,
    /// Requests per thread before measuring (not in the statistics)
    #[arg(long, default_value_t = 5)]
    pub warmup: u64,
    /// Place blocks at random distinct slots of a 4x larger registration (KV-shaped)
    #[arg(long)]
    pub scatter: bool,
    /// Fill the source with a pattern and verify the destination after the run
    #[arg(long)]
    pub check: bool,
    /// Also run the raw-tcp baseline for every case and report the ratio to it
    #[arg(long)]
    pub compare: bool,
    /// Run the KV-shaped pair instead of --block-sizes: 16K x 2048 scattered vs 32M x 1
    #[arg(long)]
    pub kv_shape: bool,
    /// Move every case under a revocable grant: the target grants the initiator exactly the
    /// case's remote blocks, so each descriptor passes the grant check (backend "NAME+grants")
    #[arg(long)]
    pub grants: bool,
    /// Seed of the scattered layouts and check patterns
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Cap on the memory registered per side
    #[arg(long, value_parser = parse_bytes, default_value = "1G")]
    pub max_mem: u64,
    /// Write the result rows as a JSON array
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the result rows as CSV
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Use running targets' side channels (raw-tcp port PORT+1) instead of spawning them; several
    /// (comma-separated) for --scheme one-to-many
    #[arg(long, value_name = "HOST:PORT,...", value_delimiter = ',')]
    pub connect: Vec<String>,
    /// Who talks to whom: one initiator agent and one target (pairwise), --peers initiator agents
    /// sharing one target (many-to-one), or one agent spreading its threads over --peers targets
    /// (one-to-many). Thread t uses agent/target t mod --peers.
    #[arg(long, value_enum, default_value_t = Scheme::Pairwise)]
    pub scheme: Scheme,
    /// Agents (many-to-one) or targets (one-to-many) of the scheme; --threads is raised to it
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub peers: u64,
    /// Also plot GB/s against block size: writes PATH.svg and PATH.png
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// Measure nothing: print, plot and re-export the rows of these JSON files (--json output
    /// of earlier runs or of bench/peers/)
    #[arg(long, value_delimiter = ',', value_name = "FILE,...")]
    pub rows: Vec<PathBuf>,
    /// No progress bar
    #[arg(long)]
    pub no_progress: bool,
    /// Also print single-thread memcpy bandwidth at each block size (the shared-memory ceiling)
    #[arg(long)]
    pub memcpy: bool,
    /// Target: side-channel address to serve on (the raw-tcp port is PORT+1, or any when 0)
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Run as the target process (serves until stdin closes)
    #[arg(long, hide = true)]
    pub target: bool,
    /// Where both sides' registered memory comes from: host (the global allocator) or backend
    /// (allocated by the backend, Agent::allocate: UCX puts it in shared memory that a peer on
    /// this host maps, so shared-memory transfers are copies; the target is told too)
    #[arg(long, value_enum, default_value_t = Alloc::Host)]
    pub alloc: Alloc,
    /// The initiator's registered memory: dram (host memory), vram (GPU memory of --device) or
    /// file (a file in --file-dir)
    #[arg(long, value_enum, default_value_t = MemKind::Dram)]
    pub local_mem: MemKind,
    /// The target's registered memory, as --local-mem (the initiator tells the target it starts)
    #[arg(long, value_enum, default_value_t = MemKind::Dram)]
    pub remote_mem: MemKind,
    /// Where FILE memory lives: one file per side, removed as soon as it is open [default: the
    /// system temp dir]
    #[arg(long, value_name = "DIR")]
    pub file_dir: Option<PathBuf>,
    /// Open FILE memory with O_DIRECT (registered size and block sizes must be multiples of 4096)
    #[arg(long)]
    pub direct: bool,
    /// CUDA device ordinal of VRAM memory
    #[arg(long, default_value_t = 0)]
    pub device: u64,
    /// Target: bytes to register [default: what the sizing flags need]
    #[arg(long, hide = true, value_parser = parse_bytes)]
    pub mem: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Scheme {
    Pairwise,
    ManyToOne,
    OneToMany,
}

impl Scheme {
    /// (initiator agents, targets) for `peers`.
    pub fn shape(self, peers: u64) -> (u64, u64) {
        match self {
            Scheme::Pairwise => (1, 1),
            Scheme::ManyToOne => (peers, 1),
            Scheme::OneToMany => (1, peers),
        }
    }
}

/// A side's kind of registered memory (`--local-mem`, `--remote-mem`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MemKind {
    Dram,
    Vram,
    File,
}

impl MemKind {
    pub fn mem_type(self) -> MemType {
        match self {
            MemKind::Dram => MemType::Dram,
            MemKind::Vram => MemType::Vram,
            MemKind::File => MemType::File,
        }
    }

    /// The flag value that names this kind.
    fn flag(self) -> String {
        self.to_possible_value().expect("no kind is skipped").get_name().to_string()
    }
}

/// Where registered DRAM comes from (`--alloc`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Alloc {
    Host,
    Backend,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OpArg {
    Read,
    Write,
    Both,
}

impl OpArg {
    pub fn ops(self) -> Vec<Op> {
        match self {
            OpArg::Read => vec![Op::Read],
            OpArg::Write => vec![Op::Write],
            OpArg::Both => vec![Op::Read, Op::Write],
        }
    }
}

/// Checked settings of an initiator run.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The xfer backend under test, or `None` for raw-tcp alone.
    pub xfer_backend: Option<String>,
    pub params: String,
    pub cases: Vec<Case>,
    pub threads: u64,
    /// Requests in flight per thread.
    pub window: u64,
    pub iters: Option<u64>,
    pub repeat: u64,
    pub warmup: u64,
    pub check: bool,
    pub compare: bool,
    pub kv_shape: bool,
    pub grants: bool,
    pub seed: u64,
    /// What each side registers.
    pub memory: RunMemory,
    pub progress: bool,
    /// Initiator agents and targets (see `Scheme`).
    pub agents: u64,
    pub targets: u64,
}

impl Args {
    /// The cases the flags ask for, in run order (ops outermost).
    pub fn cases(&self) -> Vec<Case> {
        let mut cases = Vec::new();
        for op in self.op.ops() {
            if self.kv_shape {
                cases.push(Case { op, block: KV_BLOCK, batch: KV_BATCH, scatter: true });
                cases.push(Case { op, block: KV_CONTIGUOUS, batch: 1, scatter: false });
            } else {
                cases.extend(self.block_sizes.iter().map(|&block| Case {
                    op,
                    block,
                    batch: self.batch,
                    scatter: self.scatter,
                }));
            }
        }
        cases
    }

    /// `--threads`, raised so every agent or target of the scheme gets one.
    pub fn effective_threads(&self) -> u64 {
        let (agents, targets) = self.scheme.shape(self.peers);
        self.threads.max(agents).max(targets)
    }

    /// The xfer backend named by `--backend`, or `None` for raw-tcp.
    pub fn xfer_backend(&self) -> Option<String> {
        (self.backend != RAW_TCP).then(|| self.backend.clone())
    }

    /// How both sides make their memory.
    pub fn mem_options(&self) -> MemOptions {
        MemOptions {
            alloc: self.alloc,
            file_dir: self.file_dir.clone().unwrap_or_else(std::env::temp_dir),
            direct: self.direct,
            device: self.device,
        }
    }

    /// Bytes to register per side: `--mem`, else what the cases need, within `--max-mem`; with
    /// `--direct`, it and every block size a multiple of O_DIRECT's alignment.
    pub fn memory(&self) -> Result<u64> {
        let need = region_bytes(&self.cases(), self.effective_threads());
        let mem = self.mem.unwrap_or(need);
        if mem > self.max_mem {
            bail!(
                "this run needs {} of registered memory per side (block size x batch x threads{}), over the \
                 --max-mem cap of {}; lower --batch/--threads/--block-sizes or raise --max-mem",
                format_total(mem),
                if self.scatter || self.kv_shape { " x 4 for scatter" } else { "" },
                format_total(self.max_mem)
            );
        }
        if self.direct {
            if self.local_mem != MemKind::File && self.remote_mem != MemKind::File {
                bail!("--direct opens FILE memory with O_DIRECT: add --local-mem file or --remote-mem file");
            }
            let misaligned = self.cases().into_iter().map(|case| case.block).find(|b| !b.is_multiple_of(DIRECT_ALIGN));
            if let Some(block) = misaligned {
                bail!("--direct needs block sizes that are multiples of {DIRECT_ALIGN}, not {block}");
            }
            if !mem.is_multiple_of(DIRECT_ALIGN) {
                bail!("--direct needs a registered size that is a multiple of {DIRECT_ALIGN}, not --mem {mem}");
            }
        }
        Ok(mem)
    }

    pub fn settings(&self, progress_allowed: bool) -> Result<Settings> {
        if let Err(err) = BackendParams::parse(&self.params) {
            bail!("--params: {err}");
        }
        let xfer_backend = self.xfer_backend();
        if self.compare && xfer_backend.is_none() {
            bail!("--compare compares an xfer backend with {RAW_TCP}; pick --backend tcp (or another xfer backend)");
        }
        if self.alloc == Alloc::Backend && (xfer_backend.is_none() || self.compare) {
            bail!("--alloc backend needs an xfer backend and no {RAW_TCP} (--compare)");
        }
        let both_dram = self.local_mem == MemKind::Dram && self.remote_mem == MemKind::Dram;
        if !both_dram && (xfer_backend.is_none() || self.alloc == Alloc::Backend) {
            bail!("--local-mem/--remote-mem vram|file need an xfer backend and --alloc host ({RAW_TCP} and --alloc backend move DRAM)");
        }
        if self.grants && (xfer_backend.is_none() || self.scheme != Scheme::Pairwise) {
            bail!("--grants needs an xfer backend and the pairwise scheme (one agent, one target)");
        }
        if self.window > 1 && (xfer_backend.is_none() || self.compare) {
            bail!(
                "--window needs an xfer backend and no {RAW_TCP} (--compare): the baseline keeps one request in flight"
            );
        }
        let (agents, targets) = self.scheme.shape(self.peers);
        if self.scheme != Scheme::Pairwise {
            if xfer_backend.is_none() || self.compare || self.check {
                bail!("--scheme {:?} runs an xfer backend alone: no raw-tcp, --compare or --check", self.scheme);
            }
            if !self.connect.is_empty() && self.connect.len() as u64 != targets {
                bail!("--connect names {} targets but this scheme needs {targets}", self.connect.len());
            }
        } else if self.connect.len() > 1 {
            bail!("several --connect targets need --scheme one-to-many");
        }
        Ok(Settings {
            xfer_backend,
            params: self.params.clone(),
            cases: self.cases(),
            threads: self.effective_threads(),
            window: self.window,
            iters: self.iters,
            repeat: self.repeat,
            warmup: self.warmup,
            check: self.check,
            compare: self.compare,
            kv_shape: self.kv_shape,
            grants: self.grants,
            seed: self.seed,
            memory: RunMemory {
                bytes: self.memory()?,
                local: self.local_mem,
                remote: self.remote_mem,
                options: self.mem_options(),
            },
            progress: progress_allowed && !self.no_progress,
            agents,
            targets,
        })
    }
}

impl Settings {
    /// Arguments that start a target process serving this run.
    pub fn target_args(&self) -> Vec<String> {
        let backend = self.xfer_backend.clone().unwrap_or_else(|| RAW_TCP.to_string());
        let mut args =
            vec!["--target".into(), "--backend".into(), backend, "--mem".into(), self.memory.bytes.to_string()];
        args.extend(["--max-mem".into(), self.memory.bytes.max(1).to_string()]);
        if !self.params.is_empty() {
            args.extend(["--params".into(), self.params.clone()]);
        }
        if self.memory.options.alloc == Alloc::Backend {
            args.extend(["--alloc".into(), "backend".into()]);
        }
        match self.memory.remote {
            MemKind::Dram => {}
            MemKind::Vram => args.extend(["--device".into(), self.memory.options.device.to_string()]),
            MemKind::File => {
                args.extend(["--file-dir".into(), self.memory.options.file_dir.display().to_string()]);
                if self.memory.options.direct {
                    args.push("--direct".into());
                }
            }
        }
        if self.memory.remote != MemKind::Dram {
            args.extend(["--remote-mem".into(), self.memory.remote.flag()]);
        }
        args
    }

    /// The scheme as rows record it; empty when pairwise.
    pub fn scheme_label(&self) -> String {
        match (self.agents, self.targets) {
            (1, 1) => String::new(),
            (agents, 1) => format!("many-to-one:{agents}"),
            (_, targets) => format!("one-to-many:{targets}"),
        }
    }

    /// Measured requests per thread for a case.
    pub fn iters_for(&self, case: &Case) -> u64 {
        self.iters.unwrap_or_else(|| crate::units::default_iters(case.request_bytes(), self.threads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Args {
        Args::try_parse_from(std::iter::once("xferbench").chain(line.split_whitespace())).unwrap()
    }

    #[test]
    fn defaults_and_lists() {
        let a = args("--block-sizes 64K,1M,16M --op both");
        assert_eq!(a.block_sizes, vec![64 << 10, 1 << 20, 16 << 20]);
        let cases = a.cases();
        assert_eq!(cases.len(), 6);
        assert_eq!((cases[0].op, cases[3].op), (Op::Read, Op::Write));
        assert_eq!(a.xfer_backend().as_deref(), Some("tcp"));
        assert_eq!(a.memory().unwrap(), 16 << 20);
    }

    #[test]
    fn bad_block_sizes_are_clear_errors() {
        let err = Args::try_parse_from(["xferbench", "--block-sizes", "1K"]).unwrap_err().to_string();
        assert!(err.contains("outside 4K..64M"), "{err}");
        assert!(Args::try_parse_from(["xferbench", "--op", "sideways"]).is_err());
    }

    #[test]
    fn kv_shape_runs_the_pair_per_op() {
        let a = args("--kv-shape --op both");
        let cases = a.cases();
        assert_eq!(cases.len(), 4);
        assert_eq!(cases[0].request_bytes(), cases[1].request_bytes());
        assert!(cases[0].scatter && !cases[1].scatter);
        assert_eq!(a.memory().unwrap(), 128 << 20);
    }

    #[test]
    fn memory_is_capped() {
        let err = args("--block-sizes 64M --batch 8 --threads 4").memory().unwrap_err().to_string();
        assert!(err.contains("2.00 GiB") && err.contains("--max-mem"), "{err}");
        assert!(args("--block-sizes 64M --batch 8 --threads 4 --max-mem 2G").memory().is_ok());
    }

    #[test]
    fn settings_check_compare_and_params() {
        assert!(args("--backend raw-tcp --compare").settings(false).is_err());
        assert!(args("--params streams").settings(false).is_err());
        let s = args("--compare --params streams=4 --block-sizes 1M").settings(true).unwrap();
        assert!(s.progress && s.compare);
        assert_eq!((s.agents, s.targets), (1, 1));
        assert_eq!(s.iters_for(&s.cases[0]), 1024);
        assert_eq!(
            s.target_args().join(" "),
            "--target --backend tcp --mem 1048576 --max-mem 1048576 --params streams=4"
        );
        assert!(!args("--no-progress").settings(true).unwrap().progress);
        let s = args("--backend ucx --alloc backend --block-sizes 1M").settings(false).unwrap();
        assert_eq!(s.memory.options.alloc, Alloc::Backend);
        assert_eq!(s.target_args().join(" "), "--target --backend ucx --mem 1048576 --max-mem 1048576 --alloc backend");
        assert_eq!(args("").alloc, Alloc::Host);
        assert!(args("--backend raw-tcp --alloc backend").settings(false).is_err());
        assert!(args("--compare --alloc backend").settings(false).is_err());
    }

    #[test]
    fn memory_kinds_reach_the_target_and_the_labels() {
        let s = args("--local-mem file --remote-mem vram --device 3 --block-sizes 1M").settings(false).unwrap();
        assert_eq!(
            s.target_args().join(" "),
            "--target --backend tcp --mem 1048576 --max-mem 1048576 --device 3 --remote-mem vram"
        );
        assert_eq!((s.memory.label(Op::Write), s.memory.label(Op::Read)), ("FILE→VRAM".into(), "VRAM→FILE".into()));
        let s = args("--remote-mem file --file-dir /mnt/nvme --direct --block-sizes 64K").settings(false).unwrap();
        assert!(s.target_args().join(" ").ends_with("--file-dir /mnt/nvme --direct --remote-mem file"));
        assert_eq!(s.memory.label(Op::Read), "FILE→DRAM");
        assert_eq!(
            args("").settings(false).unwrap().memory.label(Op::Write),
            "",
            "DRAM→DRAM is the unlabelled default"
        );
        assert!(args("--backend raw-tcp --local-mem file").settings(false).is_err());
        assert!(args("--local-mem vram --alloc backend").settings(false).is_err());
    }

    #[test]
    fn direct_needs_a_file_and_aligned_sizes() {
        let err = args("--direct").memory().unwrap_err().to_string();
        assert!(err.contains("--local-mem file"), "{err}");
        let err = args("--direct --local-mem file --block-sizes 64K,10000").memory().unwrap_err().to_string();
        assert!(err.contains("multiples of 4096, not 10000"), "{err}");
        let err = args("--direct --remote-mem file --mem 5000").memory().unwrap_err().to_string();
        assert!(err.contains("not --mem 5000"), "{err}");
        assert_eq!(args("--direct --remote-mem file --block-sizes 64K,1M").memory().unwrap(), 1 << 20);
    }

    #[test]
    fn a_window_needs_an_xfer_backend_alone() {
        assert_eq!(args("--window 16").settings(false).unwrap().window, 16);
        assert_eq!(args("").settings(false).unwrap().window, 1);
        for line in ["--window 4 --compare", "--window 4 --backend raw-tcp"] {
            let err = args(line).settings(false).unwrap_err().to_string();
            assert!(err.contains("--window needs an xfer backend"), "{line}: {err}");
        }
        assert!(Args::try_parse_from(["xferbench", "--window", "0"]).is_err());
    }

    #[test]
    fn schemes_shape_agents_targets_and_threads() {
        let s = args("--scheme one-to-many --peers 3").settings(false).unwrap();
        assert_eq!((s.agents, s.targets, s.threads), (1, 3, 3));
        assert_eq!(s.scheme_label(), "one-to-many:3");
        let s = args("--scheme many-to-one --peers 2 --threads 4").settings(false).unwrap();
        assert_eq!((s.agents, s.targets, s.threads), (2, 1, 4));
        assert!(args("--scheme many-to-one --check").settings(false).is_err());
        assert!(args("--scheme one-to-many --peers 3 --connect a:1,b:1").settings(false).is_err());
        assert!(args("--connect a:1,b:1").settings(false).is_err());
    }
}
