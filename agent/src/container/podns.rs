//! A pod's shared namespaces. Under CRI every container of a pod joins the
//! IPC and UTS namespaces of the pod's sandbox container: its spec names
//! them as `/proc/<sandbox pid>/ns/ipc` and `.../uts`, and the pid the
//! shim reported for the sandbox is its guest pid, so the paths mean the
//! same in the guest. The agent opens them before it forks; the child joins
//! them instead of making new ones.

use std::os::fd::OwnedFd;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use oci_spec::runtime::{LinuxNamespaceType, Spec};

use crate::error::{invalid, AgentError, Result};

/// Namespaces a container joins: an open namespace fd and its CLONE_NEW*
/// type.
pub type Joined = Vec<(OwnedFd, libc::c_int)>;

/// The IPC and UTS namespaces `spec` names by path, opened. Only
/// `/proc/<pid>/ns/{ipc,uts}` paths are taken.
pub fn pod_namespaces(spec: &Spec) -> Result<Joined> {
    let Some(nss) = spec.linux().as_ref().and_then(|l| l.namespaces().as_ref()) else {
        return Ok(Vec::new());
    };
    let mut joined = Vec::new();
    for ns in nss {
        let (kind, flag) = match ns.typ() {
            LinuxNamespaceType::Ipc => ("ipc", libc::CLONE_NEWIPC),
            LinuxNamespaceType::Uts => ("uts", libc::CLONE_NEWUTS),
            // shareProcessNamespace: the pod's, entered by the forking
            // thread (see spawn).
            LinuxNamespaceType::Pid => ("pid", libc::CLONE_NEWPID),
            _ => continue,
        };
        let Some(path) = ns.path() else { continue };
        let path = path.to_string_lossy();
        if !is_proc_ns(&path, kind) {
            return Err(invalid(format!(
                "{kind} namespace path {path:?}: want /proc/<pid>/ns/{kind}"
            )));
        }
        let fd = nix::fcntl::open(
            path.as_ref(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| AgentError::os(format!("open the pod's {kind} namespace {path}"), e))?;
        joined.push((fd, flag));
    }
    Ok(joined)
}

fn is_proc_ns(path: &str, kind: &str) -> bool {
    let Some(rest) = path.strip_prefix("/proc/") else {
        return false;
    };
    let Some((pid, tail)) = rest.split_once('/') else {
        return false;
    };
    !pid.is_empty()
        && pid.len() <= 10
        && pid.bytes().all(|b| b.is_ascii_digit())
        && tail.strip_prefix("ns/") == Some(kind)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_proc_namespace_paths_are_joined() {
        assert!(is_proc_ns("/proc/12/ns/ipc", "ipc"));
        assert!(is_proc_ns("/proc/1/ns/uts", "uts"));
        assert!(!is_proc_ns("/proc/12/ns/uts", "ipc"));
        assert!(!is_proc_ns("/proc/self/ns/ipc", "ipc"));
        assert!(!is_proc_ns("/proc/1/../1/ns/ipc", "ipc"));
        assert!(!is_proc_ns("/var/run/netns/x", "ipc"));
        let spec: Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "linux": {"namespaces": [
                {"type": "ipc", "path": "/proc/self/ns/ipc"}
            ]}
        }))
        .expect("spec");
        assert!(pod_namespaces(&spec).is_err(), "a non-pid path is refused");
        let pid = std::process::id();
        let spec: Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "linux": {"namespaces": [
                {"type": "pid"},
                {"type": "ipc", "path": format!("/proc/{pid}/ns/ipc")},
                {"type": "uts", "path": format!("/proc/{pid}/ns/uts")},
                {"type": "mount"}
            ]}
        }))
        .expect("spec");
        let joined = pod_namespaces(&spec).expect("opened");
        let kinds: Vec<libc::c_int> = joined.iter().map(|(_, k)| *k).collect();
        assert_eq!(kinds, vec![libc::CLONE_NEWIPC, libc::CLONE_NEWUTS]);
    }
}
