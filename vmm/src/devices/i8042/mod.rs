//! A minimal i8042 keyboard controller: enough for Linux's i8042/atkbd
//! probe to finish quickly, and for `reboot=k` (command 0xFE, CPU reset)
//! to end the VM, as Firecracker does. It has no host-side events: it
//! only reacts to guest port I/O, and its one outgoing event, CPU reset,
//! is an eventfd the VMM loop watches.

mod device;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::I8042;
