//! Writing and reading the files of a checkpoint around the VM snapshot the
//! [`Lifecycle`](super::lifecycle::Lifecycle) takes: the rootfs disk (a
//! copy, or a [`sparse`] pack for containerd), the packed memory file, the
//! manifest; and unpacking a packed checkpoint for a restore. Layout in
//! [`snapshot`].

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::intake::Intake;
use super::lifecycle::VmInfo;
use super::rootfs::GuestRootfs;
use super::{signing, snapshot, sparse};
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

/// What a checkpoint carries: the container the manifest describes (a
/// pod's sandbox), the slot its disk is in (a template-born VM's), and a
/// pod's other containers.
#[derive(Debug, Clone)]
pub struct Carried {
    pub container: Contents,
    pub slot: Option<u32>,
    pub pod: Option<PodDisks>,
}

/// A pod's containers besides its sandbox, for its checkpoint: what the
/// manifest says of them, and the disk in each one's slot.
#[derive(Debug, Clone)]
pub struct PodDisks {
    pub manifest: snapshot::PodManifest,
    pub disks: Vec<(u32, PathBuf)>,
}

/// A [`sparse`] packer: source, destination, bytes written.
type PackJob = fn(&Path, &Path) -> std::io::Result<u64>;

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
fn manifest(
    c: &Contents,
    info: VmInfo,
    vm: Option<String>,
    packed: bool,
    (rootfs_slot, pod): (Option<u32>, Option<&PodDisks>),
) -> snapshot::Manifest {
    snapshot::Manifest {
        kind: snapshot::KIND.into(),
        format_version: snapshot::FORMAT_VERSION,
        container_id: c.guest_id.clone(),
        vcpus: info.vcpus,
        memory_mib: info.memory_mib,
        memory_max_mib: info.memory_max_mib,
        rootfs_fstype: c.rootfs.fstype.clone(),
        rootfs_read_only: c.rootfs.read_only,
        created_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        spec: c.spec.clone(),
        vm,
        packed,
        rootfs_slot,
        pod: pod.map(|p| p.manifest.clone()),
    }
}

/// Complete a checkpoint in `dir` whose VM snapshot is in `dir/vm` (the VM
/// is still paused, so the disk matches): the disk and the manifest;
/// `packed` (for containerd) stores the memory file and the disk as
/// [`sparse`] packs. A pod's (`pod`, never packed) carries each member's
/// disk too.
pub async fn complete(
    dir: &Path,
    carried: &Carried,
    info: VmInfo,
    packed: bool,
    key: &[u8],
) -> Result<()> {
    let (c, pod) = (&carried.container, carried.pod.as_ref());
    let vm_dir = snapshot::vm_dir(dir);
    if packed {
        let memory = vm_dir.join(snapshot::MEMORY);
        // The memory page-aligned: a restore maps it where it lies.
        let jobs: [(PathBuf, PathBuf, PackJob); 2] = [
            (
                memory.clone(),
                vm_dir.join(snapshot::packed(snapshot::MEMORY)),
                sparse::pack_aligned,
            ),
            (
                c.rootfs.disk.clone(),
                dir.join(snapshot::packed(snapshot::ROOTFS)),
                sparse::pack,
            ),
        ];
        for (from, to, job) in jobs {
            sparse_job("packing", from, to, job).await?;
        }
        std::fs::remove_file(&memory)
            .map_err(|e| SandboxError::Internal(format!("removing {}: {e}", memory.display())))?;
    } else {
        snapshot::copy_disk(&c.rootfs.disk, &dir.join(snapshot::ROOTFS)).await?;
        for (slot, disk) in pod.iter().flat_map(|p| p.disks.iter()) {
            snapshot::copy_disk(disk, &dir.join(snapshot::slot_disk(*slot))).await?;
        }
    }
    let m = snapshot::write_manifest(dir, &manifest(c, info, None, packed, (carried.slot, pod)))?;
    let state_path = vm_dir.join(snapshot::STATE_FILE);
    let state = std::fs::read(&state_path)
        .map_err(|e| SandboxError::io(format_args!("reading {}", state_path.display()), &e))?;
    let sig = signing::sign(key, &m, &state)?;
    let path = dir.join(signing::SIG_FILE);
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(sig.as_bytes()))
        .map_err(|e| SandboxError::io(format_args!("writing {}", path.display()), &e))
}

/// Remove what a failed checkpoint left in `dir`.
pub fn remove_partial(dir: &Path) {
    let slots = (0..=u32::try_from(snapshot::MAX_POD_MEMBERS).unwrap_or(0)).map(snapshot::slot_disk);
    for name in [
        snapshot::VM_DIR.to_string(),
        snapshot::ROOTFS.to_string(),
        snapshot::packed(snapshot::ROOTFS),
        snapshot::MANIFEST.to_string(),
        signing::SIG_FILE.to_string(),
    ]
    .into_iter()
    .chain(slots)
    {
        let p = dir.join(name);
        let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
    }
}

