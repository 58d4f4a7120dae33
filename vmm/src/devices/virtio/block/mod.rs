//! virtio-blk backed by a raw image file or a block device, read-only or
//! read-write, with flush.

mod device;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::{disk_bytes, Block, BlockError, SECTOR_SIZE};
