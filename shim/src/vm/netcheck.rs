//! `containerd-shim-burrow-v2 check-network` (run by `burrow check`):
//! whether this host can give a sandbox its NIC, tried for real in a
//! network namespace of its own that vanishes afterwards: a tap with
//! virtio-net headers, brought up, and the egress policy's nftables
//! `netdev` table (a chain on each side's ingress forwarding to the other,
//! flows recorded in dynamic sets).

use std::os::fd::OwnedFd;

use super::egress::{self, Egress};
use super::net::{join, open_tap, TAP_NAME};
use crate::sandbox::{Result, SandboxError};

/// The shim's first argument that runs this check.
pub const CHECK_ARG: &str = "check-network";

/// Each part of the check and how it went.
pub fn check() -> Vec<(&'static str, Result<()>)> {
    let r = std::thread::spawn(|| {
        // SAFETY: unshare on this thread only; it ends afterwards.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
            let e = std::io::Error::last_os_error();
            let why = SandboxError::FailedPrecondition(format!("a network namespace: {e}"));
            return vec![("network namespace", Err(why))];
        }
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(parts()),
            Err(e) => vec![("runtime", Err(SandboxError::Internal(e.to_string())))],
        }
    })
    .join();
    r.unwrap_or_else(|_| {
        vec![(
            "network check",
            Err(SandboxError::Internal("panicked".into())),
        )]
    })
}

async fn parts() -> Vec<(&'static str, Result<()>)> {
    let mut out = vec![("network namespace", Ok(()))];
    let tap: Result<OwnedFd> = open_tap(TAP_NAME);
    let tap_ok = tap.is_ok();
    let tap_result = match &tap {
        Ok(_) => Ok(()),
        Err(e) => Err(SandboxError::FailedPrecondition(e.to_string())),
    };
    out.push(("tap (/dev/net/tun, virtio-net headers)", tap_result));
    let up = async {
        if !tap_ok {
            return Err(SandboxError::FailedPrecondition(
                "no tap to bring up".into(),
            ));
        }
        let (conn, h, _) = rtnetlink::new_connection()
            .map_err(|e| SandboxError::FailedPrecondition(format!("netlink: {e}")))?;
        let task = tokio::spawn(conn);
        let r = join(&h, 1500).await;
        task.abort();
        r
    }
    .await;
    out.push(("tap up", up));
    let nft = if tap_ok {
        egress::nft(&Egress::Deny.ruleset(
            TAP_NAME,
            "lo",
            &egress::Resolved::new(),
            &egress::Node::default(),
        ))
    } else {
        Err(SandboxError::FailedPrecondition("no tap to filter".into()))
    };
    out.push((
        "nftables netdev table (egress policy: nf_tables, nft_fwd_netdev)",
        nft,
    ));
    drop(tap);
    out
}

/// The report `check-network` prints: one line per part, `ok` or why not.
pub fn report(parts: &[(&'static str, Result<()>)]) -> String {
    let mut s = String::new();
    for (what, r) in parts {
        match r {
            Ok(()) => s.push_str(&format!("{what}: ok\n")),
            Err(e) => s.push_str(&format!("{what}: no: {e}\n")),
        }
    }
    s
}
