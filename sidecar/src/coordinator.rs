//! The coordinator link (coordinator/API.md): registration, heartbeats carrying the engine's
//! load, a pairing per request, reports, and the notices heartbeats bring back (dead engines,
//! releases). Every call is short and bounded; while the coordinator is unreachable the
//! sidecar pairs from its last view of the engines, then from the static list.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use parking_lot::{Mutex, RwLock};
use pd_api::{
    EngineSpec, EngineView, Heartbeat, Load, Notices, PairDecision, PairReason, PairRequest, Registration, Report,
    ReportEvent,
};
use pd_http::Bearer;
use serde_json::value::RawValue;
use tokio::sync::mpsc;

use crate::allowlist::HostPort;
use crate::config::Config;
use crate::context::Context;
use crate::engines::{DeadSet, EnginePool};
use crate::errors::UpstreamError;
use crate::handoff::{Pairing, RemoteDecode};
use crate::load;
use crate::metrics::{inc, Metrics, Phase};
use crate::release::Releaser;
use crate::rewrite::Prompt;
use crate::target::Target;
use crate::upstream::{self, HttpClient};

/// Why a call to the coordinator came to nothing.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    #[error("{call} answered {status}: {body}")]
    Status { call: &'static str, status: StatusCode, body: String },
    #[error("unreadable {what}: {source}")]
    Unreadable { what: &'static str, source: serde_json::Error },
}

impl LinkError {
    fn status(call: &'static str, status: StatusCode, body: &[u8]) -> LinkError {
        let body = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
        LinkError::Status { call, status, body }
    }
}

#[derive(Debug)]
pub struct Coordinator {
    base: Target,
    /// Sent on every call (`--coordinator-token`).
    token: Option<Bearer>,
    timeout: Duration,
    backoff: Duration,
    spec: EngineSpec,
    pairing: bool,
    bootstrap_port: u16,
    prefill_scheme: String,
    chars_per_token: f64,
    /// The id the coordinator confirmed at registration.
    engine: RwLock<Option<String>>,
    /// The coordinator said at registration that it reads `decode_started` on a final report.
    decode_started_on_end: AtomicBool,
    heartbeat: Mutex<Duration>,
    /// While set and in the future, calls on the request path are skipped.
    down_until: Mutex<Option<Instant>>,
    /// Prefill-capable engines alive at the last successful `GET /v1/engines`.
    view: RwLock<Vec<Target>>,
    reports: mpsc::Sender<Report>,
    report_rx: Mutex<Option<mpsc::Receiver<Report>>>,
    stopping: AtomicBool,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

impl Coordinator {
    pub fn new(cfg: &Config, engine: &Target) -> Result<Coordinator, crate::target::TargetError> {
        let base = Target::parse(cfg.coordinator.as_deref().unwrap_or_default(), "http", None)?;
        let node = cfg.node.clone().unwrap_or_else(hostname);
        let port = cfg.listen.rsplit(':').next().unwrap_or("0");
        let spec = EngineSpec {
            id: cfg.engine_id.clone().unwrap_or_else(|| format!("{node}:{port}")),
            role: cfg.role.into(),
            node,
            model: cfg.model.clone().unwrap_or_default(),
            engine_url: cfg.advertise_engine_url.clone().unwrap_or_else(|| engine.base.clone()),
            sidecar_url: cfg.advertise_url.clone(),
            kv_events: cfg.kv_events.clone(),
            kv_events_topic: cfg.kv_events_topic.clone(),
            replay: cfg.kv_events_replay.clone(),
            xfer_side_channel: cfg.xfer_side_channel.clone(),
            block_size: u32::try_from(cfg.block_size).unwrap_or(u32::MAX),
            capacity_blocks: cfg.capacity_blocks,
            data_parallel_size: cfg.data_parallel_size,
        };
        let (tx, rx) = mpsc::channel(4096);
        Ok(Coordinator {
            base,
            token: cfg.coordinator_token.clone(),
            timeout: cfg.coordinator_timeout,
            backoff: cfg.coordinator_backoff,
            spec,
            pairing: !cfg.no_pairing,
            bootstrap_port: cfg.bootstrap_port,
            prefill_scheme: cfg.prefill_scheme.clone(),
            chars_per_token: cfg.chars_per_token,
            engine: RwLock::new(None),
            decode_started_on_end: AtomicBool::new(false),
            heartbeat: Mutex::new(Duration::from_secs(1)),
            down_until: Mutex::new(None),
            view: RwLock::new(Vec::new()),
            reports: tx,
            report_rx: Mutex::new(Some(rx)),
            stopping: AtomicBool::new(false),
        })
    }

    pub fn spec(&self) -> &EngineSpec {
        &self.spec
    }

    /// The id this sidecar's engine has at the coordinator.
    pub fn engine_id(&self) -> String {
        self.engine.read().clone().unwrap_or_else(|| self.spec.id.clone())
    }

    fn is_down(&self) -> bool {
        self.down_until.lock().is_some_and(|t| Instant::now() < t)
    }

    fn mark_down(&self, metrics: &Metrics, why: &str) {
        inc(&metrics.coordinator_errors);
        let mut d = self.down_until.lock();
        if d.is_none_or(|t| Instant::now() >= t) {
            tracing::warn!(coordinator = %self.base.base, %why, "coordinator unreachable; using the last view and the static list");
        }
        *d = Some(Instant::now() + self.backoff);
    }

    fn mark_up(&self) {
        *self.down_until.lock() = None;
    }

    /// The last view's prefill engines (empty when never fetched).
    pub fn view(&self) -> Vec<Target> {
        self.view.read().clone()
    }

    /// The last view's prefill engine at `hp`, if any (the coordinator vouches for it).
    pub fn view_target(&self, hp: &HostPort) -> Option<Target> {
        self.view.read().iter().find(|t| t.host_port == *hp).cloned()
    }

    async fn call(
        &self,
        client: &HttpClient,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, bytes::Bytes), UpstreamError> {
        let mut req = upstream::json_request(method, &self.base.url(path), body)
            .map_err(|e| UpstreamError::Io { target: self.base.base.clone(), reason: e.to_string() })?;
        if let Some(token) = &self.token {
            req.headers_mut().insert(http::header::AUTHORIZATION, token.header().clone());
        }
        let started = Instant::now();
        let resp = upstream::send(client, &self.base, req, self.timeout).await?;
        let status = resp.status();
        let left = self.timeout.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
        let body = upstream::collect(&self.base, resp.into_body(), 4 << 20, left).await?;
        Ok((status, body))
    }

    /// Asks for a pairing; `None` when pairing is off, the coordinator is down or has no
    /// answer (the caller falls back to the view or the static list).
    pub async fn pair(
        &self,
        client: &HttpClient,
        metrics: &Metrics,
        request_id: &str,
        model: Option<&str>,
        prompt: Option<&Prompt>,
    ) -> Option<Pairing> {
        if !self.pairing || self.is_down() {
            return None;
        }
        let (token_ids, text) = match prompt {
            Some(Prompt::Tokens(t)) => (Some(t.as_slice()), None),
            Some(Prompt::Text(s)) => (None, Some(s.as_str())),
            None => (None, None),
        };
        let engine = self.engine_id();
        // vLLM serves a LoRA adapter under the adapter's own name: a model other than the
        // engine's base model is taken as one of its adapters.
        let lora_name = model.filter(|m| *m != self.spec.model).map(str::to_owned);
        let req = PairRequest {
            request_id: request_id.to_string(),
            model: self.spec.model.clone(),
            lora_name,
            token_ids: token_ids.map(<[u32]>::to_vec),
            prompt: text.map(String::from),
            prompt_tokens: prompt.map(|p| p.estimated_tokens(self.chars_per_token)),
            local_engine: Some(engine.clone()),
        };
        let body = serde_json::to_vec(&req).ok()?;
        let asked = Instant::now();
        let answer = self.call(client, Method::POST, "/v1/pair", Some(body)).await;
        metrics.phase(Phase::Pairing).since(asked);
        match answer {
            Ok((s, body)) if s.is_success() => {
                self.mark_up();
                let d: PairDecision = match serde_json::from_slice(&body) {
                    Ok(d) => d,
                    Err(e) => {
                        self.mark_down(metrics, &format!("unreadable pairing: {e}"));
                        return None;
                    }
                };
                inc(&metrics.pairings);
                Some(decision(d, &self.prefill_scheme, self.bootstrap_port, &engine))
            }
            // 503: no live decode for the model; the coordinator works, we just decide alone.
            Ok((s, _)) if s == StatusCode::SERVICE_UNAVAILABLE => None,
            Ok((s, _)) => {
                self.mark_down(metrics, &format!("pairing answered {s}"));
                None
            }
            Err(e) => {
                self.mark_down(metrics, &e.to_string());
                None
            }
        }
    }

    /// Queues a report (never waits; dropped when the queue is full or the link is down).
    pub fn report(&self, metrics: &Metrics, report: Report) {
        if self.reports.try_send(report).is_err() {
            inc(&metrics.reports_dropped);
        }
    }

    pub fn stop(&self) {
        self.stopping.store(true, Relaxed);
    }

    async fn register(&self, client: &HttpClient) -> Result<(), LinkError> {
        let body = serde_json::to_vec(&self.spec).expect("an EngineSpec serialises");
        let (status, body) = self.call(client, Method::POST, "/v1/engines", Some(body)).await?;
        if !status.is_success() {
            return Err(LinkError::status("registration", status, &body));
        }
        let r: Registration =
            serde_json::from_slice(&body).map_err(|source| LinkError::Unreadable { what: "registration", source })?;
        if r.heartbeat_ms > 0 {
            *self.heartbeat.lock() = Duration::from_millis(r.heartbeat_ms.clamp(50, 60_000));
        }
        tracing::info!(engine = %r.engine, "registered with the coordinator");
        self.decode_started_on_end.store(r.decode_started_on_end, Relaxed);
        *self.engine.write() = Some(r.engine);
        Ok(())
    }

    async fn refresh_view(&self, client: &HttpClient) -> Result<(), LinkError> {
        let (status, body) = self.call(client, Method::GET, "/v1/engines", None).await?;
        if !status.is_success() {
            return Err(LinkError::status("the engine list", status, &body));
        }
        let views: Vec<EngineView> =
            serde_json::from_slice(&body).map_err(|source| LinkError::Unreadable { what: "engine list", source })?;
        *self.view.write() = prefill_view(views, &self.engine_id(), &self.prefill_scheme, self.bootstrap_port);
        Ok(())
    }
}

/// The live prefill-capable engines of a view other than this sidecar's own.
fn prefill_view(views: Vec<EngineView>, own: &str, scheme: &str, bootstrap_port: u16) -> Vec<Target> {
    views
        .into_iter()
        .filter(|v| v.alive && v.spec.role.prefills() && v.spec.id != own)
        .filter_map(|v| {
            let mut t = Target::parse(&v.spec.engine_url, scheme, Some(bootstrap_port)).ok()?;
            t.id = Some(v.spec.id);
            Some(t)
        })
        .collect()
}

fn decision(d: PairDecision, scheme: &str, bootstrap_port: u16, own: &str) -> Pairing {
    let local = d.reason == PairReason::LocalPrefill;
    let prefill = d.prefill.filter(|_| !local).and_then(|p| {
        let mut t = Target::parse(&p.engine_url, scheme, Some(bootstrap_port)).ok()?;
        t.id = Some(p.id);
        t.dp_rank = d.prefill_dp_rank;
        Some(t)
    });
    let remote_decode = Some(d.decode).filter(|e| e.id != own).map(|e| RemoteDecode {
        sidecar: e.sidecar_url.as_deref().and_then(|u| Target::parse(u, "http", None).ok()),
        id: e.id,
    });
    Pairing { prefill, remote_decode, decode_rank: d.decode_dp_rank }
}

/// The link's background work: register, heartbeat with load, act on notices, refresh the
/// view, and send queued reports. Ends when [`Coordinator::stop`] is called. The link reads the
/// local engine's load, marks engines dead and frees what a notice says no decode will take.
pub async fn run(
    c: Arc<Coordinator>,
    ctx: Arc<Context>,
    engines: Arc<EnginePool>,
    dead: Arc<DeadSet>,
    releaser: Arc<Releaser>,
) {
    if let Some(rx) = c.report_rx.lock().take() {
        tokio::spawn(send_reports(Arc::clone(&c), ctx.client.clone(), Arc::clone(&ctx.metrics), rx));
    }
    let mut registered = false;
    let mut ever_registered = false;
    let mut beats: u64 = 0;
    while !c.stopping.load(Relaxed) {
        let interval = *c.heartbeat.lock();
        // The coordinator dropped us (404): come back only with a live engine. Registering a
        // dead one revived it until the next failed health checks, again every heartbeat, and
        // requests were paired with it meanwhile.
        if !registered && ever_registered && !engine_healthy(&ctx, &engines).await {
            tokio::time::sleep(interval.max(Duration::from_millis(500))).await;
            continue;
        }
        if !registered {
            match c.register(&ctx.client).await {
                Ok(()) => {
                    registered = true;
                    ever_registered = true;
                    c.mark_up();
                    beats = 0;
                }
                Err(e) => c.mark_down(&ctx.metrics, &e.to_string()),
            }
        }
        if registered {
            let load = engine_load(&ctx, &engines).await;
            match heartbeat(&c, &ctx.client, load).await {
                Ok(Some(notices)) => handle_notices(&c, &ctx.metrics, &dead, &releaser, notices),
                Ok(None) => registered = false, // 404: re-register at once
                Err(e) => c.mark_down(&ctx.metrics, &e.to_string()),
            }
            if beats.is_multiple_of(5) {
                match c.refresh_view(&ctx.client).await {
                    // Engines alive again (a healed partition, a restart) leave the dead set.
                    Ok(()) => c.view.read().iter().for_each(|t| dead.revive(t)),
                    Err(e) => tracing::debug!(%e, "cannot refresh the engine view"),
                }
            }
            beats += 1;
            if !registered {
                continue;
            }
        }
        let pause = if registered { interval } else { interval.max(Duration::from_secs(1)) };
        tokio::time::sleep(pause).await;
    }
}

/// Leaves the coordinator gracefully (bounded).
pub async fn leave(c: &Coordinator, client: &HttpClient) {
    c.stop();
    let Some(id) = c.engine.read().clone() else { return };
    let _ = c.call(client, Method::DELETE, &format!("/v1/engines/{id}"), None).await;
}

async fn heartbeat(c: &Coordinator, client: &HttpClient, load: Load) -> Result<Option<Notices>, LinkError> {
    let id = c.engine_id();
    let body = serde_json::to_vec(&Heartbeat { load: Some(load) }).expect("a heartbeat serialises");
    let (status, body) = c.call(client, Method::POST, &format!("/v1/engines/{id}/heartbeat"), Some(body)).await?;
    if status == StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !status.is_success() {
        return Err(LinkError::status("the heartbeat", status, &body));
    }
    c.mark_up();
    if body.is_empty() {
        return Ok(Some(Notices::default()));
    }
    serde_json::from_slice(&body).map(Some).map_err(|source| LinkError::Unreadable { what: "notices", source })
}

fn handle_notices(c: &Coordinator, metrics: &Metrics, dead: &DeadSet, releaser: &Arc<Releaser>, notices: Notices) {
    for id in &notices.dead_engines {
        inc(&metrics.notices_dead_engines);
        tracing::warn!(engine = %id, "coordinator reports engine dead");
        dead.mark(id);
        if let Some(t) = c.view.read().iter().find(|t| t.id.as_deref() == Some(id)) {
            dead.mark(&t.base);
        }
    }
    for r in notices.release {
        let releaser = Arc::clone(releaser);
        tokio::spawn(async move {
            let outcome = releaser.release(&r.request_id, r.kv_transfer_params.get(), None, None).await;
            if let Err(e) = outcome {
                tracing::warn!(request_id = %r.request_id, prefill = ?r.prefill, %e, "release from a notice failed");
            }
        });
    }
}

/// Whether some rank of the local engine answers `/health` 2xx (bounded like the load scrape).
async fn engine_healthy(ctx: &Context, engines: &EnginePool) -> bool {
    for t in engines.all() {
        let Ok(req) = upstream::json_request(Method::GET, &t.url("/health"), None) else { continue };
        let timeout = ctx.cfg.coordinator_timeout.max(Duration::from_millis(500));
        if let Ok(resp) = upstream::send(&ctx.client, t, req, timeout).await {
            if resp.status().is_success() {
                return true;
            }
        }
    }
    false
}

/// The engine's load over all ranks (bounded by the coordinator timeout).
async fn engine_load(ctx: &Context, engines: &EnginePool) -> Load {
    let mut loads = Vec::with_capacity(engines.len());
    for t in engines.all() {
        let Ok(req) = upstream::json_request(Method::GET, &t.url("/metrics"), None) else { continue };
        let timeout = ctx.cfg.coordinator_timeout.max(Duration::from_millis(500));
        let Ok(resp) = upstream::send(&ctx.client, t, req, timeout).await else { continue };
        if !resp.status().is_success() {
            continue;
        }
        if let Ok(body) = upstream::collect(t, resp.into_body(), 16 << 20, timeout).await {
            loads.push(load::parse(&String::from_utf8_lossy(&body)));
        }
    }
    load::combine(&loads)
}

async fn send_reports(c: Arc<Coordinator>, client: HttpClient, metrics: Arc<Metrics>, mut rx: mpsc::Receiver<Report>) {
    let limit = Arc::new(tokio::sync::Semaphore::new(16));
    while let Some(report) = rx.recv().await {
        if c.is_down() {
            inc(&metrics.reports_dropped);
            continue;
        }
        let Ok(permit) = Arc::clone(&limit).acquire_owned().await else { return };
        let (client, metrics, c) = (client.clone(), Arc::clone(&metrics), Arc::clone(&c));
        tokio::spawn(async move {
            let _permit = permit;
            let Ok(body) = serde_json::to_vec(&report) else { return };
            match c.call(&client, Method::POST, "/v1/report", Some(body)).await {
                Ok((s, _)) if s.is_success() => {}
                Ok((s, b)) => {
                    inc(&metrics.reports_dropped);
                    tracing::debug!(status = %s, body = %String::from_utf8_lossy(&b), "report refused");
                }
                Err(e) => c.mark_down(&metrics, &e.to_string()),
            }
        });
    }
}

/// A request's reports to the coordinator; a reporter dropped without an ending reports
/// `failed`.
#[derive(Debug)]
pub struct Reporter {
    c: Arc<Coordinator>,
    metrics: Arc<Metrics>,
    request_id: String,
    /// The params this sidecar's prefill leg reported: a failure report carries them, so the
    /// coordinator frees this attempt's blocks and never those of another attempt under the same
    /// request id (a sidecar that served a failed redirect itself).
    params: Option<String>,
    /// The decode's first output came with its end (a whole non-streaming answer): the final
    /// report says so instead of a `decode_started` report of its own (when the coordinator
    /// reads that; see [`Registration::decode_started_on_end`]).
    started_with_end: bool,
    done: bool,
}

impl Reporter {
    pub fn new(c: &Arc<Coordinator>, metrics: &Arc<Metrics>, request_id: &str) -> Reporter {
        Reporter {
            c: Arc::clone(c),
            metrics: Arc::clone(metrics),
            request_id: request_id.to_string(),
            params: None,
            started_with_end: false,
            done: false,
        }
    }

    fn send(&self, event: ReportEvent, engine: Option<String>, params: Option<&str>, error: Option<&str>) {
        let kv_transfer_params = params.and_then(|p| RawValue::from_string(p.to_string()).ok());
        let ends = matches!(event, ReportEvent::Finished | ReportEvent::Failed);
        let folded = ends && self.started_with_end;
        // A coordinator older than the field refuses it: report the first output on its own.
        let decode_started = folded && self.c.decode_started_on_end.load(Relaxed);
        if folded && !decode_started {
            self.send(ReportEvent::DecodeStarted, Some(self.c.engine_id()), None, None);
        }
        self.c.report(
            &self.metrics,
            Report {
                request_id: self.request_id.clone(),
                event,
                engine,
                kv_transfer_params,
                error: error.map(String::from),
                decode_started,
            },
        );
    }

    /// The prefill holds the KV under `params` (so the coordinator can release it if this
    /// decode dies).
    pub fn prefill_done(&mut self, prefill_engine: Option<&str>, params: &str) {
        self.send(ReportEvent::PrefillDone, prefill_engine.map(String::from), Some(params), None);
        self.params = Some(params.to_string());
    }

    /// The decode produced its first output: the coordinator times the handoff (or the local
    /// prefill) by it. When that output is the whole answer (`with_end`), the request ends in
    /// the next moment and the final report carries the fact: one report instead of two, and
    /// none to arrive after the end (reports travel independently).
    pub fn decode_started(&mut self, with_end: bool) {
        if with_end {
            self.started_with_end = true;
        } else {
            self.send(ReportEvent::DecodeStarted, Some(self.c.engine_id()), None, None);
        }
    }

    /// Another sidecar owns the request now (it was redirected there): report nothing.
    pub fn disown(mut self) {
        self.done = true;
    }

    pub fn finished(mut self) {
        self.done = true;
        self.send(ReportEvent::Finished, Some(self.c.engine_id()), None, None);
    }

    pub fn failed(mut self, error: &str) {
        self.done = true;
        self.send(ReportEvent::Failed, Some(self.c.engine_id()), self.params.as_deref(), Some(error));
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if !self.done {
            self.send(ReportEvent::Failed, Some(self.c.engine_id()), self.params.as_deref(), Some("request dropped"));
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[test]
    fn decisions() {
        let d: PairDecision = serde_json::from_str(
            r#"{"request_id": "r", "decode": {"id": "d0", "engine_url": "http://d:1", "node": "n"},
                "prefill": {"id": "p0", "engine_url": "http://10.0.0.5:8100", "node": "n"},
                "decode_overlap_blocks": 0, "prefill_overlap_blocks": 3, "reason": "disaggregated"}"#,
        )
        .unwrap();
        let Pairing { prefill: Some(t), remote_decode: None, .. } = decision(d, "http", 8998, "d0") else { panic!() };
        assert_eq!(
            (t.base.as_str(), t.id.as_deref(), t.bootstrap_port),
            ("http://10.0.0.5:8100", Some("p0"), Some(8998))
        );
        let local: PairDecision = serde_json::from_str(
            r#"{"request_id": "r", "decode": {"id": "d0", "engine_url": "http://d:1", "node": "n"}, "prefill": null,
                "decode_overlap_blocks": 9, "prefill_overlap_blocks": 0, "reason": "local_prefill"}"#,
        )
        .unwrap();
        assert_eq!(decision(local, "http", 1, "d0"), Pairing { prefill: None, remote_decode: None, decode_rank: None });
        // Another decode chosen: its sidecar is where the request goes.
        let other: PairDecision = serde_json::from_str(
            r#"{"request_id": "r", "decode": {"id": "d1", "engine_url": "http://d:1", "sidecar_url": "http://d:8000/", "node": "n"},
                "prefill": null, "decode_overlap_blocks": 9, "prefill_overlap_blocks": 0, "reason": "local_prefill"}"#,
        )
        .unwrap();
        let p = decision(other, "http", 1, "d0");
        let r = p.remote_decode.unwrap();
        assert_eq!((p.prefill, r.id.as_str(), r.sidecar.unwrap().base.as_str()), (None, "d1", "http://d:8000"));
        let no_url: PairDecision = serde_json::from_str(
            r#"{"request_id": "r", "decode": {"id": "d1", "engine_url": "http://d:1", "node": "n"}, "prefill": null,
                "decode_overlap_blocks": 0, "prefill_overlap_blocks": 0, "reason": "local_prefill"}"#,
        )
        .unwrap();
        assert_eq!(
            decision(no_url, "http", 1, "d0").remote_decode,
            Some(RemoteDecode { id: "d1".into(), sidecar: None })
        );
    }

    #[test]
    fn the_view_keeps_live_prefills_but_our_own_engine() {
        let view = |id: &str, role: &str, alive: bool| {
            format!(
                r#"{{"id": "{id}", "role": "{role}", "node": "n", "model": "m", "engine_url": "http://{id}:1",
                    "block_size": 16, "alive": {alive}, "generation": 1, "origin": "registered", "indexed_blocks": 0}}"#
            )
        };
        let list = [
            view("a", "prefill", true),
            view("b", "decode", true),
            view("c", "both", false),
            view("d", "both", true),
            view("own", "both", true),
        ];
        let views: Vec<EngineView> = serde_json::from_str(&format!("[{}]", list.join(","))).unwrap();
        let targets = prefill_view(views, "own", "http", 8998);
        let ids: Vec<_> = targets.iter().map(|t| (t.id.as_deref().unwrap(), t.base.as_str())).collect();
        assert_eq!(ids, [("a", "http://a:1"), ("d", "http://d:1")]);
    }

    #[test]
    fn the_spec_sent_names_only_what_is_set() {
        let cfg = Config::try_parse_from([
            "pd-sidecar",
            "--engine",
            "http://127.0.0.1:8200",
            "--coordinator",
            "http://c:1",
            "--node",
            "n",
            "--role",
            "decode",
            "--model",
            "m",
            "--listen",
            "0.0.0.0:8000",
        ])
        .unwrap();
        let engine = Target::parse("http://127.0.0.1:8200", "http", None).unwrap();
        let c = Coordinator::new(&cfg, &engine).unwrap();
        assert_eq!(
            serde_json::to_string(c.spec()).unwrap(),
            r#"{"id":"n:8000","role":"decode","node":"n","model":"m","engine_url":"http://127.0.0.1:8200","block_size":16}"#
        );
    }
}
