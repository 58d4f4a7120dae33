//! Loading the kernel, initramfs and command line, and writing the boot
//! information the kernel reads. linux-loader does the work: its ELF
//! loader, [`Cmdline`] (built by [`kernel_cmdline`], written by
//! `load_cmdline`), and its PVH (`hvm_start_info`, memory map, module
//! list) and Linux (zero page) boot configurators.

use std::fs::File;
use std::path::Path;

use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::pvh::PvhBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::elf::start_info::{
    hvm_memmap_table_entry, hvm_modlist_entry, hvm_start_info,
};
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::{load_cmdline, KernelLoader};
use vm_memory::{Bytes, GuestAddress};

use super::e820::{e820_map, E820Entry};
use super::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, MMIO_GAP_START, PVH_INFO_START, PVH_MEMMAP_START,
    PVH_MODLIST_START, VIRTIO_MMIO_SIZE, ZERO_PAGE_START,
};
use super::regs::BootProtocol;
use crate::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot load kernel (expected an ELF vmlinux): {0}")]
    Kernel(#[source] linux_loader::loader::Error),
    #[error("kernel command line is {0} bytes, the limit is {max}", max = CMDLINE_MAX_SIZE - 1)]
    CmdlineTooLong(usize),
    #[error("invalid kernel command line: {0}")]
    Cmdline(#[source] linux_loader::cmdline::Error),
    #[error("cannot write the kernel command line to guest memory: {0}")]
    CmdlineLoad(#[source] linux_loader::loader::Error),
    #[error("initramfs of {size} bytes does not fit in guest RAM below {limit:#x} above the kernel (ends {kernel_end:#x})")]
    InitrdTooBig {
        size: u64,
        limit: u64,
        kernel_end: u64,
    },
    #[error("cannot read initramfs: {0}")]
    InitrdRead(#[source] vm_memory::GuestMemoryError),
    #[error("cannot write boot information to guest memory: {0}")]
    BootParams(#[source] linux_loader::configurator::Error),
    #[error("too many e820 entries: {0}")]
    TooManyE820(usize),
}

/// Where to start the boot vCPU and how.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootEntry {
    pub protocol: BootProtocol,
    pub entry: u64,
}

/// Where the initramfs was placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitrdPlacement {
    pub addr: u64,
    pub size: u64,
}

const PAGE_SIZE: u64 = 4096;

/// Address for an initramfs of `size` bytes: as high as possible in low
/// memory (below the MMIO hole), page aligned, above the kernel.
pub fn initrd_address(mem_size: u64, kernel_end: u64, size: u64) -> Result<u64, BootError> {
    let limit = mem_size.min(MMIO_GAP_START);
    let err = || BootError::InitrdTooBig {
        size,
        limit,
        kernel_end,
    };
    let addr = limit.checked_sub(size).ok_or_else(err)? & !(PAGE_SIZE - 1);
    if addr < kernel_end {
        return Err(err());
    }
    Ok(addr)
}

/// The kernel command line: `base` (the configured line, kept as given)
/// followed by one `virtio_mmio.device=4K@ADDR:IRQ` entry per device
/// window `(base address, IRQ)`, within the x86 limit
/// (`COMMAND_LINE_SIZE`, NUL included). Init arguments after ` -- ` in
/// `base` stay last.
pub fn kernel_cmdline(base: &str, virtio_mmio: &[(u64, u32)]) -> Result<Cmdline, BootError> {
    if base.len() >= CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong(base.len()));
    }
    let mut cmdline = Cmdline::try_from(base, CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    for &(addr, irq) in virtio_mmio {
        cmdline
            .add_virtio_mmio_device(VIRTIO_MMIO_SIZE, GuestAddress(addr), irq, None)
            .map_err(|e| match e {
                linux_loader::cmdline::Error::TooLarge => {
                    BootError::CmdlineTooLong(cmdline_len(&cmdline).saturating_add(1))
                }
                e => BootError::Cmdline(e),
            })?;
    }
    // A NUL in `base` only shows when the line is rendered.
    cmdline.as_cstring().map_err(BootError::Cmdline)?;
    Ok(cmdline)
}

/// The command line's length in bytes, without the NUL.
pub fn cmdline_len(cmdline: &Cmdline) -> usize {
    cmdline.as_cstring().map_or(0, |c| c.as_bytes().len())
}

/// Load everything and write the boot information. Returns how to enter
/// the kernel.
pub fn load(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &Cmdline,
) -> Result<BootEntry, BootError> {
    let open = |what, p: &Path| {
        File::open(p).map_err(|source| BootError::Open {
            what,
            path: p.display().to_string(),
            source,
        })
    };
    let mut kfile = open("kernel", kernel)?;
    let loaded = Elf::load(mem, None, &mut kfile, Some(GuestAddress(HIMEM_START)))
        .map_err(BootError::Kernel)?;

    let initrd = match initrd {
        Some(p) => {
            let mut f = open("initramfs", p)?;
            let size = f
                .metadata()
                .map_err(|source| BootError::Open {
                    what: "initramfs",
                    path: p.display().to_string(),
                    source,
                })?
                .len();
            let addr = initrd_address(mem_size, loaded.kernel_end, size)?;
            let len = usize::try_from(size).map_err(|_| BootError::InitrdTooBig {
                size,
                limit: MMIO_GAP_START,
                kernel_end: loaded.kernel_end,
            })?;
            mem.read_exact_volatile_from(GuestAddress(addr), &mut f, len)
                .map_err(BootError::InitrdRead)?;
            Some(InitrdPlacement { addr, size })
        }
        None => None,
    };

    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline).map_err(BootError::CmdlineLoad)?;

    let map = e820_map(mem_size);
    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => {
            PvhBootConfigurator::write_bootparams(&pvh_boot_params(&map, initrd), mem)
                .map_err(BootError::BootParams)?;
            Ok(BootEntry {
                protocol: BootProtocol::Pvh,
                entry: entry.0,
            })
        }
        _ => {
            let params = zero_page(&map, initrd, cmdline_len(cmdline))?;
            LinuxBootConfigurator::write_bootparams(
                &BootParams::new(&params, GuestAddress(ZERO_PAGE_START)),
                mem,
            )
            .map_err(BootError::BootParams)?;
            Ok(BootEntry {
                protocol: BootProtocol::Linux64,
                entry: loaded.kernel_load.0,
            })
        }
    }
}

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;

