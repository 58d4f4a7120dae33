//! virtio-blk backed by a raw image file or a block device, read-only or
//! read-write, with flush; or a slot whose backing file comes and goes
//! while the VM runs (`slot.rs`).

mod device;
pub mod persist;
mod slot;
#[cfg(test)]
mod tests;

pub use device::{disk_bytes, Block, BlockError, SECTOR_SIZE};
pub use slot::SlotError;
