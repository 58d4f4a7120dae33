//! The snapshot state file: a fixed header (magic, format version, payload
//! length, CRC32 of the payload) and a JSON payload with the VM's state.
//! Anything that fails a check is refused with an error that says which.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;

/// First bytes of every state file.
pub const MAGIC: [u8; 8] = *b"BRWSNAP\0";
/// The format this build writes and reads. 2: KVM structs are
/// kvm-bindings' own serde (byte arrays) instead of hex strings.
pub const FORMAT_VERSION: u32 = 2;
/// Largest payload accepted (the VM's state without its memory is small).
pub const MAX_STATE_LEN: u64 = 64 << 20;
/// Header: magic, version, flags, payload length, CRC32, reserved.
pub const HEADER_LEN: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a burrow snapshot state file (bad magic)")]
    BadMagic,
    #[error("snapshot format version {found} is not supported (this burrow reads version {FORMAT_VERSION})")]
    UnsupportedVersion { found: u32 },
    #[error("snapshot state is {len} bytes, over the limit of {MAX_STATE_LEN}")]
    TooLarge { len: u64 },
    #[error("snapshot state file is truncated: header says {expected} bytes of state, file has {found}")]
    Truncated { expected: u64, found: u64 },
    #[error("snapshot state file has {0} unexpected bytes after the state")]
    TrailingData(u64),
    #[error("snapshot state checksum mismatch (stored {stored:#010x}, computed {computed:#010x}): the file is corrupt")]
    Checksum { stored: u32, computed: u32 },
    #[error("snapshot header has unknown flags {0:#x}")]
    UnknownFlags(u32),
    #[error("snapshot state does not decode: {0}")]
    Decode(#[source] serde_json::Error),
    #[error("snapshot state does not encode: {0}")]
    Encode(#[source] serde_json::Error),
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

/// Encode `state` as a complete state file.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, SnapshotError> {
    let payload = serde_json::to_vec(state).map_err(SnapshotError::Encode)?;
    let len = payload.len() as u64;
    if len > MAX_STATE_LEN {
        return Err(SnapshotError::TooLarge { len });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&[0u8; 4]);
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Check the header of a state file and return the payload length it
/// announces. `file_len` is the whole file's length.
pub fn check_header(header: &[u8], file_len: u64) -> Result<u64, SnapshotError> {
    if header.len() < HEADER_LEN {
        return Err(SnapshotError::Truncated {
            expected: HEADER_LEN as u64,
            found: header.len() as u64,
        });
    }
    if header[..8] != MAGIC {
        return Err(SnapshotError::BadMagic);
    }
    let found = le_u32(header, 8);
    if found != FORMAT_VERSION {
        return Err(SnapshotError::UnsupportedVersion { found });
    }
    let flags = le_u32(header, 12);
    if flags != 0 {
        return Err(SnapshotError::UnknownFlags(flags));
    }
    let len = le_u64(header, 16);
    if len > MAX_STATE_LEN {
        return Err(SnapshotError::TooLarge { len });
    }
    let body = file_len.saturating_sub(HEADER_LEN as u64);
    if body < len {
        return Err(SnapshotError::Truncated {
            expected: len,
            found: body,
        });
    }
    if body > len {
        return Err(SnapshotError::TrailingData(body - len));
    }
    Ok(len)
}

/// Decode a complete state file.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, SnapshotError> {
    check_header(bytes, bytes.len() as u64)?;
    let payload = &bytes[HEADER_LEN..];
    let stored = le_u32(bytes, 24);
    let computed = crc32fast::hash(payload);
    if stored != computed {
        return Err(SnapshotError::Checksum { stored, computed });
    }
    serde_json::from_slice(payload).map_err(SnapshotError::Decode)
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Write `state` to `path` atomically (temp file, fsync, rename).
pub fn write_state_file<T: Serialize>(path: &Path, state: &T) -> Result<(), SnapshotError> {
    let tmp = path.with_extension("tmp");
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    write_state_to(&mut f, &tmp, state)?;
    fs::rename(&tmp, path).map_err(io(path))
}

/// Write a state file into `f` (an empty file opened for writing;
/// `path` names it in errors) and sync it.
pub fn write_state_to<T: Serialize>(f: &mut fs::File, path: &Path, state: &T) -> Result<(), SnapshotError> {
    let bytes = encode(state)?;
    f.write_all(&bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// Read and check a state file. The size limit is checked from the header
/// before the payload is read, so an oversized file costs no memory.
pub fn read_state_file<T: DeserializeOwned>(path: &Path) -> Result<T, SnapshotError> {
    let mut f = fs::File::open(path).map_err(io(path))?;
    let file_len = f.metadata().map_err(io(path))?.len();
    let mut header = [0u8; HEADER_LEN];
    let got = read_up_to(&mut f, &mut header).map_err(io(path))?;
    let len = check_header(&header[..got], file_len)?;
    let total = usize::try_from(len).map_err(|_| SnapshotError::TooLarge { len })? + HEADER_LEN;
    let mut bytes = Vec::with_capacity(total);
    bytes.extend_from_slice(&header);
    f.take(len).read_to_end(&mut bytes).map_err(io(path))?;
    decode(&bytes)
}

fn read_up_to(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct State {
        regs: Vec<u64>,
        name: String,
    }

    fn state() -> State {
        State {
            regs: vec![1, 2, 0xffff_ffff_ffff_ffff],
            name: "vcpu0".into(),
        }
    }

    #[test]
    fn round_trips_through_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vm.state");
        write_state_file(&path, &state()).unwrap();
        assert_eq!(read_state_file::<State>(&path).unwrap(), state());
    }

    #[test]
    fn refuses_every_kind_of_bad_file() {
        let good = encode(&state()).unwrap();

        let mut corrupt = good.clone();
        let last = corrupt.len() - 2;
        corrupt[last] ^= 0x20;
        assert!(matches!(decode::<State>(&corrupt), Err(SnapshotError::Checksum { .. })));

        let truncated = &good[..good.len() - 5];
        assert!(matches!(decode::<State>(truncated), Err(SnapshotError::Truncated { .. })));
        assert!(matches!(decode::<State>(&good[..10]), Err(SnapshotError::Truncated { .. })));

        let mut version = good.clone();
        version[8] = 9;
        let err = decode::<State>(&version).unwrap_err();
        assert!(err.to_string().contains("version 9 is not supported"), "{err}");
        // Version 1 stored KVM structs as hex strings: not read any more.
        version[8] = 1;
        let err = decode::<State>(&version).unwrap_err();
        assert!(err.to_string().contains("version 1 is not supported (this burrow reads version 2)"), "{err}");

        let mut magic = good.clone();
        magic[0] = b'X';
        assert!(matches!(decode::<State>(&magic), Err(SnapshotError::BadMagic)));

        let mut huge = good.clone();
        huge[16..24].copy_from_slice(&(MAX_STATE_LEN + 1).to_le_bytes());
        assert!(matches!(decode::<State>(&huge), Err(SnapshotError::TooLarge { .. })));

        let mut trailing = good.clone();
        trailing.push(0);
        assert!(matches!(decode::<State>(&trailing), Err(SnapshotError::TrailingData(1))));

        let mut flags = good.clone();
        flags[12] = 1;
        assert!(matches!(decode::<State>(&flags), Err(SnapshotError::UnknownFlags(1))));

        // Valid frame, payload of the wrong shape.
        let other = encode(&vec![1u8, 2, 3]).unwrap();
        assert!(matches!(decode::<State>(&other), Err(SnapshotError::Decode(_))));
    }

    #[test]
    fn an_oversized_file_is_refused_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("huge.state");
        let mut header = encode(&state()).unwrap()[..HEADER_LEN].to_vec();
        header[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
        let f = fs::File::create(&path).unwrap();
        f.set_len(1 << 40).unwrap(); // sparse: costs no disk
        drop(f);
        let mut f = fs::OpenOptions::new().write(true).open(&path).unwrap();
        f.write_all(&header).unwrap();
        let err = read_state_file::<State>(&path).unwrap_err();
        assert!(matches!(err, SnapshotError::TooLarge { .. }), "{err}");
    }
}
