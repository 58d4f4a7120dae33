//! The sandbox's egress policy, enforced in its network namespace on the
//! host side of the tap, where the guest (even as root with a kernel of
//! its own) cannot reach it.
//!
//! Frames from the guest enter the namespace at the tap's ingress; an
//! nftables `netdev` chain hooked there filters them and forwards what
//! passes to the CNI interface (`fwd to`, the nftables twin of tc's mirred
//! redirect, which the other direction keeps). tc's redirect would bypass
//! every netfilter hook, so this direction is nftables' own.
//!
//! Always dropped: IPv4 link-local (169.254.0.0/16, the cloud metadata
//! address 169.254.169.254 among them) and AWS's IPv6 metadata address
//! fd00:ec2::254; new TCP and UDP to IPv6 link-local addresses; and new
//! connections (TCP SYNs, UDP, pings) to the node's own addresses
//! ([`Node`]: every address in PID 1's network namespace), except DNS
//! (port 53) on the CNI gateway, the pod's resolver when the node runs
//! one. Replies to connections the node makes into the container (health
//! probes, `kubectl port-forward`) still leave. Then by mode (annotation
//! `io.burrow.egress`):
//!
//! - `open` (default): everything else leaves;
//! - `deny`: no new connection leaves: TCP SYNs, UDP and ICMP echo
//!   requests are dropped; replies to connections made to the container
//!   still go out;
//! - an allow-list, `CIDR[:PORT],...` (IPv6 as `[CIDR]:PORT`) where a
//!   DNS name may stand for a CIDR (`pypi.org:443`): new TCP/UDP
//!   connections and pings only to those, as `deny` otherwise. Names are
//!   resolved on the host when the sandbox's NIC is set up and again every
//!   [`super::egress_dns::REFRESH`] ([`super::egress_dns`]); a name that
//!   resolves to nothing allows nothing.
//!
//! The chain is stateless (a `netdev` hook has no conntrack): it stops new
//! connections, not a root guest that hand-crafts non-SYN TCP segments.
//! Fragments, whose ports and flags a stateless rule cannot see, never
//! reach the node, nor leave at all but in `open` mode.
//! The table goes with the namespace, and [`teardown`] removes it before.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::process::{Command, Stdio};
use std::str::FromStr;

use burrow_protocol::net::Cidr;

use crate::sandbox::{Result, SandboxError};

/// The annotation that picks the mode.
pub const ANNOTATION: &str = "io.burrow.egress";
/// The nftables table, in the sandbox's namespace.
pub const TABLE: &str = "burrow_egress";
/// Most allow-list entries.
pub const MAX_ALLOW: usize = 64;

/// Where an allow-list entry lets connections go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dest {
    Net(Cidr),
    /// A DNS name, resolved on the host.
    Name(String),
}

impl std::fmt::Display for Dest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Net(c) => write!(f, "{c}"),
            Self::Name(n) => f.write_str(n),
        }
    }
}

/// One allow-list entry: a destination, optionally one port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    pub dest: Dest,
    pub port: Option<u16>,
}

/// What each name of an allow-list resolved to (sorted, so that two
/// resolutions compare equal when the addresses are the same).
pub type Resolved = std::collections::BTreeMap<String, std::collections::BTreeSet<IpAddr>>;

/// Most node addresses written into the table (a node has a handful; a
/// cap keeps the script bounded on one with thousands).
pub const MAX_NODE_ADDRS: usize = 256;

/// The node's own addresses, which new connections from the guest never
/// reach, and the gateways whose DNS port stays open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Node {
    addrs: BTreeSet<IpAddr>,
    dns: BTreeSet<IpAddr>,
}

