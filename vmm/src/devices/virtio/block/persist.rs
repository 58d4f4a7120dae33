//! Snapshot state of virtio-blk. Restoring a block device is not implemented
//! yet (snapshots are a later issue); the state it will carry is fixed here.

use serde::{Deserialize, Serialize};

use super::Block;

/// What a snapshot records for a block device besides its queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    pub capacity: u64,
    pub read_only: bool,
}

impl Block {
    pub fn save_state(&self) -> BlockState {
        BlockState {
            capacity: self.capacity(),
            read_only: self.read_only(),
        }
    }
}
