use std::os::fd::RawFd;
use std::path::Path;

use virtio_queue::QueueOwnedT;
use virtio_vsock::packet::VsockPacket;
use vm_memory::Bytes;

use super::muxer::Muxer;
use super::packet::{Header, HEADER_SIZE};
use crate::devices::virtio::queue::{add_used, pop_chain};
use crate::devices::virtio::{
    delegate_base, DeviceError, VirtioBase, VirtioDevice, TYPE_VSOCK, VIRTIO_F_VERSION_1,
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
    pub(super) base: VirtioBase,
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
            // Config space: the guest's CID.
            base: VirtioBase::new(
                TYPE_VSOCK,
                VIRTIO_F_VERSION_1,
                &[QUEUE_SIZE, QUEUE_SIZE, QUEUE_SIZE],
                cid.to_le_bytes().to_vec(),
            ),
            rx_buf: vec![0u8; MAX_PKT_DATA as usize],
        })
    }

    pub fn cid(&self) -> u64 {
        self.cid
    }

    pub fn uds_path(&self) -> &Path {
        self.muxer.uds_path()
    }

    /// Take every packet the guest queued for the host.
    pub(crate) fn process_tx(&mut self) -> Result<bool, DeviceError> {
        let mem = self.base.mem()?;
        let mut used = false;
        let mut data = Vec::new();
        loop {
            let q = self.base.queue_mut(TXQ)?;
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
                None => self.base.errors += 1,
            }
            add_used(self.base.queue_mut(TXQ)?, &mem, head, 0)?;
            used = true;
        }
        Ok(used)
    }

    /// Fill the guest's RX buffers with what the host side has for it.
    pub(crate) fn process_rx(&mut self) -> Result<bool, DeviceError> {
        let mem = self.base.mem()?;
        let mut used = false;
        while self.muxer.has_rx() {
            let q = self.base.queue_mut(RXQ)?;
            let Some(mut chain) = pop_chain(q, &mem)? else {
                break;
            };
            let head = chain.head_index();
            let mut pkt = match VsockPacket::from_rx_virtq_chain(&mem, &mut chain, MAX_PKT_DATA) {
                Ok(p) => p,
                Err(e) => {
                    tracing::debug!("vsock: malformed RX chain: {e}");
                    add_used(q, &mem, head, 0)?;
                    self.base.errors += 1;
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
            let len = if ok { (HEADER_SIZE + n) as u32 } else { 0 };
            add_used(q, &mem, head, len)?;
            if !ok {
                self.base.errors += 1;
            }
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
            self.base.signal_used()?;
        }
        Ok(())
    }
}

impl VirtioDevice for Vsock {
    delegate_base!(base);

    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
        match index {
            RXQ => self.process_all(false),
            TXQ => self.process_all(true),
            EVQ => Ok(()),
            _ => Err(DeviceError::NoSuchQueue(index)),
        }
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
        self.base.errors + self.muxer.errors
    }

    fn save_device_state(&self) -> crate::devices::virtio::persist::DeviceState {
        self.device_state()
    }

    fn on_restored(&mut self) -> Result<(), DeviceError> {
        self.after_restore()
    }
}
