use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use crate::devices::virtio::queue::{add_used, collect_chain, pop_chain, QueueError};
use crate::devices::virtio::{
    delegate_base, DeviceError, VirtioBase, VirtioDevice, TYPE_MEM, VIRTIO_F_VERSION_1,
};
use crate::GuestMemoryMmap;

/// Plug granularity (Linux's default on x86_64 is the THP size).
pub const BLOCK_SIZE: u64 = 2 << 20;
/// The region's alignment and size granularity: Linux's x86_64 memory
/// block size (the driver adds memory in whole memory blocks).
pub const REGION_ALIGN: u64 = 128 << 20;
/// Largest region (1 TiB, the largest `--mem` too).
pub const MAX_REGION: u64 = 1 << 40;
pub(crate) const QUEUE_SIZE: u16 = 128;
pub(crate) const CONFIG_SIZE: usize = 56;

pub(crate) const REQ_PLUG: u16 = 0;
pub(crate) const REQ_UNPLUG: u16 = 1;
pub(crate) const REQ_UNPLUG_ALL: u16 = 2;
pub(crate) const REQ_STATE: u16 = 3;
pub(crate) const RESP_ACK: u16 = 0;
pub(crate) const RESP_NACK: u16 = 1;
#[allow(dead_code)]
pub(crate) const RESP_BUSY: u16 = 2;
pub(crate) const RESP_ERROR: u16 = 3;
pub(crate) const STATE_PLUGGED: u16 = 0;
pub(crate) const STATE_UNPLUGGED: u16 = 1;
pub(crate) const STATE_MIXED: u16 = 2;
/// `struct virtio_mem_req` and `struct virtio_mem_resp`.
pub(crate) const REQ_SIZE: u32 = 24;
pub(crate) const RESP_SIZE: u32 = 10;

const PAGE_SIZE_NZ: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(4096) {
    Some(n) => n,
    None => panic!("page size is not zero"),
};

