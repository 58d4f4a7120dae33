//! virtio-mmio transport, version 2 (virtio 1.x "modern" register layout).
//! The guest finds each device through `virtio_mmio.device=4K@ADDR:IRQ` on
//! its command line.

use std::sync::atomic::Ordering;

use crate::GuestMemoryMmap;
use virtio_queue::{Queue, QueueT};

use super::{Active, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG};

const MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR_ID: u32 = 0;

pub const REG_MAGIC: u64 = 0x000;
pub const REG_VERSION: u64 = 0x004;
pub const REG_DEVICE_ID: u64 = 0x008;
pub const REG_VENDOR_ID: u64 = 0x00c;
pub const REG_DEVICE_FEATURES: u64 = 0x010;
pub const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
pub const REG_DRIVER_FEATURES: u64 = 0x020;
pub const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
pub const REG_QUEUE_SEL: u64 = 0x030;
pub const REG_QUEUE_NUM_MAX: u64 = 0x034;
pub const REG_QUEUE_NUM: u64 = 0x038;
pub const REG_QUEUE_READY: u64 = 0x044;
pub const REG_QUEUE_NOTIFY: u64 = 0x050;
pub const REG_INTERRUPT_STATUS: u64 = 0x060;
pub const REG_INTERRUPT_ACK: u64 = 0x064;
pub const REG_STATUS: u64 = 0x070;
pub const REG_QUEUE_DESC_LOW: u64 = 0x080;
pub const REG_QUEUE_DESC_HIGH: u64 = 0x084;
pub const REG_QUEUE_AVAIL_LOW: u64 = 0x090;
pub const REG_QUEUE_AVAIL_HIGH: u64 = 0x094;
pub const REG_QUEUE_USED_LOW: u64 = 0x0a0;
pub const REG_QUEUE_USED_HIGH: u64 = 0x0a4;
pub const REG_CONFIG_GENERATION: u64 = 0x0fc;
pub const REG_CONFIG: u64 = 0x100;

pub const STATUS_ACKNOWLEDGE: u32 = 1;
pub const STATUS_DRIVER: u32 = 2;
pub const STATUS_DRIVER_OK: u32 = 4;
pub const STATUS_FEATURES_OK: u32 = 8;
pub const STATUS_NEEDS_RESET: u32 = 0x40;
pub const STATUS_FAILED: u32 = 0x80;

/// The transport's own registers (for snapshots).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Registers {
    pub features_sel: u32,
    pub acked_features_sel: u32,
    pub acked_features: u64,
    pub queue_sel: u32,
    pub status: u32,
}

/// One virtio device behind its MMIO register window.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    irq: IrqTrigger,
    queues: Vec<Queue>,
    features_sel: u32,
    acked_features_sel: u32,
    acked_features: u64,
    queue_sel: u32,
    status: u32,
}

