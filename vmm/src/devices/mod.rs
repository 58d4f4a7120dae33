//! Devices: legacy (serial, i8042) and virtio. Each device has its own
//! folder with the same files: `device.rs` (the device and its reactions
//! to guest accesses and host events), `persist.rs` (snapshot state),
//! `tests.rs`. Events reach devices from the VMM's epoll loop (`vmm.rs`);
//! there is no per-device event-handler layer.

pub mod fuzz;
pub mod i8042;
pub mod serial;
pub mod virtio;
#[cfg(test)]
mod fuzz_tests;
