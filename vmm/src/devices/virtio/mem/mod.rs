//! virtio-mem (virtio 1.2 §5.15, device id 24): a region of guest
//! physical memory above all RAM that the guest plugs and unplugs in
//! 2 MiB blocks, up to the size the host requests (`resize_memory` on the
//! control API). The host side of the region is one anonymous mapping
//! (`MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE`, so it costs nothing
//! until plugged and touched), its own KVM memory slot and a region of
//! guest memory as the devices see it; unplugged blocks are `PROT_NONE`
//! (a guest touching one makes KVM_RUN fail with EFAULT) and their pages
//! are discarded (`MADV_DONTNEED`). Anything that walks all of guest
//! memory (snapshots) must skip unplugged blocks: see [`Mem::plugged_ranges`].
//! Device emulation reaching an unplugged block ends the VM: see [`guard`].

mod device;
pub mod guard;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::{
    hotplug_mapping, region_for, vm_region, Mem, MemError, BLOCK_SIZE, REGION_ALIGN,
};
