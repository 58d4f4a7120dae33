use std::io::ErrorKind;
use std::os::fd::{AsRawFd, RawFd};

use virtio_bindings::virtio_net::{
    VIRTIO_NET_F_CSUM, VIRTIO_NET_F_GUEST_CSUM, VIRTIO_NET_F_GUEST_TSO4, VIRTIO_NET_F_GUEST_TSO6,
    VIRTIO_NET_F_HOST_TSO4, VIRTIO_NET_F_HOST_TSO6, VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::QueueOwnedT;
use vm_memory::{Bytes, GuestMemoryBackend};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::tap::{Tap, VNET_HDR_LEN};
use crate::devices::virtio::queue::{add_used, collect_chain, pop_chain, QueueError};
use crate::devices::virtio::{
    delegate_base, ActivateError, Active, DeviceError, VirtioBase, VirtioDevice, TYPE_NET,
    VIRTIO_F_VERSION_1,
};
use crate::GuestMemoryMmap;

pub(crate) const RXQ: usize = 0;
pub(crate) const TXQ: usize = 1;
pub(crate) const QUEUE_SIZE: u16 = 256;
/// Largest frame either way, header included: a 64 KiB GSO frame, its
/// Ethernet header and the virtio-net header (Firecracker's bound).
pub(crate) const MAX_FRAME: usize = 65562;
/// Frames moved per queue per wake-up; past it the device wakes itself
/// again, so a guest flooding a queue cannot keep the VMM thread from its
/// other work (control API, other devices).
pub(crate) const BUDGET: usize = 64;

const TOKEN_TAP: u64 = 1;
const TOKEN_KICK: u64 = 2;

const fn bit(b: u32) -> u64 {
    1 << b
}

/// What we offer: checksum offload both ways, TSO both ways, mergeable
/// receive buffers, the MAC in config space.
pub(crate) const FEATURES: u64 = VIRTIO_F_VERSION_1
    | bit(VIRTIO_NET_F_CSUM)
    | bit(VIRTIO_NET_F_GUEST_CSUM)
    | bit(VIRTIO_NET_F_MAC)
    | bit(VIRTIO_NET_F_GUEST_TSO4)
    | bit(VIRTIO_NET_F_GUEST_TSO6)
    | bit(VIRTIO_NET_F_HOST_TSO4)
    | bit(VIRTIO_NET_F_HOST_TSO6)
    | bit(VIRTIO_NET_F_MRG_RXBUF);

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Tap(#[from] super::tap::TapError),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
}

/// Why one chain could not be used (counted as a device error).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum FrameError {
    #[error("{0}")]
    Chain(#[from] QueueError),
    #[error("a transmit descriptor is device-writable")]
    TxDirection,
    #[error("a receive descriptor is device-readable")]
    RxDirection,
    #[error("frame of {0} bytes is shorter than its header or longer than {MAX_FRAME}")]
    Length(usize),
    #[error("buffer outside guest memory")]
    Memory,
}

/// Outcome of placing the pending received frame.
#[derive(Debug, PartialEq, Eq)]
enum Placed {
    Delivered,
    /// The guest has not posted enough buffers: wait for its notification.
    NoRoom,
    /// The frame cannot fit the guest's buffers at all (non-mergeable).
    Dropped,
}

pub struct Net {
    pub(super) tap: Tap,
    pub(super) mac: [u8; 6],
    pub(super) base: VirtioBase,
    /// The tap (edge-triggered) and `kick`; the event loop watches it.
    epoll: Epoll,
    /// Written when a queue stops at [`BUDGET`] with work left.
    kick: EventFd,
    rx_frame: Vec<u8>,
    /// Length of the frame in `rx_frame` not yet given to the guest (0: none).
    rx_len: usize,
    tx_frame: Vec<u8>,
    /// Frames lost on the host side (tap write failed, guest buffer too small).
    pub(super) dropped: u64,
}

/// The TUN_F_* offloads matching the features the guest accepted: what
/// the tap may hand us must be what the guest can take.
pub(crate) fn tap_offload(acked: u64) -> libc::c_uint {
    let mut f = 0;
    if acked & bit(VIRTIO_NET_F_GUEST_CSUM) != 0 {
        f |= libc::TUN_F_CSUM;
        if acked & bit(VIRTIO_NET_F_GUEST_TSO4) != 0 {
            f |= libc::TUN_F_TSO4;
        }
        if acked & bit(VIRTIO_NET_F_GUEST_TSO6) != 0 {
            f |= libc::TUN_F_TSO6;
        }
    }
    f
}

impl Net {
    pub fn new(tap: Tap, mac: [u8; 6]) -> Result<Self, NetError> {
        let epoll = Epoll::new().map_err(|e| NetError::Io("epoll", e))?;
        let kick = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| NetError::Io("eventfd", e))?;
        let add = |fd: RawFd, ev: EventSet, token: u64| {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(ev, token))
                .map_err(|e| NetError::Io("epoll_ctl", e))
        };
        add(
            tap.as_raw_fd(),
            EventSet::IN | EventSet::EDGE_TRIGGERED,
            TOKEN_TAP,
        )?;
        add(kick.as_raw_fd(), EventSet::IN, TOKEN_KICK)?;
        Ok(Self {
            tap,
            mac,
            base: VirtioBase::new(TYPE_NET, FEATURES, &[QUEUE_SIZE, QUEUE_SIZE], mac.to_vec()),
            epoll,
            kick,
            rx_frame: vec![0; MAX_FRAME],
            rx_len: 0,
            tx_frame: vec![0; MAX_FRAME],
            dropped: 0,
        })
    }

    pub fn tap_name(&self) -> &str {
        self.tap.name()
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }

    fn acked(&self) -> u64 {
        self.base.active().map_or(0, |a| a.acked_features)
    }

    /// Tell the tap which offloads the (activated) guest takes.
    pub(super) fn apply_offload(&self) {
        if let Err(e) = self.tap.set_offload(tap_offload(self.acked())) {
            tracing::warn!("virtio-net: {e}; frames go without offloads");
        }
    }

    /// Have the event loop call [`VirtioDevice::process_backend`] again.
    fn wake_later(&self) {
        let _ = self.kick.write(1);
    }

    /// Send what the guest queued for transmission, at most [`BUDGET`]
    /// frames.
    pub(crate) fn process_tx(&mut self) -> Result<(), DeviceError> {
        let mem = self.base.mem()?;
        let mut used = false;
        for n in 0..=BUDGET {
            let q = self.base.queue_mut(TXQ)?;
            let Some(mut chain) = pop_chain(q, &mem)? else {
                break;
            };
            if n == BUDGET {
                q.go_to_previous_position();
                self.wake_later();
                break;
            }
            let head = chain.head_index();
            let gathered = collect_chain(&mut chain)
                .map_err(FrameError::from)
                .and_then(|d| gather(&mem, &d, &mut self.tx_frame));
            match gathered {
                Ok(len) => {
                    let frame = self.tx_frame.get(..len).unwrap_or_default();
                    if let Err(e) = self.tap.write_frame(frame) {
                        self.dropped += 1;
                        tracing::debug!("virtio-net: tap write: {e}");
                    }
                }
                Err(e) => {
                    self.base.errors += 1;
                    crate::guest_warn!("virtio-net: malformed transmit chain: {e}");
                }
            }
            add_used(self.base.queue_mut(TXQ)?, &mem, head, 0)?;
            used = true;
        }
        if used {
            self.base.signal_used_if_needed(TXQ)?;
        }
        Ok(())
    }

    /// Move frames from the tap into the guest's receive buffers, at most
    /// [`BUDGET`] frames.
    pub(crate) fn process_rx(&mut self) -> Result<(), DeviceError> {
        let mem = self.base.mem()?;
        let mut used = false;
        for n in 0..=BUDGET {
            if self.rx_len == 0 {
                if n == BUDGET {
                    self.wake_later();
                    break;
                }
                match self.tap.read_frame(&mut self.rx_frame) {
                    Ok(len) if len > VNET_HDR_LEN => self.rx_len = len,
                    Ok(_) => {
                        self.dropped += 1;
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        return Err(DeviceError::Other(format!("virtio-net: tap read: {e}")));
                    }
                }
            }
            match self.place_frame(&mem)? {
                Placed::Delivered => used = true,
                Placed::Dropped => self.dropped += 1,
                Placed::NoRoom => break,
            }
            self.rx_len = 0;
        }
        if used {
            self.base.signal_used_if_needed(RXQ)?;
        }
        Ok(())
    }

    /// Give the pending frame to the guest: one buffer chain, or with
    /// mergeable buffers as many as it needs (`num_buffers` in its header).
    fn place_frame(&mut self, mem: &GuestMemoryMmap) -> Result<Placed, DeviceError> {
        let mergeable = self.acked() & bit(VIRTIO_NET_F_MRG_RXBUF) != 0;
        let len = self.rx_len;
        let q = self.base.queue_mut(RXQ)?;
        // (head, its writable buffers) of the chains that take the frame,
        // and the heads of malformed chains met on the way.
        let mut chains: Vec<(u16, Vec<Descriptor>)> = Vec::new();
        let mut bad: Vec<u16> = Vec::new();
        let mut room = 0usize;
        while room < len && (mergeable || chains.is_empty()) {
            let Some(mut chain) = pop_chain(q, mem)? else {
                for _ in 0..chains.len() + bad.len() {
                    q.go_to_previous_position();
                }
                return Ok(Placed::NoRoom);
            };
            let head = chain.head_index();
            match collect_chain(&mut chain)
                .map_err(FrameError::from)
                .and_then(|d| rx_buffers(mem, d))
            {
                Ok((descs, r)) => {
                    room = room.saturating_add(r);
                    chains.push((head, descs));
                }
                Err(e) => {
                    crate::guest_warn!("virtio-net: malformed receive chain: {e}");
                    bad.push(head);
                }
            }
        }
        self.base.errors += bad.len() as u64;
        // Malformed chains go back empty, before the frame's buffers, so
        // they are not taken as part of it.
        for head in bad {
            add_used(self.base.queue_mut(RXQ)?, mem, head, 0)?;
        }
        if room < len {
            // Non-mergeable and the guest's buffer is too small: hand the
            // chain back unused.
            for (head, _) in chains {
                add_used(self.base.queue_mut(RXQ)?, mem, head, 0)?;
            }
            return Ok(Placed::Dropped);
        }
        let num_buffers = u16::try_from(chains.len()).unwrap_or(u16::MAX);
        if let Some(nb) = self.rx_frame.get_mut(10..12) {
            nb.copy_from_slice(&num_buffers.to_le_bytes());
        }
        let frame = self.rx_frame.get(..len).unwrap_or_default();
        let mut off = 0usize;
        for (head, descs) in chains {
            let mut written = 0usize;
            for d in descs {
                let Some(part) = frame.get(off..).filter(|p| !p.is_empty()) else {
                    break;
                };
                let n = part.len().min(d.len() as usize);
                let ok = part
                    .get(..n)
                    .is_some_and(|p| mem.write_slice(p, d.addr()).is_ok());
                if !ok {
                    self.base.errors += 1;
                    break;
                }
                off += n;
                written += n;
            }
            add_used(self.base.queue_mut(RXQ)?, mem, head, written as u32)?;
        }
        Ok(Placed::Delivered)
    }

    /// Consume the device's own epoll events (the tap and the kick).
    fn drain_events(&mut self) {
        let mut events = [EpollEvent::default(); 4];
        while let Ok(n) = self.epoll.wait(0, &mut events) {
            if n == 0 {
                break;
            }
            let _ = self.kick.read();
        }
    }

    pub(crate) fn process_all(&mut self) -> Result<(), DeviceError> {
        self.process_tx()?;
        self.process_rx()
    }
}

