//! A packed form of a sparse file, for checkpoints that leave through
//! containerd: containerd 1.6 tars a checkpoint directory with Go's tar,
//! which writes holes as zeros, so a 256 MiB guest's memory file (mostly
//! holes) and its disk image went into the content store at full size.
//! Packed, only the data extents travel.
//!
//! ```text
//! magic   8 bytes  "BRWSPRS\x01"
//! size    u64 LE   the file's apparent size
//! count   u64 LE   number of extents
//! count × (offset u64 LE, length u64 LE), sorted, not overlapping
//! the extents' bytes, back to back
//! ```
//!
//! Unpacking checks every bound before it writes: a damaged or hostile
//! file is refused with an error that names it.
//!
//! A checkpoint's memory is packed page-aligned instead (magic
//! `BRWSPRS\x02`, the same header, then zeros up to the next page, then
//! each extent's bytes, each extent whole pages): a restore never unpacks
//! it, burrow-vmm maps its extents in place ([`aligned_layout`],
//! `burrow_vmm_api::memory_map`), so a restore reads no memory up front.
//! It has at most `memory_map::MAX_EXTENTS` extents (the closest ones are
//! merged, the hole between them packed as zeros).

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::Path;

const MAGIC: &[u8; 8] = b"BRWSPRS\x01";
const MAGIC_ALIGNED: &[u8; 8] = b"BRWSPRS\x02";
const PAGE: u64 = burrow_vmm_api::memory_map::PAGE;
/// Largest file unpacked (apparent size).
pub const MAX_SIZE: u64 = 1 << 40;
/// Most extents in one file.
pub const MAX_EXTENTS: u64 = 1 << 22;

type Extent = (u64, u64);

fn bad(path: &Path, why: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("{}: not a usable packed file: {why}", path.display()),
    )
}

/// The data extents of `f` (`size` bytes), from SEEK_DATA/SEEK_HOLE; the
/// whole file where the file system cannot say.
fn extents(f: &File, size: u64) -> std::io::Result<Vec<Extent>> {
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        let at = i64::try_from(pos).unwrap_or(i64::MAX);
        // SAFETY: lseek on a descriptor we own; no memory is passed.
        let data = unsafe { libc::lseek(fd, at, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENXIO) => Ok(out),
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if out.is_empty() => {
                    Ok(vec![(0, size)])
                }
                _ => Err(e),
            };
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (data, hole) = (data as u64, (hole as u64).min(size));
        if hole <= data {
            break;
        }
        out.push((data, hole - data));
        pos = hole;
    }
    Ok(out)
}

/// Pack `src` (a sparse file) into `dst`; returns the bytes written.
pub fn pack(src: &Path, dst: &Path) -> std::io::Result<u64> {
    let mut f = File::open(src)?;
    let size = f.seek(SeekFrom::End(0))?;
    let ext = extents(&f, size)?;
    write_pack(&mut f, src, dst, (MAGIC, size), &ext, 1)
}

/// Write the pack of `f` (`src`, `size` bytes) with `magic` and extents
/// `ext` into `dst`: the header, zeros up to a multiple of `align`, then
/// each extent's bytes. Returns the bytes written.
fn write_pack(
    f: &mut File,
    src: &Path,
    dst: &Path,
    (magic, size): (&[u8; 8], u64),
    ext: &[Extent],
    align: u64,
) -> std::io::Result<u64> {
    let mut out = BufWriter::new(File::create(dst)?);
    out.write_all(magic)?;
    out.write_all(&size.to_le_bytes())?;
    out.write_all(&(ext.len() as u64).to_le_bytes())?;
    for (off, len) in ext {
        out.write_all(&off.to_le_bytes())?;
        out.write_all(&len.to_le_bytes())?;
    }
    let header = 24 + 16 * ext.len() as u64;
    let pad = header.div_ceil(align) * align - header;
    std::io::copy(&mut std::io::repeat(0).take(pad), &mut out)?;
    let mut out = out.into_inner().map_err(|e| e.into_error())?;
    for (off, len) in ext {
        f.seek(SeekFrom::Start(*off))?;
        let n = std::io::copy(&mut f.take(*len), &mut out)?;
        if n != *len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} shrank while it was packed", src.display()),
            ));
        }
    }
    out.sync_all()?;
    out.stream_position()
}

