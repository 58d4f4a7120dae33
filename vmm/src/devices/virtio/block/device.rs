use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::path::{Path, PathBuf};

use vm_memory::{Bytes, GuestAddress};

use crate::devices::virtio::queue::{add_used, collect_chain, pop_chain, QueueError};
use crate::devices::virtio::{
    delegate_base, DeviceError, VirtioBase, VirtioDevice, TYPE_BLOCK, VIRTIO_F_VERSION_1,
};
use crate::GuestMemoryMmap;

pub const SECTOR_SIZE: u64 = 512;
pub(crate) const QUEUE_SIZE: u16 = 256;
const VIRTIO_BLK_F_RO: u64 = 1 << 5;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << 9;
pub(crate) const VIRTIO_BLK_T_IN: u32 = 0;
pub(crate) const VIRTIO_BLK_T_OUT: u32 = 1;
pub(crate) const VIRTIO_BLK_T_FLUSH: u32 = 4;
pub(crate) const VIRTIO_BLK_T_GET_ID: u32 = 8;
pub(crate) const VIRTIO_BLK_S_OK: u8 = 0;
pub(crate) const VIRTIO_BLK_S_IOERR: u8 = 1;
pub(crate) const VIRTIO_BLK_S_UNSUPP: u8 = 2;
const VIRTIO_BLK_ID_BYTES: usize = 20;
/// Largest data transfer in one request (bounds what a guest can ask for).
const MAX_REQUEST_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    #[error("cannot open disk image {path}: {source}")]
    Open {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("disk image {0} size is not a multiple of 512 bytes")]
    Size(String),
}

/// Why a single request could not be served (counted as a device error).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RequestError {
    #[error("{0}")]
    Chain(#[from] QueueError),
    #[error("request header descriptor is missing, write-only or too short")]
    BadHeader,
    #[error("status descriptor is missing, read-only or empty")]
    BadStatus,
    #[error("data descriptor has the wrong direction")]
    DataDirection,
    #[error("data length {0} is not a multiple of the sector size or too large")]
    DataLength(u64),
    #[error("guest memory access out of range")]
    Memory,
}

/// A parsed request: header, data buffers, status byte address.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub kind: u32,
    pub sector: u64,
    pub data: Vec<(GuestAddress, u32)>,
    pub data_len: u64,
    pub status: GuestAddress,
}

/// Size in bytes of a disk: an image file or a block device (whose
/// metadata length is 0, so it is measured by seeking to its end).
pub fn disk_bytes(disk: &File) -> std::io::Result<u64> {
    let mut disk = disk;
    let len = disk.seek(SeekFrom::End(0))?;
    disk.seek(SeekFrom::Start(0))?;
    Ok(len)
}

pub struct Block {
    /// The backing file (empty: an empty slot).
    pub(super) path: PathBuf,
    /// `None`: an empty slot (capacity 0).
    pub(super) disk: Option<File>,
    pub(super) read_only: bool,
    /// `Some(n)`: slot `n`, whose backing file is attached and detached
    /// while the VM runs (see `slot.rs`).
    pub(super) slot: Option<u32>,
    pub(super) capacity: u64,
    pub(super) id: [u8; VIRTIO_BLK_ID_BYTES],
    pub(super) base: VirtioBase,
}

impl Block {
    /// Open a raw image. Its size must be a whole number of sectors.
    pub fn open(path: &Path, read_only: bool) -> Result<Self, BlockError> {
        let (disk, capacity) = open_disk(path, read_only)?;
        let mut features = VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH;
        if read_only {
            features |= VIRTIO_BLK_F_RO;
        }
        // Config space: the capacity in sectors.
        let config = capacity.to_le_bytes().to_vec();
        Ok(Self {
            path: path.to_path_buf(),
            disk: Some(disk),
            read_only,
            slot: None,
            capacity,
            id: device_id(b"burrow-blk"),
            base: VirtioBase::new(TYPE_BLOCK, features, &[QUEUE_SIZE], config),
        })
    }

