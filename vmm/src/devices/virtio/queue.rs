//! Safe access to a split virtqueue: popping chains with the avail index
//! validated, and collecting a chain's descriptors with loops and
//! over-long chains detected.

use std::num::Wrapping;
use std::sync::atomic::Ordering;

use virtio_queue::desc::split::Descriptor;
use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use crate::GuestMemoryMmap;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
    #[error("avail index {avail} is {ahead} entries ahead of the device, queue size is {size}")]
    AvailIdxOutOfRange { avail: u16, ahead: u16, size: u16 },
    #[error("cannot read the avail ring")]
    AvailRing,
    #[error("cannot write the used ring")]
    UsedRing,
    #[error("descriptor chain is empty or its head is out of range")]
    EmptyChain,
    #[error("descriptor chain loops or is longer than the queue")]
    ChainTooLong,
}

/// Pop the next available chain, checking the driver's avail index first
/// (virtio-queue alone would only log a bad index).
pub fn pop_chain<'a>(
    queue: &mut Queue,
    mem: &'a GuestMemoryMmap,
) -> Result<Option<DescriptorChain<&'a GuestMemoryMmap>>, QueueError> {
    if !queue.ready() {
        return Ok(None);
    }
    let avail = queue
        .avail_idx(mem, Ordering::Acquire)
        .map_err(|_| QueueError::AvailRing)?;
    let ahead = (avail - Wrapping(queue.next_avail())).0;
    if ahead > queue.size() {
        return Err(QueueError::AvailIdxOutOfRange {
            avail: avail.0,
            ahead,
            size: queue.size(),
        });
    }
    if ahead == 0 {
        return Ok(None);
    }
    let mut iter = queue.iter(mem).map_err(|_| QueueError::AvailRing)?;
    Ok(iter.next())
}

/// All descriptors of a chain. Fails if the chain is empty (head index out
/// of range, unreadable descriptor) or was cut short because it loops or is
/// longer than the queue.
pub fn collect_chain(
    chain: &mut DescriptorChain<&GuestMemoryMmap>,
) -> Result<Vec<Descriptor>, QueueError> {
    let descs: Vec<Descriptor> = chain.by_ref().collect();
    match descs.last() {
        None => Err(QueueError::EmptyChain),
        Some(d) if d.has_next() => Err(QueueError::ChainTooLong),
        Some(_) => Ok(descs),
    }
}

/// Return a chain to the driver.
pub fn add_used(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    head: u16,
    len: u32,
) -> Result<(), QueueError> {
    queue
        .add_used(mem, head, len)
        .map_err(|_| QueueError::UsedRing)
}

/// Test helpers: a driver-side view of a split queue in guest memory.
#[cfg(test)]
pub mod testing {
    use virtio_queue::{Queue, QueueT};
    use crate::GuestMemoryMmap;
    use vm_memory::{Bytes, GuestAddress};

    pub const VIRTQ_DESC_F_NEXT: u16 = 1;
    pub const VIRTQ_DESC_F_WRITE: u16 = 2;

    /// A queue of `size` entries at `base` (descriptors, then avail, then used).
    pub struct DriverQueue {
        pub size: u16,
        pub desc: u64,
        pub avail: u64,
        pub used: u64,
        avail_idx: u16,
    }

    impl DriverQueue {
        pub fn new(base: u64, size: u16) -> Self {
            let desc = base;
            let avail = desc + 16 * u64::from(size);
            let used = (avail + 6 + 2 * u64::from(size) + 3) & !3;
            Self { size, desc, avail, used, avail_idx: 0 }
        }

        pub fn queue(&self, mem: &GuestMemoryMmap) -> Queue {
            let mut q = Queue::new(self.size).unwrap();
            q.set_size(self.size);
            q.try_set_desc_table_address(GuestAddress(self.desc)).unwrap();
            q.try_set_avail_ring_address(GuestAddress(self.avail)).unwrap();
            q.try_set_used_ring_address(GuestAddress(self.used)).unwrap();
            q.set_ready(true);
            assert!(q.is_valid(mem));
            q
        }

