//! Growing the guest's memory after boot (`--mem-max`, the control API's
//! `resize_memory`): the virtio-mem device's region and requested size.

use super::{lock, Vmm, VmmError};
use crate::api::{ApiError, ApiErrorKind, Response};
use crate::devices::virtio::mem::{vm_region, BLOCK_SIZE};

const MIB: u64 = 1 << 20;

/// The hotplug region (guest address, size) of a VM with `mem_mib` of RAM
/// that may grow to `mem_max_mib`; `None` without `--mem-max` or when it
/// equals `--mem`.
pub(super) fn region(mem_mib: u64, mem_max_mib: Option<u64>) -> Result<Option<(u64, u64)>, VmmError> {
    vm_region(mem_mib, mem_max_mib).map_err(|e| VmmError::Config(e.to_string()))
}

impl Vmm {
    /// The VM's memory as `status` reports it (None without virtio-mem).
    pub(super) fn memory_info(&self) -> Option<burrow_vmm_api::MemoryInfo> {
        let max_mib = self.mem_max_mib?;
        self.devices.iter().find_map(|d| {
            let mut t = lock(&d.transport);
            let m = t.device_mut().as_mem()?;
            Some(burrow_vmm_api::MemoryInfo {
                base_mib: self.mem_mib,
                max_mib,
                requested_mib: self.mem_mib + m.requested_size() / MIB,
                plugged_mib: self.mem_mib + m.plugged_size() / MIB,
            })
        })
    }

    /// Ask the guest to have `mib` MiB in all (`--mem` ..= `--mem-max`).
    pub(super) fn resize_memory(&mut self, mib: u64) -> Response {
        let invalid = |m: String| Response::err(ApiError::new(ApiErrorKind::InvalidRequest, m));
        let Some(max) = self.mem_max_mib else {
            return Response::err(ApiError::new(
                ApiErrorKind::Unsupported,
                "the VM has no hotplug memory (started without --mem-max)",
            ));
        };
        if mib < self.mem_mib || mib > max {
            return invalid(format!("memory must be {} to {max} MiB, got {mib} MiB", self.mem_mib));
        }
        let bytes = (mib - self.mem_mib) * MIB;
        if !bytes.is_multiple_of(BLOCK_SIZE) {
            return invalid(format!(
                "memory above --mem grows in {} MiB steps: {mib} MiB is {} MiB above {} MiB",
                BLOCK_SIZE / MIB,
                mib - self.mem_mib,
                self.mem_mib
            ));
        }
        for d in &self.devices {
            let mut t = lock(&d.transport);
            let Some(m) = t.device_mut().as_mem_mut() else {
                continue;
            };
            return match m.set_requested_size(bytes) {
                Ok(()) => {
                    tracing::info!("memory: requested {mib} MiB in all ({} MiB plugged now)", self.mem_mib + m.plugged_size() / MIB);
                    drop(t);
                    Response::ok(self.state).with_memory(self.memory_info())
                }
                Err(e) => Response::err(ApiError::new(ApiErrorKind::Internal, e.to_string())),
            };
        }
        Response::err(ApiError::new(ApiErrorKind::Internal, "the virtio-mem device is missing"))
    }
}
