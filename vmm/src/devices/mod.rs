//! Devices: legacy (serial, i8042) and virtio. Each device has its own
//! folder with the same files: device, event handler, snapshot state, tests.

pub mod i8042;
pub mod serial;
pub mod virtio;
