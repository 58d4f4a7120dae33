use std::os::fd::RawFd;
use std::path::Path;

use virtio_queue::{Queue, QueueOwnedT};
use virtio_vsock::packet::VsockPacket;
use crate::GuestMemoryMmap;
use vm_memory::Bytes;

use super::muxer::Muxer;
use super::packet::{Header, HEADER_SIZE};
use crate::devices::virtio::queue::{add_used, pop_chain};
use crate::devices::virtio::{
    read_config_bytes, ActivateError, DeviceError, IrqTrigger, VirtioDevice, TYPE_VSOCK,
    VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_VRING,
};

/// The host's CID, as the guest sees it.
pub const HOST_CID: u64 = 2;
const QUEUE_SIZE: u16 = 256;
pub(crate) const RXQ: usize = 0;
pub(crate) const TXQ: usize = 1;
pub(crate) const EVQ: usize = 2;
/// Largest payload in one packet either way.
pub(crate) const MAX_PKT_DATA: u32 = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("guest CID {0} is reserved (use 3 or more)")]
    BadCid(u64),
    #[error("cannot listen on vsock socket {path}: {source}")]
    Listen {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

pub struct Vsock {
    pub(super) cid: u64,
    pub(crate) muxer: Muxer,
    pub(super) mem: Option<GuestMemoryMmap>,
    pub(super) queues: Vec<Queue>,
    pub(super) irq: Option<IrqTrigger>,
    pub(super) errors: u64,
    pub(super) rx_buf: Vec<u8>,
}

impl Vsock {
    /// A vsock device for guest `cid` whose host side listens on `uds_path`.
    pub fn new(cid: u64, uds_path: &Path) -> Result<Self, VsockError> {
        if cid < 3 || cid > u64::from(u32::MAX) {
            return Err(VsockError::BadCid(cid));
        }
        let muxer = Muxer::new(cid, uds_path).map_err(|source| VsockError::Listen {
            path: uds_path.display().to_string(),
            source,
        })?;
        Ok(Self {
            cid,
            muxer,
            mem: None,
            queues: Vec::new(),
            irq: None,
            errors: 0,
            rx_buf: vec![0u8; MAX_PKT_DATA as usize],
        })
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }

    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    fn signal(&self) -> Result<(), DeviceError> {
        match &self.irq {
            Some(irq) => irq.trigger(VIRTIO_MMIO_INT_VRING),
            None => Ok(()),
        }
    }

    /// Take every packet the guest queued for the host.
    pub(crate) fn process_tx(&mut self) -> Result<bool, DeviceError> {
        let mem = self.mem.clone().ok_or(DeviceError::NotActivated)?;
        let mut used = false;
        let mut data = Vec::new();
        loop {
            let q = self.queues.get_mut(TXQ).ok_or(DeviceError::NoSuchQueue(TXQ))?;
            let Some(mut chain) = pop_chain(q, &mem)? else {
                break;
            };
            let head = chain.head_index();
            data.clear();
            let parsed = match VsockPacket::from_tx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(pkt) => {
                    let mut raw = [0u8; HEADER_SIZE];
                    let hdr_ok = pkt.header_slice().read_slice(&mut raw, 0).is_ok();
                    let hdr = Header::from_bytes(&raw);
                    let ok = match pkt.data_slice() {
                        Some(s) if hdr.len > 0 => {
                            let n = (hdr.len as usize).min(s.len());
                            data.resize(n, 0);
                            s.read_slice(&mut data, 0).is_ok()
                        }
                        _ => true,
                    };
                    (hdr_ok && ok).then_some(hdr)
                }
                Err(e) => {
                    tracing::debug!("vsock: malformed TX chain: {e}");
                    None
                }
            };
            match parsed {
                Some(hdr) => self.muxer.handle_tx(&hdr, &data),
                None => self.errors += 1,
            }
            let q = self.queues.get_mut(TXQ).ok_or(DeviceError::NoSuchQueue(TXQ))?;
            add_used(q, &mem, head, 0)?;
            used = true;
        }
        Ok(used)
    }

    /// Fill the guest's RX buffers with what the host side has for it.
    pub(crate) fn process_rx(&mut self) -> Result<bool, DeviceError> {
        let mem = self.mem.clone().ok_or(DeviceError::NotActivated)?;
        let mut used = false;
        while self.muxer.has_rx() {
            let q = self.queues.get_mut(RXQ).ok_or(DeviceError::NoSuchQueue(RXQ))?;
            let Some(mut chain) = pop_chain(q, &mem)? else {
                break;
            };
            let head = chain.head_index();
            let mut pkt = match VsockPacket::from_rx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!("vsock: malformed RX chain: {e}");
                    self.errors += 1;
                    add_used(q, &mem, head, 0)?;
                    used = true;
                    continue;
                }
            };
            let cap = pkt
                .data_slice()
                .map_or(0, |s| s.len())
                .min(self.rx_buf.len());
            let buf = self.rx_buf.get_mut(..cap).unwrap_or_default();
            let Some((hdr, n)) = self.muxer.next_rx(buf) else {
                // Nothing could be read after all: give the buffer back.
                q.go_to_previous_position();
                break;
            };
            let mut ok = pkt.set_header_from_raw(&hdr.to_bytes()).is_ok();
            if n > 0 {
                ok &= match (pkt.data_slice(), self.rx_buf.get(..n)) {
                    (Some(s), Some(d)) => s.write_slice(d, 0).is_ok(),
                    _ => false,
                };
            }
            if !ok {
                self.errors += 1;
            }
            let len = if ok { (HEADER_SIZE + n) as u32 } else { 0 };
            add_used(q, &mem, head, len)?;
            used = true;
        }
        Ok(used)
    }

    fn process_all(&mut self, tx: bool) -> Result<(), DeviceError> {
        let mut used = false;
        if tx {
            used |= self.process_tx()?;
        }
        used |= self.process_rx()?;
        if used {
            self.signal()?;
        }
        Ok(())
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        TYPE_VSOCK
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&self.cid.to_le_bytes(), offset, data)
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        irq: IrqTrigger,
        _acked_features: u64,
    ) -> Result<(), ActivateError> {
        if queues.len() != 3 {
            return Err(ActivateError::QueueCount {
                expected: 3,
                got: queues.len(),
            });
        }
        self.mem = Some(mem);
        self.queues = queues;
        self.irq = Some(irq);
        Ok(())
    }

    fn is_activated(&self) -> bool {
        self.mem.is_some()
    }

    fn save_device_state(&self) -> crate::devices::virtio::persist::DeviceState {
        self.device_state()
    }

    fn on_restored(&mut self) -> Result<(), DeviceError> {
        self.after_restore()
    }

    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
        match index {
            RXQ => self.process_all(false),
            TXQ => self.process_all(true),
            EVQ => Ok(()),
            _ => Err(DeviceError::NoSuchQueue(index)),
        }
    }

    fn reset(&mut self) {
        self.mem = None;
        self.queues.clear();
        self.irq = None;
    }

    fn backend_fd(&self) -> Option<RawFd> {
        Some(self.muxer.epoll_fd())
    }

    fn process_backend(&mut self) -> Result<(), DeviceError> {
        self.muxer
            .handle_events()
            .map_err(|e| DeviceError::Other(format!("vsock backend: {e}")))?;
        if self.is_activated() {
            self.process_all(false)?;
        }
        Ok(())
    }

    fn error_count(&self) -> u64 {
        self.errors + self.muxer.errors
    }
}
