//! One generation request from body to response: parse, inject faults, queue, obtain the
//! prompt's KV blocks (compute, pull from a vLLM-style prefill, or from an SGLang-style
//! bootstrap room), generate, and answer; prefill roles then hold the blocks for their decode.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use pd_protocols::kv_params::{KvTransferParams, GRANT_KEY, RELEASE_REQUEST_ID_SUFFIX};
use tokio::sync::{mpsc, OwnedSemaphorePermit};

use crate::config::{FailurePolicy, PrefillQueueMode, Role};
use crate::engine::{random_hex, DecodeSteps, Engine, Prompt};
use crate::faults::Verdict;
use crate::metrics::add;
use crate::openai::{ApiError, Bootstrap, Endpoint, GenRequest, PromptInput};
use crate::pool::BlockId;
use crate::pull::{self, PullError};
use crate::respond::{self, Meta};
use crate::sglang;

/// Where the prompt's KV comes from and where it goes afterwards.
#[derive(Debug)]
enum Mode {
    Local,
    /// vLLM prefill for a remote decode: hold the blocks under a lease, answer with params.
    /// Carries the decode's agent name when the proxy put it in `remote_engine_id`: the
    /// held blocks are then granted to that agent alone.
    RemoteDecode(Option<String>),
    /// vLLM decode: pull the blocks the params name.
    RemotePrefill(KvTransferParams),
    /// SGLang prefill: hold the room's blocks until its decode pulls them.
    RoomPrefill(Bootstrap),
    /// SGLang decode: pull the room's blocks from the prefill's bootstrap server.
    RoomDecode(Bootstrap),
    /// Sidecar-pull mode: a co-located process already wrote the blocks into the pool blocks it
    /// reserved through `/admin/reserve`; verify and adopt them.
    Preloaded(String),
}

/// Blocks and the running slot a request holds; both go back when it is dropped (also when a
/// streaming client disconnects).
#[derive(Debug)]
pub struct Held {
    engine: Arc<Engine>,
    pub blocks: Vec<BlockId>,
    _permit: OwnedSemaphorePermit,
    room: Option<i64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.engine.running.fetch_sub(1, Relaxed);
        let mut state = self.engine.state.lock();
        state.pool.release(&self.blocks);
        if let Some(room) = self.room {
            let blocks = state.rooms.end(room);
            state.pool.release(&blocks);
        }
    }
}

/// Decrements the waiting gauge however the wait ends.
struct Waiting<'a>(&'a Engine);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Relaxed);
    }
}

/// Releases a claimed room when the request fails before it holds blocks.
struct RoomClaim {
    engine: Arc<Engine>,
    room: Option<i64>,
}

impl Drop for RoomClaim {
    fn drop(&mut self) {
        if let Some(room) = self.room.take() {
            let blocks = self.engine.state.lock().rooms.end(room);
            self.engine.release(&blocks);
        }
    }
}

pub async fn handle(engine: Arc<Engine>, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
    match run(&engine, endpoint, &headers, &body).await {
        Ok(response) => {
            add(&engine.metrics.requests_ok, 1);
            response
        }
        Err(err) => {
            add(&engine.metrics.requests_failed, 1);
            err.into_response()
        }
    }
}

fn mode(engine: &Engine, req: &GenRequest) -> Mode {
    if let Some(b) = &req.bootstrap {
        match engine.cfg.role {
            Role::Prefill => return Mode::RoomPrefill(b.clone()),
            Role::Decode => return Mode::RoomDecode(b.clone()),
            Role::Both => {}
        }
    }
    let Some(raw) = &req.kv_transfer_params else { return Mode::Local };
    let params: KvTransferParams = match serde_json::from_value(serde_json::Value::Object(raw.clone())) {
        Ok(p) => p,
        Err(err) => {
            add(&engine.metrics.invalid_params, 1);
            tracing::warn!(%err, "Got invalid KVTransferParams; recomputing the prompt");
            return Mode::Local;
        }
    };
    if let Some(id) = params.extra.get("reservation_id").and_then(serde_json::Value::as_str) {
        if params.do_remote_prefill {
            return Mode::Preloaded(id.to_string());
        }
    }
    if params.do_remote_decode {
        Mode::RemoteDecode(params.remote_engine_id)
    } else if params.do_remote_prefill {
        if params.is_valid_for_pull() {
            Mode::RemotePrefill(params)
        } else {
            add(&engine.metrics.invalid_params, 1);
            tracing::warn!("Got invalid KVTransferParams; recomputing the prompt");
            Mode::Local
        }
    } else {
        Mode::Local
    }
}

