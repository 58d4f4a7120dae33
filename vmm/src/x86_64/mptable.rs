//! Intel MultiProcessor table. Without ACPI this is how the guest kernel
//! learns how many CPUs there are and where the IOAPIC and its pins are.
//! Layout per the MP spec 1.4; written at the start of the EBDA.

use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::layout::{APIC_ADDR, EBDA_START, IOAPIC_ADDR, IRQ_MAX};

#[derive(Debug, thiserror::Error)]
pub enum MptableError {
    #[error("too many vCPUs for the MP table: {0}")]
    TooManyCpus(u8),
    #[error("cannot write the MP table: {0}")]
    Memory(#[source] vm_memory::GuestMemoryError),
}

const APIC_VERSION: u8 = 0x14;
const IOAPIC_VERSION: u8 = 0x11;
const CPU_ENABLED: u8 = 1;
const CPU_BOOTPROCESSOR: u8 = 2;
const MP_INT: u8 = 0;
const MP_NMI: u8 = 1;
const MP_EXTINT: u8 = 3;
/// Largest vCPU count: APIC ids are 8 bits and the IOAPIC takes the next id.
pub const MAX_CPUS: u8 = 254;

fn checksum(bytes: &[u8]) -> u8 {
    bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)).wrapping_neg()
}

/// Build the MP floating pointer and configuration table as bytes placed at
/// `base` (the table follows the 16-byte floating pointer).
pub fn build(base: u64, num_cpus: u8) -> Result<Vec<u8>, MptableError> {
    if num_cpus == 0 || num_cpus > MAX_CPUS {
        return Err(MptableError::TooManyCpus(num_cpus));
    }
    let ioapic_id = num_cpus + 1;
    let table_addr = base + 16;
    // Entries first, header after (it needs their length and count).
    let mut entries = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..num_cpus {
        let flags = CPU_ENABLED | if cpu == 0 { CPU_BOOTPROCESSOR } else { 0 };
        entries.extend_from_slice(&[0, cpu, APIC_VERSION, flags]);
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0u8; 8]);
        count += 1;
    }
    entries.extend_from_slice(&[1, 0]);
    entries.extend_from_slice(b"ISA   ");
    count += 1;
    entries.extend_from_slice(&[2, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    count += 1;
    for irq in 0..=IRQ_MAX as u8 {
        // type, irqtype, irqflag (conforms to bus), src bus, src irq, dst apic, dst pin
        entries.extend_from_slice(&[3, MP_INT, 0, 0, 0, irq, ioapic_id, irq]);
        count += 1;
    }
    entries.extend_from_slice(&[4, MP_EXTINT, 0, 0, 0, 0, 0, 0]);
    entries.extend_from_slice(&[4, MP_NMI, 0, 0, 0, 0, 0xff, 1]);
    count += 2;

    let table_len = 44 + entries.len();
    let mut table = Vec::with_capacity(table_len);
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&(table_len as u16).to_le_bytes());
    table.push(4); // spec revision 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"BURROW  ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // OEM table pointer
    table.extend_from_slice(&0u16.to_le_bytes()); // OEM table size
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&APIC_ADDR.to_le_bytes());
    table.extend_from_slice(&0u16.to_le_bytes()); // extended table length
    table.push(0); // extended table checksum
    table.push(0);
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut fp = Vec::with_capacity(16 + table.len());
    fp.extend_from_slice(b"_MP_");
    fp.extend_from_slice(&(table_addr as u32).to_le_bytes());
    fp.push(1); // length in 16-byte units
    fp.push(4); // spec revision
    fp.push(0); // checksum, below
    fp.extend_from_slice(&[0; 5]);
    fp[10] = checksum(&fp);
    fp.extend_from_slice(&table);
    Ok(fp)
}

/// Write the MP table for `num_cpus` vCPUs at the start of the EBDA.
pub fn setup(mem: &GuestMemoryMmap, num_cpus: u8) -> Result<(), MptableError> {
    let bytes = build(EBDA_START, num_cpus)?;
    mem.write_slice(&bytes, GuestAddress(EBDA_START))
        .map_err(MptableError::Memory)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_counts() {
        let t = build(EBDA_START, 2).unwrap();
        assert_eq!(&t[0..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let ptr = u32::from_le_bytes([t[4], t[5], t[6], t[7]]) as u64;
        assert_eq!(ptr, EBDA_START + 16);
        let table = &t[16..];
        assert_eq!(&table[0..4], b"PCMP");
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        assert_eq!(len, table.len());
        assert_eq!(table.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let count = u16::from_le_bytes([table[34], table[35]]);
        assert_eq!(count, 2 + 1 + 1 + 24 + 2);
        // fits below the end of the 1 KiB EBDA window the kernel scans
        assert!(t.len() <= 1024);
    }

    #[test]
    fn bounds() {
        assert!(build(EBDA_START, 0).is_err());
        assert!(build(EBDA_START, 255).is_err());
        assert!(build(EBDA_START, MAX_CPUS).is_ok());
    }
}
