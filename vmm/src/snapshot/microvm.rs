//! The whole machine's state file (`<dir>/state`) and the guest memory
//! files next to it: what a snapshot directory holds, how restore checks
//! it before building anything, and how memory is mapped back.
//!
//! - Full snapshot: `<dir>/memory` is every RAM region back to back
//!   (sparse: zero pages are holes).
//! - Incremental: `<dir>/memory` holds only the pages dirtied since the
//!   snapshot it is based on, densely, in the order the state's `runs`
//!   list; the state names its base directory and that snapshot's id.
//!   Restore maps the chain's full memory file MAP_PRIVATE and copies each
//!   overlay's pages on top, oldest first.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion, GuestRegionMmap};

use burrow_vmm_api::memory_map;

use super::format::{read_state_file, SnapshotError};
use super::memory::PAGE_SIZE;
use super::vcpu::VcpuState;
use super::vm::VmState;
use crate::devices::i8042::persist::I8042State;
use crate::devices::serial::persist::SerialSnap;
use crate::devices::virtio::block::persist::BlockState;
use crate::devices::virtio::persist::{DeviceState, MmioState};
use crate::GuestMemoryMmap;

/// File names inside a snapshot directory, and the longest chain of
/// incremental snapshots restore follows (burrow-vmm-api's layout, which
/// the shim reads too).
pub use burrow_vmm_api::layout::{MAX_VMM_CHAIN as MAX_CHAIN, MEMORY_FILE, STATE_FILE};
/// Most virtio devices a state may describe (IRQs 5..=23).
pub const MAX_DEVICES: usize = 19;

const PAGE_SIZE_NZ: std::num::NonZeroUsize = match std::num::NonZeroUsize::new(PAGE_SIZE) {
    Some(n) => n,
    None => panic!("page size is not zero"),
};

/// A run of pages, in page numbers of the concatenated RAM regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRun {
    pub first: u64,
    pub count: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum MemoryKind {
    Full,
    Incremental {
        /// Directory of the snapshot this one is based on.
        base_dir: PathBuf,
        /// Its id (checked: a base overwritten since is refused).
        base_id: u64,
        runs: Vec<PageRun>,
    },
}

/// A RAM region: guest address and size. Its bytes start in the memory
/// file at the sum of the sizes before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionState {
    pub guest_addr: u64,
    pub size: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryState {
    pub regions: Vec<RegionState>,
    pub kind: MemoryKind,
}

impl MemoryState {
    pub fn total_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.size).sum()
    }
}

/// A disk as the snapshot recorded it (the VMM does not copy disks).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskRecord {
    pub path: PathBuf,
    pub read_only: bool,
}

/// Everything in `<dir>/state`.
#[derive(Debug, Serialize, Deserialize)]
pub struct MicrovmState {
    /// Identifies this snapshot (incremental ones name their base's).
    pub id: u64,
    pub vcpu_count: u8,
    /// vCPUs allowed to run (`--max-vcpus`, `set_vcpus`); none: all of
    /// them (snapshots from before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus_running: Option<u8>,
    pub mem_mib: u64,
    /// `--mem-max` of a VM with a virtio-mem device (its region is the
    /// last of `memory.regions`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_max_mib: Option<u64>,
    pub memory: MemoryState,
    pub vm: VmState,
    pub vcpus: Vec<VcpuState>,
    pub serial: SerialSnap,
    pub i8042: I8042State,
    /// virtio-mmio devices in bus order (window i at VIRTIO_MMIO_START + i * 4 KiB).
    pub devices: Vec<MmioState>,
}

