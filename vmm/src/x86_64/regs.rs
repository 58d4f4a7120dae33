//! Initial vCPU state for the two boot protocols: GDT, identity page tables,
//! segment/control registers, general registers, FPU, boot MSRs and LAPIC.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{
    BOOT_GDT_START, BOOT_IDT_START, BOOT_STACK_POINTER, PDE_START, PDPTE_START, PML4_START,
    PVH_INFO_START, ZERO_PAGE_START,
};

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("KVM ioctl {0} failed: {1}")]
    Ioctl(&'static str, #[source] kvm_ioctls::Error),
    #[error("cannot write boot structures to guest memory: {0}")]
    Memory(#[source] vm_memory::GuestMemoryError),
    #[error("cannot build MSR list")]
    Msrs,
}

/// How the vCPU enters the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootProtocol {
    /// PVH: 32-bit protected mode, paging off, `rbx` = start info.
    Pvh,
    /// Linux 64-bit boot protocol: long mode, identity-mapped, `rsi` = zero page.
    Linux64,
}

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Encode a GDT entry from flags, base and limit.
pub const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    (((base as u64) & 0xff00_0000) << 32)
        | (((flags as u64) & 0x0000_f0ff) << 40)
        | (((limit as u64) & 0x000f_0000) << 32)
        | (((base as u64) & 0x00ff_ffff) << 16)
        | ((limit as u64) & 0x0000_ffff)
}

/// Decode a GDT entry into the segment KVM expects, with selector `index * 8`.
pub fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = ((entry & 0xffff) | (((entry >> 48) & 0xf) << 16)) as u32;
    let limit = if g == 1 {
        (raw_limit << 12) | 0xfff
    } else {
        raw_limit
    };
    let present = ((entry >> 47) & 1) as u8;
    kvm_segment {
        base: ((entry >> 16) & 0x00ff_ffff) | (((entry >> 56) & 0xff) << 24),
        limit,
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present,
        dpl: ((entry >> 45) & 0x3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: u8::from(present == 0),
    }
}

/// The boot GDT for a protocol: null, code, data, TSS.
pub fn boot_gdt(protocol: BootProtocol) -> [u64; 4] {
    match protocol {
        // 64-bit code segment (L=1), flat data, TSS.
        BootProtocol::Linux64 => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xa09b, 0, 0xfffff),
            gdt_entry(0xc093, 0, 0xfffff),
            gdt_entry(0x808b, 0, 0xfffff),
        ],
        // 32-bit flat code and data (PVH enters in protected mode).
        BootProtocol::Pvh => [
            gdt_entry(0, 0, 0),
            gdt_entry(0xc09b, 0, 0xffff_ffff),
            gdt_entry(0xc093, 0, 0xffff_ffff),
            gdt_entry(0x008b, 0, 0x67),
        ],
    }
}

/// Special registers for the protocol; writes the GDT, IDT and (for the
/// 64-bit protocol) identity page tables into guest memory.
pub fn setup_sregs(
    mem: &GuestMemoryMmap,
    sregs: &mut kvm_sregs,
    protocol: BootProtocol,
) -> Result<(), RegsError> {
    let gdt = boot_gdt(protocol);
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + (i as u64) * 8))
            .map_err(RegsError::Memory)?;
    }
    mem.write_obj(0u64, GuestAddress(BOOT_IDT_START))
        .map_err(RegsError::Memory)?;
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = BOOT_IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;
    match protocol {
        BootProtocol::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
        BootProtocol::Linux64 => {
            setup_page_tables(mem)?;
            sregs.cr3 = PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
    }
    Ok(())
}

/// Identity-map the first 1 GiB with 2 MiB pages.
fn setup_page_tables(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    mem.write_obj(PDPTE_START | 0x03, GuestAddress(PML4_START))
        .map_err(RegsError::Memory)?;
    mem.write_obj(PDE_START | 0x03, GuestAddress(PDPTE_START))
        .map_err(RegsError::Memory)?;
    for i in 0..512u64 {
        mem.write_obj((i << 21) | 0x83, GuestAddress(PDE_START + i * 8))
            .map_err(RegsError::Memory)?;
    }
    Ok(())
}

