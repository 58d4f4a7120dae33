//! The control API's `attach_disk` and `detach_disk`: fill or empty one of
//! the block slots the VM was built with (`--disk-slots`).

use std::path::Path;

use super::{lock, Vmm};
use crate::api::{ApiError, ApiErrorKind, Response};
use crate::devices::virtio::block::SlotError;

impl Vmm {
    /// Attach `backing` (path, read-only) to slot `slot`, or empty it.
    /// A jailed VMM gets the file passed with the request (`file`).
    pub(super) fn attach_disk(
        &mut self,
        slot: u32,
        backing: Option<(&Path, bool)>,
        mut file: Option<std::fs::File>,
    ) -> Response {
        for dev in &self.devices {
            let mut t = lock(&dev.transport);
            let Some(b) = t.device_mut().as_block_mut() else {
                continue;
            };
            if b.slot_index() != Some(slot) {
                continue;
            }
            let r = match backing {
                Some((path, read_only)) => b.attach_file(file.take(), path, read_only),
                None => b.detach(),
            };
            return match r {
                Ok(()) => {
                    match backing {
                        Some((p, ro)) => tracing::info!(
                            "slot {slot}: attached {} (read-only: {ro})",
                            p.display()
                        ),
                        None => tracing::info!("slot {slot}: emptied"),
                    }
                    Response::ok(self.state)
                }
                Err(e) => Response::err(slot_error(slot, &e)),
            };
        }
        Response::err(ApiError::new(
            ApiErrorKind::NotFound,
            format!(
                "no block slot {slot}: the VM has {} (--disk-slots)",
                self.slot_count()
            ),
        ))
    }

    fn slot_count(&self) -> usize {
        self.devices
            .iter()
            .filter(|d| {
                lock(&d.transport)
                    .device_mut()
                    .as_block_mut()
                    .is_some_and(|b| b.slot_index().is_some())
            })
            .count()
    }
}

fn slot_error(slot: u32, e: &SlotError) -> ApiError {
    let kind = match e {
        SlotError::Open(crate::devices::virtio::block::BlockError::Open { source, .. }) => {
            burrow_vmm_api::error::io_kind(source)
        }
        SlotError::Open(_) | SlotError::NotASlot => ApiErrorKind::InvalidRequest,
        SlotError::Notify(_) => ApiErrorKind::Internal,
    };
    ApiError::new(kind, format!("slot {slot}: {e}"))
}
