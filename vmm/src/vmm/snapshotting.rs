//! Taking a snapshot of a running VM (the control API's `snapshot`).
//!
//! Order (as Firecracker's): pause every vCPU (kicked out of KVM_RUN), save
//! each vCPU's state from its own thread, then the VM's (irqchip, PIT,
//! clock), the devices, and memory last. The VM stays paused.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegion;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::{lock, Vmm};
use crate::api::{Event, VmState};
use crate::devices::virtio::persist::DeviceState;
use crate::snapshot::memory::{write_sparse, PAGE_SIZE};
use crate::snapshot::microvm::{
    self, MemoryKind, MemoryState, MicrovmState, PageRun, MEMORY_FILE, STATE_FILE,
};
use crate::snapshot::{self, write_state_file, Persist};
use crate::vcpu;

/// What the API answers for a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    pub incremental: bool,
    /// Size of `<dir>/state`.
    pub state_bytes: u64,
    /// Apparent size of `<dir>/memory`.
    pub memory_bytes: u64,
    /// Pages actually written (non-zero ones in a full snapshot, dirty ones
    /// in an incremental one).
    pub memory_pages: u64,
    pub took_ms: u64,
}

fn new_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 40)
}

fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> String {
    let m = format!("{what} {}", path.display());
    move |e| format!("{m}: {e}")
}

impl Vmm {
    /// Pause (if running) and write a snapshot to `dir`. The VM is left paused.
    pub(super) fn snapshot(
        &mut self,
        dir: &Path,
        incremental: bool,
        events: &mut Vec<Event>,
    ) -> Result<SnapshotInfo, String> {
        let start = Instant::now();
        match self.state {
            VmState::Running => {
                if !self.control.pause(&self.threads) {
                    self.control.resume();
                    return Err("vCPUs did not pause in time".into());
                }
                self.state = VmState::Paused;
                events.push(Event::Paused);
            }
            VmState::Paused | VmState::Created => {}
            VmState::Exited => return Err("the VM has exited".into()),
        }
        let base = if incremental {
            if !self.dirty_log {
                return Err("incremental snapshot needs a full snapshot (or a restore) first: KVM is not logging dirty pages yet".into());
            }
            let Some((base_dir, base_id)) = self.last_snapshot.clone() else {
                return Err("incremental snapshot needs a full snapshot first".into());
            };
            Some((base_dir, base_id))
        } else {
            None
        };
        std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
        let dir = dir.canonicalize().map_err(io("cannot resolve", dir))?;
        if let Some((base_dir, _)) = &base {
            if *base_dir == dir {
                return Err(format!("{} holds the base snapshot; write the incremental one elsewhere", dir.display()));
            }
        }

        // vCPUs, each from its own thread (or directly if never started).
        let vcpus = if self.threads.is_empty() {
            let list = self.control.msr_list().to_vec();
            self.pending_vcpus
                .iter_mut()
                .enumerate()
                .map(|(id, v)| vcpu::save_state(id, v, &list))
                .collect::<Vec<_>>()
        } else {
            self.control
                .save_all(&self.threads)
                .ok_or("vCPUs did not save their state (a vCPU thread exited or hung)")?
        };
        let vcpus = vcpus.into_iter().collect::<Result<Vec<_>, _>>()?;
        let vm = snapshot::vm::save(&self.vm).map_err(|e| e.to_string())?;
        let serial = lock(&self.bus.serial).save();
        let i8042 = lock(&self.bus.i8042).save();
        let devices: Vec<_> = self.devices.iter().map(|d| lock(&d.transport).save()).collect();
        if let Some(t) = devices.iter().find_map(|d| match d.device {
            DeviceState::Unsupported(t) => Some(t),
            _ => None,
        }) {
            return Err(format!("device type {t} does not support snapshots"));
        }

        // Memory: written to a temporary name and renamed, so a VM restored
        // from this directory (whose memory maps the old file) is unaffected.
        // From here on the dirty logs get consumed: if anything fails, no
        // snapshot is a valid base for an incremental one any more.
        self.last_snapshot = None;
        let tmp = dir.join(format!("{MEMORY_FILE}.tmp"));
        let file = File::create(&tmp).map_err(io("cannot create", &tmp))?;
        let regions = microvm::regions_for(self.mem_mib);
        let (kind, pages) = match base {
            None => {
                let mut offset = 0u64;
                let mut pages = 0;
                for slice in microvm::region_slices(&self.mem) {
                    pages += write_sparse(&file, offset, slice).map_err(io("cannot write", &tmp))?.pages_written;
                    offset += slice.len() as u64;
                }
                self.start_dirty_log()?;
                (MemoryKind::Full, pages)
            }
            Some((base_dir, base_id)) => {
                let runs = self.take_dirty_pages()?;
                let pages = microvm::write_runs(&file, &self.mem, &runs).map_err(io("cannot write", &tmp))?;
                (MemoryKind::Incremental { base_dir, base_id, runs }, pages)
            }
        };
        file.sync_all().map_err(io("cannot sync", &tmp))?;
        let memory_bytes = file.metadata().map_err(io("cannot stat", &tmp))?.len();
        drop(file);
        let mem_path = dir.join(MEMORY_FILE);
        std::fs::rename(&tmp, &mem_path).map_err(io("cannot rename to", &mem_path))?;

        let id = new_id();
        let state = MicrovmState {
            id,
            vcpu_count: self.vcpu_count,
            mem_mib: self.mem_mib,
            memory: MemoryState { regions, kind },
            vm,
            vcpus,
            serial,
            i8042,
            devices,
        };
        let state_path = dir.join(STATE_FILE);
        write_state_file(&state_path, &state).map_err(|e| e.to_string())?;
        let state_bytes = std::fs::metadata(&state_path).map(|m| m.len()).unwrap_or(0);
        self.last_snapshot = Some((dir.clone(), id));
        let info = SnapshotInfo {
            dir,
            incremental,
            state_bytes,
            memory_bytes,
            memory_pages: pages,
            took_ms: start.elapsed().as_millis() as u64,
        };
        tracing::info!("snapshot: {info:?}");
        Ok(info)
    }

