//! A private network of "nodes": one Linux network namespace per node, each joined to a bridge
//! (in a namespace of its own) by a veth pair. Addresses come from 10.77.0.0/24 and exist only
//! inside these namespaces. Links are cut by setting the bridge's end of a node's veth down, and
//! degraded on the node's end: with `tc netem` where the kernel has it, else with an nftables
//! random-drop rule (loss) and a `tc tbf` token bucket (a slow link, no fixed delay).
//! The nftables table lives in the node's namespace and goes with it at teardown.
//!
//! Namespaces are named `pdc-<harness pid>-<node>`. Dropping the [`Net`] kills whatever still
//! runs in them and deletes them; [`remove_stale`] does the same for the namespaces of harnesses
//! that died without dropping theirs (killed with SIGKILL), and is called at every start.

use std::fs::File;
use std::net::Ipv4Addr;
use std::process::Command;

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The namespace-name prefix of every harness.
pub const PREFIX: &str = "pdc-";
/// The bridge's namespace, and the interface name on each side of a node's link.
const BRIDGE_NODE: &str = "br";
const NODE_IF: &str = "eth0";

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("`ip {args}` failed: {stderr} (the chaos harness needs root, iproute2 and network-namespace support)")]
    Ip { args: String, stderr: String },
    #[error("running `{program}`: {source} (is iproute2 installed?)")]
    Spawn { program: String, source: std::io::Error },
    #[error(
        "this kernel has no netem queueing discipline (CONFIG_NET_SCH_NETEM): {netem}; \
         and the nftables + tbf fallback failed: {fallback}"
    )]
    NoImpairment { netem: String, fallback: String },
    #[error("`tc {args}` failed: {stderr}")]
    Tc { args: String, stderr: String },
    #[error("`nft {args}` failed: {stderr} (is nftables installed?)")]
    Nft { args: String, stderr: String },
    #[error("entering network namespace {name}: {reason}")]
    Enter { name: String, reason: String },
    #[error("no node named {0}")]
    UnknownNode(String),
}

/// One node: its namespace and address (on its first link, `eth0`).
#[derive(Debug, Clone)]
pub struct Node {
    pub name: String,
    pub netns: String,
    pub ip: Ipv4Addr,
    /// The node's address on every link, `eth0` first ([`Net::create_with_links`]).
    pub ips: Vec<Ipv4Addr>,
}

/// The namespaces of one harness run; removed on drop.
#[derive(Debug)]
pub struct Net {
    id: String,
    bridge_ns: String,
    pub nodes: Vec<Node>,
}

/// The impairment [`Net::degrade`] really applied to a node's link.
#[derive(Debug, Clone, PartialEq)]
pub enum Impairment {
    /// `tc netem`: random loss and a fixed delay on every packet the node sends.
    Netem { loss_percent: f64, delay_ms: u32 },
    /// The kernel has no netem: random loss by an nftables `numgen` rule on the node's output
    /// hook and a `tc tbf` rate limit on its `eth0`; no fixed delay.
    NftTbf { loss_percent: f64, rate_mbit: u32 },
}

impl std::fmt::Display for Impairment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Impairment::Netem { loss_percent, delay_ms } => {
                write!(f, "netem {loss_percent} % loss + {delay_ms} ms delay")
            }
            Impairment::NftTbf { loss_percent, rate_mbit } => {
                write!(f, "nft {loss_percent} % loss + tbf {rate_mbit} Mbit; no fixed delay: kernel lacks netem")
            }
        }
    }
}

/// The nftables table the fallback loss rule lives in (one per node namespace).
const NFT_TABLE: &str = "pdchaos";

/// The `numgen random mod 10000 < N` threshold that drops `loss_percent` % of packets.
pub fn loss_threshold(loss_percent: f64) -> u32 {
    (loss_percent * 100.0).round().clamp(0.0, 10_000.0) as u32
}

