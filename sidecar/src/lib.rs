//! `pd-sidecar`: a decode-first prefill/decode proxy next to one engine (see `README.md`).
//!
//! A client's completion request becomes a disaggregated execution: the sidecar picks a
//! prefill engine (upstream router's header checked against an allowlist, the coordinator's
//! pairing, or a static list), runs the prefill leg, hands the prefill's `kv_transfer_params`
//! verbatim to the local engine's decode leg and streams the answer back; SGLang's bootstrap
//! protocol and a sidecar-pull mode (the sidecar moves the KV blocks itself with `xfer`) are
//! the other two modes. Every wait is bounded, and blocks a prefill holds for a decode that
//! will not come are released at once.
//!
//! Layout: [`config`] (flags, env, TOML), [`allowlist`] and [`target`] (who may be called),
//! [`json`] and [`rewrite`] (pure body rewriting), [`handoff`] (the pure core: where a request
//! is served, the failover policy), [`routing`] (gathers the core's inputs), [`legs`] (the
//! prefill-leg executor both modes share), [`prefill`] and [`decode`] (the legs), [`sglang`],
//! [`pull`], [`release`], [`coordinator`], [`metrics`], [`errors`] (where errors become HTTP),
//! [`server`] (HTTP surface and accept loop).

#![forbid(unsafe_code)]

pub mod allowlist;
pub mod config;
pub mod coordinator;
pub mod decode;
pub mod errors;
pub mod finish;
pub mod handoff;
pub mod ids;
pub mod json;
pub mod legs;
pub mod load;
pub mod metrics;
pub mod prefill;
pub mod proxy;
pub mod pull;
pub mod redirect;
pub mod release;
pub mod rewrite;
pub mod routing;
pub mod server;
pub mod sglang;
pub mod state;
pub mod target;
pub mod tls;
pub mod upstream;
pub mod xfer_link;

use std::future::Future;
use std::sync::Arc;

use anyhow::Context;

use crate::config::{Config, Mode, ReleaseMethod};
use crate::state::State;

/// A running sidecar's address and shared state (tests read its metrics).
#[derive(Debug)]
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub state: Arc<State>,
}

/// The request context and the handles beside it, each passed only to the parts that use it.
#[derive(Debug, Clone)]
pub struct App {
    pub state: Arc<State>,
    /// The coordinator link (`--coordinator`).
    pub coordinator: Option<Arc<coordinator::Coordinator>>,
    /// The sidecar's own KV reads (`--mode sim-pull`).
    pub puller: Option<Arc<pull::Puller>>,
}

/// Builds the request context and the handles from a configuration.
pub fn build(cfg: Config) -> anyhow::Result<App> {
    let resolved = cfg.resolve()?;
    let tls = tls::client_config(cfg.upstream_ca.as_deref()).context("upstream TLS")?;
    let client = upstream::client(cfg.connect_timeout, tls);
    let wants_xfer = cfg.mode == Mode::SimPull || cfg.release_method == ReleaseMethod::SimXfer;
    let xfer = if wants_xfer {
        Some(xfer_link::XferLink::new(&cfg.xfer_listen).context("starting the xfer agent")?)
    } else {
        None
    };
    let coordinator = match &cfg.coordinator {
        Some(_) => Some(Arc::new(coordinator::Coordinator::new(&cfg, &resolved.engines[0])?)),
        None => None,
    };
    let puller = (cfg.mode == Mode::SimPull).then(|| Arc::new(pull::Puller::default()));
    Ok(App { state: Arc::new(State::new(cfg, resolved, client, xfer)), coordinator, puller })
}

/// Binds the listener and serves until `shutdown` resolves; `on_bound` learns the address
/// (tests bind port 0).
pub async fn run(
    cfg: Config,
    shutdown: impl Future<Output = ()>,
    on_bound: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(c), Some(k)) => Some(tls::server_config(c, k).context("listener TLS")?),
        _ => None,
    };
    let listener =
        tokio::net::TcpListener::bind(&cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let drain = cfg.drain_timeout;
    let app = build(cfg)?;
    let state = Arc::clone(&app.state);
    tracing::info!(
        %addr,
        mode = ?state.cfg.mode,
        engines = state.engines.len(),
        prefills = state.prefills.len(),
        coordinator = state.cfg.coordinator.as_deref().unwrap_or("-"),
        tls = tls.is_some(),
        "pd-sidecar listening"
    );
    on_bound(&Running { addr, state: Arc::clone(&state) });
    let link = app.coordinator.clone().map(|c| tokio::spawn(coordinator::run(c, Arc::clone(&state))));
    let coordinator = app.coordinator.clone();
    server::serve(listener, server::router(app), tls, shutdown, drain).await;
    if let Some(c) = coordinator {
        coordinator::leave(&c, &state.client).await;
    }
    if let Some(link) = link {
        link.abort();
    }
    Ok(())
}