/// General registers for the protocol.
pub fn boot_regs(protocol: BootProtocol, entry: u64) -> kvm_regs {
    match protocol {
        BootProtocol::Pvh => kvm_regs {
            rflags: 0x2,
            rip: entry,
            rbx: PVH_INFO_START,
            ..Default::default()
        },
        BootProtocol::Linux64 => kvm_regs {
            rflags: 0x2,
            rip: entry,
            rsp: BOOT_STACK_POINTER,
            rbp: BOOT_STACK_POINTER,
            rsi: ZERO_PAGE_START,
            ..Default::default()
        },
    }
}

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// MSR values at boot.
pub fn boot_msrs() -> Vec<(u32, u64)> {
    vec![
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        (MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn set_apic_delivery_mode(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

/// Set every piece of boot state on one vCPU.
pub fn configure_vcpu(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    protocol: BootProtocol,
    entry: u64,
    boot_cpu: bool,
) -> Result<(), RegsError> {
    let ioctl = |what| move |e| RegsError::Ioctl(what, e);
    // MSRs
    let entries: Vec<kvm_msr_entry> = boot_msrs()
        .into_iter()
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).map_err(|_| RegsError::Msrs)?;
    vcpu.set_msrs(&msrs).map_err(ioctl("KVM_SET_MSRS"))?;
    if boot_cpu {
        set_boot_registers(vcpu, mem, protocol, entry)?;
    }
    set_lint(vcpu)
}

/// Registers, segments and FPU of the boot CPU (the others start through
/// INIT/SIPI from the guest).
fn set_boot_registers(
    vcpu: &VcpuFd,
    mem: &GuestMemoryMmap,
    protocol: BootProtocol,
    entry: u64,
) -> Result<(), RegsError> {
    let ioctl = |what| move |e| RegsError::Ioctl(what, e);
    // general and special registers
    vcpu.set_regs(&boot_regs(protocol, entry))
        .map_err(ioctl("KVM_SET_REGS"))?;
    let mut sregs = vcpu.get_sregs().map_err(ioctl("KVM_GET_SREGS"))?;
    setup_sregs(mem, &mut sregs, protocol)?;
    vcpu.set_sregs(&sregs).map_err(ioctl("KVM_SET_SREGS"))?;
    // FPU
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(ioctl("KVM_SET_FPU"))?;
    Ok(())
}

fn set_lint(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let ioctl = |what| move |e| RegsError::Ioctl(what, e);
    // LAPIC: LINT0 = ExtINT (legacy PIC), LINT1 = NMI.
    let mut lapic = vcpu.get_lapic().map_err(ioctl("KVM_GET_LAPIC"))?;
    for (off, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let mut b = [0u8; 4];
        for (i, byte) in b.iter_mut().enumerate() {
            *byte = lapic.regs[off + i] as u8;
        }
        let v = set_apic_delivery_mode(u32::from_le_bytes(b), mode);
        for (i, byte) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[off + i] = *byte as _;
        }
    }
    vcpu.set_lapic(&lapic).map_err(ioctl("KVM_SET_LAPIC"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GuestMemoryMmap;

    #[test]
    fn gdt_entries_round_trip() {
        let gdt = boot_gdt(BootProtocol::Linux64);
        let code = segment_from_gdt(gdt[1], 1);
        assert_eq!(code.selector, 8);
        assert_eq!(code.l, 1, "64-bit code segment");
        assert_eq!(code.db, 0);
        assert_eq!(code.type_, 0xb);
        assert_eq!(code.present, 1);
        assert_eq!(code.limit, 0xffff_ffff);
        let data = segment_from_gdt(gdt[2], 2);
        assert_eq!(data.type_, 0x3);
        assert_eq!(data.db, 1);
        let pvh = boot_gdt(BootProtocol::Pvh);
        let code32 = segment_from_gdt(pvh[1], 1);
        assert_eq!((code32.l, code32.db, code32.base), (0, 1, 0));
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
    }

    #[test]
    fn long_mode_sregs_and_identity_map() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut sregs = kvm_sregs::default();
        setup_sregs(&mem, &mut sregs, BootProtocol::Linux64).unwrap();
        assert_eq!(sregs.cr3, PML4_START);
        assert_ne!(sregs.cr0 & X86_CR0_PG, 0);
        assert_ne!(sregs.efer & EFER_LMA, 0);
        let pde1: u64 = mem.read_obj(GuestAddress(PDE_START + 8)).unwrap();
        assert_eq!(pde1, (1 << 21) | 0x83);
        let gdt1: u64 = mem.read_obj(GuestAddress(BOOT_GDT_START + 8)).unwrap();
        assert_eq!(gdt1, boot_gdt(BootProtocol::Linux64)[1]);
    }

    #[test]
    fn pvh_sregs_are_protected_mode_without_paging() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let mut sregs = kvm_sregs::default();
        setup_sregs(&mem, &mut sregs, BootProtocol::Pvh).unwrap();
        assert_eq!(sregs.cr0 & X86_CR0_PG, 0);
        assert_eq!(sregs.cr0 & X86_CR0_PE, 1);
        assert_eq!(sregs.efer, 0);
        let regs = boot_regs(BootProtocol::Pvh, 0x100_0000);
        assert_eq!(regs.rbx, PVH_INFO_START);
    }

    #[test]
    fn apic_mode_bits() {
        assert_eq!(set_apic_delivery_mode(0x0001_0700, APIC_MODE_NMI), 0x0001_0400);
    }
}
