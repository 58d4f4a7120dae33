//! Containers: their root filesystem and mounts (prepared in the agent's
//! mount namespace under the state directory), and turning OCI `process`
//! objects into [`ChildPlan`]s.
//!
//! Written by hand rather than with youki's `libcontainer`: that crate is a
//! whole runtime (state directory, its own fork/clone3 init protocol,
//! console socket, cgroup managers, systemd/dbus) built around being a
//! separate process that detaches, while the agent is PID 1 that must reap
//! everything itself, keep stdio as pipes it serves over ttrpc, and stay
//! small for a fast-booting initramfs. What a container needs inside an
//! already isolating VM is a short list of system calls (see `spawn`).

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::OFlag;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::Mode;
use oci_spec::runtime::{Mount, Process as OciProcess, Spec};

use crate::error::{invalid, AgentError, Result};
use crate::fs::{self, CleanPath};
use crate::process::{ParentStdio, Process};
use crate::spawn::{self, CapSets, ChildPlan, ChildStdio, Namespaces, ProcMasks};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_ARGS: usize = 4096;
const MAX_ENV: usize = 4096;
const MAX_MOUNTS: usize = 512;

/// A container, or the guest itself (id "").
#[derive(Debug)]
pub struct Container {
    pub id: String,
    /// Directory holding this container's mount points (None for the guest).
    pub bundle: Option<PathBuf>,
    /// Its processes live in a PID namespace of their own.
    pub own_pid_ns: bool,
    /// Root filesystem as the agent sees it.
    pub rootfs: PathBuf,
    /// Processes by exec id; "" is the init.
    pub processes: Mutex<HashMap<String, Arc<Process>>>,
}

impl Container {
    pub fn guest() -> Self {
        Container {
            id: String::new(),
            bundle: None,
            own_pid_ns: false,
            rootfs: PathBuf::from("/"),
            processes: Mutex::new(HashMap::new()),
        }
    }

    pub fn process(&self, exec_id: &str) -> Result<Arc<Process>> {
        self.processes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(exec_id)
            .cloned()
            .ok_or_else(|| {
                if exec_id.is_empty() {
                    AgentError::NotFound(format!("container {:?} has no init process", self.id))
                } else {
                    AgentError::NotFound(format!(
                        "no process {exec_id:?} in container {:?}",
                        self.id
                    ))
                }
            })
    }

    pub fn all_processes(&self) -> Vec<Arc<Process>> {
        self.processes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }

    pub fn root_fd(&self) -> Result<OwnedFd> {
        fs::open_root(&self.rootfs)
    }
}

/// Check a container or exec id: short, and safe as a file name.
pub fn check_id(kind: &str, id: &str) -> Result<()> {
    if id.is_empty() || id.len() > burrow_protocol::MAX_ID_LEN {
        return Err(invalid(format!(
            "{kind} must be 1 to {} bytes long",
            burrow_protocol::MAX_ID_LEN
        )));
    }
    if id == "."
        || id == ".."
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(invalid(format!(
            "{kind} {id:?} may only hold letters, digits, '-', '_' and '.'"
        )));
    }
    Ok(())
}

/// Parse an OCI runtime spec (JSON) with a size cap.
pub fn parse_spec(json: &[u8]) -> Result<Spec> {
    if json.len() > burrow_protocol::MAX_SPEC_BYTES {
        return Err(invalid(format!(
            "OCI spec is {} bytes, more than the {} allowed",
            json.len(),
            burrow_protocol::MAX_SPEC_BYTES
        )));
    }
    let spec: Spec =
        serde_json::from_slice(json).map_err(|e| invalid(format!("bad OCI spec: {e}")))?;
    let process = spec
        .process()
        .as_ref()
        .ok_or_else(|| invalid("bad OCI spec: no \"process\""))?;
    check_process(process)?;
    Ok(spec)
}

/// Parse an OCI `process` object (JSON) with a size cap.
pub fn parse_process(json: &[u8]) -> Result<OciProcess> {
    if json.len() > burrow_protocol::MAX_SPEC_BYTES {
        return Err(invalid(format!(
            "OCI process is {} bytes, more than the {} allowed",
            json.len(),
            burrow_protocol::MAX_SPEC_BYTES
        )));
    }
    let p: OciProcess =
        serde_json::from_slice(json).map_err(|e| invalid(format!("bad OCI process: {e}")))?;
    check_process(&p)?;
    Ok(p)
}

