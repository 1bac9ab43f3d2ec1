//! Every gRPC method once against the real daemon, with the same answers as the HTTP API.

mod common;

use common::{free_port, Coord, MODEL};
use pd_coordinator::api::grpc::proto::coordinator_client::CoordinatorClient;
use pd_coordinator::api::grpc::proto::{
    DeregisterRequest, Empty, EngineSpec, HeartbeatRequest, Load, NodeDownRequest, PairRequest, ReportEvent,
    ReportRequest, Role,
};
use tonic::Code;

fn spec(id: &str, role: Role) -> EngineSpec {
    EngineSpec {
        id: id.into(),
        role: role.into(),
        node: "n1".into(),
        model: MODEL.into(),
        engine_url: format!("http://127.0.0.1:{}", free_port()),
        sidecar_url: Some(format!("http://127.0.0.1:{}", free_port())),
        kv_events: None,
        kv_events_topic: None,
        replay: None,
        xfer_side_channel: Some("127.0.0.1:5600".into()),
        block_size: 16,
        capacity_blocks: Some(1024),
        data_parallel_size: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_grpc_method_once() {
    let coord = Coord::start(&["--health-interval-ms", "0"]).await;
    let mut client = CoordinatorClient::connect(format!("http://127.0.0.1:{}", coord.grpc)).await.unwrap();

    let reg = client.register(spec("d0", Role::Decode)).await.unwrap().into_inner();
    assert_eq!(
        (reg.engine.as_str(), reg.lease_ms, reg.heartbeat_ms, reg.decode_started_on_end),
        ("d0", 3000, 1000, true)
    );
    client.register(spec("p0", Role::Prefill)).await.unwrap();
    let mut bad = spec("x", Role::Unspecified);
    bad.role = 0;
    assert_eq!(client.register(bad).await.unwrap_err().code(), Code::InvalidArgument);

    // Absurd figures are accepted and clamped (they must not break the cost arithmetic).
    let huge = Load { active_decode_blocks: Some(u64::MAX), queued_prefill_blocks: Some(u64::MAX), ..Load::default() };
    client.heartbeat(HeartbeatRequest { engine: "p0".into(), load: Some(huge) }).await.unwrap();
    let load = Load { running: Some(2), active_decode_blocks: Some(10), ..Load::default() };
    let notices =
        client.heartbeat(HeartbeatRequest { engine: "d0".into(), load: Some(load) }).await.unwrap().into_inner();
    assert!(notices.dead_engines.is_empty() && notices.release.is_empty());

    let list = client.list_engines(Empty {}).await.unwrap().into_inner();
    assert_eq!(list.engines.len(), 2);
    let d0 = list.engines.iter().find(|e| e.spec.as_ref().unwrap().id == "d0").unwrap();
    assert!(d0.alive);
    assert_eq!(d0.load.unwrap().running, Some(2));
    assert_eq!(d0.spec.as_ref().unwrap().capacity_blocks, Some(1024));

    let pair = PairRequest {
        request_id: "r1".into(),
        model: MODEL.into(),
        token_ids: (0..640).collect(),
        ..PairRequest::default()
    };
    let d = client.pair(pair).await.unwrap().into_inner();
    assert_eq!(d.decode.as_ref().unwrap().id, "d0");
    assert_eq!(d.prefill.as_ref().unwrap().id, "p0");
    assert_eq!(d.reason, "disaggregated");
    let unknown = PairRequest { request_id: "r2".into(), model: "other".into(), ..PairRequest::default() };
    assert_eq!(client.pair(unknown).await.unwrap_err().code(), Code::Unavailable);
    // A message over 4 MiB (1.5 M token ids of 3 bytes each) is refused before it is decoded.
    let huge = PairRequest {
        request_id: "r3".into(),
        model: MODEL.into(),
        token_ids: vec![100_000; 1_500_000],
        ..PairRequest::default()
    };
    assert_eq!(client.pair(huge).await.unwrap_err().code(), Code::OutOfRange);

    let report = ReportRequest {
        request_id: "r1".into(),
        event: ReportEvent::PrefillDone.into(),
        engine: Some("p0".into()),
        kv_transfer_params: Some(r#"{"remote_request_id": "r1"}"#.into()),
        error: None,
        decode_started: false,
    };
    client.report(report).await.unwrap();
    let garbage = ReportRequest {
        request_id: "r1".into(),
        event: ReportEvent::Finished.into(),
        kv_transfer_params: Some("{not json".into()),
        ..ReportRequest::default()
    };
    assert_eq!(client.report(garbage).await.unwrap_err().code(), Code::InvalidArgument);

    let stats = client.index_stats(Empty {}).await.unwrap().into_inner();
    // The routed prompt is speculatively on both engines for a moment.
    let model = &stats.models[MODEL];
    assert_eq!(model.blocks, 40);
    assert_eq!(model.engines["d0"], 40);

    client.deregister(DeregisterRequest { engine: "d0".into() }).await.unwrap();
    let gone = client.heartbeat(HeartbeatRequest { engine: "d0".into(), load: None }).await.unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);
    // The prefill that held r1's blocks is told to free them (no sidecar answered the call).
    let mut dead = Vec::new();
    let notices = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            let n = client.heartbeat(HeartbeatRequest { engine: "p0".into(), load: None }).await.unwrap().into_inner();
            dead.extend(n.dead_engines.iter().cloned());
            if !n.release.is_empty() {
                return n;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("release notice within 5 s");
    assert_eq!(notices.release[0].request_id, "r1");
    assert_eq!(notices.release[0].prefill, "p0");
    assert_eq!(notices.release[0].kv_transfer_params, r#"{"remote_request_id": "r1"}"#);
    assert_eq!(dead, vec!["d0".to_string()]);

    // The node of both engines goes down: p0 (still live) leaves; unknown nodes are NOT_FOUND.
    let down = client.node_down(NodeDownRequest { node: "n1".into() }).await.unwrap().into_inner();
    assert_eq!((down.node.as_str(), down.engines), ("n1", vec!["p0".to_string()]));
    let unknown = client.node_down(NodeDownRequest { node: "nowhere".into() }).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    assert_eq!(coord.metric("pd_coordinator_engine_deaths_total{cause=\"node\"}").await, 1.0);
}

/// With --auth-token, gRPC calls need `authorization: Bearer <token>` metadata, as HTTP calls do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_need_the_bearer_token() {
    let coord = Coord::start(&["--health-interval-ms", "0", "--auth-token", "grpc-key"]).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{}", coord.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut anonymous = CoordinatorClient::new(channel.clone());
    let refused = anonymous.register(spec("d0", Role::Decode)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
    let with = |token: &'static str| {
        move |mut request: tonic::Request<()>| {
            request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
            Ok(request)
        }
    };
    let mut wrong = CoordinatorClient::with_interceptor(channel.clone(), with("other"));
    assert_eq!(wrong.list_engines(Empty {}).await.unwrap_err().code(), Code::Unauthenticated);
    let mut client = CoordinatorClient::with_interceptor(channel, with("grpc-key"));
    assert_eq!(client.register(spec("d0", Role::Decode)).await.unwrap().into_inner().engine, "d0");
    assert_eq!(client.list_engines(Empty {}).await.unwrap().into_inner().engines.len(), 1);
    let (status, _) = coord.get("/v1/engines").await;
    assert_eq!(status, 401, "HTTP is guarded by the same token");
}
