//! The on-disk layout of a burrow checkpoint (what `Checkpoint` writes and
//! Create-from-checkpoint reads):
//!
//! ```text
//! <dir>/burrow.json   manifest (this module): format version, container id,
//!                     VM size, rootfs file system, the OCI spec
//! <dir>/vm/state      burrow-vmm snapshot: vCPUs, devices (see vmm/README.md)
//! <dir>/vm/memory     burrow-vmm snapshot: guest RAM (sparse)
//! <dir>/rootfs.img    copy of the container's writable disk at that instant
//! ```
//!
//! A checkpoint written for containerd is *packed* (manifest `packed`):
//! `vm/memory.packed` and `rootfs.img.packed` in [`super::sparse`]'s form in
//! place of the two sparse files, because containerd's tar would store
//! their holes as zeros.
//!
//! A hibernation snapshot (`<snapshot_dir>/<namespace>/<sandbox id>/`) has
//! the same layout without `rootfs.img` (the sandbox's disk stays in its
//! image directory, untouched while the VM is stopped), and its VM snapshots
//! are a chain: `vm-<n>/`, a full one and then incremental ones on top of
//! it, the newest named by the manifest's `vm` field.
//!
//! The manifest is small JSON, read with a size bound and checked before
//! anything is started.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox::{Result, SandboxError};

/// File names: the manifest, the VMM's snapshot directory inside a
/// checkpoint, the copied writable disk, the VMM's memory and state files,
/// the suffix of a packed file (see [`super::sparse`]); one definition for
/// the VMM, shim and CLI in burrow-vmm-api.
pub use burrow_vmm_api::layout::{
    MANIFEST, MAX_NAME, MEMORY_FILE as MEMORY, PACKED, ROOTFS, STATE_FILE, VM_DIR,
};
/// Format version this shim writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Largest manifest read (the spec is bounded by MAX_SPEC_BYTES, plus room).
pub const MAX_MANIFEST: u64 = 2 * 1024 * 1024;
/// What `kind` says, so a stray directory is not mistaken for a checkpoint.
pub const KIND: &str = "burrow-checkpoint";

/// `burrow.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    pub kind: String,
    pub format_version: u32,
    /// The container id inside the guest (the agent knows it by this id,
    /// whatever id a restored task gets from containerd).
    pub container_id: String,
    pub vcpus: u32,
    pub memory_mib: u64,
    /// File system of the rootfs disk (for the record; the guest has it
    /// mounted already).
    pub rootfs_fstype: String,
    pub rootfs_read_only: bool,
    /// Unix seconds when it was taken.
    pub created_unix: u64,
    /// The OCI spec the container was created with (as the guest got it).
    pub spec: serde_json::Value,
    /// The VMM snapshot directory inside the checkpoint, when it is not
    /// [`VM_DIR`] (hibernation chains: `vm-<n>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// The memory file and the disk are packed (`*.packed`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packed: bool,
}

/// `name` with the packed suffix.
pub fn packed(name: &str) -> String {
    format!("{name}{PACKED}")
}

impl Manifest {
    /// The VMM snapshot directory of checkpoint `dir` this manifest names.
    pub fn vm_dir(&self, dir: &Path) -> PathBuf {
        dir.join(self.vm.as_deref().unwrap_or(VM_DIR))
    }
}

/// Write the manifest into `dir`; returns the bytes written (what a
/// checkpoint's signature covers).
pub fn write_manifest(dir: &Path, m: &Manifest) -> Result<Vec<u8>> {
    let data = serde_json::to_vec_pretty(m)
        .map_err(|e| SandboxError::Internal(format!("encoding the manifest: {e}")))?;
    let path = dir.join(MANIFEST);
    std::fs::write(&path, &data)
        .map_err(|e| SandboxError::io(format_args!("writing {}", path.display()), &e))?;
    Ok(data)
}

/// Read and check the manifest of checkpoint `dir`, and that the files it
/// needs are there.
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    read_manifest_with(dir, true)
}

/// [`read_manifest`], with the bytes it was read from (what a checkpoint's
/// signature covers).
pub fn read_manifest_bytes(dir: &Path) -> Result<(Manifest, Vec<u8>)> {
    read_manifest_inner(dir, true)
}

/// Like [`read_manifest`]; a hibernation snapshot has no `rootfs.img` (the
/// sandbox's own disk stays where it is), so `with_rootfs` is false there.
pub fn read_manifest_with(dir: &Path, with_rootfs: bool) -> Result<Manifest> {
    read_manifest_inner(dir, with_rootfs).map(|(m, _)| m)
}

