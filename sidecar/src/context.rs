//! The request context: what every part of the request path reads — the configuration (with the
//! bearer headers it implies), the upstream HTTP client and the metrics. Everything else a part
//! needs (engines, ids, the releaser, the coordinator link, the puller) is a handle of its own in
//! [`crate::App`], passed only to the parts that use it.

use std::sync::Arc;

use http::HeaderValue;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::upstream::HttpClient;

#[derive(Debug)]
pub struct Context {
    pub cfg: Config,
    /// Built from `cfg` once, not per request.
    pub auth: Auth,
    pub client: HttpClient,
    pub metrics: Arc<Metrics>,
}

/// The bearer headers the configuration implies.
#[derive(Debug)]
pub struct Auth {
    /// `Bearer <token>` clients must send.
    pub expected: Option<HeaderValue>,
    /// Authorization sent upstream instead of the client's.
    pub upstream: Option<HeaderValue>,
}

impl Context {
    pub fn new(cfg: Config, client: HttpClient) -> Context {
        let bearer = |t: &Option<String>| {
            t.as_ref().and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()).map(|mut v| {
                v.set_sensitive(true);
                v
            })
        };
        let auth = Auth { expected: bearer(&cfg.auth_token), upstream: bearer(&cfg.upstream_token) };
        Context { cfg, auth, client, metrics: Arc::new(Metrics::default()) }
    }
}
