//! Why a step of an end-to-end suite failed: a missing setting, a process that would not start,
//! an answer that was not what the protocol says.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum E2eError {
    /// The suite cannot run here: a setting it needs is missing.
    #[error("{var} is not set")]
    Unset { var: &'static str },
    #[error("{var}={value}: {problem}")]
    BadSetting { var: &'static str, value: String, problem: &'static str },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} failed: {status}")]
    Failed { what: String, status: ExitStatus },
    #[error("{} not found after building", path.display())]
    NotBuilt { path: PathBuf },
    #[error("no free range of {count} ports from {wanted}")]
    NoFreePorts { wanted: u16, count: u16 },
    #[error("{name} exited during start; log tail:\n{log_tail}")]
    ExitedDuringStart { name: String, log_tail: String },
    /// `waited_for` says what did not come, e.g. "no /health".
    #[error("{name}: {waited_for} within {timeout:?}; log tail:\n{log_tail}")]
    NotReady { name: String, waited_for: String, timeout: Duration, log_tail: String },
    #[error("{what}: {source}")]
    Http {
        what: String,
        #[source]
        source: reqwest::Error,
    },
    /// An HTTP answer with a status other than the one the step needs.
    #[error("{what}: {status} {body}")]
    Status { what: String, status: u16, body: String },
    #[error("{what}: {source}")]
    Json {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    /// An answer that parsed but says something else than the protocol needs.
    #[error("{what}: {body}")]
    Answer { what: &'static str, body: String },
}

impl E2eError {
    pub fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> E2eError {
        let what = what.into();
        move |source| E2eError::Io { what, source }
    }

    pub fn json(what: impl Into<String>) -> impl FnOnce(serde_json::Error) -> E2eError {
        let what = what.into();
        move |source| E2eError::Json { what, source }
    }
}
