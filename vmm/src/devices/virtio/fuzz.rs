//! Fuzzing harness for virtqueue processing and vsock packet parsing: the
//! input bytes become guest memory holding a split queue (descriptors,
//! avail ring, buffers) that a block, vsock or virtio-mem device then
//! processes. Any
//! panic is a bug; errors are expected. Used by `vmm/fuzz` (cargo-fuzz)
//! and by a randomized unit test that runs in the normal test suite.

use std::path::PathBuf;
use std::sync::OnceLock;

use virtio_queue::{Queue, QueueT};
use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::block::Block;
use super::mem::{Mem, BLOCK_SIZE};
use super::vsock::Vsock;
use super::{Active, IrqTrigger, VirtioDevice};

/// Guest memory size the harness uses.
pub const MEM_SIZE: usize = 64 * 1024;
const QUEUE_SIZE: u16 = 16;
const DESC: u64 = 0x0;
const AVAIL: u64 = 0x1000;
const USED: u64 = 0x2000;

pub(crate) fn scratch() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("burrow-fuzz-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&d);
        let _ = std::fs::write(d.join("disk.img"), vec![0u8; 64 * 1024]);
        d
    })
}

fn queue(mem: &GuestMemoryMmap) -> Option<Queue> {
    let mut q = Queue::new(QUEUE_SIZE).ok()?;
    q.set_size(QUEUE_SIZE);
    q.try_set_desc_table_address(GuestAddress(DESC)).ok()?;
    q.try_set_avail_ring_address(GuestAddress(AVAIL)).ok()?;
    q.try_set_used_ring_address(GuestAddress(USED)).ok()?;
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

/// Run one input. The first byte picks the device and queue; the rest is
/// copied into guest memory from address 0.
pub fn run(data: &[u8]) {
    let Some((&sel, image)) = data.split_first() else {
        return;
    };
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]) else {
        return;
    };
    let n = image.len().min(MEM_SIZE);
    if mem.write_slice(image.get(..n).unwrap_or_default(), GuestAddress(0)).is_err() {
        return;
    }
    let Ok(irq) = IrqTrigger::new() else {
        return;
    };
    match sel % 4 {
        3 => {
            // virtio-mem's requests over a region above this memory (no
            // host mapping: only the request logic runs).
            let Ok(mut m) = Mem::new(4 << 30, 128 << 20, None) else {
                return;
            };
            let _ = m.set_requested_size(u64::from(sel >> 2) * BLOCK_SIZE);
            let Some(q) = queue(&mem) else { return };
            let active = Active { mem: mem.clone(), queues: vec![q], irq, acked_features: 0 };
            if m.activate(active).is_ok() {
                let _ = m.process_queue(0);
            }
        }
        0 => {
            let Ok(mut blk) = Block::open(&scratch().join("disk.img"), sel & 0x80 != 0) else {
                return;
            };
            let Some(q) = queue(&mem) else { return };
            let active = Active { mem: mem.clone(), queues: vec![q], irq, acked_features: 0 };
            if blk.activate(active).is_ok() {
                let _ = blk.process_queue(0);
            }
        }
        which => {
            let Ok(mut v) = Vsock::new(3, &scratch().join("v.sock")) else {
                return;
            };
            // The queue under test sits at the fixed addresses; the others
            // are empty rings elsewhere.
            let (Some(a), Some(b), Some(c)) = (queue(&mem), queue(&mem), queue(&mem)) else {
                return;
            };
            let active = Active { mem: mem.clone(), queues: vec![a, b, c], irq, acked_features: 0 };
            if v.activate(active).is_ok() {
                let _ = v.process_queue(if which == 1 { 1 } else { 0 });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// xorshift64*: deterministic, dependency-free randomness.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
    }

    /// Inputs shaped like real queues (mostly in-range addresses, short
    /// chains, plausible vsock/blk headers) with random corruption.
    fn input(rng: &mut Rng) -> Vec<u8> {
        let mut m = vec![0u8; 0x4000];
        for b in m.iter_mut().skip(0x3000) {
            *b = rng.next() as u8;
        }
        for i in 0..u64::from(QUEUE_SIZE) {
            let r = rng.next();
            let addr = if r.is_multiple_of(8) { rng.next() } else { 0x3000 + (rng.next() % 0x1000) };
            let len = match r % 5 {
                0 => rng.next() as u32,
                1 => 44,
                2 => 16,
                _ => (rng.next() % 600) as u32,
            };
            let flags = (rng.next() % 8) as u16;
            let next = (rng.next() % 20) as u16;
            let o = (DESC + i * 16) as usize;
            m[o..o + 8].copy_from_slice(&addr.to_le_bytes());
            m[o + 8..o + 12].copy_from_slice(&len.to_le_bytes());
            m[o + 12..o + 14].copy_from_slice(&flags.to_le_bytes());
            m[o + 14..o + 16].copy_from_slice(&next.to_le_bytes());
        }
        let avail_idx = if rng.next().is_multiple_of(10) { rng.next() as u16 } else { (rng.next() % 17) as u16 };
        m[AVAIL as usize + 2..AVAIL as usize + 4].copy_from_slice(&avail_idx.to_le_bytes());
        for i in 0..usize::from(QUEUE_SIZE) {
            let head = (rng.next() % 18) as u16;
            let o = AVAIL as usize + 4 + 2 * i;
            m[o..o + 2].copy_from_slice(&head.to_le_bytes());
        }
        // vsock-looking headers at some buffer addresses
        for _ in 0..4 {
            let o = 0x3000 + (rng.next() % 0xf00) as usize;
            let h = super::super::vsock::packet::Header {
                src_cid: if rng.next().is_multiple_of(4) { rng.next() } else { 3 },
                dst_cid: 2,
                src_port: rng.next() as u32,
                dst_port: (rng.next() % 4) as u32,
                len: (rng.next() % 100) as u32,
                type_: 1,
                op: (rng.next() % 9) as u16,
                flags: rng.next() as u32,
                buf_alloc: rng.next() as u32,
                fwd_cnt: rng.next() as u32,
            };
            m[o..o + 44].copy_from_slice(&h.to_bytes());
        }
        // virtio-mem-looking requests: mostly inside the region the
        // harness gives the device (4 GiB, 64 blocks of 2 MiB).
        for _ in 0..4 {
            let o = 0x3000 + (rng.next() % 0xfe0) as usize;
            let kind = (rng.next() % 5) as u16;
            let addr = if rng.next().is_multiple_of(6) { rng.next() } else { (4u64 << 30) + (rng.next() % 70) * (2 << 20) };
            let nb = if rng.next().is_multiple_of(6) { rng.next() as u16 } else { (rng.next() % 8) as u16 };
            m[o..o + 2].copy_from_slice(&kind.to_le_bytes());
            m[o + 8..o + 16].copy_from_slice(&addr.to_le_bytes());
            m[o + 16..o + 18].copy_from_slice(&nb.to_le_bytes());
        }
        let mut data = vec![(rng.next() % 256) as u8];
        data.extend_from_slice(&m);
        data
    }

    #[test]
    fn random_queues_never_panic() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..3000 {
            run(&input(&mut rng));
        }
        // and pure noise
        for _ in 0..300 {
            let len = (rng.next() % 0x4000) as usize;
            let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            run(&data);
        }
        run(&[]);
        run(&[1]);
    }
}
