//! 8250/16550 UART on COM1 (vm-superio), output to a log file or stdout.

mod device;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::{IrqEvt, Serial, SerialOut};
