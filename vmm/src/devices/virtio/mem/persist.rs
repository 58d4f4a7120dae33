//! Snapshot state of virtio-mem: the region, the plugged-block bitmap and
//! the plugged and requested sizes. The plugged blocks' contents are in
//! the snapshot's memory file like RAM's (the region is its last region);
//! a restore maps it and takes access away from the unplugged blocks
//! again. The state is untrusted input: [`check`] refuses a region that is
//! misaligned or too large, a bitmap of the wrong length or with bits past
//! the region, and sizes that do not match the bitmap.

use serde::{Deserialize, Serialize};

use super::device::{check_region, BLOCK_SIZE};
use super::Mem;
use crate::devices::virtio::base::BaseState;
use crate::devices::virtio::persist::{DeviceContext, DeviceState, VirtioPersistError};
use crate::snapshot::Persist;
use crate::GuestMemoryMmap;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemState {
    pub addr: u64,
    pub region_size: u64,
    pub block_size: u64,
    pub plugged_size: u64,
    pub requested_size: u64,
    /// Bit `i` of word `i / 64`: block `i` is plugged.
    pub bitmap: Vec<u64>,
    #[serde(flatten)]
    pub base: BaseState,
}

/// Rebuilding the device: the guest memory holding the region (`None`
/// only in tests) and the device context.
pub struct MemContext {
    pub host: Option<GuestMemoryMmap>,
    pub device: DeviceContext,
}

/// Structural checks of a state read from a snapshot.
pub fn check(s: &MemState) -> Result<(), String> {
    check_region(s.addr, s.region_size).map_err(|e| e.to_string())?;
    if s.block_size != BLOCK_SIZE {
        return Err(format!("virtio-mem block size {} (this VMM uses {BLOCK_SIZE})", s.block_size));
    }
    let blocks = s.region_size / BLOCK_SIZE;
    let words = usize::try_from(blocks.div_ceil(64)).map_err(|_| "too many blocks".to_string())?;
    if s.bitmap.len() != words {
        return Err(format!("virtio-mem bitmap has {} words, the region needs {words}", s.bitmap.len()));
    }
    if !blocks.is_multiple_of(64) {
        if let Some(last) = s.bitmap.last() {
            if last >> (blocks % 64) != 0 {
                return Err("virtio-mem bitmap marks blocks past the region".into());
            }
        }
    }
    let plugged: u64 = s.bitmap.iter().map(|w| u64::from(w.count_ones())).sum();
    if plugged.checked_mul(BLOCK_SIZE) != Some(s.plugged_size) {
        return Err(format!(
            "virtio-mem plugged size {} does not match the {plugged} blocks its bitmap marks",
            s.plugged_size
        ));
    }
    if !s.requested_size.is_multiple_of(BLOCK_SIZE) || s.requested_size > s.region_size {
        return Err(format!("virtio-mem requested size {} is not whole blocks inside the region", s.requested_size));
    }
    Ok(())
}

impl Persist for Mem {
    type State = MemState;
    type Context = MemContext;
    type Error = VirtioPersistError;

    fn save(&self) -> MemState {
        MemState {
            addr: self.addr,
            region_size: self.region_size,
            block_size: BLOCK_SIZE,
            plugged_size: self.plugged_size,
            requested_size: self.requested_size,
            bitmap: self.bitmap.clone(),
            base: self.base.save(),
        }
    }

    fn restore(ctx: MemContext, state: &MemState) -> Result<Self, VirtioPersistError> {
        check(state).map_err(VirtioPersistError::Backend)?;
        let backend = |e: super::MemError| VirtioPersistError::Backend(e.to_string());
        let mut m = Mem::new(state.addr, state.region_size, ctx.host).map_err(backend)?;
        m.bitmap.clone_from(&state.bitmap);
        m.plugged_size = state.plugged_size;
        m.requested_size = state.requested_size;
        m.base.update_config(m.config());
        m.apply_protection().map_err(backend)?;
        m.base.restore(&state.base, ctx.device)?;
        Ok(m)
    }
}

impl Mem {
    pub(crate) fn device_state(&self) -> DeviceState {
        DeviceState::Mem(self.save())
    }
}
