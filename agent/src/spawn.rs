//! Starting processes: fork in the agent, set the child up with plain system
//! calls, then exec.
//!
//! Everything the child needs (C strings, ids, capability masks, namespace
//! fds) is prepared in the parent as a [`ChildPlan`]. Between fork and exec
//! the child only makes system calls on that data and never allocates, locks
//! or logs, which keeps forking from a multi-threaded PID 1 safe. Failures
//! travel back over a close-on-exec status pipe as a fixed-size record
//! (errno + which step failed); the pipe reaching EOF means exec succeeded.
//!
//! Processes are forked here and never through `std::process::Command`:
//! PID 1 reaps every child with `waitpid(-1)` (see `reaper`), which would
//! race std's own `wait` on an exec failure.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
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
            Some(b) if b.first() == Some(&b'R') => Ok((pid, rx, Some(Gate { start, status }))),
            Some(b) => Err(decode_failure(&b)),
            None => Err(AgentError::Internal("the process died during setup".into())),
        }
    } else {
        match read_record(status).await?.1 {
            None => Ok((pid, rx, None)),
            Some(b) => Err(decode_failure(&b)),
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
    let pid = match &plan.namespaces {
        Namespaces::NewContainer { pid: Some(_), .. } => {
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
        Namespaces::Join { pid: Some(ns), .. } => fork_in_pid_namespace(ns)?,
        // SAFETY: the child only runs `child_main`, which makes system
        // calls on memory prepared before the fork and never returns.
        _ => unsafe { libc::fork() },
    };
    if pid == 0 {
        let start_fd = start_r.map_or(-1, AsRawFd::as_raw_fd);
        // SAFETY: see above; all pointers stay valid (owned by `plan`).
        unsafe {
            child_main(
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
            Some(b) => Err(decode_failure(&b)),
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

fn decode_failure(rec: &[u8]) -> AgentError {
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
    let msg = format!("starting the process failed at {step}: {}", err.desc());
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

/// Write a failure record and exit. Async-signal-safe.
unsafe fn fail(status: RawFd, step: &'static str, errno: i32) -> ! {
    let mut rec = [0u8; RECORD];
    rec[0] = b'E';
    let e = errno.to_le_bytes();
    rec[1..5].copy_from_slice(&e);
    let n = step.len().min(RECORD - 6);
    rec[5..5 + n].copy_from_slice(&step.as_bytes()[..n]);
    // SAFETY: plain write/_exit system calls.
    unsafe {
        libc::write(status, rec.as_ptr().cast(), RECORD);
        libc::_exit(127)
    }
}

/// In a new PID namespace (after pivot_root): replace the agent's /proc by
/// one of this namespace and mask it as the spec asks. Only system calls.
unsafe fn mount_own_proc(status: RawFd, masks: &ProcMasks) {
    // SAFETY: system calls on C strings owned by `masks` or literals.
    unsafe {
        libc::umount2(c"/proc".as_ptr(), libc::MNT_DETACH);
        if libc::mount(
            c"proc".as_ptr(),
            c"/proc".as_ptr(),
            c"proc".as_ptr(),
            libc::MS_NOSUID | libc::MS_NOEXEC | libc::MS_NODEV,
            std::ptr::null(),
        ) < 0
        {
            fail(
                status,
                "mount /proc for the container's PID namespace",
                errno(),
            );
        }
        for path in &masks.masked {
            let file = libc::mount(
                c"/dev/null".as_ptr(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            );
            if file < 0 && errno() == libc::ENOTDIR {
                libc::mount(
                    c"tmpfs".as_ptr(),
                    path.as_ptr(),
                    c"tmpfs".as_ptr(),
                    libc::MS_RDONLY,
                    std::ptr::null(),
                );
            }
        }
        for path in &masks.readonly {
            if libc::mount(
                path.as_ptr(),
                path.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND | libc::MS_REC,
                std::ptr::null(),
            ) == 0
            {
                libc::mount(
                    std::ptr::null(),
                    path.as_ptr(),
                    std::ptr::null(),
                    libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_REC,
                    std::ptr::null(),
                );
            }
        }
    }
}

enum GateMsg {
    Start,
    Terminal(RawFd),
    Nothing,
}

/// One message from the gate socket: the start byte, or a terminal fd.
/// None at EOF or on error. Only system calls (runs in the child).
unsafe fn recv_gate(start: RawFd) -> Option<GateMsg> {
    // SAFETY: recvmsg(2) into buffers on this stack frame; the control
    // buffer is u64-aligned as cmsghdr needs.
    unsafe {
        let mut b = [0u8; 1];
        let mut iov = libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: 1,
        };
        let mut control = [0u64; 8];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&control) as _;
        let n = libc::recvmsg(start, &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 && errno() == libc::EINTR {
            return Some(GateMsg::Nothing);
        }
        if n != 1 {
            return None;
        }
        let c = libc::CMSG_FIRSTHDR(&msg);
        if b[0] == b'T'
            && !c.is_null()
            && (*c).cmsg_level == libc::SOL_SOCKET
            && (*c).cmsg_type == libc::SCM_RIGHTS
        {
            let fd = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>());
            return Some(GateMsg::Terminal(fd));
        }
        Some(if b[0] == b'T' {
            GateMsg::Nothing
        } else {
            GateMsg::Start
        })
    }
}

fn errno() -> i32 {
    Errno::last_raw()
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

/// The child between fork and exec. Only system calls; never returns.
unsafe fn child_main(
    plan: &ChildPlan,
    stdio: &ChildStdio,
    argv: &[*const libc::c_char],
    env: &[*const libc::c_char],
    status: RawFd,
    start: RawFd,
) -> ! {
    // SAFETY: every call below is a system call on memory owned by `plan`,
    // `stdio` or this stack frame; see the module comment.
    unsafe {
        // Default signal dispositions and an empty mask (the agent ignores
        // SIGPIPE; children must not inherit that).
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        let adj = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if adj >= 0 {
            let v = plan.oom_score_adj.as_bytes();
            libc::write(adj, v.as_ptr().cast(), v.len());
            libc::close(adj);
        }
        if libc::setsid() < 0 {
            fail(status, "setsid", errno());
        }
        let fds = [
            stdio.stdin.as_raw_fd(),
            stdio.stdout.as_raw_fd(),
            stdio.stderr.as_raw_fd(),
        ];
        for (target, fd) in fds.iter().enumerate() {
            // dup2 onto 0/1/2 clears close-on-exec there.
            if libc::dup2(*fd, target as i32) < 0 {
                fail(status, "dup2 stdio", errno());
            }
        }
        if plan.terminal && libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
            fail(status, "set controlling terminal", errno());
        }
        match &plan.namespaces {
            Namespaces::Guest => {}
            Namespaces::NewContainer {
                rootfs,
                hostname,
                pid,
            } => {
                if libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC) < 0 {
                    fail(status, "unshare namespaces", errno());
                }
                if libc::mount(
                    std::ptr::null(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) < 0
                {
                    fail(status, "make mounts private", errno());
                }
                if libc::chdir(rootfs.as_ptr()) < 0 {
                    fail(status, "chdir to the container root", errno());
                }
                if libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) < 0 {
                    fail(status, "pivot_root", errno());
                }
                if libc::umount2(c".".as_ptr(), libc::MNT_DETACH) < 0 {
                    fail(status, "detach the old root", errno());
                }
                if libc::chdir(c"/".as_ptr()) < 0 {
                    fail(status, "chdir /", errno());
                }
                if let Some(h) = hostname {
                    if libc::sethostname(h.as_ptr(), h.as_bytes().len()) < 0 {
                        fail(status, "sethostname", errno());
                    }
                }
                if let Some(masks) = pid {
                    mount_own_proc(status, masks);
                }
            }
            Namespaces::Join { fds, .. } => {
                for fd in fds {
                    if libc::setns(fd.as_raw_fd(), 0) < 0 {
                        fail(status, "join the container's namespaces", errno());
                    }
                }
            }
        }
        // From here on the child holds only stdio, the fds it is to pass on
        // (3 .. 3+n), the status pipe (3+n) and the start pipe (4+n): a
        // child waiting at the gate must not keep other processes' pipes
        // open. Everything is first copied above the targets so that no
        // dup2 below clobbers a source.
        let n = plan.pass_fds.len().min(MAX_PASS_FDS) as RawFd;
        let above = 5 + n;
        let mut passed = [-1 as RawFd; MAX_PASS_FDS];
        for (slot, fd) in passed.iter_mut().zip(&plan.pass_fds) {
            *slot = libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, above);
            if *slot < 0 {
                fail(status, "copy a passed fd", errno());
            }
        }
        let status_tmp = libc::fcntl(status, libc::F_DUPFD_CLOEXEC, above);
        if status_tmp < 0 {
            fail(status, "move the status pipe", errno());
        }
        let status = status_tmp;
        let start_tmp = if start >= 0 {
            libc::fcntl(start, libc::F_DUPFD_CLOEXEC, above)
        } else {
            -1
        };
        if start >= 0 && start_tmp < 0 {
            fail(status, "move the start pipe", errno());
        }
        for (i, &fd) in passed.iter().take(n as usize).enumerate() {
            // dup2 clears close-on-exec on the target: the program keeps it.
            if libc::dup2(fd, 3 + i as RawFd) < 0 {
                fail(status, "pass an fd", errno());
            }
        }
        if libc::dup2(status, 3 + n) < 0 {
            fail(status, "move the status pipe", errno());
        }
        let status: RawFd = 3 + n;
        libc::fcntl(status, libc::F_SETFD, libc::FD_CLOEXEC);
        let start: RawFd = if start_tmp >= 0 {
            if libc::dup2(start_tmp, 4 + n) < 0 {
                fail(status, "move the start pipe", errno());
            }
            libc::fcntl(4 + n, libc::F_SETFD, libc::FD_CLOEXEC);
            4 + n
        } else {
            -1
        };
        let first_closed = (if start >= 0 { 5 + n } else { 4 + n }) as libc::c_uint;
        if libc::syscall(libc::SYS_close_range, first_closed, libc::c_uint::MAX, 0) < 0 {
            fail(status, "close inherited fds", errno());
        }
        for &(resource, soft, hard) in &plan.rlimits {
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(resource as _, &lim) < 0 {
                fail(status, "setrlimit", errno());
            }
        }
        if let Some(caps) = &plan.caps {
            for cap in 0..=plan.last_cap.min(63) {
                if caps.bounding & (1u64 << cap) == 0
                    && libc::prctl(libc::PR_CAPBSET_DROP, cap as libc::c_ulong, 0, 0, 0) < 0
                {
                    fail(status, "drop a bounding capability", errno());
                }
            }
            if libc::prctl(libc::PR_SET_KEEPCAPS, 1, 0, 0, 0) < 0 {
                fail(status, "keep capabilities", errno());
            }
        }
        // Raw system calls, not glibc's setgroups/setres[ug]id: those apply
        // the change to every thread glibc knows of (signalling each and
        // waiting), and a child made by a raw clone(2) still carries the
        // agent's thread list. In a new PID namespace the agent's main
        // thread (tid 1 when it is the guest's init) is the child itself,
        // and the wait never ends.
        if libc::syscall(libc::SYS_setgroups, plan.groups.len(), plan.groups.as_ptr()) < 0 {
            fail(status, "setgroups", errno());
        }
        if libc::syscall(libc::SYS_setresgid, plan.gid, plan.gid, plan.gid) < 0 {
            fail(status, "setgid", errno());
        }
        if libc::syscall(libc::SYS_setresuid, plan.uid, plan.uid, plan.uid) < 0 {
            fail(status, "setuid", errno());
        }
        if let Some(caps) = &plan.caps {
            let header = CapHeader {
                version: CAP_VERSION_3,
                pid: 0,
            };
            let data = [
                CapData {
                    effective: caps.effective as u32,
                    permitted: caps.permitted as u32,
                    inheritable: caps.inheritable as u32,
                },
                CapData {
                    effective: (caps.effective >> 32) as u32,
                    permitted: (caps.permitted >> 32) as u32,
                    inheritable: (caps.inheritable >> 32) as u32,
                },
            ];
            if libc::syscall(libc::SYS_capset, &header as *const CapHeader, data.as_ptr()) < 0 {
                fail(status, "capset", errno());
            }
            for cap in 0..=plan.last_cap.min(63) {
                if caps.ambient & (1u64 << cap) != 0
                    && libc::prctl(
                        libc::PR_CAP_AMBIENT,
                        libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong,
                        cap as libc::c_ulong,
                        0,
                        0,
                    ) < 0
                {
                    fail(status, "raise an ambient capability", errno());
                }
            }
        }
        if libc::chdir(plan.cwd.as_ptr()) < 0 {
            fail(status, "chdir to the working directory", errno());
        }
        if let Some(mask) = plan.umask {
            libc::umask(mask as libc::mode_t);
        }
        if plan.no_new_privileges && libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
            fail(status, "set no_new_privileges", errno());
        }
        if start >= 0 {
            let ready = [b'R'; RECORD];
            libc::write(status, ready.as_ptr().cast(), RECORD);
            loop {
                match recv_gate(start) {
                    Some(GateMsg::Start) => break,
                    Some(GateMsg::Terminal(fd)) => {
                        for target in 0..3 {
                            if libc::dup2(fd, target) < 0 {
                                fail(status, "install the terminal", errno());
                            }
                        }
                        libc::close(fd);
                        if libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                            fail(status, "set controlling terminal", errno());
                        }
                    }
                    Some(GateMsg::Nothing) => {}
                    // The agent dropped us without starting: quietly go away.
                    None => libc::_exit(1),
                }
            }
        }
        let mut err = libc::ENOENT;
        for path in &plan.exec_paths {
            libc::execve(path.as_ptr(), argv.as_ptr(), env.as_ptr());
            let e = errno();
            // Like execvp: remember a more telling error than ENOENT.
            if e != libc::ENOENT && e != libc::ENOTDIR {
                err = e;
            }
        }
        fail(status, "exec", err)
    }
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
