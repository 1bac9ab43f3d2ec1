//! `xferbench`: a nixlbench-style transfer benchmark for xfer backends, with a plain-TCP
//! baseline between the same two processes. See the crate's README for usage.

// Unsafe only to register GPU memory (`memory.rs`), which the agent names by address.
#![forbid(unsafe_code)]

mod check;
mod cli;
mod layout;
mod measure;
mod memcpy;
mod memory;
mod pattern;
mod plot;
mod raw;
mod report;
mod run;
mod serve;
mod spawn;
mod target;
mod units;
mod wire;
mod xfer_engine;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = cli::Args::parse();
    let result = if args.target { target::serve(&args) } else { run::main(&args) };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let line = pd_config_file::report::error_line(err.as_ref());
            eprintln!("xferbench{}: error: {line}", if args.target { " target" } else { "" });
            ExitCode::FAILURE
        }
    }
}