fn check_process(p: &OciProcess) -> Result<()> {
    let args = p.args().as_deref().unwrap_or_default();
    if args.is_empty() {
        return Err(invalid("bad OCI process: \"args\" is empty"));
    }
    if args.len() > MAX_ARGS || p.env().as_ref().is_some_and(|e| e.len() > MAX_ENV) {
        return Err(invalid("bad OCI process: too many args or env entries"));
    }
    Ok(())
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| invalid(format!("{what} contains a NUL byte")))
}

fn cap_number(name: &str) -> Option<u32> {
    const NAMES: [&str; 41] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ];
    let short = name.strip_prefix("CAP_").unwrap_or(name);
    NAMES
        .iter()
        .position(|n| *n == short)
        .and_then(|i| u32::try_from(i).ok())
}

fn cap_mask(set: &Option<oci_spec::runtime::Capabilities>) -> u64 {
    let mut mask = 0u64;
    for cap in set.iter().flatten() {
        let name = serde_json::to_value(cap)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        match cap_number(&name) {
            Some(n) => mask |= 1u64 << n,
            None => tracing::warn!("ignoring unknown capability {name}"),
        }
    }
    mask
}

fn rlimit_resource(name: &str) -> Option<i32> {
    let r = match name {
        "RLIMIT_CPU" => libc::RLIMIT_CPU,
        "RLIMIT_FSIZE" => libc::RLIMIT_FSIZE,
        "RLIMIT_DATA" => libc::RLIMIT_DATA,
        "RLIMIT_STACK" => libc::RLIMIT_STACK,
        "RLIMIT_CORE" => libc::RLIMIT_CORE,
        "RLIMIT_RSS" => libc::RLIMIT_RSS,
        "RLIMIT_NPROC" => libc::RLIMIT_NPROC,
        "RLIMIT_NOFILE" => libc::RLIMIT_NOFILE,
        "RLIMIT_MEMLOCK" => libc::RLIMIT_MEMLOCK,
        "RLIMIT_AS" => libc::RLIMIT_AS,
        "RLIMIT_LOCKS" => libc::RLIMIT_LOCKS,
        "RLIMIT_SIGPENDING" => libc::RLIMIT_SIGPENDING,
        "RLIMIT_MSGQUEUE" => libc::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => libc::RLIMIT_NICE,
        "RLIMIT_RTPRIO" => libc::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => libc::RLIMIT_RTTIME,
        _ => return None,
    };
    i32::try_from(r).ok()
}

fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Turn an OCI process into a plan for `spawn`.
pub fn plan(p: &OciProcess, namespaces: Namespaces) -> Result<ChildPlan> {
    let args = p.args().as_deref().unwrap_or_default();
    let argv = args
        .iter()
        .map(|a| cstring("an argument", a))
        .collect::<Result<Vec<_>>>()?;
    let env_list = p.env().as_deref().unwrap_or_default();
    let env = env_list
        .iter()
        .map(|e| cstring("an environment variable", e))
        .collect::<Result<Vec<_>>>()?;
    let path_var = env_list
        .iter()
        .rev()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH);
    let argv0 = args.first().map(String::as_str).unwrap_or_default();
    let exec_paths = if argv0.contains('/') {
        vec![cstring("the command", argv0)?]
    } else {
        path_var
            .split(':')
            .map(|dir| {
                let dir = if dir.is_empty() { "." } else { dir };
                cstring("PATH", &format!("{dir}/{argv0}"))
            })
            .collect::<Result<Vec<_>>>()?
    };
    let cwd = p.cwd().to_string_lossy();
    let cwd = cstring("cwd", if cwd.is_empty() { "/" } else { &cwd })?;
    let user = p.user();
    let mut rlimits = Vec::new();
    for rl in p.rlimits().iter().flatten() {
        let name = rl.typ().to_string();
        let name = if name.starts_with("RLIMIT_") {
            name
        } else {
            serde_json::to_value(rl.typ())
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        };
        let res =
            rlimit_resource(&name).ok_or_else(|| invalid(format!("unknown rlimit {name}")))?;
        rlimits.push((res, rl.soft(), rl.hard()));
    }
    let caps = p.capabilities().as_ref().map(|c| CapSets {
        bounding: cap_mask(c.bounding()),
        effective: cap_mask(c.effective()),
        permitted: cap_mask(c.permitted()),
        inheritable: cap_mask(c.inheritable()),
        ambient: cap_mask(c.ambient()),
    });
    Ok(ChildPlan {
        argv,
        env,
        exec_paths,
        cwd,
        uid: user.uid(),
        gid: user.gid(),
        groups: user.additional_gids().clone().unwrap_or_default(),
        umask: user.umask(),
        namespaces,
        rlimits,
        no_new_privileges: p.no_new_privileges().unwrap_or(false),
        caps,
        last_cap: last_cap(),
        terminal: p.terminal().unwrap_or(false),
        pass_fds: Vec::new(),
        oom_score_adj: cstring(
            "oomScoreAdj",
            &p.oom_score_adj().unwrap_or(0).clamp(-1000, 1000).to_string(),
        )?,
    })
}