        pub fn set_desc(&self, mem: &GuestMemoryMmap, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
            let a = GuestAddress(self.desc + 16 * u64::from(i));
            mem.write_obj(addr, a).unwrap();
            mem.write_obj(len, GuestAddress(a.0 + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(a.0 + 12)).unwrap();
            mem.write_obj(next, GuestAddress(a.0 + 14)).unwrap();
        }

        /// Publish a chain head in the avail ring.
        pub fn push_avail(&mut self, mem: &GuestMemoryMmap, head: u16) {
            let slot = u64::from(self.avail_idx % self.size);
            mem.write_obj(head, GuestAddress(self.avail + 4 + 2 * slot)).unwrap();
            self.avail_idx = self.avail_idx.wrapping_add(1);
            mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2)).unwrap();
        }

        /// Overwrite the avail index (to test bogus values).
        pub fn set_avail_idx(&mut self, mem: &GuestMemoryMmap, idx: u16) {
            self.avail_idx = idx;
            mem.write_obj(idx, GuestAddress(self.avail + 2)).unwrap();
        }

        pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
            mem.read_obj(GuestAddress(self.used + 2)).unwrap()
        }

        /// (id, len) of used entry `n`.
        pub fn used_elem(&self, mem: &GuestMemoryMmap, n: u16) -> (u32, u32) {
            let a = self.used + 4 + 8 * u64::from(n % self.size);
            (mem.read_obj(GuestAddress(a)).unwrap(), mem.read_obj(GuestAddress(a + 4)).unwrap())
        }
    }

    pub fn memory(size: usize) -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), size)]).unwrap()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn bogus_avail_index_is_an_error() {
        let mem = memory(1 << 20);
        let mut dq = DriverQueue::new(0x1000, 16);
        let mut q = dq.queue(&mem);
        dq.set_avail_idx(&mem, 100);
        assert!(matches!(pop_chain(&mut q, &mem), Err(QueueError::AvailIdxOutOfRange { .. })));
    }

    #[test]
    fn looping_chain_is_an_error() {
        let mem = memory(1 << 20);
        let mut dq = DriverQueue::new(0x1000, 8);
        let mut q = dq.queue(&mem);
        dq.set_desc(&mem, 0, 0x8000, 16, VIRTQ_DESC_F_NEXT, 1);
        dq.set_desc(&mem, 1, 0x8000, 16, VIRTQ_DESC_F_NEXT, 0);
        dq.push_avail(&mem, 0);
        let mut chain = pop_chain(&mut q, &mem).unwrap().unwrap();
        assert_eq!(collect_chain(&mut chain).err(), Some(QueueError::ChainTooLong));
    }

    #[test]
    fn head_out_of_range_is_an_error() {
        let mem = memory(1 << 20);
        let mut dq = DriverQueue::new(0x1000, 8);
        let mut q = dq.queue(&mem);
        dq.push_avail(&mem, 200);
        let mut chain = pop_chain(&mut q, &mem).unwrap().unwrap();
        assert_eq!(collect_chain(&mut chain).err(), Some(QueueError::EmptyChain));
    }

    #[test]
    fn next_index_out_of_range_is_cut_short() {
        let mem = memory(1 << 20);
        let mut dq = DriverQueue::new(0x1000, 8);
        let mut q = dq.queue(&mem);
        dq.set_desc(&mem, 0, 0x8000, 16, VIRTQ_DESC_F_NEXT, 9);
        dq.push_avail(&mem, 0);
        let mut chain = pop_chain(&mut q, &mem).unwrap().unwrap();
        assert_eq!(collect_chain(&mut chain).err(), Some(QueueError::ChainTooLong));
    }

    #[test]
    fn empty_queue_pops_nothing() {
        let mem = memory(1 << 20);
        let dq = DriverQueue::new(0x1000, 8);
        let mut q = dq.queue(&mem);
        assert!(pop_chain(&mut q, &mem).unwrap().is_none());
    }
}