/// 404 for a request naming another model (vLLM's answer).
pub(crate) fn check_model(engine: &Engine, req: &GenRequest) -> Result<(), ApiError> {
    match &req.model {
        Some(model) if *model != engine.cfg.model => {
            Err(ApiError::new(StatusCode::NOT_FOUND, format!("The model `{model}` does not exist.")))
        }
        _ => Ok(()),
    }
}

/// The prompt's token ids and the output budget, checked against the context length.
pub(crate) fn prompt_tokens(engine: &Engine, req: &GenRequest) -> Result<(Vec<u32>, usize), ApiError> {
    let tokens = match &req.prompt {
        PromptInput::Text(text) => engine
            .tokenizer
            .encode(text)
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?,
        PromptInput::Tokens(ids) => ids.clone(),
    };
    if tokens.is_empty() {
        return Err(ApiError::bad_request("The prompt is empty (no tokens).", Some("prompt")));
    }
    let max_tokens = req.max_tokens.unwrap_or(engine.cfg.default_max_tokens);
    let limit = engine.cfg.max_model_len;
    if tokens.len().saturating_add(max_tokens) > limit {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {limit} tokens. However, you requested {} tokens ({} in the messages, {max_tokens} in the completion).",
                tokens.len() + max_tokens,
                tokens.len()
            ),
            None,
        ));
    }
    Ok((tokens, max_tokens))
}

/// The request's id base: the client's `X-Request-Id` when usable, else random.
pub(crate) fn request_base(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 256)
        .map(String::from)
        .unwrap_or_else(|| random_hex(16))
}

