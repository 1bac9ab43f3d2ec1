//! The daemon: the shared [`Coordinator`] state and the tasks that drive it — lease ticks,
//! health polling, KV-event ingestion threads, the etcd watch — plus the HTTP and gRPC servers.

mod events;
mod health;
mod load;
mod ops;
mod release;
pub mod state;
mod store;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::net::TcpListener;

use crate::config::{ClusterFile, Config, StoreUrl};
use crate::membership::EngineSpec;
use crate::prompt::PromptHasher;
use crate::store::etcd::EtcdStore;
use crate::store::Store;

pub use state::{Coordinator, Origin};

/// How long open connections may finish their requests after a shutdown signal.
const DRAIN: Duration = Duration::from_secs(5);

/// Runs the daemon until SIGINT or SIGTERM.
pub async fn run(config: Config) -> anyhow::Result<()> {
    // Installed before any listener is bound (see `shutdown_signal`).
    let shutdown = pd_config_file::signals::shutdown_signal();
    let hasher = PromptHasher::new(
        config.pythonhashseed.as_deref(),
        config.tokenizer.as_deref(),
        config.tokenizer_add_special_tokens,
        config.approx_chars_per_token,
    )?
    .with_scheme(config.block_hash);
    let cluster = config.cluster.as_deref().map(ClusterFile::load).transpose()?.unwrap_or_default();
    let store = match config.store_url()? {
        StoreUrl::Memory => None,
        StoreUrl::Etcd(endpoints) => {
            let etcd = EtcdStore::connect(&endpoints, &config.etcd_prefix, config.lease()).await?;
            Some(Arc::new(etcd) as Arc<dyn Store>)
        }
    };
    let (http_tls, grpc_tls) = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => {
            let http = pd_http::tls::server_config(cert, key).context("--tls-cert/--tls-key")?;
            let read =
                |path: &std::path::Path| std::fs::read(path).with_context(|| format!("cannot read {}", path.display()));
            (Some(http), Some(tonic::transport::Identity::from_pem(read(cert)?, read(key)?)))
        }
        _ => (None, None),
    };
    if config.auth_token.is_none() {
        tracing::warn!("no --auth-token: anyone who reaches the API can register engines and ask for pairings");
    }
    let http_listener =
        TcpListener::bind(config.listen).await.with_context(|| format!("cannot listen on {}", config.listen))?;
    let grpc_listener = match config.no_grpc {
        true => None,
        false => Some(
            TcpListener::bind(config.grpc_listen)
                .await
                .with_context(|| format!("cannot listen on {}", config.grpc_listen))?,
        ),
    };
    config.topic_pattern()?;
    let coordinator = Arc::new(Coordinator::new(config, hasher, store, tokio::runtime::Handle::current())?);
    if let Some(listen) = coordinator.config.kv_events_listen.as_deref() {
        coordinator.listen_ranks(1)?;
        tracing::info!(listen, pattern = %coordinator.config.kv_events_topic_pattern, "collecting KV events");
    }
    {
        let now = Instant::now();
        let mut inner = coordinator.inner.lock();
        for spec in &cluster.engines {
            coordinator.apply_register(&mut inner, EngineSpec::from(spec), Origin::Static, None, now);
        }
    }
    tracing::info!(
        http = %coordinator.config.listen,
        grpc = ?(!coordinator.config.no_grpc).then_some(coordinator.config.grpc_listen),
        store = %coordinator.config.store,
        static_engines = cluster.engines.len(),
        tokenizer = coordinator.hasher.has_tokenizer(),
        "pd-coordinator running"
    );

    let mut tasks = Vec::new();
    {
        let this = Arc::clone(&coordinator);
        tasks.push(tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(this.config.tick_ms));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                this.tick(Instant::now());
            }
        }));
    }
    if coordinator.config.health_interval_ms > 0 {
        tasks.push(tokio::spawn(Arc::clone(&coordinator).health_loop()));
    }
    tasks.extend(coordinator.follow_store());

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let http = {
        let router = crate::api::http::router(Arc::clone(&coordinator));
        let stop = stopped(stop_rx.clone());
        tokio::spawn(pd_http::serve(http_listener, router, http_tls, stop, DRAIN))
    };
    let grpc = match grpc_listener {
        None => None,
        Some(listener) => {
            let service = crate::api::grpc::service(Arc::clone(&coordinator));
            let stop = stopped(stop_rx.clone());
            let mut server = tonic::transport::Server::builder();
            if let Some(identity) = grpc_tls {
                server = server
                    .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                    .context("gRPC TLS")?;
            }
            Some(tokio::spawn(async move {
                server
                    .add_service(service)
                    .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), stop)
                    .await
            }))
        }
    };

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    for task in &tasks {
        task.abort();
    }
    coordinator.stop_ingest();
    let drain = async {
        let _ = http.await;
        if let Some(grpc) = grpc {
            if let Ok(Err(err)) = grpc.await {
                tracing::warn!(%err, "gRPC server");
            }
        }
    };
    // In-flight requests get a moment; long-lived connections do not hold the exit.
    let _ = tokio::time::timeout(DRAIN, drain).await;
    Ok(())
}
