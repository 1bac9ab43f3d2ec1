//! `pd-chaos run`: scenarios 1–6 of issue 24 on a cluster in network namespaces, with a summary
//! table; exits non-zero when a bar is missed or the harness cannot run (no root, no netns).
//! `pd-chaos soak --minutes 10`: scenario 7. `pd-chaos cleanup`: removes what killed runs left.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use nix::sys::signal::{SigSet, Signal};
use pdchaos::cluster::{Binaries, Timing};
use pdchaos::load::LoadShape;
use pdchaos::netns;
use pdchaos::scenarios::{self, with_cluster, Setup};
use pdchaos::summary::{self, Row};

#[derive(Parser, Debug)]
#[command(version, about = "A P/D cluster in network namespaces under kill, partition, restart and lossy links")]
struct Cli {
    /// Where the daemons' logs go (one folder per scenario).
    #[arg(long, global = true, default_value = "target/pd-chaos")]
    log_dir: PathBuf,
    /// Folder of pd-sim, pd-sidecar and pd-coordinator (default: beside this binary).
    #[arg(long, global = true)]
    bin_dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Scenarios 1–6 (about a minute and a half), then the summary table.
    Run {
        /// Only these scenarios (e.g. `--only 1,3`).
        #[arg(long, value_delimiter = ',')]
        only: Vec<u8>,
        /// Fail scenario 6 instead of skipping it when neither netem nor the nftables + tbf
        /// fallback can degrade a link.
        #[arg(long)]
        require_netem: bool,
    },
    /// Scenario 7: a long run at moderate load.
    Soak {
        #[arg(long, default_value_t = 10)]
        minutes: u64,
    },
    /// Remove the namespaces (and processes) of harness runs that were killed.
    Cleanup,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).init();
    let cli = Cli::parse();
    // /proc/self belongs to the effective user.
    let euid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap_or_else(|e| {
        eprintln!("pd-chaos: reading /proc/self: {e}");
        std::process::exit(1)
    }));
    if euid != 0 {
        eprintln!("pd-chaos: FAILED, not run: it needs root (network namespaces, veth links, tc)");
        return ExitCode::FAILURE;
    }
    // Ctrl-C or a SIGTERM (a CI timeout) would end the process without destructors, leaving the
    // daemons (in their own process groups) and the namespaces behind: one thread takes these
    // signals, tears down and exits. Blocked here, before any other thread exists; children get
    // a cleared mask from std's spawn.
    let signals = SigSet::from_iter([Signal::SIGINT, Signal::SIGTERM]);
    if let Err(e) = signals.thread_block() {
        eprintln!("pd-chaos: blocking SIGINT/SIGTERM: {e}");
        return ExitCode::FAILURE;
    }
    std::thread::spawn(move || {
        if let Ok(sig) = signals.wait() {
            eprintln!("pd-chaos: {sig:?}: stopping the daemons and removing the namespaces");
            netns::remove_own();
            std::process::exit(130);
        }
    });
    match netns::remove_stale() {
        Ok(stale) if !stale.is_empty() => eprintln!("removed namespaces of killed runs: {stale:?}"),
        Ok(_) => {}
        Err(e) => {
            eprintln!("pd-chaos: FAILED, not run: {e}");
            return ExitCode::FAILURE;
        }
    }
    let bins = match &cli.bin_dir {
        Some(d) => {
            Binaries { sim: d.join("pd-sim"), sidecar: d.join("pd-sidecar"), coordinator: d.join("pd-coordinator") }
        }
        None => Binaries::beside_me(),
    };
    let setup = Setup { bins, log_dir: cli.log_dir.clone(), timing: Timing::default(), shape: LoadShape::default() };
    let (rows, allow_skips) = match cli.command {
        Cmd::Cleanup => return ExitCode::SUCCESS,
        Cmd::Run { only, require_netem } => (run(&setup, &only), !require_netem),
        Cmd::Soak { minutes } => {
            // Moderate: two clients, a pause of 100 ms between requests.
            let shape = LoadShape { workers: 2, pause: Duration::from_millis(100), ..setup.shape };
            let length = Duration::from_secs(minutes * 60);
            (vec![with_cluster(&setup, "7 soak", |c| scenarios::soak(c, shape, length))], false)
        }
    };
    println!("{}", summary::render(&rows));
    if summary::all_passed(&rows, allow_skips) {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn run(setup: &Setup, only: &[u8]) -> Vec<Row> {
    let wanted = |n: u8| only.is_empty() || only.contains(&n);
    let shape = setup.shape;
    let mut rows = Vec::new();
    let mut step = |n: u8, name: &str, row: &dyn Fn() -> Row| {
        if wanted(n) {
            let started = std::time::Instant::now();
            eprintln!("== scenario {name}");
            let r = row();
            eprintln!("== scenario {name}: {:?} in {:.1} s", r.verdict, started.elapsed().as_secs_f64());
            rows.push(r);
        }
    };
    step(1, "1 kill -9 prefill", &|| with_cluster(setup, "1 kill -9 prefill", |c| scenarios::kill_prefill(c, shape)));
    step(2, "2 kill -9 decode", &|| with_cluster(setup, "2 kill -9 decode", |c| scenarios::kill_decode(c, shape)));
    step(3, "3 cut a node", &|| with_cluster(setup, "3 cut a node", |c| scenarios::partition(c, shape)));
    step(4, "4 restart coordinator", &|| {
        with_cluster(setup, "4 restart coordinator", |c| scenarios::restart_coordinator(c, shape))
    });
    step(5, "5 disconnect storm", &|| {
        with_cluster(setup, "5 disconnect storm", |c| scenarios::disconnect_storm(c, shape))
    });
    step(6, "6 lossy link", &|| with_cluster(setup, "6 lossy link", |c| scenarios::lossy_link(c, shape)));
    rows
}
