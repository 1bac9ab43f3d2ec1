//! An upstream HTTP endpoint (an engine, a prefill, the coordinator): scheme, host and port.

use std::str::FromStr;

use crate::allowlist::HostPort;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{0:?} is not host:port or http(s)://host:port (optionally #bootstrap=PORT)")]
pub struct TargetError(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// `scheme://host:port`, no trailing slash.
    pub base: String,
    pub host_port: HostPort,
    pub tls: bool,
    /// SGLang: the prefill's bootstrap port.
    pub bootstrap_port: Option<u16>,
    /// The coordinator's engine id, when it named this target.
    pub id: Option<String>,
    /// The engine's vLLM data-parallel rank the coordinator named (sent as
    /// `X-data-parallel-rank`); never set otherwise.
    pub dp_rank: Option<u32>,
}

impl Target {
    /// Parses `host:port` (taking `default_scheme`) or `http(s)://host:port[/]`, with an
    /// optional `#bootstrap=PORT`.
    pub fn parse(text: &str, default_scheme: &str, default_bootstrap: Option<u16>) -> Result<Target, TargetError> {
        let bad = || TargetError(text.to_string());
        let (main, fragment) = match text.trim().split_once('#') {
            Some((m, f)) => (m, Some(f)),
            None => (text.trim(), None),
        };
        let bootstrap_port = match fragment {
            Some(f) => Some(f.strip_prefix("bootstrap=").and_then(|p| p.parse::<u16>().ok()).ok_or_else(bad)?),
            None => default_bootstrap,
        };
        let (scheme, rest) = match main.split_once("://") {
            Some((s, r)) => (s.to_ascii_lowercase(), r),
            None => (default_scheme.to_string(), main),
        };
        if scheme != "http" && scheme != "https" {
            return Err(bad());
        }
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains('/') || authority.contains('@') || authority.contains('?') {
            return Err(bad());
        }
        let host_port = HostPort::from_str(authority).map_err(|_| bad())?;
        Ok(Target {
            base: format!("{scheme}://{}", host_port.authority()),
            tls: scheme == "https",
            host_port,
            bootstrap_port,
            id: None,
            dp_rank: None,
        })
    }

    pub fn from_host_port(hp: HostPort, scheme: &str, bootstrap_port: Option<u16>) -> Target {
        Target {
            base: format!("{scheme}://{}", hp.authority()),
            tls: scheme == "https",
            host_port: hp,
            bootstrap_port,
            id: None,
            dp_rank: None,
        }
    }

    pub fn url(&self, path_and_query: &str) -> String {
        let mut s = String::with_capacity(self.base.len() + path_and_query.len());
        s.push_str(&self.base);
        s.push_str(path_and_query);
        s
    }

    /// A short name for logs and metrics labels.
    pub fn name(&self) -> &str {
        self.id.as_deref().unwrap_or(&self.base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        let t = Target::parse("10.0.0.1:8100", "http", Some(8998)).unwrap();
        assert_eq!((t.base.as_str(), t.tls, t.bootstrap_port), ("http://10.0.0.1:8100", false, Some(8998)));
        let t = Target::parse("HTTPS://Host:443/#bootstrap=9", "http", None).unwrap();
        assert_eq!((t.base.as_str(), t.tls, t.bootstrap_port), ("https://host:443", true, Some(9)));
        assert_eq!(t.url("/v1/completions"), "https://host:443/v1/completions");
        assert_eq!(Target::parse("http://[::1]:80", "http", None).unwrap().base, "http://[::1]:80");
        for bad in ["ftp://h:1", "http://h", "http://h:1/v1", "http://u@h:1", "h:1#x=2", "h:1#bootstrap=x", ""] {
            assert!(Target::parse(bad, "http", None).is_err(), "{bad}");
        }
    }
}
