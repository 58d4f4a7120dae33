//! `--net`: the guest NIC's host side (a tap) and its MAC.
//!
//! `fd=N,mac=MAC` names a tap file descriptor the VMM inherited (the shim
//! opens the tap inside the container's network namespace and passes it,
//! so the VMM never enters that namespace); `tap=NAME,mac=MAC` has the VMM
//! open (or create) the tap `NAME` in its own namespace.

use std::fmt;
use std::str::FromStr;

/// Where the tap comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TapSource {
    /// An open `/dev/net/tun` descriptor attached to a tap (inherited).
    Fd(i32),
    /// A tap interface name (at most 15 bytes), opened by the VMM.
    Name(String),
}

/// An Ethernet address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mac(pub [u8; 6]);

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

impl FromStr for Mac {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = [0u8; 6];
        let mut parts = s.split(':');
        for b in out.iter_mut() {
            let p = parts
                .next()
                .ok_or_else(|| format!("MAC {s:?} is too short"))?;
            if p.len() != 2 {
                return Err(format!("MAC {s:?}: {p:?} is not two hex digits"));
            }
            *b = u8::from_str_radix(p, 16).map_err(|_| format!("MAC {s:?}: {p:?} is not hex"))?;
        }
        if parts.next().is_some() {
            return Err(format!("MAC {s:?} is too long"));
        }
        if out[0] & 1 != 0 {
            return Err(format!("MAC {s:?} is a multicast address"));
        }
        Ok(Mac(out))
    }
}

/// Longest interface name (IFNAMSIZ less its NUL).
pub const MAX_IFNAME: usize = 15;

/// One `--net`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetArg {
    pub tap: TapSource,
    pub mac: Mac,
}

impl NetArg {
    pub fn to_arg(&self) -> String {
        match &self.tap {
            TapSource::Fd(fd) => format!("fd={fd},mac={}", self.mac),
            TapSource::Name(n) => format!("tap={n},mac={}", self.mac),
        }
    }
}

impl FromStr for NetArg {
    type Err = String;
    /// `fd=N,mac=MAC` or `tap=NAME,mac=MAC`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (mut tap, mut mac) = (None, None);
        for kv in s.split(',') {
            match kv.split_once('=') {
                Some(("fd", v)) => {
                    let fd: i32 = v
                        .parse()
                        .map_err(|_| format!("--net fd={v:?} is not a number"))?;
                    if fd < 3 {
                        return Err(format!("--net fd={fd}: not a tap (0-2 are stdio)"));
                    }
                    tap = Some(TapSource::Fd(fd));
                }
                Some(("tap", v)) => {
                    if v.is_empty() || v.len() > MAX_IFNAME || v.contains(['/', ' ', ',']) {
                        return Err(format!("--net tap={v:?} is not an interface name"));
                    }
                    tap = Some(TapSource::Name(v.into()));
                }
                Some(("mac", v)) => mac = Some(v.parse()?),
                _ => {
                    return Err(format!(
                        "--net: unknown part {kv:?} (fd=N|tap=NAME,mac=MAC)"
                    ))
                }
            }
        }
        Ok(Self {
            tap: tap.ok_or("--net needs fd=N or tap=NAME")?,
            mac: mac.ok_or("--net needs mac=MAC")?,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn net_args_round_trip_and_refuse_nonsense() {
        for s in [
            "fd=7,mac=02:00:00:aa:bb:0c",
            "tap=tap0,mac=0a:58:0a:04:00:05",
        ] {
            let a: NetArg = s.parse().unwrap();
            assert_eq!(a.to_arg(), s);
        }
        let a: NetArg = "mac=02:00:00:00:00:01,fd=9".parse().unwrap();
        assert_eq!(a.tap, TapSource::Fd(9));
        assert_eq!(a.mac.0, [2, 0, 0, 0, 0, 1]);
        for bad in [
            "fd=7",
            "mac=02:00:00:00:00:01",
            "fd=1,mac=02:00:00:00:00:01",
            "fd=x,mac=02:00:00:00:00:01",
            "tap=a-name-longer-than-15,mac=02:00:00:00:00:01",
            "tap=a/b,mac=02:00:00:00:00:01",
            "fd=7,mac=01:00:00:00:00:01",
            "fd=7,mac=02:00:00:00:00",
            "fd=7,mac=02:00:00:00:00:01:03",
            "fd=7,mac=02:00:00:00:00:zz",
            "fd=7,mac=02:00:00:00:00:01,mtu=9000",
        ] {
            assert!(bad.parse::<NetArg>().is_err(), "{bad}");
        }
    }
}
