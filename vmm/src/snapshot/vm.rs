//! VM-wide KVM state: the in-kernel irqchip (PIC master and slave, IOAPIC),
//! the PIT and the kvmclock base. Saved after the vCPUs, restored before
//! the devices (a device that raises an interrupt on restore, like vsock's
//! transport reset, must find the irqchip already in place).

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use super::pod::Pod;
use super::vcpu::VcpuStateError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmState {
    pub pic_master: Pod<kvm_irqchip>,
    pub pic_slave: Pod<kvm_irqchip>,
    pub ioapic: Pod<kvm_irqchip>,
    pub pit: Pod<kvm_pit_state2>,
    pub clock: Pod<kvm_clock_data>,
}

fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuStateError {
    move |e| VcpuStateError::Ioctl(what, e)
}

fn get_chip(vm: &VmFd, chip_id: u32) -> Result<Pod<kvm_irqchip>, VcpuStateError> {
    let mut chip = kvm_irqchip { chip_id, ..Default::default() };
    vm.get_irqchip(&mut chip).map_err(ioctl("KVM_GET_IRQCHIP"))?;
    Ok(Pod(chip))
}

/// Save the VM's state (its vCPUs are paused).
pub fn save(vm: &VmFd) -> Result<VmState, VcpuStateError> {
    Ok(VmState {
        pic_master: get_chip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: get_chip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: get_chip(vm, KVM_IRQCHIP_IOAPIC)?,
        pit: Pod(vm.get_pit2().map_err(ioctl("KVM_GET_PIT2"))?),
        clock: Pod(vm.get_clock().map_err(ioctl("KVM_GET_CLOCK"))?),
    })
}

/// Load `state` into a VM that has its irqchip and PIT created.
pub fn restore(vm: &VmFd, state: &VmState) -> Result<(), VcpuStateError> {
    for (chip, id) in [
        (&state.pic_master, KVM_IRQCHIP_PIC_MASTER),
        (&state.pic_slave, KVM_IRQCHIP_PIC_SLAVE),
        (&state.ioapic, KVM_IRQCHIP_IOAPIC),
    ] {
        if chip.0.chip_id != id {
            return Err(VcpuStateError::Invalid(format!(
                "irqchip entry for chip {id} says chip {}",
                chip.0.chip_id
            )));
        }
        vm.set_irqchip(&chip.0).map_err(ioctl("KVM_SET_IRQCHIP"))?;
    }
    vm.set_pit2(&state.pit.0).map_err(ioctl("KVM_SET_PIT2"))?;
    // Only the clock value: the flags KVM_GET_CLOCK reports (TSC_STABLE,
    // HOST_TSC, REALTIME) describe the old host; setting REALTIME would
    // make KVM advance the clock by the wall time the VM spent saved.
    let clock = kvm_clock_data { clock: state.clock.0.clock, ..Default::default() };
    vm.set_clock(&clock).map_err(ioctl("KVM_SET_CLOCK"))?;
    Ok(())
}
