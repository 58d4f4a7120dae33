//! Bounded randomized tests (issue 15) of the devices a guest drives by
//! register: the serial port and the i8042 (port I/O) and the virtio-mmio
//! transport (register sequences, queue setup, notifications). Seeded, a
//! few thousand sequences each, in the normal test suite; any panic is a
//! bug. The virtqueue contents themselves are `virtio::fuzz`'s (also a
//! cargo-fuzz target).

use std::io::Write;
use std::sync::{Arc, Mutex};

use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use super::i8042::I8042;
use super::serial::{IrqEvt, Serial};
use super::virtio::block::Block;
use super::virtio::mmio::*;
use super::virtio::IrqTrigger;
use crate::GuestMemoryMmap;

#[derive(Clone, Default)]
struct Count(Arc<Mutex<usize>>);

impl Write for Count {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) += b.len();
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn evt() -> Arc<EventFd> {
    Arc::new(EventFd::new(libc::EFD_NONBLOCK).expect("eventfd"))
}

#[test]
fn random_port_io_never_panics_and_output_is_bounded_by_writes() {
    let mut rng = fastrand::Rng::with_seed(0x5eed_0017);
    for _ in 0..2000 {
        let out = Count::default();
        let mut s = Serial::new(IrqEvt(evt()), Box::new(out.clone()));
        let mut k = I8042::new(evt(), evt());
        let mut thr_writes = 0usize;
        for _ in 0..200 {
            let v = rng.u8(..);
            match rng.u8(0..6) {
                0 => {
                    let off = if rng.bool() { rng.u8(0..8) } else { rng.u8(..) };
                    if off == 0 {
                        thr_writes += 1;
                    }
                    s.write(off, v);
                }
                1 => {
                    s.read(if rng.bool() { rng.u8(0..8) } else { rng.u8(..) });
                }
                2 => {
                    let input: Vec<u8> = (0..rng.usize(0..70)).map(|_| rng.u8(..)).collect();
                    s.enqueue_input(&input);
                }
                3 => k.write(if rng.bool() { [0x60, 0x64][rng.usize(0..2)] } else { rng.u16(..) }, v),
                _ => {
                    k.read(if rng.bool() { [0x60, 0x64][rng.usize(0..2)] } else { rng.u16(..) });
                }
            }
        }
        let written = *out.0.lock().unwrap_or_else(|p| p.into_inner());
        assert!(written <= thr_writes, "{written} bytes out for {thr_writes} writes to the data register");
    }
}

#[test]
fn random_mmio_register_sequences_never_panic() {
    const REGS: [u64; 24] = [
        REG_MAGIC, REG_VERSION, REG_DEVICE_ID, REG_VENDOR_ID, REG_DEVICE_FEATURES,
        REG_DEVICE_FEATURES_SEL, REG_DRIVER_FEATURES, REG_DRIVER_FEATURES_SEL, REG_QUEUE_SEL,
        REG_QUEUE_NUM_MAX, REG_QUEUE_NUM, REG_QUEUE_READY, REG_QUEUE_NOTIFY, REG_INTERRUPT_STATUS,
        REG_INTERRUPT_ACK, REG_STATUS, REG_QUEUE_DESC_LOW, REG_QUEUE_DESC_HIGH, REG_QUEUE_AVAIL_LOW,
        REG_QUEUE_AVAIL_HIGH, REG_QUEUE_USED_LOW, REG_QUEUE_USED_HIGH, REG_CONFIG_GENERATION, REG_CONFIG,
    ];
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = dir.path().join("disk.img");
    std::fs::write(&disk, vec![0u8; 64 * 1024]).expect("disk");
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 * 1024)]).expect("memory");
    let mut rng = fastrand::Rng::with_seed(0x5eed_0018);
    for _ in 0..2000 {
        let dev = Block::open(&disk, rng.bool()).expect("block");
        let mut t = MmioTransport::new(Box::new(dev), mem.clone(), IrqTrigger::new().expect("irq")).expect("transport");
        for _ in 0..100 {
            let off = match rng.u8(0..8) {
                0 => rng.u64(0..0x200),
                1 => REG_CONFIG + rng.u64(0..64),
                _ => REGS[rng.usize(0..REGS.len())],
            };
            let len = [1usize, 2, 4, 8, 0, 3][rng.usize(0..6)];
            if rng.u8(0..3) == 0 {
                let mut buf = vec![0u8; len];
                t.read(off, &mut buf);
            } else {
                // Mostly plausible values: a driver's status bits, small
                // queue numbers and sizes, addresses inside memory.
                let v: u64 = match rng.u8(0..4) {
                    0 => u64::from(rng.u32(..)),
                    1 => rng.u64(0..16),
                    2 => rng.u64(0..0x1_0000) & !0xf,
                    _ => 0xf,
                };
                let bytes = v.to_le_bytes();
                t.write(off, bytes.get(..len).unwrap_or(&bytes));
            }
        }
        let _ = t.status();
    }
}
