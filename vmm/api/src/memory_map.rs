//! Where a restore's guest memory lies inside a packed file, so the VMM
//! can map it in place (`burrow-vmm run --restore DIR --packed-memory-fd N`)
//! instead of the shim unpacking it first: `DIR/memory.map` lists page
//! ranges of the guest's memory (its regions back to back) and where
//! each one's bytes start in the file; every other page is zero.
//!
//! ```text
//! magic   8 bytes  "BRWMMAP\x01"
//! count   u64 LE
//! count × (guest offset u64 LE, file offset u64 LE, length u64 LE)
//! ```
//!
//! The shim writes it from a checkpoint it has checked; the VMM checks it
//! again (page-aligned, sorted, not overlapping, inside the memory and the
//! file, at most [`MAX_EXTENTS`]) before it maps anything.

/// Magic of a memory map file.
pub const MAGIC: &[u8; 8] = b"BRWMMAP\x01";
/// Most ranges in one map: each is a mapping in the VMM, and a process
/// has 65530 by default.
pub const MAX_EXTENTS: usize = 16384;
/// Pages the map speaks in.
pub const PAGE: u64 = 4096;
/// Largest map file.
pub const MAX_BYTES: u64 = 16 + 24 * MAX_EXTENTS as u64;

/// One range of guest memory backed by the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Offset in the guest's memory (its regions back to back).
    pub guest: u64,
    /// Where its bytes start in the packed file.
    pub file: u64,
    pub len: u64,
}

/// Encode `extents` as a map file's bytes.
pub fn encode(extents: &[Extent]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + 24 * extents.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(extents.len() as u64).to_le_bytes());
    for e in extents {
        for v in [e.guest, e.file, e.len] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

/// Check `extents` against guest memory of `memory` bytes and a file of
/// `file_len` bytes: each page-aligned and non-empty, in guest order
/// without overlap, inside both.
pub fn check(extents: &[Extent], memory: u64, file_len: u64) -> Result<(), String> {
    if extents.len() > MAX_EXTENTS {
        return Err(format!("{} ranges, at most {MAX_EXTENTS}", extents.len()));
    }
    let mut end = 0u64;
    for (i, e) in extents.iter().enumerate() {
        if e.len == 0 || e.guest % PAGE != 0 || e.file % PAGE != 0 || e.len % PAGE != 0 {
            return Err(format!("range {i} ({e:?}) is empty or not page-aligned"));
        }
        let guest_end = e.guest.checked_add(e.len).filter(|g| *g <= memory);
        let file_end = e.file.checked_add(e.len).filter(|f| *f <= file_len);
        let (Some(guest_end), Some(_)) = (guest_end, file_end) else {
            return Err(format!(
                "range {i} ({e:?}) lies outside the memory ({memory} bytes) or the file ({file_len} bytes)"
            ));
        };
        if e.guest < end {
            return Err(format!("range {i} ({e:?}) overlaps or precedes the one before"));
        }
        end = guest_end;
    }
    Ok(())
}

/// Decode and [`check`] a map file's bytes.
pub fn decode(bytes: &[u8], memory: u64, file_len: u64) -> Result<Vec<Extent>, String> {
    if bytes.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not a memory map (wrong magic)".into());
    }
    let count = u64_at(bytes, 8).ok_or("truncated header")?;
    let count = usize::try_from(count)
        .ok()
        .filter(|c| *c <= MAX_EXTENTS)
        .ok_or_else(|| format!("{count} ranges, at most {MAX_EXTENTS}"))?;
    if bytes.len() != 16 + 24 * count {
        return Err(format!(
            "{} bytes, {count} ranges need {}",
            bytes.len(),
            16 + 24 * count
        ));
    }
    let mut out = Vec::with_capacity(count);
    for i in 0..count {
        let at = 16 + 24 * i;
        let v = |k: usize| u64_at(bytes, at + 8 * k).ok_or("truncated range");
        out.push(Extent {
            guest: v(0)?,
            file: v(1)?,
            len: v(2)?,
        });
    }
    check(&out, memory, file_len)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn e(guest: u64, file: u64, len: u64) -> Extent {
        Extent { guest, file, len }
    }

    #[test]
    fn round_trips_and_refuses_what_does_not_fit() {
        let good = vec![e(0, 4096, 8192), e(MIB, 12288, 4096)];
        let bytes = encode(&good);
        assert_eq!(decode(&bytes, 2 * MIB, 16384), Ok(good.clone()));
        // The file is one page short, the memory too small.
        assert!(decode(&bytes, 2 * MIB, 12288).unwrap_err().contains("outside"));
        assert!(decode(&bytes, MIB, 16384).unwrap_err().contains("outside"));
        for (bad, why) in [
            (vec![e(0, 4096, 100)], "page-aligned"),
            (vec![e(1, 4096, 4096)], "page-aligned"),
            (vec![e(0, 4097, 4096)], "page-aligned"),
            (vec![e(0, 4096, 0)], "empty"),
            (vec![e(MIB, 0, 4096), e(0, 4096, 4096)], "overlaps"),
            (vec![e(0, 0, 8192), e(4096, 8192, 4096)], "overlaps"),
            (vec![e(u64::MAX - 4095, 0, 4096)], "outside"),
            (vec![e(0, !4095, 4096)], "outside"),
        ] {
            let err = decode(&encode(&bad), 2 * MIB, u64::MAX).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
        assert!(decode(b"BRWMMAP\x02", MIB, MIB).unwrap_err().contains("magic"));
        assert!(decode(&bytes[..20], 2 * MIB, 16384).is_err());
        let mut huge = bytes.clone();
        huge[8..16].copy_from_slice(&(MAX_EXTENTS as u64 + 1).to_le_bytes());
        assert!(decode(&huge, 2 * MIB, 16384).unwrap_err().contains("at most"));
        let mut long = bytes;
        long.push(0);
        assert!(decode(&long, 2 * MIB, 16384).unwrap_err().contains("need"));
    }
}
