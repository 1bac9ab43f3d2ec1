//! The gRPC edge (tonic, package `pd.coordinator.v1`): one call per HTTP route, the same
//! operations on the same [`Coordinator`]. `kv_transfer_params` travels as JSON text.

use std::sync::Arc;

use pd_http::Bearer;
use serde_json::value::RawValue;
use tonic::service::interceptor::{InterceptedService, Interceptor};
use tonic::{Request, Response, Status};

use crate::api::{
    ApiError, Endpoint, EngineSpecJson, EngineView, LoadJson, PairDecisionJson, PairRequestJson, ReportEvent,
    ReportJson,
};
use crate::daemon::Coordinator;
use crate::membership::Role;

/// The generated messages, client and server.
#[allow(missing_debug_implementations, clippy::all)]
pub mod proto {
    tonic::include_proto!("pd.coordinator.v1");
}

use proto::coordinator_server::{Coordinator as CoordinatorRpc, CoordinatorServer};

/// The service, behind the bearer-token check when `--auth-token` is set (metadata
/// `authorization: Bearer <token>`, as on HTTP).
pub fn service(coordinator: Arc<Coordinator>) -> InterceptedService<CoordinatorServer<Service>, Authorize> {
    let token = coordinator.config.auth_token.clone();
    InterceptedService::new(CoordinatorServer::new(Service { coordinator }), Authorize(token))
}

#[derive(Clone, Debug)]
pub struct Authorize(Option<Bearer>);

impl Interceptor for Authorize {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.0 else { return Ok(request) };
        // tonic keeps HTTP/2 headers as metadata; the same check as the HTTP edge's.
        let headers = request.metadata().clone().into_headers();
        match token.admits(&headers) {
            true => Ok(request),
            false => Err(ApiError::Unauthorized.into()),
        }
    }
}

#[derive(Debug)]
pub struct Service {
    coordinator: Arc<Coordinator>,
}

impl From<ApiError> for Status {
    fn from(err: ApiError) -> Status {
        match err {
            ApiError::BadRequest(m) => Status::invalid_argument(m),
            ApiError::NotFound(m) => Status::not_found(m),
            ApiError::TooLarge(_) => Status::out_of_range(err.to_string()),
            ApiError::Unauthorized => Status::unauthenticated(ApiError::Unauthorized.to_string()),
            ApiError::Unavailable(m) => Status::unavailable(m),
            ApiError::Internal(m) => Status::internal(m),
        }
    }
}

fn bad(message: impl Into<String>) -> Status {
    Status::invalid_argument(message)
}

impl TryFrom<proto::EngineSpec> for EngineSpecJson {
    type Error = Status;

    fn try_from(spec: proto::EngineSpec) -> Result<EngineSpecJson, Status> {
        let role = match proto::Role::try_from(spec.role) {
            Ok(proto::Role::Prefill) => Role::Prefill,
            Ok(proto::Role::Decode) => Role::Decode,
            Ok(proto::Role::Both) => Role::Both,
            Ok(proto::Role::Unspecified) | Err(_) => return Err(bad("'role' must be PREFILL, DECODE or BOTH")),
        };
        Ok(EngineSpecJson {
            id: spec.id,
            role,
            node: spec.node,
            model: spec.model,
            engine_url: spec.engine_url,
            sidecar_url: spec.sidecar_url,
            kv_events: spec.kv_events,
            kv_events_topic: spec.kv_events_topic,
            replay: spec.replay,
            xfer_side_channel: spec.xfer_side_channel,
            block_size: spec.block_size,
            capacity_blocks: spec.capacity_blocks,
            data_parallel_size: spec.data_parallel_size,
        })
    }
}

impl From<EngineSpecJson> for proto::EngineSpec {
    fn from(spec: EngineSpecJson) -> proto::EngineSpec {
        let role = match spec.role {
            Role::Prefill => proto::Role::Prefill,
            Role::Decode => proto::Role::Decode,
            Role::Both => proto::Role::Both,
        };
        proto::EngineSpec {
            id: spec.id,
            role: role.into(),
            node: spec.node,
            model: spec.model,
            engine_url: spec.engine_url,
            sidecar_url: spec.sidecar_url,
            kv_events: spec.kv_events,
            kv_events_topic: spec.kv_events_topic,
            replay: spec.replay,
            xfer_side_channel: spec.xfer_side_channel,
            block_size: spec.block_size,
            capacity_blocks: spec.capacity_blocks,
            data_parallel_size: spec.data_parallel_size,
        }
    }
}

impl From<proto::Load> for LoadJson {
    fn from(l: proto::Load) -> LoadJson {
        LoadJson {
            running: l.running,
            waiting: l.waiting,
            kv_usage: l.kv_usage,
            active_decode_blocks: l.active_decode_blocks,
            queued_prefill_blocks: l.queued_prefill_blocks,
        }
    }
}

impl From<LoadJson> for proto::Load {
    fn from(l: LoadJson) -> proto::Load {
        proto::Load {
            running: l.running,
            waiting: l.waiting,
            kv_usage: l.kv_usage,
            active_decode_blocks: l.active_decode_blocks,
            queued_prefill_blocks: l.queued_prefill_blocks,
        }
    }
}

impl From<Endpoint> for proto::Endpoint {
    fn from(e: Endpoint) -> proto::Endpoint {
        proto::Endpoint { id: e.id, engine_url: e.engine_url, sidecar_url: e.sidecar_url, node: e.node }
    }
}

