//! The backend's parameters: UCX settings passed through to `ucp_config_modify`, and our own
//! tunables. Pure parsing, so it is tested without UCX.

use std::time::Duration;

use xfer_core::staging::StagingConfig;
use xfer_core::{BackendError, BackendParams};

use crate::keys::TcpSegments;

/// Parameter prefix that passes any UCX setting through: `ucx_rndv_thresh=inf` sets
/// `UCX_RNDV_THRESH`.
pub const PASSTHROUGH_PREFIX: &str = "ucx_";

/// Separates list items inside a UCX value (`tls=posix+cma+self`), since commas separate the
/// parameters themselves.
pub const LIST_SEPARATOR: char = '+';

/// Default of `tcp_seg_size`: UCX's TCP transport moves an emulated put or get as active
/// messages of one TX segment each (8 KiB by default), and the target answers every put
/// segment with its own completion message, so a 1 MiB WRITE costs 128 sends and 128
/// acknowledgements each way. 256 KiB segments make that 4; larger ones measured no faster
/// (bench/README.md, "UCX against ucx_perftest").
pub const DEFAULT_TCP_SEG_SIZE: u64 = 256 << 10;
/// Largest accepted `tcp_seg_size` (UCX frames a message length in 32 bits; each worker keeps
/// a pool of segment buffers).
pub const MAX_TCP_SEG_SIZE: u64 = 64 << 20;
/// UCX's TCP options behind `tcp_seg_size`, as UCX 1.13's `ucp_config_modify` takes them: by
/// their name inside the transport's table, without `TCP_`. UCX 1.22 refuses that name
/// (`Invalid parameter`) and takes the full one, `TCP_TX_SEG_SIZE` ([`with_transport`]), which
/// 1.13 accepts without effect, warning of an invalid configuration when the worker starts.
const TCP_SEG_OPTIONS: [&str; 2] = ["TX_SEG_SIZE", "RX_SEG_SIZE"];

/// The name under which a UCX version that wants transport options with their transport's
/// prefix takes `option`, when `option` is one of TCP's segment sizes.
pub fn with_transport(option: &str) -> Option<String> {
    TCP_SEG_OPTIONS.contains(&option).then(|| format!("TCP_{option}"))
}

/// Whether an option name given to `ucp_config_modify` names TCP segment size `option`, with or
/// without the transport's prefix.
fn names_tcp_option(name: &str, option: &str) -> bool {
    name == option || name.strip_prefix("TCP_") == Some(option)
}

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
    /// environment's configuration (see [`Settings::ucx_options`] for what comes before).
    pub ucx: Vec<(String, String)>,
    /// TX and RX segment size of UCX's TCP transport; 0 leaves UCX's (8 KiB and 64 KiB).
    pub tcp_seg_size: u64,
    /// Whether `tcp_seg_size` was given (then it applies whatever the environment says).
    pub tcp_seg_size_given: bool,
    /// No completion of any operation to a peer for this long fails its requests.
    pub timeout: Duration,
    /// After the last event, the progress thread polls this long before it sleeps.
    pub spin: Duration,
    /// Descriptors longer than this are moved as several operations, so progress (and a
    /// stall) is visible per piece.
    pub max_op_bytes: u64,
    pub error_mode: ErrorMode,
    /// Slots of the lanes that stage files (and GPU memory without CUDA).
    pub staging: StagingConfig,
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
        let tcp_seg_size_param = params.take("tcp_seg_size");
        let tcp_seg_size_given = tcp_seg_size_param.is_some();
        let tcp_seg_size = match tcp_seg_size_param {
            None => DEFAULT_TCP_SEG_SIZE,
            Some(value) => value.parse().map_err(|err| invalid("tcp_seg_size", format!("{value:?}: {err}")))?,
        };
        let error_mode = match params.take("error_mode").as_deref() {
            None | Some("auto") => ErrorMode::Auto,
            Some("peer") => ErrorMode::Peer,
            Some("none") => ErrorMode::None,
            Some(other) => return Err(invalid("error_mode", format!("{other:?}: expected peer, none or auto"))),
        };
        let staging = StagingConfig::take(&mut params)?;
        params.finish("ucx")?;
        if timeout.is_zero() {
            return Err(invalid("timeout_ms", "must be positive"));
        }
        if max_op_bytes < 4096 {
            return Err(invalid("max_op_bytes", "must be at least 4096"));
        }
        if tcp_seg_size != 0 && !(8192..=MAX_TCP_SEG_SIZE).contains(&tcp_seg_size) {
            return Err(invalid("tcp_seg_size", format!("must be 0 or 8192..={MAX_TCP_SEG_SIZE}")));
        }
        Ok(Settings { ucx, tcp_seg_size, tcp_seg_size_given, timeout, spin, max_op_bytes, error_mode, staging })
    }

    /// The UCX options to apply over the environment's configuration, in order: the TCP
    /// segment size (both TX and RX, so that peers with the same setting fit each other's
    /// segments), then the explicit ones. The default segment size steps aside when the
    /// environment or an explicit option sets either segment size (UCX refuses an RX segment
    /// smaller than the TX one), and when the transports or devices cannot include TCP (UCX warns about
    /// options no transport used). `env` reads an environment variable.
    pub fn ucx_options(&self, env: impl Fn(&str) -> Option<String>) -> Vec<(String, String)> {
        let mut options = Vec::with_capacity(self.ucx.len() + 2);
        let set_elsewhere = TCP_SEG_OPTIONS.iter().any(|option| {
            env(&format!("UCX_TCP_{option}")).is_some()
                || self.ucx.iter().any(|(name, _)| names_tcp_option(name, option))
        });
        let setting = |option: &str| {
            let explicit = self.ucx.iter().rev().find(|(name, _)| name == option).map(|(_, value)| value.clone());
            explicit.or_else(|| env(&format!("UCX_{option}")))
        };
        let default_applies = !set_elsewhere
            && may_use_tcp(setting("TLS").as_deref())
            && may_have_netdev(setting("NET_DEVICES").as_deref());
        if self.tcp_seg_size != 0 && (self.tcp_seg_size_given || default_applies) {
            for option in TCP_SEG_OPTIONS {
                options.push((option.to_string(), self.tcp_seg_size.to_string()));
            }
        }
        options.extend(self.ucx.iter().cloned());
        options
    }
}

