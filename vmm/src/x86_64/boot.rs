//! Loading the kernel, initramfs and command line, and writing the boot
//! information the kernel reads (PVH start info or Linux zero page).

use std::fs::File;
use std::path::Path;

use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::elf::{Elf, PvhBootCapability};
use linux_loader::loader::KernelLoader;
use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::e820::{e820_map, E820Entry};
use super::layout::{
    CMDLINE_MAX_SIZE, CMDLINE_START, HIMEM_START, MMIO_GAP_START, PVH_INFO_START,
    PVH_MEMMAP_START, PVH_MODLIST_START, ZERO_PAGE_START,
};
use super::regs::BootProtocol;

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
    #[error("kernel command line contains a NUL byte")]
    CmdlineNul,
    #[error("initramfs of {size} bytes does not fit in guest RAM below {limit:#x} above the kernel (ends {kernel_end:#x})")]
    InitrdTooBig { size: u64, limit: u64, kernel_end: u64 },
    #[error("cannot read initramfs: {0}")]
    InitrdRead(#[source] vm_memory::GuestMemoryError),
    #[error("cannot write boot information to guest memory: {0}")]
    Memory(#[source] vm_memory::GuestMemoryError),
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
    let err = BootError::InitrdTooBig {
        size,
        limit,
        kernel_end,
    };
    let addr = limit.checked_sub(size).ok_or(err)? & !(PAGE_SIZE - 1);
    if addr < kernel_end {
        return Err(BootError::InitrdTooBig {
            size,
            limit,
            kernel_end,
        });
    }
    Ok(addr)
}

/// Validate a kernel command line for the x86 limit.
pub fn check_cmdline(cmdline: &str) -> Result<(), BootError> {
    if cmdline.len() >= CMDLINE_MAX_SIZE {
        return Err(BootError::CmdlineTooLong(cmdline.len()));
    }
    if cmdline.as_bytes().contains(&0) {
        return Err(BootError::CmdlineNul);
    }
    Ok(())
}

/// Load everything and write the boot information. Returns how to enter
/// the kernel.
pub fn load(
    mem: &GuestMemoryMmap,
    mem_size: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
) -> Result<BootEntry, BootError> {
    check_cmdline(cmdline)?;
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

    let mut cbytes = cmdline.as_bytes().to_vec();
    cbytes.push(0);
    mem.write_slice(&cbytes, GuestAddress(CMDLINE_START))
        .map_err(BootError::Memory)?;

    let map = e820_map(mem_size);
    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => {
            write_pvh_info(mem, &map, initrd)?;
            Ok(BootEntry {
                protocol: BootProtocol::Pvh,
                entry: entry.0,
            })
        }
        _ => {
            write_zero_page(mem, &map, initrd, cmdline.len())?;
            Ok(BootEntry {
                protocol: BootProtocol::Linux64,
                entry: loaded.kernel_load.0,
            })
        }
    }
}

const XEN_HVM_START_MAGIC: u32 = 0x336e_c578;

