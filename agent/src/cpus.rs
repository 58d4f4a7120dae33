//! The guest's CPUs: a pod's VM boots with some of its vCPUs offline
//! (`maxcpus=`) and the shim asks for more as containers arrive; the VMM
//! lets them run first, then [`online`] brings them up through sysfs. As
//! containers leave, [`online`] takes the extra ones offline again before
//! the VMM holds them.

use std::path::Path;

use crate::error::{AgentError, Result};

const CPU_DIR: &str = "/sys/devices/system/cpu";

/// Have exactly CPUs `0..count` online (CPU 0 always is): those past
/// them are taken offline, highest first, then the rest brought up;
/// answers how many are online afterwards.
pub fn online(count: u32) -> Result<u32> {
    online_in(Path::new(CPU_DIR), count)
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| AgentError::Internal(format!("reading {}: {e}", path.display())))
}

fn online_in(dir: &Path, count: u32) -> Result<u32> {
    let present = count_list(&read(&dir.join("present"))?)
        .ok_or_else(|| AgentError::Internal("unreadable list of present CPUs".into()))?;
    if count == 0 || count > present {
        return Err(AgentError::InvalidArgument(format!(
            "cannot have {count} CPUs online: the guest has {present}"
        )));
    }
    for cpu in (count..present).rev() {
        set_online(dir, cpu, false)?;
    }
    for cpu in 1..count {
        set_online(dir, cpu, true)?;
    }
    count_list(&read(&dir.join("online"))?)
        .ok_or_else(|| AgentError::Internal("unreadable list of online CPUs".into()))
}

/// Bring CPU `cpu` online (`on`) or take it offline, unless it already is.
fn set_online(dir: &Path, cpu: u32, on: bool) -> Result<()> {
    let file = dir.join(format!("cpu{cpu}/online"));
    let want = if on { "1" } else { "0" };
    if read(&file)? == want {
        return Ok(());
    }
    std::fs::write(&file, want).map_err(|e| {
        let what = if on { "online" } else { "offline" };
        AgentError::FailedPrecondition(format!("taking CPU {cpu} {what}: {e}"))
    })
}

/// How many CPUs a sysfs CPU list (`0-2,4`) names; none if it is not one.
fn count_list(list: &str) -> Option<u32> {
    let mut n = 0u32;
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<u32>().ok()?, b.parse::<u32>().ok()?),
            None => {
                let a = part.parse::<u32>().ok()?;
                (a, a)
            }
        };
        n = n.checked_add(b.checked_sub(a)?.checked_add(1)?)?;
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cpu_lists() {
        assert_eq!(count_list("0"), Some(1));
        assert_eq!(count_list("0-3"), Some(4));
        assert_eq!(count_list("0-1,4,6-7"), Some(5));
        assert_eq!(count_list(""), Some(0));
        assert_eq!(count_list("3-1"), None);
        assert_eq!(count_list("x"), None);
    }

    fn fake(dir: &Path, present: &str, online: &[bool]) {
        std::fs::write(dir.join("present"), present).unwrap();
        let list: Vec<String> = online
            .iter()
            .enumerate()
            .filter(|(_, on)| **on)
            .map(|(i, _)| i.to_string())
            .collect();
        std::fs::write(dir.join("online"), list.join(",")).unwrap();
        for (i, on) in online.iter().enumerate().skip(1) {
            std::fs::create_dir_all(dir.join(format!("cpu{i}"))).unwrap();
            std::fs::write(dir.join(format!("cpu{i}/online")), if *on { "1\n" } else { "0\n" })
                .unwrap();
        }
    }

    #[test]
    fn onlines_the_first_cpus_and_refuses_absent_ones() {
        let dir = tempfile::tempdir().unwrap();
        fake(dir.path(), "0-3\n", &[true, false, false, false]);
        // sysfs would update `online` itself; the fake's stays, so only
        // the writes are checked here.
        online_in(dir.path(), 3).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu1/online")).unwrap(), "1");
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu2/online")).unwrap(), "1");
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu3/online")).unwrap(), "0\n");
        // Fewer: the ones past them go offline, the first stay.
        online_in(dir.path(), 2).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu1/online")).unwrap(), "1");
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu2/online")).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(dir.path().join("cpu3/online")).unwrap(), "0\n");
        let e = online_in(dir.path(), 5).unwrap_err();
        assert!(matches!(e, AgentError::InvalidArgument(_)), "{e}");
        assert!(matches!(online_in(dir.path(), 0), Err(AgentError::InvalidArgument(_))));
    }
}