/// The packet count of the first `counter` in `nft list` output.
pub fn counter_packets(listing: &str) -> Option<u64> {
    let rest = &listing[listing.find("counter packets ")? + "counter packets ".len()..];
    rest.split_whitespace().next()?.parse().ok()
}

/// Runs `program args`, mapping a failure to its stderr.
fn run(program: &str, args: &[&str]) -> Result<(), (String, String)> {
    let out = Command::new(program).args(args).output().map_err(|e| (String::new(), e.to_string()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err((args.join(" "), String::from_utf8_lossy(&out.stderr).trim().to_string()))
    }
}

fn ip(args: &[&str]) -> Result<(), NetError> {
    run("ip", args).map_err(|(args, stderr)| {
        if args.is_empty() {
            NetError::Spawn { program: "ip".into(), source: std::io::Error::other(stderr) }
        } else {
            NetError::Ip { args, stderr }
        }
    })
}

fn ip_output(args: &[&str]) -> Result<String, NetError> {
    let out =
        Command::new("ip").args(args).output().map_err(|source| NetError::Spawn { program: "ip".into(), source })?;
    if !out.status.success() {
        return Err(NetError::Ip { args: args.join(" "), stderr: String::from_utf8_lossy(&out.stderr).trim().into() });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The address of the `index`-th node (0-based).
pub fn node_ip(index: usize) -> Ipv4Addr {
    link_ip(0, index)
}

/// The address of the `index`-th node on link `link` (10.77.<link>.0/24).
pub fn link_ip(link: usize, index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 77, link as u8, 10 + index as u8)
}

/// A node's interface on link `link`: `eth0`, `eth1`, ...
pub fn link_if(link: usize) -> String {
    format!("eth{link}")
}

impl Net {
    /// Creates the bridge and one namespace per name, each linked to the bridge and up.
    pub fn create(node_names: &[&str]) -> Result<Net, NetError> {
        Net::create_with_links(node_names, 1)
    }

    /// The same with `links` separate networks (for multi-rail transports): link `k` is a
    /// bridge `br<k>` and, in every node, an interface `eth<k>` with address 10.77.<k>.x/24.
    /// Cutting and degrading act on link 0.
    pub fn create_with_links(node_names: &[&str], links: usize) -> Result<Net, NetError> {
        let id = std::process::id().to_string();
        let bridge_ns = format!("{PREFIX}{id}-{BRIDGE_NODE}");
        // Registered before anything exists, so a failure half-way still removes what was made.
        let mut net = Net { id, bridge_ns: bridge_ns.clone(), nodes: Vec::new() };
        ip(&["netns", "add", &bridge_ns])?;
        for link in 0..links.max(1) {
            let bridge = format!("br{link}");
            ip(&["-n", &bridge_ns, "link", "add", &bridge, "type", "bridge"])?;
            ip(&["-n", &bridge_ns, "link", "set", &bridge, "up"])?;
        }
        for (i, name) in node_names.iter().enumerate() {
            let ips: Vec<Ipv4Addr> = (0..links.max(1)).map(|link| link_ip(link, i)).collect();
            let node = Node { name: name.to_string(), netns: net.netns_of(name), ip: ips[0], ips: ips.clone() };
            ip(&["netns", "add", &node.netns])?;
            net.nodes.push(node.clone());
            for (link, addr) in ips.iter().enumerate() {
                let (port, iface, bridge) = (bridge_port_on(link, name), link_if(link), format!("br{link}"));
                ip(&[
                    "link",
                    "add",
                    &iface,
                    "netns",
                    &node.netns,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    &port,
                    "netns",
                    &bridge_ns,
                ])?;
                ip(&["-n", &bridge_ns, "link", "set", &port, "master", &bridge, "up"])?;
                ip(&["-n", &node.netns, "addr", "add", &format!("{addr}/24"), "dev", &iface])?;
                ip(&["-n", &node.netns, "link", "set", &iface, "up"])?;
            }
            ip(&["-n", &node.netns, "link", "set", "lo", "up"])?;
        }
        Ok(net)
    }

    /// Bytes the node's interface on link `link` received and sent so far (its
    /// `/sys/class/net/eth<k>/statistics`, read inside the namespace).
    pub fn link_bytes(&self, node: &str, link: usize) -> Result<(u64, u64), NetError> {
        let ns = &self.node(node)?.netns;
        let iface = link_if(link);
        let read = |counter: &str| -> Result<u64, NetError> {
            let path = format!("/sys/class/net/{iface}/statistics/{counter}");
            let out = ip_output(&["netns", "exec", ns, "cat", &path])?;
            out.trim().parse().map_err(|_| NetError::Ip { args: format!("netns exec {ns} cat {path}"), stderr: out })
        };
        Ok((read("rx_bytes")?, read("tx_bytes")?))
    }

    fn netns_of(&self, node: &str) -> String {
        format!("{PREFIX}{}-{node}", self.id)
    }

    pub fn node(&self, name: &str) -> Result<&Node, NetError> {
        self.nodes.iter().find(|n| n.name == name).ok_or_else(|| NetError::UnknownNode(name.into()))
    }

    /// Takes the node off the bridge: its packets go nowhere, its own address still works.
    pub fn cut(&self, node: &str) -> Result<(), NetError> {
        self.cut_link(node, 0)
    }

    pub fn heal(&self, node: &str) -> Result<(), NetError> {
        self.heal_link(node, 0)
    }

    /// Like [`cut`](Net::cut) for the node's link `link` alone (a multi-rail NIC going down).
    pub fn cut_link(&self, node: &str, link: usize) -> Result<(), NetError> {
        self.node(node)?;
        ip(&["-n", &self.bridge_ns, "link", "set", &bridge_port_on(link, node), "down"])
    }

    pub fn heal_link(&self, node: &str, link: usize) -> Result<(), NetError> {
        self.node(node)?;
        ip(&["-n", &self.bridge_ns, "link", "set", &bridge_port_on(link, node), "up"])
    }

    /// Slows the node's link `link` to `rate_mbit` both ways (`tc tbf` on the node's interface
    /// and on the bridge's end of it), so that a transfer over it lasts long enough to be cut
    /// in the middle; `None` lifts the limit.
    pub fn limit_link(&self, node: &str, link: usize, rate_mbit: Option<u32>) -> Result<(), NetError> {
        let ns = self.node(node)?.netns.clone();
        let rate = rate_mbit.map(|r| format!("{r}mbit"));
        for (ns, dev) in [(ns.as_str(), link_if(link)), (self.bridge_ns.as_str(), bridge_port_on(link, node))] {
            let mut args = vec!["-n", ns, "qdisc"];
            match &rate {
                Some(rate) => args.extend(["replace", "dev", &dev, "root", "tbf", "rate", rate]),
                None => args.extend(["del", "dev", &dev, "root"]),
            }
            if rate.is_some() {
                args.extend(["burst", "64kb", "latency", "50ms"]);
            }
            run("tc", &args).map_err(|(args, stderr)| NetError::Tc { args, stderr })?;
        }
        Ok(())
    }

    /// Every packet the node sends is dropped with `loss_percent` and delayed by `delay_ms`
    /// (netem). On a kernel without netem, the loss comes from an nftables rule on the node's
    /// output hook and the link is slowed to `fallback_rate_mbit` by `tc tbf` instead of being
    /// delayed. Returns what was applied.
    pub fn degrade(
        &self,
        node: &str,
        loss_percent: f64,
        delay_ms: u32,
        fallback_rate_mbit: u32,
    ) -> Result<Impairment, NetError> {
        let ns = self.node(node)?.netns.clone();
        let (loss, delay) = (format!("{loss_percent}%"), format!("{delay_ms}ms"));
        let args = ["-n", &ns, "qdisc", "replace", "dev", NODE_IF, "root", "netem", "loss", &loss, "delay", &delay];
        match run("tc", &args) {
            Ok(()) => Ok(Impairment::Netem { loss_percent, delay_ms }),
            Err((_, stderr)) if stderr.contains("Specified qdisc kind is unknown") => {
                match degrade_without_netem(&ns, loss_percent, fallback_rate_mbit) {
                    Ok(()) => Ok(Impairment::NftTbf { loss_percent, rate_mbit: fallback_rate_mbit }),
                    Err(e) => Err(NetError::NoImpairment { netem: stderr, fallback: e.to_string() }),
                }
            }
            Err((args, stderr)) if args.is_empty() => {
                Err(NetError::Spawn { program: "tc".into(), source: std::io::Error::other(stderr) })
            }
            Err((args, stderr)) => Err(NetError::Tc { args, stderr }),
        }
    }

    /// The packets the nftables fallback dropped on the node so far; `None` where it has no
    /// such rule (netem, or not degraded).
    pub fn nft_dropped(&self, node: &str) -> Result<Option<u64>, NetError> {
        let ns = &self.node(node)?.netns;
        let args = ["netns", "exec", ns, "nft", "list", "table", "inet", NFT_TABLE];
        let out = Command::new("ip")
            .args(args)
            .output()
            .map_err(|source| NetError::Spawn { program: "ip".into(), source })?;
        if !out.status.success() {
            return Ok(None);
        }
        Ok(counter_packets(&String::from_utf8_lossy(&out.stdout)))
    }

    /// Moves the calling thread into the node's namespace: sockets it (and threads it starts)
    /// opens from then on live there. Other threads are not affected.
    pub fn enter(&self, node: &str) -> Result<(), NetError> {
        let ns = &self.node(node)?.netns;
        let enter_err = |reason: String| NetError::Enter { name: ns.clone(), reason };
        let file = File::open(format!("/var/run/netns/{ns}")).map_err(|e| enter_err(e.to_string()))?;
        setns(file, CloneFlags::CLONE_NEWNET).map_err(|e| enter_err(e.to_string()))
    }

    /// The command line prefix that runs a program inside the node.
    pub fn exec_in(&self, node: &str, program: &std::path::Path) -> Result<Command, NetError> {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.node(node)?.netns]).arg(program);
        Ok(cmd)
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        let mut names: Vec<String> = self.nodes.iter().map(|n| n.netns.clone()).collect();
        names.push(self.bridge_ns.clone());
        for ns in names {
            remove_namespace(&ns);
        }
    }
}