/// The PVH boot information: `hvm_start_info` (version 1) at
/// [`PVH_INFO_START`], the memory map at [`PVH_MEMMAP_START`] and, with an
/// initramfs, one module at [`PVH_MODLIST_START`]. No ACPI (rsdp 0).
pub fn pvh_boot_params(map: &[E820Entry], initrd: Option<InitrdPlacement>) -> BootParams {
    let memmap: Vec<hvm_memmap_table_entry> = map
        .iter()
        .map(|e| hvm_memmap_table_entry {
            addr: e.addr,
            size: e.size,
            type_: e.kind,
            reserved: 0,
        })
        .collect();
    let modules: Vec<hvm_modlist_entry> = initrd
        .iter()
        .map(|i| hvm_modlist_entry {
            paddr: i.addr,
            size: i.size,
            cmdline_paddr: 0,
            reserved: 0,
        })
        .collect();
    let start_info = hvm_start_info {
        magic: XEN_HVM_START_MAGIC,
        version: 1,
        flags: 0,
        nr_modules: modules.len() as u32,
        modlist_paddr: if modules.is_empty() {
            0
        } else {
            PVH_MODLIST_START
        },
        cmdline_paddr: CMDLINE_START,
        rsdp_paddr: 0,
        memmap_paddr: PVH_MEMMAP_START,
        memmap_entries: memmap.len() as u32,
        reserved: 0,
    };
    let mut params = BootParams::new(&start_info, GuestAddress(PVH_INFO_START));
    params.set_sections(&memmap, GuestAddress(PVH_MEMMAP_START));
    if !modules.is_empty() {
        params.set_modules(&modules, GuestAddress(PVH_MODLIST_START));
    }
    params
}

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448;
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;