impl Node {
    /// `addrs` as read from the node, less those other rules cover
    /// (loopback: never routed out of the namespace; link-local: dropped
    /// above), keeping port 53 open on those of `gateways` among them.
    pub fn new(addrs: impl IntoIterator<Item = IpAddr>, gateways: &[IpAddr]) -> Self {
        let addrs: BTreeSet<IpAddr> = addrs
            .into_iter()
            .filter(|ip| match ip {
                IpAddr::V4(v4) => !v4.is_loopback() && !v4.is_link_local() && !v4.is_unspecified(),
                IpAddr::V6(v6) => {
                    !v6.is_loopback()
                        && !v6.is_unspecified()
                        && (v6.segments()[0] & 0xffc0) != 0xfe80
                }
            })
            .take(MAX_NODE_ADDRS)
            .collect();
        let dns = gateways
            .iter()
            .filter(|g| addrs.contains(g))
            .copied()
            .collect();
        Self { addrs, dns }
    }

    /// The drops for the node's addresses, as nftables rules.
    fn rules(&self, s: &mut String) {
        let new_tcp = "tcp flags & (syn | ack) == syn";
        for (fam, v4, icmp) in [("ip", true, "icmp"), ("ip6", false, "icmpv6")] {
            let set = |which: &mut dyn Iterator<Item = &IpAddr>| {
                let list: Vec<String> = which
                    .filter(|ip| ip.is_ipv4() == v4)
                    .map(|ip| ip.to_string())
                    .collect();
                (!list.is_empty()).then(|| format!("{{ {} }}", list.join(", ")))
            };
            let Some(all) = set(&mut self.addrs.iter()) else {
                continue;
            };
            // Fragments first: a port or a TCP flag is only in a first
            // fragment, and a tiny one may not hold the flags at all.
            let _ = writeln!(
                s,
                "    {fam} daddr {all} {} counter drop",
                FRAGMENT[usize::from(!v4)]
            );
            // The gateway's resolver first: only its port 53 is spared.
            if let Some(dns) = set(&mut self.dns.iter()) {
                let _ = writeln!(
                    s,
                    "    {fam} daddr {dns} tcp dport != 53 {new_tcp} counter drop"
                );
                let _ = writeln!(s, "    {fam} daddr {dns} udp dport != 53 counter drop");
            }
            let others = set(&mut self.addrs.iter().filter(|ip| !self.dns.contains(ip)));
            if let Some(others) = others {
                let _ = writeln!(s, "    {fam} daddr {others} {new_tcp} counter drop");
                let _ = writeln!(s, "    {fam} daddr {others} meta l4proto udp counter drop");
            }
            let _ = writeln!(
                s,
                "    {fam} daddr {all} {icmp} type echo-request counter drop"
            );
        }
    }
}

/// An IPv4 fragment (more to come, or not the first), and an IPv6 one.
const FRAGMENT: [&str; 2] = ["ip frag-off & 0x3fff != 0", "exthdr frag exists"];

/// Longest DNS name accepted.
const MAX_NAME: usize = 253;

/// A DNS host name: two or more dot-separated labels of letters, digits
/// and hyphens (not at a label's ends), at least one letter somewhere (so
/// that neither a mistyped mode nor a mistyped address is taken for a
/// name).
fn dns_name(s: &str) -> Option<String> {
    let s = s.strip_suffix('.').unwrap_or(s);
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    (s.len() <= MAX_NAME
        && s.contains('.')
        && s.split('.').all(label_ok)
        && s.bytes().any(|b| b.is_ascii_alphabetic()))
    .then(|| s.to_ascii_lowercase())
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Egress {
    #[default]
    Open,
    Deny,
    Allow(Vec<Allow>),
}

fn bad(msg: String) -> SandboxError {
    SandboxError::InvalidArgument(format!("{ANNOTATION}: {msg}"))
}

fn dest(s: &str) -> std::result::Result<Dest, String> {
    if s.contains('/') {
        s.parse().map(Dest::Net)
    } else if let Ok(ip) = s.parse::<IpAddr>() {
        Cidr::new(ip, if ip.is_ipv4() { 32 } else { 128 }).map(Dest::Net)
    } else {
        dns_name(s)
            .map(Dest::Name)
            .ok_or_else(|| format!("{s:?} is neither an address nor a DNS name"))
    }
}

impl FromStr for Allow {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        let (net, port) = if let Some(rest) = s.strip_prefix('[') {
            let (net, after) = rest
                .split_once(']')
                .ok_or_else(|| format!("{s:?}: no ']'"))?;
            match after.strip_prefix(':') {
                Some(p) => (net, Some(p)),
                None if after.is_empty() => (net, None),
                None => return Err(format!("{s:?}: junk after ']'")),
            }
        } else {
            match s.split_once(':') {
                Some((n, p)) if !n.contains(':') && !p.contains(':') => (n, Some(p)),
                Some(_) => (s, None),
                None => (s, None),
            }
        };
        let port = port
            .map(|p| {
                p.parse::<u16>()
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| format!("{s:?}: port {p:?}"))
            })
            .transpose()?;
        Ok(Self {
            dest: dest(net)?,
            port,
        })
    }
}

