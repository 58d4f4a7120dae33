//! Seccomp allow-lists, one per kind of thread (the `seccompiler` crate of
//! rust-vmm). Any other syscall kills the whole process with SIGSYS.
//!
//! - **VMM thread** (the event loop: virtqueues, vsock's host sockets, the
//!   control API, snapshots, the serial log): file I/O on open fds and on
//!   the jail's few directories, unix sockets only, epoll, KVM ioctls,
//!   threads (not processes). It starts the vCPU and parent-watch threads,
//!   which inherit its filter and add their own: theirs is the
//!   intersection.
//! - **vCPU threads**: KVM ioctls, and the device work a vCPU exit does in
//!   place (serial output and its rotation, eventfd kicks, MMIO register
//!   writes that activate a device); no new sockets, no `connect`/`accept`,
//!   no threads, no epoll.
//! - **parent-watch thread**: waits in `poll` on the parent's pidfd, `getppid`, writes one line, exits.
//!
//! `ioctl` is allowed for KVM's ioctls (type 0xAE), `FIONBIO` and a tap's
//! `TUNSETOFFLOAD`/`TUNSETVNETHDRSZ`; `socket`
//! for `AF_UNIX`; `clone` only with `CLONE_THREAD`; `clone3` (whose flags
//! a filter cannot see) fails with ENOSYS, so glibc falls back to `clone`;
//! `tgkill` only within this process; `prctl` only to name a thread or set
//! `no_new_privs`; `seccomp` only to add a filter.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition,
    SeccompFilter, SeccompRule,
};

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("seccomp filter: {0}")]
    Build(String),
    #[error("installing the {0:?} thread's seccomp filter: {1}")]
    Apply(Thread, String),
}

/// The kinds of thread, each with its filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thread {
    Vmm,
    Vcpu,
    ParentWatch,
}

struct Filters {
    vmm: BpfProgram,
    no_clone3: BpfProgram,
    vcpu: BpfProgram,
    watch: BpfProgram,
}

/// Compiled by [`prepare`]; `None` inside when seccomp is off.
static FILTERS: OnceLock<Option<Filters>> = OnceLock::new();

type Rules = BTreeMap<i64, Vec<SeccompRule>>;

fn allow(rules: &mut Rules, syscalls: &[libc::c_long]) {
    for &s in syscalls {
        rules.insert(s, Vec::new());
    }
}

fn cond(arg: u8, op: Op, value: u64) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, Len::Dword, op, value)
        .map_err(|e| SeccompError::Build(e.to_string()))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conds).map_err(|e| SeccompError::Build(e.to_string()))
}

/// Every thread: memory, futexes, signals, time, reading and writing open
/// fds, leaving.
fn common(rules: &mut Rules) -> Result<(), SeccompError> {
    use libc::*;
    allow(
        rules,
        &[
            SYS_read,
            SYS_write,
            SYS_readv,
            SYS_writev,
            SYS_close,
            SYS_lseek,
            SYS_fstat,
            SYS_newfstatat,
            SYS_statx,
            SYS_fcntl,
            SYS_futex,
            SYS_rt_sigreturn,
            SYS_rt_sigprocmask,
            SYS_sigaltstack,
            SYS_mmap,
            SYS_munmap,
            SYS_mprotect,
            SYS_madvise,
            SYS_mremap,
            SYS_brk,
            SYS_exit,
            SYS_exit_group,
            SYS_clock_gettime,
            SYS_clock_nanosleep,
            SYS_nanosleep,
            SYS_sched_yield,
            SYS_getpid,
            SYS_gettid,
            SYS_getrandom,
            SYS_restart_syscall,
        ],
    );
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { getpid() } as u64;
    rules.insert(SYS_tgkill, vec![rule(vec![cond(0, Op::Eq, pid)?])?]);
    Ok(())
}

/// `TUNSETOFFLOAD` and `TUNSETVNETHDRSZ`: a virtio-net device sets them
/// on its (passed) tap when the guest negotiates features.
const TUN_IOCTLS: [u64; 2] = [0x4004_54d0, 0x4004_54d8];

/// KVM's ioctls (type 0xAE), FIONBIO and the tap's offload settings.
fn ioctls(rules: &mut Rules) -> Result<(), SeccompError> {
    let mut allowed = vec![
        rule(vec![cond(1, Op::MaskedEq(0xff00), 0xae00)?])?,
        rule(vec![cond(1, Op::Eq, libc::FIONBIO)?])?,
    ];
    for t in TUN_IOCTLS {
        allowed.push(rule(vec![cond(1, Op::Eq, t)?])?);
    }
    rules.insert(libc::SYS_ioctl, allowed);
    Ok(())
}

/// Writing files in the jail's directories (serial log rotation,
/// snapshots written by path) and block I/O.
fn files(rules: &mut Rules) {
    use libc::*;
    allow(
        rules,
        &[
            SYS_openat,
            SYS_pread64,
            SYS_pwrite64,
            SYS_preadv,
            SYS_pwritev,
            SYS_preadv2,
            SYS_pwritev2,
            SYS_fsync,
            SYS_fdatasync,
            SYS_ftruncate,
            SYS_fallocate,
            SYS_rename,
            SYS_renameat,
            SYS_renameat2,
            SYS_unlink,
            SYS_unlinkat,
            SYS_sendto,
            SYS_recvfrom,
            SYS_sendmsg,
            SYS_recvmsg,
            SYS_shutdown,
        ],
    );
}

