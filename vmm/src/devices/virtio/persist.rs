//! Snapshot state shared by every virtio device: the virtqueues and the
//! MMIO transport's registers (the device base's own part is
//! [`BaseState`](super::base::BaseState)). Each device's own state is in
//! its folder's `persist.rs`; [`DeviceState`] names which one a transport
//! carries.

use std::sync::atomic::Ordering;

use crate::GuestMemoryMmap;
use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};

use super::block::persist::BlockState;
use super::mem::persist::MemState;
use super::mmio::{MmioTransport, Registers};
use super::net::persist::NetState;
use super::vsock::persist::VsockState;
use super::{IrqTrigger, VirtioDevice};
use crate::snapshot::Persist;

#[derive(Debug, thiserror::Error)]
pub enum VirtioPersistError {
    #[error("queue {index}: {what}")]
    Queue { index: usize, what: String },
    #[error("device has {expected} queues, state has {found}")]
    QueueCount { expected: usize, found: usize },
    #[error("state is for device type {found}, device is type {expected}")]
    DeviceType { expected: u32, found: u32 },
    #[error("device cannot be activated from its state: {0}")]
    Activate(String),
    #[error("{0}")]
    Backend(String),
}

/// virtio-queue's `QueueState` (which has no serde of its own), field
/// for field.
#[derive(Serialize, Deserialize)]
#[serde(remote = "QueueState")]
struct QueueStateDef {
    max_size: u16,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
}

/// A virtqueue in the state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct QueueSnap(#[serde(with = "QueueStateDef")] pub QueueState);

impl QueueSnap {
    pub fn of(q: &Queue) -> Self {
        Self(q.state())
    }

    /// Rebuild the queue for a device whose queue `index` has `max_size`
    /// entries at most. A ready queue must lie inside `mem` (the driver
    /// could only have made it ready that way).
    pub fn to_queue(
        &self,
        index: usize,
        max_size: u16,
        mem: &GuestMemoryMmap,
    ) -> Result<Queue, VirtioPersistError> {
        let err = |what: String| VirtioPersistError::Queue { index, what };
        if self.0.max_size != max_size {
            return Err(err(format!(
                "max size {} but the device offers {max_size}",
                self.0.max_size
            )));
        }
        let q = Queue::try_from(self.0).map_err(|e| err(e.to_string()))?;
        if q.ready() && !q.is_valid(mem) {
            return Err(err("rings outside guest memory or misaligned".into()));
        }
        Ok(q)
    }
}

/// Queues from a state, checked against the device's (one per entry of
/// `max_sizes`) and guest memory.
pub fn restore_queues(
    snaps: &[QueueSnap],
    max_sizes: &[u16],
    mem: &GuestMemoryMmap,
) -> Result<Vec<Queue>, VirtioPersistError> {
    if snaps.len() != max_sizes.len() {
        return Err(VirtioPersistError::QueueCount {
            expected: max_sizes.len(),
            found: snaps.len(),
        });
    }
    snaps
        .iter()
        .zip(max_sizes)
        .enumerate()
        .map(|(i, (q, &max))| q.to_queue(i, max, mem))
        .collect()
}

/// What a device adds to its transport's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceState {
    Block(BlockState),
    Vsock(VsockState),
    Net(NetState),
    Mem(MemState),
    /// A device without snapshot support (test devices): a VM with one
    /// refuses to snapshot.
    Unsupported(u32),
}

/// The MMIO transport's registers and queue configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioState {
    pub device_type: u32,
    #[serde(flatten)]
    pub registers: Registers,
    pub interrupt_status: u32,
    pub queues: Vec<QueueSnap>,
    pub device: DeviceState,
}

/// What rebuilding a virtio device needs besides its state.
pub struct DeviceContext {
    pub mem: GuestMemoryMmap,
    pub irq: IrqTrigger,
    /// The features the driver acknowledged (from the transport's state).
    pub acked_features: u64,
}

/// What rebuilding a transport needs: its device (already rebuilt from
/// [`MmioState::device`]), guest memory and its interrupt.
pub struct MmioContext {
    pub device: Box<dyn VirtioDevice>,
    pub mem: GuestMemoryMmap,
    pub irq: IrqTrigger,
}

impl Persist for MmioTransport {
    type State = MmioState;
    type Context = MmioContext;
    type Error = VirtioPersistError;

    fn save(&self) -> MmioState {
        MmioState {
            device_type: self.device().device_type(),
            registers: self.registers(),
            interrupt_status: self.irq().status.load(Ordering::SeqCst),
            queues: self.queues().iter().map(QueueSnap::of).collect(),
            device: self.device().save_device_state(),
        }
    }

    fn restore(ctx: MmioContext, state: &MmioState) -> Result<Self, VirtioPersistError> {
        let expected = ctx.device.device_type();
        if state.device_type != expected {
            return Err(VirtioPersistError::DeviceType {
                expected,
                found: state.device_type,
            });
        }
        let queues = restore_queues(&state.queues, ctx.device.queue_max_sizes(), &ctx.mem)?;
        ctx.irq
            .status
            .store(state.interrupt_status, Ordering::SeqCst);
        let mut t = MmioTransport::new(ctx.device, ctx.mem, ctx.irq)
            .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        t.set_registers(state.registers, queues);
        Ok(t)
    }
}
