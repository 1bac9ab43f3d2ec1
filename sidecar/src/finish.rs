//! A request's end, recorded exactly once: its outcome and end-to-end latency in the metrics,
//! its report to the coordinator, and the prefill's held blocks freed unless the decode used
//! them. Created when the request arrives and carried to wherever it ends; dropped unsettled
//! (the client left, a task was cancelled) it counts as cancelled, reports `failed` and frees
//! the blocks — each part by its own guard.

use axum::body::Body;
use http::Response;

use std::sync::Arc;

use crate::coordinator::{Coordinator, Reporter};
use crate::errors::{ApiError, LegError};
use crate::metrics::{Metrics, Outcome, Tracker};
use crate::release::ReleaseGuard;

#[derive(Debug)]
pub struct Finish {
    tracker: Tracker,
    reporter: Option<Reporter>,
    release: Option<ReleaseGuard>,
}

impl Finish {
    pub fn new(metrics: &Arc<Metrics>, coordinator: Option<&Arc<Coordinator>>, request_id: &str) -> Finish {
        let reporter = coordinator.map(|c| Reporter::new(c, metrics, request_id));
        Finish { tracker: Tracker::new(metrics), reporter, release: None }
    }

    /// The prefill holds the KV under `params` (the coordinator can free it if this decode dies).
    pub fn prefill_done(&mut self, prefill_engine: Option<&str>, params: &str) {
        if let Some(r) = &mut self.reporter {
            r.prefill_done(prefill_engine, params);
        }
    }

    /// What to free if the request ends before the decode took the blocks (replaces any earlier
    /// guard, which frees its own blocks as it drops).
    pub fn hold(&mut self, guard: ReleaseGuard) {
        self.release = Some(guard);
    }

    /// The decode produced output, so the engine has the KV: nothing to free.
    pub fn blocks_taken(&mut self) {
        if let Some(g) = self.release.as_mut() {
            g.disarm();
        }
    }

    /// The decode's first output arrived; `with_end`: it is the whole answer.
    pub fn decode_started(&mut self, with_end: bool) {
        if let Some(r) = &mut self.reporter {
            r.decode_started(with_end);
        }
    }

    /// The decode will not use the blocks: free them now.
    pub fn release_now(&mut self) {
        self.release = None;
    }

    /// Another sidecar owns the request (it was redirected there) and reports on it.
    pub fn disown(&mut self) {
        if let Some(r) = self.reporter.take() {
            r.disown();
        }
    }

    /// Ends the request with `outcome`; `error` says what went wrong (for the report).
    pub fn end(mut self, outcome: Outcome, error: Option<&str>) {
        if let Some(r) = self.reporter.take() {
            match error {
                None if outcome == Outcome::Ok => r.finished(),
                None => r.failed(&format!("decode answered {outcome:?}")),
                Some(e) => r.failed(e),
            }
        }
        self.release = None;
        self.tracker.finish(outcome);
    }

    /// Ends the request with the sidecar's own error answer.
    pub fn fail(self, error: &ApiError) -> Response<Body> {
        tracing::warn!(status = %error.status, error = %error.message, "request failed");
        self.end(error.outcome(), Some(&error.message));
        error.response()
    }

    /// Ends the request with a leg's error, as HTTP.
    pub fn leg_failed(self, error: &LegError) -> Response<Body> {
        self.fail(&error.into())
    }

    /// Ends the request with the prefill's 4xx, returned to the client unchanged.
    pub fn client_error(self, response: Response<Body>) -> Response<Body> {
        self.end(Outcome::ClientError, Some(&format!("prefill answered {}", response.status())));
        response
    }

    /// The client went away: counted as cancelled, reported `failed` with `why`.
    pub fn cancel(mut self, why: &str) {
        if let Some(r) = self.reporter.take() {
            r.failed(why);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering::Relaxed;

    use http::StatusCode;

    use super::*;

    #[test]
    fn every_end_is_recorded_once() {
        let m = &Arc::new(Metrics::default());
        Finish::new(m, None, "a").end(Outcome::Ok, None);
        let failed = Finish::new(m, None, "b").fail(&ApiError::gateway_timeout("late"));
        assert_eq!(failed.status(), StatusCode::GATEWAY_TIMEOUT);
        let mut four = Response::new(Body::empty());
        *four.status_mut() = StatusCode::BAD_REQUEST;
        assert_eq!(Finish::new(m, None, "c").client_error(four).status(), StatusCode::BAD_REQUEST);
        Finish::new(m, None, "d").cancel("client disconnected");
        let dropped = Finish::new(m, None, "e");
        assert_eq!(m.in_flight.load(Relaxed), 1);
        drop(dropped);
        assert_eq!(m.in_flight.load(Relaxed), 0);
        let counts = [Outcome::Ok, Outcome::Timeout, Outcome::ClientError, Outcome::Cancelled].map(|o| m.requests(o));
        assert_eq!(counts, [1, 1, 1, 2]);
    }
}
