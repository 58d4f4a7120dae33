//! virtio: the device trait, the MMIO transport and shared queue helpers.
//! Each device has its own folder (device, event handling, snapshot state,
//! tests), as Firecracker lays out `devices/virtio/<dev>/`.

pub mod block;
pub mod fuzz;
pub mod mmio;
pub mod persist;
pub mod queue;
pub mod vsock;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use virtio_queue::Queue;
use crate::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

/// VIRTIO_F_VERSION_1: the only (modern) interface we offer.
pub const VIRTIO_F_VERSION_1: u64 = 1 << 32;
/// Interrupt status bits.
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

pub const TYPE_BLOCK: u32 = 2;
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

/// Raises the device's interrupt line: sets a bit in the transport's
/// interrupt status and signals the irqfd (or, in tests, a plain eventfd).
#[derive(Clone, Debug)]
pub struct IrqTrigger {
    pub status: Arc<AtomicU32>,
    pub evt: Arc<EventFd>,
}

impl IrqTrigger {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            status: Arc::new(AtomicU32::new(0)),
            evt: Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
        })
    }

    pub fn trigger(&self, bit: u32) -> Result<(), DeviceError> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.evt.write(1).map_err(DeviceError::Irq)
    }
}

/// What a virtio device must provide to the MMIO transport.
pub trait VirtioDevice: Send {
    fn device_type(&self) -> u32;
    /// Feature bits offered (must include [`VIRTIO_F_VERSION_1`]).
    fn avail_features(&self) -> u64;
    /// Maximum size of each queue; the count is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Read device config space at `offset`; bytes past the end read as 0.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Write device config space (most devices ignore it).
    fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
    /// The driver set DRIVER_OK: start using the queues.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        irq: IrqTrigger,
        acked_features: u64,
    ) -> Result<(), ActivateError>;
    fn is_activated(&self) -> bool;
    /// The driver notified queue `index`.
    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError>;
    /// The driver reset the device: drop the queues and backend state.
    fn reset(&mut self);
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
    fn error_count(&self) -> u64;
    /// The device's snapshot state (see each device's `persist.rs`).
    fn save_device_state(&self) -> persist::DeviceState {
        persist::DeviceState::Unsupported(self.device_type())
    }
    /// Called once the whole VM is restored, before it runs.
    fn on_restored(&mut self) -> Result<(), DeviceError> {
        Ok(())
    }
}

/// Copy `config[offset..]` into `data`, zero-filling past the end.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}
