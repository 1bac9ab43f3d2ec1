//! Sidecar-pull mode: the local engine keeps its KV pool in a shared-memory file (the
//! simulator's `--shm-path`, described by its `GET /admin/pool`); the sidecar maps and registers
//! it, reserves blocks there (`POST /admin/reserve`), READs the prompt's blocks from the prefill
//! engine's agent with its own xfer agent (the done notification rides on the READ, freeing the
//! prefill), then the decode call names the reservation instead of the prefill.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::Method;
use parking_lot::Mutex;
use serde::Deserialize;
use tokio::sync::OnceCell;

use crate::context::Context;
use crate::errors::UpstreamError;
use crate::json::{self, Object};
use crate::metrics::inc;
use crate::release::{ReleaseGuard, Releaser};
use crate::target::Target;
use crate::upstream::{self, HttpClient};
use crate::xfer_link::{self, Handle, LinkError, XferLink};

/// Why a call to the local engine's pd-sim admin API came to nothing.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Request(#[from] http::Error),
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("{path} answered {status}: {body}")]
    Status { path: String, status: http::StatusCode, body: String },
    #[error("{path}: {source}")]
    Json { path: String, source: serde_json::Error },
}

#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("the local engine's pool: {0}")]
    Pool(String),
    #[error("reserving blocks: {0}")]
    Reserve(String),
    #[error("{0}")]
    Link(#[from] LinkError),
}

#[derive(Debug, Deserialize)]
struct PoolInfo {
    block_bytes: u64,
    num_blocks: usize,
    shm_path: Option<PathBuf>,
}

#[derive(Debug, Deserialize)]
struct Reservation {
    reservation_id: String,
    block_ids: Vec<u64>,
}

/// The mapped, registered pool (the registration keeps the mapping alive).
#[derive(Debug)]
struct LocalPool {
    prepared: xfer::PreparedLocal,
    _registration: xfer::Registration,
    block_bytes: u64,
    num_blocks: usize,
}

/// The puller's own handles: the sidecar's xfer agent, the local engine's first rank (its pool
/// and reservations) and the releaser that gives back a reservation no decode will use.
#[derive(Debug)]
pub struct Puller {
    link: Arc<XferLink>,
    engine: Target,
    releaser: Arc<Releaser>,
    pool: OnceCell<Arc<LocalPool>>,
    /// Prefill pools as prepared descriptor lists, by engine id.
    peers: Mutex<HashMap<String, Arc<xfer::PreparedRemote>>>,
    /// Held from loading a grant until the descriptors under it are prepared, so that another
    /// request's grant over the same peer cannot slip in between.
    grant_loading: Mutex<()>,
}