/// Random loss with nftables in the namespace (output hook: like netem, only what the node
/// sends) and a token-bucket rate limit on its `eth0`.
fn degrade_without_netem(ns: &str, loss_percent: f64, rate_mbit: u32) -> Result<(), NetError> {
    let nft = |args: &[&str]| {
        let mut full = vec!["netns", "exec", ns, "nft"];
        full.extend_from_slice(args);
        run("ip", &full).map_err(|(_, stderr)| NetError::Nft { args: args.join(" "), stderr })
    };
    nft(&["add", "table", "inet", NFT_TABLE])?;
    nft(&["add", "chain", "inet", NFT_TABLE, "out", "{ type filter hook output priority 0; policy accept; }"])?;
    let threshold = loss_threshold(loss_percent).to_string();
    nft(&[
        "add", "rule", "inet", NFT_TABLE, "out", "numgen", "random", "mod", "10000", "lt", &threshold, "counter",
        "drop",
    ])?;
    let rate = format!("{rate_mbit}mbit");
    let args = [
        "-n", ns, "qdisc", "replace", "dev", NODE_IF, "root", "tbf", "rate", &rate, "burst", "64kb", "latency", "50ms",
    ];
    run("tc", &args).map_err(|(args, stderr)| NetError::Tc { args, stderr })
}

