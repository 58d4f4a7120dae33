//! virtio-blk backed by a raw image file, read-only or read-write, with flush.

mod device;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::{Block, BlockError, SECTOR_SIZE};
