//! The guest's network configuration, as the shim reads it from the
//! container's network namespace and the agent applies it to the guest's
//! NIC. It travels on the guest kernel command line as one word,
//! `burrow.net=mac=..;mtu=..;addr=IP/P;...;route=DST/P@GW;...`, so the
//! agent has it before anything else starts and a restored guest (which
//! keeps its configured NIC) needs nothing new.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// The kernel command-line key.
pub const CMDLINE_KEY: &str = "burrow.net";
/// Most addresses and routes carried (a CNI result has a handful).
pub const MAX_ADDRS: usize = 16;
pub const MAX_ROUTES: usize = 32;
/// The longest text form accepted (16 IPv6 addresses and 32 routes with
/// gateways fit well below it).
pub const MAX_TEXT: usize = 4096;

/// The files of a container's network identity that CRI (and nerdctl)
/// bind-mount from the host: (destination in the container, name). The
/// shim carries each one's contents in the guest spec's annotation
/// [`HOST_FILE_ANNOTATION`]`NAME` and points the mount's source at
/// [`HOST_FILE_SOURCE`]`NAME`; the agent writes the file in the guest and
/// mounts it there instead.
pub const HOST_FILES: [(&str, &str); 3] = [
    ("/etc/resolv.conf", "resolv.conf"),
    ("/etc/hosts", "hosts"),
    ("/etc/hostname", "hostname"),
];
pub const HOST_FILE_ANNOTATION: &str = "io.burrow.file.";
pub const HOST_FILE_SOURCE: &str = "burrow-file:";
/// The largest such file carried.
pub const MAX_HOST_FILE_BYTES: usize = 64 << 10;

/// An address or destination with its prefix length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    pub ip: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn new(ip: IpAddr, prefix: u8) -> Result<Self, String> {
        let max = if ip.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("{ip}/{prefix}: prefix longer than {max}"));
        }
        Ok(Self { ip, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.ip, self.prefix)
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (ip, prefix) = s
            .split_once('/')
            .ok_or_else(|| format!("{s:?} is not IP/PREFIX"))?;
        let ip: IpAddr = ip
            .parse()
            .map_err(|_| format!("{ip:?} is not an IP address"))?;
        let prefix: u8 = prefix
            .parse()
            .map_err(|_| format!("{prefix:?} is not a prefix length"))?;
        Self::new(ip, prefix)
    }
}

/// A route: a destination, through a gateway or directly on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub dst: Cidr,
    pub gateway: Option<IpAddr>,
}

/// What the guest's NIC is configured with.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GuestNet {
    pub mac: [u8; 6],
    pub mtu: u32,
    pub addrs: Vec<Cidr>,
    pub routes: Vec<Route>,
}

impl fmt::Display for GuestNet {
    /// The command-line value (without the key).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.mac;
        write!(
            f,
            "mac={a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x};mtu={}",
            self.mtu
        )?;
        for addr in &self.addrs {
            write!(f, ";addr={addr}")?;
        }
        for r in &self.routes {
            write!(f, ";route={}", r.dst)?;
            if let Some(gw) = r.gateway {
                write!(f, "@{gw}")?;
            }
        }
        Ok(())
    }
}

/// Whether `mac` can be a NIC's own address: not all zero, not group.
pub fn is_unicast_mac(mac: [u8; 6]) -> bool {
    mac != [0; 6] && mac[0] & 1 == 0
}

impl FromStr for GuestNet {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.len() > MAX_TEXT {
            return Err(format!("longer than {MAX_TEXT} bytes"));
        }
        let mut net = GuestNet::default();
        let mut have_mac = false;
        for part in s.split(';') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?} is not KEY=VALUE"))?;
            match k {
                "mac" => {
                    let bytes: Vec<u8> = v
                        .split(':')
                        .map(|h| u8::from_str_radix(h, 16).map_err(|_| format!("MAC {v:?}")))
                        .collect::<Result<_, _>>()?;
                    net.mac = bytes.try_into().map_err(|_| format!("MAC {v:?}"))?;
                    have_mac = true;
                }
                "mtu" => {
                    net.mtu = v
                        .parse()
                        .ok()
                        .filter(|m| (68..=65535).contains(m))
                        .ok_or_else(|| format!("MTU {v:?}"))?;
                }
                "addr" if net.addrs.len() < MAX_ADDRS => net.addrs.push(v.parse()?),
                "route" if net.routes.len() < MAX_ROUTES => {
                    let (dst, gw) = match v.split_once('@') {
                        Some((d, g)) => (d, Some(g.parse().map_err(|_| format!("gateway {g:?}"))?)),
                        None => (v, None),
                    };
                    net.routes.push(Route {
                        dst: dst.parse()?,
                        gateway: gw,
                    });
                }
                "addr" | "route" => {
                    return Err(format!(
                        "more than {MAX_ADDRS} addresses or {MAX_ROUTES} routes"
                    ))
                }
                _ => return Err(format!("unknown key {k:?}")),
            }
        }
        if !have_mac || net.mtu == 0 {
            return Err("mac and mtu are required".into());
        }
        if !is_unicast_mac(net.mac) {
            return Err(format!("MAC {:02x?} is not a unicast address", net.mac));
        }
        Ok(net)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_nonsense() {
        let net = GuestNet {
            mac: [0x0a, 0x58, 10, 4, 0, 5],
            mtu: 1450,
            addrs: vec![
                "10.4.0.5/16".parse().unwrap(),
                "fd00:4::5/64".parse().unwrap(),
            ],
            routes: vec![
                Route {
                    dst: "0.0.0.0/0".parse().unwrap(),
                    gateway: Some("10.4.0.1".parse().unwrap()),
                },
                Route {
                    dst: "10.9.0.0/16".parse().unwrap(),
                    gateway: None,
                },
            ],
        };
        let s = net.to_string();
        assert_eq!(
            s,
            "mac=0a:58:0a:04:00:05;mtu=1450;addr=10.4.0.5/16;addr=fd00:4::5/64;route=0.0.0.0/0@10.4.0.1;route=10.9.0.0/16"
        );
        assert!(!s.contains(' '), "one command-line word");
        assert_eq!(s.parse::<GuestNet>().unwrap(), net);
        for bad in [
            "mtu=1500",
            "mac=0a:58:0a:04:00:05",
            "mac=0a:58:0a:04:00;mtu=1500",
            "mac=0a:58:0a:04:00:05;mtu=10",
            "mac=0a:58:0a:04:00:05;mtu=1500;addr=10.0.0.1/33",
            "mac=0a:58:0a:04:00:05;mtu=1500;addr=10.0.0.1",
            "mac=0a:58:0a:04:00:05;mtu=1500;route=0.0.0.0/0@x",
            "mac=0a:58:0a:04:00:05;mtu=1500;dns=1.1.1.1",
            "mac=01:00:5e:00:00:01;mtu=1500",
            "mac=00:00:00:00:00:00;mtu=1500",
        ] {
            assert!(bad.parse::<GuestNet>().is_err(), "{bad}");
        }
        let many = format!(
            "mac=0a:58:0a:04:00:05;mtu=1500{}",
            ";addr=10.0.0.1/8".repeat(MAX_ADDRS + 1)
        );
        assert!(many.parse::<GuestNet>().is_err());
        let long = format!(
            "mac=0a:58:0a:04:00:05;mtu=1500;addr=10.0.0.1/{}8",
            "0".repeat(MAX_TEXT)
        );
        assert!(long.parse::<GuestNet>().is_err());
    }
}
