//! Starting processes: fork in the agent, set the child up with plain system
//! calls, then exec.
//!
//! Everything the child needs (C strings, ids, capability masks, namespace
//! fds) is prepared in the parent as a [`ChildPlan`]. Between fork and exec
//! the child (`child`) only makes system calls on that data and never
//! allocates, locks or logs, which keeps forking from a multi-threaded PID 1
//! safe. Failures
//! travel back over a close-on-exec status pipe as a fixed-size record
//! (errno + which step failed); the pipe reaching EOF means exec succeeded.
//!
//! Processes are forked here and never through `std::process::Command`:
//! PID 1 reaps every child with `waitpid(-1)` (see `reaper`), which would
//! race std's own `wait` on an exec failure.

mod child;

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{LazyLock, Mutex};

use nix::errno::Errno;
use tokio::sync::watch;

use crate::error::{AgentError, Result};

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    pub code: i32,
    pub signal: u32,
}

/// Every child we forked and still wait for, by pid. The reaper looks a pid
/// up only after taking this lock, and `spawn` holds it from fork until the
/// pid is inserted, so an early exit is never missed.
pub static CHILDREN: LazyLock<Mutex<HashMap<i32, watch::Sender<Option<ExitStatus>>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Run `f` with the children lock held: any fd created in `f` without
/// O_CLOEXEC cannot leak into a concurrently forked child.
pub fn with_fork_lock<T>(f: impl FnOnce() -> T) -> T {
    let _guard = CHILDREN.lock().unwrap_or_else(|p| p.into_inner());
    f()
}

/// Namespace setup of a child.
#[derive(Debug)]
pub enum Namespaces {
    /// Stay in the agent's namespaces (container_id "").
    Guest,
    /// A container's init: new mount, UTS and IPC namespaces, pivot_root
    /// into `rootfs` (already fully mounted by the agent), and with `pid` a
    /// PID namespace of its own whose /proc the child mounts itself.
    NewContainer {
        rootfs: CString,
        hostname: Option<CString>,
        pid: Option<ProcMasks>,
        /// A pod's IPC, UTS and PID namespaces to join instead of new ones
        /// (fd, CLONE_NEW* type; the PID one is entered by forking into it,
        /// and the child mounts its /proc as for a new one).
        join: Vec<(OwnedFd, libc::c_int)>,
    },
    /// Join a running container through fds of its init's namespaces
    /// (`fds`: set up in the child) and PID namespace (`pid`: entered by
    /// the forking thread, since a PID namespace applies to children).
    Join {
        fds: Vec<OwnedFd>,
        pid: Option<OwnedFd>,
    },
}

/// The spec's masked and read-only paths under /proc, applied again to the
/// /proc a container with its own PID namespace mounts (the agent's copies
/// of them sit on the agent's /proc, which the child replaces).
#[derive(Debug, Default)]
pub struct ProcMasks {
    pub masked: Vec<CString>,
    pub readonly: Vec<CString>,
}

/// Capability sets as bit masks (bit n = capability n).
#[derive(Debug, Clone, Copy, Default)]
pub struct CapSets {
    pub bounding: u64,
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
    pub ambient: u64,
}

/// Everything a child does between fork and exec.
#[derive(Debug)]
pub struct ChildPlan {
    pub argv: Vec<CString>,
    pub env: Vec<CString>,
    /// Paths to try for argv[0] (a PATH search, done in the child's root).
    pub exec_paths: Vec<CString>,
    pub cwd: CString,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub umask: Option<u32>,
    pub namespaces: Namespaces,
    pub rlimits: Vec<(i32, u64, u64)>,
    pub no_new_privileges: bool,
    pub caps: Option<CapSets>,
    pub last_cap: u32,
    pub terminal: bool,
    /// Extra fds the program inherits as fds 3, 4, ... in this order (e.g.
    /// chromium's `--remote-debugging-pipe` pair); at most [`MAX_PASS_FDS`].
    pub pass_fds: Vec<OwnedFd>,
    /// Written to /proc/self/oom_score_adj first thing (the agent itself
    /// runs at -1000, which children must not inherit).
    pub oom_score_adj: CString,
    /// The container's seccomp filters, installed just before exec (with
    /// no_new_privileges) or before giving up root (without: installing
    /// then needs CAP_SYS_ADMIN), as runc does.
    pub seccomp: crate::container::seccomp::Seccomp,
    /// The container's `cgroup.procs`: the child writes "0" into it first
    /// thing, so that it and all it forks live in the container's cgroup.
    pub cgroup_procs: Option<OwnedFd>,
}

