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
    kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use super::kvm_serde::{Exact, KvmFpu};

/// Most MSRs one vCPU state may carry (KVM lists a few hundred at most).
pub const MAX_MSRS: usize = 2048;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    #[error("KVM ioctl {0} failed: {1}")]
    Ioctl(&'static str, #[source] kvm_ioctls::Error),
    #[error("KVM_SET_MSRS stopped at MSR {index:#x} ({set} of {total} set)")]
    SetMsrs {
        index: u32,
        set: usize,
        total: usize,
    },
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

/// Everything KVM holds for one vCPU, as kvm-bindings' structs (see
/// `kvm_serde` for how they are stored).
#[derive(Debug, Serialize, Deserialize)]
pub struct VcpuState {
    pub id: usize,
    pub cpuid: Vec<Exact<kvm_cpuid_entry2>>,
    pub msrs: Vec<Exact<kvm_msr_entry>>,
    pub regs: Exact<kvm_regs>,
    pub sregs: Exact<kvm_sregs>,
    #[serde(with = "KvmFpu")]
    pub fpu: kvm_fpu,
    /// None where KVM_GET_XSAVE is unavailable (the FPU state then covers
    /// x87/SSE).
    pub xsave: Option<Exact<kvm_xsave>>,
    pub xcrs: Option<Exact<kvm_xcrs>>,
    pub lapic: Exact<kvm_lapic_state>,
    pub mp_state: Exact<kvm_mp_state>,
    pub events: Exact<kvm_vcpu_events>,
    pub debug_regs: Exact<kvm_debugregs>,
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
    let mut v: Vec<u32> = list
        .as_slice()
        .iter()
        .copied()
        .filter(|i| !NOT_SAVED.contains(i))
        .collect();
    v.truncate(MAX_MSRS);
    Ok(v)
}

/// Read `indexes`, skipping those KVM refuses (KVM_GET_MSRS stops at the
/// first MSR it cannot read: that one is dropped and the rest retried).
pub fn get_msrs(vcpu: &VcpuFd, indexes: &[u32]) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let mut out = Vec::with_capacity(indexes.len());
    let mut rest: &[u32] = indexes;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries)
            .map_err(|e| VcpuStateError::Invalid(format!("MSR list: {e:?}")))?;
        let n = vcpu.get_msrs(&mut msrs).map_err(ioctl("KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice().iter().take(n).copied());
        if let Some(skipped) = rest.get(n) {
            tracing::debug!("MSR {skipped:#x} is not readable; not saved");
        }
        rest = rest.get(n + 1..).unwrap_or_default();
    }
    Ok(out)
}

/// The result of an ioctl some hosts do not have: `None` there.
fn optional<T>(
    what: &'static str,
    r: Result<T, kvm_ioctls::Error>,
) -> Result<Option<T>, VcpuStateError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if [libc::EINVAL, libc::ENOTTY, libc::EOPNOTSUPP].contains(&e.errno()) => Ok(None),
        Err(e) => Err(VcpuStateError::Ioctl(what, e)),
    }
}

