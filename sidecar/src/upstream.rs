//! The HTTP client towards engines, prefills and the coordinator ([`pd_http::client`]: pooled
//! keep-alive connections, optional rustls), and the header rules of each leg.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Limited};
/// An engine's response body, read as it is polled.
pub use pd_http::client::Body as UpstreamBody;
use pd_http::client::{Client, ClientConfig};

use crate::errors::UpstreamError;
use crate::target::Target;

pub type HttpClient = Client;

/// The header naming the prefill chosen by an upstream router (llm-d convention).
pub const ROUTING_HEADER: &str = "x-prefiller-host-port";
pub const REQUEST_ID: &str = "x-request-id";
/// Set by a sidecar that hands a request to the decode engine's sidecar the coordinator chose:
/// `prefill` (the prefill is named in [`ROUTING_HEADER`]) or `local` (decode without a prefill
/// leg). A request carrying it is never paired or redirected again.
pub const REDIRECT_HEADER: &str = "x-pd-redirected";
/// vLLM's data-parallel rank header ([`pd_api::DATA_PARALLEL_RANK_HEADER`]). The sidecar owns
/// it on its legs: it carries the rank the coordinator named for that leg's engine, and a
/// client's own reaches only the engine the client addressed (the local decode).
pub const DP_RANK_HEADER: &str = pd_api::DATA_PARALLEL_RANK_HEADER;
/// On a redirect: the data-parallel rank of the prefill named in [`ROUTING_HEADER`].
pub const PREFILL_DP_RANK_HEADER: &str = "x-pd-prefill-dp-rank";

/// Sets (or, with `None`, removes) the data-parallel rank of a leg's headers.
pub fn set_dp_rank(headers: &mut HeaderMap, rank: Option<u32>) {
    let name = HeaderName::from_static(DP_RANK_HEADER);
    match rank {
        Some(rank) => {
            headers.insert(name, HeaderValue::from(rank));
        }
        None => {
            headers.remove(name);
        }
    }
}

pub fn client(connect_timeout: Duration, tls: rustls::ClientConfig) -> HttpClient {
    Client::new(ClientConfig {
        connect_timeout,
        tcp_keepalive: Some(Duration::from_secs(30)),
        idle_timeout: Duration::from_secs(60),
        max_idle_per_origin: 4096,
        tls: std::sync::Arc::new(tls),
    })
}

/// Sends `req`, waiting at most `timeout` for the response head.
pub async fn send(
    client: &HttpClient,
    target: &Target,
    req: Request<Body>,
    timeout: Duration,
) -> Result<Response<UpstreamBody>, UpstreamError> {
    match tokio::time::timeout(timeout, client.request(req)).await {
        Err(_) => Err(UpstreamError::Timeout { target: target.base.clone(), secs: timeout.as_secs_f64() }),
        Ok(Ok(r)) => Ok(r),
        Ok(Err(e)) if e.is_connect() => {
            Err(UpstreamError::Connect { target: target.base.clone(), reason: e.to_string() })
        }
        Ok(Err(e)) => Err(UpstreamError::Io { target: target.base.clone(), reason: e.to_string() }),
    }
}

/// Reads a whole (small) response body, bounded in size and time.
pub async fn collect(
    target: &Target,
    body: UpstreamBody,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, UpstreamError> {
    match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Err(_) => Err(UpstreamError::Timeout { target: target.base.clone(), secs: timeout.as_secs_f64() }),
        Ok(Ok(c)) => Ok(c.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() => {
            Err(UpstreamError::TooLarge { target: target.base.clone(), limit })
        }
        Ok(Err(e)) => Err(UpstreamError::Io { target: target.base.clone(), reason: e.to_string() }),
    }
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
}

/// How a leg's request headers are derived from the client's.
#[derive(Debug, Clone, Copy)]
pub struct LegHeaders<'a> {
    pub request_id: &'a str,
    /// Replaces the client's Authorization (`--upstream-token`).
    pub authorization: Option<&'a HeaderValue>,
    /// The body was rewritten: drop the client's content-length (hyper sets it).
    pub rewritten: bool,
    /// The sidecar reads this response: ask for it uncompressed.
    pub identity: bool,
}

