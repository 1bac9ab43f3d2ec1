//! The daemons' shutdown signals (feature `signals`).

use std::future::Future;

use tokio::signal::unix::{signal, Signal, SignalKind};

/// Resolves on SIGINT or SIGTERM. Call it inside the runtime before the daemon binds its
/// listeners: the handlers are installed by the call, not when the future is first polled, so
/// a SIGTERM right after start-up drains like any other instead of killing the process.
///
/// Handlers that libraries installed when they were loaded are dropped first: tokio chains to
/// whatever handler was there, and Debian's libfabric pulls in libinfinipath, whose handler for
/// SIGINT and SIGTERM exits the process (status 1) before anything drains.
pub fn shutdown_signal() -> impl Future<Output = ()> {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: resets the disposition of a signal this daemon owns to the default, before
        // any handler of ours is installed; no Rust state depends on the previous handler.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
    }
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
