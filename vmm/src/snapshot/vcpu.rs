//! Saving and restoring one vCPU: registers, special registers, FPU and
//! xsave, xcrs, MSRs, LAPIC, mp_state, pending events, debug registers,
//! CPUID and the TSC frequency. Called from the vCPU's own thread while it
//! is out of KVM_RUN (see `vcpu.rs`).
//!
//! Restore order follows Firecracker's (its `vstate/vcpu` restore_state):
//! CPUID first (it shapes what KVM accepts for the rest), then mp_state,
//! regs, sregs (APIC base before the LAPIC), FPU/xsave, xcrs, debug
//! registers, LAPIC, MSRs (TSC before TSC_DEADLINE) and last the pending
//! events.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_lapic_state, kvm_mp_state,
    kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs,
    KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use super::pod::Pod;

/// Most MSRs one vCPU state may carry (KVM lists a few hundred at most).
pub const MAX_MSRS: usize = 2048;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    #[error("KVM ioctl {0} failed: {1}")]
    Ioctl(&'static str, #[source] kvm_ioctls::Error),
    #[error("KVM_SET_MSRS stopped at MSR {index:#x} ({set} of {total} set)")]
    SetMsrs { index: u32, set: usize, total: usize },
    #[error("invalid vCPU state: {0}")]
    Invalid(String),
    #[error("vCPU {id}: TSC frequency {saved} kHz cannot be set (this host runs at {host} kHz): {source}")]
    TscKhz {
        id: usize,
        saved: u32,
        host: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuStateError {
    move |e| VcpuStateError::Ioctl(what, e)
}

/// One MSR's index and value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Msr {
    pub index: u32,
    pub data: u64,
}

/// Everything KVM holds for one vCPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: usize,
    pub cpuid: Vec<Pod<kvm_cpuid_entry2>>,
    pub msrs: Vec<Msr>,
    pub regs: Pod<kvm_regs>,
    pub sregs: Pod<kvm_sregs>,
    pub fpu: Pod<kvm_fpu>,
    /// None where KVM_GET_XSAVE is unavailable (the FPU state then covers
    /// x87/SSE).
    pub xsave: Option<Pod<kvm_xsave>>,
    pub xcrs: Option<Pod<kvm_xcrs>>,
    pub lapic: Pod<kvm_lapic_state>,
    pub mp_state: Pod<kvm_mp_state>,
    pub events: Pod<kvm_vcpu_events>,
    pub debug_regs: Pod<kvm_debugregs>,
    pub tsc_khz: Option<u32>,
}

/// MSRs KVM lists but that are not vCPU state to carry over (Firecracker
/// leaves out the same two): IA32_FEATURE_CONTROL (firmware's VMX lock,
/// which the guest cannot use here) and IA32_MCG_CTL (KVM refuses writes
/// unless MCG_CAP advertises it).
const NOT_SAVED: [u32; 2] = [0x3a, 0x17b];

/// The MSRs worth saving: KVM's list (KVM_GET_MSR_INDEX_LIST) without
/// [`NOT_SAVED`], bounded. Those a vCPU cannot read are dropped when it is
/// saved ([`get_msrs`]), so the list does not need to be exact.
pub fn msrs_to_save(kvm: &Kvm) -> Result<Vec<u32>, VcpuStateError> {
    let list = kvm
        .get_msr_index_list()
        .map_err(ioctl("KVM_GET_MSR_INDEX_LIST"))?;
    let mut v: Vec<u32> = list.as_slice().iter().copied().filter(|i| !NOT_SAVED.contains(i)).collect();
    v.truncate(MAX_MSRS);
    Ok(v)
}

/// Read `indexes`, skipping those KVM refuses (KVM_GET_MSRS stops at the
/// first MSR it cannot read: that one is dropped and the rest retried).
pub fn get_msrs(vcpu: &VcpuFd, indexes: &[u32]) -> Result<Vec<Msr>, VcpuStateError> {
    let mut out = Vec::with_capacity(indexes.len());
    let mut rest: &[u32] = indexes;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry { index, ..Default::default() })
            .collect();
        let mut msrs = Msrs::from_entries(&entries)
            .map_err(|e| VcpuStateError::Invalid(format!("MSR list: {e:?}")))?;
        let n = vcpu.get_msrs(&mut msrs).map_err(ioctl("KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice().iter().take(n).map(|e| Msr { index: e.index, data: e.data }));
        if let Some(skipped) = rest.get(n) {
            tracing::debug!("MSR {skipped:#x} is not readable; not saved");
        }
        rest = rest.get(n + 1..).unwrap_or_default();
    }
    Ok(out)
}