/// Most extra fds a child may inherit.
pub const MAX_PASS_FDS: usize = 8;

/// The child's ends of its stdio.
pub struct ChildStdio {
    pub stdin: OwnedFd,
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
}

/// A child forked but held before exec until [`Gate::release`].
#[derive(Debug)]
pub struct Gate {
    start: OwnedFd,
    status: OwnedFd,
    names: Names,
}

/// What a failed step acted on, for its error: the program and the
/// working directory, as the caller gave them.
#[derive(Debug, Clone)]
struct Names {
    program: String,
    cwd: String,
}

impl Names {
    fn of(plan: &ChildPlan) -> Self {
        let lossy = |c: Option<&CString>| {
            c.map(|c| String::from_utf8_lossy(c.as_bytes()).into_owned())
                .unwrap_or_default()
        };
        Names {
            program: lossy(plan.argv.first()),
            cwd: lossy(Some(&plan.cwd)),
        }
    }
}

const RECORD: usize = 64;

/// Fork a child that carries out `plan`. With `gated`, the child stops
/// after its setup and waits for [`Gate::release`]; without, this returns
/// once exec succeeded or failed.
pub async fn spawn(
    plan: ChildPlan,
    stdio: ChildStdio,
    gated: bool,
) -> Result<(i32, watch::Receiver<Option<ExitStatus>>, Option<Gate>)> {
    if plan.pass_fds.len() > MAX_PASS_FDS {
        return Err(AgentError::Internal(format!(
            "{} fds to pass, more than {MAX_PASS_FDS}",
            plan.pass_fds.len()
        )));
    }
    let (status_r, status_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| AgentError::os("create a status pipe", e))?;
    let (start_r, start_w) = if gated {
        // A socket pair rather than a pipe: the gate can pass the child its
        // terminal (an fd) before the start byte.
        let (r, w) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| AgentError::os("create a start socket", e))?;
        (Some(r), Some(w))
    } else {
        (None, None)
    };
    let names = Names::of(&plan);
    let (pid, rx) = fork_child(&plan, &stdio, &status_w, start_r.as_ref())?;
    drop(status_w);
    drop(start_r);
    drop(stdio);
    drop(plan);
    let mut status = status_r;
    if let Some(start) = start_w {
        let (st, rec) = read_record(status).await?;
        status = st;
        match rec {
            Some(b) if b.first() == Some(&b'R') => Ok((
                pid,
                rx,
                Some(Gate {
                    start,
                    status,
                    names,
                }),
            )),
            Some(b) => Err(decode_failure(&b, &names)),
            None => Err(AgentError::Internal("the process died during setup".into())),
        }
    } else {
        match read_record(status).await?.1 {
            None => Ok((pid, rx, None)),
            Some(b) => Err(decode_failure(&b, &names)),
        }
    }
}

/// fork(2) from this thread with its children placed in PID namespace `ns`,
/// then put the thread back: setns(CLONE_NEWPID) only changes where the
/// calling thread's future children go.
fn fork_in_pid_namespace(ns: &OwnedFd) -> Result<i32> {
    let own = nix::fcntl::open(
        "/proc/thread-self/ns/pid",
        nix::fcntl::OFlag::O_RDONLY | nix::fcntl::OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| AgentError::os("open the agent's PID namespace", e))?;
    // SAFETY: setns(2) on fds we own.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWPID) } < 0 {
        return Err(AgentError::os(
            "enter the container's PID namespace",
            Errno::last(),
        ));
    }
    // SAFETY: as in `fork_child`: the child only runs `child_main`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        return Ok(0);
    }
    let fork_errno = Errno::last();
    // SAFETY: setns(2) back into this thread's own active PID namespace.
    if unsafe { libc::setns(own.as_raw_fd(), libc::CLONE_NEWPID) } < 0 {
        // Every later child of this thread would land in the container.
        tracing::error!(
            "cannot return to the agent's PID namespace: {}",
            Errno::last()
        );
        std::process::abort();
    }
    if pid < 0 {
        return Err(AgentError::os("fork", fork_errno));
    }
    Ok(pid)
}

