//! Snapshot state of virtio-blk. The VMM does not copy disks: the state
//! records the image's path, read-only flag and size, and restore opens the
//! image given (the recorded path or an override: the shim restores into a
//! copy/reflink of the disk) and refuses one whose size differs. A slot
//! records its number and what is attached to it (an empty path: nothing);
//! restore attaches the same file again, which must have the same size.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{Block, SECTOR_SIZE};
use crate::devices::virtio::base::BaseState;
use crate::devices::virtio::persist::{DeviceContext, DeviceState, VirtioPersistError};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub path: PathBuf,
    pub read_only: bool,
    /// Capacity in 512-byte sectors.
    pub capacity: u64,
    /// `Some(n)`: slot `n` (older snapshots have no slots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u32>,
    #[serde(flatten)]
    pub base: BaseState,
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
            slot: self.slot,
            base: self.base.save(),
        }
    }

    fn restore(ctx: BlockContext, state: &BlockState) -> Result<Self, VirtioPersistError> {
        let backend = |e: &dyn std::fmt::Display| VirtioPersistError::Backend(e.to_string());
        let mut b = match state.slot {
            None => Block::open(&ctx.path, state.read_only).map_err(|e| backend(&e))?,
            Some(n) => {
                let mut b = Block::slot(n);
                if !ctx.path.as_os_str().is_empty() {
                    // Not active yet: no interrupt; the guest knows the size.
                    b.attach(&ctx.path, state.read_only)
                        .map_err(|e| backend(&e))?;
                }
                b
            }
        };
        if b.capacity != state.capacity {
            return Err(VirtioPersistError::Backend(format!(
                "disk {} is {} bytes, the snapshot's disk was {} bytes",
                ctx.path.display(),
                b.capacity.saturating_mul(SECTOR_SIZE),
                state.capacity.saturating_mul(SECTOR_SIZE)
            )));
        }
        b.base.restore(&state.base, ctx.device)?;
        Ok(b)
    }
}

impl Block {
    pub(crate) fn device_state(&self) -> DeviceState {
        DeviceState::Block(self.save())
    }
}