/// `struct hvm_start_info` (version 1) as bytes.
pub fn pvh_start_info(nr_modules: u32, memmap_entries: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(56);
    b.extend_from_slice(&XEN_HVM_START_MAGIC.to_le_bytes());
    b.extend_from_slice(&1u32.to_le_bytes()); // version
    b.extend_from_slice(&0u32.to_le_bytes()); // flags
    b.extend_from_slice(&nr_modules.to_le_bytes());
    let modlist = if nr_modules > 0 { PVH_MODLIST_START } else { 0 };
    b.extend_from_slice(&modlist.to_le_bytes());
    b.extend_from_slice(&CMDLINE_START.to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // rsdp: no ACPI
    b.extend_from_slice(&PVH_MEMMAP_START.to_le_bytes());
    b.extend_from_slice(&memmap_entries.to_le_bytes());
    b.extend_from_slice(&0u32.to_le_bytes());
    b
}

fn write_pvh_info(
    mem: &GuestMemoryMmap,
    map: &[E820Entry],
    initrd: Option<InitrdPlacement>,
) -> Result<(), BootError> {
    let mut memmap = Vec::with_capacity(map.len() * 24);
    for e in map {
        memmap.extend_from_slice(&e.addr.to_le_bytes());
        memmap.extend_from_slice(&e.size.to_le_bytes());
        memmap.extend_from_slice(&e.kind.to_le_bytes());
        memmap.extend_from_slice(&0u32.to_le_bytes());
    }
    mem.write_slice(&memmap, GuestAddress(PVH_MEMMAP_START))
        .map_err(BootError::Memory)?;
    let nr_modules = if let Some(i) = initrd {
        let mut m = Vec::with_capacity(32);
        m.extend_from_slice(&i.addr.to_le_bytes());
        m.extend_from_slice(&i.size.to_le_bytes());
        m.extend_from_slice(&0u64.to_le_bytes());
        m.extend_from_slice(&0u64.to_le_bytes());
        mem.write_slice(&m, GuestAddress(PVH_MODLIST_START))
            .map_err(BootError::Memory)?;
        1
    } else {
        0
    };
    mem.write_slice(
        &pvh_start_info(nr_modules, map.len() as u32),
        GuestAddress(PVH_INFO_START),
    )
    .map_err(BootError::Memory)
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

fn write_zero_page(
    mem: &GuestMemoryMmap,
    map: &[E820Entry],
    initrd: Option<InitrdPlacement>,
    cmdline_len: usize,
) -> Result<(), BootError> {
    let params = zero_page(map, initrd, cmdline_len)?;
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(BootError::Memory)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn cmdline_limits() {
        assert!(check_cmdline("console=ttyS0").is_ok());
        assert!(check_cmdline(&"a".repeat(CMDLINE_MAX_SIZE)).is_err());
        assert!(check_cmdline("a\0b").is_err());
    }

    #[test]
    fn zero_page_fields() {
        let map = e820_map(256 << 20);
        let p = zero_page(&map, Some(InitrdPlacement { addr: 0x100_0000, size: 77 }), 12).unwrap();
        let hdr = p.hdr;
        assert_eq!({ hdr.boot_flag }, 0xaa55);
        assert_eq!({ hdr.header }, KERNEL_HDR_MAGIC);
        assert_eq!({ hdr.cmd_line_ptr }, CMDLINE_START as u32);
        assert_eq!({ hdr.ramdisk_size }, 77);
        assert_eq!({ p.e820_entries }, 3);
        let t = p.e820_table;
        assert_eq!({ t[2].addr }, HIMEM_START);
    }

    #[test]
    fn pvh_start_info_layout() {
        let b = pvh_start_info(1, 3);
        assert_eq!(b.len(), 56);
        assert_eq!(&b[0..4], &XEN_HVM_START_MAGIC.to_le_bytes());
        assert_eq!(u64::from_le_bytes(b[16..24].try_into().unwrap()), PVH_MODLIST_START);
        assert_eq!(u64::from_le_bytes(b[24..32].try_into().unwrap()), CMDLINE_START);
        assert_eq!(u64::from_le_bytes(b[40..48].try_into().unwrap()), PVH_MEMMAP_START);
        assert_eq!(u32::from_le_bytes(b[48..52].try_into().unwrap()), 3);
    }

    #[test]
    fn pvh_note_selects_pvh() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let k = std::env::temp_dir().join(format!("burrow-pvh-{}", std::process::id()));
        std::fs::write(&k, crate::probe::tiny_elf(0x20_0000, &[0xf4], true)).unwrap();
        let e = load(&mem, 32 << 20, &k, None, "").unwrap();
        assert_eq!(e, BootEntry { protocol: BootProtocol::Pvh, entry: 0x20_0000 });
        let magic: u32 = mem.read_obj(GuestAddress(PVH_INFO_START)).unwrap();
        assert_eq!(magic, XEN_HVM_START_MAGIC);
        std::fs::remove_file(&k).unwrap();
    }

    #[test]
    fn loads_a_minimal_elf_with_pvh_note_absent() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 32 << 20)]).unwrap();
        let dir = std::env::temp_dir().join(format!("burrow-boot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let k = dir.join("vmlinux");
        std::fs::write(&k, crate::probe::tiny_elf(0x100_0000, &[0xf4], false)).unwrap();
        let initrd = dir.join("initrd");
        std::fs::write(&initrd, b"070701").unwrap();
        let e = load(&mem, 32 << 20, &k, Some(&initrd), "console=ttyS0").unwrap();
        assert_eq!(e, BootEntry { protocol: BootProtocol::Linux64, entry: 0x100_0000 });
        let byte: u8 = mem.read_obj(GuestAddress(0x100_0000)).unwrap();
        assert_eq!(byte, 0xf4);
        let p: boot_params = mem.read_obj(GuestAddress(ZERO_PAGE_START)).unwrap();
        let addr = { p.hdr.ramdisk_image } as u64;
        let mut magic = [0u8; 6];
        mem.read_slice(&mut magic, GuestAddress(addr)).unwrap();
        assert_eq!(&magic, b"070701");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
