//! The backend's parameters (see the crate docs for the table).

use std::time::Duration;

use xfer_core::{BackendError, BackendParams};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `None`: the best available ([`PREFERENCE`]).
    pub provider: Option<String>,
    /// The domains (NICs); empty: the provider's first.
    pub domains: Vec<String>,
    /// Endpoints per domain, each a rail of its own (connection, CQ, engine thread).
    pub lanes: usize,
    pub timeout: Duration,
    /// A share of a request striped over several rails moves to another rail once its rail
    /// completed nothing for the peer for this long.
    pub failover: Duration,
    /// How long a rail that failed is left out before a request tries it again (doubling
    /// while it keeps failing).
    pub rail_retry: Duration,
    pub max_in_flight: usize,
    pub max_op_bytes: usize,
    pub max_notif_bytes: usize,
    /// Payload bytes per notification message (the receive buffers' size, less headers).
    pub notif_chunk: usize,
    pub recv_buffers: usize,
    pub spin: Duration,
}

/// Providers the default picks from, best first. `shm` and `udp` are left out: they cannot
/// reach other hosts (or lack RMA).
pub const PREFERENCE: &[&str] =
    &["efa", "cxi", "opx", "psm3", "psm2", "verbs;ofi_rxm", "verbs", "tcp;ofi_rxm", "tcp", "sockets"];

impl Settings {
    pub fn parse(mut params: BackendParams) -> Result<Settings, BackendError> {
        let provider = params.take("provider").filter(|p| !p.is_empty() && p != "auto");
        let domain = params.take("domain").filter(|d| !d.is_empty());
        let domains = params.take("domains").filter(|d| !d.is_empty());
        let lanes = params.take_parsed("lanes", DEFAULT_LANES)?;
        let timeout = params.take_millis("timeout_ms", Duration::from_secs(5))?;
        let failover = params.take_millis("failover_ms", Duration::from_secs(1))?;
        let rail_retry = params.take_millis("rail_retry_ms", Duration::from_secs(1))?;
        let max_in_flight = params.take_parsed("max_in_flight", 16usize)?;
        let max_op_bytes = params.take_parsed("max_op_bytes", 4usize << 20)?;
        let max_notif_bytes = params.take_parsed("max_notif_bytes", 16usize << 20)?;
        let notif_chunk = params.take_parsed("notif_chunk", 16usize << 10)?;
        let recv_buffers = params.take_parsed("recv_buffers", 32usize)?;
        let spin = Duration::from_micros(params.take_parsed("spin_us", 200u64)?);
        params.finish("libfabric")?;
        let positive = |name: &str, v: usize| {
            if v == 0 {
                Err(BackendError::InvalidParam { name: name.into(), reason: "must be at least 1".into() })
            } else {
                Ok(())
            }
        };
        positive("lanes", lanes)?;
        positive("max_in_flight", max_in_flight)?;
        positive("max_op_bytes", max_op_bytes)?;
        positive("recv_buffers", recv_buffers)?;
        positive("notif_chunk", notif_chunk)?;
        positive("timeout_ms", timeout.as_millis() as usize)?;
        positive("failover_ms", failover.as_millis() as usize)?;
        if max_notif_bytes > 1 << 30 {
            return Err(BackendError::InvalidParam { name: "max_notif_bytes".into(), reason: "at most 1 GiB".into() });
        }
        if notif_chunk > 1 << 20 {
            return Err(BackendError::InvalidParam { name: "notif_chunk".into(), reason: "at most 1 MiB".into() });
        }
        // A provider name with a comma cannot come through `k=v,k=v`; `+` stands for it there.
        let provider = provider.map(|p| p.replace('+', ","));
        let domains = match (domain, domains) {
            (Some(_), Some(_)) => {
                return Err(BackendError::InvalidParam {
                    name: "domains".into(),
                    reason: "give either `domain` or `domains`, not both".into(),
                })
            }
            (Some(one), None) => vec![one],
            (None, Some(list)) => parse_domains(&list)?,
            (None, None) => Vec::new(),
        };
        if domains.len().max(1).saturating_mul(lanes) > MAX_RAILS {
            return Err(BackendError::InvalidParam {
                name: "lanes".into(),
                reason: format!("{} domain(s) × {lanes} lanes: at most {MAX_RAILS} endpoints", domains.len().max(1)),
            });
        }
        Ok(Settings {
            provider,
            domains,
            lanes,
            timeout,
            // A share never waits longer to move than its request would to fail.
            failover: failover.min(timeout),
            rail_retry,
            max_in_flight,
            max_op_bytes,
            max_notif_bytes,
            notif_chunk,
            recv_buffers,
            spin,
        })
    }

