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
use crate::devices::virtio::base::BaseState;
use crate::devices::virtio::persist::{DeviceContext, DeviceState, VirtioPersistError};
use crate::devices::virtio::queue::{add_used, pop_chain};
use crate::devices::virtio::DeviceError;
use crate::snapshot::Persist;

/// `struct virtio_vsock_event`'s only event id.
pub const VIRTIO_VSOCK_EVENT_TRANSPORT_RESET: u32 = 0;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VsockState {
    pub cid: u64,
    pub uds_path: PathBuf,
    #[serde(flatten)]
    pub base: BaseState,
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
            base: self.base.save(),
        }
    }

    fn restore(ctx: VsockContext, state: &VsockState) -> Result<Self, VirtioPersistError> {
        let mut v = Vsock::new(state.cid, &ctx.uds_path)
            .map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        v.base.restore(&state.base, ctx.device)?;
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
        if self.base.is_activated() && self.process_tx()? {
            self.base.signal_used()?;
        }
        Ok(())
    }

    /// Tell the guest driver that every connection is gone. Returns whether
    /// an event buffer was available (a driver keeps one posted).
    pub fn send_transport_reset(&mut self) -> Result<bool, DeviceError> {
        let Ok(mem) = self.base.mem() else {
            return Ok(false);
        };
        let q = self.base.queue_mut(EVQ)?;
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
        add_used(q, &mem, head, if written { 4 } else { 0 })?;
        if !written {
            self.base.errors += 1;
        }
        self.base.signal_used()?;
        Ok(written)
    }
}
