//! A minimal i8042 keyboard controller: enough for Linux's i8042/atkbd
//! probe to finish quickly, and for `reboot=k` (command 0xFE, CPU reset)
//! to end the VM, as Firecracker does.

mod device;
mod event_handler;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::I8042;