/// Copy a transmit chain (header and frame, all device-readable) into
/// `buf`; returns the length.
pub(crate) fn gather(
    mem: &GuestMemoryMmap,
    descs: &[Descriptor],
    buf: &mut [u8],
) -> Result<usize, FrameError> {
    let mut len = 0usize;
    for d in descs {
        if d.is_write_only() {
            return Err(FrameError::TxDirection);
        }
        let end = len.saturating_add(d.len() as usize);
        let dst = buf.get_mut(len..end).ok_or(FrameError::Length(end))?;
        mem.read_slice(dst, d.addr())
            .map_err(|_| FrameError::Memory)?;
        len = end;
    }
    if len <= VNET_HDR_LEN {
        return Err(FrameError::Length(len));
    }
    Ok(len)
}

/// The writable buffers of a receive chain (all inside guest memory) and
/// how many bytes they hold.
fn rx_buffers(
    mem: &GuestMemoryMmap,
    descs: Vec<Descriptor>,
) -> Result<(Vec<Descriptor>, usize), FrameError> {
    let mut room = 0usize;
    for d in &descs {
        if !d.is_write_only() {
            return Err(FrameError::RxDirection);
        }
        if !GuestMemoryBackend::check_range(mem, d.addr(), d.len() as usize) {
            return Err(FrameError::Memory);
        }
        room = room.saturating_add(d.len() as usize);
    }
    Ok((descs, room))
}