/// Create stdio for a new process and start it. A terminal comes from the
/// devpts under `pty_root` (the container's root as seen through
/// /proc/<pid>/root, so that it is a /dev/pts/N inside the container). A
/// container's init has no such root before it exists: it is started at
/// the gate without a terminal and given one there.
pub async fn start_process(
    exec_id: &str,
    p: &OciProcess,
    pty_root: &Path,
    namespaces: Namespaces,
    want_stdin: bool,
    gated: bool,
) -> Result<Process> {
    let mut plan = plan(p, namespaces)?;
    let late_terminal =
        plan.terminal && gated && matches!(plan.namespaces, Namespaces::NewContainer { .. });
    let size = p.console_size().map(|b| libc::winsize {
        ws_row: u16::try_from(b.height()).unwrap_or(u16::MAX),
        ws_col: u16::try_from(b.width()).unwrap_or(u16::MAX),
        ws_xpixel: 0,
        ws_ypixel: 0,
    });
    if late_terminal {
        plan.terminal = false;
        let null = || {
            nix::fcntl::open("/dev/null", OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())
                .map_err(|e| AgentError::os("open /dev/null", e))
        };
        let child = ChildStdio {
            stdin: null()?,
            stdout: null()?,
            stderr: null()?,
        };
        let (pid, exit, gate) = spawn::spawn(plan, child, gated).await?;
        let root = PathBuf::from(format!("/proc/{pid}/root"));
        let opened = spawn::with_fork_lock(|| open_pty(&root, size.as_ref())).and_then(|pty| {
            if let Some(g) = &gate {
                g.send_terminal(&pty.slave)?;
            }
            Ok(pty)
        });
        let pty = match opened {
            Ok(pty) => pty,
            Err(e) => {
                // SAFETY: kill(2) on the child we just forked.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                return Err(e);
            }
        };
        let parent = pty_parent(pty.master)?;
        return Process::new(exec_id.to_string(), pid, exit, parent, gate);
    }
    let (child, parent) = if plan.terminal {
        let pty = spawn::with_fork_lock(|| open_pty(pty_root, size.as_ref()))?;
        let dup = |fd: &OwnedFd| {
            fd.try_clone()
                .map_err(|e| AgentError::io("dup the terminal", e))
        };
        let child = ChildStdio {
            stdin: dup(&pty.slave)?,
            stdout: dup(&pty.slave)?,
            stderr: pty.slave,
        };
        (child, pty_parent(pty.master)?)
    } else {
        let pipe =
            || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| AgentError::os("create a pipe", e));
        let (stdin_child, stdin_parent) = if want_stdin {
            let (r, w) = pipe()?;
            (r, Some(w))
        } else {
            let null = nix::fcntl::open(
                "/dev/null",
                OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| AgentError::os("open /dev/null", e))?;
            (null, None)
        };
        let (out_r, out_w) = pipe()?;
        let (err_r, err_w) = pipe()?;
        (
            ChildStdio {
                stdin: stdin_child,
                stdout: out_w,
                stderr: err_w,
            },
            ParentStdio {
                stdin: stdin_parent,
                stdout: Some(out_r),
                stderr: Some(err_r),
                pty: None,
            },
        )
    };
    let (pid, exit, gate) = spawn::spawn(plan, child, gated).await?;
    Process::new(exec_id.to_string(), pid, exit, parent, gate)
}

