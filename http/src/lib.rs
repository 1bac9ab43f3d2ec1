//! The HTTP edge the sidecar and the coordinator share: the accept loop ([`serve`], plain or
//! TLS, with a bounded graceful drain), their rustls configurations ([`tls`]) and bearer tokens
//! ([`Bearer`]).

mod bearer;
mod serve;
pub mod tls;

pub use bearer::{Bearer, BearerError};
pub use serve::serve;
