//! A pod member's root filesystem as a shared read-only image layer under
//! a small writable disk of its own, overlaid in the guest.
//!
//! A whole copy of the image per container ([`super::rootfs::prepare`])
//! costs a copy of every byte where the file system has no reflinks
//! (ext4), and the disk space each time. Instead, for a container on a
//! fresh overlayfs snapshot (the cacheable case of
//! [`super::layer_cache`]):
//!
//! - its image's layer cache image (built now if there is none) is linked
//!   into the sandbox's image directory (a hard link: no data copied, and
//!   the file outlives the cache's trim for as long as the pod has it; a
//!   copy where the cache is on another file system) and attached
//!   **read-only** to a block slot of its own. Every container of the pod
//!   with the same layers shares that slot; the last one to go empties it
//!   and removes the link. These slots are `pod_layer_slots` more than the
//!   containers' own (`pod_disk_slots`), so sharing never takes a
//!   container's slot. burrow-vmm refuses the guest's writes to it and
//!   holds it open read-only, so the cache's image never changes.
//! - the container gets a new sparse ext4 disk, as large as the image (it
//!   may rewrite every file), formatted without writing its size, in its
//!   own slot; the agent mounts the shared image read-only and overlays
//!   the container's disk on it (upper and work directories on that disk).
//!
//! Both are slot disks like a whole copy, so hibernation, a pod's named
//! checkpoint (both disks, the shared one once) and its restore keep what
//! the container wrote. When the VM has no slot left for a new shared
//! image, or `pod_layer_slots` is 0, the container gets a whole copy.

use std::path::PathBuf;

use super::checkpoint::Contents;
use super::layer_cache::LayerCache;
use super::rootfs::{self, GuestRootfs, Lower};
use super::{disk_budget, VmSandbox};
use crate::config::Config;
use crate::sandbox::{ContainerConfig, Result, SandboxError};

/// The name of the shared image of layer chain `key` in a sandbox's image
/// directory (`+` is in no container id, so no container's image is it).
pub fn layer_name(key: &str) -> String {
    format!("+layer-{key}{}", disk_budget::IMAGE_SUFFIX)
}

impl VmSandbox {
    /// The layered root filesystem of pod member `c` (see the module doc),
    /// registered and its shared image attached, or none when `c` gets a
    /// whole copy instead. `c`'s slot for its own disk is taken already.
    pub(super) async fn layered_rootfs(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        guest_spec: &serde_json::Value,
    ) -> Result<Option<GuestRootfs>> {
        if cfg.pod_layer_slots == 0 {
            return Ok(None);
        }
        let cache = LayerCache::new(&cfg.layer_cache_dir, cfg.layer_cache_images);
        let Some(key) = cache.key(&c.rootfs, cfg.rootfs_slack_mib) else {
            return Ok(None);
        };
        // One at a time: the second container of an image waits for the
        // first one's shared image to be in its slot.
        let _one = self.layering.lock().await;
        let (slot, disk) = match self.slots.join_shared(&key, &c.id) {
            Some(shared) => shared,
            None => {
                if !self.slots.room_for_layer() {
                    tracing::info!(
                        "{}: no block slot left for another shared image layer (pod_layer_slots): a whole copy",
                        c.id
                    );
                    return Ok(None);
                }
                self.share_layers(cfg, c, (&cache, &key)).await?
            }
        };
        // From here on a failure is cleaned up by the caller's
        // `release_slot`, which takes `c` off the shared slot.
        let upper = self.image_path(&c.id);
        let size = std::fs::metadata(&disk)
            .map_err(|e| SandboxError::io(format_args!("reading {}", disk.display()), &e))?
            .len();
        self.check_disk(&format!("the writable layer of container {}", c.id), size)?;
        let started = std::time::Instant::now();
        rootfs::make_upper(&upper, size).await?;
        tracing::info!(
            "{}: shared image layer in slot {slot}, a writable layer of {} MiB made in {} ms",
            c.id,
            size >> 20,
            started.elapsed().as_millis()
        );
        let made = GuestRootfs {
            disk: upper.clone(),
            read_only: false,
            fstype: "ext4".into(),
            image: Some(upper),
            lower: Some(Lower { disk, slot }),
        };
        self.registry().insert(
            c.id.clone(),
            Contents {
                rootfs: made.clone(),
                guest_id: c.id.clone(),
                spec: guest_spec.clone(),
            },
        );
        Ok(Some(made))
    }

    /// Link layer chain `key`'s cached image into the image directory and
    /// attach it read-only to a free slot, shared, `c` its first user.
    async fn share_layers(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        (cache, key): (&LayerCache, &str),
    ) -> Result<(u32, PathBuf)> {
        disk_budget::make_private_dir(&self.images)?;
        let disk = self.images.join(layer_name(key));
        let what = format!("the shared image layer of container {}", c.id);
        let budget = |size| self.check_disk(&what, size);
        rootfs::cached_layers(c, (cache, key), cfg.rootfs_slack_mib, &disk, budget).await?;
        let slot = match self.slots.take_shared(key, &disk, vec![c.id.clone()]) {
            Ok(slot) => slot,
            Err(e) => {
                let _ = std::fs::remove_file(&disk);
                return Err(e);
            }
        };
        // On failure the caller's `release_slot` empties it and removes
        // the link.
        self.attach_disk(slot, &disk, true).await?;
        Ok((slot, disk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shared_layers_name_is_no_containers_image() {
        let key = "ab".repeat(32);
        let name = layer_name(&key);
        // containerd's ids are letters, digits and `._-`: never a `+`.
        assert!(name.starts_with('+') && name.ends_with(disk_budget::IMAGE_SUFFIX));
        assert!(name.len() < 255);
    }
}