/// The agent's ends of a terminal: master for input, output and resize.
fn pty_parent(master: OwnedFd) -> Result<ParentStdio> {
    let dup = |fd: &OwnedFd| {
        fd.try_clone()
            .map_err(|e| AgentError::io("dup the terminal", e))
    };
    Ok(ParentStdio {
        stdin: Some(dup(&master)?),
        stdout: Some(dup(&master)?),
        stderr: None,
        pty: Some(master),
    })
}

/// A terminal for a process whose root is `root`: from that root's own
/// devpts instance (`/dev/pts/ptmx`, mounted `newinstance` by the spec), so
/// that inside the container the terminal is a /dev/pts/N that exists and
/// `tty`/`ttyname` work, as with runc; the agent's devpts otherwise. Both
/// ends close-on-exec (the child dups the slave onto 0-2).
fn open_pty(root: &Path, size: Option<&libc::winsize>) -> Result<nix::pty::OpenptyResult> {
    let ptmx = root.join("dev/pts/ptmx");
    if !ptmx.exists() {
        let pty =
            nix::pty::openpty(size, None).map_err(|e| AgentError::os("open a terminal", e))?;
        for fd in [&pty.master, &pty.slave] {
            nix::fcntl::fcntl(
                fd.as_fd(),
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(|e| AgentError::os("set close-on-exec", e))?;
        }
        return Ok(pty);
    }
    let master = nix::fcntl::open(
        &ptmx,
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| AgentError::os(format!("open {}", ptmx.display()), e))?;
    let unlock: libc::c_int = 0;
    // SAFETY: ioctls on a terminal master we own, with valid pointers.
    let slave = unsafe {
        if libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) < 0 {
            return Err(AgentError::os(
                "unlock the terminal",
                nix::errno::Errno::last(),
            ));
        }
        if let Some(ws) = size {
            libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, ws);
        }
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if slave < 0 {
        return Err(AgentError::os(
            "open the terminal's peer",
            nix::errno::Errno::last(),
        ));
    }
    // SAFETY: TIOCGPTPEER returned a new fd that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    Ok(nix::pty::OpenptyResult { master, slave })
}

/// Fds of the namespaces of a running container init, to join. `pid`:
/// the container has a PID namespace of its own.
pub fn join_namespaces(init_pid: i32, pid: bool) -> Result<Namespaces> {
    let open = |ns: &str| {
        let path = format!("/proc/{init_pid}/ns/{ns}");
        nix::fcntl::open(
            path.as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| AgentError::os(format!("open {path}"), e))
    };
    let fds = ["ipc", "uts", "mnt"]
        .into_iter()
        .map(open)
        .collect::<Result<Vec<_>>>()?;
    let pid = if pid { Some(open("pid")?) } else { None };
    Ok(Namespaces::Join { fds, pid })
}

/// With a PID namespace in the spec (one to create, not a path to join):
/// the /proc masks its init re-applies after mounting its own /proc.
pub fn pid_namespace(spec: &Spec) -> Result<Option<ProcMasks>> {
    let Some(linux) = spec.linux() else {
        return Ok(None);
    };
    let wants =
        linux.namespaces().iter().flatten().any(|ns| {
            ns.typ() == oci_spec::runtime::LinuxNamespaceType::Pid && ns.path().is_none()
        });
    if !wants {
        return Ok(None);
    }
    let under_proc = |paths: &Option<Vec<String>>| {
        paths
            .iter()
            .flatten()
            .filter(|p| p.starts_with("/proc/"))
            .map(|p| cstring("a masked path", p))
            .collect::<Result<Vec<_>>>()
    };
    Ok(Some(ProcMasks {
        masked: under_proc(linux.masked_paths())?,
        readonly: under_proc(linux.readonly_paths())?,
    }))
}