impl Settings {
    /// The TCP segment sizes UCX will use with these settings and this environment (the options
    /// [`Settings::ucx_options`] applies, else `UCX_TCP_*`/`UCX_*` variables, else UCX's
    /// defaults of 8 KiB and 64 KiB); zeros when TCP cannot be selected, 0 for a size that does
    /// not parse. Published in the connection info so that peers can check they fit.
    pub fn tcp_segments(&self, env: impl Fn(&str) -> Option<String>) -> TcpSegments {
        let setting = |option: &str| {
            let explicit = self.ucx.iter().rev().find(|(name, _)| name == option).map(|(_, value)| value.clone());
            explicit.or_else(|| env(&format!("UCX_{option}")))
        };
        if !may_use_tcp(setting("TLS").as_deref()) || !may_have_netdev(setting("NET_DEVICES").as_deref()) {
            return TcpSegments::default();
        }
        let options = self.ucx_options(&env);
        let size = |option: &str, default: u32| {
            let value = options
                .iter()
                .rev()
                .find(|(name, _)| names_tcp_option(name, option))
                .map(|(_, value)| value.clone())
                .or_else(|| env(&format!("UCX_TCP_{option}")))
                .or_else(|| env(&format!("UCX_{option}")));
            match value {
                None => default,
                Some(text) => parse_size(&text).unwrap_or(0),
            }
        };
        TcpSegments { tx: size("TX_SEG_SIZE", 8192), rx: size("RX_SEG_SIZE", 65_536) }
    }
}