#[derive(Debug, thiserror::Error)]
pub enum MemError {
    #[error("invalid virtio-mem region: {0}")]
    Region(String),
    #[error("requested size {requested} bytes is not a multiple of {BLOCK_SIZE} or exceeds the region's {region} bytes")]
    Requested { requested: u64, region: u64 },
    #[error("cannot map the hotplug region: {0}")]
    Map(String),
    #[error("the hotplug region is not part of guest memory")]
    NotInMemory,
    #[error("changing the protection of hotplug memory: {0}")]
    Protect(#[source] std::io::Error),
    #[error("telling the guest: {0}")]
    Notify(#[from] DeviceError),
}

/// The hotplug region for a VM whose RAM ends (exclusive) at `ram_end`
/// and that may grow by `extra` bytes: the first [`REGION_ALIGN`]-aligned
/// address at or above both `ram_end` and 4 GiB (above the 32-bit MMIO
/// gap), and `extra` rounded up to [`REGION_ALIGN`]. `None` for no growth.
pub fn region_for(ram_end: u64, extra: u64) -> Option<(u64, u64)> {
    if extra == 0 {
        return None;
    }
    let start = ram_end
        .max(crate::x86_64::layout::MMIO_GAP_END)
        .checked_next_multiple_of(REGION_ALIGN)?;
    let size = extra.checked_next_multiple_of(REGION_ALIGN)?;
    start.checked_add(size)?;
    Some((start, size))
}

/// The hotplug region of a VM with `mem_mib` of RAM that may grow to
/// `mem_max_mib` (`None`: no `--mem-max`, or equal to `--mem`).
pub fn vm_region(mem_mib: u64, mem_max_mib: Option<u64>) -> Result<Option<(u64, u64)>, MemError> {
    let Some(max) = mem_max_mib else {
        return Ok(None);
    };
    if max < mem_mib || max > 1 << 20 {
        return Err(MemError::Region(format!(
            "--mem-max must be at least --mem ({mem_mib} MiB) and at most 1 TiB, got {max} MiB"
        )));
    }
    let ram_end = crate::x86_64::e820::ram_end(mem_mib << 20);
    Ok(region_for(ram_end, (max - mem_mib) << 20))
}

/// Map `size` bytes of host memory for the region at guest address
/// `addr`: private, anonymous, no swap reserved, and `PROT_NONE` until
/// blocks are plugged.
pub fn hotplug_mapping(addr: u64, size: u64) -> Result<GuestRegionMmap<AtomicBitmap>, MemError> {
    let len = usize::try_from(size).map_err(|_| MemError::Map("region too large".into()))?;
    let mapping = MmapRegionBuilder::new_with_bitmap(len, AtomicBitmap::new(len, PAGE_SIZE_NZ))
        .with_mmap_prot(libc::PROT_NONE)
        .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE)
        .build()
        .map_err(|e| MemError::Map(e.to_string()))?;
    GuestRegionMmap::new(mapping, GuestAddress(addr))
        .ok_or_else(|| MemError::Map("region wraps the address space".into()))
}

/// Check a region (from the command line or a snapshot).
pub(crate) fn check_region(addr: u64, size: u64) -> Result<(), MemError> {
    let bad = |m: String| Err(MemError::Region(m));
    if size == 0 || size > MAX_REGION || !size.is_multiple_of(REGION_ALIGN) {
        return bad(format!("size {size:#x} is not a non-zero multiple of {REGION_ALIGN:#x} up to {MAX_REGION:#x}"));
    }
    if !addr.is_multiple_of(REGION_ALIGN) || addr < crate::x86_64::layout::MMIO_GAP_END {
        return bad(format!("address {addr:#x} is not {REGION_ALIGN:#x}-aligned above 4 GiB"));
    }
    if addr.checked_add(size).is_none_or(|e| e > 1 << 52) {
        return bad(format!("region {addr:#x}+{size:#x} ends past the guest's physical address space"));
    }
    Ok(())
}

/// One parsed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Request {
    pub kind: u16,
    pub addr: u64,
    pub nb_blocks: u16,
}

/// Why a chain was malformed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum RequestError {
    #[error("{0}")]
    Chain(#[from] QueueError),
    #[error("request descriptor is missing, write-only or shorter than 24 bytes")]
    BadRequest,
    #[error("response descriptor is missing, read-only or shorter than 10 bytes")]
    BadResponse,
    #[error("guest memory access out of range")]
    Memory,
}

/// The virtio-mem device: the region's layout, the plugged blocks and the
/// size the host asks the guest to plug.
pub struct Mem {
    pub(super) addr: u64,
    pub(super) region_size: u64,
    /// Bit `i`: block `i` (at `addr + i * BLOCK_SIZE`) is plugged.
    pub(super) bitmap: Vec<u64>,
    pub(super) plugged_size: u64,
    pub(super) requested_size: u64,
    /// Guest memory holding the region (its host mapping is what plugging
    /// protects and unprotects); `None` in tests of the request logic only.
    pub(super) host: Option<GuestMemoryMmap>,
    pub(super) base: VirtioBase,
}