async fn engine_json<T: for<'de> Deserialize<'de>>(
    client: &HttpClient,
    target: &Target,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> Result<T, AdminError> {
    let req = upstream::json_request(method, &target.url(path), body)?;
    let started = Instant::now();
    let resp = upstream::send(client, target, req, timeout).await?;
    let status = resp.status();
    let left = timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
    let bytes = upstream::collect(target, resp.into_body(), 1 << 20, left).await?;
    if !status.is_success() {
        let body = String::from_utf8_lossy(&bytes).into_owned();
        return Err(AdminError::Status { path: path.to_string(), status, body });
    }
    serde_json::from_slice(&bytes).map_err(|source| AdminError::Json { path: path.to_string(), source })
}

impl Puller {
    pub fn new(link: Arc<XferLink>, engine: Target, releaser: Arc<Releaser>) -> Puller {
        Puller {
            link,
            engine,
            releaser,
            pool: OnceCell::new(),
            peers: Mutex::default(),
            grant_loading: Mutex::default(),
        }
    }

    /// The agent the prefill call names as the reader, so the blocks are granted to it: this
    /// sidecar's, once it has mapped the engine's pool. Before that (and for an engine without a
    /// shared pool) none: the engine may have to pull itself, and it could not read under a
    /// grant issued to another agent.
    pub fn granted_reader(&self) -> Option<&str> {
        self.pool.initialized().then(|| self.link.agent.name())
    }

    /// The local engine's pool, mapped and registered once.
    async fn pool(&self, client: &HttpClient, timeout: Duration) -> Result<Arc<LocalPool>, PullError> {
        let (engine, link) = (&self.engine, &self.link);
        self.pool
            .get_or_try_init(|| async {
                let info: PoolInfo = engine_json(client, engine, Method::GET, "/admin/pool", None, timeout)
                    .await
                    .map_err(|e| PullError::Pool(e.to_string()))?;
                let path = info
                    .shm_path
                    .ok_or_else(|| PullError::Pool("the engine has no shared-memory pool (--shm-path)".into()))?;
                let map = Arc::new(
                    xfer::SharedFile::open(&path).map_err(|e| PullError::Pool(format!("{}: {e}", path.display())))?,
                );
                let needed = info.block_bytes.saturating_mul(info.num_blocks as u64);
                if info.block_bytes == 0 || (map.len() as u64) < needed {
                    return Err(PullError::Pool(format!("{} is smaller than the advertised pool", path.display())));
                }
                let registration = link.agent.register_buffer(&map).map_err(LinkError::from)?;
                let descs: Vec<xfer::Desc> = (0..info.num_blocks as u64)
                    .map(|i| xfer::Desc::new(map.addr() + i * info.block_bytes, info.block_bytes, 0))
                    .collect();
                let prepared = link.agent.prep_local(xfer::MemType::Dram, &descs).map_err(LinkError::from)?;
                tracing::info!(path = %path.display(), blocks = info.num_blocks, "mapped the engine's KV pool");
                Ok(Arc::new(LocalPool {
                    prepared,
                    _registration: registration,
                    block_bytes: info.block_bytes,
                    num_blocks: info.num_blocks,
                }))
            })
            .await
            .cloned()
    }

    /// The prefill's pool, resolved once per engine id (blocking).
    fn peer_pool(
        &self,
        link: &XferLink,
        h: &Handle,
        block_bytes: u64,
        refresh: bool,
    ) -> Result<Arc<xfer::PreparedRemote>, LinkError> {
        if !refresh {
            if let Some(p) = self.peers.lock().get(&h.remote_engine_id) {
                return Ok(Arc::clone(p));
            }
        }
        let peer = link.peer(h, refresh)?;
        let regions = link.agent.remote_regions(&peer)?;
        let (_, region) = regions
            .iter()
            .find(|(t, d)| *t == xfer::MemType::Dram && d.len % block_bytes == 0)
            .ok_or_else(|| LinkError::Other(format!("{peer} publishes no pool with {block_bytes}-byte blocks")))?;
        let descs: Vec<xfer::Desc> = (0..region.len / block_bytes)
            .map(|i| xfer::Desc::new(region.addr + i * block_bytes, block_bytes, 0))
            .collect();
        let prepared = Arc::new(link.agent.prep_remote(&peer, xfer::MemType::Dram, &descs)?);
        self.peers.lock().insert(h.remote_engine_id.clone(), Arc::clone(&prepared));
        Ok(prepared)
    }
}

/// Pulls the blocks `params` name into a fresh reservation of the local engine; returns the
/// `kv_transfer_params` of the decode call.
pub async fn run(
    ctx: &Context,
    puller: &Arc<Puller>,
    client: &Object<'_>,
    path: &str,
    rid: &str,
    params: &str,
) -> Result<String, PullError> {
    let link = &puller.link;
    let handle = Handle::parse(params)?;
    let remote_ids = handle.block_ids()?;
    if remote_ids.is_empty() {
        return Err(PullError::Link(LinkError::Params("no remote blocks".into())));
    }
    let (engine, timeout) = (&puller.engine, ctx.cfg.pull_timeout);
    let pool = puller.pool(&ctx.client, timeout).await?;
    if remote_ids.len() > pool.num_blocks {
        return Err(PullError::Reserve(format!("{} blocks exceed the pool", remote_ids.len())));
    }
    let body = format!("{{\"num_blocks\":{}}}", remote_ids.len()).into_bytes();
    let r: Reservation = engine_json(&ctx.client, engine, Method::POST, "/admin/reserve", Some(body), timeout)
        .await
        .map_err(|e| PullError::Reserve(e.to_string()))?;
    let reserved = reservation_params(&r.reservation_id);
    if !reservation_fits(&r.block_ids, remote_ids.len(), pool.num_blocks) {
        consume(puller, client, path, rid, &reserved);
        return Err(PullError::Reserve("the engine reserved unexpected blocks".into()));
    }
    let started = Instant::now();
    let (puller2, link2, pool2, handle2) = (Arc::clone(puller), Arc::clone(link), Arc::clone(&pool), handle.clone());
    let local_idx: Vec<usize> = r.block_ids.iter().map(|&b| b as usize).collect();
    let outcome = xfer_link::blocking(timeout + Duration::from_secs(1), move || {
        read(&puller2, &link2, &pool2, &handle2, &local_idx, &remote_ids, timeout)
    })
    .await;
    match outcome {
        Ok(bytes) => {
            inc(&ctx.metrics.pulls_ok);
            ctx.metrics.pull_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!(bytes, us = started.elapsed().as_micros() as u64, "pulled the prompt's blocks");
            Ok(reserved)
        }
        Err(e) => {
            inc(&ctx.metrics.pulls_failed);
            link.forget(&handle.remote_engine_id);
            puller.peers.lock().remove(&handle.remote_engine_id);
            consume(puller, client, path, rid, &reserved);
            Err(e.into())
        }
    }
}

/// The decode call's `kv_transfer_params` naming a reservation.
fn reservation_params(id: &str) -> String {
    format!("{{\"do_remote_prefill\":true,\"reservation_id\":{}}}", json::string(id))
}

/// Whether the engine reserved one block per wanted block, each inside its pool (an engine
/// answer is not trusted to index the pool).
fn reservation_fits(reserved: &[u64], wanted: usize, num_blocks: usize) -> bool {
    reserved.len() == wanted && reserved.iter().all(|&b| usize::try_from(b).is_ok_and(|b| b < num_blocks))
}

/// READs the remote blocks into the reserved ones, notifying the prefill when done (blocking).
fn read(
    puller: &Puller,
    link: &XferLink,
    pool: &LocalPool,
    h: &Handle,
    local_idx: &[usize],
    remote_ids: &[u64],
    timeout: Duration,
) -> Result<u64, LinkError> {
    let remote = match puller.peer_pool(link, h, pool.block_bytes, false) {
        Ok(r) => r,
        Err(_) => puller.peer_pool(link, h, pool.block_bytes, true)?,
    };
    let remote_idx = remote_ids
        .iter()
        .map(|&id| usize::try_from(id).ok().filter(|&i| i < remote.len()))
        .collect::<Option<Vec<usize>>>()
        .ok_or_else(|| LinkError::Params(format!("a block id is outside the prefill's {} blocks", remote.len())))?;
    let granted = match &h.grant {
        Some(token) => Some(under_grant(puller, link, h, token, remote_ids, pool.block_bytes)?),
        None => None,
    };
    // Under a grant the prepared list holds exactly the blocks, in order.
    let (remote, remote_idx) = match &granted {
        Some(list) => (list, (0..remote_ids.len()).collect()),
        None => (&*remote, remote_idx),
    };
    let request = link.agent.make_request(
        xfer::Op::Read,
        &pool.prepared,
        local_idx,
        remote,
        &remote_idx,
        xfer::RequestOptions::notify(h.done_notification()),
    )?;
    request.post()?;
    if let Err(e) = request.wait(timeout) {
        request.cancel();
        // Let the backend stop writing into the blocks before they go back to the engine.
        let _ = request.wait(Duration::from_secs(1));
        return Err(e.into());
    }
    Ok(request.bytes())
}

/// Loads the prefill's grant token and prepares the blocks under it: a prefill that already
/// revoked the grant refuses the READ before any byte moves.
fn under_grant(
    puller: &Puller,
    link: &XferLink,
    h: &Handle,
    token_hex: &str,
    remote_ids: &[u64],
    block_bytes: u64,
) -> Result<xfer::PreparedRemote, LinkError> {
    let token = xfer::grant::from_hex(token_hex)?;
    let peer = link.peer(h, false)?;
    let (_, region) = link
        .agent
        .remote_regions(&peer)?
        .into_iter()
        .find(|(t, d)| *t == xfer::MemType::Dram && d.len % block_bytes == 0)
        .ok_or_else(|| LinkError::Other(format!("{peer} publishes no pool with {block_bytes}-byte blocks")))?;
    let descs: Vec<xfer::Desc> =
        remote_ids.iter().map(|&b| xfer::Desc::new(region.addr + b * block_bytes, block_bytes, 0)).collect();
    let _loading = puller.grant_loading.lock();
    let granter = link.agent.load_grant(&token)?;
    if granter != peer {
        return Err(LinkError::Params(format!("the grant is from {granter}, the blocks are {peer}'s")));
    }
    Ok(link.agent.prep_remote(&peer, xfer::MemType::Dram, &descs)?)
}

/// Makes the local engine drop a reservation it will not get a decode for (a one-token decode
/// naming it).
fn consume(puller: &Puller, client: &Object<'_>, path: &str, rid: &str, reserved: &str) {
    let body = bytes::Bytes::from(client.rewrite(&[]));
    drop(ReleaseGuard::new(&puller.releaser, rid, reserved, body, path).decode_only());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_checked() {
        for (reserved, wanted, blocks, fits) in [
            (&[0u64, 3][..], 2, 4, true),
            (&[3], 1, 4, true),
            (&[4], 1, 4, false),
            (&[0, 1], 3, 4, false),
            (&[0, 1, 2], 2, 4, false),
            (&[u64::MAX], 1, 4, false),
            (&[], 0, 0, true),
        ] {
            assert_eq!(reservation_fits(reserved, wanted, blocks), fits, "{reserved:?} for {wanted} of {blocks}");
        }
    }

    #[test]
    fn reservation_params_are_json() {
        for id in ["r-1", "a\"b\\c", ""] {
            let v: serde_json::Value = serde_json::from_str(&reservation_params(id)).unwrap();
            assert_eq!(v["reservation_id"], id);
            assert_eq!(v["do_remote_prefill"], true);
        }
    }
}
