//! The decode side of a transfer: resolve the prefill's pool through its xfer side channel
//! (cached per engine id), READ its blocks into ours by block id, with a bounded wait. When the
//! prefill sent a grant token, the READ goes under the grant: a prefill that already revoked it
//! (its lease ended) refuses, and [`PullError::LateRead`] says so; no byte arrives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::{MemType, Op, PreparedRemote, RefusalCode, RequestOptions, XferError};

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
    #[error("the prefill revoked the blocks' grant before the read (it ended the lease): {0}")]
    LateRead(XferError),
    #[error("grant token: {0}")]
    Grant(XferError),
}

impl PullError {
    fn from_transfer(err: XferError) -> PullError {
        match err {
            XferError::Refused { code: RefusalCode::Revoked, .. } => PullError::LateRead(err),
            err => PullError::Xfer(err),
        }
    }
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
    let region = pool_region(engine, &name)?;
    let descs: Vec<xfer::Desc> =
        (0..region.len / block_bytes).map(|i| xfer::Desc::new(region.addr + i * block_bytes, block_bytes, 0)).collect();
    // Through the published region, never a grant: a metadata fetch that finished while another
    // request loaded its grant would otherwise cache that grant's key for those blocks, and
    // every later ungranted read of them (a release decode) would be refused once it is revoked.
    let prepared = Arc::new(engine.agent.prep_remote_published(&name, MemType::Dram, &descs)?);
    engine.peers.lock().insert(name, Arc::clone(&prepared));
    Ok(prepared)
}

/// The region of a loaded peer that holds its pool (blocks of our size).
fn pool_region(engine: &Engine, peer: &str) -> Result<xfer::Desc, PullError> {
    let block_bytes = engine.memory.block_bytes() as u64;
    engine
        .agent
        .remote_regions(peer)?
        .into_iter()
        .find(|(t, d)| *t == MemType::Dram && d.len % block_bytes == 0)
        .map(|(_, region)| region)
        .ok_or_else(|| PullError::NoPool(peer.to_string()))
}

/// Loads the prefill's grant token (hex) and prepares the blocks `remote_idx` under it.
fn under_grant(
    engine: &Engine,
    remote: &PreparedRemote,
    token_hex: &str,
    remote_idx: &[usize],
) -> Result<PreparedRemote, PullError> {
    let token = xfer::grant::from_hex(token_hex).map_err(PullError::Grant)?;
    let block_bytes = engine.memory.block_bytes() as u64;
    let region = pool_region(engine, remote.peer())?;
    let descs: Vec<xfer::Desc> =
        remote_idx.iter().map(|&i| xfer::Desc::new(region.addr + i as u64 * block_bytes, block_bytes, 0)).collect();
    // The load and the preparation together: descriptors prepared now resolve to this grant
    // even if another request loads an older one over the same blocks right after.
    let _loading = engine.grant_loading.lock();
    let granter = engine.agent.load_grant(&token).map_err(PullError::Grant)?;
    if granter != remote.peer() {
        return Err(PullError::Grant(XferError::InvalidArgument(format!(
            "the token is from {granter}, the blocks are {}'s",
            remote.peer()
        ))));
    }
    Ok(engine.agent.prep_remote(remote.peer(), MemType::Dram, &descs)?)
}

/// READs `remote_ids` of the peer into `local_ids`, under the peer's grant when `grant` (its
/// token, hex) is given and grants are on; the peer gets `notif` once the data left.
pub async fn read_blocks(
    engine: &Arc<Engine>,
    engine_id: &str,
    remote: &PreparedRemote,
    remote_ids: &[u64],
    local_ids: &[BlockId],
    grant: Option<&str>,
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
    let grant = grant.filter(|_| !engine.cfg.no_kv_grants && !remote_idx.is_empty());
    let notified = notif.clone();
    let result = match grant {
        Some(token) => match under_grant(engine, remote, token, &remote_idx) {
            Ok(granted) => read(engine, &granted, &local_idx, &(0..granted.len()).collect::<Vec<_>>(), notif).await,
            Err(err) => Err(err),
        },
        None => read(engine, remote, &local_idx, &remote_idx, notif).await,
    };
    match &result {
        Ok(bytes) => {
            engine.metrics.xfer_time.observe(started.elapsed().as_secs_f64());
            add(&engine.metrics.bytes_pulled, *bytes);
            add(&engine.metrics.pulls_ok, 1);
            if grant.is_some() {
                add(&engine.metrics.granted_pulls, 1);
            }
        }
        Err(err @ PullError::LateRead(_)) => {
            add(&engine.metrics.failed_pulls, 1);
            add(&engine.metrics.late_reads_refused, 1);
            tracing::warn!(peer = engine_id, notif = %notified, granted = grant.is_some(), %err, "KV pull refused: read after the prefill's lease ended");
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
    request.post().map_err(PullError::from_transfer)?;
    match tokio::time::timeout(timeout, request.wait_async()).await {
        Ok(result) => result.map(|()| request.bytes()).map_err(PullError::from_transfer),
        Err(_) => {
            request.cancel();
            // Let the backend stop writing into our blocks before they go back to the pool.
            let _ = tokio::time::timeout(Duration::from_secs(1), request.wait_async()).await;
            Err(PullError::Timeout(timeout))
        }
    }
}
