//! What every virtio device shares, so each device only writes its own
//! request handling: identity (device type, offered features, queue sizes,
//! config space), activation (guest memory, the driver's queues, the
//! interrupt and the acknowledged features), raising the used-buffer
//! interrupt, the count of malformed requests, and the snapshot of all of
//! it ([`BaseState`]). A device holds a [`VirtioBase`] and hands it to the
//! [`VirtioDevice`](super::VirtioDevice) trait, whose default methods do
//! the rest.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

use super::persist::{restore_queues, DeviceContext, QueueSnap, VirtioPersistError};
use super::{ActivateError, DeviceError, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_VRING};
use crate::GuestMemoryMmap;

/// Raises the device's interrupt line: sets a bit in the transport's
/// interrupt status and signals the irqfd (or, in tests, a plain eventfd).
#[derive(Clone, Debug)]
pub struct IrqTrigger {
    pub status: Arc<AtomicU32>,
    pub evt: Arc<EventFd>,
}

impl IrqTrigger {
    pub fn new() -> std::io::Result<Self> {
        Ok(Self {
            status: Arc::new(AtomicU32::new(0)),
            evt: Arc::new(EventFd::new(libc::EFD_NONBLOCK)?),
        })
    }

    pub fn trigger(&self, bit: u32) -> Result<(), DeviceError> {
        self.status.fetch_or(bit, Ordering::SeqCst);
        self.evt.write(1).map_err(DeviceError::Irq)
    }
}

/// What the driver handed over when it set DRIVER_OK.
pub struct Active {
    pub mem: GuestMemoryMmap,
    pub queues: Vec<Queue>,
    pub irq: IrqTrigger,
    pub acked_features: u64,
}

/// The part of a virtio device that is the same for every device.
pub struct VirtioBase {
    device_type: u32,
    avail_features: u64,
    queue_max_sizes: Vec<u16>,
    config: Vec<u8>,
    /// Bumped on every config space change (not kept in snapshots: the
    /// driver only compares two reads around one config access).
    config_generation: u32,
    active: Option<Active>,
    /// Malformed requests the guest has sent so far.
    pub errors: u64,
}

impl VirtioBase {
    /// A device of `device_type` offering `avail_features` (which must
    /// include VIRTIO_F_VERSION_1), one queue per entry of
    /// `queue_max_sizes`, and `config` as its (read-only) config space.
    pub fn new(
        device_type: u32,
        avail_features: u64,
        queue_max_sizes: &[u16],
        config: Vec<u8>,
    ) -> Self {
        Self {
            device_type,
            avail_features,
            queue_max_sizes: queue_max_sizes.to_vec(),
            config,
            config_generation: 0,
            active: None,
            errors: 0,
        }
    }

    pub fn device_type(&self) -> u32 {
        self.device_type
    }

    pub fn avail_features(&self) -> u64 {
        self.avail_features
    }

    pub fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    /// Read config space at `offset`; bytes past the end read as 0.
    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.config, offset, data)
    }

    pub fn config_generation(&self) -> u32 {
        self.config_generation
    }

    /// Replace the config space and, once the driver runs, tell it with
    /// the config-change interrupt.
    pub fn set_config(&mut self, config: Vec<u8>) -> Result<(), DeviceError> {
        self.config = config;
        self.config_generation = self.config_generation.wrapping_add(1);
        match &self.active {
            Some(a) => a.irq.trigger(VIRTIO_MMIO_INT_CONFIG),
            None => Ok(()),
        }
    }

    /// Replace the config space after a change the driver does not need
    /// an interrupt for (virtio-mem's plugged size): the generation
    /// changes, so a driver reading across it reads again.
    pub fn update_config(&mut self, config: Vec<u8>) {
        self.config = config;
        self.config_generation = self.config_generation.wrapping_add(1);
    }

    /// Take over the driver's queues (one per queue the device offers).
    pub fn activate(&mut self, active: Active) -> Result<(), ActivateError> {
        if active.queues.len() != self.queue_max_sizes.len() {
            return Err(ActivateError::QueueCount {
                expected: self.queue_max_sizes.len(),
                got: active.queues.len(),
            });
        }
        self.active = Some(active);
        Ok(())
    }

    pub fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    /// The driver reset the device: drop the queues.
    pub fn reset(&mut self) {
        self.active = None;
    }

    /// The activated device's memory, queues and interrupt.
    pub fn active(&self) -> Result<&Active, DeviceError> {
        self.active.as_ref().ok_or(DeviceError::NotActivated)
    }

    /// Guest memory (a cheap handle), once activated.
    pub fn mem(&self) -> Result<GuestMemoryMmap, DeviceError> {
        Ok(self.active()?.mem.clone())
    }

    /// Queue `index` of the activated device.
    pub fn queue_mut(&mut self, index: usize) -> Result<&mut Queue, DeviceError> {
        self.active
            .as_mut()
            .ok_or(DeviceError::NotActivated)?
            .queues
            .get_mut(index)
            .ok_or(DeviceError::NoSuchQueue(index))
    }

    /// Tell the driver that buffers were used (no-op before activation).
    pub fn signal_used(&self) -> Result<(), DeviceError> {
        match &self.active {
            Some(a) => a.irq.trigger(VIRTIO_MMIO_INT_VRING),
            None => Ok(()),
        }
    }

    /// Signal the driver for queue `index` after using buffers on it,
    /// unless the driver asked not to be (event index / NO_INTERRUPT).
    pub fn signal_used_if_needed(&mut self, index: usize) -> Result<(), DeviceError> {
        let mem = self.mem()?;
        let queue = self.queue_mut(index)?;
        if virtio_queue::QueueT::needs_notification(queue, &mem).unwrap_or(true) {
            self.signal_used()?;
        }
        Ok(())
    }

    /// The snapshot of this part of the device.
    pub fn save(&self) -> BaseState {
        BaseState {
            errors: self.errors,
            active: self.active.as_ref().map(|a| ActiveState {
                queues: a.queues.iter().map(QueueSnap::of).collect(),
            }),
        }
    }

    /// Load `state` into a freshly built device: its error count and, if
    /// it was active, its queues (checked against this device and guest
    /// memory) with the context's memory and interrupt.
    pub fn restore(
        &mut self,
        state: &BaseState,
        ctx: DeviceContext,
    ) -> Result<(), VirtioPersistError> {
        self.errors = state.errors;
        if let Some(active) = &state.active {
            let queues = restore_queues(&active.queues, &self.queue_max_sizes, &ctx.mem)?;
            let (mem, irq, acked_features) = (ctx.mem, ctx.irq, ctx.acked_features);
            self.activate(Active {
                mem,
                queues,
                irq,
                acked_features,
            })
            .map_err(|e| VirtioPersistError::Activate(e.to_string()))?;
        }
        Ok(())
    }
}

