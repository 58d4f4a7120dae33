//! A container's resource use as the guest sees it, for containerd's Stats.
//!
//! A VM holds one container, so the guest's CPU time (`/proc/stat`) and
//! memory in use (`/proc/meminfo`) are the container's; its processes are
//! those in its PID namespace.

use std::path::Path;

use crate::error::{AgentError, Result};

/// Most `/proc` entries looked at when counting a namespace's processes.
const MAX_PROC_ENTRIES: usize = 1 << 16;

/// CPU time outside idle, iowait and steal, in microseconds, from the
/// first line of `/proc/stat` (in ticks of `clk_tck` per second).
pub fn parse_cpu_usec(stat: &str, clk_tck: u64) -> Option<u64> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let busy = [0, 1, 2, 5, 6]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .fold(0u64, |a, &t| a.saturating_add(t));
    Some(busy.saturating_mul(1_000_000) / clk_tck.max(1))
}

/// `(MemTotal - MemAvailable, MemTotal)` in bytes from `/proc/meminfo`.
pub fn parse_memory(meminfo: &str) -> Option<(u64, u64)> {
    let kib = |key: &str| {
        meminfo.lines().find_map(|l| {
            let rest = l.strip_prefix(key)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    let total = kib("MemTotal")?.saturating_mul(1024);
    let available = kib("MemAvailable")?.saturating_mul(1024);
    Some((total.saturating_sub(available), total))
}

pub fn cpu_usec() -> Result<u64> {
    let stat =
        std::fs::read_to_string("/proc/stat").map_err(|e| AgentError::io("read /proc/stat", e))?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let clk_tck = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    parse_cpu_usec(&stat, clk_tck)
        .ok_or_else(|| AgentError::Internal("/proc/stat has no cpu line".into()))
}

pub fn memory() -> Result<(u64, u64)> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .map_err(|e| AgentError::io("read /proc/meminfo", e))?;
    parse_memory(&meminfo)
        .ok_or_else(|| AgentError::Internal("/proc/meminfo lacks MemTotal or MemAvailable".into()))
}

/// Processes in the PID namespace of process `pid` (0 if it is gone).
pub fn processes_in_pid_namespace_of(pid: i32) -> u64 {
    let ns = |p: &Path| std::fs::read_link(p.join("ns/pid")).ok();
    let Some(target) = ns(&Path::new("/proc").join(pid.to_string())) else {
        return 0;
    };
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    entries
        .flatten()
        .take(MAX_PROC_ENTRIES)
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| ns(&e.path()).as_ref() == Some(&target))
        .count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_counts_user_nice_system_irq_softirq() {
        let stat = "cpu  100 20 30 5000 7 1 2 9 0 0\ncpu0 100 20 30 5000 7 1 2 9 0 0\nintr 1\n";
        assert_eq!(parse_cpu_usec(stat, 100), Some(1_530_000));
        assert_eq!(parse_cpu_usec("intr 1\n", 100), None);
        assert_eq!(parse_cpu_usec("cpu  x 1\n", 100), None);
    }

    #[test]
    fn memory_in_use_is_total_minus_available() {
        let meminfo = "MemTotal:         246000 kB\nMemFree:          100000 kB\nMemAvailable:     200000 kB\n";
        assert_eq!(parse_memory(meminfo), Some((46_000 * 1024, 246_000 * 1024)));
        assert_eq!(parse_memory("MemTotal: 1 kB\n"), None);
    }
}
