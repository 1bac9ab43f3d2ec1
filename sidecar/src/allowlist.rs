//! Which prefill targets a request may name (SSRF protection without Kubernetes): exact
//! `host:port` entries and IP networks (`10.0.0.0/8`, optionally with a port:
//! `10.0.0.0/8:8000`). Host names are matched only literally, never resolved, so DNS cannot
//! widen the list.

use std::net::IpAddr;
use std::str::FromStr;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AllowError {
    #[error("{0:?} is not host:port, an IP network (a.b.c.d/n) or an IP network with a port")]
    Entry(String),
    #[error("{0:?} is not host:port")]
    Target(String),
}

/// One `host:port` (a literal host name or an IP address).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    pub fn ip(&self) -> Option<IpAddr> {
        IpAddr::from_str(&self.host).ok()
    }

    /// `host:port` with IPv6 hosts bracketed, as in a URL's authority.
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl FromStr for HostPort {
    type Err = AllowError;

    fn from_str(s: &str) -> Result<Self, AllowError> {
        let bad = || AllowError::Target(s.to_string());
        let s = s.trim();
        let (host, port) = if let Some(rest) = s.strip_prefix('[') {
            let (host, port) = rest.split_once("]:").ok_or_else(bad)?;
            IpAddr::from_str(host).map_err(|_| bad())?;
            (host, port)
        } else {
            let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
            if host.contains(':') {
                return Err(bad()); // IPv6 needs brackets
            }
            (host, port)
        };
        let port: u16 = port.parse().map_err(|_| bad())?;
        let valid_host = !host.is_empty()
            && host.len() <= 253
            && (IpAddr::from_str(host).is_ok()
                || host.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_'));
        if !valid_host || port == 0 {
            return Err(bad());
        }
        Ok(HostPort { host: host.to_ascii_lowercase(), port })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Network {
    addr: IpAddr,
    prefix: u8,
    port: Option<u16>,
}

impl Network {
    fn contains(&self, ip: IpAddr, port: u16) -> bool {
        if self.port.is_some_and(|p| p != port) {
            return false;
        }
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => masked(u32::from(net).into(), u32::from(ip).into(), 32, self.prefix),
            (IpAddr::V6(net), IpAddr::V6(ip)) => masked(u128::from(net), u128::from(ip), 128, self.prefix),
            (IpAddr::V4(_), IpAddr::V6(ip)) => {
                ip.to_ipv4_mapped().is_some_and(|v4| self.contains(IpAddr::V4(v4), port))
            }
            (IpAddr::V6(_), IpAddr::V4(_)) => false,
        }
    }
}

fn masked(net: u128, ip: u128, bits: u8, prefix: u8) -> bool {
    if prefix == 0 {
        return true;
    }
    let shift = bits - prefix;
    (net >> shift) == (ip >> shift)
}

/// The allowlist; empty allows nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    exact: Vec<HostPort>,
    networks: Vec<Network>,
}

impl Allowlist {
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, AllowError> {
        let mut list = Allowlist::default();
        for e in entries {
            list.add(e.as_ref())?;
        }
        Ok(list)
    }

    pub fn add(&mut self, entry: &str) -> Result<(), AllowError> {
        let entry = entry.trim();
        let bad = || AllowError::Entry(entry.to_string());
        if let Some((addr, rest)) = entry.split_once('/') {
            let (prefix, port) = match rest.split_once(':') {
                Some((p, port)) => (p, Some(port.parse::<u16>().map_err(|_| bad())?)),
                None => (rest, None),
            };
            let addr = IpAddr::from_str(addr).map_err(|_| bad())?;
            let prefix: u8 = prefix.parse().map_err(|_| bad())?;
            let max = if addr.is_ipv4() { 32 } else { 128 };
            if prefix > max {
                return Err(bad());
            }
            self.networks.push(Network { addr, prefix, port });
        } else {
            let hp = HostPort::from_str(entry).map_err(|_| bad())?;
            if !self.exact.contains(&hp) {
                self.exact.push(hp);
            }
        }
        Ok(())
    }

    pub fn allows(&self, target: &HostPort) -> bool {
        if self.exact.iter().any(|e| e == target) {
            return true;
        }
        match target.ip() {
            Some(ip) => self.networks.iter().any(|n| n.contains(ip, target.port)),
            None => false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.networks.is_empty()
    }
}

/// The targets of an `x-prefiller-host-port` header (comma separated): every one must parse
/// and be allowed, else the header is refused as a whole.
pub fn validate_header(value: &str, allowed: impl Fn(&HostPort) -> bool) -> Result<Vec<HostPort>, AllowError> {
    let mut out = Vec::new();
    for part in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let hp = HostPort::from_str(part)?;
        if !allowed(&hp) {
            return Err(AllowError::Target(part.to_string()));
        }
        out.push(hp);
    }
    if out.is_empty() {
        return Err(AllowError::Target(value.to_string()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hp(s: &str) -> HostPort {
        s.parse().unwrap()
    }

    #[test]
    fn host_ports() {
        assert_eq!(hp("Prefill-1.local:8100"), HostPort { host: "prefill-1.local".into(), port: 8100 });
        assert_eq!(hp("[::1]:80").authority(), "[::1]:80");
        assert_eq!(hp("10.0.0.1:1").authority(), "10.0.0.1:1");
        for bad in
            ["", "host", "host:", ":80", "host:0", "host:99999", "a b:80", "h/x:80", "[zz]:80", "::1:80", "h:80/x"]
        {
            assert!(bad.parse::<HostPort>().is_err(), "{bad}");
        }
    }

    #[test]
    fn exact_networks_and_ports() {
        let a =
            Allowlist::parse(&["p1:8100", "10.1.0.0/16", "192.168.1.0/24:9000", "fd00::/8", "127.0.0.1/32"]).unwrap();
        assert!(a.allows(&hp("p1:8100")));
        assert!(!a.allows(&hp("p1:8101")), "exact entries pin the port");
        assert!(!a.allows(&hp("p2:8100")));
        assert!(a.allows(&hp("10.1.200.3:1234")));
        assert!(!a.allows(&hp("10.2.0.1:1234")));
        assert!(a.allows(&hp("192.168.1.77:9000")));
        assert!(!a.allows(&hp("192.168.1.77:9001")));
        assert!(a.allows(&hp("[fd12::1]:80")));
        assert!(!a.allows(&hp("[fe80::1]:80")));
        assert!(a.allows(&hp("[::ffff:10.1.0.9]:5")), "IPv4-mapped IPv6");
        assert!(a.allows(&hp("127.0.0.1:5")));
        assert!(!a.allows(&hp("localhost:5")), "names are never resolved");
        assert!(Allowlist::parse(&["0.0.0.0/0"]).unwrap().allows(&hp("8.8.8.8:53")));
        for bad in ["10.0.0.0/33", "x/8", "10.0.0.0/8:x", "nohost", "::/129"] {
            assert!(Allowlist::parse(&[bad]).is_err(), "{bad}");
        }
        assert!(Allowlist::default().is_empty() && !Allowlist::default().allows(&hp("a:1")));
    }

    #[test]
    fn header_values() {
        let a = Allowlist::parse(&["p1:8100", "p2:8100"]).unwrap();
        let allows = |h: &HostPort| a.allows(h);
        assert_eq!(validate_header("p1:8100, p2:8100", allows).unwrap(), vec![hp("p1:8100"), hp("p2:8100")]);
        assert!(validate_header("p1:8100,evil:80", allows).is_err(), "one bad target refuses the header");
        assert!(validate_header("http://p1:8100", allows).is_err());
        assert!(validate_header(" , ", allows).is_err());
    }
}