/// A UCX memory-size setting (`65536`, `64k`, `1M`, `256KB`) in bytes, when it fits a u32.
fn parse_size(text: &str) -> Option<u32> {
    let text = text.trim().to_ascii_lowercase();
    let text = text.strip_suffix('b').unwrap_or(&text);
    let (digits, shift) = match text.chars().last()? {
        'k' => (&text[..text.len() - 1], 10),
        'm' => (&text[..text.len() - 1], 20),
        'g' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    let value: u64 = digits.trim().parse().ok()?;
    u32::try_from(value.checked_mul(1 << shift)?).ok()
}

/// Whether a `UCX_NET_DEVICES` value (none: every device) can name a network interface, which
/// TCP needs: not when every entry is an RDMA port (`mlx5_0:1`).
fn may_have_netdev(devices: Option<&str>) -> bool {
    devices.is_none_or(|list| list.split(',').any(|device| !device.contains(':')))
}

/// Whether a `UCX_TLS` value (none: UCX's default, every transport) can select TCP.
fn may_use_tcp(tls: Option<&str>) -> bool {
    let Some(tls) = tls.map(str::trim) else { return true };
    let names = |list: &str| list.split(',').map(|name| name.trim().to_ascii_lowercase()).collect::<Vec<_>>();
    match tls.strip_prefix('^') {
        Some(excluded) => !names(excluded).iter().any(|name| name == "tcp"),
        None => names(tls).iter().any(|name| name == "tcp" || name == "all"),
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
        assert!(Settings::parse(BackendParams::parse("tcp_seg_size=100").unwrap()).is_err());
        assert!(Settings::parse(BackendParams::parse("tcp_seg_size=1073741824").unwrap()).is_err());
    }

    fn options(params: &str, env: &[(&str, &str)]) -> Vec<(String, String)> {
        let settings = Settings::parse(BackendParams::parse(params).unwrap()).unwrap();
        settings.ucx_options(|name| env.iter().find(|(key, _)| *key == name).map(|(_, value)| value.to_string()))
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter().map(|(name, value)| (name.to_string(), value.to_string())).collect()
    }

    fn segments(params: &str, env: &[(&str, &str)]) -> (u32, u32) {
        let settings = Settings::parse(BackendParams::parse(params).unwrap()).unwrap();
        let s =
            settings.tcp_segments(|name| env.iter().find(|(key, _)| *key == name).map(|(_, value)| value.to_string()));
        (s.tx, s.rx)
    }

    #[test]
    fn published_tcp_segments_are_the_ones_ucx_will_use() {
        let seg = DEFAULT_TCP_SEG_SIZE as u32;
        assert_eq!(segments("", &[]), (seg, seg));
        assert_eq!(segments("tcp_seg_size=0", &[]), (8192, 65_536), "UCX's own defaults");
        assert_eq!(segments("", &[("UCX_TCP_RX_SEG_SIZE", "1m")]), (8192, 1 << 20), "the environment's");
        assert_eq!(segments("ucx_tx_seg_size=16k", &[]), (16_384, 65_536));
        assert_eq!(segments("ucx_tcp_tx_seg_size=16k", &[]), (16_384, 65_536), "UCX 1.22's name");
        assert_eq!(segments("tcp_seg_size=65536,ucx_rx_seg_size=128KB", &[]), (65_536, 131_072), "last wins");
        assert_eq!(segments("", &[("UCX_TCP_TX_SEG_SIZE", "lots")]), (0, 65_536), "unparsable: unknown");
        // No TCP possible: nothing to check.
        assert_eq!(segments("tls=posix+cma+self", &[]), (0, 0));
        assert_eq!(segments("", &[("UCX_NET_DEVICES", "mlx5_0:1")]), (0, 0));
    }

    #[test]
    fn tcp_segment_options_have_a_full_name_for_newer_ucx() {
        assert_eq!(with_transport("TX_SEG_SIZE").as_deref(), Some("TCP_TX_SEG_SIZE"));
        assert_eq!(with_transport("RX_SEG_SIZE").as_deref(), Some("TCP_RX_SEG_SIZE"));
        // Anything else is passed as given: its error is the user's to read.
        assert_eq!(with_transport("TLS"), None);
        assert_eq!(with_transport("TCP_TX_SEG_SIZE"), None);
    }

    #[test]
    fn ucx_sizes_parse() {
        for (text, bytes) in [("65536", 65_536), ("64k", 65_536), ("64K", 65_536), ("1m", 1 << 20), ("256KB", 262_144)]
        {
            assert_eq!(parse_size(text), Some(bytes), "{text}");
        }
        for text in ["", "k", "x", "-1", "8g", "inf"] {
            assert_eq!(parse_size(text), None, "{text}");
        }
    }

    #[test]
    fn tcp_segment_size_defaults_unless_set_elsewhere() {
        let seg = DEFAULT_TCP_SEG_SIZE.to_string();
        let default = [("TX_SEG_SIZE", seg.as_str()), ("RX_SEG_SIZE", seg.as_str())];
        // Applied first, so explicit options come after it.
        assert_eq!(options("tls=tcp", &[]), pairs(&[default[0], default[1], ("TLS", "tcp")]));
        assert_eq!(options("", &[]), pairs(&default));
        assert_eq!(options("", &[("UCX_TLS", "^ib")]), pairs(&default));
        assert_eq!(options("tls=rc+tcp", &[("UCX_TLS", "posix")]), pairs(&[default[0], default[1], ("TLS", "rc,tcp")]));
        // No TCP among the transports: nothing (UCX would warn about an unused option).
        assert_eq!(options("tls=posix+cma+self", &[]), pairs(&[("TLS", "posix,cma,self")]));
        assert_eq!(options("", &[("UCX_TLS", "^tcp,ib")]), pairs(&[]));
        // Only RDMA ports among the devices: no TCP either.
        assert_eq!(options("net_devices=mlx5_0:1", &[]), pairs(&[("NET_DEVICES", "mlx5_0:1")]));
        assert_eq!(options("", &[("UCX_NET_DEVICES", "mlx5_0:1,mlx5_1:1")]), pairs(&[]));
        assert_eq!(options("", &[("UCX_NET_DEVICES", "mlx5_0:1,eth0")]), pairs(&default));
        // Set by the environment or an explicit option: UCX's own rules, ours stay out.
        assert_eq!(options("", &[("UCX_TCP_RX_SEG_SIZE", "1m")]), pairs(&[]));
        assert_eq!(options("ucx_tx_seg_size=16k", &[]), pairs(&[("TX_SEG_SIZE", "16k")]));
        assert_eq!(options("ucx_tcp_rx_seg_size=1m", &[]), pairs(&[("TCP_RX_SEG_SIZE", "1m")]));
        assert_eq!(options("tcp_seg_size=0", &[]), pairs(&[]));
        // Given explicitly: applies whatever the environment says; explicit options still win.
        assert_eq!(
            options("tcp_seg_size=65536", &[("UCX_TCP_TX_SEG_SIZE", "8k")]),
            pairs(&[("TX_SEG_SIZE", "65536"), ("RX_SEG_SIZE", "65536")])
        );
        assert_eq!(
            options("tcp_seg_size=65536,ucx_rx_seg_size=1m", &[]),
            pairs(&[("TX_SEG_SIZE", "65536"), ("RX_SEG_SIZE", "65536"), ("RX_SEG_SIZE", "1m")])
        );
    }
}
