//! Fuzzing harnesses for the devices a guest drives by register: the
//! serial port and the i8042 (port I/O), and the virtio-mmio transport
//! (register sequences, queue setup, notifications). The input bytes are
//! read as a sequence of guest accesses; any panic is a bug. Used by
//! `vmm/fuzz` (cargo-fuzz targets `port_io` and `mmio`) and by randomized
//! tests in the normal test suite (`fuzz_tests.rs`), which feed them
//! random bytes. The virtqueue contents are `virtio::fuzz`'s.

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

/// Accesses one input makes at most (longer inputs are cut).
pub const MAX_ACCESSES: usize = 4096;

/// The input, read front to back; zeros once it is used up.
pub struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self(data)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn u8(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    pub fn u32(&mut self) -> u32 {
        u32::from(self.u16()) | (u32::from(self.u16()) << 16)
    }

    pub fn u64(&mut self) -> u64 {
        u64::from(self.u32()) | (u64::from(self.u32()) << 32)
    }

    /// A number below `n` (`n` > 0), from as few bytes as `n` needs.
    pub fn below(&mut self, n: u64) -> u64 {
        let v = if n <= 1 << 8 {
            u64::from(self.u8())
        } else if n <= 1 << 16 {
            u64::from(self.u16())
        } else {
            self.u64()
        };
        v % n.max(1)
    }

    /// `len` bytes (fewer if the input ends).
    pub fn bytes(&mut self, len: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(len.min(self.0.len()));
        self.0 = rest;
        head
    }
}

/// Counts what the serial port writes.
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

fn evt() -> Option<Arc<EventFd>> {
    EventFd::new(libc::EFD_NONBLOCK).ok().map(Arc::new)
}

/// Port I/O on a serial port and an i8042: reads and writes of their
/// registers (mostly real ones), host input for the serial port. The
/// serial port writes at most a byte per write to its data register.
pub fn port_io(data: &[u8]) {
    let mut inp = Input::new(data);
    let (Some(irq), Some(kirq), Some(reset)) = (evt(), evt(), evt()) else {
        return;
    };
    let out = Count::default();
    let mut s = Serial::new(IrqEvt(irq), Box::new(out.clone()));
    let mut k = I8042::new(kirq, reset);
    let mut thr_writes = 0usize;
    let kbd_port = |inp: &mut Input| {
        if inp.bool() {
            [0x60, 0x64][inp.below(2) as usize]
        } else {
            inp.u16()
        }
    };
    for _ in 0..MAX_ACCESSES {
        if inp.is_empty() {
            break;
        }
        let v = inp.u8();
        match inp.below(6) {
            0 => {
                let off = if inp.bool() {
                    inp.below(8) as u8
                } else {
                    inp.u8()
                };
                if off == 0 {
                    thr_writes += 1;
                }
                s.write(off, v);
            }
            1 => {
                let off = if inp.bool() {
                    inp.below(8) as u8
                } else {
                    inp.u8()
                };
                s.read(off);
            }
            2 => {
                let len = inp.below(70) as usize;
                s.enqueue_input(inp.bytes(len));
            }
            3 => {
                let port = kbd_port(&mut inp);
                k.write(port, v);
            }
            _ => {
                let port = kbd_port(&mut inp);
                k.read(port);
            }
        }
    }
    let written = *out.0.lock().unwrap_or_else(|p| p.into_inner());
    assert!(
        written <= thr_writes,
        "{written} bytes out for {thr_writes} writes to the data register"
    );
}

/// The registers the MMIO harness mostly picks from (by index).
pub const REGS: [u64; 24] = [
    REG_MAGIC,
    REG_VERSION,
    REG_DEVICE_ID,
    REG_VENDOR_ID,
    REG_DEVICE_FEATURES,
    REG_DEVICE_FEATURES_SEL,
    REG_DRIVER_FEATURES,
    REG_DRIVER_FEATURES_SEL,
    REG_QUEUE_SEL,
    REG_QUEUE_NUM_MAX,
    REG_QUEUE_NUM,
    REG_QUEUE_READY,
    REG_QUEUE_NOTIFY,
    REG_INTERRUPT_STATUS,
    REG_INTERRUPT_ACK,
    REG_STATUS,
    REG_QUEUE_DESC_LOW,
    REG_QUEUE_DESC_HIGH,
    REG_QUEUE_AVAIL_LOW,
    REG_QUEUE_AVAIL_HIGH,
    REG_QUEUE_USED_LOW,
    REG_QUEUE_USED_HIGH,
    REG_CONFIG_GENERATION,
    REG_CONFIG,
];

/// Guest memory the MMIO harness gives its device.
const MMIO_MEM: usize = 64 * 1024;

/// A virtio-blk device behind the MMIO transport, driven by register
/// reads and writes: mostly real registers and plausible values (status
/// bits, small queue numbers and sizes, addresses inside memory), so that
/// queues get set up, the device activated and notified. Returns the
/// device status it ended with.
pub fn mmio_registers(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let disk = super::virtio::fuzz::scratch().join("disk.img");
    let Ok(mem) = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MMIO_MEM)]) else {
        return 0;
    };
    let Ok(dev) = Block::open(&disk, inp.bool()) else {
        return 0;
    };
    let Ok(irq) = IrqTrigger::new() else {
        return 0;
    };
    let Ok(mut t) = MmioTransport::new(Box::new(dev), mem, irq) else {
        return 0;
    };
    for _ in 0..MAX_ACCESSES {
        if inp.is_empty() {
            break;
        }
        let off = match inp.below(8) {
            0 => inp.below(0x200),
            1 => REG_CONFIG + inp.below(64),
            _ => REGS[inp.below(REGS.len() as u64) as usize],
        };
        let len = [1usize, 2, 4, 8, 0, 3][inp.below(6) as usize];
        if inp.below(3) == 0 {
            let mut buf = vec![0u8; len];
            t.read(off, &mut buf);
        } else {
            let v: u64 = match inp.below(4) {
                0 => u64::from(inp.u32()),
                1 => inp.below(16),
                2 => inp.below(MMIO_MEM as u64) & !0xf,
                _ => 0xf,
            };
            let bytes = v.to_le_bytes();
            t.write(off, bytes.get(..len).unwrap_or(&bytes));
        }
    }
    t.status()
}