/// Save vCPU `id`'s state. The caller has made sure the vCPU completed any
/// I/O it exited for (a KVM_RUN with immediate_exit set).
pub fn save(id: usize, vcpu: &VcpuFd, msr_list: &[u32]) -> Result<VcpuState, VcpuStateError> {
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2"))?;
    let xsave = match vcpu.get_xsave() {
        Ok(x) => Some(Pod(x)),
        Err(e) if e.errno() == libc::EINVAL || e.errno() == libc::ENOTTY || e.errno() == libc::EOPNOTSUPP => {
            tracing::debug!("vcpu{id}: KVM_GET_XSAVE unavailable ({e}); saving the FPU state only");
            None
        }
        Err(e) => return Err(VcpuStateError::Ioctl("KVM_GET_XSAVE", e)),
    };
    let xcrs = match vcpu.get_xcrs() {
        Ok(x) => Some(Pod(x)),
        Err(e) if e.errno() == libc::EINVAL || e.errno() == libc::ENOTTY || e.errno() == libc::EOPNOTSUPP => None,
        Err(e) => return Err(VcpuStateError::Ioctl("KVM_GET_XCRS", e)),
    };
    let tsc_khz = vcpu.get_tsc_khz().ok();
    Ok(VcpuState {
        id,
        cpuid: cpuid.as_slice().iter().map(|e| Pod(*e)).collect(),
        msrs: get_msrs(vcpu, msr_list)?,
        regs: Pod(vcpu.get_regs().map_err(ioctl("KVM_GET_REGS"))?),
        sregs: Pod(vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?),
        fpu: Pod(vcpu.get_fpu().map_err(ioctl("KVM_GET_FPU"))?),
        xsave,
        xcrs,
        lapic: Pod(vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?),
        mp_state: Pod(vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?),
        events: Pod(vcpu.get_vcpu_events().map_err(ioctl("KVM_GET_VCPU_EVENTS"))?),
        debug_regs: Pod(vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS"))?),
        tsc_khz,
    })
}

/// Check a state from a snapshot file before any of it reaches KVM.
pub fn validate(state: &VcpuState, allowed_msrs: &[u32]) -> Result<(), VcpuStateError> {
    if state.cpuid.is_empty() || state.cpuid.len() > KVM_MAX_CPUID_ENTRIES {
        return Err(VcpuStateError::Invalid(format!(
            "vcpu{}: {} CPUID entries (1..={KVM_MAX_CPUID_ENTRIES} allowed)",
            state.id,
            state.cpuid.len()
        )));
    }
    if state.msrs.len() > MAX_MSRS {
        return Err(VcpuStateError::Invalid(format!("vcpu{}: {} MSRs", state.id, state.msrs.len())));
    }
    if let Some(m) = state.msrs.iter().find(|m| !allowed_msrs.contains(&m.index)) {
        return Err(VcpuStateError::Invalid(format!(
            "vcpu{}: MSR {:#x} is not one KVM lists on this host",
            state.id, m.index
        )));
    }
    if let Some(khz) = state.tsc_khz {
        if khz == 0 {
            return Err(VcpuStateError::Invalid(format!("vcpu{}: TSC frequency 0", state.id)));
        }
    }
    Ok(())
}

/// MSRs in the order they must be set: TSC_DEADLINE after TSC (a deadline
/// is relative to the TSC), everything else as saved.
fn ordered_msrs(msrs: &[Msr]) -> Vec<kvm_msr_entry> {
    let mut v: Vec<kvm_msr_entry> = msrs
        .iter()
        .map(|m| kvm_msr_entry { index: m.index, data: m.data, ..Default::default() })
        .collect();
    v.sort_by_key(|e| match e.index {
        MSR_IA32_TSC => 0,
        MSR_IA32_TSC_DEADLINE => 2,
        _ => 1,
    });
    v
}

/// Load `state` into a freshly created vCPU.
pub fn restore(vcpu: &VcpuFd, state: &VcpuState) -> Result<(), VcpuStateError> {
    let id = state.id;
    if let Some(saved) = state.tsc_khz {
        let host = vcpu.get_tsc_khz().unwrap_or(0);
        // Within 250 ppm counts as the same clock (what Firecracker allows).
        if u64::from(saved.abs_diff(host)) * 4000 > u64::from(saved) {
            vcpu.set_tsc_khz(saved)
                .map_err(|source| VcpuStateError::TscKhz { id, saved, host, source })?;
        }
    }
    let entries: Vec<kvm_cpuid_entry2> = state.cpuid.iter().map(|p| p.0).collect();
    let cpuid = CpuId::from_entries(&entries)
        .map_err(|e| VcpuStateError::Invalid(format!("vcpu{id}: CPUID: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))?;
    vcpu.set_mp_state(state.mp_state.0).map_err(ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs.0).map_err(ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs.0).map_err(ioctl("KVM_SET_SREGS"))?;
    vcpu.set_fpu(&state.fpu.0).map_err(ioctl("KVM_SET_FPU"))?;
    if let Some(x) = &state.xsave {
        // SAFETY: a legacy 4 KiB kvm_xsave, as KVM_GET_XSAVE returned it.
        unsafe { vcpu.set_xsave(&x.0) }.map_err(ioctl("KVM_SET_XSAVE"))?;
    }
    if let Some(x) = &state.xcrs {
        vcpu.set_xcrs(&x.0).map_err(ioctl("KVM_SET_XCRS"))?;
    }
    vcpu.set_debug_regs(&state.debug_regs.0).map_err(ioctl("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&state.lapic.0).map_err(ioctl("KVM_SET_LAPIC"))?;
    let entries = ordered_msrs(&state.msrs);
    let msrs = Msrs::from_entries(&entries)
        .map_err(|e| VcpuStateError::Invalid(format!("vcpu{id}: MSRs: {e:?}")))?;
    let set = vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
    if set < entries.len() {
        return Err(VcpuStateError::SetMsrs {
            index: entries.get(set).map_or(0, |e| e.index),
            set,
            total: entries.len(),
        });
    }
    vcpu.set_vcpu_events(&state.events.0).map_err(ioctl("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_deadline_is_restored_after_tsc() {
        let msrs = [
            Msr { index: MSR_IA32_TSC_DEADLINE, data: 5 },
            Msr { index: 0x174, data: 1 },
            Msr { index: MSR_IA32_TSC, data: 7 },
        ];
        let order: Vec<u32> = ordered_msrs(&msrs).iter().map(|e| e.index).collect();
        assert_eq!(order, vec![MSR_IA32_TSC, 0x174, MSR_IA32_TSC_DEADLINE]);
    }
}
