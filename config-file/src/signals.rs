//! The daemons' shutdown signals (feature `signals`).

use std::future::Future;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Resolves on SIGINT or SIGTERM. Call it inside the runtime before the daemon binds its
/// listeners: the handlers are installed by the call, not when the future is first polled, so
/// a SIGTERM right after start-up drains like any other instead of killing the process.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    let wait = |installed: std::io::Result<Signal>| async move {
        match installed {
            Ok(mut signal) => drop(signal.recv().await),
            Err(_) => std::future::pending::<()>().await,
        }
    };
    let (interrupt, terminate) = (wait(signal(SignalKind::interrupt())), wait(signal(SignalKind::terminate())));
    async move {
        tokio::select! {
            () = interrupt => {}
            () = terminate => {}
        }
    }
}