/// Save vCPU `id`'s state. The caller has made sure the vCPU completed any
/// I/O it exited for (a KVM_RUN with immediate_exit set).
pub fn save(id: usize, vcpu: &VcpuFd, msr_list: &[u32]) -> Result<VcpuState, VcpuStateError> {
    let cpuid = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(ioctl("KVM_GET_CPUID2"))?;
    let xsave = optional("KVM_GET_XSAVE", vcpu.get_xsave())?;
    if xsave.is_none() {
        tracing::debug!("vcpu{id}: KVM_GET_XSAVE unavailable; saving the FPU state only");
    }
    let xcrs = optional("KVM_GET_XCRS", vcpu.get_xcrs())?;
    let tsc_khz = vcpu.get_tsc_khz().ok();
    Ok(VcpuState {
        id,
        cpuid: cpuid.as_slice().iter().copied().map(Exact).collect(),
        msrs: get_msrs(vcpu, msr_list)?.into_iter().map(Exact).collect(),
        regs: Exact(vcpu.get_regs().map_err(ioctl("KVM_GET_REGS"))?),
        sregs: Exact(vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?),
        fpu: vcpu.get_fpu().map_err(ioctl("KVM_GET_FPU"))?,
        xsave: xsave.map(Exact),
        xcrs: xcrs.map(Exact),
        lapic: Exact(vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?),
        mp_state: Exact(vcpu.get_mp_state().map_err(ioctl("KVM_GET_MP_STATE"))?),
        events: Exact(
            vcpu.get_vcpu_events()
                .map_err(ioctl("KVM_GET_VCPU_EVENTS"))?,
        ),
        debug_regs: Exact(vcpu.get_debug_regs().map_err(ioctl("KVM_GET_DEBUGREGS"))?),
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
        return Err(VcpuStateError::Invalid(format!(
            "vcpu{}: {} MSRs",
            state.id,
            state.msrs.len()
        )));
    }
    if let Some(m) = state.msrs.iter().find(|m| !allowed_msrs.contains(&m.index)) {
        return Err(VcpuStateError::Invalid(format!(
            "vcpu{}: MSR {:#x} is not one KVM lists on this host",
            state.id, m.index
        )));
    }
    if let Some(khz) = state.tsc_khz {
        if khz == 0 {
            return Err(VcpuStateError::Invalid(format!(
                "vcpu{}: TSC frequency 0",
                state.id
            )));
        }
    }
    Ok(())
}

/// MSRs in the order they must be set: TSC_DEADLINE after TSC (a deadline
/// is relative to the TSC), everything else as saved.
fn ordered_msrs(mut v: Vec<kvm_msr_entry>) -> Vec<kvm_msr_entry> {
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
                .map_err(|source| VcpuStateError::TscKhz {
                    id,
                    saved,
                    host,
                    source,
                })?;
        }
    }
    let entries: Vec<kvm_cpuid_entry2> = state.cpuid.iter().map(|e| e.0).collect();
    let cpuid = CpuId::from_entries(&entries)
        .map_err(|e| VcpuStateError::Invalid(format!("vcpu{id}: CPUID: {e:?}")))?;
    vcpu.set_cpuid2(&cpuid).map_err(ioctl("KVM_SET_CPUID2"))?;
    vcpu.set_mp_state(*state.mp_state)
        .map_err(ioctl("KVM_SET_MP_STATE"))?;
    vcpu.set_regs(&state.regs).map_err(ioctl("KVM_SET_REGS"))?;
    vcpu.set_sregs(&state.sregs)
        .map_err(ioctl("KVM_SET_SREGS"))?;
    vcpu.set_fpu(&state.fpu).map_err(ioctl("KVM_SET_FPU"))?;
    if let Some(x) = &state.xsave {
        // SAFETY: a legacy 4 KiB kvm_xsave, as KVM_GET_XSAVE returned it.
        unsafe { vcpu.set_xsave(x) }.map_err(ioctl("KVM_SET_XSAVE"))?;
    }
    if let Some(x) = &state.xcrs {
        vcpu.set_xcrs(x).map_err(ioctl("KVM_SET_XCRS"))?;
    }
    vcpu.set_debug_regs(&state.debug_regs)
        .map_err(ioctl("KVM_SET_DEBUGREGS"))?;
    vcpu.set_lapic(&state.lapic)
        .map_err(ioctl("KVM_SET_LAPIC"))?;
    let entries = ordered_msrs(state.msrs.iter().map(|m| m.0).collect());
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
    vcpu.set_vcpu_events(&state.events)
        .map_err(ioctl("KVM_SET_VCPU_EVENTS"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tsc_deadline_is_restored_after_tsc() {
        let msr = |index, data| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        };
        let msrs = [
            msr(MSR_IA32_TSC_DEADLINE, 5),
            msr(0x174, 1),
            msr(MSR_IA32_TSC, 7),
        ];
        let order: Vec<u32> = ordered_msrs(msrs.to_vec())
            .iter()
            .map(|e| e.index)
            .collect();
        assert_eq!(order, vec![MSR_IA32_TSC, 0x174, MSR_IA32_TSC_DEADLINE]);
    }
}