/// `ext` (sorted, from [`extents`]) widened to whole pages of a file of
/// `size` bytes, touching ones joined, then the closest merged until at
/// most `max` are left.
fn page_extents(ext: &[Extent], size: u64, max: usize) -> Vec<Extent> {
    let mut out: Vec<Extent> = Vec::new();
    for &(off, len) in ext {
        let start = off - off % PAGE;
        let end = off.saturating_add(len).div_ceil(PAGE).saturating_mul(PAGE).min(size);
        match out.last_mut() {
            Some((s, l)) if *s + *l >= start => *l = end.max(*s + *l) - *s,
            _ => out.push((start, end - start)),
        }
    }
    // Merge across the smallest holes first: the fewest zeros packed.
    let mut gap = PAGE;
    while out.len() > max.max(1) {
        let mut merged: Vec<Extent> = Vec::with_capacity(out.len());
        for (off, len) in out {
            match merged.last_mut() {
                Some((s, l)) if off - (*s + *l) <= gap => *l = off + len - *s,
                _ => merged.push((off, len)),
            }
        }
        out = merged;
        gap = gap.saturating_mul(2);
    }
    out
}

/// Pack `src` (a sparse file of whole pages: guest memory) page-aligned
/// into `dst`; returns the bytes written.
pub fn pack_aligned(src: &Path, dst: &Path) -> std::io::Result<u64> {
    pack_aligned_at_most(src, dst, burrow_vmm_api::memory_map::MAX_EXTENTS)
}

fn pack_aligned_at_most(src: &Path, dst: &Path, max: usize) -> std::io::Result<u64> {
    let mut f = File::open(src)?;
    let size = f.seek(SeekFrom::End(0))?;
    if size % PAGE != 0 {
        return Err(bad(src, format!("{size} bytes is not whole pages")));
    }
    let ext = page_extents(&extents(&f, size)?, size, max);
    write_pack(&mut f, src, dst, (MAGIC_ALIGNED, size), &ext, PAGE)
}

/// Whether `f` (named `path` in errors) is a page-aligned pack; an error
/// for a file that is no pack at all.
pub fn is_aligned(f: &File, path: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::FileExt;
    let mut magic = [0u8; 8];
    f.read_exact_at(&mut magic, 0)
        .map_err(|_| bad(path, "truncated header"))?;
    match &magic {
        m if m == MAGIC_ALIGNED => Ok(true),
        m if m == MAGIC => Ok(false),
        _ => Err(bad(path, "wrong magic")),
    }
}

/// The layout of page-aligned pack `f` (named `path` in errors) holding a
/// file of exactly `want` bytes: where each extent's bytes lie in `f`, for
/// burrow-vmm to map in place. Every bound is checked, as by [`unpack`].
pub fn aligned_layout(
    f: &File,
    path: &Path,
    want: u64,
) -> std::io::Result<Vec<burrow_vmm_api::memory_map::Extent>> {
    use burrow_vmm_api::memory_map::{self, Extent as MapExtent};
    use std::os::unix::fs::FileExt;
    let total = f.metadata()?.len();
    let at = |off: u64| -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, off)
            .map_err(|_| bad(path, "truncated header"))?;
        Ok(u64::from_le_bytes(b))
    };
    if !is_aligned(f, path)? {
        return Err(bad(path, "not page-aligned"));
    }
    let size = at(8)?;
    if size != want {
        return Err(bad(path, format!("holds {size} bytes, the checkpoint says {want}")));
    }
    let count = at(16)?;
    let count = usize::try_from(count)
        .ok()
        .filter(|c| *c <= memory_map::MAX_EXTENTS)
        .ok_or_else(|| bad(path, format!("{count} extents is over {}", memory_map::MAX_EXTENTS)))?;
    let header = 24 + 16 * count as u64;
    let mut file_off = header.div_ceil(PAGE) * PAGE;
    let mut out = Vec::with_capacity(count);
    for i in 0..count as u64 {
        let (off, len) = (at(24 + 16 * i)?, at(32 + 16 * i)?);
        out.push(MapExtent {
            guest: off,
            file: file_off,
            len,
        });
        file_off = file_off
            .checked_add(len)
            .ok_or_else(|| bad(path, format!("extent {off}+{len} is out of order or beyond {size}")))?;
    }
    if file_off != total {
        return Err(bad(path, format!("{total} bytes, the header promises {file_off}")));
    }
    memory_map::check(&out, size, total).map_err(|why| bad(path, why))?;
    Ok(out)
}