impl Egress {
    /// The mode the spec's annotation asks for (`open` without one).
    pub fn from_spec(spec: &serde_json::Value) -> Result<Self> {
        match crate::spec::annotation(spec, ANNOTATION) {
            None => Ok(Self::Open),
            Some(v) => v.parse().map_err(bad),
        }
    }

    /// The DNS names of the allow-list.
    pub fn names(&self) -> Vec<String> {
        match self {
            Self::Allow(list) => list
                .iter()
                .filter_map(|a| match &a.dest {
                    Dest::Name(n) => Some(n.clone()),
                    Dest::Net(_) => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The nftables script for tap `tap` forwarding to `out`, with the
    /// allow-list's names standing for the addresses in `resolved`, and
    /// `node`'s addresses closed to new connections.
    pub fn ruleset(&self, tap: &str, out: &str, resolved: &Resolved, node: &Node) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "table netdev {TABLE} {{");
        let _ = writeln!(s, "  chain from_guest {{");
        let _ = writeln!(
            s,
            "    type filter hook ingress device \"{tap}\" priority 0; policy drop;"
        );
        let _ = writeln!(s, "    ip daddr 169.254.0.0/16 counter drop");
        let _ = writeln!(s, "    ip6 daddr fd00:ec2::254 counter drop");
        let _ = writeln!(
            s,
            "    ip6 daddr fe80::/10 tcp flags & (syn | ack) == syn counter drop"
        );
        let _ = writeln!(s, "    ip6 daddr fe80::/10 meta l4proto udp counter drop");
        node.rules(&mut s);
        let fwd = format!("fwd to \"{out}\"");
        if *self != Self::Open {
            // A stateless filter cannot tell a fragment's connection: no
            // fragment leaves (a crafted first fragment too small to hold
            // the TCP flags would slip a SYN past the rules below).
            for frag in FRAGMENT {
                let _ = writeln!(s, "    {frag} counter drop");
            }
        }
        if let Self::Allow(list) = self {
            for a in list {
                let nets: Vec<Cidr> = match &a.dest {
                    Dest::Net(c) => vec![*c],
                    Dest::Name(n) => resolved
                        .get(n)
                        .into_iter()
                        .flatten()
                        .filter_map(|ip| Cidr::new(*ip, if ip.is_ipv4() { 32 } else { 128 }).ok())
                        .collect(),
                };
                for net in nets {
                    let fam = if net.ip.is_ipv4() { "ip" } else { "ip6" };
                    match a.port {
                        Some(p) => {
                            for proto in ["tcp", "udp"] {
                                let _ =
                                    writeln!(s, "    {fam} daddr {net} {proto} dport {p} {fwd}");
                            }
                        }
                        None => {
                            let _ = writeln!(s, "    {fam} daddr {net} {fwd}");
                        }
                    }
                }
            }
        }
        if *self != Self::Open {
            let _ = writeln!(s, "    tcp flags & (syn | ack) == syn counter drop");
            let _ = writeln!(s, "    meta l4proto udp counter drop");
            let _ = writeln!(s, "    icmp type echo-request counter drop");
            let _ = writeln!(s, "    icmpv6 type echo-request counter drop");
        }
        let _ = writeln!(s, "    {fwd}");
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "}}");
        s
    }
}

impl FromStr for Egress {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim() {
            "" | "open" => Ok(Self::Open),
            "deny" => Ok(Self::Deny),
            list => {
                let entries: Vec<Allow> = list
                    .split(',')
                    .map(|e| e.trim().parse())
                    .collect::<std::result::Result<_, _>>()?;
                if entries.len() > MAX_ALLOW {
                    return Err(format!("more than {MAX_ALLOW} entries"));
                }
                Ok(Self::Allow(entries))
            }
        }
    }
}

