//! Devices: legacy (serial, i8042) and virtio.

pub mod virtio;