/// Mount flags and data string from mount(8)-style options.
fn parse_options(options: &[String]) -> (MsFlags, bool, String) {
    let mut flags = MsFlags::empty();
    let mut recursive_bind = false;
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            "ro" => flags |= MsFlags::MS_RDONLY,
            "rw" => flags &= !MsFlags::MS_RDONLY,
            "nosuid" => flags |= MsFlags::MS_NOSUID,
            "suid" => flags &= !MsFlags::MS_NOSUID,
            "nodev" => flags |= MsFlags::MS_NODEV,
            "dev" => flags &= !MsFlags::MS_NODEV,
            "noexec" => flags |= MsFlags::MS_NOEXEC,
            "exec" => flags &= !MsFlags::MS_NOEXEC,
            "sync" => flags |= MsFlags::MS_SYNCHRONOUS,
            "async" => flags &= !MsFlags::MS_SYNCHRONOUS,
            "dirsync" => flags |= MsFlags::MS_DIRSYNC,
            "noatime" => flags |= MsFlags::MS_NOATIME,
            "atime" => flags &= !MsFlags::MS_NOATIME,
            "nodiratime" => flags |= MsFlags::MS_NODIRATIME,
            "diratime" => flags &= !MsFlags::MS_NODIRATIME,
            "relatime" => flags |= MsFlags::MS_RELATIME,
            "norelatime" => flags &= !MsFlags::MS_RELATIME,
            "strictatime" => flags |= MsFlags::MS_STRICTATIME,
            "bind" => flags |= MsFlags::MS_BIND,
            "rbind" => {
                flags |= MsFlags::MS_BIND;
                recursive_bind = true;
            }
            // Propagation: every container gets private mounts anyway.
            "private" | "rprivate" | "shared" | "rshared" | "slave" | "rslave" | "unbindable"
            | "runbindable" | "defaults" => {}
            other => data.push(other.to_string()),
        }
    }
    (flags, recursive_bind, data.join(","))
}

/// A mount target inside the root: created (directory, or empty file when
/// `file`) and opened without leaving the root.
fn prepare_target(root: &OwnedFd, dest: &CleanPath, file: bool) -> Result<OwnedFd> {
    if file {
        let (parent, _) = dest.split()?;
        fs::mkdir(root, &parent, 0o755, true)?;
        let f = fs::open_in_root(
            root,
            dest,
            OFlag::O_RDONLY | OFlag::O_CREAT,
            Mode::from_bits_truncate(0o644),
        );
        drop(f);
    } else {
        fs::mkdir(root, dest, 0o755, true)?;
    }
    fs::open_in_root(root, dest, OFlag::O_PATH, Mode::empty())
}

fn mount_err(what: String) -> impl FnOnce(nix::errno::Errno) -> AgentError {
    move |e| AgentError::FailedPrecondition(format!("{what}: {}", e.desc()))
}