/// Fork under the children lock; the child runs `child_main`.
fn fork_child(
    plan: &ChildPlan,
    stdio: &ChildStdio,
    status_w: &OwnedFd,
    start_r: Option<&OwnedFd>,
) -> Result<(i32, watch::Receiver<Option<ExitStatus>>)> {
    let argv_ptrs = null_terminated(&plan.argv);
    let env_ptrs = null_terminated(&plan.env);
    let (tx, rx) = watch::channel(None);
    let mut children = CHILDREN.lock().unwrap_or_else(|p| p.into_inner());
    // A pod's PID namespace (shareProcessNamespace) is entered by forking
    // into it, as for an exec.
    let pod_pid = match &plan.namespaces {
        Namespaces::NewContainer { join, .. } => join
            .iter()
            .find(|(_, kind)| *kind == libc::CLONE_NEWPID)
            .map(|(fd, _)| fd),
        _ => None,
    };
    let pid = match (&plan.namespaces, pod_pid) {
        (_, Some(ns)) => fork_in_pid_namespace(ns)?,
        (Namespaces::NewContainer { pid: Some(_), .. }, None) => {
            // SAFETY: clone(2) without CLONE_VM and without a new stack is
            // fork(2) with extra flags; the child runs only `child_main`
            // (system calls on memory prepared before, never returns).
            unsafe {
                libc::syscall(
                    libc::SYS_clone,
                    (libc::SIGCHLD | libc::CLONE_NEWPID) as libc::c_ulong,
                    0usize,
                    0usize,
                    0usize,
                    0usize,
                ) as i32
            }
        }
        (Namespaces::Join { pid: Some(ns), .. }, None) => fork_in_pid_namespace(ns)?,
        // SAFETY: the child only runs `child_main`, which makes system
        // calls on memory prepared before the fork and never returns.
        _ => unsafe { libc::fork() },
    };
    if pid == 0 {
        let start_fd = start_r.map_or(-1, AsRawFd::as_raw_fd);
        // SAFETY: see above; all pointers stay valid (owned by `plan`).
        unsafe {
            child::child_main(
                plan,
                stdio,
                &argv_ptrs,
                &env_ptrs,
                status_w.as_raw_fd(),
                start_fd,
            )
        }
    }
    if pid < 0 {
        return Err(AgentError::os("fork", Errno::last()));
    }
    children.insert(pid, tx);
    Ok((pid, rx))
}

impl Gate {
    /// Give the held child `tty` as its stdin/stdout/stderr and controlling
    /// terminal (opened after the child's namespaces exist, so from its own
    /// devpts).
    pub fn send_terminal(&self, tty: &OwnedFd) -> Result<()> {
        let fds = [tty.as_raw_fd()];
        let cmsg = [nix::sys::socket::ControlMessage::ScmRights(&fds)];
        let iov = [std::io::IoSlice::new(b"T")];
        nix::sys::socket::sendmsg::<()>(
            self.start.as_raw_fd(),
            &iov,
            &cmsg,
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .map_err(|e| AgentError::os("pass the terminal to the process", e))?;
        Ok(())
    }

    /// Let the held child exec; returns once exec succeeded or failed.
    pub async fn release(self) -> Result<()> {
        nix::unistd::write(&self.start, b"S")
            .map_err(|e| AgentError::os("start the process", e))?;
        drop(self.start);
        match read_record(self.status).await?.1 {
            None => Ok(()),
            Some(b) => Err(decode_failure(&b, &self.names)),
        }
    }
}

/// Read one record (or EOF) from the status pipe, off the async threads.
async fn read_record(fd: OwnedFd) -> Result<(OwnedFd, Option<Vec<u8>>)> {
    tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; RECORD];
        let mut got = 0;
        while got < RECORD {
            match nix::unistd::read(&fd, &mut buf[got..]) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(Errno::EINTR) => {}
                Err(e) => return Err(AgentError::os("read the child's status", e)),
            }
        }
        let rec = (got > 0).then(|| buf[..got].to_vec());
        Ok((fd, rec))
    })
    .await
    .map_err(|e| AgentError::Internal(format!("status reader failed: {e}")))?
}

