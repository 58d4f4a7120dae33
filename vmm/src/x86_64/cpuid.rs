//! CPUID: KVM's supported set, adjusted per vCPU (APIC ids, topology, the
//! hypervisor bit, the TSC-deadline timer KVM emulates but does not list)
//! and stripped of what we do not emulate (PMU).

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE: u32 = 0x4;
const LEAF_POWER: u32 = 0x6;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY: u32 = 0x8000_001e;
const ECX_HYPERVISOR: u32 = 1 << 31;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const EDX_HTT: u32 = 1 << 28;

/// Adjust `cpuid` (from `KVM_GET_SUPPORTED_CPUID`) for vCPU `index` of `count`.
///
/// `tsc_deadline` (`KVM_CAP_TSC_DEADLINE_TIMER`, which KVM_GET_SUPPORTED_CPUID
/// never reports in leaf 1) tells the guest its local APIC timer runs off
/// the TSC. With kvm-clock giving it the TSC's frequency, Linux then needs
/// no PIT at all: it neither calibrates against it nor arms it as its boot
/// clock event, so the in-kernel PIT's worker never injects an interrupt
/// (a nested test host's freezes came with that worker's stacks).
pub fn filter(cpuid: &mut CpuId, index: u8, count: u8, tsc_deadline: bool) {
    for e in cpuid.as_mut_slice().iter_mut() {
        match e.function {
            LEAF_FEATURES => {
                // EBX: [31:24] initial APIC id, [23:16] logical CPUs, [15:8] CLFLUSH size (8 qwords)
                e.ebx = (u32::from(index) << 24) | (u32::from(count) << 16) | (8 << 8);
                e.ecx |= ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE => {
                // EAX[31:26]: cores per package - 1; [25:14]: threads sharing the cache - 1.
                let cores = u32::from(count.max(1) - 1) & 0x3f;
                e.eax = (e.eax & 0x3fff) | (cores << 26);
            }
            LEAF_POWER => {
                // No energy-performance bias MSR.
                e.ecx &= !(1 << 3);
            }
            LEAF_PMU => {
                // No PMU emulation.
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            LEAF_TOPOLOGY => {
                // One thread per core, `count` cores in one package.
                e.edx = u32::from(index);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        e.eax = 8;
                        e.ebx = u32::from(count);
                        e.ecx = (2 << 8) | 1;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            LEAF_EXT_TOPOLOGY => {
                e.eax = u32::from(index);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn apic_id_and_hypervisor_bit() {
        let entries = [
            kvm_cpuid_entry2 { function: 1, edx: EDX_HTT, ..Default::default() },
            kvm_cpuid_entry2 { function: 0xa, eax: 0x0703_0105, ..Default::default() },
            kvm_cpuid_entry2 { function: 0xb, index: 1, ..Default::default() },
        ];
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        filter(&mut cpuid, 3, 1, false);
        let s = cpuid.as_slice();
        assert_eq!(s[0].ebx >> 24, 3);
        assert_ne!(s[0].ecx & ECX_HYPERVISOR, 0);
        assert_eq!(s[0].ecx & ECX_TSC_DEADLINE, 0);
        assert_eq!(s[0].edx & EDX_HTT, 0);
        assert_eq!(s[1].eax, 0);
        assert_eq!(s[2].edx, 3);
        assert_eq!(s[2].ebx, 1);
    }

    #[test]
    fn tsc_deadline_only_when_kvm_has_it() {
        let entries = [kvm_cpuid_entry2 { function: 1, ..Default::default() }];
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        filter(&mut cpuid, 0, 1, true);
        assert_ne!(cpuid.as_slice()[0].ecx & ECX_TSC_DEADLINE, 0);
    }
}
