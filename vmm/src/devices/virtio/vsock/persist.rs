//! Snapshot state of virtio-vsock. Connections do not survive a snapshot:
//! after restore the device sends a transport reset on the event queue and
//! the host reconnects (DESIGN.md). Restore itself is a later issue.

use serde::{Deserialize, Serialize};

use super::Vsock;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub cid: u64,
    pub uds_path: String,
}

impl Vsock {
    pub fn save_state(&self) -> VsockState {
        VsockState {
            cid: self.cid(),
            uds_path: self.uds_path().display().to_string(),
        }
    }
}