    /// How many rails (endpoints: lanes on every domain) the backend opens.
    pub fn rails(&self) -> usize {
        self.domains.len().max(1) * self.lanes
    }

    /// Index of the best candidate provider (first of its kind in libfabric's order).
    pub fn pick(&self, providers: &[String]) -> Option<usize> {
        if self.provider.is_some() {
            return (!providers.is_empty()).then_some(0);
        }
        PREFERENCE.iter().find_map(|want| providers.iter().position(|p| p == want))
    }
}

/// Most rails one backend drives (each is an endpoint with its own engine thread).
pub const MAX_RAILS: usize = 16;

/// Endpoints per domain unless `lanes` says otherwise. The tcp provider of libfabric 1.17
/// carries one endpoint pair's traffic over one socket; several lanes use several.
pub const DEFAULT_LANES: usize = 1;

/// `a+b+c` (the list separator `+`, since `,` separates parameters): distinct, non-empty names.
fn parse_domains(list: &str) -> Result<Vec<String>, BackendError> {
    let bad = |reason: String| BackendError::InvalidParam { name: "domains".into(), reason };
    let names: Vec<String> = list.split('+').map(str::to_string).collect();
    if names.iter().any(String::is_empty) {
        return Err(bad(format!("{list:?} has an empty name (separate domains with `+`)")));
    }
    if names.len() > MAX_RAILS {
        return Err(bad(format!("{} domains: at most {MAX_RAILS}", names.len())));
    }
    if let Some(twice) = names.iter().enumerate().find_map(|(i, n)| names[..i].contains(n).then_some(n)) {
        return Err(bad(format!("{twice} is listed twice")));
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_overrides_and_typos() {
        let s = Settings::parse(BackendParams::new()).unwrap();
        assert_eq!((s.provider.as_deref(), s.timeout, s.max_in_flight), (None, Duration::from_secs(5), 16));
        let s =
            Settings::parse(BackendParams::parse("provider=tcp;ofi_rxm,domain=lo,timeout_ms=250").unwrap()).unwrap();
        assert_eq!(s.provider.as_deref(), Some("tcp;ofi_rxm"));
        assert_eq!((s.domains.clone(), s.rails()), (vec!["lo".to_string()], DEFAULT_LANES));
        assert_eq!(s.timeout, Duration::from_millis(250));
        assert_eq!(s.failover, Duration::from_millis(250), "a share moves no later than its request fails");
        let s = Settings::parse(BackendParams::parse("failover_ms=300,rail_retry_ms=2000").unwrap()).unwrap();
        assert_eq!((s.failover, s.rail_retry), (Duration::from_millis(300), Duration::from_secs(2)));
        assert!(Settings::parse(BackendParams::new().with("failover_ms", "0")).is_err());
        assert!(Settings::parse(BackendParams::new().with("timout_ms", "5")).is_err());
        assert!(Settings::parse(BackendParams::new().with("max_in_flight", "0")).is_err());
        assert!(Settings::parse(BackendParams::new().with("notif_chunk", "99999999")).is_err());
    }

    #[test]
    fn domains_list_the_rails() {
        let s = Settings::parse(BackendParams::parse("domains=eth0+eth1,lanes=1").unwrap()).unwrap();
        assert_eq!((s.domains.clone(), s.rails()), (vec!["eth0".to_string(), "eth1".to_string()], 2));
        let s = Settings::parse(BackendParams::parse("domains=eth0+eth1,lanes=3").unwrap()).unwrap();
        assert_eq!((s.lanes, s.rails()), (3, 6));
        assert_eq!(Settings::parse(BackendParams::new()).unwrap().rails(), DEFAULT_LANES);
        let many = (0..=MAX_RAILS).map(|i| format!("d{i}")).collect::<Vec<_>>().join("+");
        for bad in [
            "domains=eth0++eth1",
            "domains=eth0+eth0",
            &format!("domains={many},lanes=1"),
            "domain=lo,domains=lo+eth0",
            "lanes=0",
            "lanes=17",
            "domains=a+b+c+d+e,lanes=4",
        ] {
            let err = Settings::parse(BackendParams::parse(bad).unwrap());
            assert!(matches!(err, Err(BackendError::InvalidParam { .. })), "{bad}: {err:?}");
        }
    }

    #[test]
    fn default_provider_is_the_best_listed() {
        let s = Settings::parse(BackendParams::new()).unwrap();
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(s.pick(&names(&["shm", "tcp;ofi_rxm", "sockets", "tcp;ofi_rxm"])), Some(1));
        assert_eq!(s.pick(&names(&["sockets", "efa"])), Some(1));
        assert_eq!(s.pick(&names(&["shm", "udp;ofi_rxd"])), None);
    }
}