/// The Linux zero page for the 64-bit boot protocol.
pub fn zero_page(
    map: &[E820Entry],
    initrd: Option<InitrdPlacement>,
    cmdline_len: usize,
) -> Result<boot_params, BootError> {
    let mut params = boot_params::default();
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    if let Some(i) = initrd {
        params.hdr.ramdisk_image = i.addr as u32;
        params.hdr.ramdisk_size = i.size as u32;
    }
    let mut table = params.e820_table;
    if map.len() > table.len() {
        return Err(BootError::TooManyE820(map.len()));
    }
    for (slot, e) in table.iter_mut().zip(map) {
        slot.addr = e.addr;
        slot.size = e.size;
        slot.r#type = e.kind;
    }
    params.e820_table = table;
    params.e820_entries = map.len() as u8;
    Ok(params)
}

#[cfg(test)]
mod tests {

    use super::*;
    /// A command line like the VMM's default one.
    const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=1 pci=off nomodule";

    #[test]
    fn initrd_goes_high_and_aligned() {
        let a = initrd_address(128 << 20, 20 << 20, 10_000).unwrap();
        assert_eq!(a % PAGE_SIZE, 0);
        assert!(a + 10_000 <= 128 << 20);
        assert!(a >= (128 << 20) - 4 * PAGE_SIZE);
        // never in the MMIO hole
        let b = initrd_address(8 << 30, 20 << 20, 4096).unwrap();
        assert_eq!(b, MMIO_GAP_START - 4096);
        assert!(initrd_address(64 << 20, 60 << 20, 8 << 20).is_err());
        assert!(initrd_address(1 << 20, 0, 2 << 20).is_err());
    }

    fn rendered(c: &Cmdline) -> String {
        c.as_cstring().unwrap().into_string().unwrap()
    }

    #[test]
    fn cmdline_is_the_base_then_one_entry_per_device() {
        let c = kernel_cmdline(DEFAULT_CMDLINE, &[(0xd000_0000, 5), (0xd000_1000, 6)]).unwrap();
        assert_eq!(
            rendered(&c),
            format!(
                "{DEFAULT_CMDLINE} virtio_mmio.device=4K@0xd0000000:5 virtio_mmio.device=4K@0xd0001000:6"
            )
        );
        assert_eq!(cmdline_len(&c), rendered(&c).len());
        // init arguments stay last, after the device entries
        let c = kernel_cmdline("console=ttyS0 -- init-arg", &[(0xd000_0000, 5)]).unwrap();
        assert_eq!(
            rendered(&c),
            "console=ttyS0 virtio_mmio.device=4K@0xd0000000:5 -- init-arg"
        );
        assert_eq!(rendered(&kernel_cmdline("", &[]).unwrap()), "");
    }

    #[test]
    fn cmdline_limits() {
        assert!(kernel_cmdline("console=ttyS0", &[]).is_ok());
        assert!(kernel_cmdline(&"a".repeat(CMDLINE_MAX_SIZE - 1), &[]).is_ok());
        assert!(matches!(
            kernel_cmdline(&"a".repeat(CMDLINE_MAX_SIZE), &[]),
            Err(BootError::CmdlineTooLong(n)) if n == CMDLINE_MAX_SIZE
        ));
        // fits alone, but not with the device entries
        assert!(matches!(
            kernel_cmdline(&"a".repeat(CMDLINE_MAX_SIZE - 10), &[(0xd000_0000, 5)]),
            Err(BootError::CmdlineTooLong(_))
        ));
        assert!(matches!(
            kernel_cmdline("a\0b", &[]),
            Err(BootError::Cmdline(_))
        ));
    }

