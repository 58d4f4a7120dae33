//! Snapshot state of virtio-blk. The VMM does not copy disks: the state
//! records the image's path, read-only flag and size, and restore opens the
//! image given (the recorded path or an override: the shim restores into a
//! copy/reflink of the disk) and refuses one whose size differs.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Block, SECTOR_SIZE};
use crate::devices::virtio::persist::{ActiveState, DeviceContext, DeviceState, VirtioPersistError};
use crate::devices::virtio::VirtioDevice;
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub path: PathBuf,
    pub read_only: bool,
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    pub errors: u64,
    /// The live queues, if the driver had activated the device.
    pub active: Option<ActiveState>,
}

/// Rebuilding a block device: the image to open and the device context
/// (only used if the state says the device was active).
pub struct BlockContext {
    pub path: PathBuf,
    pub device: DeviceContext,
}

impl Persist for Block {
    type State = BlockState;
    type Context = BlockContext;
    type Error = VirtioPersistError;

    fn save(&self) -> BlockState {
        BlockState {
            path: self.path.clone(),
            read_only: self.read_only,
            capacity: self.capacity,
            errors: self.errors,
            active: self.mem.is_some().then(|| ActiveState::of(&self.queues)),
        }
    }

    fn restore(ctx: BlockContext, state: &BlockState) -> Result<Self, VirtioPersistError> {
        let mut b = Block::open(&ctx.path, state.read_only)
            .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        if b.capacity != state.capacity {
            return Err(VirtioPersistError::Backend(format!(
                "disk {} is {} bytes, the snapshot's disk was {} bytes",
                ctx.path.display(),
                b.capacity.saturating_mul(SECTOR_SIZE),
                state.capacity.saturating_mul(SECTOR_SIZE)
            )));
        }
        b.errors = state.errors;
        if let Some(active) = &state.active {
            let queues = active.queues(b.queue_max_sizes(), &ctx.device.mem)?;
            b.activate(ctx.device.mem, queues, ctx.device.irq, ctx.device.acked_features)
                .map_err(|e| VirtioPersistError::Activate(e.to_string()))?;
        }
        Ok(b)
    }
}

impl Block {
    pub(crate) fn device_state(&self) -> DeviceState {
        DeviceState::Block(self.save())
    }
}