impl VirtioDevice for Net {
    delegate_base!(base);

    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
        match index {
            // New receive buffers: frames waiting for room can go now.
            RXQ => self.process_rx(),
            TXQ => self.process_tx(),
            _ => Err(DeviceError::NoSuchQueue(index)),
        }
    }

    fn activate(&mut self, active: Active) -> Result<(), ActivateError> {
        self.base.activate(active)?;
        self.apply_offload();
        // Frames queued on the tap before now raised no new edge.
        self.wake_later();
        Ok(())
    }

    fn reset(&mut self) {
        self.base.reset();
        self.rx_len = 0;
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.epoll.as_raw_fd())
    }

    fn process_backend(&mut self) -> Result<(), DeviceError> {
        self.drain_events();
        if !self.is_activated() {
            // Nobody to give frames to: drop them so the tap does not
            // hold stale traffic (the kernel queue is bounded anyway).
            while self.tap.read_frame(&mut self.rx_frame).is_ok() {
                self.dropped += 1;
            }
            return Ok(());
        }
        self.process_all()
    }

    fn save_device_state(&self) -> crate::devices::virtio::persist::DeviceState {
        self.device_state()
    }

    /// Notifications the guest sent the old VMM are lost: serve both
    /// queues now.
    fn on_restored(&mut self) -> Result<(), DeviceError> {
        if self.is_activated() {
            self.apply_offload();
            self.process_all()?;
        }
        Ok(())
    }
}
