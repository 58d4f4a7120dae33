//! Rebuilding a VM from a snapshot directory (`burrow-vmm run --restore`).

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

use kvm_ioctls::Kvm;
use vmm_sys_util::eventfd::EventFd;

use super::{
    ioctl, lock, new_irqfd, MmioDevice, new_vm, register_memory, serial_output, wire_virtio, Parts, Vmm, VmmError,
};
use crate::bus::Bus;
use crate::config::SerialOutput;
use crate::devices::i8042::persist::I8042Context;
use crate::devices::i8042::I8042;
use crate::devices::serial::persist::SerialContext;
use crate::devices::serial::{IrqEvt, Serial};
use crate::devices::virtio::block::persist::BlockContext;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mem::persist::MemContext;
use crate::devices::virtio::mem::Mem;
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::net::persist::NetContext;
use crate::devices::virtio::net::{Net, Tap};
use crate::devices::virtio::persist::{DeviceContext, DeviceState, MmioContext};
use crate::devices::virtio::vsock::persist::VsockContext;
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::VirtioDevice;
use crate::snapshot::microvm::{self, MemoryState, MicrovmState};
use crate::snapshot::{self, Persist};
use crate::vcpu;
use crate::x86_64::layout::{IRQ_I8042, IRQ_SERIAL};

/// How to restore a snapshot: where it is and what the new VM may change
/// (console, vsock socket path, disk paths; each disk must have the size
/// the snapshot recorded).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreConfig {
    pub dir: PathBuf,
    pub serial: SerialOutput,
    pub serial_stdin: bool,
    /// Host-side vsock socket (default: the one the snapshot recorded).
    pub vsock: Option<PathBuf>,
    /// Disk image paths in device order (default: the recorded ones).
    pub disks: Vec<PathBuf>,
    /// The NIC's tap (default: the recorded tap name, opened here).
    pub net: Option<burrow_vmm_api::TapSource>,
}

/// Checks of a restore's inputs that need no VM: the disk paths (given or
/// recorded) exist and have the sizes the snapshot recorded. Run before
/// anything is created, so a mismatch touches nothing.
pub fn check_restore(opts: &RestoreConfig, state: &MicrovmState) -> Result<(), VmmError> {
    // Slots come back with what was attached (checked like a disk), or
    // with the paths given after the disks' (in slot order).
    let (disks, slots) = state.disks_and_filled_slots();
    let n = opts.disks.len();
    if n != 0 && n != disks.len() && n != disks.len() + slots.len() {
        return Err(VmmError::Restore(format!(
            "{n} disk paths given, the snapshot has {} disks and {} filled slots",
            disks.len(),
            slots.len()
        )));
    }
    let given = disks.iter().chain(slots.iter()).enumerate().map(|(i, b)| (opts.disks.get(i).unwrap_or(&b.path), *b));
    for (path, b) in given {
        let len = std::fs::File::open(path)
            .and_then(|f| crate::devices::virtio::block::disk_bytes(&f))
            .map_err(|e| VmmError::Restore(format!("disk {}: {e}", path.display())))?;
        let want = b.capacity.saturating_mul(crate::devices::virtio::block::SECTOR_SIZE);
        if len != want {
            return Err(VmmError::Restore(format!(
                "disk {} is {len} bytes, the snapshot's disk was {want} bytes",
                path.display()
            )));
        }
    }
    Ok(())
}

impl Vmm {
    /// Rebuild a VM from the snapshot `load`ed from `opts.dir` (already
    /// checked by [`microvm::load`]). Order as Firecracker's: VM, irqchip
    /// and PIT, memory (the snapshot file mapped MAP_PRIVATE), VM state
    /// (irqchip, PIT, clock), vCPUs with CPUID first then the rest,
    /// devices from state; the VM then waits to be started.
    pub fn restore(
        opts: &RestoreConfig,
        state: &MicrovmState,
        chain: &[(PathBuf, MemoryState)],
    ) -> Result<Self, VmmError> {
        Self::restore_packed(opts, state, chain, None)
    }

