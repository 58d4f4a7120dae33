//! Port I/O and MMIO dispatch from vCPU exits to devices.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::devices::i8042::I8042;
use crate::devices::serial::Serial;
use crate::devices::virtio::mmio::MmioTransport;
use crate::x86_64::layout::{I8042_DATA_PORT, SERIAL_PORT_BASE, VIRTIO_MMIO_SIZE};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every device a vCPU can reach.
pub struct Bus {
    pub serial: Arc<Mutex<Serial>>,
    pub i8042: Arc<Mutex<I8042>>,
    /// (base address, transport), one 4 KiB window each.
    pub mmio: Vec<(u64, Arc<Mutex<MmioTransport>>)>,
}

impl Bus {
    pub fn pio_read(&self, port: u16, data: &mut [u8]) {
        let v = match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + 8).contains(&p) && data.len() == 1 => {
                lock(&self.serial).read((p - SERIAL_PORT_BASE) as u8)
            }
            0x60 | 0x64 if data.len() == 1 => lock(&self.i8042).read(port - I8042_DATA_PORT),
            _ => 0xff,
        };
        data.fill(v);
    }

    pub fn pio_write(&self, port: u16, data: &[u8]) {
        let Some(&v) = data.first() else {
            return;
        };
        match port {
            p if (SERIAL_PORT_BASE..SERIAL_PORT_BASE + 8).contains(&p) && data.len() == 1 => {
                lock(&self.serial).write((p - SERIAL_PORT_BASE) as u8, v)
            }
            0x60 | 0x64 if data.len() == 1 => lock(&self.i8042).write(port - I8042_DATA_PORT, v),
            _ => {}
        }
    }

    fn find(&self, addr: u64) -> Option<(&Arc<Mutex<MmioTransport>>, u64)> {
        self.mmio.iter().find_map(|(base, t)| {
            let off = addr.checked_sub(*base)?;
            (off < VIRTIO_MMIO_SIZE).then_some((t, off))
        })
    }

    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) {
        match self.find(addr) {
            Some((t, off)) => lock(t).read(off, data),
            None => {
                tracing::debug!("MMIO read of unmapped {addr:#x}");
                data.fill(0xff)
            }
        }
    }

    pub fn mmio_write(&self, addr: u64, data: &[u8]) {
        match self.find(addr) {
            Some((t, off)) => lock(t).write(off, data),
            None => tracing::debug!("MMIO write to unmapped {addr:#x}"),
        }
    }
}