fn decode_failure(rec: &[u8], names: &Names) -> AgentError {
    let errno = rec
        .get(1..5)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map_or(0, i32::from_le_bytes);
    let step_bytes = rec.get(5..).unwrap_or_default();
    let end = step_bytes
        .iter()
        .position(|&b| b == 0)
        .unwrap_or(step_bytes.len());
    let step = String::from_utf8_lossy(step_bytes.get(..end).unwrap_or_default());
    let err = Errno::from_raw(errno);
    // The steps that act on a name the caller gave say which (as runc's
    // `exec: "x": no such file or directory`).
    let what = match step.as_ref() {
        "exec" => format!(" {:?}", names.program),
        "chdir to the working directory" => format!(" {:?}", names.cwd),
        _ => String::new(),
    };
    let msg = format!(
        "starting the process failed at {step}{what}: {}",
        err.desc()
    );
    match err {
        Errno::ENOENT => AgentError::NotFound(msg),
        Errno::EACCES | Errno::EPERM => AgentError::PermissionDenied(msg),
        _ => AgentError::FailedPrecondition(msg),
    }
}

fn null_terminated(strings: &[CString]) -> Vec<*const libc::c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cstrings(v: &[&str]) -> Vec<CString> {
        v.iter()
            .map(|s| CString::new(*s).expect("no NUL"))
            .collect()
    }

    /// Passed fds arrive as 3, 4, ... in order, and nothing else leaks.
    #[tokio::test]
    async fn pass_fds_become_3_and_4() {
        let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        let (a_r, a_w) = pipe();
        let (b_r, b_w) = pipe();
        let (out_r, out_w) = pipe();
        let null = |flags| {
            nix::fcntl::open(
                "/dev/null",
                flags | nix::fcntl::OFlag::O_CLOEXEC,
                nix::sys::stat::Mode::empty(),
            )
            .expect("/dev/null")
        };
        let plan = ChildPlan {
            argv: cstrings(&[
                "sh",
                "-c",
                "echo three >&3; echo four >&4; ls /proc/self/fd",
            ]),
            env: cstrings(&["PATH=/usr/bin:/bin"]),
            exec_paths: cstrings(&["/bin/sh"]),
            cwd: cstrings(&["/"]).remove(0),
            uid: nix::unistd::getuid().as_raw(),
            gid: nix::unistd::getgid().as_raw(),
            groups: Vec::new(),
            umask: None,
            namespaces: Namespaces::Guest,
            rlimits: Vec::new(),
            no_new_privileges: false,
            caps: None,
            last_cap: 40,
            terminal: false,
            pass_fds: vec![a_w, b_w],
            seccomp: Default::default(),
            cgroup_procs: None,
            oom_score_adj: cstrings(&["0"]).remove(0),
        };
        let stdio = ChildStdio {
            stdin: null(nix::fcntl::OFlag::O_RDONLY),
            stdout: out_w,
            stderr: null(nix::fcntl::OFlag::O_WRONLY),
        };
        spawn(plan, stdio, false).await.expect("spawn");
        let read_all = |fd: OwnedFd| {
            let mut f = std::fs::File::from(fd);
            let mut s = String::new();
            std::io::Read::read_to_string(&mut f, &mut s).expect("read");
            s
        };
        assert_eq!(read_all(a_r), "three\n");
        assert_eq!(read_all(b_r), "four\n");
        // ls itself opens one more fd (its directory) while listing.
        let fds: Vec<String> = read_all(out_r).lines().map(str::to_string).collect();
        assert!(
            fds.len() <= 6 && fds.iter().take(5).eq(["0", "1", "2", "3", "4"].iter()),
            "{fds:?}"
        );
    }
}