impl Mem {
    /// A device for the region `addr`..`addr + region_size`, nothing
    /// plugged or requested. `host` is the guest memory the region is a
    /// region of (its mapping must be all `PROT_NONE`, as
    /// [`hotplug_mapping`] makes it).
    pub fn new(addr: u64, region_size: u64, host: Option<GuestMemoryMmap>) -> Result<Self, MemError> {
        check_region(addr, region_size)?;
        if let Some(m) = &host {
            let inside = m
                .find_region(GuestAddress(addr))
                .is_some_and(|r| r.start_addr().0 == addr && r.len() == region_size);
            if !inside {
                return Err(MemError::NotInMemory);
            }
        }
        let blocks = region_size / BLOCK_SIZE;
        let words = usize::try_from(blocks.div_ceil(64)).map_err(|_| MemError::Region("too many blocks".into()))?;
        let mut m = Self {
            addr,
            region_size,
            bitmap: vec![0; words],
            plugged_size: 0,
            requested_size: 0,
            host,
            base: VirtioBase::new(TYPE_MEM, VIRTIO_F_VERSION_1, &[QUEUE_SIZE], Vec::new()),
        };
        m.base.update_config(m.config());
        Ok(m)
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }
    pub fn region_size(&self) -> u64 {
        self.region_size
    }
    pub fn plugged_size(&self) -> u64 {
        self.plugged_size
    }
    pub fn requested_size(&self) -> u64 {
        self.requested_size
    }
    /// Bit `i` of word `i / 64`: block `i` is plugged.
    pub fn bitmap(&self) -> &[u64] {
        &self.bitmap
    }

    /// End the VM, with a message, if device emulation touches an
    /// unplugged block of this region (see [`super::guard`]).
    pub fn guard_region(&self) -> Result<(), MemError> {
        let Some(mem) = &self.host else {
            return Ok(());
        };
        let (p, n) = host_range(mem, self.addr, self.region_size)?;
        super::guard::install(p.cast(), n).map_err(MemError::Protect)
    }

    fn blocks(&self) -> u64 {
        self.region_size / BLOCK_SIZE
    }

    /// The config space: block_size, node_id, padding, addr, region_size,
    /// usable_region_size, plugged_size, requested_size (little endian).
    pub(crate) fn config(&self) -> Vec<u8> {
        let mut c = Vec::with_capacity(CONFIG_SIZE);
        c.extend_from_slice(&BLOCK_SIZE.to_le_bytes());
        c.extend_from_slice(&[0u8; 8]); // node_id (u16) and 6 bytes of padding
        c.extend_from_slice(&self.addr.to_le_bytes());
        c.extend_from_slice(&self.region_size.to_le_bytes());
        c.extend_from_slice(&self.region_size.to_le_bytes()); // all of it is usable
        c.extend_from_slice(&self.plugged_size.to_le_bytes());
        c.extend_from_slice(&self.requested_size.to_le_bytes());
        c
    }

    /// Ask the guest to plug (or unplug down to) `bytes`; it is told with
    /// the config-change interrupt and plugs asynchronously.
    pub fn set_requested_size(&mut self, bytes: u64) -> Result<(), MemError> {
        if !bytes.is_multiple_of(BLOCK_SIZE) || bytes > self.region_size {
            return Err(MemError::Requested { requested: bytes, region: self.region_size });
        }
        self.requested_size = bytes;
        let config = self.config();
        self.base.set_config(config)?;
        Ok(())
    }

    pub(crate) fn is_plugged(&self, block: u64) -> bool {
        usize::try_from(block / 64)
            .ok()
            .and_then(|w| self.bitmap.get(w))
            .is_some_and(|w| w & (1 << (block % 64)) != 0)
    }

    fn set_bits(&mut self, first: u64, count: u64, plugged: bool) {
        for b in first..first.saturating_add(count) {
            if let Some(w) = usize::try_from(b / 64).ok().and_then(|w| self.bitmap.get_mut(w)) {
                if plugged {
                    *w |= 1 << (b % 64);
                } else {
                    *w &= !(1 << (b % 64));
                }
            }
        }
    }

    /// The plugged parts of the region as guest `(addr, len)` ranges,
    /// adjacent blocks merged, in order.
    pub fn plugged_ranges(&self) -> Vec<(u64, u64)> {
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in (0..self.blocks()).filter(|&b| self.is_plugged(b)) {
            let a = self.addr + b * BLOCK_SIZE;
            match out.last_mut() {
                Some((s, l)) if *s + *l == a => *l += BLOCK_SIZE,
                _ => out.push((a, BLOCK_SIZE)),
            }
        }
        out
    }

