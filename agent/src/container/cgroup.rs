//! A container's cgroup in the guest (cgroup v2): `burrow/<id>` under the
//! agent's cgroup2 mount, holding the container's init, everything it
//! forks and every process exec'd into it, as runc does on a host.
//!
//! - The spec's `linux.resources` become the cgroup's limits (runc's
//!   cgroup v1 → v2 conversions), so one container of a pod cannot take
//!   the whole VM: its memory limit OOM-kills in its own cgroup only.
//! - Stats and OOM kills are the container's own (`memory.current`,
//!   `cpu.stat`, `pids.current`, `memory.events`), not the VM's.
//! - Deleting the container kills what is left in the cgroup
//!   (`cgroup.kill`) and removes it.
//!
//! The agent itself stays in the root cgroup (which may hold processes
//! while its children have controllers enabled).

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use oci_spec::runtime::LinuxResources;

use crate::error::{invalid, AgentError, Result};

/// Where the agent mounts cgroup2 as PID 1.
pub const MOUNT: &str = "/sys/fs/cgroup";
/// The agent's subtree for containers.
const PARENT: &str = "burrow";
/// Controllers given to containers, where the kernel has them.
const CONTROLLERS: [&str; 6] = ["cpu", "cpuset", "io", "memory", "pids", "hugetlb"];
/// Most `linux.resources.unified` entries taken.
const MAX_UNIFIED: usize = 64;
/// Longest value written to one cgroup file.
const MAX_VALUE: usize = 4096;
/// How long removal waits for killed processes to leave.
const REMOVE_WAIT: Duration = Duration::from_secs(5);

/// One container's cgroup directory.
#[derive(Debug)]
pub struct Cgroup {
    dir: PathBuf,
}

/// What a container's cgroup says it uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Usage {
    pub cpu_usec: u64,
    pub memory_bytes: u64,
    /// `memory.max`, None when unlimited.
    pub memory_limit: Option<u64>,
    pub pids: u64,
    pub oom_kills: u64,
}

/// Make `<mount>/burrow` with the controllers enabled on the way down,
/// once at the agent's start: each controller enabled is a cgroup
/// rebuild, about 40 ms for all of them in the emulated test host. Done
/// here, before a template snapshot, no container's create pays it. [`Cgroup::create`] checks
/// again (a write for a controller already on changes nothing).
pub fn prepare(mount: &Path) -> Result<()> {
    let parent = mount.join(PARENT);
    enable_controllers(mount);
    mkdir(&parent)?;
    enable_controllers(&parent);
    Ok(())
}

impl Cgroup {
    /// Make `<mount>/burrow/<id>` (id checked by the caller) with the
    /// controllers enabled on the way down, and apply `resources`.
    pub fn create(mount: &Path, id: &str, resources: Option<&LinuxResources>) -> Result<Cgroup> {
        prepare(mount)?;
        let dir = mount.join(PARENT).join(id);
        std::fs::create_dir(&dir)
            .map_err(|e| AgentError::io(format!("create cgroup {}", dir.display()), e))?;
        let cg = Cgroup { dir };
        if let Some(r) = resources {
            if let Err(e) = cg.apply(r) {
                cg.remove();
                return Err(e);
            }
        }
        Ok(cg)
    }

    /// `cgroup.procs`, open for a child to write "0" into before anything
    /// else (the child then lives in this cgroup, and so does all it forks).
    pub fn procs(&self) -> Result<OwnedFd> {
        let path = self.dir.join("cgroup.procs");
        nix::fcntl::open(&path, OFlag::O_WRONLY | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| AgentError::os(format!("open {}", path.display()), e))
    }

    /// Write `resources` as this cgroup's limits. A setting whose file the
    /// kernel does not offer is a clear error, never skipped.
    pub fn apply(&self, resources: &LinuxResources) -> Result<()> {
        for (file, value) in settings(resources)? {
            let path = self.dir.join(&file);
            if file == "memory.swap.max" && !path.exists() {
                // A guest kernel without swap: there is none to limit.
                continue;
            }
            std::fs::write(&path, &value).map_err(|e| {
                AgentError::InvalidArgument(format!(
                    "linux.resources: cannot set {file} to {value:?} in the guest: {e}"
                ))
            })?;
        }
        Ok(())
    }

    pub fn usage(&self) -> Usage {
        let read = |f: &str| std::fs::read_to_string(self.dir.join(f)).unwrap_or_default();
        let number = |f: &str| read(f).trim().parse::<u64>().ok();
        Usage {
            cpu_usec: keyed(&read("cpu.stat"), "usage_usec").unwrap_or(0),
            memory_bytes: number("memory.current").unwrap_or(0),
            memory_limit: number("memory.max"),
            pids: number("pids.current").unwrap_or(0),
            oom_kills: keyed(&read("memory.events"), "oom_kill").unwrap_or(0),
        }
    }

