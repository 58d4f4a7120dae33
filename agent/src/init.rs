//! PID 1 duties: early mounts, console, hostname, clock, entropy, power off.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::mount::{mount, MsFlags};
use nix::sys::stat::Mode;

use crate::container::cgroup;
use crate::error::{invalid, AgentError, Result};

fn mount_fs(
    source: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(target)?;
    match mount(Some(source), target, Some(fstype), flags, data) {
        Ok(()) | Err(Errno::EBUSY) => Ok(()),
        Err(e) => Err(anyhow::anyhow!("mount {fstype} on {target}: {}", e.desc())),
    }
}

/// Bring the loopback interface up: containers share the guest's network
/// namespace, and programs expect 127.0.0.1 to work.
pub fn loopback_up() -> std::io::Result<()> {
    // SAFETY: socket(2) and two ioctls on a zeroed ifreq naming "lo", with
    // pointers to this stack frame; the fd is owned right away.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let fd = <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *d = *s as libc::c_char;
        }
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(fd.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// How many processes the kernel's OOM killer has killed since boot.
pub fn oom_kills() -> Result<u64> {
    let vmstat = std::fs::read_to_string("/proc/vmstat")
        .map_err(|e| AgentError::io("read /proc/vmstat", e))?;
    Ok(vmstat
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

/// Set up the guest as PID 1: the kernel file systems, a console on
/// stdio, and a root that `pivot_root` accepts.
pub fn setup_pid1() -> anyhow::Result<()> {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    // The initramfs root ("rootfs") has no parent mount, so pivot_root(2)
    // refuses to leave it. Move a bind mount of it over / and chroot into
    // that: from then on the root is an ordinary mount.
    if !Path::new("/.burrow-rebound").exists() {
        std::fs::create_dir_all("/.burrow-root")?;
        mount(
            Some("/"),
            "/.burrow-root",
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(|e| anyhow::anyhow!("bind / for a pivotable root: {}", e.desc()))?;
        nix::unistd::chdir("/.burrow-root")?;
        mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
            .map_err(|e| anyhow::anyhow!("move the new root over /: {}", e.desc()))?;
        nix::unistd::chroot(".")?;
        nix::unistd::chdir("/")?;
        std::fs::create_dir_all("/.burrow-rebound")?;
    }
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    console_on_stdio();
    mount_fs("proc", "/proc", "proc", nosuid, None)?;
    // The OOM killer must take a container's process, never the agent:
    // without PID 1 the VM is gone. Children set their own value (spawn).
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
        tracing::warn!("cannot protect the agent from the OOM killer: {e}");
    }
    if let Err(e) = loopback_up() {
        tracing::warn!("cannot bring the loopback interface up: {e}");
    }
    mount_fs("sysfs", "/sys", "sysfs", nosuid, None)?;
    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=0620,ptmxmode=0666"),
    )?;
    mount_fs("tmpfs", "/dev/shm", "tmpfs", nosuid, Some("mode=1777"))?;
    mount_fs(
        "tmpfs",
        "/run",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    mount_fs(
        "tmpfs",
        "/tmp",
        "tmpfs",
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    // favordynmods: moving a process into a cgroup (every container's
    // init and exec) and enabling controllers no longer wait for an RCU
    // grace period each; fork and exit take a slower path in exchange.
    // Linux 6.0 has it; an older guest kernel mounts without.
    let cgroup2 = mount_fs("cgroup2", cgroup::MOUNT, "cgroup2", nosuid, Some("favordynmods"))
        .or_else(|e| {
            tracing::info!("cgroup2 without favordynmods: {e}");
            mount_fs("cgroup2", cgroup::MOUNT, "cgroup2", nosuid, None)
        });
    match cgroup2 {
        Ok(()) => {
            if let Err(e) = cgroup::prepare(Path::new(cgroup::MOUNT)) {
                tracing::warn!("containers' cgroup: {e}");
            }
        }
        Err(e) => tracing::warn!("no cgroup2: {e}"),
    }
    let hostname = kernel_cmdline_value("burrow.hostname").unwrap_or_else(|| "burrow".into());
    if let Err(e) = nix::unistd::sethostname(&hostname) {
        tracing::warn!("sethostname {hostname}: {e}");
    }
    Ok(())
}

/// Point stdin/stdout/stderr at /dev/console (the serial console).
fn console_on_stdio() {
    if let Ok(fd) = nix::fcntl::open(
        "/dev/console",
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        Mode::empty(),
    ) {
        for target in 0..3 {
            // SAFETY: dup2 onto the standard fds.
            unsafe { libc::dup2(fd.as_raw_fd(), target) };
        }
    }
}

pub fn kernel_cmdline_value(key: &str) -> Option<String> {
    let cmdline = std::fs::read_to_string("/proc/cmdline").ok()?;
    cmdline
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('=').map(str::to_string))
}

/// Step the realtime clock.
pub fn set_time(secs: i64, nanos: u32) -> Result<()> {
    if nanos >= 1_000_000_000 {
        return Err(invalid("nanos must be below 1e9"));
    }
    let ts = nix::sys::time::TimeSpec::new(secs, i64::from(nanos));
    nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, ts)
        .map_err(|e| AgentError::os("set the clock", e))
}

/// Mix `data` into the kernel's entropy pool and credit it.
pub fn add_entropy(data: &[u8]) -> Result<()> {
    if data.is_empty() || data.len() > burrow_protocol::MAX_ENTROPY_BYTES {
        return Err(invalid(format!(
            "entropy must be 1 to {} bytes",
            burrow_protocol::MAX_ENTROPY_BYTES
        )));
    }
    let fd: OwnedFd = nix::fcntl::open(
        "/dev/random",
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| AgentError::os("open /dev/random", e))?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let len = i32::try_from(data.len()).map_err(|_| invalid("entropy too large"))?;
    let mut info = Vec::with_capacity(8 + data.len());
    info.extend_from_slice(&len.saturating_mul(8).to_ne_bytes());
    info.extend_from_slice(&len.to_ne_bytes());
    info.extend_from_slice(data);
    // Keep the buffer 4-byte aligned in length as the kernel reads u32s.
    while info.len() % 4 != 0 {
        info.push(0);
    }
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
    // SAFETY: the ioctl reads `info`, laid out as rand_pool_info.
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), RNDADDENTROPY, info.as_ptr()) };
    if rc < 0 {
        return Err(AgentError::os("RNDADDENTROPY", Errno::last()));
    }
    // Crediting entropy does not make an initialised CRNG reseed at once:
    // copies of one snapshot would go on producing the same bytes until
    // the next scheduled reseed. Force it (Linux 4.17+).
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
    // SAFETY: an ioctl without argument.
    if unsafe { libc::ioctl(fd.as_raw_fd(), RNDRESEEDCRNG) } < 0 {
        return Err(AgentError::os("RNDRESEEDCRNG", Errno::last()));
    }
    Ok(())
}

/// Write `/etc/machine-id` (32 lowercase hex digits, as systemd's).
pub fn set_machine_id(id: &str) -> Result<()> {
    if id.len() != 32
        || !id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(invalid("a machine id is 32 lowercase hex digits"));
    }
    std::fs::create_dir_all("/etc").map_err(|e| AgentError::io("creating /etc", e))?;
    std::fs::write("/etc/machine-id", format!("{id}\n"))
        .map_err(|e| AgentError::io("writing /etc/machine-id", e))
}

/// Sync and end the VM. Only returns on failure.
///
/// Both ways reset the guest (`reboot(RB_AUTOBOOT)`, the i8042 reset with
/// `reboot=k`), which burrow-vmm takes as the VM's end: without ACPI a
/// `RB_POWER_OFF` only halts the CPUs, and the VMM does not poll for that.
/// `reboot` says which the caller meant, for the log.
pub fn power_off(reboot: bool) -> Result<()> {
    nix::unistd::sync();
    tracing::debug!(reboot, "resetting the guest to end the VM");
    match nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT) {
        Err(e) => Err(AgentError::os("reboot(2)", e)),
        Ok(never) => match never {},
    }
}