    /// Empty slot `n`: no backing file, capacity 0, read-write offered
    /// (a read-only attachment is enforced per request). Its serial is
    /// `burrow-slot-<n>`.
    pub fn slot(n: u32) -> Self {
        let features = VIRTIO_F_VERSION_1 | VIRTIO_BLK_F_FLUSH;
        Self {
            path: PathBuf::new(),
            disk: None,
            read_only: false,
            slot: Some(n),
            capacity: 0,
            id: device_id(format!("burrow-slot-{n}").as_bytes()),
            base: VirtioBase::new(
                TYPE_BLOCK,
                features,
                &[QUEUE_SIZE],
                0u64.to_le_bytes().to_vec(),
            ),
        }
    }

    /// Capacity in 512-byte sectors.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn read_only(&self) -> bool {
        self.read_only
    }

    /// Process every available request on the request queue.
    pub(crate) fn process_requests(&mut self) -> Result<(), DeviceError> {
        let mem = self.base.mem()?;
        let mut used_any = false;
        loop {
            let queue = self.base.queue_mut(0)?;
            let Some(mut chain) = pop_chain(queue, &mem)? else {
                break;
            };
            let head = chain.head_index();
            let len = match collect_chain(&mut chain)
                .map_err(RequestError::from)
                .and_then(|d| parse_request(&mem, &d))
            {
                Ok(req) => self.execute(&mem, &req),
                Err(e) => {
                    self.base.errors += 1;
                    crate::guest_warn!("virtio-blk: malformed request: {e}");
                    0
                }
            };
            add_used(self.base.queue_mut(0)?, &mem, head, len)?;
            used_any = true;
        }
        if used_any {
            self.base.signal_used_if_needed(0)?;
        }
        Ok(())
    }

    /// Run a request; returns the number of bytes written to guest memory.
    fn execute(&mut self, mem: &GuestMemoryMmap, req: &Request) -> u32 {
        let (status, written) = match self.do_io(mem, req) {
            Ok(n) => (VIRTIO_BLK_S_OK, n),
            Err(s) => (s, 0),
        };
        if mem.write_obj(status, req.status).is_err() {
            self.base.errors += 1;
            return 0;
        }
        written.saturating_add(1)
    }

    fn do_io(&mut self, mem: &GuestMemoryMmap, req: &Request) -> Result<u32, u8> {
        match req.kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                if !req.data_len.is_multiple_of(SECTOR_SIZE) {
                    self.base.errors += 1;
                    return Err(VIRTIO_BLK_S_IOERR);
                }
                let end = req
                    .sector
                    .checked_add(req.data_len / SECTOR_SIZE)
                    .filter(|&e| e <= self.capacity);
                if end.is_none() {
                    tracing::debug!("virtio-blk: request past end of disk");
                    return Err(VIRTIO_BLK_S_IOERR);
                }
                if req.kind == VIRTIO_BLK_T_OUT && self.read_only {
                    return Err(VIRTIO_BLK_S_IOERR);
                }
                let offset = req.sector * SECTOR_SIZE;
                let disk = self.disk.as_mut().ok_or(VIRTIO_BLK_S_IOERR)?;
                disk.seek(SeekFrom::Start(offset))
                    .map_err(|_| VIRTIO_BLK_S_IOERR)?;
                for &(addr, len) in &req.data {
                    let r = if req.kind == VIRTIO_BLK_T_IN {
                        mem.read_exact_volatile_from(addr, disk, len as usize)
                    } else {
                        mem.write_all_volatile_to(addr, disk, len as usize)
                    };
                    if let Err(e) = r {
                        tracing::warn!("virtio-blk: I/O error: {e}");
                        return Err(VIRTIO_BLK_S_IOERR);
                    }
                }
                Ok(if req.kind == VIRTIO_BLK_T_IN {
                    req.data_len as u32
                } else {
                    0
                })
            }
            VIRTIO_BLK_T_FLUSH => {
                if let Some(disk) = self.disk.as_ref().filter(|_| !self.read_only) {
                    disk.sync_data().map_err(|_| VIRTIO_BLK_S_IOERR)?;
                }
                Ok(0)
            }
            VIRTIO_BLK_T_GET_ID => {
                let Some(&(addr, len)) = req.data.first() else {
                    return Err(VIRTIO_BLK_S_IOERR);
                };
                let n = (len as usize).min(VIRTIO_BLK_ID_BYTES);
                let id = self.id.get(..n).ok_or(VIRTIO_BLK_S_IOERR)?;
                mem.write_slice(id, addr).map_err(|_| VIRTIO_BLK_S_IOERR)?;
                Ok(n as u32)
            }
            _ => Err(VIRTIO_BLK_S_UNSUPP),
        }
    }
}

