//! virtio-net backed by a tap: one receive and one transmit queue,
//! checksum and TSO offloads both ways, mergeable receive buffers, the MAC
//! in config space. Each wake-up moves a bounded number of frames per
//! queue (see [`device`]'s `BUDGET`); the device re-arms itself when it
//! stops with work left. The tap is opened by name or inherited as a file
//! descriptor ([`tap`]); a snapshot records its name and MAC, and a restore
//! is handed a tap again.

mod device;
pub mod persist;
pub mod tap;
#[cfg(test)]
mod tests;

pub use device::{Net, NetError};
pub use tap::{Tap, TapError};