async fn run(engine: &Arc<Engine>, endpoint: Endpoint, headers: &HeaderMap, body: &[u8]) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let req = GenRequest::parse(endpoint, body)?;
    check_model(engine, &req)?;
    if engine.faults.before_request().await == Verdict::Fail {
        add(&engine.metrics.injected_errors, 1);
        return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "injected failure"));
    }
    let (tokens, max_tokens) = prompt_tokens(engine, &req)?;
    let base = request_base(headers);
    // A sidecar's release decode: its prompt may be synthetic, so what it pulls is neither
    // checked against the prompt nor cached; the pull itself (and its done notification) is
    // what frees the prefill's blocks.
    let release_decode = base.ends_with(RELEASE_REQUEST_ID_SUFFIX);
    let prefix = endpoint.id_prefix();
    let meta = Meta {
        id: format!("{prefix}-{base}"),
        model: engine.cfg.model.clone(),
        created: respond::unix_now(),
        endpoint,
        prompt_tokens: tokens.len(),
    };
    // The engine-internal id, with vLLM's random suffix (what `remote_request_id` carries).
    let internal_id = format!("{}-0-{}", meta.id, random_hex(4));
    let mut mode = mode(engine, &req);
    let room = match &mode {
        Mode::RoomPrefill(b) | Mode::RoomDecode(b) => Some(b.room),
        _ => None,
    };
    let mut claim = RoomClaim { engine: Arc::clone(engine), room: None };
    if let Some(room) = room {
        engine.state.lock().rooms.begin(room).map_err(|e| {
            add(&engine.metrics.rooms_rejected, 1);
            ApiError::bad_request(e.to_string(), Some("bootstrap_room"))
        })?;
        claim.room = Some(room);
    }
    // A decode resolves its prefill before queueing, so it can send heartbeats while it waits.
    let remote = match &mode {
        Mode::RemotePrefill(p) => Some(resolve(engine, p).await),
        _ => None,
    };
    let heartbeat = match (&mode, &remote) {
        (Mode::RemotePrefill(p), Some(Ok(peer))) => {
            Some((peer.peer().to_string(), p.remote_request_id.clone().unwrap_or_default()))
        }
        _ => None,
    };
    let deadline = arrived + engine.cfg.queue_timeout;
    let permit = admit(engine, heartbeat, deadline).await?;
    engine.running.fetch_add(1, Relaxed);
    let prompt = engine.prompt(tokens);
    let preloaded = match &mode {
        Mode::Preloaded(id) => Some((id.clone(), engine.take_reservation(id))),
        _ => None,
    };
    let (mut held, hit) = match preloaded {
        Some((_, Some(blocks))) if blocks.len() == prompt.num_blocks() => {
            (Held { engine: Arc::clone(engine), blocks, _permit: permit, room: None }, 0)
        }
        Some((id, blocks)) => {
            // Unknown, expired or wrongly sized: nothing usable was preloaded.
            let n = blocks.as_ref().map_or(0, Vec::len);
            engine.release(&blocks.unwrap_or_default());
            add(&engine.metrics.failed_pulls, 1);
            let reason = format!("reservation {id} holds {n} blocks, the prompt needs {}", prompt.num_blocks());
            if engine.cfg.kv_load_failure_policy == FailurePolicy::Fail {
                return Err(ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("failed to load the KV cache: {reason}"),
                ));
            }
            tracing::warn!(%reason, "no preloaded KV; recomputing the prompt");
            add(&engine.metrics.recomputed, 1);
            mode = Mode::Local;
            reserve(engine, &prompt, deadline, permit, None).await?
        }
        None => reserve(engine, &prompt, deadline, permit, claim.room.take()).await?,
    };

    match &mode {
        Mode::RemotePrefill(params) => {
            let outcome = match remote.expect("resolved for remote prefill") {
                Ok(peer) => pull_vllm(engine, &prompt, &held.blocks, hit, params, &peer, !release_decode).await,
                Err(err) => Err(err),
            };
            if !(release_decode && outcome.is_ok()) {
                settle_pull(engine, &prompt, &held.blocks, hit, outcome).await?;
            }
        }
        Mode::Preloaded(_) => {
            let outcome = verify(engine, &prompt, &held.blocks, 0);
            settle_pull(engine, &prompt, &held.blocks, 0, outcome).await?;
        }
        Mode::RoomDecode(b) => {
            let outcome = sglang::pull_room(engine, &prompt, &held.blocks, hit, b).await;
            settle_pull(engine, &prompt, &held.blocks, hit, outcome).await?;
        }
        _ => compute(engine, &prompt, &held.blocks, hit).await,
    }

    let n_out = match mode {
        Mode::RoomPrefill(_) => 1,
        _ => max_tokens,
    };
    let out = output_tokens(&prompt, n_out, engine.tokenizer.vocab_size());
    add(&engine.metrics.prompt_tokens, prompt.tokens.len() as u64);
    add(&engine.metrics.generation_tokens, out.len() as u64);

    match mode {
        Mode::RemoteDecode(decode_agent) => {
            DecodeSteps::new(Instant::now()).run(engine, out.len()).await;
            engine.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
            let blocks = std::mem::take(&mut held.blocks);
            let mut params = lease_params(engine, &internal_id, &blocks, &prompt, hit);
            if let Some(token) = engine.start_lease(internal_id, blocks, decode_agent.as_deref()) {
                params.extra.insert(GRANT_KEY.into(), token.into());
            }
            Ok(respond::full(&meta, &text(engine, &out), out.len(), Some(&params)))
        }
        Mode::RoomPrefill(b) => {
            DecodeSteps::new(Instant::now()).run(engine, out.len()).await;
            engine.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
            sglang::hold_until_pulled(engine, &mut held, b.room, prompt.tokens.len()).await?;
            Ok(respond::full(&meta, &text(engine, &out), out.len(), None))
        }
        _ if req.stream => Ok(stream(engine, meta, out, held, req.include_usage, arrived)),
        _ => {
            DecodeSteps::new(Instant::now()).run(engine, out.len()).await;
            engine.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
            drop(held);
            Ok(respond::full(&meta, &text(engine, &out), out.len(), None))
        }
    }
}

async fn resolve(engine: &Arc<Engine>, p: &KvTransferParams) -> Result<Arc<xfer::PreparedRemote>, PullError> {
    let (id, host, port) = (
        p.remote_engine_id.as_deref().unwrap_or_default(),
        p.remote_host.as_deref().unwrap_or_default(),
        p.remote_port.unwrap_or_default(),
    );
    pull::peer_pool(engine, id, &format!("{host}:{port}")).await
}