impl MmioTransport {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryMmap,
        irq: IrqTrigger,
    ) -> Result<Self, virtio_queue::Error> {
        let queues = device
            .queue_max_sizes()
            .iter()
            .map(|&s| Queue::new(s))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            device,
            mem,
            irq,
            queues,
            features_sel: 0,
            acked_features_sel: 0,
            acked_features: 0,
            queue_sel: 0,
            status: 0,
        })
    }

    pub fn device(&self) -> &dyn VirtioDevice {
        self.device.as_ref()
    }

    pub fn device_mut(&mut self) -> &mut dyn VirtioDevice {
        self.device.as_mut()
    }

    pub fn status(&self) -> u32 {
        self.status
    }

    pub fn irq(&self) -> &IrqTrigger {
        &self.irq
    }

    pub fn registers(&self) -> Registers {
        Registers {
            features_sel: self.features_sel,
            acked_features_sel: self.acked_features_sel,
            acked_features: self.acked_features,
            queue_sel: self.queue_sel,
            status: self.status,
        }
    }

    /// The queue configuration the driver wrote (the device works on its
    /// own copies once activated).
    pub fn queues(&self) -> &[Queue] {
        &self.queues
    }

    /// Restore registers and queue configuration from a snapshot. The
    /// caller has validated `queues` against the device and guest memory.
    pub(crate) fn set_registers(&mut self, r: Registers, queues: Vec<Queue>) {
        self.features_sel = r.features_sel;
        self.acked_features_sel = r.acked_features_sel;
        self.acked_features = r.acked_features & self.device.avail_features();
        self.queue_sel = r.queue_sel;
        self.status = r.status;
        self.queues = queues;
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_sel as usize)
    }

    fn selected_queue_mut(&mut self) -> Option<&mut Queue> {
        if self.device.is_activated() {
            // Queue configuration is frozen once the device runs.
            return None;
        }
        self.queues.get_mut(self.queue_sel as usize)
    }

    fn reset(&mut self) {
        self.device.reset();
        for q in &mut self.queues {
            q.reset();
        }
        self.features_sel = 0;
        self.acked_features_sel = 0;
        self.acked_features = 0;
        self.queue_sel = 0;
        self.status = 0;
        self.irq.status.store(0, Ordering::SeqCst);
    }

    /// Mark the device broken and tell the driver (config-change interrupt).
    pub fn set_needs_reset(&mut self) {
        self.status |= STATUS_NEEDS_RESET;
        if let Err(e) = self.irq.trigger(VIRTIO_MMIO_INT_CONFIG) {
            tracing::warn!("cannot raise config interrupt: {e}");
        }
    }

    /// Handle a guest read of `data.len()` bytes at `offset`.
    pub fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= REG_CONFIG {
            self.device.read_config(offset - REG_CONFIG, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        let v: u32 = match offset {
            REG_MAGIC => MAGIC_VALUE,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => self.device.device_type(),
            REG_VENDOR_ID => VENDOR_ID,
            REG_DEVICE_FEATURES => match self.features_sel {
                0 => self.device.avail_features() as u32,
                1 => (self.device.avail_features() >> 32) as u32,
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            REG_QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            REG_INTERRUPT_STATUS => self.irq.status.load(Ordering::SeqCst),
            REG_STATUS => self.status,
            REG_CONFIG_GENERATION => self.device.config_generation(),
            _ => 0,
        };
        data.copy_from_slice(&v.to_le_bytes());
    }

    /// Handle a guest write at `offset`.
    pub fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= REG_CONFIG {
            if self.status & STATUS_DRIVER != 0 {
                self.device.write_config(offset - REG_CONFIG, data);
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            tracing::debug!(
                "ignoring {}-byte virtio-mmio write at {offset:#x}",
                data.len()
            );
            return;
        };
        let v = u32::from_le_bytes(bytes);
        match offset {
            REG_DEVICE_FEATURES_SEL => self.features_sel = v,
            REG_DRIVER_FEATURES_SEL => self.acked_features_sel = v,
            REG_DRIVER_FEATURES => {
                if self.status & STATUS_FEATURES_OK != 0 || self.device.is_activated() {
                    return;
                }
                let avail = self.device.avail_features();
                match self.acked_features_sel {
                    0 => {
                        self.acked_features = (self.acked_features & !0xffff_ffff)
                            | (u64::from(v) & avail & 0xffff_ffff)
                    }
                    1 => {
                        self.acked_features = (self.acked_features & 0xffff_ffff)
                            | ((u64::from(v) << 32) & avail & !0xffff_ffff)
                    }
                    _ => {}
                }
            }
            REG_QUEUE_SEL => self.queue_sel = v,
            REG_QUEUE_NUM => {
                if let Some(q) = self.selected_queue_mut() {
                    if let Ok(n) = u16::try_from(v) {
                        q.set_size(n);
                    }
                }
            }
            REG_QUEUE_READY => {
                if let Some(q) = self.selected_queue_mut() {
                    q.set_ready(v == 1);
                }
            }
            REG_QUEUE_DESC_LOW => self.with_queue(|q| q.set_desc_table_address(Some(v), None)),
            REG_QUEUE_DESC_HIGH => self.with_queue(|q| q.set_desc_table_address(None, Some(v))),
            REG_QUEUE_AVAIL_LOW => self.with_queue(|q| q.set_avail_ring_address(Some(v), None)),
            REG_QUEUE_AVAIL_HIGH => self.with_queue(|q| q.set_avail_ring_address(None, Some(v))),
            REG_QUEUE_USED_LOW => self.with_queue(|q| q.set_used_ring_address(Some(v), None)),
            REG_QUEUE_USED_HIGH => self.with_queue(|q| q.set_used_ring_address(None, Some(v))),
            REG_QUEUE_NOTIFY => self.notify(v as usize),
            REG_INTERRUPT_ACK => {
                self.irq.status.fetch_and(!v, Ordering::SeqCst);
            }
            REG_STATUS => self.set_status(v),
            _ => tracing::debug!("ignoring virtio-mmio write {v:#x} at {offset:#x}"),
        }
    }

    fn with_queue(&mut self, f: impl FnOnce(&mut Queue)) {
        if let Some(q) = self.selected_queue_mut() {
            f(q);
        }
    }

    /// The driver notified queue `index` (an MMIO write, or an ioeventfd).
    pub fn notify(&mut self, index: usize) {
        if !self.device.is_activated() {
            return;
        }
        if let Err(e) = self.device.process_queue(index) {
            crate::guest_warn!(
                "virtio device {} queue {index}: {e}; device needs reset",
                self.device.device_type()
            );
            self.set_needs_reset();
        }
    }

    fn set_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let mut v = v;
        // FEATURES_OK only sticks if the driver accepted VERSION_1.
        if v & STATUS_FEATURES_OK != 0
            && self.status & STATUS_FEATURES_OK == 0
            && self.acked_features & VIRTIO_F_VERSION_1 == 0
        {
            crate::guest_warn!("driver did not accept VIRTIO_F_VERSION_1; refusing FEATURES_OK");
            v &= !STATUS_FEATURES_OK;
        }
        self.status = v | (self.status & STATUS_NEEDS_RESET);
        if v & STATUS_DRIVER_OK != 0
            && v & STATUS_FEATURES_OK != 0
            && !self.device.is_activated()
            && v & STATUS_FAILED == 0
        {
            self.activate();
        }
    }

    fn activate(&mut self) {
        for (i, q) in self.queues.iter().enumerate() {
            if q.ready() && !q.is_valid(&self.mem) {
                crate::guest_warn!("virtio queue {i} is invalid; not activating");
                self.set_needs_reset();
                return;
            }
        }
        let queues = match self
            .queues
            .iter()
            .map(|q| Queue::try_from(q.state()))
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(q) => q,
            Err(e) => {
                crate::guest_warn!("virtio queue state: {e}");
                self.set_needs_reset();
                return;
            }
        };
        if let Err(e) = self.device.activate(Active {
            mem: self.mem.clone(),
            queues,
            irq: self.irq.clone(),
            acked_features: self.acked_features,
        }) {
            crate::guest_warn!(
                "virtio device {} activation failed: {e}",
                self.device.device_type()
            );
            self.set_needs_reset();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::queue::testing::{memory, DriverQueue};
    use crate::devices::virtio::{delegate_base, DeviceError, VirtioBase};

    struct Dummy {
        base: VirtioBase,
        notified: Vec<usize>,
    }

    impl VirtioDevice for Dummy {
        delegate_base!(base);
        fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
            self.notified.push(index);
            if index > 1 {
                return Err(DeviceError::NoSuchQueue(index));
            }
            Ok(())
        }
    }

    fn transport() -> MmioTransport {
        let base = VirtioBase::new(
            42,
            VIRTIO_F_VERSION_1 | 0b101,
            &[16, 8],
            vec![1, 2, 3, 4, 5, 6, 7, 8],
        );
        let dev = Dummy {
            base,
            notified: vec![],
        };
        MmioTransport::new(Box::new(dev), memory(1 << 20), IrqTrigger::new().unwrap()).unwrap()
    }

    fn r(t: &mut MmioTransport, off: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(off, &mut b);
        u32::from_le_bytes(b)
    }

    fn w(t: &mut MmioTransport, off: u64, v: u32) {
        t.write(off, &v.to_le_bytes());
    }

    #[test]
    fn identity_registers() {
        let mut t = transport();
        assert_eq!(r(&mut t, REG_MAGIC), MAGIC_VALUE);
        assert_eq!(r(&mut t, REG_VERSION), 2);
        assert_eq!(r(&mut t, REG_DEVICE_ID), 42);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), 0b101);
        w(&mut t, REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), 1);
        w(&mut t, REG_DEVICE_FEATURES_SEL, 7);
        assert_eq!(r(&mut t, REG_DEVICE_FEATURES), 0);
        w(&mut t, REG_QUEUE_SEL, 1);
        assert_eq!(r(&mut t, REG_QUEUE_NUM_MAX), 8);
        w(&mut t, REG_QUEUE_SEL, 99);
        assert_eq!(r(&mut t, REG_QUEUE_NUM_MAX), 0);
        // odd sizes and unknown offsets never panic
        let mut one = [0xffu8; 1];
        t.read(REG_MAGIC, &mut one);
        assert_eq!(one, [0]);
        t.write(REG_STATUS, &[1, 2]);
        w(&mut t, 0xf00, 1);
        let mut cfg = [0u8; 4];
        t.read(REG_CONFIG + 6, &mut cfg);
        assert_eq!(cfg, [7, 8, 0, 0]);
        t.read(u64::MAX, &mut cfg);
        assert_eq!(cfg, [0; 4]);
    }

    fn setup_queue(t: &mut MmioTransport, sel: u32, dq: &DriverQueue) {
        w(t, REG_QUEUE_SEL, sel);
        w(t, REG_QUEUE_NUM, u32::from(dq.size));
        w(t, REG_QUEUE_DESC_LOW, dq.desc as u32);
        w(t, REG_QUEUE_DESC_HIGH, 0);
        w(t, REG_QUEUE_AVAIL_LOW, dq.avail as u32);
        w(t, REG_QUEUE_USED_LOW, dq.used as u32);
        w(t, REG_QUEUE_READY, 1);
    }

    #[test]
    fn driver_handshake_activates_and_notifies() {
        let mut t = transport();
        w(&mut t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        w(&mut t, REG_DRIVER_FEATURES_SEL, 1);
        w(&mut t, REG_DRIVER_FEATURES, 1);
        w(&mut t, REG_DRIVER_FEATURES_SEL, 0);
        w(&mut t, REG_DRIVER_FEATURES, 0xffff_ffff);
        assert_eq!(
            t.acked_features,
            VIRTIO_F_VERSION_1 | 0b101,
            "masked by offer"
        );
        w(
            &mut t,
            REG_STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
        assert_ne!(r(&mut t, REG_STATUS) & STATUS_FEATURES_OK, 0);
        setup_queue(&mut t, 0, &DriverQueue::new(0x1000, 16));
        setup_queue(&mut t, 1, &DriverQueue::new(0x4000, 8));
        assert_eq!(r(&mut t, REG_QUEUE_READY), 1);
        w(&mut t, REG_STATUS, 0xf);
        assert!(t.device().is_activated());
        w(&mut t, REG_QUEUE_NOTIFY, 1);
        w(&mut t, REG_QUEUE_NOTIFY, 5);
        assert_ne!(
            r(&mut t, REG_STATUS) & STATUS_NEEDS_RESET,
            0,
            "bad queue index is a device error"
        );
        assert_ne!(r(&mut t, REG_INTERRUPT_STATUS) & VIRTIO_MMIO_INT_CONFIG, 0);
        w(&mut t, REG_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r(&mut t, REG_INTERRUPT_STATUS), 0);
        // queue config is frozen while running
        w(&mut t, REG_QUEUE_SEL, 0);
        w(&mut t, REG_QUEUE_NUM, 2);
        w(&mut t, REG_STATUS, 0);
        assert!(!t.device().is_activated());
        assert_eq!(r(&mut t, REG_STATUS), 0);
        assert_eq!(r(&mut t, REG_QUEUE_READY), 0);
    }

    #[test]
    fn features_ok_needs_version_1() {
        let mut t = transport();
        w(&mut t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        w(&mut t, REG_DRIVER_FEATURES, 0b1);
        w(
            &mut t,
            REG_STATUS,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
        assert_eq!(r(&mut t, REG_STATUS) & STATUS_FEATURES_OK, 0);
        w(&mut t, REG_STATUS, 0xf);
        assert!(!t.device().is_activated());
    }

    #[test]
    fn queue_outside_memory_is_not_activated() {
        let mut t = transport();
        w(&mut t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        w(&mut t, REG_DRIVER_FEATURES_SEL, 1);
        w(&mut t, REG_DRIVER_FEATURES, 1);
        w(&mut t, REG_STATUS, 0xb);
        setup_queue(&mut t, 0, &DriverQueue::new(0xfff_0000, 16));
        w(&mut t, REG_STATUS, 0xf);
        assert!(!t.device().is_activated());
        assert_ne!(r(&mut t, REG_STATUS) & STATUS_NEEDS_RESET, 0);
    }
}
