//! The sandbox's egress policy, enforced in its network namespace on the
//! host side of the tap, where the guest (even as root with a kernel of
//! its own) cannot reach it.
//!
//! One nftables `netdev` table joins the tap to the CNI interface: a chain
//! on the tap's ingress filters the guest's frames and forwards what
//! passes to the CNI interface (`fwd to`), and a chain on the CNI
//! interface's ingress forwards everything to the tap, recording flows on
//! the way. (tc's mirred redirect used to carry that direction; tc's
//! ingress runs before netfilter's, so packets it redirected were never
//! seen by a chain that could record them.)
//!
//! Always dropped: IPv4 link-local (169.254.0.0/16, the cloud metadata
//! address 169.254.169.254 among them) and AWS's IPv6 metadata address
//! fd00:ec2::254; new TCP and UDP to IPv6 link-local addresses; and new
//! connections (TCP SYNs, UDP, pings) to the node's own addresses
//! ([`Node`]: every address in PID 1's network namespace), except DNS
//! (port 53) on the CNI gateway, the pod's resolver when the node runs
//! one. Then by mode (annotation `io.burrow.egress`):
//!
//! - `open` (default): everything else leaves; nothing is recorded;
//! - `deny`: nothing leaves but packets of flows the outside opened: a
//!   TCP segment or UDP datagram into the guest records its flow (the
//!   guest's addresses and ports, the peer's, the protocol) in a dynamic
//!   set, and the guest's packets leave only when they carry a recorded
//!   flow, refreshing it; pings into the guest likewise let their echo
//!   replies out. Connections the node makes into the container (health
//!   probes, `kubectl port-forward`) work; a root guest's hand-made
//!   segments (non-SYN, with a payload) to anywhere else are dropped, as
//!   are all other IP protocols, ICMP but those echo replies, fragments
//!   and non-IP frames but ARP (ICMPv6 neighbour discovery and MLD stay);
//! - an allow-list, `CIDR[:PORT],...` (IPv6 as `[CIDR]:PORT`) where a
//!   DNS name may stand for a CIDR (`pypi.org:443`): as `deny`, and TCP
//!   and UDP to those (every protocol to a CIDR without a port) also
//!   leave, each new flow recorded so that it outlives a change of what
//!   a name resolves to. Names are resolved on the host when the
//!   sandbox's NIC is set up and again every [`super::egress_dns::REFRESH`]
//!   ([`super::egress_dns`]); a name that resolves to nothing allows
//!   nothing.
//!
//! Flows are keyed by the guest's address and port, the peer's, and the
//! protocol. TCP: a SYN or SYN-ACK, and a FIN or RST (after which the
//! flow is marked closing), keep it [`SHORT`]; other segments
//! [`TCP_IDLE`]. UDP: [`UDP_TIMEOUT`]. Each set holds at most
//! [`MAX_FLOWS`]: when full, new flows are not recorded (their packets
//! from the guest are dropped) until some expire, and the host's memory
//! stays bounded. The table is loaded and reloaded (the allow-list's
//! names changing) by one script that flushes and refills the chains and
//! declares the sets again, which keeps what they hold; it outlives the
//! VMM (hibernate and wake keep every flow). A table that lost its flows
//! (a restore into the namespace after the sandbox was deleted) records
//! an established connection again from its next segment from outside.
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

    /// The nftables script for tap `tap` joined to `out` (each way an
    /// ingress chain that forwards), with the allow-list's names standing
    /// for the addresses in `resolved`, and `node`'s addresses closed to
    /// new connections. The same script loads the table and reloads it
    /// (one transaction): the chains are flushed and refilled, the flow
    /// sets are declared again and so kept with what they hold.
    pub fn ruleset(&self, tap: &str, out: &str, resolved: &Resolved, node: &Node) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "table netdev {TABLE} {{");
        for fam in [V4, V6] {
            for (set, size) in [
                (fam.flows, MAX_FLOWS),
                (fam.closing, MAX_FLOWS),
                (fam.pings, MAX_PINGS),
            ] {
                let key = if set == fam.pings {
                    format!("typeof {fam} saddr . {fam} daddr . {} id", fam.icmp)
                } else {
                    format!(
                        "type {} . {0} . inet_proto . inet_service . inet_service",
                        fam.addr
                    )
                };
                let _ = writeln!(
                    s,
                    "  set {set} {{ {key}; flags dynamic,timeout; size {size}; }}"
                );
            }
        }
        let _ = writeln!(
            s,
            "  chain {FROM_GUEST} {{ type filter hook ingress device \"{tap}\" priority 0; policy drop; }}"
        );
        let _ = writeln!(
            s,
            "  chain {TO_GUEST} {{ type filter hook ingress device \"{out}\" priority 0; policy accept; }}"
        );
        let _ = writeln!(s, "}}");
        for chain in [FROM_GUEST, TO_GUEST] {
            let _ = writeln!(s, "flush chain netdev {TABLE} {chain}");
        }
        let _ = writeln!(s, "table netdev {TABLE} {{");
        let _ = writeln!(s, "  chain {FROM_GUEST} {{");
        self.outbound_rules(&mut s, out, resolved, node);
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "  chain {TO_GUEST} {{");
        if *self != Self::Open {
            for fam in [V4, V6] {
                fam.flow_rules(&mut s, Dir::ToGuest, &format!("fwd to \"{tap}\""));
            }
        }
        let _ = writeln!(s, "    fwd to \"{tap}\"");
        let _ = writeln!(s, "  }}");
        let _ = writeln!(s, "}}");
        s
    }

    fn outbound_rules(&self, s: &mut String, out: &str, resolved: &Resolved, node: &Node) {
        let _ = writeln!(s, "    ip daddr 169.254.0.0/16 counter drop");
        let _ = writeln!(s, "    ip6 daddr fd00:ec2::254 counter drop");
        let _ = writeln!(
            s,
            "    ip6 daddr fe80::/10 tcp flags & (syn | ack) == syn counter drop"
        );
        let _ = writeln!(s, "    ip6 daddr fe80::/10 meta l4proto udp counter drop");
        node.rules(s);
        let fwd = format!("fwd to \"{out}\"");
        if *self == Self::Open {
            let _ = writeln!(s, "    {fwd}");
            return;
        }
        // A fragment's ports are not in it (and a tiny first fragment
        // may not hold the TCP flags): no fragment leaves.
        for frag in FRAGMENT {
            let _ = writeln!(s, "    {frag} counter drop");
        }
        // What belongs to a flow already seen leaves.
        for fam in [V4, V6] {
            fam.flow_rules(s, Dir::FromGuest, &fwd);
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
                    let fam = if net.ip.is_ipv4() { V4 } else { V6 };
                    // A new connection to a listed destination: recorded,
                    // so that it outlives a change of what a name
                    // resolves to, and forwarded.
                    let port = a.port.map(|p| format!(" th dport {p}")).unwrap_or_default();
                    for (proto, timeout) in [("tcp", SHORT), ("udp", UDP_TIMEOUT)] {
                        let _ = writeln!(
                            s,
                            "    {fam} daddr {net} meta l4proto {proto}{port} update @{} {{ {} timeout {timeout} }} {fwd}",
                            fam.flows,
                            fam.key(Dir::FromGuest)
                        );
                    }
                    if a.port.is_none() {
                        let _ = writeln!(s, "    {fam} daddr {net} {fwd}");
                    }
                }
            }
        }
        // Nothing else of TCP and UDP, no ICMP but echo replies to pings
        // recorded above and IPv6's neighbour discovery, no other
        // protocol: a hostile guest has no channel out but its flows.
        let _ = writeln!(s, "    meta l4proto {{ tcp, udp }} counter drop");
        let _ = writeln!(s, "    meta l4proto icmp counter drop");
        let _ = writeln!(
            s,
            "    icmpv6 type != {{ nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert, mld-listener-report, mld2-listener-report }} counter drop"
        );
        let _ = writeln!(
            s,
            "    meta protocol {{ ip, ip6 }} meta l4proto != ipv6-icmp counter drop"
        );
        let _ = writeln!(s, "    meta protocol != {{ ip, ip6, arp }} counter drop");
        let _ = writeln!(s, "    {fwd}");
    }
}

