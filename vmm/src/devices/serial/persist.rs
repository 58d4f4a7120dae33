//! Snapshot state of the serial port: the UART registers and its receive
//! FIFO (vm-superio's `SerialState`, given serde through `serde(remote)`). The console
//! output goes wherever the restoring VMM says.

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use super::{IrqEvt, Serial, SerialOut};
use crate::snapshot::Persist;

/// vm-superio's `SerialState` (which has no serde of its own), field for
/// field.
#[derive(Serialize, Deserialize)]
#[serde(remote = "SerialState")]
struct SerialStateDef {
    baud_divisor_low: u8,
    baud_divisor_high: u8,
    interrupt_enable: u8,
    interrupt_identification: u8,
    line_control: u8,
    line_status: u8,
    modem_control: u8,
    modem_status: u8,
    scratch: u8,
    in_buffer: Vec<u8>,
}

/// The UART's state in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SerialSnap(#[serde(with = "SerialStateDef")] pub SerialState);

#[derive(Debug, thiserror::Error)]
#[error("serial state: {0}")]
pub struct SerialPersistError(String);

pub struct SerialContext {
    pub irq: IrqEvt,
    pub out: SerialOut,
}

impl Persist for Serial {
    type State = SerialSnap;
    type Context = SerialContext;
    type Error = SerialPersistError;

    fn save(&self) -> SerialSnap {
        SerialSnap(self.uart.state())
    }

    fn restore(ctx: SerialContext, s: &SerialSnap) -> Result<Self, SerialPersistError> {
        // vm-superio refuses more input than its FIFO holds.
        let uart =
            vm_superio::Serial::from_state(&s.0, ctx.irq, vm_superio::serial::NoEvents, ctx.out)
                .map_err(|e| SerialPersistError(format!("{e:?}")))?;
        Ok(Serial { uart })
    }
}