/// Load `script` with `nft -f -`. Must run on a thread inside the
/// sandbox's namespace (the child inherits it).
pub fn nft(script: &str) -> Result<()> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            SandboxError::FailedPrecondition(format!(
                "sandbox network: running nft (apt-get install nftables): {e}"
            ))
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| SandboxError::Internal(format!("nft: {e}")))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| SandboxError::Internal(format!("nft: {e}")))?;
    if !out.status.success() {
        return Err(SandboxError::FailedPrecondition(format!(
            "sandbox network: nft: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Remove the table (on a thread inside the namespace).
pub fn teardown() -> Result<()> {
    nft(&format!("delete table netdev {TABLE}\n"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_refuse_nonsense() {
        assert_eq!("open".parse::<Egress>().unwrap(), Egress::Open);
        assert_eq!("deny".parse::<Egress>().unwrap(), Egress::Deny);
        let Egress::Allow(l) = "10.0.0.0/8:443, 192.168.1.5, [fd00::/64]:53, fd00::1"
            .parse::<Egress>()
            .unwrap()
        else {
            panic!("an allow-list");
        };
        assert_eq!(l.len(), 4);
        assert_eq!(
            (l[0].dest.to_string(), l[0].port),
            ("10.0.0.0/8".into(), Some(443))
        );
        assert_eq!(
            (l[1].dest.to_string(), l[1].port),
            ("192.168.1.5/32".into(), None)
        );
        assert_eq!(
            (l[2].dest.to_string(), l[2].port),
            ("fd00::/64".into(), Some(53))
        );
        assert_eq!(
            (l[3].dest.to_string(), l[3].port),
            ("fd00::1/128".into(), None)
        );
        for bad in [
            "closed",
            "10.0.0.0/33",
            "10.0.0.1:0",
            "10.0.0.1:99999",
            "[fd00::1",
            "exa_mple.com:443",
            "-example.com",
            "10.0.0.256",
            "example..com",
        ] {
            assert!(bad.parse::<Egress>().is_err(), "{bad}");
        }
        let Egress::Allow(named) = "PyPI.org:443, files.pythonhosted.org."
            .parse::<Egress>()
            .unwrap()
        else {
            panic!("an allow-list");
        };
        assert_eq!(
            named,
            [
                Allow {
                    dest: Dest::Name("pypi.org".into()),
                    port: Some(443)
                },
                Allow {
                    dest: Dest::Name("files.pythonhosted.org".into()),
                    port: None
                },
            ]
        );
        assert!(format!("{}.com", "a".repeat(MAX_NAME))
            .parse::<Egress>()
            .is_err());
        let many = vec!["10.0.0.1"; MAX_ALLOW + 1].join(",");
        assert!(many.parse::<Egress>().is_err());
    }

    #[test]
    fn every_mode_drops_metadata_and_only_open_lets_new_connections_out() {
        for mode in [
            Egress::Open,
            Egress::Deny,
            "10.1.0.0/16:80".parse().unwrap(),
        ] {
            let r = mode.ruleset("burrow0", "eth0", &Resolved::new(), &Node::default());
            assert!(r.contains("hook ingress device \"burrow0\""), "{r}");
            assert!(r.contains("ip daddr 169.254.0.0/16 counter drop"), "{r}");
            assert!(r.contains("ip6 daddr fd00:ec2::254 counter drop"), "{r}");
            assert!(r.trim_end().ends_with("fwd to \"eth0\"\n  }\n}"), "{r}");
            assert_eq!(
                r.contains("\n    ip frag-off & 0x3fff != 0 counter drop")
                    && r.contains("\n    exthdr frag exists counter drop"),
                mode != Egress::Open,
                "no fragment leaves but in open mode: {r}"
            );
            assert_eq!(
                r.contains("\n    tcp flags & (syn | ack) == syn"),
                mode != Egress::Open,
                "{r}"
            );
        }
        let r = "10.1.0.0/16:80".parse::<Egress>().unwrap().ruleset(
            "t",
            "e",
            &Resolved::new(),
            &Node::default(),
        );
        let allow = r.find("ip daddr 10.1.0.0/16 tcp dport 80 fwd").unwrap();
        let deny = r.find("\n    tcp flags & (syn | ack)").unwrap();
        assert!(
            allow < deny,
            "allowed destinations come before the drops: {r}"
        );
    }

    #[test]
    fn a_name_stands_for_what_it_resolved_to_and_nothing_else() {
        let mode: Egress = "api.example.com:443, 10.9.0.0/16".parse().unwrap();
        assert_eq!(mode.names(), ["api.example.com"]);
        let none = mode.ruleset("t", "e", &Resolved::new(), &Node::default());
        assert!(
            !none.contains("dport 443"),
            "unresolved: allows nothing: {none}"
        );
        assert!(none.contains("ip daddr 10.9.0.0/16 fwd"), "{none}");
        let mut resolved = Resolved::new();
        resolved.insert(
            "api.example.com".into(),
            ["10.1.2.3".parse().unwrap(), "fd00::7".parse().unwrap()].into(),
        );
        let r = mode.ruleset("t", "e", &resolved, &Node::default());
        for rule in [
            "ip daddr 10.1.2.3/32 tcp dport 443 fwd",
            "ip daddr 10.1.2.3/32 udp dport 443 fwd",
            "ip6 daddr fd00::7/128 tcp dport 443 fwd",
        ] {
            assert!(r.contains(rule), "{rule}: {r}");
        }
        assert!(Egress::Deny.names().is_empty());
    }

    #[test]
    fn the_node_is_closed_to_new_connections_in_every_mode_but_its_gateways_dns() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let node = Node::new(
            [
                "10.88.0.1",
                "192.168.5.7",
                "127.0.0.1",
                "169.254.1.1",
                "fe80::1",
                "fd00::5",
            ]
            .map(ip),
            &[ip("10.88.0.1"), ip("10.99.0.1")],
        );
        for mode in [
            Egress::Open,
            Egress::Deny,
            "192.168.5.0/24".parse().unwrap(),
        ] {
            let r = mode.ruleset("t", "e", &Resolved::new(), &node);
            for rule in [
                "ip daddr { 10.88.0.1 } tcp dport != 53 tcp flags & (syn | ack) == syn counter drop",
                "ip daddr { 10.88.0.1 } udp dport != 53 counter drop",
                "ip daddr { 192.168.5.7 } tcp flags & (syn | ack) == syn counter drop",
                "ip daddr { 192.168.5.7 } meta l4proto udp counter drop",
                "ip daddr { 10.88.0.1, 192.168.5.7 } icmp type echo-request counter drop",
                "ip daddr { 10.88.0.1, 192.168.5.7 } ip frag-off & 0x3fff != 0 counter drop",
                "ip6 daddr { fd00::5 } exthdr frag exists counter drop",
                "ip6 daddr { fd00::5 } tcp flags & (syn | ack) == syn counter drop",
                "ip6 daddr fe80::/10 meta l4proto udp counter drop",
            ] {
                assert!(r.contains(rule), "{mode:?}: {rule}\n{r}");
            }
            assert!(
                !r.contains("127.0.0.1") && !r.contains("fe80::1 ") && !r.contains("10.99"),
                "{r}"
            );
            // Before anything that forwards, the allow-list included.
            let node_at = r.find("192.168.5.7").unwrap();
            assert!(r.find("fwd").unwrap() > node_at, "{r}");
        }
        let many = Node::new(
            (0..=u16::MAX).map(|i| IpAddr::from([10, 0, (i >> 8) as u8, i as u8])),
            &[],
        );
        assert_eq!(many.addrs.len(), MAX_NODE_ADDRS);
        let none = Egress::Open.ruleset("t", "e", &Resolved::new(), &Node::default());
        assert!(!none.contains("daddr {"), "no empty sets: {none}");
    }
}