/// The chain on the tap's ingress (guest to outside) and the one on the
/// CNI interface's (outside to guest).
const FROM_GUEST: &str = "from_guest";
const TO_GUEST: &str = "to_guest";

/// Most flows (and as many closing ones) per address family: a guest or
/// a peer that opens more finds new connections refused (or their
/// replies dropped) until some time out; the host's memory stays bounded
/// (an element is a few hundred bytes: ~10 MiB per family at most).
pub const MAX_FLOWS: usize = 65536;
/// Most pings awaiting their echo reply, per family.
const MAX_PINGS: usize = 1024;
/// An idle TCP connection is forgotten after this: longer than Linux's
/// default keepalive (2 h, then 9 probes 75 s apart), so a connection
/// kept alive by keepalives on either end is never forgotten.
const TCP_IDLE: &str = "3h";
/// A TCP handshake (SYN or SYN-ACK seen) or a closing connection (FIN or
/// RST seen; what conntrack's TIME_WAIT waits too) is forgotten after
/// this; it is the timeout of a new connection to a listed destination.
const SHORT: &str = "2m";
/// UDP: conntrack's timeout for a UDP stream.
const UDP_TIMEOUT: &str = "2m";
/// A ping from outside awaits its echo reply this long.
const PING_TIMEOUT: &str = "30s";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    FromGuest,
    ToGuest,
}

