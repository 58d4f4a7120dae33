//! Taking in a checkpoint for a restore, trusting nothing in it (issue 15).
//!
//! A checkpoint comes from containerd's content store (a tar, which keeps
//! symlinks, device nodes and FIFOs) or from a named directory. Before any
//! of it is copied or mapped: every file it needs is opened beneath the
//! checkpoint directory with `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
//! | RESOLVE_NO_MAGICLINKS)` and must be a regular file of a bounded size;
//! the VM it describes must fit this host's config; and one from containerd
//! must be packed (self-contained). The opened files are what is read
//! afterwards ([`Member::path`] names the open file, not the checkpoint's
//! path), so nothing can be swapped in between.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::snapshot::{self, Manifest};
use crate::config::Config;
use crate::sandbox::{Result, SandboxError};

/// Largest VMM state file (vCPUs and devices; real ones are a few KiB).
pub const MAX_STATE: u64 = 16 << 20;
/// Room a packed file may take beyond the data it holds (headers, extents).
const PACK_SLACK: u64 = 16 << 20;
/// Largest rootfs disk in a checkpoint.
pub const MAX_DISK: u64 = 1 << 40;

/// One checked file of a checkpoint, held open.
#[derive(Debug)]
pub struct Member {
    file: File,
    len: u64,
}

impl Member {
    /// A path that opens this very file (`/proc/PID/fd/N`), for tools that
    /// take paths (`cp`, the sparse unpacker).
    pub fn path(&self) -> PathBuf {
        // By pid, not `self`: child processes (`cp`) open it too.
        PathBuf::from(format!("/proc/{}/fd/{}", std::process::id(), self.file.as_raw_fd()))
    }

    pub fn size(&self) -> u64 {
        self.len
    }

    /// The open file itself (read with positioned reads only: clones share
    /// its offset).
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn into_file(self) -> File {
        self.file
    }
}

/// The checked files of a checkpoint: the VMM state, the memory and the
/// disk (packed or not, as the manifest says).
#[derive(Debug)]
pub struct Intake {
    pub state: Member,
    pub memory: Member,
    pub disk: Member,
    /// A pod's checkpoint: each member's disk, by its slot.
    pub slots: Vec<(u32, Member)>,
}

/// Where a checkpoint comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// containerd's checkpoint image: must be packed.
    Containerd,
    /// A named checkpoint this host's shim wrote under its snapshot dir.
    Named,
}

fn bad(dir: &Path, why: String) -> SandboxError {
    SandboxError::InvalidArgument(format!("{} is not a usable burrow checkpoint: {why}", dir.display()))
}

/// Largest signature file read.
const MAX_SIG: u64 = 256;

impl Intake {
    /// Check checkpoint `dir`'s signature (`burrow.sig`, beneath it like
    /// every member) over `manifest` (the bytes it was parsed from) and the
    /// state file; returns the state's bytes, which are what a restore then
    /// uses.
    pub fn verify_signature(&self, dir: &Path, key: &[u8], manifest: &[u8]) -> Result<Vec<u8>> {
        use std::io::Read;
        let base = File::open(dir).map_err(|e| bad(dir, e.to_string()))?;
        let sig = match open_beneath(&base, dir, super::signing::SIG_FILE, MAX_SIG) {
            Ok(m) => m,
            Err(SandboxError::InvalidArgument(why)) if why.ends_with("is missing") => {
                return Err(bad(
                    dir,
                    format!(
                        "it is not signed ({} is missing): only checkpoints this host took are restored",
                        super::signing::SIG_FILE
                    ),
                ))
            }
            Err(e) => return Err(e),
        };
        let mut sig_bytes = Vec::new();
        (&sig.file).take(MAX_SIG).read_to_end(&mut sig_bytes).map_err(|e| bad(dir, e.to_string()))?;
        let mut state = Vec::new();
        (&self.state.file)
            .take(MAX_STATE)
            .read_to_end(&mut state)
            .map_err(|e| bad(dir, format!("reading the VM state: {e}")))?;
        super::signing::verify(key, manifest, &state, &sig_bytes).map_err(|why| bad(dir, why))?;
        Ok(state)
    }
}