    /// Kill whatever is left in the cgroup and remove it.
    pub fn remove(&self) {
        // cgroup.kill (Linux 5.14) SIGKILLs every process in the subtree.
        let _ = std::fs::write(self.dir.join("cgroup.kill"), "1");
        let start = Instant::now();
        loop {
            match std::fs::remove_dir(&self.dir) {
                Ok(()) => return,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                Err(e) if start.elapsed() > REMOVE_WAIT => {
                    tracing::warn!("removing cgroup {}: {e}", self.dir.display());
                    return;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

fn mkdir(dir: &Path) -> Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(AgentError::io(
            format!("create cgroup {}", dir.display()),
            e,
        )),
    }
}

/// Enable in `dir`'s children every controller of [`CONTROLLERS`] that
/// `dir` has (one at a time: the kernel refuses a whole line for one
/// controller it cannot enable).
fn enable_controllers(dir: &Path) {
    let have = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    let on = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    for c in CONTROLLERS {
        let enabled = on.split_whitespace().any(|h| h == c);
        if !enabled && have.split_whitespace().any(|h| h == c) {
            if let Err(e) = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}")) {
                tracing::warn!("enabling the {c} controller in {}: {e}", dir.display());
            }
        }
    }
}

/// The value of `key` in a flat-keyed cgroup file (`key value` lines).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        (w.next() == Some(key))
            .then(|| w.next()?.parse().ok())
            .flatten()
    })
}

/// `-1` or nothing: no limit.
fn limit(v: i64) -> String {
    if v < 0 {
        "max".into()
    } else {
        v.to_string()
    }
}

