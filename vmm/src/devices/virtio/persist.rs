//! Snapshot state shared by every virtio device: the virtqueues and the
//! MMIO transport's registers. Each device's own state is in its folder's
//! `persist.rs`; [`DeviceState`] names which one a transport carries.

use std::sync::atomic::Ordering;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use crate::GuestMemoryMmap;

use super::block::persist::BlockState;
use super::mmio::MmioTransport;
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

/// A virtqueue (mirror of virtio-queue's `QueueState`, which has no serde).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueSnap {
    pub max_size: u16,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl QueueSnap {
    pub fn of(q: &Queue) -> Self {
        let s = q.state();
        Self {
            max_size: s.max_size,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
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
        if self.max_size != max_size {
            return Err(err(format!("max size {} but the device offers {max_size}", self.max_size)));
        }
        let q = Queue::try_from(QueueState {
            max_size: self.max_size,
            next_avail: self.next_avail,
            next_used: self.next_used,
            event_idx_enabled: self.event_idx_enabled,
            size: self.size,
            ready: self.ready,
            desc_table: self.desc_table,
            avail_ring: self.avail_ring,
            used_ring: self.used_ring,
        })
        .map_err(|e| err(e.to_string()))?;
        if q.ready() && !q.is_valid(mem) {
            return Err(err("rings outside guest memory or misaligned".into()));
        }
        Ok(q)
    }
}

/// The queues a device was activated with, as it has advanced them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveState {
    pub queues: Vec<QueueSnap>,
}

impl ActiveState {
    pub fn of(queues: &[Queue]) -> Self {
        Self { queues: queues.iter().map(QueueSnap::of).collect() }
    }

    /// The queues, checked against the device's and guest memory.
    pub fn queues(
        &self,
        max_sizes: &[u16],
        mem: &GuestMemoryMmap,
    ) -> Result<Vec<Queue>, VirtioPersistError> {
        if self.queues.len() != max_sizes.len() {
            return Err(VirtioPersistError::QueueCount {
                expected: max_sizes.len(),
                found: self.queues.len(),
            });
        }
        self.queues
            .iter()
            .zip(max_sizes)
            .enumerate()
            .map(|(i, (q, &max))| q.to_queue(i, max, mem))
            .collect()
    }
}

/// What a device adds to its transport's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceState {
    Block(BlockState),
    Vsock(VsockState),
    /// A device without snapshot support (test devices): a VM with one
    /// refuses to snapshot.
    Unsupported(u32),
}

/// The MMIO transport's registers and queue configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioState {
    pub device_type: u32,
    pub features_sel: u32,
    pub acked_features_sel: u32,
    pub acked_features: u64,
    pub queue_sel: u32,
    pub status: u32,
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
        let r = self.registers();
        MmioState {
            device_type: self.device().device_type(),
            features_sel: r.features_sel,
            acked_features_sel: r.acked_features_sel,
            acked_features: r.acked_features,
            queue_sel: r.queue_sel,
            status: r.status,
            interrupt_status: self.irq().status.load(Ordering::SeqCst),
            queues: self.queues().iter().map(QueueSnap::of).collect(),
            device: self.device().save_device_state(),
        }
    }

    fn restore(ctx: MmioContext, state: &MmioState) -> Result<Self, VirtioPersistError> {
        let expected = ctx.device.device_type();
        if state.device_type != expected {
            return Err(VirtioPersistError::DeviceType { expected, found: state.device_type });
        }
        let max_sizes = ctx.device.queue_max_sizes().to_vec();
        if state.queues.len() != max_sizes.len() {
            return Err(VirtioPersistError::QueueCount {
                expected: max_sizes.len(),
                found: state.queues.len(),
            });
        }
        let queues = state
            .queues
            .iter()
            .zip(&max_sizes)
            .enumerate()
            .map(|(i, (q, &max))| q.to_queue(i, max, &ctx.mem))
            .collect::<Result<Vec<_>, _>>()?;
        ctx.irq.status.store(state.interrupt_status, Ordering::SeqCst);
        let mut t = MmioTransport::new(ctx.device, ctx.mem, ctx.irq)
            .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        t.set_registers(
            super::mmio::Registers {
                features_sel: state.features_sel,
                acked_features_sel: state.acked_features_sel,
                acked_features: state.acked_features,
                queue_sel: state.queue_sel,
                status: state.status,
            },
            queues,
        );
        Ok(t)
    }
}