/// Open `path` (read-only or read-write) and measure it in sectors.
pub(super) fn open_disk(path: &Path, read_only: bool) -> Result<(File, u64), BlockError> {
    let open_err = |source| BlockError::Open {
        path: path.display().to_string(),
        source,
    };
    let disk = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(path)
        .map_err(open_err)?;
    sized_disk(disk, path)
}

/// An already-open disk (passed to a jailed VMM) and its size in sectors;
/// `path` names it in errors and the snapshot.
pub(super) fn sized_disk(disk: File, path: &Path) -> Result<(File, u64), BlockError> {
    let len = disk_bytes(&disk).map_err(|source| BlockError::Open {
        path: path.display().to_string(),
        source,
    })?;
    if len % SECTOR_SIZE != 0 {
        return Err(BlockError::Size(path.display().to_string()));
    }
    Ok((disk, len / SECTOR_SIZE))
}

/// A serial number (`VIRTIO_BLK_T_GET_ID`): `name`, cut to 20 bytes.
fn device_id(name: &[u8]) -> [u8; VIRTIO_BLK_ID_BYTES] {
    let mut id = [0u8; VIRTIO_BLK_ID_BYTES];
    for (d, s) in id.iter_mut().zip(name) {
        *d = *s;
    }
    id
}

/// Parse a request chain: readable header (16 bytes), data descriptors, and
/// a writable status byte last. Addresses are checked by every memory
/// access; lengths and directions are checked here.
pub(crate) fn parse_request(
    mem: &GuestMemoryMmap,
    descs: &[virtio_queue::desc::split::Descriptor],
) -> Result<Request, RequestError> {
    let (first, rest) = descs.split_first().ok_or(RequestError::BadHeader)?;
    if first.is_write_only() || first.len() < 16 {
        return Err(RequestError::BadHeader);
    }
    let header: [u8; 16] = mem
        .read_obj(first.addr())
        .map_err(|_| RequestError::Memory)?;
    let mut kind = [0u8; 4];
    kind.copy_from_slice(&header[0..4]);
    let mut sector = [0u8; 8];
    sector.copy_from_slice(&header[8..16]);
    let kind = u32::from_le_bytes(kind);
    let sector = u64::from_le_bytes(sector);
    let (last, data) = rest.split_last().ok_or(RequestError::BadStatus)?;
    if !last.is_write_only() || last.len() < 1 {
        return Err(RequestError::BadStatus);
    }
    let device_writes = matches!(kind, VIRTIO_BLK_T_IN | VIRTIO_BLK_T_GET_ID);
    let mut data_len: u64 = 0;
    for d in data {
        if matches!(
            kind,
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT | VIRTIO_BLK_T_GET_ID
        ) && d.is_write_only() != device_writes
        {
            return Err(RequestError::DataDirection);
        }
        data_len += u64::from(d.len());
        if data_len > MAX_REQUEST_BYTES {
            return Err(RequestError::DataLength(data_len));
        }
    }
    Ok(Request {
        kind,
        sector,
        data: data.iter().map(|d| (d.addr(), d.len())).collect(),
        data_len,
        status: last.addr(),
    })
}

impl VirtioDevice for Block {
    delegate_base!(base);

    fn as_block_mut(&mut self) -> Option<&mut Block> {
        Some(self)
    }

    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
        if index != 0 {
            return Err(DeviceError::NoSuchQueue(index));
        }
        self.process_requests()
    }

    fn save_device_state(&self) -> crate::devices::virtio::persist::DeviceState {
        self.device_state()
    }

    /// A request the guest posted just before the snapshot may have had its
    /// notification (an ioeventfd the old VMM never read) lost: serve what
    /// is in the queue now.
    fn on_restored(&mut self) -> Result<(), DeviceError> {
        if self.is_activated() {
            self.process_requests()?;
        }
        Ok(())
    }
}
