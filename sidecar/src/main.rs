//! The sidecar: a decode-first P/D proxy next to one engine.

use pd_sidecar::config::Config;

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,hyper=warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cfg = match Config::from_args(std::env::args().collect()) {
        Ok(c) => c,
        Err(pd_sidecar::config::ConfigError::Args(e)) => e.exit(),
        Err(e) => {
            eprintln!("pd-sidecar: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    // One worker runs on the calling thread: no handing tasks between threads, and no waking
    // an idle worker to steal each task a response wakes (see `--workers`).
    let workers = cfg.workers.unwrap_or(1);
    let mut rt = if workers <= 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut rt = tokio::runtime::Builder::new_multi_thread();
        rt.worker_threads(workers);
        rt
    };
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("pd-sidecar: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        // Installed before the listener is bound (see `shutdown_signal`).
        let signal = pd_config_file::signals::shutdown_signal();
        let shutdown = async move {
            signal.await;
            tracing::info!("shutting down: draining requests in flight");
        };
        pd_sidecar::run(cfg, shutdown, |r| {
            // One line on stdout for launchers and tests that bind port 0.
            println!("pd-sidecar listening on {}", r.addr);
        })
        .await
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pd-sidecar: {}", pd_config_file::report::error_line(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}