/// The queues a device was activated with, as it has advanced them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActiveState {
    pub queues: Vec<QueueSnap>,
}

/// Snapshot of a [`VirtioBase`]; each device's state flattens it in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseState {
    pub errors: u64,
    /// The live queues, if the driver had activated the device.
    pub active: Option<ActiveState>,
}

/// Copy `config[offset..]` into `data`, zero-filling past the end.
pub fn read_config_bytes(config: &[u8], offset: u64, data: &mut [u8]) {
    for (i, b) in data.iter_mut().enumerate() {
        *b = usize::try_from(offset)
            .ok()
            .and_then(|o| o.checked_add(i))
            .and_then(|o| config.get(o))
            .copied()
            .unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::devices::virtio::queue::testing::{memory, DriverQueue};
    use crate::devices::virtio::{VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING};

    fn base() -> VirtioBase {
        VirtioBase::new(7, VIRTIO_F_VERSION_1, &[16, 8], vec![1, 2, 3])
    }

    fn active(mem: &GuestMemoryMmap, queues: Vec<Queue>) -> Active {
        let irq = IrqTrigger::new().unwrap();
        Active {
            mem: mem.clone(),
            queues,
            irq,
            acked_features: VIRTIO_F_VERSION_1,
        }
    }

    #[test]
    fn config_space_reads_zero_past_its_end() {
        let mut data = [0xff; 4];
        base().read_config(1, &mut data);
        assert_eq!(data, [2, 3, 0, 0]);
        base().read_config(u64::MAX, &mut data);
        assert_eq!(data, [0; 4]);
    }

    #[test]
    fn activation_needs_one_queue_per_offered_queue() {
        let mem = memory(1 << 20);
        let mut b = base();
        assert!(matches!(b.queue_mut(0), Err(DeviceError::NotActivated)));
        let one = vec![DriverQueue::new(0x1000, 16).queue(&mem)];
        let err = b.activate(active(&mem, one)).unwrap_err();
        assert!(matches!(
            err,
            ActivateError::QueueCount {
                expected: 2,
                got: 1
            }
        ));
        assert!(!b.is_activated());

        let two = vec![
            DriverQueue::new(0x1000, 16).queue(&mem),
            DriverQueue::new(0x4000, 8).queue(&mem),
        ];
        let a = active(&mem, two);
        let irq = a.irq.clone();
        b.activate(a).unwrap();
        assert!(b.is_activated());
        assert!(b.queue_mut(1).is_ok());
        assert!(matches!(b.queue_mut(2), Err(DeviceError::NoSuchQueue(2))));
        b.signal_used().unwrap();
        assert_eq!(irq.status.load(Ordering::SeqCst), VIRTIO_MMIO_INT_VRING);
        assert_eq!(irq.evt.read().unwrap(), 1);
        b.reset();
        assert!(!b.is_activated());
        assert!(matches!(b.mem(), Err(DeviceError::NotActivated)));
    }

    #[test]
    fn state_round_trips_and_is_checked_against_the_device() {
        let mem = memory(1 << 20);
        let mut b = base();
        let qs = vec![
            DriverQueue::new(0x1000, 16).queue(&mem),
            DriverQueue::new(0x4000, 8).queue(&mem),
        ];
        b.activate(active(&mem, qs)).unwrap();
        b.errors = 3;
        let state = b.save();
        let ctx = || DeviceContext {
            mem: mem.clone(),
            irq: IrqTrigger::new().unwrap(),
            acked_features: VIRTIO_F_VERSION_1,
        };
        let mut fresh = base();
        fresh.restore(&state, ctx()).unwrap();
        assert_eq!((fresh.is_activated(), fresh.errors), (true, 3));
        assert_eq!(fresh.save(), state);

        // A device offering different queues refuses the state.
        let mut other = VirtioBase::new(7, VIRTIO_F_VERSION_1, &[16, 16], vec![]);
        assert!(other.restore(&state, ctx()).is_err());
        assert!(!other.is_activated());
        let mut fewer = VirtioBase::new(7, VIRTIO_F_VERSION_1, &[16], vec![]);
        assert!(matches!(
            fewer.restore(&state, ctx()),
            Err(VirtioPersistError::QueueCount {
                expected: 1,
                found: 2
            })
        ));
    }
}
