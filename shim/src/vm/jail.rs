//! What the shim does for burrow-vmm's jail (`burrow_vmm_api::jail`):
//! the flags it passes, the uid its VMMs run as ([`UidLease`]: one of its
//! own per sandbox), the sandbox's cgroup it puts the VMM in, and the
//! state directory the jailed VMM still writes in (its serial log's
//! rotation, its sockets).

use std::hash::{Hash, Hasher};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

use burrow_vmm_api::jail::JailArgs;

use crate::config::Config;
use crate::sandbox::{Result, SandboxError};

/// Where cgroup v2 is mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// In a sandbox's state directory: the cgroup directories the shim made
/// for its VMM, deepest first ([`remove_cgroup`] removes them).
const CGROUP_FILE: &str = "cgroup";

/// The cgroup of a sandbox under `root`: the spec's cgroupfs-style
/// `linux.cgroupsPath` (`/a/b`). None for a systemd-style one
/// (`slice:prefix:name`, whose scope only systemd makes), none given, or
/// one that would leave `root`.
fn cgroup_dir(root: &Path, spec: &serde_json::Value) -> Option<PathBuf> {
    let p = Path::new(spec.pointer("/linux/cgroupsPath")?.as_str()?);
    let mut parts = p.components();
    if parts.next() != Some(Component::RootDir) || p.as_os_str().len() > 4096 {
        return None;
    }
    let rel: PathBuf = parts
        .map(|c| match c {
            Component::Normal(n) => Some(n),
            _ => None,
        })
        .collect::<Option<_>>()?;
    (!rel.as_os_str().is_empty()).then(|| root.join(rel))
}

/// Make the sandbox's cgroup (on a cgroup v2 host) and record what was
/// made in `state_dir`; the VMM joins it before it drops privileges.
fn make_cgroup(spec: &serde_json::Value, state_dir: &Path) -> Result<Option<PathBuf>> {
    let root = Path::new(CGROUP_ROOT);
    if !root.join("cgroup.controllers").exists() {
        return Ok(None);
    }
    let Some(dir) = cgroup_dir(root, spec) else {
        return Ok(None);
    };
    let mut made = Vec::new();
    let mut p = dir.as_path();
    while !p.exists() && p != root {
        made.push(p.to_path_buf());
        p = p.parent().unwrap_or(root);
    }
    std::fs::create_dir_all(&dir)
        .map_err(|e| SandboxError::Internal(format!("creating cgroup {}: {e}", dir.display())))?;
    let list: Vec<String> = made.iter().map(|p| p.display().to_string()).collect();
    std::fs::write(state_dir.join(CGROUP_FILE), list.join("\n"))
        .map_err(|e| SandboxError::io(format_args!("recording cgroup {}", dir.display()), &e))?;
    Ok(Some(dir))
}

/// Remove the cgroup directories the shim made for the sandbox whose state
/// directory is `state_dir` (its VMM is gone). One still in use stays.
pub fn remove_cgroup(state_dir: &Path) {
    let Ok(list) = std::fs::read_to_string(state_dir.join(CGROUP_FILE)) else {
        return;
    };
    for d in list.lines().filter(|l| l.starts_with(CGROUP_ROOT)) {
        if let Err(e) = std::fs::remove_dir(d) {
            tracing::debug!("removing cgroup {d}: {e}");
        }
    }
}

/// In the state root: one lock file per VMM uid in use.
const UID_LOCKS: &str = "vmm-uids";

/// A uid of the configured range (`vmm_uid` up to `vmm_uid_count` of
/// them) that no other sandbox's VMM on this host runs as, held while
/// this lives: a lock on `<state root>/vmm-uids/<uid>` that the kernel
/// drops with the shim (its VMMs end with it). Two jailed VMMs never
/// share a uid, so nothing owned by one (its serial log, its sockets) is
/// the other's, whatever else fails. The lock file goes with the lease.
#[derive(Debug)]
pub struct UidLease {
    pub uid: u32,
    lock: std::fs::File,
    path: PathBuf,
}

