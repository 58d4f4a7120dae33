//! Containers: what the agent keeps of each one, and starting their
//! processes (stdio pipes or a terminal, then `spawn`). `plan` turns OCI
//! objects into what a child does, `mounts` prepares a container's root
//! (in the agent's mount namespace under the state directory), `pty` makes
//! its terminals.
//!
//! Written by hand rather than with youki's `libcontainer`: that crate is a
//! whole runtime (state directory, its own fork/clone3 init protocol,
//! console socket, cgroup managers, systemd/dbus) built around being a
//! separate process that detaches, while the agent is PID 1 that must reap
//! everything itself, keep stdio as pipes it serves over ttrpc, and stay
//! small for a fast-booting initramfs. What a container needs inside an
//! already isolating VM is a short list of system calls (see `spawn`).

pub mod cgroup;
pub mod fuzz;
#[cfg(test)]
mod fuzz_tests;
mod hostfiles;
mod mounts;
mod plan;
mod podns;
mod pty;
pub mod seccomp;
mod slot;

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use oci_spec::runtime::Process as OciProcess;

use crate::error::{invalid, AgentError, Result};
use crate::fs;
use crate::process::{ParentStdio, Process};
use crate::spawn::{self, ChildStdio, Namespaces};

pub use mounts::{mount_container, unmount_container};
pub use plan::{parse_process, parse_spec, pid_namespace, plan};
pub use podns::pod_namespaces;
use pty::{open_pty, pty_parent};

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
    /// What confines every process in it.
    pub confine: Confine,
}

/// What every process of a container gets: its `linux.seccomp`, compiled,
/// and its cgroup (none for the guest itself, or in test mode).
#[derive(Debug, Default)]
pub struct Confine {
    pub seccomp: seccomp::Seccomp,
    pub cgroup: Option<cgroup::Cgroup>,
}

impl Container {
    pub fn guest() -> Self {
        Container {
            id: String::new(),
            bundle: None,
            own_pid_ns: false,
            rootfs: PathBuf::from("/"),
            processes: Mutex::new(HashMap::new()),
            confine: Confine::default(),
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
    confine: &Confine,
    want_stdin: bool,
    gated: bool,
) -> Result<Process> {
    let mut plan = plan(p, namespaces)?;
    plan.seccomp = confine.seccomp.clone();
    plan.cgroup_procs = confine
        .cgroup
        .as_ref()
        .map(cgroup::Cgroup::procs)
        .transpose()?;
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
