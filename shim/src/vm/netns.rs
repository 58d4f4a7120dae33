//! A network namespace the shim makes for a sandbox whose spec asks for a
//! new one without naming it (what `ctr run` does, with or without
//! `--cni`).
//!
//! `ctr run --cni` creates the task, then runs CNI on
//! `/proc/<task pid>/ns/net`, then starts the task. A burrow task's
//! processes live in the guest, so the task pid the shim reports must name
//! a host process in the sandbox's namespace: a holder, a child of the
//! shim (`containerd-shim-burrow-v2 netns-holder`) that is born in a new
//! namespace ([`Holder::spawn`]) and does nothing but wait for its stdin
//! to close. The shim keeps the namespace open (an nsfs descriptor) and
//! the holder's stdin; dropping the [`Holder`] (or the shim dying) ends
//! the holder, and the namespace goes with the last descriptor. Kata
//! reports its hypervisor's pid for the same reason; a holder stays the
//! same process across hibernate and wake, when the VMM does not.

use std::fs::File;
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use serde_json::Value;

use crate::sandbox::{Result, SandboxError};

/// The shim's first argument that makes it a holder.
pub const HOLDER_ARG: &str = "netns-holder";

/// Whether the spec asks for a network namespace of its own without
/// naming one.
pub fn wants_fresh(spec: &Value) -> bool {
    spec.get("linux")
        .and_then(|l| l.get("namespaces"))
        .and_then(Value::as_array)
        .and_then(|nss| {
            nss.iter()
                .find(|ns| ns.get("type").and_then(Value::as_str) == Some("network"))
        })
        .is_some_and(|ns| {
            ns.get("path")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
        })
}

/// The holder's whole life (called from `main` before anything else):
/// wait until the shim closes our stdin, or dies.
pub fn run_holder() {
    let mut buf = [0u8; 64];
    let mut stdin = std::io::stdin().lock();
    loop {
        match stdin.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// A holder process and the namespace it was born in.
pub struct Holder {
    child: Child,
    ns: File,
}

impl std::fmt::Debug for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "netns of holder {}", self.child.id())
    }
}

fn ns_err(what: &str, e: impl std::fmt::Display) -> SandboxError {
    SandboxError::FailedPrecondition(format!("sandbox network namespace: {what}: {e}"))
}

impl Holder {
    /// Start a holder (this very binary) in a new network namespace and
    /// open that namespace.
    pub fn spawn() -> Result<Self> {
        Self::spawn_from(Path::new("/proc/self/exe"))
    }

    /// [`Self::spawn`] with the shim binary at `exe`.
    pub fn spawn_from(exe: &Path) -> Result<Self> {
        let mut cmd = Command::new(exe);
        cmd.arg(HOLDER_ARG)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: unshare(2) is async-signal-safe and touches no memory.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNET) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn().map_err(|e| ns_err("starting the holder", e))?;
        match File::open(format!("/proc/{}/ns/net", child.id())) {
            Ok(ns) => Ok(Self { child, ns }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(ns_err("opening the holder's namespace", e))
            }
        }
    }

    /// The task pid: the holder's.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// A path that names the namespace for as long as `self` lives.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.ns.as_raw_fd()))
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        // EOF on its stdin ends it; whoever reaps children reaps it.
        drop(self.child.stdin.take());
    }
}

/// A random locally administered unicast MAC, for a NIC whose real
/// address is only known once CNI has run.
pub fn random_mac() -> [u8; 6] {
    let mut mac = [0u8; 6];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut mac))
        .is_err()
    {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        mac.copy_from_slice(&nanos.to_le_bytes()[..6]);
    }
    mac[0] = (mac[0] & 0xfe) | 0x02;
    mac
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unnamed_network_namespace_is_made_here() {
        let fresh = serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}});
        assert!(wants_fresh(&fresh));
        let empty = serde_json::json!({"linux": {"namespaces": [{"type": "network", "path": ""}]}});
        assert!(wants_fresh(&empty));
        let named = serde_json::json!({"linux": {"namespaces": [{"type": "network", "path": "/run/netns/x"}]}});
        assert!(!wants_fresh(&named));
        let host = serde_json::json!({"linux": {"namespaces": [{"type": "pid"}]}});
        assert!(
            !wants_fresh(&host),
            "no network namespace: the host's (loopback only)"
        );
        assert!(!wants_fresh(&serde_json::json!({})));
    }

    #[test]
    fn random_macs_are_local_unicast_and_differ() {
        let (a, b) = (random_mac(), random_mac());
        assert_ne!(a, b);
        for m in [a, b] {
            assert_eq!(m[0] & 0x03, 0x02, "{m:02x?}");
            assert!(burrow_protocol::net::is_unicast_mac(m));
        }
    }
}
