//! Snapshot state of the serial port: the UART registers and its receive
//! FIFO (vm-superio's `SerialState`, mirrored here for serde). The console
//! output goes wherever the restoring VMM says.

use serde::{Deserialize, Serialize};
use vm_superio::serial::SerialState;

use super::{IrqEvt, Serial, SerialOut};
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialSnap {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    pub in_buffer: Vec<u8>,
}

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
        let s = self.uart.state();
        SerialSnap {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }

    fn restore(ctx: SerialContext, s: &SerialSnap) -> Result<Self, SerialPersistError> {
        let state = SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            // vm-superio refuses more than its FIFO holds.
            in_buffer: s.in_buffer.clone(),
        };
        let uart = vm_superio::Serial::from_state(&state, ctx.irq, vm_superio::serial::NoEvents, ctx.out)
            .map_err(|e| SerialPersistError(format!("{e:?}")))?;
        Ok(Serial { uart })
    }
}