impl Drop for UidLease {
    fn drop(&mut self) {
        // Unlinked while still locked: a sandbox that opened the file
        // meanwhile finds, once it has the lock, that the path is no
        // longer its file, and tries again ([`lease_uid`]).
        let _ = std::fs::remove_file(&self.path);
        // `lock` closes (and unlocks) after this, with the fields.
        let _ = &self.lock;
    }
}

/// Take `lock`'s exclusive flock without waiting: false if another holds it.
fn try_flock(lock: &std::fs::File) -> bool {
    // SAFETY: flock on a descriptor the caller owns.
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// Whether `lock` is still the file at `path` (not one unlinked since).
fn still_at(lock: &std::fs::File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (lock.metadata(), std::fs::metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Lease a uid for sandbox `key` (which only picks where the search
/// starts) from the range in `cfg`, locking under `root`.
pub fn lease_uid(cfg: &Config, root: &Path, key: &str) -> Result<UidLease> {
    let count = cfg.vmm_uid_count.max(1);
    let dir = root.join(UID_LOCKS);
    std::fs::create_dir_all(&dir)
        .map_err(|e| SandboxError::io(format_args!("making {}", dir.display()), &e))?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    let start = u32::try_from(h.finish() % u64::from(count)).unwrap_or(0);
    for i in 0..count {
        let Some(uid) = cfg.vmm_uid.checked_add((start + i) % count) else {
            continue;
        };
        let path = dir.join(uid.to_string());
        // A few tries: the holder may unlink the file between our open
        // and our lock.
        for _ in 0..3 {
            let lock = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| SandboxError::io(format_args!("opening {}", path.display()), &e))?;
            if !try_flock(&lock) {
                break;
            }
            if still_at(&lock, &path) {
                return Ok(UidLease { uid, lock, path });
            }
        }
    }
    Err(SandboxError::ResourceExhausted(format!(
        "every VMM uid from {} ({} of them: vmm_uid_count in the burrow config) is in use by another sandbox",
        cfg.vmm_uid, count
    )))
}

/// Remove the lease files under `root` that no shim holds: those of shims
/// that were killed before they could drop their lease. One being leased
/// meanwhile is safe: [`lease_uid`] finds its file unlinked and tries again.
pub fn remove_stale_uid_leases(root: &Path) {
    let Ok(entries) = std::fs::read_dir(root.join(UID_LOCKS)) else {
        return;
    };
    for e in entries.flatten().take(1 << 16) {
        let path = e.path();
        let Ok(f) = std::fs::OpenOptions::new().write(true).open(&path) else {
            continue;
        };
        if try_flock(&f) && still_at(&f, &path) {
            let _ = std::fs::remove_file(&path);
        }
    }
}

/// The jail flags for a VM of the container with OCI spec `spec`, whose
/// sandbox state directory is `state_dir`, its VMM running as `uid`: the
/// configured gid, the sandbox's cgroup and the spec's OOM score (the VMM
/// is the process the kernel would pick).
pub fn args(
    cfg: &Config,
    spec: &serde_json::Value,
    state_dir: &Path,
    uid: u32,
) -> Result<JailArgs> {
    let mut a = flags(cfg, spec);
    a.jail_uid = uid;
    a.cgroup = make_cgroup(spec, state_dir)?;
    Ok(a)
}

fn flags(cfg: &Config, spec: &serde_json::Value) -> JailArgs {
    let oom_score_adj = spec
        .pointer("/process/oomScoreAdj")
        .and_then(serde_json::Value::as_i64)
        .and_then(|o| i32::try_from(o.clamp(-1000, 1000)).ok());
    JailArgs {
        jail: cfg.vmm_jail,
        jail_uid: cfg.vmm_uid,
        jail_gid: cfg.vmm_gid,
        oom_score_adj,
        ..JailArgs::default()
    }
}

/// Let the jail's group create files in the state directory `dir` (its
/// serial log rotates there) but list nothing and remove only its own
/// files: root-owned, group the jail's gid, mode 01730.
pub fn share_state_dir(cfg: &Config, dir: &Path) -> Result<()> {
    if !cfg.vmm_jail {
        return Ok(());
    }
    let fail = |e: std::io::Error| {
        SandboxError::Internal(format!(
            "preparing {} for the VMM's jail: {e}",
            dir.display()
        ))
    };
    std::os::unix::fs::chown(dir, Some(0), Some(cfg.vmm_gid)).map_err(fail)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1730)).map_err(fail)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_oom_score_goes_to_the_vmm() {
        let cfg = Config::default();
        let a = flags(&cfg, &serde_json::json!({"process": {"oomScoreAdj": -998}}));
        assert!(a.jail, "jailed by default");
        assert_eq!(a.oom_score_adj, Some(-998));
        assert_eq!((a.jail_uid, a.jail_gid), (cfg.vmm_uid, cfg.vmm_gid));
        assert!(
            !a.no_seccomp && !a.test_forbidden_syscall,
            "never passed by the shim"
        );
        assert_eq!(flags(&cfg, &serde_json::json!({})).oom_score_adj, None);
        let off = Config {
            vmm_jail: false,
            ..Config::default()
        };
        assert!(!flags(&off, &serde_json::json!({})).jail);
    }

    #[test]
    fn the_vmm_cgroup_is_the_spec_cgroupfs_path_under_the_root() {
        let root = Path::new("/sys/fs/cgroup");
        let at = |p: &str| cgroup_dir(root, &serde_json::json!({"linux": {"cgroupsPath": p}}));
        assert_eq!(at("/default/t1"), Some(root.join("default/t1")));
        assert_eq!(
            at("/kubepods/burstable/pod1/c1"),
            Some(root.join("kubepods/burstable/pod1/c1"))
        );
        for bad in [
            "kubepods.slice:cri-containerd:c1",
            "/",
            "/a/../../etc",
            "relative/x",
        ] {
            assert_eq!(at(bad), None, "{bad}");
        }
        assert_eq!(cgroup_dir(root, &serde_json::json!({})), None);
    }

    #[test]
    fn each_sandbox_leases_a_uid_of_its_own_until_it_lets_go() {
        let root = tempfile::tempdir().unwrap();
        let cfg = Config {
            vmm_uid: 70_000,
            vmm_uid_count: 3,
            ..Config::default()
        };
        // The same key (a retried id) still gets a different uid.
        let a = lease_uid(&cfg, root.path(), "a").unwrap();
        let b = lease_uid(&cfg, root.path(), "a").unwrap();
        let c = lease_uid(&cfg, root.path(), "c").unwrap();
        let mut uids = vec![a.uid, b.uid, c.uid];
        uids.sort_unstable();
        assert_eq!(uids, [70_000, 70_001, 70_002]);
        let full = lease_uid(&cfg, root.path(), "d").unwrap_err();
        assert!(full.to_string().contains("vmm_uid_count"), "{full}");
        let freed = b.uid;
        drop(b);
        let d = lease_uid(&cfg, root.path(), "d").unwrap();
        assert_eq!(d.uid, freed);
        let a_args = args(&cfg, &serde_json::json!({}), root.path(), a.uid).unwrap();
        assert_eq!((a_args.jail_uid, a_args.jail_gid), (a.uid, cfg.vmm_gid));
        // Nothing is left once every lease is gone.
        drop((a, c, d));
        let left: Vec<_> = std::fs::read_dir(root.path().join(UID_LOCKS))
            .unwrap()
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn a_killed_shims_lease_file_is_swept_and_a_held_one_kept() {
        let root = tempfile::tempdir().unwrap();
        let cfg = Config {
            vmm_uid: 70_000,
            vmm_uid_count: 4,
            ..Config::default()
        };
        let held = lease_uid(&cfg, root.path(), "a").unwrap();
        // A killed shim's: the kernel dropped its lock, its Drop never ran.
        let killed_uid = if held.uid == 70_000 { 70_001 } else { 70_000 };
        let killed_path = root.path().join(UID_LOCKS).join(killed_uid.to_string());
        std::fs::write(&killed_path, "").unwrap();
        remove_stale_uid_leases(root.path());
        assert!(!killed_path.exists());
        assert!(held.path.exists());
        // The swept uid is free again.
        let again = lease_uid(&cfg, root.path(), "c").unwrap();
        assert_ne!(again.uid, held.uid);
    }
}
