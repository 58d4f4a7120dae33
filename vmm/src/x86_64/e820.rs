//! The guest's memory map, shared by both boot protocols.

use super::layout::{EBDA_START, HIMEM_START, MMIO_GAP_END, MMIO_GAP_START};

pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

/// One entry of the memory map.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct E820Entry {
    pub addr: u64,
    pub size: u64,
    pub kind: u32,
}

/// Guest RAM ranges `(start, len)` for a guest with `mem_size` bytes,
/// leaving the 32-bit MMIO hole free.
pub fn ram_ranges(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_size - MMIO_GAP_START),
        ]
    }
}

/// First guest physical address past all RAM of a guest with `mem_size`
/// bytes (the hotplug region of virtio-mem starts at or above it).
pub fn ram_end(mem_size: u64) -> u64 {
    ram_ranges(mem_size).last().map_or(0, |&(s, l)| s + l)
}

/// The e820 map: low RAM up to the EBDA, the EBDA/BIOS area reserved, then
/// RAM from 1 MiB (split around the MMIO hole).
pub fn e820_map(mem_size: u64) -> Vec<E820Entry> {
    let mut map = vec![
        E820Entry {
            addr: 0,
            size: EBDA_START,
            kind: E820_RAM,
        },
        E820Entry {
            addr: EBDA_START,
            size: HIMEM_START - EBDA_START,
            kind: E820_RESERVED,
        },
    ];
    for (start, len) in ram_ranges(mem_size) {
        let end = start + len;
        let start = start.max(HIMEM_START);
        if end > start {
            map.push(E820Entry {
                addr: start,
                size: end - start,
                kind: E820_RAM,
            });
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_has_low_and_high_ram() {
        let map = e820_map(128 << 20);
        assert_eq!(map.len(), 3);
        assert_eq!(map[0], E820Entry { addr: 0, size: EBDA_START, kind: E820_RAM });
        assert_eq!(map[1].kind, E820_RESERVED);
        assert_eq!(map[2], E820Entry { addr: HIMEM_START, size: (128 << 20) - HIMEM_START, kind: E820_RAM });
    }

    #[test]
    fn large_guest_skips_mmio_hole() {
        let size = 4u64 << 30;
        let map = e820_map(size);
        assert_eq!(map.len(), 4);
        assert_eq!(map[2].addr + map[2].size, MMIO_GAP_START);
        assert_eq!(map[3].addr, MMIO_GAP_END);
        let ram: u64 = ram_ranges(size).iter().map(|r| r.1).sum();
        assert_eq!(ram, size);
        for e in &map {
            assert!(e.addr + e.size <= MMIO_GAP_START || e.addr >= MMIO_GAP_END);
        }
    }
}
