//! `pd-sim`: one simulated engine per process.

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::serve::ListenerExt;
use pd_protocols::kv_events::EventFormat;
use pd_sim::config::{Config, EventLayout, Role};
use pd_sim::engine::Engine;
use pd_sim::events::{self, EventsConfig};

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cfg = match Config::from_args(std::env::args().collect()) {
        Ok(cfg) => cfg,
        Err(pd_sim::config::ConfigError::Args(e)) => e.exit(),
        Err(e) => return Err(e.into()),
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = cfg.workers {
        runtime.worker_threads(n.max(1));
    }
    runtime.enable_all().build().context("starting the async runtime")?.block_on(serve(cfg))
}

/// How long open requests may run on after SIGINT or SIGTERM before the process exits anyway.
const DRAIN_BOUND: Duration = Duration::from_secs(5);

async fn serve(cfg: Config) -> anyhow::Result<()> {
    // Installed before anything binds, so that a signal at any time drains and is logged.
    let shutdown = pd_config_file::signals::shutdown_signal();
    let events = match &cfg.kv_events_endpoint {
        Some(endpoint) => Some(
            events::start(EventsConfig {
                endpoint: endpoint.clone(),
                replay_endpoint: cfg.kv_events_replay_endpoint.clone(),
                topic: cfg.kv_events_topic.clone(),
                format: match cfg.kv_events_layout {
                    EventLayout::Map => EventFormat::TaggedMap,
                    EventLayout::Array => EventFormat::LegacyArray,
                },
                bytes_hashes: cfg.kv_events_bytes_hashes,
                buffer_steps: cfg.kv_events_buffer_steps,
                dp_rank: cfg.data_parallel_rank,
            })
            .context("starting the KV-event publisher")?
            .0,
        ),
        None => None,
    };
    let engine = Engine::new(cfg.clone(), events).context("starting the engine")?;
    engine.spawn_notification_thread();
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
    if cfg.role == Role::Prefill {
        let baddr = format!("{}:{}", cfg.host, cfg.bootstrap_port);
        let blistener = tokio::net::TcpListener::bind(&baddr).await.with_context(|| format!("binding {baddr}"))?;
        let router = pd_sim::sglang::bootstrap_router(Arc::clone(&engine));
        tokio::spawn(async move { axum::serve(blistener, router).await });
    }
    tracing::info!(
        http = %listener.local_addr()?,
        engine_id = %engine.engine_id,
        xfer_side_channel = %format!("{}:{}", cfg.host_ip, engine.xfer_port),
        role = ?cfg.role,
        "pd-sim ready"
    );
    let app = pd_sim::http::router(engine);
    // Streamed tokens are small writes: without TCP_NODELAY, Nagle holds each one back for the
    // client's delayed ACK (~40 ms on reused connections), which would dominate every TTFT.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let (draining, drain_started) = tokio::sync::oneshot::channel();
    let served = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!(bound_s = DRAIN_BOUND.as_secs(), "shutdown signal received: draining open requests");
        let _ = draining.send(());
    });
    let drain_bound = async move {
        match drain_started.await {
            Ok(()) => tokio::time::sleep(DRAIN_BOUND).await,
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        served = served.into_future() => served.context("serving HTTP"),
        () = drain_bound => {
            tracing::warn!(bound_s = DRAIN_BOUND.as_secs(), "requests still open at the drain bound: exiting");
            Ok(())
        }
    }
}