/// What differs between IPv4 and IPv6 in the flow rules.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Fam {
    /// `ip` or `ip6`.
    name: &'static str,
    addr: &'static str,
    icmp: &'static str,
    flows: &'static str,
    closing: &'static str,
    pings: &'static str,
}

const V4: Fam = Fam {
    name: "ip",
    addr: "ipv4_addr",
    icmp: "icmp",
    flows: "flows4",
    closing: "closing4",
    pings: "pings4",
};
const V6: Fam = Fam {
    name: "ip6",
    addr: "ipv6_addr",
    icmp: "icmpv6",
    flows: "flows6",
    closing: "closing6",
    pings: "pings6",
};

impl std::fmt::Display for Fam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

impl Fam {
    /// A flow's key, as the guest's packets carry it: guest address,
    /// peer address, protocol, guest port, peer port.
    fn key(self, dir: Dir) -> String {
        let n = self.name;
        match dir {
            Dir::FromGuest => format!("{n} saddr . {n} daddr . meta l4proto . th sport . th dport"),
            Dir::ToGuest => format!("{n} daddr . {n} saddr . meta l4proto . th dport . th sport"),
        }
    }

    /// The rules that record and refresh flows, each ending in `act`.
    /// From the guest, only a packet of a recorded flow matches; towards
    /// it every TCP segment and UDP datagram records its flow (a peer
    /// could as well open a new connection: no less safe, and a
    /// connection into the container outlives a table that lost its
    /// flows), pings are recorded for their replies.
    fn flow_rules(self, s: &mut String, dir: Dir, act: &str) {
        let key = self.key(dir);
        let (flows, closing) = (self.flows, self.closing);
        let known = match dir {
            Dir::FromGuest => format!(" {key} @{flows}"),
            Dir::ToGuest => String::new(),
        };
        // The family said outright: a payload in a set's key brings no
        // dependency on it along.
        let proto = match self.name {
            "ip" => "meta protocol ip",
            _ => "meta protocol ip6",
        };
        let tcp = format!("{proto} meta l4proto tcp");
        // FIN or RST: closing; forgotten soon, whatever comes after.
        let _ = writeln!(
            s,
            "    {tcp} {key} @{flows} tcp flags & (fin | rst) != 0 update @{closing} {{ {key} timeout {SHORT} }} update @{flows} {{ {key} timeout {SHORT} }} {act}"
        );
        let _ = writeln!(
            s,
            "    {tcp}{known} {key} @{closing} update @{flows} {{ {key} timeout {SHORT} }} {act}"
        );
        let _ = writeln!(
            s,
            "    {tcp}{known} tcp flags & (syn | fin | rst) == syn update @{flows} {{ {key} timeout {SHORT} }} {act}"
        );
        let _ = writeln!(
            s,
            "    {tcp}{known} tcp flags & (fin | rst) == 0 update @{flows} {{ {key} timeout {TCP_IDLE} }} {act}"
        );
        let _ = writeln!(
            s,
            "    {proto} meta l4proto udp{known} update @{flows} {{ {key} timeout {UDP_TIMEOUT} }} {act}"
        );
        let (icmp, n, pings) = (self.icmp, self.name, self.pings);
        match dir {
            Dir::FromGuest => {
                let _ = writeln!(
                    s,
                    "    {icmp} type echo-reply {n} saddr . {n} daddr . {icmp} id @{pings} {act}"
                );
            }
            Dir::ToGuest => {
                let _ = writeln!(
                    s,
                    "    {icmp} type echo-request update @{pings} {{ {n} daddr . {n} saddr . {icmp} id timeout {PING_TIMEOUT} }} {act}"
                );
            }
        }
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

    /// The rules of chain `name` in script `r` (its last definition).
    fn chain<'a>(r: &'a str, name: &str) -> Vec<&'a str> {
        let start = r.rfind(&format!("  chain {name} {{\n")).unwrap();
        r[start..]
            .lines()
            .skip(1)
            .take_while(|l| *l != "  }")
            .map(str::trim)
            .collect()
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
            assert!(r.contains("hook ingress device \"eth0\""), "{r}");
            let out = chain(&r, FROM_GUEST);
            assert_eq!(out[0], "ip daddr 169.254.0.0/16 counter drop", "{r}");
            assert!(out.contains(&"ip6 daddr fd00:ec2::254 counter drop"), "{r}");
            assert_eq!(out.last(), Some(&"fwd to \"eth0\""), "{r}");
            assert_eq!(
                out.contains(&"ip frag-off & 0x3fff != 0 counter drop")
                    && out.contains(&"exthdr frag exists counter drop"),
                mode != Egress::Open,
                "no fragment leaves but in open mode: {r}"
            );
            assert_eq!(
                out.contains(&"meta l4proto { tcp, udp } counter drop"),
                mode != Egress::Open,
                "{r}"
            );
            // Towards the guest everything is forwarded.
            let into = chain(&r, TO_GUEST);
            assert_eq!(into.last(), Some(&"fwd to \"burrow0\""), "{r}");
            assert!(
                into.iter().all(|l| l.ends_with("fwd to \"burrow0\"")),
                "{r}"
            );
        }
        let r = "10.1.0.0/16:80".parse::<Egress>().unwrap().ruleset(
            "t",
            "e",
            &Resolved::new(),
            &Node::default(),
        );
        let allow = r
            .find("ip daddr 10.1.0.0/16 meta l4proto tcp th dport 80 update @flows4")
            .unwrap();
        let deny = r
            .find("\n    meta l4proto { tcp, udp } counter drop")
            .unwrap();
        assert!(
            allow < deny,
            "allowed destinations come before the drops: {r}"
        );
    }

    #[test]
    fn open_mode_records_nothing_and_forwards_everything_but_the_always_closed() {
        let r = Egress::Open.ruleset("t", "e", &Resolved::new(), &Node::default());
        assert!(!r.contains("update @"), "{r}");
        assert_eq!(chain(&r, TO_GUEST), ["fwd to \"t\""]);
        let out = chain(&r, FROM_GUEST);
        assert!(
            out[..out.len() - 1].iter().all(|l| l.ends_with("drop")),
            "{r}"
        );
    }

    #[test]
    fn under_deny_only_packets_of_recorded_flows_leave() {
        let r = Egress::Deny.ruleset("t", "e", &Resolved::new(), &Node::default());
        let out = chain(&r, FROM_GUEST);
        let (last, rest) = out.split_last().unwrap();
        assert_eq!(*last, "fwd to \"e\"");
        for rule in rest.iter().filter(|l| l.contains("fwd")) {
            // Every forward looks the packet's flow up first.
            let flow = rule
                .contains(" saddr . ip daddr . meta l4proto . th sport . th dport @flows4 ")
                || rule
                    .contains(" saddr . ip6 daddr . meta l4proto . th sport . th dport @flows6 ");
            let ping = rule.contains(" id @pings");
            assert!(flow || ping, "forwards without a recorded flow: {rule}");
        }
        // What the final forward still lets out: ARP and IPv6's
        // neighbour discovery, nothing else of IP.
        for drop in [
            "meta l4proto { tcp, udp } counter drop",
            "meta l4proto icmp counter drop",
            "meta protocol { ip, ip6 } meta l4proto != ipv6-icmp counter drop",
            "meta protocol != { ip, ip6, arp } counter drop",
        ] {
            assert!(rest.contains(&drop), "{drop}: {r}");
        }
        assert!(
            rest.iter().any(|l| l.starts_with(
                "icmpv6 type != { nd-router-solicit, nd-neighbor-solicit, nd-neighbor-advert"
            ) && l.ends_with("counter drop")),
            "{r}"
        );
        // Towards the guest, every TCP segment and UDP datagram records
        // its flow as the guest's reply will carry it; FIN and RST
        // shorten it, an established segment keeps it for TCP_IDLE.
        let into = chain(&r, TO_GUEST);
        let key4 = "ip daddr . ip saddr . meta l4proto . th dport . th sport";
        for want in [
            format!("meta protocol ip meta l4proto tcp tcp flags & (syn | fin | rst) == syn update @flows4 {{ {key4} timeout {SHORT} }}"),
            format!("meta protocol ip meta l4proto tcp tcp flags & (fin | rst) == 0 update @flows4 {{ {key4} timeout {TCP_IDLE} }}"),
            format!("meta protocol ip meta l4proto udp update @flows4 {{ {key4} timeout {UDP_TIMEOUT} }}"),
            format!("meta protocol ip meta l4proto tcp {key4} @flows4 tcp flags & (fin | rst) != 0 update @closing4 {{ {key4} timeout {SHORT} }}"),
            "meta protocol ip6 meta l4proto udp update @flows6 { ip6 daddr . ip6 saddr . meta l4proto . th dport . th sport timeout 2m }".into(),
            "icmp type echo-request update @pings4 { ip daddr . ip saddr . icmp id timeout 30s }".into(),
        ] {
            assert!(
                into.iter().any(|l| l.starts_with(&want)),
                "{want}\n{r}"
            );
        }
    }

    #[test]
    fn flows_outlive_a_reload_and_are_bounded() {
        let mode: Egress = "pypi.org:443".parse().unwrap();
        let r = mode.ruleset("t", "e", &Resolved::new(), &Node::default());
        // Loading and reloading are the same script: the table and its
        // sets declared (kept if there), the chains flushed and refilled.
        assert!(!r.contains("delete"), "{r}");
        assert!(
            r.contains(&format!(
                "flush chain netdev {TABLE} from_guest\nflush chain netdev {TABLE} to_guest\n"
            )),
            "{r}"
        );
        for set in ["flows4", "closing4", "flows6", "closing6"] {
            assert!(
                r.contains(&format!("  set {set} {{ type "))
                    && r.contains(&format!("; flags dynamic,timeout; size {MAX_FLOWS}; }}")),
                "{set}: {r}"
            );
        }
        assert!(r.contains(&format!("  set pings6 {{ typeof ip6 saddr . ip6 daddr . icmpv6 id; flags dynamic,timeout; size {MAX_PINGS}; }}")), "{r}");
        let decl = r.find("policy drop; }").unwrap();
        let flush = r.find("flush chain").unwrap();
        assert!(decl < flush, "{r}");
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
            "ip daddr 10.1.2.3/32 meta l4proto tcp th dport 443 update @flows4",
            "ip daddr 10.1.2.3/32 meta l4proto udp th dport 443 update @flows4",
            "ip6 daddr fd00::7/128 meta l4proto tcp th dport 443 update @flows6",
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
            let out = chain(&r, FROM_GUEST);
            let node_at = out.iter().position(|l| l.contains("192.168.5.7")).unwrap();
            let fwd_at = out.iter().position(|l| l.contains("fwd")).unwrap();
            assert!(fwd_at > node_at, "{r}");
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