/// Waits for a running slot (bounded), sending heartbeats to the prefill meanwhile.
async fn admit(
    engine: &Arc<Engine>,
    heartbeat: Option<(String, String)>,
    deadline: Instant,
) -> Result<OwnedSemaphorePermit, ApiError> {
    if let Ok(permit) = Arc::clone(&engine.slots).try_acquire_owned() {
        return Ok(permit);
    }
    engine.waiting.fetch_add(1, Relaxed);
    let _waiting = Waiting(engine);
    let acquire = Arc::clone(&engine.slots).acquire_owned();
    tokio::pin!(acquire);
    let interval = engine.cfg.heartbeat_interval;
    let beats = heartbeat.filter(|_| !interval.is_zero());
    let mut next_beat = Instant::now() + interval;
    let timeout = || ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "timed out waiting in the queue");
    loop {
        let wake = match &beats {
            Some(_) => next_beat.min(deadline),
            None => deadline,
        };
        tokio::select! {
            permit = &mut acquire => return permit.map_err(|_| timeout()),
            () = tokio::time::sleep_until(wake.into()) => {
                if Instant::now() >= deadline {
                    return Err(timeout());
                }
                if let Some((peer, request_id)) = &beats {
                    match engine.agent.send_notif(peer, format!("HB:{request_id}").as_bytes()) {
                        Ok(()) => add(&engine.metrics.heartbeats_sent, 1),
                        Err(err) => tracing::warn!(%err, "cannot send a heartbeat"),
                    }
                    next_beat += interval;
                }
            }
        }
    }
}

/// Reserves the prompt's blocks, waiting (bounded) while the pool is full.
async fn reserve(
    engine: &Arc<Engine>,
    prompt: &Prompt,
    deadline: Instant,
    permit: OwnedSemaphorePermit,
    room: Option<i64>,
) -> Result<(Held, usize), ApiError> {
    let mut held = Held { engine: Arc::clone(engine), blocks: Vec::new(), _permit: permit, room };
    loop {
        match engine.reserve(prompt) {
            Ok((blocks, hit)) => {
                held.blocks = blocks;
                return Ok((held, hit));
            }
            Err(full) if prompt.num_blocks() > engine.cfg.num_blocks => {
                return Err(ApiError::bad_request(full.to_string(), None));
            }
            Err(full) if Instant::now() >= deadline => {
                return Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, full.to_string()));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
        }
    }
}

/// Computes the uncached part of the prompt: content, prefill time (after the prompts queued
/// before it, with `--prefill-queue fifo`), prefix cache.
async fn compute(engine: &Arc<Engine>, prompt: &Prompt, blocks: &[BlockId], hit: usize) {
    engine.fill(prompt, blocks, hit);
    let computed = prompt.tokens.len() - hit * engine.cfg.block_size;
    let took = Duration::from_secs_f64(computed as f64 * engine.cfg.prefill_us_per_token / 1e6);
    let now = Instant::now();
    match engine.cfg.prefill_queue {
        PrefillQueueMode::None => {
            engine.prefill_log.lock().record(now, took, computed as u64);
            respond::pause(computed, engine.cfg.prefill_us_per_token).await;
        }
        PrefillQueueMode::Fifo => {
            let run = engine.prefill_queue.lock().admit(now, took);
            engine.prefill_log.lock().record(run.0, took, computed as u64);
            let slot = QueueSlot { engine, run: Some(run) };
            if run.1 > now {
                tokio::time::sleep_until(run.1.into()).await;
            }
            slot.done();
        }
    }
    add(&engine.metrics.prompt_tokens_local, computed as u64);
    engine.commit(prompt, blocks, hit);
}

/// A prompt's place in the engine's prefill queue: given back if the request is dropped before
/// its prompt is computed (its client left).
struct QueueSlot<'a> {
    engine: &'a Engine,
    run: Option<(Instant, Instant)>,
}

impl QueueSlot<'_> {
    fn done(mut self) {
        self.run = None;
    }
}

impl Drop for QueueSlot<'_> {
    fn drop(&mut self) {
        if let Some(run) = self.run {
            self.engine.prefill_queue.lock().withdraw(run, Instant::now());
        }
    }
}

async fn pull_vllm(
    engine: &Arc<Engine>,
    prompt: &Prompt,
    blocks: &[BlockId],
    hit: usize,
    params: &KvTransferParams,
    peer: &xfer::PreparedRemote,
    check: bool,
) -> Result<(), PullError> {
    let remote_ids = params.first_group();
    if remote_ids.len() != prompt.num_blocks() {
        return Err(PullError::BlockIds(format!(
            "{} remote blocks for a prompt of {} blocks",
            remote_ids.len(),
            prompt.num_blocks()
        )));
    }
    let request_id = params.remote_request_id.as_deref().unwrap_or_default();
    let notif = pd_protocols::kv_params::done_notification(request_id, 1);
    let engine_id = params.remote_engine_id.as_deref().unwrap_or_default();
    pull::read_blocks(engine, engine_id, peer, &remote_ids[hit..], &blocks[hit..], params.grant(), notif).await?;
    if check {
        verify(engine, prompt, blocks, hit)
    } else {
        Ok(())
    }
}