fn vmm_rules() -> Result<Rules, SeccompError> {
    use libc::*;
    let mut r = Rules::new();
    common(&mut r)?;
    ioctls(&mut r)?;
    files(&mut r);
    allow(
        &mut r,
        &[
            SYS_epoll_wait,
            SYS_epoll_pwait,
            SYS_epoll_ctl,
            SYS_epoll_create1,
            SYS_eventfd2,
            SYS_accept,
            SYS_accept4,
            SYS_connect,
            SYS_getsockopt,
            SYS_setsockopt,
            SYS_getsockname,
            SYS_getpeername,
            SYS_mkdir,
            SYS_mkdirat,
            SYS_readlink,
            SYS_readlinkat,
            SYS_getcwd,
            SYS_dup,
            SYS_dup3,
            SYS_getppid,
            SYS_rt_sigaction,
            // starting threads (glibc sets up its cancellation signal on the
            // first; its thread start runs the rest in the new thread)
            SYS_clone3,
            SYS_set_robust_list,
            SYS_rseq,
            SYS_sched_getaffinity,
        ],
    );
    r.insert(
        SYS_socket,
        vec![rule(vec![cond(0, Op::Eq, AF_UNIX as u64)?])?],
    );
    r.insert(
        SYS_clone,
        vec![rule(vec![cond(
            0,
            Op::MaskedEq(CLONE_THREAD as u64),
            CLONE_THREAD as u64,
        )?])?],
    );
    // Naming a new thread; a new thread installing its own filter (which
    // can only narrow what it may do).
    r.insert(
        SYS_prctl,
        vec![
            rule(vec![cond(0, Op::Eq, PR_SET_NAME as u64)?])?,
            rule(vec![cond(0, Op::Eq, PR_SET_NO_NEW_PRIVS as u64)?])?,
        ],
    );
    r.insert(
        SYS_seccomp,
        vec![rule(vec![cond(
            0,
            Op::Eq,
            u64::from(SECCOMP_SET_MODE_FILTER),
        )?])?],
    );
    Ok(r)
}

fn vcpu_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    common(&mut r)?;
    ioctls(&mut r)?;
    files(&mut r);
    Ok(r)
}

fn watch_rules() -> Result<Rules, SeccompError> {
    let mut r = Rules::new();
    common(&mut r)?;
    allow(&mut r, &[libc::SYS_getppid, libc::SYS_poll, libc::SYS_ppoll]);
    Ok(r)
}

fn compile(
    rules: Rules,
    mismatch: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| SeccompError::Build(e.to_string()))?;
    SeccompFilter::new(rules, mismatch, matched, arch)
        .and_then(TryInto::try_into)
        .map_err(|e| SeccompError::Build(e.to_string()))
}

/// Compile the filters (before the jail: the pid goes into `tgkill`'s
/// rule). With `enabled` false every [`apply`] is a no-op.
pub fn prepare(enabled: bool) -> Result<(), SeccompError> {
    let filters = if enabled {
        let deny = SeccompAction::KillProcess;
        let mut clone3 = Rules::new();
        allow(&mut clone3, &[libc::SYS_clone3]);
        Some(Filters {
            vmm: compile(vmm_rules()?, deny.clone(), SeccompAction::Allow)?,
            no_clone3: compile(
                clone3,
                SeccompAction::Allow,
                SeccompAction::Errno(libc::ENOSYS as u32),
            )?,
            vcpu: compile(vcpu_rules()?, deny.clone(), SeccompAction::Allow)?,
            watch: compile(watch_rules()?, deny, SeccompAction::Allow)?,
        })
    } else {
        None
    };
    let _ = FILTERS.set(filters);
    Ok(())
}

/// Install the calling thread's filter (a no-op unless [`prepare`]d with
/// seccomp on).
pub fn apply(thread: Thread) -> Result<(), SeccompError> {
    let Some(Some(f)) = FILTERS.get() else {
        return Ok(());
    };
    let progs: &[&BpfProgram] = match thread {
        Thread::Vmm => &[&f.no_clone3, &f.vmm],
        Thread::Vcpu => &[&f.vcpu],
        Thread::ParentWatch => &[&f.watch],
    };
    for p in progs {
        seccompiler::apply_filter(p).map_err(|e| SeccompError::Apply(thread, e.to_string()))?;
    }
    Ok(())
}

/// For the jail's test: a syscall no filter allows (a socket that is not
/// AF_UNIX). Returns only when seccomp is off.
pub fn forbidden_syscall() {
    // SAFETY: socket(2) with integer arguments; the fd, if any, is closed.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
    if fd >= 0 {
        // SAFETY: closing the fd just made.
        unsafe { libc::close(fd) };
    }
}
