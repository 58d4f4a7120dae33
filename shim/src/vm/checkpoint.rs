//! Writing and reading the files of a checkpoint around the VM snapshot the
//! [`Lifecycle`](super::lifecycle::Lifecycle) takes: the rootfs disk (a
//! copy, or a [`sparse`] pack for containerd), the packed memory file, the
//! manifest; and unpacking a packed checkpoint for a restore. Layout in
//! [`snapshot`].

use std::path::{Path, PathBuf};

use super::intake::Intake;
use super::lifecycle::VmInfo;
use super::rootfs::GuestRootfs;
use super::{snapshot, sparse};
use crate::sandbox::{Result, SandboxError};

/// What a snapshot's manifest says about the container in it.
#[derive(Debug, Clone)]
pub struct Contents {
    /// The id the guest knows the container by.
    pub guest_id: String,
    pub rootfs: GuestRootfs,
    /// The spec as the guest got it.
    pub spec: serde_json::Value,
}

/// Run a [`sparse`] pack or unpack of `from` into `to` off the async threads.
async fn sparse_job<T: Send + 'static>(
    what: &'static str,
    from: PathBuf,
    to: PathBuf,
    job: fn(&Path, &Path) -> std::io::Result<T>,
) -> Result<T> {
    let (f, t) = (from.clone(), to.clone());
    tokio::task::spawn_blocking(move || job(&f, &t))
        .await
        .map_err(|e| SandboxError::Internal(format!("{what} {}: {e}", from.display())))?
        .map_err(|e| {
            let _ = std::fs::remove_file(&to);
            SandboxError::io(
                format_args!("{what} {} into {}", from.display(), to.display()),
                &e,
            )
        })
}

/// The manifest of a snapshot of `c` in `vm` (a hibernation link's name,
/// or None for a checkpoint's `vm/`).
fn manifest(c: &Contents, info: VmInfo, vm: Option<String>, packed: bool) -> snapshot::Manifest {
    snapshot::Manifest {
        kind: snapshot::KIND.into(),
        format_version: snapshot::FORMAT_VERSION,
        container_id: c.guest_id.clone(),
        vcpus: info.vcpus,
        memory_mib: info.memory_mib,
        rootfs_fstype: c.rootfs.fstype.clone(),
        rootfs_read_only: c.rootfs.read_only,
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        spec: c.spec.clone(),
        vm,
        packed,
    }
}

/// Complete a checkpoint in `dir` whose VM snapshot is in `dir/vm` (the VM
/// is still paused, so the disk matches): the disk and the manifest;
/// `packed` (for containerd) stores the memory file and the disk as
/// [`sparse`] packs.
pub async fn complete(dir: &Path, c: &Contents, info: VmInfo, packed: bool) -> Result<()> {
    let vm_dir = snapshot::vm_dir(dir);
    if packed {
        let memory = vm_dir.join(snapshot::MEMORY);
        let jobs = [
            (
                memory.clone(),
                vm_dir.join(snapshot::packed(snapshot::MEMORY)),
            ),
            (
                c.rootfs.disk.clone(),
                dir.join(snapshot::packed(snapshot::ROOTFS)),
            ),
        ];
        for (from, to) in jobs {
            sparse_job("packing", from, to, sparse::pack).await?;
        }
        std::fs::remove_file(&memory)
            .map_err(|e| SandboxError::Internal(format!("removing {}: {e}", memory.display())))?;
    } else {
        snapshot::copy_disk(&c.rootfs.disk, &dir.join(snapshot::ROOTFS)).await?;
    }
    snapshot::write_manifest(dir, &manifest(c, info, None, packed))
}

/// Remove what a failed checkpoint left in `dir`.
pub fn remove_partial(dir: &Path) {
    for name in [
        snapshot::VM_DIR.to_string(),
        snapshot::ROOTFS.to_string(),
        snapshot::packed(snapshot::ROOTFS),
        snapshot::MANIFEST.to_string(),
    ] {
        let p = dir.join(name);
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
}

/// The manifest of hibernation link `link` in `dir` (the link itself is
/// the VM snapshot; the disk stays where it is).
pub fn complete_hibernation(dir: &Path, c: &Contents, info: VmInfo, link: String) -> Result<()> {
    snapshot::write_manifest(dir, &manifest(c, info, Some(link), false))
}

/// Give a restore of the checkpoint in `dir` (with `manifest`, its files
/// checked and held open in `files`) its own disk `img` (the checkpoint
/// stays usable for more restores) and return the VM snapshot directory to
/// restore. A packed checkpoint is unpacked from the open files into
/// `unpacked`, which the caller removes once the VM runs (the VMM maps the
/// memory file privately).
pub async fn prepare_restore(
    dir: &Path,
    manifest: &snapshot::Manifest,
    files: &Intake,
    img: &Path,
    unpacked: &Path,
) -> Result<PathBuf> {
    if !manifest.packed {
        snapshot::copy_disk(&files.disk.path(), img).await?;
        return Ok(snapshot::vm_dir(dir));
    }
    let _ = std::fs::remove_dir_all(unpacked);
    std::fs::create_dir_all(unpacked)
        .and_then(|()| std::fs::copy(files.state.path(), unpacked.join(snapshot::STATE_FILE)))
        .map_err(|e| {
            SandboxError::Internal(format!(
                "copying the VM state to {}: {e}",
                unpacked.display()
            ))
        })?;
    let memory = unpacked.join(snapshot::MEMORY);
    sparse_job("unpacking", files.memory.path(), memory, sparse::unpack).await?;
    sparse_job("unpacking", files.disk.path(), img.to_path_buf(), sparse::unpack).await?;
    Ok(unpacked.to_path_buf())
}