    /// The block range a request names, if it is valid: non-empty, block
    /// aligned, inside the usable region, no overflow.
    fn block_range(&self, addr: u64, nb_blocks: u16) -> Option<(u64, u64)> {
        if nb_blocks == 0 {
            return None;
        }
        let size = u64::from(nb_blocks).checked_mul(BLOCK_SIZE)?;
        let off = addr.checked_sub(self.addr)?;
        if !off.is_multiple_of(BLOCK_SIZE) || off.checked_add(size)? > self.region_size {
            return None;
        }
        Some((off / BLOCK_SIZE, u64::from(nb_blocks)))
    }

    /// (all plugged, all unplugged) of a block range.
    fn range_state(&self, first: u64, count: u64) -> (bool, bool) {
        let mut all_plugged = true;
        let mut all_unplugged = true;
        for b in first..first.saturating_add(count) {
            if self.is_plugged(b) {
                all_unplugged = false;
            } else {
                all_plugged = false;
            }
        }
        (all_plugged, all_unplugged)
    }

    /// Make blocks accessible (plug) or discard and protect them (unplug)
    /// on the host side.
    fn protect(&self, first: u64, count: u64, plugged: bool) -> Result<(), MemError> {
        let Some(mem) = &self.host else {
            return Ok(());
        };
        set_protection(mem, self.addr + first * BLOCK_SIZE, count * BLOCK_SIZE, plugged)
    }

    /// Mark freshly plugged blocks as written by the VMM (the region's
    /// dirty bitmap), so an incremental snapshot records their new (zero)
    /// contents over what a base snapshot had there before an unplug.
    fn mark_dirty(&self, first: u64, count: u64) {
        let Some(mem) = &self.host else {
            return;
        };
        if let Some(r) = mem.find_region(GuestAddress(self.addr)) {
            let mapping: &vm_memory::mmap::MmapRegion<AtomicBitmap> = r;
            if let (Ok(off), Ok(len)) = (usize::try_from(first * BLOCK_SIZE), usize::try_from(count * BLOCK_SIZE)) {
                mapping.bitmap().set_addr_range(off, len);
            }
        }
    }

    /// Re-apply the bitmap to the host mapping: plugged blocks read-write,
    /// the others discarded and `PROT_NONE` (after a restore, whose
    /// mapping of the memory file is all read-write).
    pub(crate) fn apply_protection(&self) -> Result<(), MemError> {
        let mut b = 0;
        while b < self.blocks() {
            let p = self.is_plugged(b);
            let mut n = 1;
            while b + n < self.blocks() && self.is_plugged(b + n) == p {
                n += 1;
            }
            let Some(mem) = &self.host else {
                return Ok(());
            };
            let (addr, len) = (self.addr + b * BLOCK_SIZE, n * BLOCK_SIZE);
            // Unplugged: also drop what a restore's overlays copied there.
            set_protection(mem, addr, len, p)?;
            b += n;
        }
        Ok(())
    }

    fn plug(&mut self, first: u64, count: u64) -> u16 {
        let size = count * BLOCK_SIZE;
        if self.plugged_size.saturating_add(size) > self.requested_size {
            return RESP_NACK;
        }
        if !self.range_state(first, count).1 {
            self.base.errors += 1;
            crate::guest_warn!("virtio-mem: plug of blocks already plugged");
            return RESP_ERROR;
        }
        if let Err(e) = self.protect(first, count, true) {
            tracing::warn!("virtio-mem: {e}");
            return RESP_ERROR;
        }
        self.set_bits(first, count, true);
        self.plugged_size += size;
        self.mark_dirty(first, count);
        RESP_ACK
    }

    fn unplug(&mut self, first: u64, count: u64) -> u16 {
        if !self.range_state(first, count).0 {
            self.base.errors += 1;
            crate::guest_warn!("virtio-mem: unplug of blocks not plugged");
            return RESP_ERROR;
        }
        if let Err(e) = self.protect(first, count, false) {
            tracing::warn!("virtio-mem: {e}");
            return RESP_ERROR;
        }
        self.set_bits(first, count, false);
        self.plugged_size = self.plugged_size.saturating_sub(count * BLOCK_SIZE);
        RESP_ACK
    }

