//! Checks that the VMMs a shim started are jailed (issue 15), from outside
//! through /proc, as an operator would look.

use std::path::{Path, PathBuf};

use crate::containerd::Containerd;

/// The gid a jailed burrow-vmm runs as by default, and the first of its
/// uids (each sandbox's VMM has one of its own).
pub const JAIL_ID: u32 = 64_100;
/// How many uids the default range has.
pub const JAIL_UIDS: u32 = 800;

/// The uid process `pid` runs as (its real uid).
pub fn uid_of(pid: i32) -> u32 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("process {pid}: {e}"));
    field(&status, "Uid")
        .split_whitespace()
        .next()
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("no Uid in /proc/{pid}/status"))
}

fn field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn ns(pid: &str, kind: &str) -> Option<PathBuf> {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).ok()
}

/// The sandbox directories the jail may write in: root-owned, group the
/// jail's gid, mode 01730 (create, not list; remove only its own files).
pub fn is_jail_state_dir(meta: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    meta.is_dir()
        && meta.permissions().mode() & 0o7777 == 0o1730
        && meta.uid() == 0
        && meta.gid() == JAIL_ID
}

/// The pids in the `vmm.pid` files under `dir`, with their sandbox ids.
fn vmm_pids(dir: &Path) -> Vec<(String, String)> {
    crate::containerd::walk(dir)
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "vmm.pid"))
        .filter_map(|p| {
            let id = p.parent().and_then(Path::file_name).unwrap_or_default();
            let pid = std::fs::read_to_string(&p).ok()?;
            Some((pid.trim().to_string(), id.to_string_lossy().into_owned()))
        })
        .collect()
}

impl Containerd {
    /// Every running burrow-vmm of this containerd runs jailed: a uid of
    /// the jail's range that no other VMM has, the jail's gid, no
    /// capabilities, no_new_privs, seccomp filters, its own mount,
    /// network and IPC namespaces, in the sandbox's cgroup (the spec's
    /// `/<namespace>/<id>` under ctr). Fails when no VMM was found.
    /// Returns the VMMs' cgroup directories (for checks after delete).
    pub fn assert_jailed(&self) -> Vec<PathBuf> {
        let mut cgroups = Vec::new();
        let pids = vmm_pids(&self.burrow_state());
        assert!(
            !pids.is_empty(),
            "no vmm.pid under {}",
            self.burrow_state().display()
        );
        let me = std::process::id().to_string();
        let mut uids = std::collections::BTreeMap::new();
        for (pid, id) in pids {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_else(|e| panic!("burrow-vmm {pid} is not running: {e}"));
            let uid = field(&status, "Uid");
            let first = uid.split_whitespace().next().unwrap_or_default().to_string();
            assert_eq!(uid, [first.as_str(); 4].join("\t"), "VMM {pid}'s uids:\n{status}");
            let n: u32 = first.parse().unwrap_or_default();
            assert!(
                (JAIL_ID..JAIL_ID + JAIL_UIDS).contains(&n),
                "VMM {pid}'s uid {n} is of the jail's range:\n{status}"
            );
            if let Some(other) = uids.insert(n, id.clone()) {
                panic!("the VMMs of sandboxes {other} and {id} share uid {n}");
            }
            let jail_id = JAIL_ID.to_string();
            let ids = [jail_id.as_str(); 4].join("\t");
            assert_eq!(field(&status, "Gid"), ids, "VMM {pid}'s gid");
            for cap in ["CapPrm", "CapEff", "CapBnd", "CapAmb"] {
                assert_eq!(field(&status, cap), "0000000000000000", "VMM {pid}'s {cap}");
            }
            assert_eq!(field(&status, "NoNewPrivs"), "1", "VMM {pid}");
            assert_eq!(field(&status, "Seccomp"), "2", "VMM {pid} is filtered");
            let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            let dir = cgroup
                .lines()
                .find_map(|l| l.strip_prefix("0::/"))
                .filter(|p| p.ends_with(&format!("/{id}")));
            let dir = dir.unwrap_or_else(|| panic!("VMM {pid} is in sandbox {id}'s cgroup: {cgroup}"));
            cgroups.push(Path::new("/sys/fs/cgroup").join(dir));
            for kind in ["mnt", "net", "ipc"] {
                let theirs = ns(&pid, kind);
                assert!(
                    theirs.is_some() && theirs != ns(&me, kind),
                    "VMM {pid} has its own {kind} namespace"
                );
            }
        }
        cgroups
    }
}
