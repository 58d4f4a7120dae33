//! Guest physical memory layout (x86_64). The low-memory addresses follow the
//! conventions Firecracker and the Linux boot protocol use.

/// GDT used while booting.
pub const BOOT_GDT_START: u64 = 0x500;
/// Empty IDT used while booting.
pub const BOOT_IDT_START: u64 = 0x520;
/// PVH `hvm_start_info`.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (initramfs), right after the start info.
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map.
pub const PVH_MEMMAP_START: u64 = 0x7000;
/// Linux boot protocol "zero page" (`struct boot_params`).
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer for the 64-bit boot protocol.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity-mapping page tables for the 64-bit boot protocol.
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Largest command line the x86 kernel accepts (COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Start of the extended BIOS data area; the MP table lives here.
pub const EBDA_START: u64 = 0x9fc00;
/// Start of high memory: the kernel is loaded at or above this.
pub const HIMEM_START: u64 = 0x10_0000;
/// 32-bit MMIO hole: guest RAM never overlaps [MMIO_GAP_START, 4 GiB).
pub const MMIO_GAP_START: u64 = 0xc000_0000;
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// virtio-mmio devices: one 4 KiB window each from here.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IOAPIC and local APIC default addresses.
pub const IOAPIC_ADDR: u32 = 0xfec0_0000;
pub const APIC_ADDR: u32 = 0xfee0_0000;
/// KVM's TSS (needed on Intel before creating vCPUs), just below the APIC.
pub const KVM_TSS_ADDRESS: usize = 0xfffb_d000;
/// First IRQ handed to virtio devices; legacy devices use lower ones.
pub const IRQ_VIRTIO_START: u32 = 5;
/// Last IRQ (the in-kernel IOAPIC has 24 pins).
pub const IRQ_MAX: u32 = 23;
/// COM1 and the i8042 keyboard controller.
pub const IRQ_SERIAL: u32 = 4;
pub const IRQ_I8042: u32 = 1;
pub const SERIAL_PORT_BASE: u16 = 0x3f8;
pub const I8042_DATA_PORT: u16 = 0x60;
pub const I8042_CMD_PORT: u16 = 0x64;
