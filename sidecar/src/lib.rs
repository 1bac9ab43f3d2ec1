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
//! prefill-leg executor both modes share), [`prefill`] and [`decode`] (the legs), [`proxy`] and
//! [`sglang`] (the two flows), [`pull`], [`release`], [`coordinator`], [`metrics`], [`errors`]
//! (where errors become HTTP), [`context`] (the request context), [`engines`] (the engine
//! handles), [`server`] (HTTP surface and accept loop).

#![forbid(unsafe_code)]

pub mod allowlist;
pub mod config;
pub mod context;
pub mod coordinator;
pub mod decode;
pub mod engine_kind;
pub mod engines;
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
pub mod target;
pub mod upstream;
pub mod xfer_link;

use std::future::Future;
use std::sync::Arc;

use anyhow::Context as _;

use crate::config::{Config, Mode, ReleaseMethod};
use crate::context::Context;
use crate::engine_kind::EngineKind;
use crate::engines::{DeadSet, EnginePool, Prefills};
use crate::ids::Ids;
use crate::legs::Legs;
use crate::metrics::Metrics;
use crate::release::Releaser;

/// A running sidecar's address and metrics (tests read them).
#[derive(Debug)]
pub struct Running {
    pub addr: std::net::SocketAddr,
    pub metrics: Arc<Metrics>,
}

/// The request context and the handles beside it. The flows ([`proxy`], [`sglang`]) take the
/// whole app; every part below them gets only the handles it uses.
#[derive(Debug)]
pub struct App {
    pub ctx: Arc<Context>,
    /// The local engine's ranks.
    pub engines: Arc<EnginePool>,
    /// The static prefill list, the allowlist and the engines known dead (routing).
    pub prefills: Arc<Prefills>,
    /// The prefill-leg executor.
    pub legs: Arc<Legs>,
    /// Whether the local engine computes prompts (a decode-mode SGLang does not).
    pub engine_kind: Arc<EngineKind>,
    /// Request ids and bootstrap rooms.
    pub ids: Arc<Ids>,
    /// Frees blocks a prefill holds for a decode that will not come.
    pub releaser: Arc<Releaser>,
    /// The coordinator link (`--coordinator`).
    pub coordinator: Option<Arc<coordinator::Coordinator>>,
    /// The sidecar's own KV reads (`--mode sim-pull`).
    pub puller: Option<Arc<pull::Puller>>,
    /// Permits for requests with large bodies to run off the runtime (`--offload-body-bytes`).
    pub offloads: Arc<tokio::sync::Semaphore>,
}

/// Builds the request context and the handles from a configuration.
pub fn build(cfg: Config) -> anyhow::Result<App> {
    let resolved = cfg.resolve()?;
    let tls = pd_http::tls::client_config(cfg.upstream_ca.as_deref()).context("upstream TLS")?;
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
    let pull_mode = cfg.mode == Mode::SimPull;
    let ctx = Arc::new(Context::new(cfg, client));
    let engines = Arc::new(EnginePool::new(resolved.engines));
    let dead = Arc::new(DeadSet::default());
    let ids = Arc::new(Ids::default());
    let engine_kind = Arc::new(EngineKind::default());
    let releaser = Arc::new(Releaser::new(&ctx, &engines, xfer.clone()));
    let puller = xfer
        .filter(|_| pull_mode)
        .map(|link| Arc::new(pull::Puller::new(link, engines.primary().clone(), Arc::clone(&releaser))));
    Ok(App {
        legs: Arc::new(Legs::new(&ctx, &dead, &ids, &engine_kind)),
        engine_kind,
        prefills: Arc::new(Prefills::new(resolved.prefills, resolved.allowlist, dead)),
        ctx,
        engines,
        ids,
        releaser,
        coordinator,
        puller,
        offloads: Arc::new(tokio::sync::Semaphore::new(server::OFFLOADS_AT_ONCE)),
    })
}

/// Binds the listener and serves until `shutdown` resolves; `on_bound` learns the address
/// (tests bind port 0).
pub async fn run(
    cfg: Config,
    shutdown: impl Future<Output = ()>,
    on_bound: impl FnOnce(&Running),
) -> anyhow::Result<()> {
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(c), Some(k)) => Some(pd_http::tls::server_config(c, k).context("listener TLS")?),
        _ => None,
    };
    let listener =
        tokio::net::TcpListener::bind(&cfg.listen).await.with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let drain = cfg.drain_timeout;
    let app = Arc::new(build(cfg)?);
    tracing::info!(
        %addr,
        mode = ?app.ctx.cfg.mode,
        engines = app.engines.len(),
        prefills = app.prefills.len(),
        coordinator = app.ctx.cfg.coordinator.as_deref().unwrap_or("-"),
        tls = tls.is_some(),
        "pd-sidecar listening"
    );
    on_bound(&Running { addr, metrics: Arc::clone(&app.ctx.metrics) });
    let link = app.coordinator.clone().map(|c| {
        let dead = Arc::clone(&app.prefills.dead);
        tokio::spawn(coordinator::run(
            c,
            Arc::clone(&app.ctx),
            Arc::clone(&app.engines),
            dead,
            Arc::clone(&app.releaser),
        ))
    });
    let (coordinator, ctx) = (app.coordinator.clone(), Arc::clone(&app.ctx));
    let timer_floor = tokio::spawn(keep_timer_armed());
    pd_http::serve(listener, server::router(app), tls, shutdown, drain).await;
    timer_floor.abort();
    if let Some(c) = coordinator {
        coordinator::leave(&c, &ctx.client).await;
    }
    if let Some(link) = link {
        link.abort();
    }
    Ok(())
}

/// tokio's timer driver wakes itself — an eventfd write, then one more `epoll_wait` — whenever a
/// timer is armed earlier than every timer pending when the runtime last went to sleep, which
/// with few requests in flight is most requests (their leg timeouts, the keep-alive's header
/// timeout). A timer that is always due within a second stays the earliest, so the timeouts of
/// requests (seconds or more) arm without that; it costs one wake-up a second.
async fn keep_timer_armed() {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}
