//! The decode side of a transfer: resolve the prefill's pool through its xfer side channel
//! (cached per engine id), READ its blocks into ours by block id, with a bounded wait.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::{MemType, Op, PreparedRemote, RequestOptions, XferError};

use crate::engine::Engine;
use crate::metrics::add;
use crate::pool::BlockId;

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("fetching metadata from {addr}: {reason}")]
    Metadata { addr: String, reason: String },
    #[error("the agent at {addr} is {got}, not {expected}")]
    WrongPeer { addr: String, expected: String, got: String },
    #[error("peer {0} publishes no pool with our block size")]
    NoPool(String),
    #[error("remote block ids: {0}")]
    BlockIds(String),
    #[error("transfer: {0}")]
    Xfer(#[from] XferError),
    #[error("transfer timed out after {0:?}")]
    Timeout(Duration),
    #[error("block {0} of the prompt does not hold the expected content")]
    Verification(usize),
}

/// The prefill's pool as prepared descriptors, fetched once per engine id.
pub async fn peer_pool(engine: &Arc<Engine>, engine_id: &str, addr: &str) -> Result<Arc<PreparedRemote>, PullError> {
    if let Some(p) = engine.peers.lock().get(engine_id) {
        return Ok(Arc::clone(p));
    }
    let timeout = engine.cfg.pull_timeout;
    let agent = engine.agent.clone();
    let target = addr.to_string();
    let fetched =
        tokio::time::timeout(timeout, tokio::task::spawn_blocking(move || agent.fetch_remote_metadata(&target)))
            .await
            .map_err(|_| PullError::Metadata { addr: addr.into(), reason: format!("timed out after {timeout:?}") })?
            .map_err(|e| PullError::Metadata { addr: addr.into(), reason: e.to_string() })?;
    let name = fetched.map_err(|e| PullError::Metadata { addr: addr.into(), reason: e.to_string() })?;
    if name != engine_id {
        return Err(PullError::WrongPeer { addr: addr.into(), expected: engine_id.into(), got: name });
    }
    let block_bytes = engine.memory.block_bytes() as u64;
    let regions = engine.agent.remote_regions(&name)?;
    let (_, region) = regions
        .iter()
        .find(|(t, d)| *t == MemType::Dram && d.len % block_bytes == 0)
        .ok_or_else(|| PullError::NoPool(name.clone()))?;
    let descs: Vec<xfer::Desc> =
        (0..region.len / block_bytes).map(|i| xfer::Desc::new(region.addr + i * block_bytes, block_bytes, 0)).collect();
    let prepared = Arc::new(engine.agent.prep_remote(&name, MemType::Dram, &descs)?);
    engine.peers.lock().insert(name, Arc::clone(&prepared));
    Ok(prepared)
}

/// READs `remote_ids` of the peer into `local_ids`; the peer gets `notif` once the data left.
pub async fn read_blocks(
    engine: &Arc<Engine>,
    engine_id: &str,
    remote: &PreparedRemote,
    remote_ids: &[u64],
    local_ids: &[BlockId],
    notif: String,
) -> Result<(), PullError> {
    if remote_ids.len() != local_ids.len() {
        return Err(PullError::BlockIds(format!(
            "{} remote blocks for {} local ones",
            remote_ids.len(),
            local_ids.len()
        )));
    }
    let remote_idx = remote_ids
        .iter()
        .map(|&id| usize::try_from(id).ok().filter(|&i| i < remote.len()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| PullError::BlockIds(format!("an id is outside the peer's {} blocks", remote.len())))?;
    let local_idx: Vec<usize> = local_ids.iter().map(|&id| id as usize).collect();
    let started = Instant::now();
    let result = read(engine, remote, &local_idx, &remote_idx, notif).await;
    match &result {
        Ok(bytes) => {
            engine.metrics.xfer_time.observe(started.elapsed().as_secs_f64());
            add(&engine.metrics.bytes_pulled, *bytes);
            add(&engine.metrics.pulls_ok, 1);
        }
        Err(err) => {
            add(&engine.metrics.failed_pulls, 1);
            // The peer may have restarted: fetch its metadata afresh next time.
            engine.peers.lock().remove(engine_id);
            tracing::warn!(peer = engine_id, %err, "KV pull failed");
        }
    }
    result.map(drop)
}

async fn read(
    engine: &Arc<Engine>,
    remote: &PreparedRemote,
    local_idx: &[usize],
    remote_idx: &[usize],
    notif: String,
) -> Result<u64, PullError> {
    if local_idx.is_empty() {
        // Everything was cached locally; the prefill still learns we are done.
        engine.agent.send_notif(remote.peer(), notif.as_bytes())?;
        return Ok(0);
    }
    let timeout = engine.cfg.pull_timeout;
    let request = engine.agent.make_request(
        Op::Read,
        &engine.local_blocks,
        local_idx,
        remote,
        remote_idx,
        RequestOptions::notify(notif),
    )?;
    request.post()?;
    match tokio::time::timeout(timeout, request.wait_async()).await {
        Ok(result) => result.map(|()| request.bytes()).map_err(PullError::from),
        Err(_) => {
            request.cancel();
            // Let the backend stop writing into our blocks before they go back to the pool.
            let _ = tokio::time::timeout(Duration::from_secs(1), request.wait_async()).await;
            Err(PullError::Timeout(timeout))
        }
    }
}
