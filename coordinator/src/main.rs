//! `pd-coordinator`: membership, KV-aware pairing and failure cleanup for prefill/decode
//! disaggregated serving. See README.md and API.md.

use pd_coordinator::config::{Config, ConfigError};

fn main() -> std::process::ExitCode {
    let config = match Config::from_args(std::env::args().collect()) {
        Ok(config) => config,
        Err(ConfigError::Args(err)) => err.exit(),
        Err(err) => {
            eprintln!("pd-coordinator: {err}");
            return std::process::ExitCode::from(2);
        }
    };
    // An explicit --log wins over the environment's RUST_LOG (launchers pass flags per child).
    let filter = match &config.log {
        Some(directives) => tracing_subscriber::EnvFilter::new(directives),
        None => tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
    };
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(workers) = config.workers {
        runtime.worker_threads(workers.max(1));
    }
    let result =
        runtime.build().map_err(anyhow::Error::from).and_then(|rt| rt.block_on(pd_coordinator::daemon::run(config)));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            let line = pd_config_file::report::error_line(err.as_ref());
            tracing::error!("{line}");
            eprintln!("pd-coordinator: {line}");
            std::process::ExitCode::FAILURE
        }
    }
}
