//! Snapshot state of virtio-net: the MAC, the tap's name (for the record
//! and for a restore that is given no tap) and the queues. The tap itself
//! is not in the snapshot: a restore is handed one again (the shim passes
//! the same tap, still open in the container's network namespace, so the
//! guest keeps its address and its TCP connections). A frame half-way
//! between tap and guest at snapshot time is lost; TCP resends it.

use serde::{Deserialize, Serialize};

use super::{Net, Tap};
use crate::devices::virtio::base::BaseState;
use crate::devices::virtio::persist::{DeviceContext, DeviceState, VirtioPersistError};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    pub tap_name: String,
    pub mac: [u8; 6],
    #[serde(flatten)]
    pub base: BaseState,
}

/// Rebuilding the NIC: its tap and the device context.
pub struct NetContext {
    pub tap: Tap,
    pub device: DeviceContext,
}

impl Persist for Net {
    type State = NetState;
    type Context = NetContext;
    type Error = VirtioPersistError;

    fn save(&self) -> NetState {
        NetState {
            tap_name: self.tap_name().to_string(),
            mac: self.mac,
            base: self.base.save(),
        }
    }

    fn restore(ctx: NetContext, state: &NetState) -> Result<Self, VirtioPersistError> {
        let mut n =
            Net::new(ctx.tap, state.mac).map_err(|e| VirtioPersistError::Backend(e.to_string()))?;
        n.base.restore(&state.base, ctx.device)?;
        Ok(n)
    }
}

impl Net {
    pub(crate) fn device_state(&self) -> DeviceState {
        DeviceState::Net(self.save())
    }
}
