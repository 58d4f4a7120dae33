//! Snapshot state of the serial port: vm-superio's `SerialState` covers the
//! registers; saving and restoring it is part of the snapshot issue.

pub use vm_superio::serial::SerialState;