/// The cgroup v2 files and values for `r`, converted as runc converts the
/// OCI (cgroup v1 shaped) fields.
pub fn settings(r: &LinuxResources) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    if let Some(m) = r.memory() {
        if let Some(l) = m.limit() {
            out.push(("memory.max".into(), limit(l)));
        }
        if let Some(l) = m.reservation() {
            out.push(("memory.low".into(), limit(l)));
        }
        if let Some(swap) = m.swap() {
            // OCI's swap is memory + swap; v2's swap.max is the swap alone.
            let v = match (swap, m.limit()) {
                (s, _) if s < 0 => "max".to_string(),
                (s, Some(l)) if l > 0 => {
                    if s < l {
                        return Err(invalid(format!(
                            "linux.resources.memory: swap {s} (memory + swap) is below the limit {l}"
                        )));
                    }
                    (s - l).to_string()
                }
                (s, _) => s.to_string(),
            };
            out.push(("memory.swap.max".into(), v));
        }
    }
    if let Some(c) = r.cpu() {
        if let Some(shares) = c.shares().filter(|s| *s != 0) {
            // runc's conversion of cpu.shares [2, 262144] to weight [1, 10000].
            let s = shares.clamp(2, 262_144);
            out.push((
                "cpu.weight".into(),
                (1 + ((s - 2) * 9999) / 262_142).to_string(),
            ));
        }
        if c.quota().is_some() || c.period().is_some() {
            let period = c.period().filter(|p| *p > 0).unwrap_or(100_000);
            let quota = match c.quota() {
                Some(q) if q > 0 => q.to_string(),
                _ => "max".into(),
            };
            out.push(("cpu.max".into(), format!("{quota} {period}")));
        }
        if let Some(cpus) = c.cpus().as_deref().filter(|s| !s.is_empty()) {
            out.push(("cpuset.cpus".into(), cpus.to_string()));
        }
        if let Some(mems) = c.mems().as_deref().filter(|s| !s.is_empty()) {
            out.push(("cpuset.mems".into(), mems.to_string()));
        }
    }
    if let Some(p) = r.pids() {
        let l = p.limit();
        out.push((
            "pids.max".into(),
            if l > 0 { l.to_string() } else { "max".into() },
        ));
    }
    if let Some(w) = r.block_io().as_ref().and_then(|b| b.weight()) {
        // runc: blkio weight [10, 1000] to io weight [1, 10000].
        let w = u64::from(w.clamp(10, 1000));
        out.push((
            "io.weight".into(),
            format!("default {}", 1 + (w - 10) * 9999 / 990),
        ));
    }
    for h in r.hugepage_limits().iter().flatten() {
        let size = h.page_size();
        if size.is_empty() || !size.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(invalid(format!("linux.resources: hugepage size {size:?}")));
        }
        out.push((format!("hugetlb.{size}.max"), h.limit().to_string()));
    }
    let unified = r.unified().iter().flatten();
    if unified.clone().count() > MAX_UNIFIED {
        return Err(invalid(format!(
            "linux.resources.unified: more than {MAX_UNIFIED} entries"
        )));
    }
    for (k, v) in unified {
        let ok = k.split_once('.').is_some_and(|(a, b)| {
            !a.is_empty()
                && !b.is_empty()
                && a.bytes().all(|c| c.is_ascii_lowercase())
                && b.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
        }) && !k.starts_with("cgroup.");
        if !ok {
            return Err(invalid(format!(
                "linux.resources.unified: {k:?} is not a controller file"
            )));
        }
        out.push((k.clone(), v.clone()));
    }
    if let Some((f, _)) = out
        .iter()
        .find(|(_, v)| v.len() > MAX_VALUE || v.contains('\n'))
    {
        return Err(invalid(format!(
            "linux.resources: the value for {f} is too long or has a newline"
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resources(json: serde_json::Value) -> LinuxResources {
        serde_json::from_value(json).expect("resources")
    }

    fn get<'a>(s: &'a [(String, String)], f: &str) -> Option<&'a str> {
        s.iter().find(|(k, _)| k == f).map(|(_, v)| v.as_str())
    }

    #[test]
    fn oci_resources_become_cgroup_v2_settings_as_runc_converts_them() {
        let s = settings(&resources(serde_json::json!({
            "memory": {"limit": 67108864, "reservation": 33554432, "swap": 134217728},
            "cpu": {"shares": 1024, "quota": 50000, "period": 100000, "cpus": "0"},
            "pids": {"limit": 100},
            "blockIO": {"weight": 500},
            "hugepageLimits": [{"pageSize": "2MB", "limit": 0}],
            "unified": {"memory.high": "60000000"}
        })))
        .expect("settings");
        assert_eq!(get(&s, "memory.max"), Some("67108864"));
        assert_eq!(get(&s, "memory.low"), Some("33554432"));
        assert_eq!(get(&s, "memory.swap.max"), Some("67108864"));
        assert_eq!(get(&s, "cpu.weight"), Some("39"), "runc: 1024 shares");
        assert_eq!(get(&s, "cpu.max"), Some("50000 100000"));
        assert_eq!(get(&s, "cpuset.cpus"), Some("0"));
        assert_eq!(get(&s, "pids.max"), Some("100"));
        assert_eq!(get(&s, "io.weight"), Some("default 4950"));
        assert_eq!(get(&s, "hugetlb.2MB.max"), Some("0"));
        assert_eq!(get(&s, "memory.high"), Some("60000000"));
    }

    #[test]
    fn no_limit_is_max() {
        let s = settings(&resources(serde_json::json!({
            "memory": {"limit": -1, "swap": -1},
            "cpu": {"quota": -1},
            "pids": {"limit": 0}
        })))
        .expect("settings");
        assert_eq!(get(&s, "memory.max"), Some("max"));
        assert_eq!(get(&s, "memory.swap.max"), Some("max"));
        assert_eq!(get(&s, "cpu.max"), Some("max 100000"));
        assert_eq!(get(&s, "pids.max"), Some("max"));
        assert!(settings(&resources(serde_json::json!({})))
            .expect("empty")
            .is_empty());
    }

    #[test]
    fn hostile_resources_are_refused() {
        for bad in [
            serde_json::json!({"unified": {"../../cgroup.procs": "1"}}),
            serde_json::json!({"unified": {"cgroup.subtree_control": "+memory"}}),
            serde_json::json!({"unified": {"memory.max": "1\n2"}}),
            serde_json::json!({"unified": {"memory/max": "1"}}),
            serde_json::json!({"hugepageLimits": [{"pageSize": "../x", "limit": 1}]}),
            serde_json::json!({"memory": {"limit": 100, "swap": 50}}),
        ] {
            let e = settings(&resources(bad.clone())).expect_err(&bad.to_string());
            assert!(matches!(e, AgentError::InvalidArgument(_)), "{e:?}");
        }
        let many: serde_json::Map<String, serde_json::Value> = (0..=MAX_UNIFIED)
            .map(|i| (format!("memory.x{i}"), serde_json::Value::from("1")))
            .collect();
        assert!(settings(&resources(serde_json::json!({"unified": many}))).is_err());
    }

    #[test]
    fn usage_reads_the_cgroup_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cg = Cgroup {
            dir: dir.path().to_path_buf(),
        };
        std::fs::write(
            dir.path().join("cpu.stat"),
            "usage_usec 1234\nuser_usec 1000\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("memory.current"), "4096\n").unwrap();
        std::fs::write(dir.path().join("memory.max"), "max\n").unwrap();
        std::fs::write(dir.path().join("pids.current"), "3\n").unwrap();
        std::fs::write(
            dir.path().join("memory.events"),
            "low 0\nhigh 0\nmax 5\noom 2\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(
            cg.usage(),
            Usage {
                cpu_usec: 1234,
                memory_bytes: 4096,
                memory_limit: None,
                pids: 3,
                oom_kills: 1
            }
        );
        std::fs::write(dir.path().join("memory.max"), "1048576\n").unwrap();
        assert_eq!(cg.usage().memory_limit, Some(1_048_576));
    }
}