fn u64_at(r: &mut impl Read) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// The apparent size of the file packed in `src` (its header's; checked
/// again, with everything else, by the unpack).
pub fn packed_size(src: &Path) -> std::io::Result<u64> {
    let mut r = File::open(src)?;
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .map_err(|_| bad(src, "truncated header"))?;
    if &magic != MAGIC {
        return Err(bad(src, "wrong magic"));
    }
    u64_at(&mut r).map_err(|_| bad(src, "truncated header"))
}

/// Unpack `src` (written by [`pack`]) into a new sparse file `dst`.
pub fn unpack(src: &Path, dst: &Path) -> std::io::Result<()> {
    unpack_within(src, dst, MAX_SIZE)
}

/// [`unpack`] a file that may be at most `max` bytes (apparent size): a
/// checkpoint's memory is exactly the size its manifest says.
pub fn unpack_within(src: &Path, dst: &Path, max: u64) -> std::io::Result<()> {
    let f = File::open(src)?;
    let total = f.metadata()?.len();
    let mut r = BufReader::new(f);
    let trunc = |_| bad(src, "truncated header");
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(trunc)?;
    if &magic != MAGIC {
        return Err(bad(src, "wrong magic"));
    }
    let size = u64_at(&mut r).map_err(trunc)?;
    let count = u64_at(&mut r).map_err(trunc)?;
    let max = max.min(MAX_SIZE);
    if size > max {
        return Err(bad(src, format!("size {size} is over {max}")));
    }
    if count > MAX_EXTENTS {
        return Err(bad(src, format!("{count} extents is over {MAX_EXTENTS}")));
    }
    let header = 24 + count * 16;
    let mut ext = Vec::new();
    let (mut end, mut data) = (0u64, 0u64);
    for _ in 0..count {
        let off = u64_at(&mut r).map_err(trunc)?;
        let len = u64_at(&mut r).map_err(trunc)?;
        let stop = off
            .checked_add(len)
            .filter(|s| len > 0 && off >= end && *s <= size)
            .ok_or_else(|| {
                bad(
                    src,
                    format!("extent {off}+{len} is out of order or beyond {size}"),
                )
            })?;
        end = stop;
        data += len;
        ext.push((off, len));
    }
    if header.checked_add(data) != Some(total) {
        return Err(bad(
            src,
            format!(
                "{total} bytes, the header promises {}",
                header.saturating_add(data)
            ),
        ));
    }
    let mut out = File::create(dst)?;
    out.set_len(size)?;
    for (off, len) in ext {
        out.seek(SeekFrom::Start(off))?;
        let n = std::io::copy(&mut (&mut r).take(len), &mut out)?;
        if n != len {
            return Err(bad(src, "data ends early"));
        }
    }
    out.sync_all()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    fn sparse_file(p: &Path) -> Vec<u8> {
        let f = File::create(p).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[7u8; 5000], 4096).unwrap();
        f.write_all_at(&[9u8; 100], (32 << 20) + 3).unwrap();
        f.write_all_at(b"end", (64 << 20) - 3).unwrap();
        std::fs::read(p).unwrap()
    }

    #[test]
    fn round_trip_keeps_bytes_and_holes() {
        let d = tempfile::tempdir().unwrap();
        let (src, packed, back) = (d.path().join("m"), d.path().join("p"), d.path().join("b"));
        let want = sparse_file(&src);
        let n = pack(&src, &packed).unwrap();
        assert!(
            n < 1 << 20,
            "packed {n} bytes for a 64 MiB file with 3 small extents"
        );
        assert_eq!(n, std::fs::metadata(&packed).unwrap().len());
        assert_eq!(packed_size(&packed).unwrap(), 64 << 20);
        assert!(packed_size(&src).is_err(), "not a pack");
        unpack(&packed, &back).unwrap();
        assert_eq!(std::fs::read(&back).unwrap(), want);
        use std::os::unix::fs::MetadataExt;
        assert!(
            std::fs::metadata(&back).unwrap().blocks() * 512 < 4 << 20,
            "unpacked file is not sparse"
        );
    }

    #[test]
    fn an_aligned_pack_places_every_page_where_the_vmm_maps_it() {
        use std::os::unix::fs::FileExt;
        let d = tempfile::tempdir().unwrap();
        let (src, packed) = (d.path().join("m"), d.path().join("p"));
        let want = sparse_file(&src);
        let n = pack_aligned(&src, &packed).unwrap();
        assert!(n < 1 << 20, "packed {n} bytes");
        let f = File::open(&packed).unwrap();
        assert!(is_aligned(&f, &packed).unwrap());
        let layout = aligned_layout(&f, &packed, 64 << 20).unwrap();
        // Rebuild the file as the VMM's mappings show it: zeros, and each
        // extent's bytes from its place in the pack.
        let mut got = vec![0u8; 64 << 20];
        for e in &layout {
            assert_eq!((e.guest % PAGE, e.file % PAGE, e.len % PAGE), (0, 0, 0));
            let (g, l) = (e.guest as usize, e.len as usize);
            f.read_exact_at(&mut got[g..g + l], e.file).unwrap();
        }
        assert!(got == want, "the mapped pages differ from the file");
        // Another size than the checkpoint says, a damaged count or length.
        let e = aligned_layout(&f, &packed, 32 << 20).unwrap_err().to_string();
        assert!(e.contains("the checkpoint says") && e.contains("/p:"), "{e}");
        let good = std::fs::read(&packed).unwrap();
        for (at, v, why) in [
            (16, 1u64 << 40, "extents is over"),
            (32, 4096 * 3, "the header promises"),
            (24, 4096 * 16383 + 1, "page-aligned"),
        ] {
            let mut b = good.clone();
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            std::fs::write(&packed, &b).unwrap();
            let f = File::open(&packed).unwrap();
            let e = aligned_layout(&f, &packed, 64 << 20).unwrap_err().to_string();
            assert!(e.contains(why), "{why}: {e}");
        }
        // A v1 pack is no aligned one (a restore unpacks it as before).
        pack(&src, &packed).unwrap();
        assert!(!is_aligned(&File::open(&packed).unwrap(), &packed).unwrap());
    }

    #[test]
    fn too_many_extents_are_merged_across_the_smallest_holes() {
        let d = tempfile::tempdir().unwrap();
        let (src, packed) = (d.path().join("m"), d.path().join("p"));
        let f = File::create(&src).unwrap();
        f.set_len(1 << 20).unwrap();
        // 64 one-page extents, every other page.
        for i in 0..64u64 {
            f.write_all_at(&[i as u8 + 1; 4096], i * 2 * PAGE).unwrap();
        }
        let want = std::fs::read(&src).unwrap();
        pack_aligned_at_most(&src, &packed, 5).unwrap();
        let pf = File::open(&packed).unwrap();
        let layout = aligned_layout(&pf, &packed, 1 << 20).unwrap();
        assert!(layout.len() <= 5, "{} extents", layout.len());
        let mut got = vec![0u8; 1 << 20];
        for e in &layout {
            let (g, l) = (e.guest as usize, e.len as usize);
            pf.read_exact_at(&mut got[g..g + l], e.file).unwrap();
        }
        assert!(got == want);
    }

    #[test]
    fn damaged_files_are_refused_with_their_name() {
        let d = tempfile::tempdir().unwrap();
        let (src, packed, back) = (d.path().join("m"), d.path().join("p"), d.path().join("b"));
        sparse_file(&src);
        pack(&src, &packed).unwrap();
        let good = std::fs::read(&packed).unwrap();
        let mut cases: Vec<(&str, Vec<u8>)> = vec![
            ("wrong magic", [b"XXXXXXXX".as_slice(), &good[8..]].concat()),
            ("truncated header", good[..20].to_vec()),
            ("the header promises", good[..good.len() - 1].to_vec()),
            ("the header promises", [good.as_slice(), b"x"].concat()),
        ];
        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&(MAX_EXTENTS + 1).to_le_bytes());
        cases.push(("extents is over", huge));
        let mut beyond = good.clone();
        beyond[8..16].copy_from_slice(&100u64.to_le_bytes());
        cases.push(("beyond", beyond));
        let mut order = good.clone();
        // The second extent starts before the first one ends.
        order[40..48].copy_from_slice(&0u64.to_le_bytes());
        cases.push(("out of order", order));
        // A header that promises more than the caller allows.
        std::fs::write(&packed, &good).unwrap();
        let e = unpack_within(&packed, &back, (64 << 20) - 1).unwrap_err().to_string();
        assert!(e.contains("is over 67108863"), "{e}");
        unpack_within(&packed, &back, 64 << 20).unwrap();
        for (want, bytes) in cases {
            std::fs::write(&packed, &bytes).unwrap();
            let e = unpack(&packed, &back).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains("/p:"), "{want}: {e}");
        }
    }
}