/// The manifest of hibernation link `link` in `dir` (the link itself is
/// the VM snapshot; the disk stays where it is).
pub fn complete_hibernation(dir: &Path, c: &Contents, info: VmInfo, link: String) -> Result<()> {
    snapshot::write_manifest(dir, &manifest(c, info, Some(link), false, (None, None))).map(drop)
}

/// What a restore hands burrow-vmm: the VM snapshot directory, and for a
/// page-aligned packed memory the open pack (`--packed-memory-fd`) whose
/// extents the directory's `memory.map` places.
#[derive(Debug)]
pub struct PreparedRestore {
    pub vm_dir: PathBuf,
    pub packed_memory: Option<std::fs::File>,
}

/// Whether the checkpoint's memory (`files`) is packed page-aligned, so a
/// restore maps it in place and unpacks nothing.
pub fn maps_in_place(manifest: &snapshot::Manifest, files: &Intake) -> Result<bool> {
    if !manifest.packed {
        return Ok(false);
    }
    sparse::is_aligned(files.memory.file(), &files.memory.path())
        .map_err(|e| SandboxError::InvalidArgument(format!("the checkpoint's memory: {e}")))
}

/// Give a restore of the checkpoint in `dir` (with `manifest`, its files
/// checked and held open in `files`) its own disk `img` (the checkpoint
/// stays usable for more restores) and say what the VMM restores. A packed
/// checkpoint's VM directory is made in `unpacked` (the caller removes it
/// once the VM runs): its memory mapped in place from the open pack when
/// `in_place` ([`maps_in_place`]), else unpacked there (the VMM maps the
/// memory file privately either way).
pub async fn prepare_restore(
    dir: &Path,
    manifest: &snapshot::Manifest,
    (files, in_place): (&Intake, bool),
    state: &[u8],
    img: &Path,
    unpacked: &Path,
) -> Result<PreparedRestore> {
    if !manifest.packed {
        snapshot::copy_disk(&files.disk.path(), img).await?;
        return Ok(PreparedRestore {
            vm_dir: snapshot::vm_dir(dir),
            packed_memory: None,
        });
    }
    let _ = std::fs::remove_dir_all(unpacked);
    std::fs::create_dir_all(unpacked)
        // The bytes whose signature was checked, not a second read.
        .and_then(|()| std::fs::write(unpacked.join(snapshot::STATE_FILE), state))
        .map_err(|e| {
            SandboxError::Internal(format!(
                "copying the VM state to {}: {e}",
                unpacked.display()
            ))
        })?;
    let memory = unpacked.join(snapshot::MEMORY);
    // Exactly the manifest's memory (which the intake checked against the
    // config): the memory pack is not signed.
    let bytes = manifest.memory_mib << 20;
    let packed_memory = if in_place {
        Some(map_in_place(files, unpacked, &memory, bytes)?)
    } else {
        unpack_memory(files, &memory, bytes).await?;
        None
    };
    sparse_job("unpacking", files.disk.path(), img.to_path_buf(), sparse::unpack).await?;
    Ok(PreparedRestore {
        vm_dir: unpacked.to_path_buf(),
        packed_memory,
    })
}

/// The VM directory's side of a memory mapped in place: its map, and a
/// memory file of `bytes` that is all holes (beneath the mapped extents);
/// returns the pack to pass the VMM.
fn map_in_place(
    files: &Intake,
    unpacked: &Path,
    memory: &Path,
    bytes: u64,
) -> Result<std::fs::File> {
    let pack = files.memory.file();
    let layout = sparse::aligned_layout(pack, &files.memory.path(), bytes)
        .map_err(|e| SandboxError::InvalidArgument(format!("the checkpoint's memory: {e}")))?;
    let map = unpacked.join(burrow_vmm_api::layout::MEMORY_MAP_FILE);
    std::fs::write(&map, burrow_vmm_api::memory_map::encode(&layout))
        .and_then(|()| std::fs::File::create(memory)?.set_len(bytes))
        .and_then(|()| pack.try_clone())
        .map_err(|e| {
            SandboxError::Internal(format!("preparing {}: {e}", unpacked.display()))
        })
}

async fn unpack_memory(files: &Intake, memory: &Path, bytes: u64) -> Result<()> {
    let (from, to) = (files.memory.path(), memory.to_path_buf());
    tokio::task::spawn_blocking(move || sparse::unpack_within(&from, &to, bytes))
        .await
        .map_err(|e| SandboxError::Internal(format!("unpacking the memory: {e}")))?
        .map_err(|e| {
            let _ = std::fs::remove_file(memory);
            SandboxError::InvalidArgument(format!("unpacking the memory: {e}"))
        })
}
