//! What a vCPU looked like when the guest died (triple fault): enough to
//! tell a guest bug (bad stack, bad IDT) from a VMM or host one.

use kvm_ioctls::VcpuFd;

/// One line with the registers that matter for a fatal fault, or why they
/// could not be read.
pub fn describe(vcpu: &VcpuFd) -> String {
    let regs = match vcpu.get_regs() {
        Ok(r) => format!(
            "rip={:#x} rsp={:#x} rflags={:#x} rax={:#x}",
            r.rip, r.rsp, r.rflags, r.rax
        ),
        Err(e) => format!("regs unreadable: {e}"),
    };
    let sregs = match vcpu.get_sregs() {
        Ok(s) => format!(
            "cs={:#x} ss={:#x} cr0={:#x} cr2={:#x} cr3={:#x} cr4={:#x} efer={:#x} \
             idt={:#x}/{:#x} gdt={:#x}/{:#x} tr={:#x}@{:#x}",
            s.cs.selector,
            s.ss.selector,
            s.cr0,
            s.cr2,
            s.cr3,
            s.cr4,
            s.efer,
            s.idt.base,
            s.idt.limit,
            s.gdt.base,
            s.gdt.limit,
            s.tr.selector,
            s.tr.base
        ),
        Err(e) => format!("sregs unreadable: {e}"),
    };
    let events = match vcpu.get_vcpu_events() {
        Ok(e) => format!(
            "exception(injected={} nr={} has_error={} error={:#x}) interrupt(injected={} nr={}) nmi(injected={} pending={})",
            e.exception.injected,
            e.exception.nr,
            e.exception.has_error_code,
            e.exception.error_code,
            e.interrupt.injected,
            e.interrupt.nr,
            e.nmi.injected,
            e.nmi.pending
        ),
        Err(e) => format!("events unreadable: {e}"),
    };
    format!("{regs} {sregs} {events}")
}