impl MicrovmState {
    /// The block devices given at boot (`--disk`), then the slots that
    /// had a file attached, each in bus order: the order in which a
    /// restore's given disk paths replace theirs.
    pub fn disks_and_filled_slots(&self) -> (Vec<&BlockState>, Vec<&BlockState>) {
        let blocks = self.devices.iter().filter_map(|d| match &d.device {
            DeviceState::Block(b) => Some(b),
            _ => None,
        });
        let (disks, slots): (Vec<_>, Vec<_>) = blocks.partition(|b| b.slot.is_none());
        let filled = slots
            .into_iter()
            .filter(|b| !b.path.as_os_str().is_empty())
            .collect();
        (disks, filled)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    State(#[from] SnapshotError),
    #[error("snapshot does not fit: {0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot map guest memory: {0}")]
    Map(String),
}

fn invalid(msg: impl Into<String>) -> RestoreError {
    RestoreError::Invalid(msg.into())
}

/// The RAM regions a VM of `mem_mib` has.
pub fn regions_for(mem_mib: u64) -> Vec<RegionState> {
    crate::x86_64::e820::ram_ranges(mem_mib << 20)
        .into_iter()
        .map(|(guest_addr, size)| RegionState { guest_addr, size })
        .collect()
}

/// The regions of a VM with `mem_mib` of RAM and `--mem-max` (its
/// virtio-mem region last), or `None` if `mem_max_mib` is not valid.
pub fn regions_with(mem_mib: u64, mem_max_mib: Option<u64>) -> Option<Vec<RegionState>> {
    let mut regions = regions_for(mem_mib);
    if let Some((guest_addr, size)) = crate::devices::virtio::mem::vm_region(mem_mib, mem_max_mib).ok()? {
        regions.push(RegionState { guest_addr, size });
    }
    Some(regions)
}

/// Which parts of the virtio-mem region are plugged, for the code that
/// walks all of guest memory: unplugged blocks are `PROT_NONE` (reading
/// them would kill the VMM) and hold nothing worth keeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugView {
    /// The region's guest address and size.
    pub addr: u64,
    pub size: u64,
    /// Bit `i` of word `i / 64`: block `i` is plugged (the device's bitmap).
    pub bitmap: Vec<u64>,
}

impl HotplugView {
    fn block_plugged(&self, block: u64) -> bool {
        usize::try_from(block / 64)
            .ok()
            .and_then(|w| self.bitmap.get(w))
            .is_some_and(|w| w & (1 << (block % 64)) != 0)
    }

    /// Whether guest address `addr` may be read (outside the region, or
    /// in a plugged block).
    pub fn readable(&self, addr: u64) -> bool {
        match addr.checked_sub(self.addr) {
            Some(off) if off < self.size => self.block_plugged(off / crate::devices::virtio::mem::BLOCK_SIZE),
            _ => true,
        }
    }

