//! The backend's parameters: UCX settings passed through to `ucp_config_modify`, and our own
//! tunables. Pure parsing, so it is tested without UCX.

use std::time::Duration;

use xfer_core::{BackendError, BackendParams};

/// Parameter prefix that passes any UCX setting through: `ucx_rndv_thresh=inf` sets
/// `UCX_RNDV_THRESH`.
pub const PASSTHROUGH_PREFIX: &str = "ucx_";

/// Separates list items inside a UCX value (`tls=posix+cma+self`), since commas separate the
/// parameters themselves.
pub const LIST_SEPARATOR: char = '+';

/// How endpoints handle a failed peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorMode {
    /// UCX's peer mode: a dead peer fails its requests at once. Needs transports that detect
    /// peer failure (tcp, rc, ud, dc do; UCX 1.13's posix shared memory does not).
    Peer,
    /// No UCX error handling: requests to a dead peer end by `timeout_ms`.
    None,
    /// Peer mode where the transports support it, else none.
    Auto,
}

/// Checked settings of one backend instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `(UCX option name without the UCX_ prefix, value)`, applied in order over the
    /// environment's configuration.
    pub ucx: Vec<(String, String)>,
    /// No completion of any operation to a peer for this long fails its requests.
    pub timeout: Duration,
    /// After the last event, the progress thread polls this long before it sleeps.
    pub spin: Duration,
    /// Descriptors longer than this are moved as several operations, so progress (and a
    /// stall) is visible per piece.
    pub max_op_bytes: u64,
    pub error_mode: ErrorMode,
}

fn invalid(name: &str, reason: impl Into<String>) -> BackendError {
    BackendError::InvalidParam { name: name.into(), reason: reason.into() }
}

impl Settings {
    pub fn parse(mut params: BackendParams) -> Result<Settings, BackendError> {
        let mut ucx = Vec::new();
        for (key, option) in [("tls", "TLS"), ("net_devices", "NET_DEVICES")] {
            if let Some(value) = params.take(key) {
                ucx.push((option.to_string(), value.replace(LIST_SEPARATOR, ",")));
            }
        }
        for (key, value) in params.take_prefixed(PASSTHROUGH_PREFIX) {
            let option = key[PASSTHROUGH_PREFIX.len()..].to_ascii_uppercase();
            if option.is_empty() || !option.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(invalid(&key, "expected ucx_<UCX option name>"));
            }
            ucx.push((option, value.replace(LIST_SEPARATOR, ",")));
        }
        let timeout = params.take_millis("timeout_ms", Duration::from_secs(5))?;
        let spin = Duration::from_micros(params.take_parsed("spin_us", 2000u64)?);
        let max_op_bytes: u64 = params.take_parsed("max_op_bytes", 64 << 20)?;
        let error_mode = match params.take("error_mode").as_deref() {
            None | Some("auto") => ErrorMode::Auto,
            Some("peer") => ErrorMode::Peer,
            Some("none") => ErrorMode::None,
            Some(other) => return Err(invalid("error_mode", format!("{other:?}: expected peer, none or auto"))),
        };
        params.finish("ucx")?;
        if timeout.is_zero() {
            return Err(invalid("timeout_ms", "must be positive"));
        }
        if max_op_bytes < 4096 {
            return Err(invalid("max_op_bytes", "must be at least 4096"));
        }
        Ok(Settings { ucx, timeout, spin, max_op_bytes, error_mode })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_ucx_settings_and_rejects_unknown_keys() {
        let params = BackendParams::parse("tls=rc+tcp,net_devices=lo,ucx_rndv_thresh=inf,timeout_ms=250").unwrap();
        let s = Settings::parse(params).unwrap();
        assert_eq!(
            s.ucx,
            vec![
                ("TLS".to_string(), "rc,tcp".to_string()),
                ("NET_DEVICES".to_string(), "lo".to_string()),
                ("RNDV_THRESH".to_string(), "inf".to_string())
            ]
        );
        assert_eq!(s.timeout, Duration::from_millis(250));
        assert_eq!(s.max_op_bytes, 64 << 20);
        let err = Settings::parse(BackendParams::parse("tsl=tcp").unwrap()).unwrap_err();
        assert!(err.to_string().contains("tsl"), "{err}");
        assert!(Settings::parse(BackendParams::parse("ucx_=1").unwrap()).is_err());
        assert!(Settings::parse(BackendParams::parse("ucx_a-b=1").unwrap()).is_err());
        assert!(Settings::parse(BackendParams::parse("timeout_ms=0").unwrap()).is_err());
        assert_eq!(s.error_mode, ErrorMode::Auto);
        let none = Settings::parse(BackendParams::parse("error_mode=none").unwrap()).unwrap();
        assert_eq!(none.error_mode, ErrorMode::None);
        assert!(Settings::parse(BackendParams::parse("error_mode=maybe").unwrap()).is_err());
        assert!(Settings::parse(BackendParams::parse("max_op_bytes=1").unwrap()).is_err());
    }
}