pub fn verify(engine: &Engine, prompt: &Prompt, blocks: &[BlockId], hit: usize) -> Result<(), PullError> {
    match engine.first_mismatch(prompt, blocks, hit) {
        None => Ok(()),
        Some(i) => {
            add(&engine.metrics.verification_failures, 1);
            Err(PullError::Verification(i))
        }
    }
}

/// After a pull: count and cache what arrived, or apply the failure policy.
async fn settle_pull(
    engine: &Arc<Engine>,
    prompt: &Prompt,
    blocks: &[BlockId],
    hit: usize,
    outcome: Result<(), PullError>,
) -> Result<(), ApiError> {
    match outcome {
        Ok(()) => {
            let pulled = prompt.tokens.len() - hit * engine.cfg.block_size;
            add(&engine.metrics.prompt_tokens_transferred, pulled as u64);
            engine.commit(prompt, blocks, hit);
            Ok(())
        }
        Err(err) => match policy_for(&engine.cfg, &err) {
            FailurePolicy::Fail => {
                Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("failed to load the KV cache: {err}")))
            }
            FailurePolicy::Recompute => {
                tracing::warn!(%err, "KV load failed; recomputing the prompt");
                add(&engine.metrics.recomputed, 1);
                compute(engine, prompt, blocks, hit).await;
                Ok(())
            }
        },
    }
}

/// Late reads have their own policy; every other failure to load follows vLLM's.
fn policy_for(cfg: &crate::config::Config, err: &PullError) -> FailurePolicy {
    match err {
        PullError::LateRead(_) => cfg.late_read_policy,
        _ => cfg.kv_load_failure_policy,
    }
}

fn lease_params(
    engine: &Engine,
    request_id: &str,
    blocks: &[BlockId],
    prompt: &Prompt,
    hit: usize,
) -> KvTransferParams {
    KvTransferParams {
        do_remote_prefill: true,
        do_remote_decode: false,
        remote_block_ids: Some(vec![blocks.iter().map(|&b| u64::from(b)).collect()]),
        remote_engine_id: Some(engine.engine_id.clone()),
        remote_request_id: Some(request_id.to_string()),
        remote_host: Some(engine.cfg.host_ip.clone()),
        remote_port: Some(engine.xfer_port),
        tp_size: Some(1),
        dcp_size: Some(1),
        pp_size: Some(1),
        remote_num_tokens: Some(prompt.tokens.len() as u64),
        remote_blocks_expiry_time: None,
        transfer_mode: Some("pull".into()),
        remote_prefill_cached_tokens: Some((hit * engine.cfg.block_size) as u64),
        extra: Default::default(),
    }
}

/// Deterministic output: a function of the prompt only, so P/D and a single engine agree.
fn output_tokens(prompt: &Prompt, n: usize, vocab: u32) -> Vec<u32> {
    // Seeded by the last block's digest (flipped, so it is not the block's own content).
    let mut seed = *prompt.content_digest(prompt.num_blocks() - 1);
    seed[0] ^= 0xff;
    let mut bytes = vec![0u8; n * 4];
    crate::content::fill(&seed, &mut bytes);
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % vocab).collect()
}

fn text(engine: &Engine, out: &[u32]) -> String {
    out.iter().map(|&t| engine.tokenizer.decode_piece(t)).collect()
}

fn stream(
    engine: &Arc<Engine>,
    meta: Meta,
    out: Vec<u32>,
    held: Held,
    include_usage: bool,
    arrived: Instant,
) -> Response {
    let (tx, rx) = mpsc::channel(16);
    let engine = Arc::clone(engine);
    tokio::spawn(async move {
        let _held = held;
        let mut steps = DecodeSteps::new(Instant::now());
        if meta.endpoint == Endpoint::Chat && tx.send(respond::chunk(&meta, "", true, None)).await.is_err() {
            return;
        }
        for (i, &token) in out.iter().enumerate() {
            steps.run(&engine, 1).await;
            if i == 0 {
                engine.metrics.ttft.observe(arrived.elapsed().as_secs_f64());
            }
            let finish = (i + 1 == out.len()).then_some("length");
            let piece = engine.tokenizer.decode_piece(token);
            if tx.send(respond::chunk(&meta, &piece, false, finish)).await.is_err() {
                return; // the client left; `_held` gives the blocks back
            }
        }
        if include_usage && tx.send(respond::usage_chunk(&meta, out.len())).await.is_err() {
            return;
        }
        let _ = tx.send(respond::done_chunk()).await;
    });
    respond::stream(rx)
}