    /// The plugged ranges, as offsets into the region, merged.
    fn plugged(&self) -> Vec<(u64, u64)> {
        let bs = crate::devices::virtio::mem::BLOCK_SIZE;
        let mut out: Vec<(u64, u64)> = Vec::new();
        for b in (0..self.size / bs).filter(|&b| self.block_plugged(b)) {
            match out.last_mut() {
                Some((s, l)) if *s + *l == b * bs => *l += bs,
                _ => out.push((b * bs, bs)),
            }
        }
        out
    }
}

/// Write a full snapshot's memory: every region back to back, zero pages
/// as holes; of the virtio-mem region (`hotplug`) only its plugged blocks
/// (the rest stays a hole). Returns the pages written. The vCPUs must be
/// paused.
pub fn write_full(file: &File, mem: &GuestMemoryMmap, hotplug: Option<&HotplugView>) -> std::io::Result<u64> {
    use super::memory::write_sparse;
    let mut offset = 0u64;
    let mut pages = 0;
    for r in mem.iter() {
        let len = r.len();
        let pieces = match hotplug {
            Some(h) if r.start_addr().0 == h.addr && len == h.size => h.plugged(),
            _ => vec![(0, len)],
        };
        for (off, n) in pieces {
            let (Ok(o), Ok(n)) = (usize::try_from(off), usize::try_from(n)) else {
                return Err(std::io::Error::other("region too large"));
            };
            if o.checked_add(n).is_none_or(|e| e as u64 > len) {
                return Err(std::io::Error::other("plugged range outside its region"));
            }
            // SAFETY: [o, o + n) lies inside the region's live mapping and
            // is readable (RAM, or plugged blocks); the vCPUs are paused.
            let slice = unsafe { std::slice::from_raw_parts(r.as_ptr().add(o), n) };
            pages += write_sparse(file, offset + off, slice)?.pages_written;
        }
        offset += len;
        if file.metadata()?.len() < offset {
            file.set_len(offset)?;
        }
    }
    Ok(pages)
}

/// `runs` without the pages `mem` cannot read (unplugged virtio-mem
/// blocks): what an incremental snapshot writes.
pub fn readable_runs(runs: &[PageRun], mem: &GuestMemoryMmap, hotplug: Option<&HotplugView>) -> Vec<PageRun> {
    let Some(h) = hotplug else {
        return runs.to_vec();
    };
    // Linear page number -> guest address, region by region.
    let bases: Vec<(u64, u64, u64)> = {
        let mut lin = 0u64;
        mem.iter()
            .map(|r| {
                let at = (lin, r.len(), r.start_addr().0);
                lin += r.len();
                at
            })
            .collect()
    };
    let guest = |page: u64| {
        let lin = page.checked_mul(PAGE_SIZE as u64)?;
        bases.iter().find(|(b, l, _)| lin >= *b && lin < b + l).map(|(b, _, g)| g + (lin - b))
    };
    let mut out: Vec<PageRun> = Vec::new();
    for r in runs {
        for p in r.first..r.first.saturating_add(r.count) {
            if !guest(p).is_some_and(|a| h.readable(a)) {
                continue;
            }
            match out.last_mut() {
                Some(last) if last.first + last.count == p => last.count += 1,
                _ => out.push(PageRun { first: p, count: 1 }),
            }
        }
    }
    out
}

/// Structural checks of a state read from a file, before any of it is
/// used: counts, the memory layout this build would give such a VM, page
/// runs inside memory.
pub fn validate(state: &MicrovmState) -> Result<(), RestoreError> {
    let max = crate::x86_64::mptable::MAX_CPUS;
    if state.vcpu_count == 0 || state.vcpu_count > max {
        return Err(invalid(format!("{} vCPUs (1..={max})", state.vcpu_count)));
    }
    if state.vcpus.len() != usize::from(state.vcpu_count) {
        return Err(invalid(format!(
            "{} vCPU states for {} vCPUs",
            state.vcpus.len(),
            state.vcpu_count
        )));
    }
    if let Some(r) = state.vcpus_running.filter(|r| *r == 0 || *r > state.vcpu_count) {
        return Err(invalid(format!("{r} running vCPUs of {}", state.vcpu_count)));
    }
    if let Some((i, v)) = state.vcpus.iter().enumerate().find(|(i, v)| v.id != *i) {
        return Err(invalid(format!("vCPU state {i} says it is vCPU {}", v.id)));
    }
    if !(16..=(1 << 20)).contains(&state.mem_mib) {
        return Err(invalid(format!("{} MiB of memory", state.mem_mib)));
    }
    let Some(regions) = regions_with(state.mem_mib, state.mem_max_mib) else {
        return Err(invalid(format!("--mem-max {:?} MiB does not fit {} MiB of memory", state.mem_max_mib, state.mem_mib)));
    };
    if state.memory.regions != regions {
        return Err(invalid("memory regions do not match the VM's memory size"));
    }
    let mems: Vec<_> = state
        .devices
        .iter()
        .filter_map(|d| match &d.device {
            DeviceState::Mem(m) => Some(m),
            _ => None,
        })
        .collect();
    let hotplug = regions.get(regions_for(state.mem_mib).len());
    match (mems.as_slice(), hotplug) {
        ([], None) => {}
        ([m], Some(r)) => {
            if (m.addr, m.region_size) != (r.guest_addr, r.size) {
                return Err(invalid(format!(
                    "virtio-mem region {:#x}+{:#x} is not the VM's hotplug region {:#x}+{:#x}",
                    m.addr, m.region_size, r.guest_addr, r.size
                )));
            }
            crate::devices::virtio::mem::persist::check(m).map_err(invalid)?;
        }
        (m, _) => {
            return Err(invalid(format!(
                "{} virtio-mem devices for a VM with --mem-max {:?}",
                m.len(),
                state.mem_max_mib
            )))
        }
    }
    if state.devices.len() > MAX_DEVICES {
        return Err(invalid(format!("{} devices (at most {MAX_DEVICES})", state.devices.len())));
    }
    let vsocks = state.devices.iter().filter(|d| matches!(d.device, DeviceState::Vsock(_))).count();
    if vsocks > 1 {
        return Err(invalid(format!("{vsocks} vsock devices (at most one)")));
    }
    let nics = state.devices.iter().filter(|d| matches!(d.device, DeviceState::Net(_))).count();
    if nics > 1 {
        return Err(invalid(format!("{nics} network devices (at most one)")));
    }
    if let MemoryKind::Incremental { runs, .. } = &state.memory.kind {
        check_runs(runs, state.memory.total_bytes() / PAGE_SIZE as u64)?;
    }
    Ok(())
}

/// Runs must be ordered, disjoint, non-empty and inside memory.
fn check_runs(runs: &[PageRun], total_pages: u64) -> Result<(), RestoreError> {
    let mut next = 0u64;
    for r in runs {
        let end = r.first.checked_add(r.count).ok_or_else(|| invalid("page run overflows"))?;
        if r.count == 0 || r.first < next || end > total_pages {
            return Err(invalid(format!(
                "page run {}+{} is empty, out of order or outside {total_pages} pages",
                r.first, r.count
            )));
        }
        next = end;
    }
    Ok(())
}

/// Page runs from KVM-style dirty bitmaps (bit i of word i/64 = page i),
/// one bitmap per region in order; pages are numbered across regions.
pub fn runs_from_bitmaps(bitmaps: &[(Vec<u64>, u64)]) -> Vec<PageRun> {
    let mut runs: Vec<PageRun> = Vec::new();
    let mut base = 0u64;
    for (bitmap, pages) in bitmaps {
        for page in 0..*pages {
            let set = usize::try_from(page / 64)
                .ok()
                .and_then(|w| bitmap.get(w))
                .is_some_and(|w| w & (1u64 << (page % 64)) != 0);
            if !set {
                continue;
            }
            let p = base + page;
            match runs.last_mut() {
                Some(r) if r.first + r.count == p => r.count += 1,
                _ => runs.push(PageRun { first: p, count: 1 }),
            }
        }
        base += pages;
    }
    runs
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RestoreError + '_ {
    move |source| RestoreError::Io { path: path.to_path_buf(), source }
}

/// Read and check `<dir>/state`, and check the memory files of its chain
/// exist with the right sizes, all before anything is built.
pub fn load(dir: &Path) -> Result<(MicrovmState, Vec<(PathBuf, MemoryState)>), RestoreError> {
    load_expecting(dir, &super::untrusted::Expect::default())
}

/// [`load`], with the state checked against `expect` before any file it
/// names (a base snapshot, a memory file) is opened.
pub fn load_expecting(
    dir: &Path,
    expect: &super::untrusted::Expect,
) -> Result<(MicrovmState, Vec<(PathBuf, MemoryState)>), RestoreError> {
    let state: MicrovmState = read_state_file(&dir.join(STATE_FILE))?;
    // What the caller expects first: its message is the clearer one.
    super::untrusted::check(&state, expect).map_err(RestoreError::Invalid)?;
    validate(&state)?;
    let chain = memory_chain(dir, &state)?;
    Ok((state, chain))
}

/// The snapshot directories whose memory makes up `state`'s, newest first
/// (the last one is a full snapshot), each with its memory file checked.
fn memory_chain(dir: &Path, state: &MicrovmState) -> Result<Vec<(PathBuf, MemoryState)>, RestoreError> {
    let mut chain = vec![(dir.to_path_buf(), state.memory.clone())];
    loop {
        let Some((cur_dir, cur)) = chain.last() else {
            return Err(invalid("empty chain"));
        };
        check_memory_file(cur_dir, cur)?;
        let MemoryKind::Incremental { base_dir, base_id, .. } = &cur.kind else {
            return Ok(chain);
        };
        if chain.len() >= MAX_CHAIN {
            return Err(invalid(format!("more than {MAX_CHAIN} incremental snapshots in a chain")));
        }
        let base: MicrovmState = read_state_file(&base_dir.join(STATE_FILE))?;
        validate(&base)?;
        if base.id != *base_id {
            return Err(invalid(format!(
                "base snapshot {} is not the one this snapshot was taken on (id {:#x}, expected {base_id:#x})",
                base_dir.display(),
                base.id
            )));
        }
        if base.memory.regions != state.memory.regions {
            return Err(invalid(format!("base snapshot {} has another memory layout", base_dir.display())));
        }
        let next = (base_dir.clone(), base.memory);
        chain.push(next);
    }
}

fn check_memory_file(dir: &Path, m: &MemoryState) -> Result<(), RestoreError> {
    let path = dir.join(MEMORY_FILE);
    let len = std::fs::metadata(&path).map_err(io(&path))?.len();
    let want = match &m.kind {
        MemoryKind::Full => m.total_bytes(),
        MemoryKind::Incremental { runs, .. } => runs.iter().map(|r| r.count).sum::<u64>() * PAGE_SIZE as u64,
    };
    if len != want {
        return Err(invalid(format!("{} is {len} bytes, expected {want}", path.display())));
    }
    Ok(())
}

/// Map the chain's memory: the full snapshot's file MAP_PRIVATE (lazy,
/// copy-on-write: the file is never written and can seed many VMs), then
/// each incremental overlay's pages copied on top, oldest first.
pub fn map_memory(chain: &[(PathBuf, MemoryState)]) -> Result<GuestMemoryMmap, RestoreError> {
    let Some((full_dir, full)) = chain.last() else {
        return Err(invalid("no memory"));
    };
    let path = full_dir.join(MEMORY_FILE);
    let file = File::open(&path).map_err(io(&path))?;
    let mut regions = Vec::new();
    let mut offset = 0u64;
    for r in &full.regions {
        let size = usize::try_from(r.size).map_err(|_| invalid("region too large"))?;
        let fo = FileOffset::new(file.try_clone().map_err(io(&path))?, offset);
        let bitmap = AtomicBitmap::new(size, PAGE_SIZE_NZ);
        let mapping = MmapRegionBuilder::new_with_bitmap(size, bitmap)
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .with_file_offset(fo)
            .build()
            .map_err(|e| RestoreError::Map(e.to_string()))?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr))
            .ok_or_else(|| RestoreError::Map("region wraps the address space".into()))?;
        regions.push(region);
        offset += r.size;
    }
    let mem = GuestMemoryMmap::from_regions(regions).map_err(|e| RestoreError::Map(e.to_string()))?;
    for (dir, m) in chain.iter().rev().skip(1) {
        let MemoryKind::Incremental { runs, .. } = &m.kind else {
            return Err(invalid("a full snapshot in the middle of a chain"));
        };
        apply_overlay(&mem, &dir.join(MEMORY_FILE), runs)?;
    }
    Ok(mem)
}

