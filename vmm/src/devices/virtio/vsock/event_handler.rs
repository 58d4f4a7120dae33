//! Events for virtio-vsock: queue notifications (RX buffers added, TX
//! packets queued) and the host side's epoll fd (new connections, readable
//! or writable unix sockets), which the VMM's event loop watches.

use super::Vsock;
use crate::devices::virtio::{DeviceError, VirtioDevice};

impl Vsock {
    /// The backend epoll fd is readable.
    pub fn handle_backend_event(&mut self) -> Result<(), DeviceError> {
        self.process_backend()
    }
}
