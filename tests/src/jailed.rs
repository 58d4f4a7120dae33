//! Checks that the VMMs a shim started are jailed (issue 15), from outside
//! through /proc, as an operator would look.

use std::path::{Path, PathBuf};

use crate::containerd::Containerd;

/// The uid and gid a jailed burrow-vmm runs as by default.
pub const JAIL_ID: u32 = 64_100;

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
    /// Every running burrow-vmm of this containerd runs jailed: the jail's
    /// uid, no capabilities, no_new_privs, seccomp filters, its own mount,
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
        for (pid, id) in pids {
            let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
                .unwrap_or_else(|e| panic!("burrow-vmm {pid} is not running: {e}"));
            let jail_id = JAIL_ID.to_string();
            let ids = [jail_id.as_str(); 4].join("\t");
            assert_eq!(field(&status, "Uid"), ids, "VMM {pid}'s uid:\n{status}");
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