    /// Log dirty pages from now on (KVM for the guest's writes, the memory
    /// bitmap for the VMM's), starting from a clean slate.
    fn start_dirty_log(&mut self) -> Result<(), String> {
        if !self.dirty_log {
            match super::register_memory(&self.vm, &self.mem, true) {
                Ok(()) => self.dirty_log = true,
                Err(e) => {
                    tracing::warn!("cannot enable dirty logging ({e}); incremental snapshots will be refused");
                    return Ok(());
                }
            }
        }
        self.take_dirty_pages().map(|_| ())
    }

    /// The pages written since the last call (guest and VMM), as runs of
    /// linear page numbers; clears both logs.
    fn take_dirty_pages(&mut self) -> Result<Vec<PageRun>, String> {
        let mut bitmaps = Vec::new();
        for (slot, region) in self.mem.iter().enumerate() {
            let len = region.len() as usize;
            let mut words = self
                .vm
                .get_dirty_log(slot as u32, len)
                .map_err(|e| format!("KVM_GET_DIRTY_LOG: {e}"))?;
            let pages = len / PAGE_SIZE;
            words.resize(pages.div_ceil(64), 0);
            let mapping: &MmapRegion<AtomicBitmap> = region;
            let vmm_dirty = mapping.bitmap();
            for page in 0..pages {
                if vmm_dirty.is_bit_set(page) {
                    if let Some(w) = words.get_mut(page / 64) {
                        *w |= 1 << (page % 64);
                    }
                }
            }
            vmm_dirty.reset();
            bitmaps.push((words, pages as u64));
        }
        Ok(microvm::runs_from_bitmaps(&bitmaps))
    }
}