    fn unplug_all(&mut self) -> u16 {
        for (addr, len) in self.plugged_ranges() {
            let first = (addr - self.addr) / BLOCK_SIZE;
            let count = len / BLOCK_SIZE;
            if let Err(e) = self.protect(first, count, false) {
                tracing::warn!("virtio-mem: {e}");
                return RESP_ERROR;
            }
            self.set_bits(first, count, false);
            self.plugged_size = self.plugged_size.saturating_sub(len);
        }
        RESP_ACK
    }

    /// Run one request; returns (response type, state).
    pub(crate) fn execute(&mut self, req: Request) -> (u16, u16) {
        let before = self.plugged_size;
        let resp = match req.kind {
            REQ_UNPLUG_ALL => (self.unplug_all(), 0),
            REQ_PLUG | REQ_UNPLUG | REQ_STATE => match self.block_range(req.addr, req.nb_blocks) {
                None => {
                    self.base.errors += 1;
                    crate::guest_warn!(
                        "virtio-mem: request {} for an invalid range {:#x}+{} blocks",
                        req.kind,
                        req.addr,
                        req.nb_blocks
                    );
                    (RESP_ERROR, 0)
                }
                Some((first, count)) => match req.kind {
                    REQ_PLUG => (self.plug(first, count), 0),
                    REQ_UNPLUG => (self.unplug(first, count), 0),
                    _ => {
                        let state = match self.range_state(first, count) {
                            (true, _) => STATE_PLUGGED,
                            (_, true) => STATE_UNPLUGGED,
                            _ => STATE_MIXED,
                        };
                        (RESP_ACK, state)
                    }
                },
            },
            other => {
                self.base.errors += 1;
                crate::guest_warn!("virtio-mem: unknown request type {other}");
                (RESP_ERROR, 0)
            }
        };
        if self.plugged_size != before {
            let config = self.config();
            self.base.update_config(config);
        }
        resp
    }