/// A packed memory file whose data a map places (`--packed-memory-fd`,
/// [`burrow_vmm_api::memory_map`]), checked against the memory's size.
#[derive(Debug)]
pub struct PackedMemory {
    pub file: File,
    pub extents: Vec<memory_map::Extent>,
}

impl PackedMemory {
    /// Read the map at `map` (bounded) for `file` and check it against a
    /// memory of `memory_bytes`.
    pub fn open(file: File, map: &Path, memory_bytes: u64) -> Result<Self, RestoreError> {
        use std::io::Read;
        let mut bytes = Vec::new();
        File::open(map)
            .map_err(io(map))?
            .take(memory_map::MAX_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io(map))?;
        let file_len = file.metadata().map_err(io(map))?.len();
        let extents = memory_map::decode(&bytes, memory_bytes, file_len)
            .map_err(|why| invalid(format!("{}: {why}", map.display())))?;
        Ok(Self { file, extents })
    }
}

/// Map `packed`'s ranges privately over `mem` (whose pages beneath them
/// are zero: a full snapshot's file of holes), each at its place in the
/// regions laid back to back. Nothing is read: the guest's first touch of
/// a page faults it in from the packed file.
pub fn map_packed(mem: &GuestMemoryMmap, packed: &PackedMemory) -> Result<(), RestoreError> {
    use std::os::fd::AsRawFd;
    let mut base = 0u64;
    let regions: Vec<(u64, u64, *mut u8)> = mem
        .iter()
        .map(|r| {
            let at = (base, r.len(), r.as_ptr());
            base += r.len();
            at
        })
        .collect();
    for e in &packed.extents {
        for &(start, len, ptr) in &regions {
            let from = e.guest.max(start);
            let to = e.guest.saturating_add(e.len).min(start + len);
            if from >= to {
                continue;
            }
            let (Ok(off), Ok(n), Ok(file_off)) = (
                usize::try_from(from - start),
                usize::try_from(to - from),
                libc::off_t::try_from(e.file + (from - e.guest)),
            ) else {
                return Err(invalid(format!("memory range {e:?} does not fit this host")));
            };
            // SAFETY: [ptr+off, ptr+off+n) lies inside this region's own
            // mapping (from/to are clamped to it), which MAP_FIXED replaces
            // with a private mapping of the same size and protection; the
            // region keeps owning (and later unmaps) the whole range.
            let got = unsafe {
                libc::mmap(
                    ptr.add(off).cast(),
                    n,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                    packed.file.as_raw_fd(),
                    file_off,
                )
            };
            if got == libc::MAP_FAILED {
                return Err(RestoreError::Map(format!(
                    "mapping packed memory range {e:?}: {}",
                    std::io::Error::last_os_error()
                )));
            }
        }
    }
    Ok(())
}

