//! Root filesystems on block slots (a pod's containers after the first):
//! the shim names the disk by its serial, `serial:burrow-slot-<n>`,
//! because the guest's `vd*` names follow probe order, not slot numbers.
//! The host attaches the file just before it asks for the container, and
//! the new capacity reaches the guest with a config-change interrupt a
//! moment later: wait (bounded) until the disk has sectors.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::{invalid, AgentError, Result};

/// Prefix of a rootfs source that names a disk by its serial.
pub const SERIAL_PREFIX: &str = "serial:";
/// How long a slot's capacity may take to arrive.
const WAIT: Duration = Duration::from_secs(10);
/// Longest serial virtio-blk reports.
const MAX_SERIAL: usize = 20;

/// The device node for `source`: itself, or the `vd*` disk whose serial
/// it names, once that disk has a capacity.
pub fn resolve(source: &str) -> Result<String> {
    let dev = resolve_in(Path::new("/sys/block"), Path::new("/dev"), source, WAIT)?;
    if source.starts_with(SERIAL_PREFIX) {
        drop_cached_blocks(&dev)?;
    }
    Ok(dev)
}

/// A slot may have held another container's disk before: drop whatever
/// of it the guest's block cache still holds (BLKFLSBUF), so that nothing
/// of the old file is read as the new one's.
fn drop_cached_blocks(dev: &str) -> Result<()> {
    use std::os::fd::AsRawFd;
    nix::ioctl_none!(blkflsbuf, 0x12, 97);
    let f = std::fs::File::open(dev).map_err(|e| AgentError::io(format!("open {dev}"), e))?;
    // SAFETY: BLKFLSBUF takes no argument; f is an open block device.
    unsafe { blkflsbuf(f.as_raw_fd()) }
        .map_err(|e| AgentError::os(format!("flushing {dev}'s cached blocks"), e))?;
    Ok(())
}

pub(crate) fn resolve_in(
    sys_block: &Path,
    dev: &Path,
    source: &str,
    wait: Duration,
) -> Result<String> {
    let Some(serial) = source.strip_prefix(SERIAL_PREFIX) else {
        return Ok(source.to_string());
    };
    if serial.is_empty()
        || serial.len() > MAX_SERIAL
        || !serial
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(invalid(format!("rootfs source {source:?}: bad serial")));
    }
    let start = Instant::now();
    let mut seen = false;
    // The guest learns a new capacity from a config-change interrupt a
    // moment after the host's attach: look again soon, then every 20 ms.
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some((name, sectors)) = find(sys_block, serial) {
            seen = true;
            if sectors > 0 {
                return Ok(dev.join(name).display().to_string());
            }
        }
        if start.elapsed() >= wait {
            let why = if seen {
                "still has no capacity"
            } else {
                "is not there"
            };
            return Err(AgentError::DeadlineExceeded(format!(
                "the disk with serial {serial} {why} after {}s",
                wait.as_secs()
            )));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// The `vd*` disk with `serial` and its size in sectors.
fn find(sys_block: &Path, serial: &str) -> Option<(String, u64)> {
    let entries = std::fs::read_dir(sys_block).ok()?;
    for entry in entries.flatten().take(256) {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("vd") {
            continue;
        }
        let dir: PathBuf = entry.path();
        let Some(found) = read_small(&dir.join("serial")) else {
            continue;
        };
        if found.trim_end_matches(['\0', '\n', ' ']) != serial {
            continue;
        }
        let sectors = read_small(&dir.join("size"))
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(0);
        return Some((name, sectors));
    }
    None
}

/// A sysfs attribute (at most 64 bytes of it).
fn read_small(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut buf = Vec::with_capacity(64);
    std::fs::File::open(path)
        .ok()?
        .take(64)
        .read_to_end(&mut buf)
        .ok()?;
    Some(String::from_utf8_lossy(&buf).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(sys: &Path, name: &str, serial: &str, size: u64) {
        let d = sys.join(name);
        std::fs::create_dir_all(&d).expect("mkdir");
        std::fs::write(d.join("serial"), serial).expect("serial");
        std::fs::write(d.join("size"), format!("{size}\n")).expect("size");
    }

    #[test]
    fn a_slot_resolves_to_its_disk_once_it_has_a_capacity() {
        let t = tempfile::tempdir().expect("tempdir");
        let sys = t.path().join("block");
        disk(&sys, "vda", "burrow-blk", 1000);
        disk(&sys, "vdb", "burrow-slot-0", 0);
        disk(&sys, "vdc", "burrow-slot-1", 2048);
        let dev = Path::new("/dev");
        let got = resolve_in(&sys, dev, "serial:burrow-slot-1", Duration::ZERO);
        assert_eq!(got.expect("resolved"), "/dev/vdc");
        // Slot 0 is empty: it fails after the wait, saying why.
        let e = resolve_in(&sys, dev, "serial:burrow-slot-0", Duration::from_millis(50))
            .expect_err("empty");
        assert!(e.to_string().contains("no capacity"), "{e}");
        // The capacity arrives while it waits.
        let sys2 = sys.clone();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            disk(&sys2, "vdb", "burrow-slot-0", 64);
        });
        let got = resolve_in(&sys, dev, "serial:burrow-slot-0", Duration::from_secs(5));
        late.join().expect("join");
        assert_eq!(got.expect("resolved"), "/dev/vdb");
        let e = resolve_in(&sys, dev, "serial:burrow-slot-7", Duration::ZERO).expect_err("none");
        assert!(e.to_string().contains("is not there"), "{e}");
        // Plain device paths pass through; bad serials are refused.
        assert_eq!(
            resolve_in(&sys, dev, "/dev/vda", Duration::ZERO).expect("plain"),
            "/dev/vda"
        );
        assert!(resolve_in(&sys, dev, "serial:../x", Duration::ZERO).is_err());
        assert!(resolve_in(&sys, dev, "serial:", Duration::ZERO).is_err());
    }
}
