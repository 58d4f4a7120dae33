//! Guest memory in snapshot files: full snapshots leave holes where pages
//! are zero, incremental ones write only the pages KVM's dirty log marked.
//! Restore maps the file MAP_PRIVATE (see the VMM's memory setup), so it is
//! lazy and one file can seed many VMs.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// Granularity of holes and of KVM's dirty log.
pub const PAGE_SIZE: usize = 4096;

/// What a memory write did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteStats {
    /// Pages written to the file.
    pub pages_written: u64,
    /// Pages skipped (zero in a full snapshot, clean in an incremental one).
    pub pages_skipped: u64,
}

fn is_zero(page: &[u8]) -> bool {
    // Word at a time: this runs over all of guest memory.
    let mut words = page.chunks_exact(16);
    let whole = words
        .by_ref()
        .all(|w| u128::from_ne_bytes(w.try_into().unwrap_or([1; 16])) == 0);
    whole && words.remainder().iter().all(|&b| b == 0)
}

/// Write a region of guest memory to `file` at `offset`, leaving a hole for
/// every all-zero page. The file is extended to cover the whole region.
pub fn write_sparse(file: &File, offset: u64, mem: &[u8]) -> io::Result<WriteStats> {
    let mut stats = WriteStats::default();
    for (i, page) in mem.chunks(PAGE_SIZE).enumerate() {
        if is_zero(page) {
            stats.pages_skipped += 1;
            continue;
        }
        file.write_all_at(page, offset + (i * PAGE_SIZE) as u64)?;
        stats.pages_written += 1;
    }
    let end = offset + mem.len() as u64;
    if file.metadata()?.len() < end {
        file.set_len(end)?;
    }
    Ok(stats)
}

/// Write the pages of `mem` whose bit is set in `dirty` (KVM's dirty log
/// layout: bit `i` of word `i / 64` is page `i`) to `file` at `offset`, on
/// top of an earlier snapshot. Bits past the end of `mem` are ignored.
pub fn write_dirty(file: &File, offset: u64, mem: &[u8], dirty: &[u64]) -> io::Result<WriteStats> {
    let mut stats = WriteStats::default();
    for (i, page) in mem.chunks(PAGE_SIZE).enumerate() {
        let set = dirty
            .get(i / 64)
            .is_some_and(|word| word & (1u64 << (i % 64)) != 0);
        if !set {
            stats.pages_skipped += 1;
            continue;
        }
        file.write_all_at(page, offset + (i * PAGE_SIZE) as u64)?;
        stats.pages_written += 1;
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    fn rw_file(path: &std::path::Path) -> File {
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap()
    }

    #[test]
    fn zero_pages_become_holes() {
        let dir = tempfile::tempdir().unwrap();
        let f = rw_file(&dir.path().join("mem"));
        let mut mem = vec![0u8; 256 * PAGE_SIZE];
        mem[3 * PAGE_SIZE + 17] = 0xaa;
        mem[200 * PAGE_SIZE] = 0x55;
        let stats = write_sparse(&f, 0, &mem).unwrap();
        assert_eq!(stats.pages_written, 2);
        assert_eq!(stats.pages_skipped, 254);
        let md = f.metadata().unwrap();
        assert_eq!(md.len(), mem.len() as u64);
        assert!(md.blocks() * 512 <= 16 * PAGE_SIZE as u64, "{} blocks allocated", md.blocks());
        let mut back = vec![0u8; mem.len()];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back, mem);
    }

    #[test]
    fn incremental_writes_only_dirty_pages() {
        let dir = tempfile::tempdir().unwrap();
        let f = rw_file(&dir.path().join("mem"));
        let mut mem = vec![1u8; 100 * PAGE_SIZE];
        write_sparse(&f, 0, &mem).unwrap();
        mem[5 * PAGE_SIZE] = 9;
        mem[70 * PAGE_SIZE + 1] = 9;
        mem[71 * PAGE_SIZE] = 9; // changed but not marked: must not be written
        let mut dirty = vec![0u64; 2];
        dirty[0] |= 1 << 5;
        dirty[1] |= 1 << (70 - 64);
        dirty.push(u64::MAX); // past the end of memory: ignored
        let stats = write_dirty(&f, 0, &mem, &dirty).unwrap();
        assert_eq!(stats.pages_written, 2);
        let mut back = vec![0u8; mem.len()];
        f.read_exact_at(&mut back, 0).unwrap();
        assert_eq!(back[5 * PAGE_SIZE], 9);
        assert_eq!(back[70 * PAGE_SIZE + 1], 9);
        assert_eq!(back[71 * PAGE_SIZE], 1);
    }
}