    /// [`Self::restore`], with the memory's data mapped in place from a
    /// packed file (`--packed-memory-fd`) over the full snapshot's holes.
    pub fn restore_packed(
        opts: &RestoreConfig,
        state: &MicrovmState,
        chain: &[(PathBuf, MemoryState)],
        packed: Option<&microvm::PackedMemory>,
    ) -> Result<Self, VmmError> {
        let restore_err = |e: &dyn std::fmt::Display| VmmError::Restore(e.to_string());
        check_restore(opts, state)?;
        vcpu::install_kick_handler().map_err(|e| VmmError::Io("signal handler", e))?;
        let kvm = Kvm::new().map_err(VmmError::Kvm)?;
        let vm = new_vm(&kvm)?;
        let mem = microvm::map_memory(chain).map_err(|e| restore_err(&e))?;
        if let Some(p) = packed {
            if chain.len() != 1 {
                return Err(VmmError::Restore("packed memory restores a full snapshot only".into()));
            }
            microvm::map_packed(&mem, p).map_err(|e| restore_err(&e))?;
        }
        let dirty_log = match register_memory(&vm, &mem, true) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("dirty logging unavailable ({e}); incremental snapshots will be refused");
                register_memory(&vm, &mem, false)?;
                false
            }
        };
        snapshot::vm::restore(&vm, &state.vm).map_err(|e| restore_err(&e))?;

        let msr_list = snapshot::vcpu::msrs_to_save(&kvm).map_err(|e| restore_err(&e))?;
        let mut pending_vcpus = Vec::new();
        for vs in &state.vcpus {
            snapshot::vcpu::validate(vs, &msr_list).map_err(|e| restore_err(&e))?;
            let vcpu = vm
                .create_vcpu(vs.id as u64)
                .map_err(ioctl("KVM_CREATE_VCPU"))?;
            snapshot::vcpu::restore(&vcpu, vs)
                .map_err(|e| VmmError::Restore(format!("vcpu{}: {e}", vs.id)))?;
            pending_vcpus.push(vcpu);
        }

        let mut irqfds = Vec::new();
        let panicked = Arc::new(AtomicBool::new(false));
        let out = serial_output(&opts.serial, &panicked)?;
        let serial_irq = new_irqfd(&vm, IRQ_SERIAL)?;
        irqfds.push(serial_irq.clone());
        let serial = Serial::restore(SerialContext { irq: IrqEvt(serial_irq), out }, &state.serial)
            .map_err(|e| restore_err(&e))?;
        let kbd_irq = new_irqfd(&vm, IRQ_I8042)?;
        irqfds.push(kbd_irq.clone());
        let reset_evt = Arc::new(
            EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?,
        );
        let i8042 = I8042::restore(I8042Context { irq: kbd_irq, reset: reset_evt.clone() }, &state.i8042)
            .map_err(|e| restore_err(&e))?;

        let mut devices = Vec::new();
        let mut mmio = Vec::new();
        // Given paths replace the disks', then the filled slots'.
        let n_disks = state.disks_and_filled_slots().0.len();
        let mut disk_no = 0;
        let mut slot_no = 0;
        for (i, ms) in state.devices.iter().enumerate() {
            let dev_err = |e: &dyn std::fmt::Display| VmmError::Restore(format!("device {i}: {e}"));
            let max_sizes = match &ms.device {
                DeviceState::Block(_) => 1,
                DeviceState::Vsock(_) => 3,
                DeviceState::Net(_) => 2,
                DeviceState::Mem(_) => 1,
                DeviceState::Unsupported(t) => {
                    return Err(VmmError::Restore(format!("device {i}: type {t} cannot be restored")))
                }
            };
            let w = wire_virtio(&vm, i, max_sizes)?;
            let ctx = DeviceContext { mem: mem.clone(), irq: w.irq.clone(), acked_features: ms.registers.acked_features };
            let dev: Box<dyn VirtioDevice> = match &ms.device {
                DeviceState::Block(b) => {
                    let path = match b.slot {
                        Some(_) if b.path.as_os_str().is_empty() => b.path.clone(),
                        Some(_) => {
                            slot_no += 1;
                            opts.disks.get(n_disks + slot_no - 1).cloned().unwrap_or_else(|| b.path.clone())
                        }
                        None => {
                            disk_no += 1;
                            opts.disks.get(disk_no - 1).cloned().unwrap_or_else(|| b.path.clone())
                        }
                    };
                    Box::new(Block::restore(BlockContext { path, device: ctx }, b).map_err(|e| dev_err(&e))?)
                }
                DeviceState::Vsock(v) => {
                    let uds_path = opts.vsock.clone().unwrap_or_else(|| v.uds_path.clone());
                    Box::new(Vsock::restore(VsockContext { uds_path, device: ctx }, v).map_err(|e| dev_err(&e))?)
                }
                DeviceState::Net(n) => {
                    let source = opts.net.clone().unwrap_or_else(|| burrow_vmm_api::TapSource::Name(n.tap_name.clone()));
                    let tap = Tap::open(&source).map_err(|e| dev_err(&e))?;
                    Box::new(Net::restore(NetContext { tap, device: ctx }, n).map_err(|e| dev_err(&e))?)
                }
                DeviceState::Mem(m) => {
                    let host = Some(mem.clone());
                    let m = Mem::restore(MemContext { host, device: ctx }, m).map_err(|e| dev_err(&e))?;
                    m.guard_region().map_err(|e| dev_err(&e))?;
                    Box::new(m)
                }
                DeviceState::Unsupported(_) => return Err(dev_err(&"unsupported")),
            };
            let backend_fd = dev.backend_fd();
            let transport = MmioTransport::restore(MmioContext { device: dev, mem: mem.clone(), irq: w.irq }, ms)
                .map_err(|e| dev_err(&e))?;
            let transport = Arc::new(Mutex::new(transport));
            mmio.push((w.base, transport.clone()));
            devices.push(MmioDevice { transport, queue_evts: w.queue_evts, backend_fd });
        }
        // Devices that tell the guest about the restore (vsock's transport
        // reset) do so now that the irqchip and every device are in place.
        for (i, d) in devices.iter().enumerate() {
            if let Err(e) = lock(&d.transport).device_mut().on_restored() {
                tracing::warn!("device {i} after restore: {e}");
            }
        }

        let dir = opts.dir.canonicalize().unwrap_or_else(|_| opts.dir.clone());
        tracing::info!("restored {} vCPUs, {} MiB from {}", state.vcpu_count, state.mem_mib, dir.display());
        Self::assemble(Parts {
            kvm,
            vm,
            mem,
            vcpu_count: state.vcpu_count,
            vcpus_running: state.vcpus_running.unwrap_or(state.vcpu_count),
            mem_mib: state.mem_mib,
            mem_max_mib: state.mem_max_mib,
            dirty_log,
            last_snapshot: Some((dir, state.id)),
            pending_vcpus,
            msr_list,
            bus: Bus { serial: Arc::new(Mutex::new(serial)), i8042: Arc::new(Mutex::new(i8042)), mmio },
            devices,
            reset_evt,
            panicked,
            serial_stdin: opts.serial_stdin,
            irqfds,
        })
    }
}
