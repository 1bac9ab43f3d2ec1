//! The request context: what every part of the request path reads — the configuration, the
//! upstream HTTP client and the metrics. Everything else a part
//! needs (engines, ids, the releaser, the coordinator link, the puller) is a handle of its own in
//! [`crate::App`], passed only to the parts that use it.

use std::sync::Arc;

use http::HeaderValue;
use pd_http::Bearer;

use crate::config::Config;
use crate::metrics::Metrics;
use crate::upstream::HttpClient;

#[derive(Debug)]
pub struct Context {
    pub cfg: Config,
    pub client: HttpClient,
    pub metrics: Arc<Metrics>,
}

impl Context {
    pub fn new(cfg: Config, client: HttpClient) -> Context {
        Context { cfg, client, metrics: Arc::new(Metrics::default()) }
    }

    /// The Authorization sent upstream instead of the client's (`--upstream-token`).
    pub fn upstream_authorization(&self) -> Option<&HeaderValue> {
        self.cfg.upstream_token.as_ref().map(Bearer::header)
    }
}
