//! The child side of [`spawn`](super::spawn): what runs between fork (or
//! clone) and exec. Async-signal-safe: only system calls on data the parent
//! prepared, no allocation, locks or logging (the agent is multi-threaded,
//! and a raw-clone child still carries glibc's idea of its threads).

use std::os::fd::{AsRawFd, RawFd};

use nix::errno::Errno;

use super::{ChildPlan, ChildStdio, Namespaces, ProcMasks, MAX_PASS_FDS, RECORD};

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

/// Install the container's seccomp filters (compiled before the fork).
///
/// # Safety
/// Called in the forked child; only system calls.
unsafe fn install_seccomp(status: RawFd, seccomp: &crate::container::seccomp::Seccomp) {
    for prog in &seccomp.filters {
        let fprog = libc::sock_fprog {
            // At most 4096 instructions: checked when compiled.
            len: prog.len() as libc::c_ushort,
            // seccompiler's sock_filter has the kernel's layout.
            filter: prog.as_ptr().cast_mut().cast(),
        };
        // SAFETY: seccomp(2) copies the program; fail() only writes and exits.
        unsafe {
            if libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                seccomp.flags,
                &fprog as *const libc::sock_fprog,
            ) < 0
            {
                fail(status, "install the seccomp profile", errno());
            }
        }
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
pub(super) unsafe fn child_main(
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
        if let Some(procs) = &plan.cgroup_procs {
            if libc::write(procs.as_raw_fd(), c"0".as_ptr().cast(), 1) < 0 {
                fail(status, "join the container's cgroup", errno());
            }
        }
        let adj = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
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
                join,
            } => {
                let mut new = libc::CLONE_NEWNS | libc::CLONE_NEWUTS | libc::CLONE_NEWIPC;
                // A pod PID namespace was entered by the fork already.
                for (fd, kind) in join.iter().filter(|(_, k)| *k != libc::CLONE_NEWPID) {
                    if libc::setns(fd.as_raw_fd(), *kind) < 0 {
                        fail(status, "join the pod's namespaces", errno());
                    }
                    new &= !*kind;
                }
                if libc::unshare(new) < 0 {
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
                // In the pod's UTS namespace the sandbox owns the name.
                if let Some(h) = hostname.as_ref().filter(|_| new & libc::CLONE_NEWUTS != 0) {
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
        if !plan.no_new_privileges {
            install_seccomp(status, &plan.seccomp);
        }
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
        if plan.no_new_privileges {
            install_seccomp(status, &plan.seccomp);
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