/// Mount one spec mount inside `rootfs`.
fn do_mount(rootfs: &Path, m: &Mount) -> Result<()> {
    let dest_str = m.destination().to_string_lossy().into_owned();
    let dest = CleanPath::parse(&dest_str)?;
    if dest.is_root() {
        return Err(invalid("a mount onto the container's / is not supported"));
    }
    let typ = m.typ().clone().unwrap_or_default();
    let options = m.options().clone().unwrap_or_default();
    let (flags, rbind, data) = parse_options(&options);
    let source = m
        .source()
        .as_ref()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let root = fs::open_root(rootfs)?;
    let is_bind = flags.contains(MsFlags::MS_BIND) || typ == "bind";
    if is_bind {
        let meta = std::fs::metadata(&source).map_err(|e| {
            AgentError::FailedPrecondition(format!(
                "bind mount source {source} for {dest_str}: {e}"
            ))
        })?;
        let target = prepare_target(&root, &dest, !meta.is_dir())?;
        let tpath = fs::proc_fd_path(&target);
        let mut bflags = MsFlags::MS_BIND;
        if rbind {
            bflags |= MsFlags::MS_REC;
        }
        mount(
            Some(source.as_str()),
            tpath.as_str(),
            None::<&str>,
            bflags,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {source} onto {dest_str}")))?;
        let extra = flags & !MsFlags::MS_BIND;
        if !extra.is_empty() {
            // Flags of a bind mount only take with a remount of the new mount.
            let target = fs::open_in_root(&root, &dest, OFlag::O_PATH, Mode::empty())?;
            let tpath = fs::proc_fd_path(&target);
            mount(
                None::<&str>,
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | extra,
                None::<&str>,
            )
            .map_err(mount_err(format!("remount {dest_str} with {options:?}")))?;
        }
        return Ok(());
    }
    let fstype = match typ.as_str() {
        // A cgroup v1 hierarchy is not set up in the guest: give cgroup2.
        "cgroup" => "cgroup2",
        "" => return Err(invalid(format!("mount {dest_str} has no type"))),
        t => t,
    };
    let target = prepare_target(&root, &dest, false)?;
    let tpath = fs::proc_fd_path(&target);
    let src = if source.is_empty() {
        fstype.to_string()
    } else {
        source
    };
    let data_opt = (!data.is_empty()).then_some(data.as_str());
    let res = mount(
        Some(src.as_str()),
        tpath.as_str(),
        Some(fstype),
        flags,
        data_opt,
    );
    match res {
        Ok(()) => Ok(()),
        // Optional kernel features: a missing one must not stop the container.
        Err(e) if matches!(fstype, "cgroup2" | "mqueue") => {
            tracing::warn!("skipping mount {dest_str} ({fstype}): {}", e.desc());
            Ok(())
        }
        Err(e) => Err(mount_err(format!("mount {fstype} on {dest_str}"))(e)),
    }
}

fn default_mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount> {
    let json = serde_json::json!({
        "destination": dest, "type": typ, "source": source, "options": options,
    });
    serde_json::from_value(json).map_err(|e| AgentError::Internal(format!("default mount: {e}")))
}

/// Device nodes bound from the guest's /dev into a container's /dev.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

fn populate_dev(rootfs: &Path) -> Result<()> {
    let root = fs::open_root(rootfs)?;
    for dev in DEVICES {
        let dest = CleanPath::parse(&format!("/dev/{dev}"))?;
        let target = prepare_target(&root, &dest, true)?;
        let tpath = fs::proc_fd_path(&target);
        let src = format!("/dev/{dev}");
        mount(
            Some(src.as_str()),
            tpath.as_str(),
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {src} into the container")))?;
    }
    let dev = fs::open_in_root(
        &root,
        &CleanPath::parse("/dev")?,
        OFlag::O_PATH | OFlag::O_DIRECTORY,
        Mode::empty(),
    )?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        match nix::unistd::symlinkat(target, dev.as_fd(), name) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(AgentError::os(format!("symlink /dev/{name}"), e)),
        }
    }
    Ok(())
}

/// Mount the container's root filesystem and every mount of its spec
/// under `bundle`. On error, everything mounted so far is detached.
pub fn mount_container(
    bundle: &Path,
    spec: &Spec,
    rootfs: &burrow_protocol::agent::Rootfs,
) -> Result<PathBuf> {
    let target = bundle.join("rootfs");
    let res = mount_container_inner(bundle, &target, spec, rootfs);
    if res.is_err() {
        unmount_container(bundle);
    }
    res.map(|()| target)
}