/// Host address of one page at linear page number `page` (regions back to
/// back), if it lies inside memory.
fn page_ptr(mem: &GuestMemoryMmap, page: u64) -> Option<*mut u8> {
    let lin = page.checked_mul(PAGE_SIZE as u64)?;
    let mut base = 0u64;
    for r in mem.iter() {
        let size = r.len();
        if lin >= base && lin + PAGE_SIZE as u64 <= base + size {
            let off = usize::try_from(lin - base).ok()?;
            // SAFETY: the page lies inside the region's mapping.
            return Some(unsafe { r.as_ptr().add(off) });
        }
        base += size;
    }
    None
}

fn apply_overlay(mem: &GuestMemoryMmap, path: &Path, runs: &[PageRun]) -> Result<(), RestoreError> {
    let file = File::open(path).map_err(io(path))?;
    let page = PAGE_SIZE as u64;
    let mut file_off = 0u64;
    for r in runs {
        for p in r.first..r.first + r.count {
            let dst = page_ptr(mem, p).ok_or_else(|| invalid(format!("page {p} outside memory")))?;
            // SAFETY: one page inside the mapping, which outlives this call;
            // nothing runs the guest during restore.
            let dst = unsafe { std::slice::from_raw_parts_mut(dst, PAGE_SIZE) };
            file.read_exact_at(dst, file_off).map_err(io(path))?;
            file_off += page;
        }
    }
    Ok(())
}

