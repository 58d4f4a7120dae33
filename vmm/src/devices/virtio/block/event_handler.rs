//! Events for virtio-blk: the request queue's notification (an ioeventfd
//! the VMM's event loop watches, or a direct MMIO write) is the only one;
//! I/O is synchronous on the file.

use super::Block;
use crate::devices::virtio::DeviceError;

impl Block {
    /// The request queue was notified.
    pub fn handle_queue_event(&mut self) -> Result<(), DeviceError> {
        self.process_requests()
    }
}
