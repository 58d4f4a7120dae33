//! The VMM's jail, on the model of Firecracker's jailer (issue 15): what a
//! guest that takes over the VMM process could still reach.
//!
//! The VM is built first, as root: `/dev/kvm`, the kernel, the disks, the
//! snapshot files, the API and vsock sockets and the serial log are all
//! open before [`enter`] runs. Then, on the only thread:
//! - the sandbox's cgroup and OOM score ([`place`]);
//! - new mount, network, IPC and UTS namespaces. The tap a network device
//!   uses comes as an open fd, and unix sockets bound to paths work across
//!   network namespaces. No PID namespace: it would only hold the VMM's
//!   children, and the VMM never makes any (its seccomp filters allow
//!   `clone` for threads only);
//! - a root that is a small read-only tmpfs holding, at their own paths,
//!   only the directories the VMM still writes in: those of its API and
//!   vsock sockets (guest-initiated vsock connections go to `PATH_PORT`)
//!   and of its serial log (rotated to `PATH.1`). No `/dev`, `/proc` or
//!   `/sys`. Snapshots are written into files the controller opens and
//!   passes over the API socket, so no snapshot directory is in the jail;
//! - rlimits: open files, locked memory 0, core dumps 0;
//! - an empty capability bounding set, then the unprivileged uid and gid
//!   (no supplementary groups), which leaves no capabilities at all;
//! - not dumpable (no ptrace of it, no core, even by a VMM that shares
//!   its uid: the shim gives each sandbox's VMM a uid of its own, but a
//!   config may not);
//! - `no_new_privs` is set by `main` for every run.
//!
//! Seccomp filters come after, per thread ([`seccomp`]).

pub mod seccomp;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("jail: {what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("jail: {0}")]
    Refused(String),
}

type Result<T> = std::result::Result<T, JailError>;

fn sys(what: impl Into<String>) -> impl FnOnce(io::Error) -> JailError {
    let what = what.into();
    move |source| JailError::Sys { what, source }
}

/// `rc` of a libc call: -1 is the thread's errno.
fn check(rc: libc::c_int, what: impl Into<String>) -> Result<()> {
    if rc < 0 {
        Err(sys(what)(io::Error::last_os_error()))
    } else {
        Ok(())
    }
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| JailError::Refused(format!("path {} has a NUL byte", p.display())))
}

/// Open files a jailed VMM may have: its devices, sockets, vsock
/// connections (the muxer holds at most 1024) and API clients.
pub const MAX_OPEN_FILES: u64 = 4096;

/// What the jail is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Jail {
    pub uid: u32,
    pub gid: u32,
    /// Directories the jailed VMM still uses, visible at their own paths.
    pub dirs: Vec<PathBuf>,
    /// Files the VMM made and keeps writing or removing (its serial log,
    /// its sockets): given to the jail's uid.
    pub own_files: Vec<PathBuf>,
}

/// Move this process into `cgroup` (a cgroup v2 directory) and set its
/// OOM score adjustment, while it may still write both.
pub fn place(cgroup: Option<&Path>, oom_score_adj: Option<i32>) -> Result<()> {
    if let Some(c) = cgroup {
        let procs = c.join("cgroup.procs");
        std::fs::write(&procs, b"0").map_err(sys(format!("joining cgroup {}", c.display())))?;
    }
    if let Some(o) = oom_score_adj {
        std::fs::write("/proc/self/oom_score_adj", o.to_string())
            .map_err(sys("setting oom_score_adj"))?;
    }
    Ok(())
}

/// Threads of this process now.
fn thread_count() -> Result<usize> {
    Ok(std::fs::read_dir("/proc/self/task")
        .map_err(sys("listing /proc/self/task"))?
        .count())
}

/// Enter the jail. Must run on the process's only thread: namespaces,
/// the capability bounding set and the root are per thread.
pub fn enter(jail: &Jail) -> Result<()> {
    let threads = thread_count()?;
    if threads != 1 {
        return Err(JailError::Refused(format!(
            "must be entered before any other thread starts ({threads} threads)"
        )));
    }
    for f in &jail.own_files {
        match std::os::unix::fs::lchown(f, Some(jail.uid), Some(jail.gid)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(sys(format!("giving {} to the jail", f.display()))(e))
            }
            _ => {}
        }
    }
    let last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse::<libc::c_int>().ok())
        .unwrap_or(63);

    // SAFETY: unshare has no memory-safety preconditions.
    check(
        unsafe {
            libc::unshare(
                libc::CLONE_NEWNS | libc::CLONE_NEWNET | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS,
            )
        },
        "unshare",
    )?;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )?;
    // Open the directories (in this namespace: a bind takes its source
    // from the caller's own) before the new root covers them.
    let mut dirs: Vec<(PathBuf, OwnedFd)> = Vec::new();
    for d in &jail.dirs {
        let d = d
            .canonicalize()
            .map_err(sys(format!("resolving {}", d.display())))?;
        if dirs.iter().any(|(p, _)| *p == d) {
            continue;
        }
        let fd = std::fs::File::options()
            .read(true)
            .custom_flags(libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&d)
            .map_err(sys(format!("opening {}", d.display())))?;
        dirs.push((d, fd.into()));
    }
    new_root(&dirs)?;
    drop(dirs);
    limits()?;
    drop_privileges(jail.uid, jail.gid, last_cap)
}

