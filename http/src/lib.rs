//! The HTTP edge the sidecar and the coordinator share: the accept loop ([`serve`], plain or
//! TLS, with a bounded graceful drain), their rustls configurations ([`tls`]), bearer tokens
//! ([`Bearer`]) and the upstream client ([`client`]).

mod bearer;
pub mod client;
mod serve;
pub mod tls;

pub use bearer::{Bearer, BearerError};
pub use serve::serve;