/// Open `rel` beneath the directory `base` without following any symlink,
/// as a regular file of at most `max` bytes.
pub(super) fn open_beneath(base: &File, dir: &Path, rel: &str, max: u64) -> Result<Member> {
    let c = std::ffi::CString::new(Path::new(rel).as_os_str().as_bytes())
        .map_err(|_| bad(dir, format!("{rel}: bad name")))?;
    // SAFETY: open_how is plain data; zeroed is its documented default.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    // O_NONBLOCK: opening a FIFO must not wait for a writer.
    how.flags = (libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads `c` and `how` (valid for the call) and returns
    // a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            base.as_raw_fd(),
            c.as_ptr(),
            &how as *const libc::open_how,
            std::mem::size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        let why = match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::EXDEV) => "is a symlink or leads outside the checkpoint".to_string(),
            Some(libc::ENOENT) => "is missing".to_string(),
            _ => e.to_string(),
        };
        return Err(bad(dir, format!("{rel} {why}")));
    }
    let fd = i32::try_from(fd).map_err(|_| bad(dir, format!("{rel}: bad descriptor")))?;
    // SAFETY: openat2 just returned this descriptor; nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    let meta = file.metadata().map_err(|e| bad(dir, format!("{rel}: {e}")))?;
    if !meta.file_type().is_file() {
        return Err(bad(dir, format!("{rel} is not a regular file")));
    }
    if meta.len() > max {
        return Err(bad(dir, format!("{rel} is {} bytes, more than the {max} it may be", meta.len())));
    }
    Ok(Member { file, len: meta.len() })
}

