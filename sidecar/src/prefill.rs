//! The vLLM prefill leg: one non-streaming, one-token call per candidate through the leg
//! executor ([`crate::legs`]), and `kv_transfer_params` read out of the answer as raw JSON text.

use axum::body::Body;
use bytes::Bytes;
use http::{HeaderMap, Response};

use crate::errors::LegError;
use crate::json::Object;
use crate::legs::{Attempted, Legged, Legs};
use crate::metrics::{Attempt, Metrics};
use crate::target::Target;
use crate::upstream::{self, LegHeaders};

/// Largest prefill answer read (a one-token completion; logprobs can make it bigger).
const MAX_PREFILL_BODY: usize = 16 << 20;

/// How an answered prefill ended the leg.
#[derive(Debug)]
pub enum Prefilled {
    /// The prefill holds the KV; `params` is its `kv_transfer_params` exactly as sent.
    Params { params: String, target: Target },
    /// `kv_transfer_params: null` or absent (early stop, abort): nothing is held.
    NullParams { target: Target },
    /// A 4xx, returned to the client unchanged.
    ClientError(Response<Body>),
    /// An answer no other candidate is asked to improve on (another status, a bad body).
    Failed(LegError),
}

pub async fn run(
    legs: &Legs,
    candidates: &[Target],
    path: &str,
    client_headers: &HeaderMap,
    request_id: &str,
    body: Bytes,
) -> Legged<Prefilled> {
    let leg =
        LegHeaders { request_id, authorization: legs.ctx.upstream_authorization(), rewritten: true, identity: true };
    legs.run(candidates, |target| {
        // Built per attempt (hyper takes the map; another attempt is rare).
        let (mut headers, body) = (upstream::leg_headers(client_headers, leg, &[]), body.clone());
        // The client's rank header names a rank of the engine it addressed, not of this one.
        upstream::set_dp_rank(&mut headers, target.dp_rank);
        async move {
            match legs.attempt(target, path, headers, body, MAX_PREFILL_BODY).await {
                Attempted::Answer(bytes) => Ok(read_params(&legs.ctx.metrics, target, &bytes)),
                Attempted::Retry(failure) => Err(failure),
                Attempted::ClientError(r) => Ok(Prefilled::ClientError(r)),
                Attempted::Failed(e) => Ok(Prefilled::Failed(e)),
            }
        }
    })
    .await
}

/// The `kv_transfer_params` of a 2xx answer, verbatim (public for the fuzz target).
pub fn read_params(metrics: &Metrics, target: &Target, bytes: &[u8]) -> Prefilled {
    let bad_body = |reason: String| {
        metrics.attempt(Attempt::BadBody);
        Prefilled::Failed(LegError::PrefillBadBody { prefill: target.name().to_string(), reason })
    };
    let object = match Object::parse(bytes) {
        Ok(o) => o,
        Err(e) => return bad_body(e.to_string()),
    };
    match object.get("kv_transfer_params").map(|raw| raw.get()) {
        Some(raw) if raw.trim_start().starts_with('{') => {
            metrics.attempt(Attempt::Ok);
            Prefilled::Params { params: raw.to_string(), target: target.clone() }
        }
        Some(raw) if raw != "null" => bad_body("kv_transfer_params is not an object".into()),
        _ => {
            metrics.attempt(Attempt::NullParams);
            Prefilled::NullParams { target: target.clone() }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_read_verbatim_or_classified() {
        let metrics = Metrics::default();
        let target = Target::parse("p:1", "http", None).unwrap();
        let read = |body: &str| read_params(&metrics, &target, body.as_bytes());
        let Prefilled::Params { params, .. } =
            read(r#"{"id": "x", "kv_transfer_params": {"b": 1.00000000000000000001, "a": 2}}"#)
        else {
            panic!()
        };
        assert_eq!(params, r#"{"b": 1.00000000000000000001, "a": 2}"#);
        assert!(matches!(read(r#"{"kv_transfer_params": null}"#), Prefilled::NullParams { .. }));
        assert!(matches!(read(r#"{"choices": []}"#), Prefilled::NullParams { .. }));
        for bad in [r#"{"kv_transfer_params": "x"}"#, "not json", "[1]"] {
            assert!(matches!(read(bad), Prefilled::Failed(LegError::PrefillBadBody { .. })), "{bad}");
        }
        let counted = [Attempt::Ok, Attempt::NullParams, Attempt::BadBody].map(|a| metrics.attempts(a));
        assert_eq!(counted, [1, 2, 3]);
    }
}