    #[test]
    fn zero_page_fields() {
        let map = e820_map(256 << 20);
        let p = zero_page(
            &map,
            Some(InitrdPlacement {
                addr: 0x100_0000,
                size: 77,
            }),
            12,
        )
        .unwrap();
        let hdr = p.hdr;
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ hdr.ramdisk_size }, 77);
        assert_eq!({ p.e820_entries }, 3);
        let t = p.e820_table;
        assert_eq!({ t[2].addr }, HIMEM_START);
    }

    /// The bytes the VMM wrote by hand before it used linux-loader's PVH
    /// configurator: `hvm_start_info` v1, then the memory map entries and
    /// module entries (little endian, `hvm_memmap_table_entry` and
    /// `hvm_modlist_entry` layouts). The guest must see exactly these.
    fn hand_assembled(
        map: &[E820Entry],
        initrd: Option<InitrdPlacement>,
    ) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
        let nr_modules = u32::from(initrd.is_some());
        let mut info = Vec::new();
        info.extend_from_slice(&XEN_HVM_START_MAGIC.to_le_bytes());
        info.extend_from_slice(&1u32.to_le_bytes());
        info.extend_from_slice(&0u32.to_le_bytes());
        info.extend_from_slice(&nr_modules.to_le_bytes());
        let modlist = if nr_modules > 0 { PVH_MODLIST_START } else { 0 };
        info.extend_from_slice(&modlist.to_le_bytes());
        info.extend_from_slice(&CMDLINE_START.to_le_bytes());
        info.extend_from_slice(&0u64.to_le_bytes());
        info.extend_from_slice(&PVH_MEMMAP_START.to_le_bytes());
        info.extend_from_slice(&(map.len() as u32).to_le_bytes());
        info.extend_from_slice(&0u32.to_le_bytes());
        let mut memmap = Vec::new();
        for e in map {
            memmap.extend_from_slice(&e.addr.to_le_bytes());
            memmap.extend_from_slice(&e.size.to_le_bytes());
            memmap.extend_from_slice(&e.kind.to_le_bytes());
            memmap.extend_from_slice(&0u32.to_le_bytes());
        }
        let mut modules = Vec::new();
        if let Some(i) = initrd {
            modules.extend_from_slice(&i.addr.to_le_bytes());
            modules.extend_from_slice(&i.size.to_le_bytes());
            modules.extend_from_slice(&[0u8; 16]);
        }
        (info, memmap, modules)
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        mem.read_slice(&mut b, GuestAddress(addr)).unwrap();
        b
    }

    struct Files(std::path::PathBuf);
    impl Drop for Files {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn files(name: &str, pvh: bool, entry: u64) -> (Files, std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("burrow-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("vmlinux");
        std::fs::write(&k, crate::probe::tiny_elf(entry, &[0xf4], pvh)).unwrap();
        let initrd = dir.join("initrd");
        std::fs::write(&initrd, b"070701").unwrap();
        (Files(dir), k, initrd)
    }

    #[test]
    fn pvh_start_info_memmap_and_initrd_read_back_from_guest_memory() {
        let mem_size = 64u64 << 20;
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), mem_size as usize)]).unwrap();
        let (_guard, k, initrd) = files("pvh", true, 0x20_0000);
        let cmdline = kernel_cmdline(DEFAULT_CMDLINE, &[(0xd000_0000, 5)]).unwrap();
        let e = load(&mem, mem_size, &k, Some(&initrd), &cmdline).unwrap();
        assert_eq!(
            e,
            BootEntry {
                protocol: BootProtocol::Pvh,
                entry: 0x20_0000
            }
        );

        // start_info, field by field
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(info.magic, XEN_HVM_START_MAGIC);
        assert_eq!(info.version, 1);
        assert_eq!(info.flags, 0);
        assert_eq!(info.nr_modules, 1);
        assert_eq!(info.modlist_paddr, PVH_MODLIST_START);
        assert_eq!(info.cmdline_paddr, CMDLINE_START);
        assert_eq!(info.rsdp_paddr, 0);
        assert_eq!(info.memmap_paddr, PVH_MEMMAP_START);
        let map = e820_map(mem_size);
        assert_eq!(info.memmap_entries as usize, map.len());

        // the memory map the guest reads is the e820 map
        for (i, want) in map.iter().enumerate() {
            let at = PVH_MEMMAP_START + 24 * i as u64;
            let got: hvm_memmap_table_entry = mem.read_obj(GuestAddress(at)).unwrap();
            assert_eq!(
                (got.addr, got.size, got.type_, got.reserved),
                (want.addr, want.size, want.kind, 0)
            );
        }

        // the one module is the initramfs, where its bytes are
        let module: hvm_modlist_entry = mem.read_obj(GuestAddress(PVH_MODLIST_START)).unwrap();
        assert_eq!(module.size, 6);
        assert_eq!(module.cmdline_paddr, 0);
        assert_eq!(read(&mem, module.paddr, 6), b"070701");
        assert_eq!(
            module.paddr,
            initrd_address(mem_size, 0x20_1000, 6).unwrap()
        );

        // byte for byte what the hand-assembled version wrote
        let placed = InitrdPlacement {
            addr: module.paddr,
            size: 6,
        };
        let (want_info, want_map, want_mods) = hand_assembled(&map, Some(placed));
        assert_eq!(read(&mem, PVH_INFO_START, want_info.len()), want_info);
        assert_eq!(read(&mem, PVH_MEMMAP_START, want_map.len()), want_map);
        assert_eq!(read(&mem, PVH_MODLIST_START, want_mods.len()), want_mods);

        // the command line, NUL-terminated, where cmdline_paddr points
        let want = format!("{DEFAULT_CMDLINE} virtio_mmio.device=4K@0xd0000000:5\0");
        assert_eq!(read(&mem, CMDLINE_START, want.len()), want.as_bytes());
    }

    #[test]
    fn pvh_without_initrd_has_no_modules() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let (_guard, k, _) = files("pvh-noinitrd", true, 0x20_0000);
        // a module list left over from anything else must not be announced
        mem.write_slice(&[0xaa; 32], GuestAddress(PVH_MODLIST_START))
            .unwrap();
        load(&mem, 32 << 20, &k, None, &kernel_cmdline("", &[]).unwrap()).unwrap();
        let map = e820_map(32 << 20);
        let (want_info, want_map, _) = hand_assembled(&map, None);
        assert_eq!(read(&mem, PVH_INFO_START, want_info.len()), want_info);
        assert_eq!(read(&mem, PVH_MEMMAP_START, want_map.len()), want_map);
        let info: hvm_start_info = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!((info.nr_modules, info.modlist_paddr), (0, 0));
        assert_eq!(read(&mem, CMDLINE_START, 1), b"\0");
    }

    #[test]
    fn loads_a_minimal_elf_with_pvh_note_absent() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let (_guard, k, initrd) = files("boot", false, 0x100_0000);
        let cmdline = kernel_cmdline("console=ttyS0", &[]).unwrap();
        let e = load(&mem, 32 << 20, &k, Some(&initrd), &cmdline).unwrap();
        assert_eq!(
            e,
            BootEntry {
                protocol: BootProtocol::Linux64,
                entry: 0x100_0000
            }
        );
        let byte: u8 = mem.read_obj(GuestAddress(0x100_0000)).unwrap();
        assert_eq!(byte, 0xf4);
        let p: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        assert_eq!({ p.hdr.cmd_line_ptr } as u64, CMDLINE_START);
        assert_eq!({ p.hdr.cmdline_size }, 13);
        assert_eq!(read(&mem, CMDLINE_START, 14), b"console=ttyS0\0");
        let addr = { p.hdr.ramdisk_image } as u64;
        assert_eq!(read(&mem, addr, 6), b"070701");
        assert_eq!({ p.e820_entries } as usize, e820_map(32 << 20).len());
    }
}
