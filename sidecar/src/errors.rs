//! Errors of each leg (`thiserror`), and the one place they become HTTP: OpenAI-style JSON
//! `{"error": {"message", "type", "param", "code"}}` as vLLM writes it.

use axum::body::Body;
use http::{header, Response, StatusCode};
use serde::Serialize;

use crate::handoff::PrefillExhausted;
use crate::metrics::Outcome;

/// What can go wrong talking to an upstream (engine, prefill, coordinator).
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("cannot connect to {target}: {reason}")]
    Connect { target: String, reason: String },
    #[error("{target} did not answer within {secs:.3} s")]
    Timeout { target: String, secs: f64 },
    #[error("{target}: {reason}")]
    Io { target: String, reason: String },
    #[error("{target}: response body larger than {limit} bytes")]
    TooLarge { target: String, limit: usize },
}

impl UpstreamError {
    /// Whether nothing reached the upstream (a retry elsewhere is always safe).
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. })
    }
}

/// Why a request's legs ended without an answer to relay.
#[derive(Debug, thiserror::Error)]
pub enum LegError {
    #[error("prefill {prefill} answered {status}{}", with_detail(.detail))]
    PrefillStatus { prefill: String, status: StatusCode, detail: String },
    #[error("prefill {prefill} answered a body that is not JSON: {reason}")]
    PrefillBadBody { prefill: String, reason: String },
    #[error("prefill {prefill} returned no kv_transfer_params (the request stopped early or was aborted)")]
    NullParams { prefill: String },
    #[error(transparent)]
    Exhausted(#[from] PrefillExhausted),
    #[error("no prefill engine is configured or alive")]
    NoCandidate,
    /// A local decision for an engine that cannot compute prompts (SGLang started with
    /// `--disaggregation-mode decode`), with no prefill to run instead.
    #[error("the local engine only decodes (SGLang --disaggregation-mode decode) and no prefill engine is configured or alive (decided: {decided:?})")]
    NoPrefillForDecodeOnly { decided: crate::metrics::LocalReason },
    #[error("prefill task: {0}")]
    PrefillTask(#[from] tokio::task::JoinError),
    #[error("the decode response did not complete")]
    DecodeIncomplete,
    #[error("the decode engine is unavailable{}", with_detail(.0))]
    DecodeUnavailable(String),
    #[error("the decode engine did not answer within {secs:.3} s: {source}")]
    DecodeTimeout { secs: f64, source: UpstreamError },
    #[error("the decode engine failed: {0}")]
    DecodeFailed(UpstreamError),
    /// `what` (the decode engine, a redirect's sidecar) sent no body within the limit.
    #[error("{what} sent no output within {secs:.3} s")]
    NoOutput { what: String, secs: f64 },
    #[error("{what} broke off its response: {reason}")]
    BrokeOff { what: String, reason: String },
    #[error("the decode stream was idle for {secs:.3} s")]
    StreamIdle { secs: f64 },
}

fn with_detail(detail: &str) -> String {
    if detail.is_empty() {
        String::new()
    } else {
        format!(": {detail}")
    }
}

/// The one place a leg's error becomes the client's HTTP error.
impl From<&LegError> for ApiError {
    fn from(e: &LegError) -> ApiError {
        let status = match e {
            LegError::Exhausted(PrefillExhausted::NothingReachable { .. })
            | LegError::NoCandidate
            | LegError::NoPrefillForDecodeOnly { .. }
            | LegError::DecodeUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            LegError::DecodeTimeout { .. } | LegError::NoOutput { .. } | LegError::StreamIdle { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            LegError::PrefillStatus { .. }
            | LegError::PrefillBadBody { .. }
            | LegError::NullParams { .. }
            | LegError::Exhausted(PrefillExhausted::AllFailed { .. })
            | LegError::PrefillTask(_)
            | LegError::DecodeIncomplete
            | LegError::DecodeFailed(_)
            | LegError::BrokeOff { .. } => StatusCode::BAD_GATEWAY,
        };
        ApiError::new(status, e.to_string())
    }
}

/// An error answered to the client by the sidecar itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into() }
    }

    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn gateway_timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, message)
    }

    fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            413 => "RequestTooLargeError",
            502 => "BadGatewayError",
            503 => "ServiceUnavailableError",
            504 => "GatewayTimeoutError",
            _ => "InternalServerError",
        }
    }

    /// The outcome a request answered with this error counts as.
    pub fn outcome(&self) -> Outcome {
        match self.status.as_u16() {
            401 => Outcome::Unauthorized,
            504 => Outcome::Timeout,
            502 => Outcome::PrefillFailed,
            503 => Outcome::DecodeUnavailable,
            400..=499 => Outcome::ClientError,
            _ => Outcome::EngineError,
        }
    }

    pub fn body(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Fields<'a> {
            message: &'a str,
            #[serde(rename = "type")]
            kind: &'a str,
            param: Option<&'a str>,
            code: u16,
        }
        #[derive(Serialize)]
        struct Envelope<'a> {
            error: Fields<'a>,
        }
        serde_json::to_vec(&Envelope {
            error: Fields { message: &self.message, kind: self.kind(), param: None, code: self.status.as_u16() },
        })
        .expect("serialising an error cannot fail")
    }

    pub fn response(&self) -> Response<Body> {
        let mut r = Response::new(Body::from(self.body()));
        *r.status_mut() = self.status;
        r.headers_mut().insert(header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, http::HeaderValue::from_static("Bearer"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openai_shape() {
        let e = ApiError::unavailable("decode engine down");
        let v: serde_json::Value = serde_json::from_slice(&e.body()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "decode engine down", "type": "ServiceUnavailableError", "param": null, "code": 503}})
        );
        assert_eq!(e.response().status(), 503);
        assert_eq!(ApiError::gateway_timeout("x").outcome(), Outcome::Timeout);
        assert_eq!(ApiError::new(StatusCode::UNAUTHORIZED, "x").response().headers()["www-authenticate"], "Bearer");
    }

    #[test]
    fn leg_errors_map_to_statuses() {
        let exhausted = |e| LegError::Exhausted(e);
        let cases = [
            (exhausted(PrefillExhausted::NothingReachable { tried: 2, last: "x".into() }), 503),
            (exhausted(PrefillExhausted::AllFailed { tried: 2, last: "x".into() }), 502),
            (LegError::NoCandidate, 503),
            (LegError::NoPrefillForDecodeOnly { decided: crate::metrics::LocalReason::Threshold }, 503),
            (LegError::NullParams { prefill: "p".into() }, 502),
            (LegError::PrefillBadBody { prefill: "p".into(), reason: "x".into() }, 502),
            (LegError::DecodeIncomplete, 502),
            (LegError::DecodeUnavailable(String::new()), 503),
            (LegError::NoOutput { what: "the decode engine".into(), secs: 1.0 }, 504),
            (LegError::StreamIdle { secs: 1.0 }, 504),
            (LegError::BrokeOff { what: "x".into(), reason: "y".into() }, 502),
        ];
        for (e, status) in cases {
            assert_eq!(ApiError::from(&e).status.as_u16(), status, "{e}");
        }
        let e = LegError::PrefillStatus {
            prefill: "p".into(),
            status: StatusCode::INTERNAL_SERVER_ERROR,
            detail: "boom".into(),
        };
        assert_eq!(ApiError::from(&e).message, "prefill p answered 500 Internal Server Error: boom");
        let e = LegError::PrefillStatus {
            prefill: "p".into(),
            status: StatusCode::INTERNAL_SERVER_ERROR,
            detail: String::new(),
        };
        assert_eq!(e.to_string(), "prefill p answered 500 Internal Server Error");
    }
}
