//! Taking a snapshot of a running VM (the control API's `snapshot`).
//!
//! Order (as Firecracker's): pause every vCPU (kicked out of KVM_RUN), save
//! each vCPU's state from its own thread, then the VM's (irqchip, PIT,
//! clock), the devices, and memory last. The VM stays paused.

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegion;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::{lock, Vmm};
use crate::api::{failure_kind, ApiError, ApiErrorKind, Event, SnapshotInfo, VmState};
use crate::devices::virtio::persist::DeviceState;
use crate::snapshot::memory::PAGE_SIZE;
use crate::snapshot::microvm::{
    self, MemoryKind, MemoryState, MicrovmState, PageRun, MEMORY_FILE, STATE_FILE,
};
use crate::snapshot::{self, write_state_file, write_state_to, Persist};
use crate::vcpu;

fn new_id() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    t ^ (u64::from(std::process::id()) << 40)
}

fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> ApiError {
    let m = format!("{what} {}", path.display());
    move |e| ApiError::io(m, &e)
}

fn err(kind: ApiErrorKind, message: impl Into<String>) -> ApiError {
    ApiError::new(kind, message)
}

/// A snapshot-module error with the kind its cause has.
fn typed(e: &(dyn std::error::Error + 'static)) -> ApiError {
    err(failure_kind(e).unwrap_or(ApiErrorKind::Internal), e.to_string())
}

/// The two files of a snapshot, opened by the controller and passed over
/// the API socket (`SCM_RIGHTS`, memory first): a jailed VMM sees no
/// snapshot directory. Both must be empty.
pub struct SnapshotFiles {
    pub memory: File,
    pub state: File,
}

impl Vmm {
    /// Pause (if running) and write a snapshot to `dir`, or to `files`
    /// (then `dir` is the absolute path they are in, as recorded in the
    /// state). The VM is left paused.
    pub(super) fn snapshot(
        &mut self,
        dir: &Path,
        incremental: bool,
        files: Option<SnapshotFiles>,
        events: &mut Vec<Event>,
    ) -> Result<SnapshotInfo, ApiError> {
        if let Some(f) = &files {
            if !dir.is_absolute() {
                return Err(err(ApiErrorKind::InvalidRequest, format!("snapshot files passed with a relative dir {}", dir.display())));
            }
            for (what, file) in [("memory", &f.memory), ("state", &f.state)] {
                let len = file.metadata().map_err(io("cannot stat the passed file for", Path::new(what)))?.len();
                if len != 0 {
                    return Err(err(ApiErrorKind::InvalidRequest, format!("the {what} file passed is not empty ({len} bytes)")));
                }
            }
        }
        let start = Instant::now();
        match self.state {
            VmState::Running => {
                if !self.control.pause(&self.threads) {
                    self.control.resume();
                    return Err(err(ApiErrorKind::Timeout, "vCPUs did not pause in time"));
                }
                self.state = VmState::Paused;
                events.push(Event::Paused);
            }
            VmState::Paused | VmState::Created => {}
            VmState::Exited => return Err(err(ApiErrorKind::InvalidState, "the VM has exited")),
        }
        let base = if incremental {
            if !self.dirty_log {
                return Err(err(ApiErrorKind::InvalidState, "incremental snapshot needs a full snapshot (or a restore) first: KVM is not logging dirty pages yet"));
            }
            let Some((base_dir, base_id)) = self.last_snapshot.clone() else {
                return Err(err(ApiErrorKind::InvalidState, "incremental snapshot needs a full snapshot first"));
            };
            Some((base_dir, base_id))
        } else {
            None
        };
        let dir = if files.is_some() {
            dir.to_path_buf()
        } else {
            std::fs::create_dir_all(dir).map_err(io("cannot create", dir))?;
            dir.canonicalize().map_err(io("cannot resolve", dir))?
        };
        if let Some((base_dir, _)) = &base {
            if *base_dir == dir {
                return Err(err(ApiErrorKind::InvalidRequest, format!("{} holds the base snapshot; write the incremental one elsewhere", dir.display())));
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
                .ok_or_else(|| err(ApiErrorKind::Timeout, "vCPUs did not save their state (a vCPU thread exited or hung)"))?
        };
        let vcpus = vcpus.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| err(ApiErrorKind::Internal, e))?;
        let vm = snapshot::vm::save(&self.vm).map_err(|e| err(ApiErrorKind::Internal, e.to_string()))?;
        let serial = lock(&self.bus.serial).save();
        let i8042 = lock(&self.bus.i8042).save();
        let devices: Vec<_> = self.devices.iter().map(|d| lock(&d.transport).save()).collect();
        if let Some(t) = devices.iter().find_map(|d| match d.device {
            DeviceState::Unsupported(t) => Some(t),
            _ => None,
        }) {
            return Err(err(ApiErrorKind::Unsupported, format!("device type {t} does not support snapshots")));
        }

        // Memory: written to a temporary name and renamed, so a VM restored
        // from this directory (whose memory maps the old file) is unaffected.
        // From here on the dirty logs get consumed: if anything fails, no
        // snapshot is a valid base for an incremental one any more.
        self.last_snapshot = None;
        let (file, state_file, tmp) = match files {
            Some(f) => (f.memory, Some(f.state), dir.join(MEMORY_FILE)),
            None => {
                let tmp = dir.join(format!("{MEMORY_FILE}.tmp"));
                (File::create(&tmp).map_err(io("cannot create", &tmp))?, None, tmp)
            }
        };
        let regions = microvm::regions_with(self.mem_mib, self.mem_max_mib)
            .ok_or_else(|| err(ApiErrorKind::Internal, "the VM's --mem-max has no region"))?;
        let hotplug = self.devices.iter().find_map(|d| {
            let mut t = lock(&d.transport);
            let m = t.device_mut().as_mem()?;
            Some(microvm::HotplugView { addr: m.addr(), size: m.region_size(), bitmap: m.bitmap().to_vec() })
        });
        let (kind, pages) = match base {
            None => {
                // Unplugged virtio-mem blocks are PROT_NONE: skipped.
                let pages = microvm::write_full(&file, &self.mem, hotplug.as_ref()).map_err(io("cannot write", &tmp))?;
                self.start_dirty_log()?;
                (MemoryKind::Full, pages)
            }
            Some((base_dir, base_id)) => {
                let runs = self.take_dirty_pages()?;
                let runs = microvm::readable_runs(&runs, &self.mem, hotplug.as_ref());
                let pages = microvm::write_runs(&file, &self.mem, &runs).map_err(io("cannot write", &tmp))?;
                (MemoryKind::Incremental { base_dir, base_id, runs }, pages)
            }
        };
        file.sync_all().map_err(io("cannot sync", &tmp))?;
        let memory_bytes = file.metadata().map_err(io("cannot stat", &tmp))?.len();
        drop(file);
        let mem_path = dir.join(MEMORY_FILE);
        if state_file.is_none() {
            std::fs::rename(&tmp, &mem_path).map_err(io("cannot rename to", &mem_path))?;
        }

        let id = new_id();
        let state = MicrovmState {
            id,
            vcpu_count: self.vcpu_count,
            vcpus_running: Some(self.control.running()),
            mem_mib: self.mem_mib,
            mem_max_mib: self.mem_max_mib,
            memory: MemoryState { regions, kind },
            vm,
            vcpus,
            serial,
            i8042,
            devices,
        };
        let state_path = dir.join(STATE_FILE);
        let state_bytes = match state_file {
            Some(mut f) => {
                write_state_to(&mut f, &state_path, &state).map_err(|e| typed(&e))?;
                f.metadata().map(|m| m.len()).unwrap_or(0)
            }
            None => {
                write_state_file(&state_path, &state).map_err(|e| typed(&e))?;
                std::fs::metadata(&state_path).map(|m| m.len()).unwrap_or(0)
            }
        };
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
    fn start_dirty_log(&mut self) -> Result<(), ApiError> {
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
    fn take_dirty_pages(&mut self) -> Result<Vec<PageRun>, ApiError> {
        let mut bitmaps = Vec::new();
        for (slot, region) in self.mem.iter().enumerate() {
            let len = region.len() as usize;
            let mut words = self
                .vm
                .get_dirty_log(slot as u32, len)
                .map_err(|e| err(ApiErrorKind::Internal, format!("KVM_GET_DIRTY_LOG: {e}")))?;
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
