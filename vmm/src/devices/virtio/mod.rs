//! virtio: the device trait and the base every device shares
//! (`base.rs`), the MMIO transport, safe queue access and the shared
//! snapshot state. Each device has its own folder with the same files
//! (device, snapshot state, tests), as Firecracker lays out
//! `devices/virtio/<dev>/`.

pub mod base;
pub mod block;
pub mod fault_log;
pub mod fuzz;
pub mod mem;
pub mod mmio;
pub mod net;
pub mod persist;
pub mod queue;
pub mod vsock;

use std::os::fd::RawFd;

pub use base::{read_config_bytes, Active, IrqTrigger, VirtioBase};

/// VIRTIO_F_VERSION_1: the only (modern) interface we offer.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Interrupt status bits.
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

pub const TYPE_NET: u32 = 1;
pub const TYPE_BLOCK: u32 = 2;
pub const TYPE_MEM: u32 = 24;
pub const TYPE_VSOCK: u32 = 19;

/// A device-level error. Malformed requests from the guest are counted and
/// logged; the VMM never panics on them.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("queue {0} does not exist")]
    NoSuchQueue(usize),
    #[error("device is not activated")]
    NotActivated,
    #[error("virtqueue error: {0}")]
    Queue(#[from] queue::QueueError),
    #[error("cannot signal the guest: {0}")]
    Irq(#[source] std::io::Error),
    #[error("{0}")]
    Other(String),
}

#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    #[error("wrong number of queues: expected {expected}, got {got}")]
    QueueCount { expected: usize, got: usize },
    #[error("queue {0} is not valid (size/addresses outside guest memory)")]
    InvalidQueue(usize),
    #[error("cannot activate device: {0}")]
    Backend(String),
}

/// [`VirtioDevice::base`] and [`VirtioDevice::base_mut`] for a device that
/// keeps its [`VirtioBase`] in field `$field` (`delegate_base!(base);`
/// inside its `impl VirtioDevice`).
macro_rules! delegate_base {
    ($field:ident) => {
        fn base(&self) -> &$crate::devices::virtio::VirtioBase {
            &self.$field
        }

        fn base_mut(&mut self) -> &mut $crate::devices::virtio::VirtioBase {
            &mut self.$field
        }
    };
}
pub(crate) use delegate_base;

/// What a virtio device must provide to the MMIO transport. A device
/// holds a [`VirtioBase`] and returns it from [`Self::base`] and
/// [`Self::base_mut`]; identity, config space, activation, reset and error
/// counting come from it through the default methods, so a device writes
/// only how it processes its queues (and its backend, if it has one).
pub trait VirtioDevice: Send {
    fn base(&self) -> &VirtioBase;
    fn base_mut(&mut self) -> &mut VirtioBase;
    /// The driver notified queue `index`.
    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError>;

    fn device_type(&self) -> u32 {
        self.base().device_type()
    }
    /// Feature bits offered (must include [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64 {
        self.base().avail_features()
    }
    /// Maximum size of each queue; the count is the number of queues.
    fn queue_max_sizes(&self) -> &[u16] {
        self.base().queue_max_sizes()
    }
    /// Read device config space at `offset`; bytes past the end read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.base().read_config(offset, data)
    }
    /// Write device config space (most devices ignore it).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK: start using the queues.
    fn activate(&mut self, active: Active) -> Result<(), ActivateError> {
        self.base_mut().activate(active)
    }
    fn is_activated(&self) -> bool {
        self.base().is_activated()
    }
    /// The driver reset the device: drop the queues and backend state.
    fn reset(&mut self) {
        self.base_mut().reset()
    }
    /// A file descriptor whose readability means [`Self::process_backend`]
    /// has work (vsock's host sockets); `None` for purely guest-driven devices.
    fn backend_fd(&self) -> Option<RawFd> {
        None
    }
    /// Handle backend events (called when [`Self::backend_fd`] is readable).
    fn process_backend(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// How many malformed requests the guest has sent so far.
    fn error_count(&self) -> u64 {
        self.base().errors
    }
    /// The device's snapshot state (see each device's `persist.rs`).
    fn save_device_state(&self) -> persist::DeviceState {
        persist::DeviceState::Unsupported(self.device_type())
    }
    /// Called once the whole VM is restored, before it runs.
    fn on_restored(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Changes of the config space so far (the transport's
    /// ConfigGeneration register).
    fn config_generation(&self) -> u32 {
        self.base().config_generation()
    }
    /// The device as a block device (block slots are filled through it).
    fn as_block_mut(&mut self) -> Option<&mut block::Block> {
        None
    }
    /// The device as virtio-mem (memory is resized through it).
    fn as_mem(&self) -> Option<&mem::Mem> {
        None
    }
    fn as_mem_mut(&mut self) -> Option<&mut mem::Mem> {
        None
    }
}