use std::os::unix::fs::OpenOptionsExt;

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<()> {
    let src = src.map(cstr).transpose()?;
    let target_c = cstr(target)?;
    let fstype = fstype.map(|s| CString::new(s).unwrap_or_default());
    let data = data.map(|s| CString::new(s).unwrap_or_default());
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is a NUL-terminated string that outlives the
    // call, or null where mount(2) allows it.
    let rc = unsafe {
        libc::mount(
            ptr(&src),
            target_c.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    check(rc, format!("mount {}", target.display()))
}

/// Where the new root is built before it becomes `/` (in this process's
/// own mount namespace; the host's `/tmp` is not touched).
const STAGING: &str = "/tmp";

/// Mount the jail's root and pivot into it: a tmpfs with `dirs` bound at
/// their own paths (nosuid, nodev, noexec), then read-only.
fn new_root(dirs: &[(PathBuf, OwnedFd)]) -> Result<()> {
    let staging = Path::new(STAGING);
    let safe = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    mount(
        Some(Path::new("tmpfs")),
        staging,
        Some("tmpfs"),
        safe,
        Some("mode=0755,size=64k,nr_inodes=256"),
    )?;
    // SAFETY: umask has no memory-safety preconditions.
    let old_umask = unsafe { libc::umask(0o022) };
    let made = (|| {
        for (d, fd) in dirs {
            let target = staging.join(d.strip_prefix("/").unwrap_or(d));
            std::fs::create_dir_all(&target)
                .map_err(sys(format!("creating {}", target.display())))?;
            let src = PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            mount(Some(&src), &target, None, libc::MS_BIND, None)?;
            mount(
                None,
                &target,
                None,
                libc::MS_BIND | libc::MS_REMOUNT | safe,
                None,
            )?;
        }
        Ok(())
    })();
    // SAFETY: as above.
    unsafe { libc::umask(old_umask) };
    made?;
    std::env::set_current_dir(staging).map_err(sys("chdir to the new root"))?;
    let dot = c".";
    // SAFETY: pivot_root with two valid NUL-terminated paths.
    check(
        unsafe { libc::syscall(libc::SYS_pivot_root, dot.as_ptr(), dot.as_ptr()) } as libc::c_int,
        "pivot_root",
    )?;
    // The old root is stacked under the new one: detach it.
    // SAFETY: umount2 with a valid path.
    check(
        unsafe { libc::umount2(dot.as_ptr(), libc::MNT_DETACH) },
        "detaching the old root",
    )?;
    std::env::set_current_dir("/").map_err(sys("chdir /"))?;
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | safe,
        None,
    )
}

fn limits() -> Result<()> {
    for (res, value, what) in [
        (libc::RLIMIT_NOFILE, MAX_OPEN_FILES, "RLIMIT_NOFILE"),
        (libc::RLIMIT_MEMLOCK, 0, "RLIMIT_MEMLOCK"),
        (libc::RLIMIT_CORE, 0, "RLIMIT_CORE"),
    ] {
        let l = libc::rlimit {
            rlim_cur: value,
            rlim_max: value,
        };
        // SAFETY: setrlimit reads the struct it is given.
        check(unsafe { libc::setrlimit(res, &l) }, what)?;
    }
    Ok(())
}

fn drop_privileges(uid: u32, gid: u32, last_cap: libc::c_int) -> Result<()> {
    if uid == 0 || gid == 0 {
        return Err(JailError::Refused(
            "the jail's uid and gid must not be 0".into(),
        ));
    }
    for cap in 0..=last_cap {
        // SAFETY: prctl with integer arguments.
        let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
        if rc < 0 && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL) {
            return Err(sys(format!("dropping capability {cap}"))(
                io::Error::last_os_error(),
            ));
        }
    }
    // SAFETY: setgroups with an empty list; setresgid/setresuid with ids.
    check(unsafe { libc::setgroups(0, std::ptr::null()) }, "setgroups")?;
    check(unsafe { libc::setresgid(gid, gid, gid) }, "setresgid")?;
    check(unsafe { libc::setresuid(uid, uid, uid) }, "setresuid")?;
    // Leaving uid 0 cleared the permitted, effective and ambient sets;
    // make sure (an exec could not raise them anyway: no_new_privs).
    // SAFETY: getuid/geteuid have no preconditions.
    if unsafe { libc::getuid() } != uid || unsafe { libc::geteuid() } != uid {
        return Err(JailError::Refused("the uid did not change".into()));
    }
    // SAFETY: prctl with integer arguments.
    check(
        unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) },
        "PR_SET_DUMPABLE",
    )
}
