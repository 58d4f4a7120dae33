//! Snapshot state of virtio-vsock. Connections do not survive a snapshot
//! (their host ends belonged to the old VMM process): the state is the
//! guest CID, the host socket path and the queues. After restore the
//! device sends VIRTIO_VSOCK_EVENT_TRANSPORT_RESET on its event queue
//! ([`Vsock::send_transport_reset`]); the guest then drops its connections
//! and keeps its listeners, and the host side reconnects.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use vm_memory::Bytes;

use super::device::EVQ;
use super::Vsock;
use crate::devices::virtio::persist::{ActiveState, DeviceContext, DeviceState, VirtioPersistError};
use crate::devices::virtio::queue::{add_used, pop_chain};
use crate::devices::virtio::{DeviceError, VirtioDevice, VIRTIO_MMIO_INT_VRING};
use crate::snapshot::Persist;

/// `struct virtio_vsock_event`'s only event id.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub cid: u64,
    pub uds_path: PathBuf,
    pub errors: u64,
    pub active: Option<ActiveState>,
}

/// Rebuilding vsock: where the host side listens now (the recorded path
/// or an override) and the device context.
pub struct VsockContext {
    pub uds_path: PathBuf,
    pub device: DeviceContext,
}

impl Persist for Vsock {
    type State = VsockState;
    type Context = VsockContext;
    type Error = VirtioPersistError;

    fn save(&self) -> VsockState {
        VsockState {
            cid: self.cid,
            uds_path: self.uds_path().to_path_buf(),
            errors: self.errors,
            active: self.mem.is_some().then(|| ActiveState::of(&self.queues)),
        }
    }

    fn restore(ctx: VsockContext, state: &VsockState) -> Result<Self, VirtioPersistError> {
        let mut v = Vsock::new(state.cid, &ctx.uds_path)
            .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        v.errors = state.errors;
        if let Some(active) = &state.active {
            let queues = active.queues(v.queue_max_sizes(), &ctx.device.mem)?;
            v.activate(ctx.device.mem, queues, ctx.device.irq, ctx.device.acked_features)
                .map_err(|e| VirtioPersistError::Activate(e.to_string()))?;
        }
        Ok(v)
    }
}

impl Vsock {
    pub(crate) fn device_state(&self) -> DeviceState {
        DeviceState::Vsock(self.save())
    }

    /// After a restore: the transport reset, then whatever the guest had
    /// queued for transmission when the snapshot was taken (its notification
    /// went to the old VMM); packets for connections that no longer exist
    /// are answered with resets.
    pub(crate) fn after_restore(&mut self) -> Result<(), DeviceError> {
        self.send_transport_reset()?;
        if self.mem.is_some() && self.process_tx()? {
            if let Some(irq) = &self.irq {
                irq.trigger(VIRTIO_MMIO_INT_VRING)?;
            }
        }
        Ok(())
    }

    /// Tell the guest driver that every connection is gone. Returns whether
    /// an event buffer was available (a driver keeps one posted).
    pub fn send_transport_reset(&mut self) -> Result<bool, DeviceError> {
        let Some(mem) = self.mem.clone() else {
            return Ok(false);
        };
        let q = self.queues.get_mut(EVQ).ok_or(DeviceError::NoSuchQueue(EVQ))?;
        let Some(mut chain) = pop_chain(q, &mem)? else {
            tracing::warn!("vsock: no event buffer for the transport reset");
            return Ok(false);
        };
        let head = chain.head_index();
        let written = match chain.next() {
            Some(d) if d.is_write_only() && d.len() >= 4 => mem
                .write_obj(VIRTIO_VSOCK_EVENT_TRANSPORT_RESET.to_le(), d.addr())
                .is_ok(),
            _ => false,
        };
        if !written {
            self.errors += 1;
        }
        add_used(q, &mem, head, if written { 4 } else { 0 })?;
        if let Some(irq) = &self.irq {
            irq.trigger(VIRTIO_MMIO_INT_VRING)?;
        }
        Ok(written)
    }
}
