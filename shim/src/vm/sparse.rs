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

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::io::AsRawFd;
use std::path::Path;

const MAGIC: &[u8; 8] = b"BRWSPRS\x01";
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
    let mut out = BufWriter::new(File::create(dst)?);
    out.write_all(MAGIC)?;
    out.write_all(&size.to_le_bytes())?;
    out.write_all(&(ext.len() as u64).to_le_bytes())?;
    for (off, len) in &ext {
        out.write_all(&off.to_le_bytes())?;
        out.write_all(&len.to_le_bytes())?;
    }
    let mut out = out.into_inner().map_err(|e| e.into_error())?;
    for (off, len) in &ext {
        f.seek(SeekFrom::Start(*off))?;
        let n = std::io::copy(&mut (&mut f).take(*len), &mut out)?;
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