fn read_manifest_inner(dir: &Path, with_rootfs: bool) -> Result<(Manifest, Vec<u8>)> {
    use std::io::Read;
    let bad = |why: String| {
        SandboxError::InvalidArgument(format!(
            "{} is not a usable burrow checkpoint: {why}",
            dir.display()
        ))
    };
    // Beneath the directory, no symlink, a regular file (a FIFO must not
    // block, /dev/zero must not be read), like every other member.
    let base = std::fs::File::open(dir).map_err(|e| bad(e.to_string()))?;
    let f = super::intake::open_beneath(&base, dir, MANIFEST, MAX_MANIFEST)?.into_file();
    let mut data = Vec::new();
    f.take(MAX_MANIFEST + 1)
        .read_to_end(&mut data)
        .map_err(|e| bad(format!("{MANIFEST}: {e}")))?;
    if data.len() as u64 > MAX_MANIFEST {
        return Err(bad(format!(
            "{MANIFEST} is larger than {MAX_MANIFEST} bytes"
        )));
    }
    let m: Manifest = serde_json::from_slice(&data).map_err(|e| bad(format!("{MANIFEST}: {e}")))?;
    if m.kind != KIND {
        return Err(bad(format!(
            "{MANIFEST} kind is {:?}, not {KIND:?}",
            m.kind
        )));
    }
    if m.format_version != FORMAT_VERSION {
        return Err(bad(format!(
            "format version {} (this shim reads {FORMAT_VERSION})",
            m.format_version
        )));
    }
    if m.container_id.is_empty() || m.container_id.len() > burrow_protocol::MAX_ID_LEN {
        return Err(bad("bad container id".into()));
    }
    if m.vcpus == 0 || m.memory_mib == 0 {
        return Err(bad("VM size is zero".into()));
    }
    if let Some(name) = &m.vm {
        if !crate::is_plain_name(name, MAX_NAME) {
            return Err(bad(format!("bad vm directory name {name:?}")));
        }
    }
    let vm = m.vm_dir(dir);
    let name = |n: &str| if m.packed { packed(n) } else { n.to_string() };
    let mut need = vec![vm.join(STATE_FILE), vm.join(name(MEMORY))];
    if with_rootfs {
        need.push(dir.join(name(ROOTFS)));
    }
    // Only that they are there: what they are (a symlink, a FIFO) is for
    // the intake to refuse, by name (`is_file` would follow a symlink and
    // call a FIFO missing).
    for f in need {
        if std::fs::symlink_metadata(&f).is_err() {
            return Err(bad(format!("{} is missing", f.display())));
        }
    }
    Ok((m, data))
}

/// The VMM snapshot directory of checkpoint `dir`.
pub fn vm_dir(dir: &Path) -> PathBuf {
    dir.join(VM_DIR)
}

/// Copy a disk (image file or block device) to `to`: a reflink where the
/// file system can, else a sparse copy.
pub async fn copy_disk(from: &Path, to: &Path) -> Result<()> {
    let out = tokio::process::Command::new("cp")
        .arg("--reflink=auto")
        .arg("--sparse=always")
        .arg("--")
        .arg(from)
        .arg(to)
        .output()
        .await
        .map_err(|e| SandboxError::Internal(format!("running cp: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        let _ = std::fs::remove_file(to);
        Err(SandboxError::Internal(format!(
            "copying {} to {}: {}",
            from.display(),
            to.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn sample() -> Manifest {
        Manifest {
            kind: KIND.into(),
            format_version: FORMAT_VERSION,
            container_id: "c1".into(),
            vcpus: 1,
            memory_mib: 256,
            rootfs_fstype: "ext4".into(),
            rootfs_read_only: false,
            created_unix: 1,
            spec: serde_json::json!({"ociVersion": "1.0.2"}),
            vm: None,
            packed: false,
        }
    }

    fn populate(dir: &Path) {
        std::fs::create_dir_all(vm_dir(dir)).unwrap();
        std::fs::write(vm_dir(dir).join("state"), b"s").unwrap();
        std::fs::write(vm_dir(dir).join("memory"), b"m").unwrap();
        std::fs::write(dir.join(ROOTFS), b"r").unwrap();
    }

    #[test]
    fn round_trip() {
        let d = tempfile::tempdir().unwrap();
        populate(d.path());
        write_manifest(d.path(), &sample()).unwrap();
        assert_eq!(read_manifest(d.path()).unwrap(), sample());
    }

    #[test]
    fn refuses_garbage_versions_and_missing_files() {
        let d = tempfile::tempdir().unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(
            e.to_string().contains("not a usable burrow checkpoint"),
            "{e}"
        );
        std::fs::write(d.path().join(MANIFEST), b"\x00garbage").unwrap();
        assert!(read_manifest(d.path()).is_err());
        let mut m = sample();
        m.format_version = 99;
        write_manifest(d.path(), &m).unwrap();
        populate(d.path());
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("format version 99"), "{e}");
        write_manifest(d.path(), &sample()).unwrap();
        std::fs::remove_file(d.path().join(ROOTFS)).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("rootfs.img is missing"), "{e}");
    }

    #[test]
    fn a_named_vm_directory_is_read_and_checked() {
        let d = tempfile::tempdir().unwrap();
        let mut m = sample();
        m.vm = Some("vm-3".into());
        write_manifest(d.path(), &m).unwrap();
        let e = read_manifest_with(d.path(), false).unwrap_err();
        assert!(e.to_string().contains("vm-3/state is missing"), "{e}");
        std::fs::create_dir_all(d.path().join("vm-3")).unwrap();
        std::fs::write(d.path().join("vm-3/state"), b"s").unwrap();
        std::fs::write(d.path().join("vm-3/memory"), b"m").unwrap();
        let got = read_manifest_with(d.path(), false).unwrap();
        assert_eq!(got.vm_dir(d.path()), d.path().join("vm-3"));
        for bad in ["../etc", "/abs", "", "..", "a b"] {
            m.vm = Some(bad.into());
            write_manifest(d.path(), &m).unwrap();
            let e = read_manifest_with(d.path(), false).unwrap_err();
            assert!(
                e.to_string().contains("bad vm directory name"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn refuses_oversized_manifest() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join(MANIFEST)).unwrap();
        f.set_len(MAX_MANIFEST + 10).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("more than the"), "{e}");
    }

    #[test]
    fn a_manifest_that_is_a_symlink_or_a_fifo_is_refused_at_once() {
        let d = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.path().join(MANIFEST)).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("burrow.json is a symlink"), "{e}");
        std::fs::remove_file(d.path().join(MANIFEST)).unwrap();
        let fifo = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(
            d.path().join(MANIFEST).as_os_str(),
        ))
        .unwrap();
        // SAFETY: mkfifo reads a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let start = std::time::Instant::now();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
    }
}