fn mount_container_inner(
    bundle: &Path,
    target: &Path,
    spec: &Spec,
    rootfs: &burrow_protocol::agent::Rootfs,
) -> Result<()> {
    let mkdir = |p: &Path| {
        std::fs::create_dir_all(p).map_err(|e| AgentError::io(format!("mkdir {}", p.display()), e))
    };
    mkdir(target)?;
    let (flags, _, data) = parse_options(&rootfs.options);
    let data_opt = (!data.is_empty()).then_some(data.as_str());
    let source = rootfs.source.as_str();
    if source.is_empty() {
        return Err(invalid("rootfs.source is empty"));
    }
    let lower = if rootfs.writable_overlay {
        bundle.join("lower")
    } else {
        target.to_path_buf()
    };
    mkdir(&lower)?;
    if rootfs.fstype == "bind" {
        if !Path::new(source).is_dir() {
            return Err(invalid(format!(
                "rootfs source {source} is not a directory"
            )));
        }
        mount(
            Some(source),
            &lower,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {source} as the container root")))?;
    } else {
        if rootfs.fstype.is_empty() {
            return Err(invalid(
                "rootfs.fstype is empty (want e.g. ext4, or \"bind\")",
            ));
        }
        let flags = if rootfs.writable_overlay {
            flags | MsFlags::MS_RDONLY
        } else {
            flags
        };
        mount(
            Some(source),
            &lower,
            Some(rootfs.fstype.as_str()),
            flags,
            data_opt,
        )
        .map_err(mount_err(format!(
            "mount {source} ({}) as the container root",
            rootfs.fstype
        )))?;
    }
    if rootfs.writable_overlay {
        let scratch = bundle.join("scratch");
        mkdir(&scratch)?;
        mount(
            Some("tmpfs"),
            &scratch,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        )
        .map_err(mount_err("mount the overlay's tmpfs".into()))?;
        mkdir(&scratch.join("upper"))?;
        mkdir(&scratch.join("work"))?;
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            scratch.join("upper").display(),
            scratch.join("work").display()
        );
        mount(
            Some("overlay"),
            target,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts.as_str()),
        )
        .map_err(mount_err("mount the writable overlay".into()))?;
    }
    let mut mounts: Vec<Mount> = spec.mounts().clone().unwrap_or_default();
    if mounts.len() > MAX_MOUNTS {
        return Err(invalid(format!(
            "spec has {} mounts, more than {MAX_MOUNTS}",
            mounts.len()
        )));
    }
    let has = |mounts: &[Mount], d: &str| mounts.iter().any(|m| m.destination() == Path::new(d));
    let mut defaults = Vec::new();
    if !has(&mounts, "/proc") {
        defaults.push(default_mount(
            "/proc",
            "proc",
            "proc",
            &["nosuid", "noexec", "nodev"],
        )?);
    }
    if !has(&mounts, "/dev") {
        defaults.push(default_mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?);
        if !has(&mounts, "/dev/pts") {
            defaults.push(default_mount(
                "/dev/pts",
                "devpts",
                "devpts",
                &[
                    "nosuid",
                    "noexec",
                    "newinstance",
                    "ptmxmode=0666",
                    "mode=0620",
                ],
            )?);
        }
    }
    if !has(&mounts, "/sys") {
        defaults.push(default_mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?);
    }
    defaults.append(&mut mounts);
    let mounts = defaults;
    for m in &mounts {
        do_mount(target, m)?;
    }
    populate_dev(target)?;
    if let Some(linux) = spec.linux() {
        let root = fs::open_root(target)?;
        for p in linux.readonly_paths().iter().flatten() {
            let Ok(fd) =
                fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())
            else {
                continue;
            };
            let tpath = fs::proc_fd_path(&fd);
            mount(
                Some(tpath.as_str()),
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(mount_err(format!("bind readonly path {p}")))?;
            let fd = fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())?;
            let tpath = fs::proc_fd_path(&fd);
            mount(
                None::<&str>,
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND
                    | MsFlags::MS_REMOUNT
                    | MsFlags::MS_RDONLY
                    | MsFlags::MS_NOSUID
                    | MsFlags::MS_NODEV
                    | MsFlags::MS_NOEXEC,
                None::<&str>,
            )
            .map_err(mount_err(format!("make {p} read-only")))?;
        }
        for p in linux.masked_paths().iter().flatten() {
            let Ok(fd) =
                fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())
            else {
                continue;
            };
            let tpath = fs::proc_fd_path(&fd);
            let is_dir = nix::sys::stat::fstat(fd.as_fd())
                .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
                .unwrap_or(false);
            let res = if is_dir {
                mount(
                    Some("tmpfs"),
                    tpath.as_str(),
                    Some("tmpfs"),
                    MsFlags::MS_RDONLY,
                    None::<&str>,
                )
            } else {
                mount(
                    Some("/dev/null"),
                    tpath.as_str(),
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
            };
            res.map_err(mount_err(format!("mask {p}")))?;
        }
    }
    if spec
        .root()
        .as_ref()
        .and_then(|r| r.readonly())
        .unwrap_or(false)
    {
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(mount_err("make the container root read-only".into()))?;
    }
    Ok(())
}

/// Detach everything mounted for a container and remove its directories
/// (only empty ones: a failed unmount never deletes container data).
pub fn unmount_container(bundle: &Path) {
    for sub in ["rootfs", "scratch", "lower"] {
        let p = bundle.join(sub);
        if p.exists() {
            let _ = umount2(&p, MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(&p);
        }
    }
    let _ = std::fs::remove_dir(bundle);
}