/// The client's headers minus hop-by-hop headers, `host`, routing and redirect headers and anything in
/// `strip`, with the request id (and authorization) set.
pub fn leg_headers(client: &HeaderMap, leg: LegHeaders<'_>, strip: &[HeaderName]) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(client.len() + 2);
    for (name, value) in client {
        if is_hop_by_hop(name)
            || name == header::HOST
            || name == header::EXPECT
            || name.as_str() == ROUTING_HEADER
            || name.as_str() == REDIRECT_HEADER
            || name.as_str() == PREFILL_DP_RANK_HEADER
            || name.as_str() == REQUEST_ID
            || strip.contains(name)
            || (leg.rewritten && name == header::CONTENT_LENGTH)
            || (leg.identity && name == header::ACCEPT_ENCODING)
            || (leg.authorization.is_some() && name == header::AUTHORIZATION)
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    if let Ok(v) = HeaderValue::from_str(leg.request_id) {
        out.insert(HeaderName::from_static(REQUEST_ID), v);
    }
    if let Some(auth) = leg.authorization {
        out.insert(header::AUTHORIZATION, auth.clone());
    }
    if leg.rewritten {
        out.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    out
}

/// A POST of `body` to `target` at `path`.
pub fn post(target: &Target, path: &str, headers: HeaderMap, body: impl Into<Body>) -> Request<Body> {
    let mut req = Request::new(body.into());
    *req.method_mut() = Method::POST;
    *req.uri_mut() = target.url(path).parse().expect("a target URL with a path is a valid URI");
    *req.headers_mut() = headers;
    req
}

/// A bare JSON request (coordinator, engine admin calls).
pub fn json_request(method: Method, url: &str, body: Option<Vec<u8>>) -> Result<Request<Body>, http::Error> {
    let mut b = Request::builder().method(method).uri(url);
    if body.is_some() {
        b = b.header(header::CONTENT_TYPE, "application/json");
    }
    b.body(body.map_or_else(Body::empty, Body::from))
}

/// The engine's response headers as the client gets them (hop-by-hop headers removed).
pub fn response_headers(upstream: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        if !is_hop_by_hop(name) {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leg_headers_strip_and_set() {
        let mut h = HeaderMap::new();
        h.insert("host", "sidecar:8000".parse().unwrap());
        h.insert("connection", "keep-alive".parse().unwrap());
        h.insert(ROUTING_HEADER, "evil:80".parse().unwrap());
        h.insert(REDIRECT_HEADER, "local".parse().unwrap());
        h.insert("x-request-id", "client-id".parse().unwrap());
        h.insert("content-length", "10".parse().unwrap());
        h.insert("accept-encoding", "gzip".parse().unwrap());
        h.insert("authorization", "Bearer client".parse().unwrap());
        h.insert("x-custom", "kept".parse().unwrap());
        let up = HeaderValue::from_static("Bearer upstream");
        let out = leg_headers(
            &h,
            LegHeaders { request_id: "rid", authorization: Some(&up), rewritten: true, identity: true },
            &[],
        );
        assert_eq!(out.get("x-request-id").unwrap(), "rid");
        assert_eq!(out.get("authorization").unwrap(), "Bearer upstream");
        assert_eq!(out.get("x-custom").unwrap(), "kept");
        assert_eq!(out.get("content-type").unwrap(), "application/json");
        for gone in ["host", "connection", ROUTING_HEADER, REDIRECT_HEADER, "content-length", "accept-encoding"] {
            assert!(out.get(gone).is_none(), "{gone}");
        }
        let out = leg_headers(
            &h,
            LegHeaders { request_id: "rid", authorization: None, rewritten: false, identity: false },
            &[HeaderName::from_static("x-custom")],
        );
        assert_eq!(out.get("authorization").unwrap(), "Bearer client");
        assert_eq!(out.get("content-length").unwrap(), "10");
        assert!(out.get("x-custom").is_none());
    }
}