/// The bridge's end of a node's link `link`: `p-<node>` for link 0, `p<k>-<node>` beyond.
fn bridge_port_on(link: usize, node: &str) -> String {
    let mut name = if link == 0 { format!("p-{node}") } else { format!("p{link}-{node}") };
    name.truncate(15);
    name
}

/// Kills every process left in the namespace, then deletes it.
fn remove_namespace(ns: &str) {
    if let Ok(pids) = ip_output(&["netns", "pids", ns]) {
        for pid in pids.split_whitespace().filter_map(|p| p.parse::<i32>().ok()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
    if let Err(e) = ip(&["netns", "del", ns]) {
        tracing::warn!("removing namespace {ns}: {e}");
    }
}

/// The harness namespaces in `ip netns list` output whose harness process is gone.
pub fn stale_namespaces(list: &str, alive: impl Fn(u32) -> bool) -> Vec<String> {
    list.lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| {
            let Some(rest) = name.strip_prefix(PREFIX) else { return false };
            match rest.split('-').next().and_then(|pid| pid.parse::<u32>().ok()) {
                Some(pid) => !alive(pid),
                None => false,
            }
        })
        .map(str::to_string)
        .collect()
}

/// Removes this process's own namespaces and what runs in them: for a harness stopped by a
/// signal, whose destructors will not run.
pub fn remove_own() {
    let own = format!("{PREFIX}{}-", std::process::id());
    let list = ip_output(&["netns", "list"]).unwrap_or_default();
    for ns in list.lines().filter_map(|l| l.split_whitespace().next()).filter(|n| n.starts_with(&own)) {
        remove_namespace(ns);
    }
}

/// Removes the namespaces (and their processes) of harness runs that were killed; returns them.
pub fn remove_stale() -> Result<Vec<String>, NetError> {
    let own = std::process::id();
    let list = ip_output(&["netns", "list"])?;
    let stale = stale_namespaces(&list, |pid| pid == own || kill(Pid::from_raw(pid as i32), None).is_ok());
    for ns in &stale {
        remove_namespace(ns);
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stale_namespaces_are_those_of_dead_harnesses_only() {
        let list = "pdc-41-n1 (id: 3)\npdc-41-br (id: 2)\npdc-77-coord\nother-ns (id: 0)\npdc-x-n1\nxb9a\n";
        let stale = stale_namespaces(list, |pid| pid == 77);
        assert_eq!(stale, ["pdc-41-n1", "pdc-41-br"]);
        assert!(stale_namespaces("", |_| false).is_empty());
    }

    #[test]
    fn bridge_ports_fit_an_interface_name() {
        assert_eq!(bridge_port_on(0, "n1"), "p-n1");
        assert_eq!(bridge_port_on(0, "a-very-long-node-name").len(), 15);
        assert_eq!(bridge_port_on(1, "n1"), "p1-n1");
        assert_eq!(node_ip(0), Ipv4Addr::new(10, 77, 0, 10));
        assert_eq!((link_ip(1, 2), link_if(1)), (Ipv4Addr::new(10, 77, 1, 12), "eth1".to_string()));
    }

    #[test]
    fn impairments_say_what_was_applied() {
        assert_eq!(loss_threshold(2.0), 200);
        assert_eq!(loss_threshold(0.5), 50);
        assert_eq!(loss_threshold(150.0), 10_000);
        let listing = "table inet pdchaos {\n\tchain out {\n\t\tnumgen random mod 10000 < 200 counter packets 42 bytes 6000 drop\n\t}\n}\n";
        assert_eq!(counter_packets(listing), Some(42));
        assert_eq!(counter_packets("table inet pdchaos {}"), None);
        assert_eq!(Impairment::Netem { loss_percent: 2.0, delay_ms: 5 }.to_string(), "netem 2 % loss + 5 ms delay");
        assert_eq!(
            Impairment::NftTbf { loss_percent: 2.0, rate_mbit: 200 }.to_string(),
            "nft 2 % loss + tbf 200 Mbit; no fixed delay: kernel lacks netem"
        );
    }
}