/// Check checkpoint `dir` (its manifest already read and checked) from
/// `origin` against `cfg`, and hold its files open.
pub fn take(dir: &Path, m: &Manifest, cfg: &Config, origin: Origin) -> Result<Intake> {
    if origin == Origin::Containerd && !m.packed {
        return Err(bad(
            dir,
            "a checkpoint from containerd must be packed (self-contained); this one says \"packed\": false".into(),
        ));
    }
    if m.vcpus == 0 || m.vcpus > cfg.vcpus.max {
        return Err(bad(dir, format!("{} vCPUs; this host allows 1 to {}", m.vcpus, cfg.vcpus.max)));
    }
    if m.memory_mib == 0 || m.memory_mib > cfg.memory_mib.max {
        return Err(bad(
            dir,
            format!("{} MiB of memory; this host allows at most {} MiB", m.memory_mib, cfg.memory_mib.max),
        ));
    }
    if let Some(max) = m.memory_max_mib {
        if max < m.memory_mib || max > cfg.memory_mib.max {
            return Err(bad(
                dir,
                format!(
                    "memory that grows to {max} MiB from {} MiB; this host allows at most {} MiB",
                    m.memory_mib, cfg.memory_mib.max
                ),
            ));
        }
    }
    if let Some(vm) = &m.vm {
        return Err(bad(dir, format!("names VM snapshot {vm:?}: only hibernation snapshots have chains")));
    }
    let base = File::open(dir).map_err(|e| bad(dir, e.to_string()))?;
    // The memory file holds the RAM, then a growable VM's whole virtio-mem
    // region (burrow-vmm rounds it up to 128 MiB), holes where unplugged.
    let region_mib = m
        .memory_max_mib
        .map_or(0, |max| max.saturating_sub(m.memory_mib).div_ceil(128) * 128);
    let memory_bytes = (m.memory_mib + region_mib) << 20;
    let (memory, disk) = if m.packed {
        (snapshot::packed(snapshot::MEMORY), snapshot::packed(snapshot::ROOTFS))
    } else {
        (snapshot::MEMORY.to_string(), snapshot::ROOTFS.to_string())
    };
    let vm = snapshot::VM_DIR;
    // A pod's slots were checked with the manifest (never packed, each
    // slot within the VM's and used once).
    let mut slots = Vec::new();
    for n in m.pod.iter().flat_map(snapshot::PodManifest::disk_slots) {
        slots.push((n, open_beneath(&base, dir, &snapshot::slot_disk(n), MAX_DISK)?));
    }
    Ok(Intake {
        state: open_beneath(&base, dir, &format!("{vm}/{}", snapshot::STATE_FILE), MAX_STATE)?,
        memory: open_beneath(&base, dir, &format!("{vm}/{memory}"), memory_bytes + PACK_SLACK)?,
        disk: open_beneath(&base, dir, &disk, MAX_DISK)?,
        slots,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn manifest(packed: bool) -> Manifest {
        Manifest {
            kind: snapshot::KIND.into(),
            format_version: snapshot::FORMAT_VERSION,
            container_id: "c".into(),
            vcpus: 1,
            memory_mib: 128,
            memory_max_mib: None,
            rootfs_fstype: "ext4".into(),
            rootfs_read_only: false,
            created_unix: 0,
            spec: serde_json::json!({}),
            vm: None,
            packed,
            rootfs_slot: None,
            pod: None,
        }
    }

    /// A packed checkpoint's files in a fresh directory.
    fn checkpoint() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("vm")).unwrap();
        std::fs::write(d.path().join("vm/state"), b"state").unwrap();
        std::fs::write(d.path().join("vm/memory.packed"), b"memory").unwrap();
        std::fs::write(d.path().join("rootfs.img.packed"), b"disk").unwrap();
        d
    }

    fn refused(d: &Path, m: &Manifest, origin: Origin) -> String {
        match take(d, m, &Config::default(), origin) {
            Err(SandboxError::InvalidArgument(why)) => why,
            other => panic!("not refused as invalid: {other:?}"),
        }
    }

    #[test]
    fn a_good_checkpoint_is_taken_and_read_through_its_open_files() {
        let d = checkpoint();
        let got = take(d.path(), &manifest(true), &Config::default(), Origin::Containerd).unwrap();
        assert_eq!(std::fs::read(got.memory.path()).unwrap(), b"memory");
        assert_eq!(got.disk.size(), 4);
        // Swapping the file afterwards changes nothing: the open one is read.
        std::fs::write(d.path().join("vm/other"), b"swapped").unwrap();
        std::fs::rename(d.path().join("vm/other"), d.path().join("vm/state")).unwrap();
        assert_eq!(std::fs::read(got.state.path()).unwrap(), b"state");
    }

    #[test]
    fn symlinks_devices_and_fifos_are_refused() {
        let sentinel = tempfile::NamedTempFile::new().unwrap();
        for target in [sentinel.path(), Path::new("/dev/zero")] {
            let d = checkpoint();
            std::fs::remove_file(d.path().join("rootfs.img.packed")).unwrap();
            std::os::unix::fs::symlink(target, d.path().join("rootfs.img.packed")).unwrap();
            let why = refused(d.path(), &manifest(true), Origin::Containerd);
            assert!(why.contains("rootfs.img.packed is a symlink"), "{why}");
        }
        // A symlinked directory on the way is refused too.
        let d = checkpoint();
        let elsewhere = checkpoint();
        std::fs::remove_dir_all(d.path().join("vm")).unwrap();
        std::os::unix::fs::symlink(elsewhere.path().join("vm"), d.path().join("vm")).unwrap();
        assert!(refused(d.path(), &manifest(true), Origin::Containerd).contains("is a symlink"));
        // A FIFO is refused at once, not waited on.
        let d = checkpoint();
        std::fs::remove_file(d.path().join("vm/state")).unwrap();
        let fifo = std::ffi::CString::new(d.path().join("vm/state").as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo reads a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let start = std::time::Instant::now();
        assert!(refused(d.path(), &manifest(true), Origin::Containerd).contains("not a regular file"));
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }

    #[test]
    fn an_unpacked_checkpoint_from_containerd_is_refused() {
        let d = checkpoint();
        let why = refused(d.path(), &manifest(false), Origin::Containerd);
        assert!(why.contains("must be packed"), "{why}");
    }

    #[test]
    fn a_vm_bigger_than_the_config_allows_is_refused() {
        let d = checkpoint();
        let mut m = manifest(true);
        m.memory_mib = Config::default().memory_mib.max + 1;
        assert!(refused(d.path(), &m, Origin::Containerd).contains("MiB of memory"));
        let mut m = manifest(true);
        m.vcpus = Config::default().vcpus.max + 1;
        assert!(refused(d.path(), &m, Origin::Containerd).contains("vCPUs"));
        let mut m = manifest(true);
        m.memory_max_mib = Some(Config::default().memory_mib.max + 1);
        assert!(refused(d.path(), &m, Origin::Containerd).contains("grows to"));
        m.memory_max_mib = Some(m.memory_mib - 1);
        assert!(refused(d.path(), &m, Origin::Containerd).contains("grows to"));
    }

    #[test]
    fn an_oversized_state_file_is_refused() {
        let d = checkpoint();
        let f = std::fs::File::create(d.path().join("vm/state")).unwrap();
        f.set_len(MAX_STATE + 1).unwrap();
        assert!(refused(d.path(), &manifest(true), Origin::Containerd).contains("vm/state is"));
    }
}