impl From<PairDecisionJson> for proto::PairDecision {
    fn from(d: PairDecisionJson) -> proto::PairDecision {
        proto::PairDecision {
            request_id: d.request_id,
            decode: Some(d.decode.into()),
            prefill: d.prefill.map(Into::into),
            decode_overlap_blocks: d.decode_overlap_blocks,
            prefill_overlap_blocks: d.prefill_overlap_blocks,
            reason: d.reason.as_str().into(),
            decode_dp_rank: d.decode_dp_rank,
            prefill_dp_rank: d.prefill_dp_rank,
        }
    }
}

impl From<EngineView> for proto::EngineView {
    fn from(v: EngineView) -> proto::EngineView {
        proto::EngineView {
            spec: Some(v.spec.into()),
            alive: v.alive,
            generation: v.generation,
            origin: v.origin.as_str().into(),
            load: v.load.map(Into::into),
            indexed_blocks: v.indexed_blocks,
        }
    }
}

fn raw_json(text: String) -> Result<Box<RawValue>, Status> {
    RawValue::from_string(text).map_err(|e| bad(format!("'kv_transfer_params' is not JSON: {e}")))
}

#[tonic::async_trait]
impl CoordinatorRpc for Service {
    async fn register(&self, request: Request<proto::EngineSpec>) -> Result<Response<proto::Registration>, Status> {
        let spec = EngineSpecJson::try_from(request.into_inner())?;
        let r = self.coordinator.register(spec).await?;
        Ok(Response::new(proto::Registration {
            engine: r.engine,
            lease_ms: r.lease_ms,
            heartbeat_ms: r.heartbeat_ms,
            decode_started_on_end: r.decode_started_on_end,
        }))
    }

    async fn heartbeat(&self, request: Request<proto::HeartbeatRequest>) -> Result<Response<proto::Notices>, Status> {
        let request = request.into_inner();
        let notices = self.coordinator.heartbeat(&request.engine, request.load.map(Into::into)).await?;
        Ok(Response::new(proto::Notices {
            dead_engines: notices.dead_engines,
            release: notices
                .release
                .into_iter()
                .map(|r| proto::Release {
                    request_id: r.request_id,
                    prefill: r.prefill,
                    kv_transfer_params: r.kv_transfer_params.get().to_string(),
                })
                .collect(),
        }))
    }

    async fn deregister(&self, request: Request<proto::DeregisterRequest>) -> Result<Response<proto::Empty>, Status> {
        self.coordinator.deregister(&request.into_inner().engine).await?;
        Ok(Response::new(proto::Empty {}))
    }

    async fn node_down(
        &self,
        request: Request<proto::NodeDownRequest>,
    ) -> Result<Response<proto::NodeDownReply>, Status> {
        let down = self.coordinator.node_down(&request.into_inner().node).await?;
        Ok(Response::new(proto::NodeDownReply { node: down.node, engines: down.engines }))
    }

    async fn list_engines(&self, _: Request<proto::Empty>) -> Result<Response<proto::EngineList>, Status> {
        let engines = self.coordinator.list().into_iter().map(Into::into).collect();
        Ok(Response::new(proto::EngineList { engines }))
    }

    async fn pair(&self, request: Request<proto::PairRequest>) -> Result<Response<proto::PairDecision>, Status> {
        let r = request.into_inner();
        let req = PairRequestJson {
            request_id: r.request_id,
            model: r.model,
            token_ids: (!r.token_ids.is_empty()).then_some(r.token_ids),
            prompt: r.prompt,
            prompt_tokens: r.prompt_tokens,
            local_engine: r.local_engine,
            lora_name: r.lora_name,
        };
        Ok(Response::new(self.coordinator.pair_without_blocking(req).await?.into()))
    }

    async fn report(&self, request: Request<proto::ReportRequest>) -> Result<Response<proto::Empty>, Status> {
        let r = request.into_inner();
        let event = match proto::ReportEvent::try_from(r.event) {
            Ok(proto::ReportEvent::PrefillDone) => ReportEvent::PrefillDone,
            Ok(proto::ReportEvent::DecodeStarted) => ReportEvent::DecodeStarted,
            Ok(proto::ReportEvent::Finished) => ReportEvent::Finished,
            Ok(proto::ReportEvent::Failed) => ReportEvent::Failed,
            Ok(proto::ReportEvent::Unspecified) | Err(_) => {
                return Err(bad("'event' must be PREFILL_DONE, DECODE_STARTED, FINISHED or FAILED"))
            }
        };
        let report = ReportJson {
            request_id: r.request_id,
            event,
            engine: r.engine,
            kv_transfer_params: r.kv_transfer_params.map(raw_json).transpose()?,
            error: r.error,
            decode_started: r.decode_started,
        };
        self.coordinator.report(report)?;
        Ok(Response::new(proto::Empty {}))
    }

    async fn index_stats(&self, _: Request<proto::Empty>) -> Result<Response<proto::IndexStatsReply>, Status> {
        let stats = self.coordinator.index_stats();
        let models = stats
            .models
            .into_iter()
            .map(|(model, s)| {
                (
                    model,
                    proto::ModelStats {
                        blocks: s.blocks,
                        entries: s.entries,
                        engines: s.engines.into_iter().collect(),
                    },
                )
            })
            .collect();
        Ok(Response::new(proto::IndexStatsReply { models }))
    }
}