    /// Serve every request on the queue.
    pub(crate) fn process_requests(&mut self) -> Result<(), DeviceError> {
        let mem = self.base.mem()?;
        let mut used_any = false;
        while let Some(mut chain) = pop_chain(self.base.queue_mut(0)?, &mem)? {
            let head = chain.head_index();
            let len = match collect_chain(&mut chain).map_err(RequestError::from).and_then(|d| parse(&mem, &d)) {
                Ok((Ok(req), resp_at)) => {
                    let (kind, state) = self.execute(req);
                    respond(&mem, resp_at, kind, state)
                }
                Ok((Err(e), resp_at)) => {
                    self.base.errors += 1;
                    crate::guest_warn!("virtio-mem: malformed request: {e}");
                    respond(&mem, resp_at, RESP_ERROR, 0)
                }
                Err(e) => {
                    self.base.errors += 1;
                    crate::guest_warn!("virtio-mem: malformed request: {e}");
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
}

/// Write a response; the used length (0 if it could not be written).
fn respond(mem: &GuestMemoryMmap, at: GuestAddress, kind: u16, state: u16) -> u32 {
    let mut r = [0u8; RESP_SIZE as usize];
    r[0..2].copy_from_slice(&kind.to_le_bytes());
    r[8..10].copy_from_slice(&state.to_le_bytes());
    match mem.write_slice(&r, at) {
        Ok(()) => RESP_SIZE,
        Err(_) => 0,
    }
}

/// Parse a chain: a readable request (24 bytes) first, a writable
/// response (10 bytes) last. The outer error: no place to answer; the
/// inner one: answer ERROR there.
pub(crate) type Parsed = (Result<Request, RequestError>, GuestAddress);

pub(crate) fn parse(
    mem: &GuestMemoryMmap,
    descs: &[virtio_queue::desc::split::Descriptor],
) -> Result<Parsed, RequestError> {
    let last = descs.last().ok_or(RequestError::BadResponse)?;
    if descs.len() < 2 || !last.is_write_only() || last.len() < RESP_SIZE {
        return Err(RequestError::BadResponse);
    }
    let first = descs.first().ok_or(RequestError::BadRequest)?;
    if first.is_write_only() || first.len() < REQ_SIZE {
        return Ok((Err(RequestError::BadRequest), last.addr()));
    }
    let mut raw = [0u8; REQ_SIZE as usize];
    if mem.read_slice(&mut raw, first.addr()).is_err() {
        return Ok((Err(RequestError::Memory), last.addr()));
    }
    let u16_at = |i: usize| u16::from_le_bytes([raw[i], raw[i + 1]]);
    let mut a = [0u8; 8];
    a.copy_from_slice(&raw[8..16]);
    Ok((
        Ok(Request { kind: u16_at(0), addr: u64::from_le_bytes(a), nb_blocks: u16_at(16) }),
        last.addr(),
    ))
}

/// Host address of guest range `addr`..`addr + len`, which must lie in one
/// region of `mem`.
fn host_range(mem: &GuestMemoryMmap, addr: u64, len: u64) -> Result<(*mut libc::c_void, usize), MemError> {
    let len_us = usize::try_from(len).map_err(|_| MemError::NotInMemory)?;
    let r = mem.find_region(GuestAddress(addr)).ok_or(MemError::NotInMemory)?;
    let off = addr - r.start_addr().0;
    if off.checked_add(len).is_none_or(|e| e > r.len()) {
        return Err(MemError::NotInMemory);
    }
    let p = mem.get_host_address(GuestAddress(addr)).map_err(|_| MemError::NotInMemory)?;
    Ok((p.cast(), len_us))
}

fn mprotect(mem: &GuestMemoryMmap, addr: u64, len: u64, prot: i32) -> Result<(), MemError> {
    let (p, n) = host_range(mem, addr, len)?;
    // SAFETY: the range lies inside one region of `mem`, a live mapping
    // that `mem` owns; changing its protection changes no Rust object.
    if unsafe { libc::mprotect(p, n, prot) } != 0 {
        return Err(MemError::Protect(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Plug (read-write) or unplug (discard, then `PROT_NONE`) a guest range
/// of the hotplug region.
pub(crate) fn set_protection(mem: &GuestMemoryMmap, addr: u64, len: u64, plugged: bool) -> Result<(), MemError> {
    if plugged {
        return mprotect(mem, addr, len, libc::PROT_READ | libc::PROT_WRITE);
    }
    let (p, n) = host_range(mem, addr, len)?;
    // SAFETY: as in `mprotect`; the guest gave these pages back, and no
    // reference into guest memory outlives a device request.
    if unsafe { libc::madvise(p, n, libc::MADV_DONTNEED) } != 0 {
        return Err(MemError::Protect(std::io::Error::last_os_error()));
    }
    mprotect(mem, addr, len, libc::PROT_NONE)
}

impl VirtioDevice for Mem {
    delegate_base!(base);

    fn process_queue(&mut self, index: usize) -> Result<(), DeviceError> {
        if index != 0 {
            return Err(DeviceError::NoSuchQueue(index));
        }
        self.process_requests()
    }

    fn save_device_state(&self) -> crate::devices::virtio::persist::DeviceState {
        self.device_state()
    }

    fn on_restored(&mut self) -> Result<(), DeviceError> {
        if self.is_activated() {
            self.process_requests()?;
        }
        Ok(())
    }

    fn as_mem(&self) -> Option<&Mem> {
        Some(self)
    }

    fn as_mem_mut(&mut self) -> Option<&mut Mem> {
        Some(self)
    }
}
