//! Block slots: virtio-blk devices that exist from boot with no backing
//! file (capacity 0) and get one attached, swapped or detached while the
//! VM runs, as firecracker-containerd's stub drives do. Each change
//! rewrites the capacity in config space and raises the config-change
//! interrupt, on which Linux's virtio_blk re-reads the capacity.

use std::path::{Path, PathBuf};

use super::device::{open_disk, sized_disk, Block, BlockError};
use crate::devices::virtio::DeviceError;

#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("this disk is not a slot")]
    NotASlot,
    #[error(transparent)]
    Open(#[from] BlockError),
    #[error("telling the guest: {0}")]
    Notify(#[from] DeviceError),
}

impl Block {
    /// The slot number, if this device is a slot.
    pub fn slot_index(&self) -> Option<u32> {
        self.slot
    }

    /// The attached file (None: empty or not a slot).
    pub fn attached(&self) -> Option<&Path> {
        (self.slot.is_some() && self.disk.is_some()).then_some(self.path.as_path())
    }

    /// Back this slot with `path` (replacing what it had); the guest sees
    /// the new capacity after the config-change interrupt. On error the
    /// slot keeps what it had.
    pub fn attach(&mut self, path: &Path, read_only: bool) -> Result<(), SlotError> {
        self.attach_file(None, path, read_only)
    }

    /// [`Self::attach`] with the file already open (`file`: a jailed VMM
    /// cannot open host paths; `path` is then only its name).
    pub fn attach_file(&mut self, file: Option<std::fs::File>, path: &Path, read_only: bool) -> Result<(), SlotError> {
        if self.slot.is_none() {
            return Err(SlotError::NotASlot);
        }
        let (disk, capacity) = match file {
            Some(f) => sized_disk(f, path)?,
            None => open_disk(path, read_only)?,
        };
        self.disk = Some(disk);
        self.path = path.to_path_buf();
        self.read_only = read_only;
        self.set_capacity(capacity)
    }

    /// Empty this slot (capacity 0); requests to it fail from now on.
    pub fn detach(&mut self) -> Result<(), SlotError> {
        if self.slot.is_none() {
            return Err(SlotError::NotASlot);
        }
        self.disk = None;
        self.path = PathBuf::new();
        self.read_only = false;
        self.set_capacity(0)
    }

    fn set_capacity(&mut self, capacity: u64) -> Result<(), SlotError> {
        self.capacity = capacity;
        self.base.set_config(capacity.to_le_bytes().to_vec())?;
        Ok(())
    }
}
