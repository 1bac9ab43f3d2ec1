//! SGLang-style P/D: the router sends the same body with `bootstrap_host`/`bootstrap_port`/
//! `bootstrap_room` to a prefill and a decode at once. The prefill computes the prompt and
//! publishes the room's blocks on its bootstrap server; the decode polls that server (bounded),
//! pulls the blocks through xfer and notifies the prefill, which then releases them. A prefill
//! whose decode never comes releases after `--bootstrap-timeout-secs`.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

use crate::engine::{Engine, Prompt};
use crate::metrics::add;
use crate::openai::{ApiError, Bootstrap};
use crate::pool::BlockId;
use crate::pull::{self, PullError};
use crate::rooms::{room_done, RoomInfo};
use crate::serve::{verify, Held};

/// The prefill's bootstrap server: where decodes find a room's blocks.
pub fn bootstrap_router(engine: Arc<Engine>) -> Router {
    Router::new()
        .route("/bootstrap/room/{room}", get(room_info))
        .route("/health", get(|| async { StatusCode::OK }))
        .with_state(engine)
}

async fn room_info(State(engine): State<Arc<Engine>>, Path(room): Path<i64>) -> Response {
    match engine.state.lock().rooms.lookup(room) {
        Some((block_ids, num_tokens)) => Json(RoomInfo {
            engine_id: engine.engine_id.clone(),
            xfer_host: engine.cfg.host_ip.clone(),
            xfer_port: engine.xfer_port,
            block_ids,
            num_tokens,
        })
        .into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

/// Prefill: publishes the room's blocks and waits (bounded) until the decode pulled them. The
/// blocks go back to the pool when `held` drops (it owns the room).
pub async fn hold_until_pulled(
    engine: &Arc<Engine>,
    held: &mut Held,
    room: i64,
    num_tokens: usize,
) -> Result<(), ApiError> {
    let blocks = std::mem::take(&mut held.blocks);
    let pulled = engine.state.lock().rooms.hold(room, blocks, num_tokens);
    let timeout = engine.cfg.bootstrap_timeout;
    match tokio::time::timeout(timeout, pulled.notified()).await {
        Ok(()) => Ok(()),
        Err(_) => {
            add(&engine.metrics.rooms_timed_out, 1);
            tracing::warn!(room, "no decode pulled the room's blocks in time; releasing them");
            Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("bootstrap timeout: no decode pulled room {room} within {timeout:?}"),
            ))
        }
    }
}

fn client() -> &'static reqwest::Client {
    static CLIENT: OnceLock<reqwest::Client> = OnceLock::new();
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .connect_timeout(Duration::from_secs(2))
            .build()
            .expect("a plain HTTP client")
    })
}

/// Decode: finds the room on the prefill's bootstrap server (polling until the prefill has
/// computed it, bounded), pulls its blocks and verifies them.
pub async fn pull_room(
    engine: &Arc<Engine>,
    prompt: &Prompt,
    blocks: &[BlockId],
    hit: usize,
    b: &Bootstrap,
) -> Result<(), PullError> {
    let port = b.port.unwrap_or(engine.cfg.bootstrap_port);
    let url = format!("http://{}:{port}/bootstrap/room/{}", b.host, b.room);
    let deadline = Instant::now() + engine.cfg.bootstrap_timeout;
    let info = loop {
        let last = match client().get(&url).send().await {
            Ok(r) if r.status() == StatusCode::OK => match r.json::<RoomInfo>().await {
                Ok(info) => break info,
                Err(e) => e.to_string(),
            },
            Ok(r) => format!("HTTP {}", r.status()),
            Err(e) => e.to_string(),
        };
        if Instant::now() >= deadline {
            return Err(PullError::Metadata { addr: url, reason: format!("room not ready in time ({last})") });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    if info.num_tokens != prompt.tokens.len() || info.block_ids.len() != prompt.num_blocks() {
        return Err(PullError::BlockIds(format!(
            "room {} holds {} tokens in {} blocks, the prompt has {} in {}",
            b.room,
            info.num_tokens,
            info.block_ids.len(),
            prompt.tokens.len(),
            prompt.num_blocks()
        )));
    }
    let peer = pull::peer_pool(engine, &info.engine_id, &format!("{}:{}", info.xfer_host, info.xfer_port)).await?;
    let remote: Vec<u64> = info.block_ids[hit..].iter().map(|&id| u64::from(id)).collect();
    pull::read_blocks(engine, &info.engine_id, &peer, &remote, &blocks[hit..], None, room_done(b.room)).await?;
    verify(engine, prompt, blocks, hit)
}
