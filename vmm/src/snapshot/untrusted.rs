//! What a restore of a snapshot the caller does not trust may ask for
//! (issue 15): `--self-contained`, `--expect-vcpus`, `--expect-mem`.
//!
//! A checkpoint from containerd is a tar anyone with access to the content
//! store may have written. Its state file is checked here before anything
//! it names is opened: it must not name a base snapshot (an incremental
//! chain could point at another sandbox's memory), a slot with an attached
//! file (any host path, a block device) unless the caller gives the paths
//! of all disks and filled slots (a template-born VM's rootfs is in a
//! slot; the given paths replace the recorded ones, which are never
//! opened), or a tap to open by name (unless
//! the caller hands the VM its own); and its size must be the one the
//! caller checked against its limits.

use super::microvm::{MemoryKind, MicrovmState};
use crate::devices::virtio::persist::DeviceState;

/// What the caller allows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expect {
    /// No base snapshot, no attached slot file, no tap by name.
    pub self_contained: bool,
    /// The caller passes the NIC's tap (so a recorded name is not opened).
    pub net_given: bool,
    /// How many disk paths the caller gives (`--disk`): they replace the
    /// state's disks', then its filled slots', in order.
    pub disks_given: usize,
    pub vcpus: Option<u8>,
    pub mem_mib: Option<u64>,
    /// With `mem_mib`: the `--mem-max` the state must have (`None`: no
    /// hotplug memory at all).
    pub mem_max_mib: Option<u64>,
}

/// Check `state` against `expect`; the error says what the snapshot asked
/// for that it may not.
pub fn check(state: &MicrovmState, expect: &Expect) -> Result<(), String> {
    if let Some(v) = expect.vcpus {
        if state.vcpu_count != v {
            return Err(format!(
                "the state has {} vCPUs, the checkpoint says {v}",
                state.vcpu_count
            ));
        }
    }
    if let Some(m) = expect.mem_mib {
        if state.mem_mib != m {
            return Err(format!(
                "the state has {} MiB of memory, the checkpoint says {m} MiB",
                state.mem_mib
            ));
        }
        if state.mem_max_mib != expect.mem_max_mib {
            return Err(format!(
                "the state may grow to {:?} MiB of memory (--mem-max), the checkpoint says {:?}",
                state.mem_max_mib, expect.mem_max_mib
            ));
        }
    }
    if !expect.self_contained {
        return Ok(());
    }
    if let MemoryKind::Incremental { base_dir, .. } = &state.memory.kind {
        return Err(format!(
            "the state names a base snapshot ({}); a self-contained snapshot may not",
            base_dir.display()
        ));
    }
    let (disks, filled) = state.disks_and_filled_slots();
    let all_replaced = expect.disks_given >= disks.len().saturating_add(filled.len());
    for d in &state.devices {
        match &d.device {
            DeviceState::Block(b)
                if b.slot.is_some() && !b.path.as_os_str().is_empty() && !all_replaced =>
            {
                return Err(format!(
                    "the state attaches {} to a disk slot; a self-contained snapshot may not",
                    b.path.display()
                ));
            }
            DeviceState::Net(n) if !expect.net_given => {
                return Err(format!(
                    "the state names tap {:?} and no tap was given; a self-contained snapshot may not",
                    n.tap_name
                ));
            }
            _ => {}
        }
    }
    Ok(())
}
