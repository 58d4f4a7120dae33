//! File names and limits of the directories snapshots live in, for every
//! program that writes or reads them (VMM, shim, CLI).
//!
//! ```text
//! <vmm snapshot dir>/state          VMM: vCPUs, devices (vmm/README.md)
//! <vmm snapshot dir>/memory         VMM: guest RAM (sparse)
//!
//! <checkpoint>/burrow.json          shim: manifest
//! <checkpoint>/vm/                  a VMM snapshot dir
//! <checkpoint>/rootfs.img           copy of the writable disk
//! <checkpoint>/*.packed             packed form of memory and rootfs.img
//!
//! <snapshot_dir>/<namespace>/<id>/  hibernation: burrow.json + vm-<n>/ chain
//! <snapshot_dir>/.checkpoints/NAME/ named checkpoints (`burrow sandbox checkpoint`)
//! ```

/// The VMM's state file in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The VMM's memory file in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// Beside it in a restore's directory: where the memory's data lies in
/// the packed file passed with `--packed-memory-fd` ([`crate::memory_map`]).
pub const MEMORY_MAP_FILE: &str = "memory.map";
/// Most snapshots (a full one and incremental ones on it) the VMM follows
/// to restore one.
pub const MAX_VMM_CHAIN: usize = 64;

/// A checkpoint's manifest.
pub const MANIFEST: &str = "burrow.json";
/// The VMM snapshot directory inside a checkpoint.
pub const VM_DIR: &str = "vm";
/// The copied writable disk inside a checkpoint.
pub const ROOTFS: &str = "rootfs.img";
/// Suffix of a packed file.
pub const PACKED: &str = ".packed";

/// Start of a hibernation chain link's directory name (`vm-<n>`).
pub const LINK_PREFIX: &str = "vm-";
/// Incremental hibernation snapshots on one full one before the next full
/// one.
pub const MAX_HIBERNATION_CHAIN: u32 = 16;
const _: () = assert!((MAX_HIBERNATION_CHAIN as usize) < MAX_VMM_CHAIN);

/// The named checkpoints' directory inside `snapshot_dir` (a dot, which no
/// containerd namespace starts with).
pub const NAMED_DIR: &str = ".checkpoints";
/// Longest checkpoint name (and hibernation link name).
pub const MAX_NAME: usize = 64;

/// The directory name of hibernation link `n`.
pub fn link_name(n: u64) -> String {
    format!("{LINK_PREFIX}{n}")
}

/// Whether `name` is a hibernation link's directory name.
pub fn is_link_name(name: &str) -> bool {
    name.strip_prefix(LINK_PREFIX)
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_names() {
        assert_eq!(link_name(3), "vm-3");
        assert!(is_link_name(&link_name(u64::MAX)));
        assert!(link_name(u64::MAX).len() <= MAX_NAME);
        assert!(!is_link_name("vm-"));
        assert!(!is_link_name("vm-x"));
        assert!(!is_link_name(VM_DIR));
    }
}