/// Host memory of every region, in order (the guest must not be running).
pub fn region_slices(mem: &GuestMemoryMmap) -> Vec<&[u8]> {
    mem.iter()
        .map(|r| {
            // SAFETY: the whole mapping of a live region; the vCPUs are
            // paused and the VMM thread is the caller.
            unsafe { std::slice::from_raw_parts(r.as_ptr(), r.len() as usize) }
        })
        .collect()
}

/// Write the pages `runs` names (linear page numbers) densely to `file`.
pub fn write_runs(file: &File, mem: &GuestMemoryMmap, runs: &[PageRun]) -> std::io::Result<u64> {
    let page = PAGE_SIZE as u64;
    let mut off = 0u64;
    for r in runs {
        for p in r.first..r.first + r.count {
            let src = page_ptr(mem, p).ok_or_else(|| std::io::Error::other(format!("page {p} outside memory")))?;
            // SAFETY: one page inside the mapping; the vCPUs are paused.
            let src = unsafe { std::slice::from_raw_parts(src, PAGE_SIZE) };
            file.write_all_at(src, off)?;
            off += page;
        }
    }
    Ok(off / page)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dirty_bitmaps_become_page_runs_across_regions() {
        // Region 0: 130 pages, pages 0,1,2 and 64 dirty; region 1: 10 pages, page 0 and 9.
        let r0 = vec![0b111u64, 1, 0];
        let r1 = vec![1u64 | 1 << 9];
        let runs = runs_from_bitmaps(&[(r0, 130), (r1, 10)]);
        assert_eq!(
            runs,
            vec![
                PageRun { first: 0, count: 3 },
                PageRun { first: 64, count: 1 },
                PageRun { first: 130, count: 1 },
                PageRun { first: 139, count: 1 },
            ]
        );
        // Bits past a region's end are ignored; a bitmap shorter than the region is fine.
        assert_eq!(runs_from_bitmaps(&[(vec![u64::MAX], 3)]), vec![PageRun { first: 0, count: 3 }]);
        assert!(runs_from_bitmaps(&[(vec![], 100)]).is_empty());
        // Last page of region 0 and first of region 1 join into one run.
        let runs = runs_from_bitmaps(&[(vec![0, 0, 1 << 1], 130), (vec![1], 10)]);
        assert_eq!(runs, vec![PageRun { first: 129, count: 2 }]);
    }

    #[test]
    fn vmm_writes_to_guest_memory_are_marked_dirty() {
        use vm_memory::Bytes;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 16 * PAGE_SIZE)]).unwrap();
        mem.write_obj(1u32, GuestAddress(5 * PAGE_SIZE as u64 + 8)).unwrap();
        let mut buf = [7u8; 2];
        mem.write_slice(&buf, GuestAddress(9 * PAGE_SIZE as u64 - 1)).unwrap(); // straddles 8 and 9
        mem.read_slice(&mut buf, GuestAddress(12 * PAGE_SIZE as u64)).unwrap(); // reads do not count
        let region = mem.iter().next().unwrap();
        let mapping: &vm_memory::mmap::MmapRegion<AtomicBitmap> = region;
        let dirty: Vec<usize> = (0..16).filter(|&p| mapping.bitmap().is_bit_set(p)).collect();
        assert_eq!(dirty, vec![5, 8, 9]);
    }

    #[test]
    fn page_runs_are_checked() {
        assert!(check_runs(&[PageRun { first: 0, count: 2 }, PageRun { first: 5, count: 1 }], 10).is_ok());
        assert!(check_runs(&[PageRun { first: 5, count: 1 }, PageRun { first: 0, count: 2 }], 10).is_err());
        assert!(check_runs(&[PageRun { first: 9, count: 2 }], 10).is_err());
        assert!(check_runs(&[PageRun { first: 1, count: 0 }], 10).is_err());
        assert!(check_runs(&[PageRun { first: u64::MAX, count: 2 }], 10).is_err());
    }

    #[test]
    fn overlay_chain_restores_base_plus_dirty_pages() {
        use vm_memory::Bytes;
        let dir = tempfile::tempdir().unwrap();
        let (full, inc) = (dir.path().join("full"), dir.path().join("inc"));
        std::fs::create_dir_all(&full).unwrap();
        std::fs::create_dir_all(&inc).unwrap();
        let regions = vec![RegionState { guest_addr: 0, size: 16 * PAGE_SIZE as u64 }];
        let mut base = vec![0u8; 16 * PAGE_SIZE];
        base[3 * PAGE_SIZE] = 1;
        base[7 * PAGE_SIZE] = 2;
        std::fs::write(full.join(MEMORY_FILE), &base).unwrap();
        let mut overlay = vec![9u8; PAGE_SIZE];
        overlay.extend(vec![8u8; PAGE_SIZE]);
        std::fs::write(inc.join(MEMORY_FILE), &overlay).unwrap();
        let runs = vec![PageRun { first: 7, count: 2 }];
        let chain = vec![
            (inc.clone(), MemoryState {
                regions: regions.clone(),
                kind: MemoryKind::Incremental { base_dir: full.clone(), base_id: 1, runs },
            }),
            (full.clone(), MemoryState { regions, kind: MemoryKind::Full }),
        ];
        let mem = map_memory(&chain).unwrap();
        let b = |a: u64| mem.read_obj::<u8>(GuestAddress(a)).unwrap();
        assert_eq!(b(3 * PAGE_SIZE as u64), 1, "base page");
        assert_eq!(b(7 * PAGE_SIZE as u64), 9, "overlaid page");
        assert_eq!(b(8 * PAGE_SIZE as u64 + 5), 8);
        // Private mapping: guest writes never reach the file.
        mem.write_obj(0x77u8, GuestAddress(3 * PAGE_SIZE as u64)).unwrap();
        assert_eq!(std::fs::read(full.join(MEMORY_FILE)).unwrap()[3 * PAGE_SIZE], 1);
    }

    #[test]
    fn packed_memory_is_mapped_in_place_across_regions() {
        use vm_memory::Bytes;
        let d = tempfile::tempdir().unwrap();
        let full = d.path().join("full");
        std::fs::create_dir_all(&full).unwrap();
        let page = PAGE_SIZE as u64;
        // Two regions of 4 pages with a gap between them in guest space.
        let regions = vec![
            RegionState { guest_addr: 0, size: 4 * page },
            RegionState { guest_addr: 1 << 20, size: 4 * page },
        ];
        // The full snapshot's file is all holes.
        std::fs::File::create(full.join(MEMORY_FILE)).unwrap().set_len(8 * page).unwrap();
        // Packed: a header page, then 3 pages of data that cross from the
        // first region into the second (linear pages 3, 4, 5).
        let mut packed = vec![0u8; PAGE_SIZE];
        for v in [3u8, 4, 5] {
            packed.extend(vec![v; PAGE_SIZE]);
        }
        let pfile = d.path().join("packed");
        std::fs::write(&pfile, &packed).unwrap();
        let map = d.path().join("memory.map");
        let ext = [memory_map::Extent { guest: 3 * page, file: page, len: 3 * page }];
        std::fs::write(&map, memory_map::encode(&ext)).unwrap();
        let p = PackedMemory::open(File::open(&pfile).unwrap(), &map, 8 * page).unwrap();
        let chain = vec![(full.clone(), MemoryState { regions, kind: MemoryKind::Full })];
        let mem = map_memory(&chain).unwrap();
        map_packed(&mem, &p).unwrap();
        let b = |a: u64| mem.read_obj::<u8>(GuestAddress(a)).unwrap();
        assert_eq!(b(2 * page), 0, "a hole stays zero");
        assert_eq!(b(3 * page + 17), 3);
        assert_eq!(b(1 << 20), 4, "the range goes on in the second region");
        assert_eq!(b((1 << 20) + page + 5), 5);
        assert_eq!(b((1 << 20) + 2 * page), 0);
        // Private: guest writes never reach the packed file.
        mem.write_obj(0x77u8, GuestAddress(3 * page)).unwrap();
        assert_eq!(b(3 * page), 0x77);
        assert_eq!(std::fs::read(&pfile).unwrap()[PAGE_SIZE], 3);
        // A map reaching past the file is refused before anything is mapped.
        let past = [memory_map::Extent { guest: 0, file: page, len: 4 * page }];
        std::fs::write(&map, memory_map::encode(&past)).unwrap();
        let e = PackedMemory::open(File::open(&pfile).unwrap(), &map, 8 * page).unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
    }
}
