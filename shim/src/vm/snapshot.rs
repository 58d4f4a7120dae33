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
/// Most containers a pod's checkpoint carries besides its sandbox (the
/// config's `pod_disk_slots` is at most 16).
pub const MAX_POD_MEMBERS: usize = 16;
/// Largest manifest read: a spec each for the sandbox and its members
/// (each bounded by MAX_SPEC_BYTES), plus room.
pub const MAX_MANIFEST: u64 = (MAX_POD_MEMBERS as u64 + 2) * burrow_protocol::MAX_SPEC_BYTES as u64;
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
    /// What the VM's memory may grow to (a pod's, `--mem-max`), when it
    /// can; a restore passes it as `--expect-mem-max`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_max_mib: Option<u64>,
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
    /// The block slot the container's disk is in (a template-born VM's);
    /// none: it is the VM's first disk. A restore gives the disk in the
    /// same place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rootfs_slot: Option<u32>,
    /// A CRI pod's checkpoint: the VM's block slots and the pod's other
    /// containers. The fields above describe its sandbox container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodManifest>,
}

/// What a pod's checkpoint holds beyond its sandbox container: a named
/// checkpoint of the whole VM, every container's disk beside it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodManifest {
    /// The VM's block slots (a template-born VM's sandbox is in slot 0,
    /// the manifest's `rootfs_slot`).
    pub slots: u32,
    /// How many of them are for shared image layers (`pod_layer_slots`).
    #[serde(default)]
    pub layer_slots: u32,
    pub members: Vec<PodMember>,
    /// What the pod's VM grew to and why (its members' limits by CRI
    /// name): a restored pod grows on from it. None in a checkpoint from
    /// before pods grew, or of a VM that does not: the restored one does
    /// not grow either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub growth: Option<super::grow::PodGrowth>,
}

/// One container of a pod's checkpoint, besides its sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PodMember {
    /// The id the guest knows it by.
    pub guest_id: String,
    /// Its CRI name (`io.kubernetes.cri.container-name`): a container of
    /// that name in the restored pod continues it.
    pub name: String,
    /// The block slot its disk is in; the disk is [`slot_disk`] of it.
    pub slot: u32,
    /// The slot of the read-only image layer its disk is overlaid on (its
    /// disk is then that overlay's upper layer), shared with the pod's
    /// other members of that image ([`super::layered`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lower_slot: Option<u32>,
    pub rootfs_fstype: String,
    pub rootfs_read_only: bool,
    /// Its spec as the guest got it.
    pub spec: serde_json::Value,
}

/// The file of a pod checkpoint's disk in slot `n` (named by the number,
/// never by anything a manifest says).
pub fn slot_disk(n: u32) -> String {
    format!("slot-{n}.img")
}

impl PodManifest {
    /// The slots of shared image layers, each once, in slot order.
    pub fn lower_slots(&self) -> Vec<u32> {
        let mut lowers: Vec<u32> = self.members.iter().filter_map(|m| m.lower_slot).collect();
        lowers.sort_unstable();
        lowers.dedup();
        lowers
    }

    /// Every filled slot but the sandbox's: the members' and their shared
    /// layers', in slot order.
    pub fn disk_slots(&self) -> Vec<u32> {
        let mut all: Vec<u32> = self.members.iter().map(|m| m.slot).chain(self.lower_slots()).collect();
        all.sort_unstable();
        all.dedup();
        all
    }

    /// Check what a restore relies on: slot numbers (the members' and the
    /// sandbox's `rootfs_slot`) within the VM's, each used once, plain ids
    /// and names, at most [`MAX_POD_MEMBERS`].
    pub fn check(&self, rootfs_slot: Option<u32>) -> std::result::Result<(), String> {
        let max_slots = u32::try_from(MAX_POD_MEMBERS).unwrap_or(u32::MAX).saturating_add(1);
        if self.slots == 0 || self.slots > max_slots {
            return Err(format!("{} block slots (1 to {max_slots})", self.slots));
        }
        if self.layer_slots > self.slots {
            return Err(format!("{} of {} block slots for layers", self.layer_slots, self.slots));
        }
        if self.members.len() > MAX_POD_MEMBERS {
            return Err(format!("{} pod members (at most {MAX_POD_MEMBERS})", self.members.len()));
        }
        let mut used = vec![false; usize::try_from(self.slots).unwrap_or(0)];
        let slots = rootfs_slot.into_iter().chain(self.members.iter().map(|m| m.slot));
        let slots = slots.chain(self.lower_slots());
        for n in slots {
            match usize::try_from(n).ok().and_then(|i| used.get_mut(i)) {
                Some(u) if !*u => *u = true,
                Some(_) => return Err(format!("slot {n} is given twice")),
                None => return Err(format!("slot {n} is beyond the VM's {}", self.slots)),
            }
        }
        for m in &self.members {
            if m.guest_id.is_empty() || m.guest_id.len() > burrow_protocol::MAX_ID_LEN {
                return Err("a member has a bad container id".into());
            }
            if m.name.is_empty() || m.name.len() > burrow_protocol::MAX_ID_LEN {
                return Err(format!("member {} has a bad name", m.guest_id));
            }
        }
        Ok(())
    }
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
    if let Some(pod) = &m.pod {
        if m.packed {
            return Err(bad("a pod's checkpoint is never packed".into()));
        }
        pod.check(m.rootfs_slot).map_err(bad)?;
        need.extend(pod.disk_slots().into_iter().map(|n| dir.join(slot_disk(n))));
    } else if let Some(n) = m.rootfs_slot {
        if usize::try_from(n).map_or(true, |n| n > MAX_POD_MEMBERS) {
            return Err(bad(format!("rootfs slot {n} is beyond any VM's")));
        }
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
            memory_max_mib: None,
            rootfs_fstype: "ext4".into(),
            rootfs_read_only: false,
            created_unix: 1,
            spec: serde_json::json!({"ociVersion": "1.0.2"}),
            vm: None,
            packed: false,
            rootfs_slot: None,
            pod: None,
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

    fn pod_member(slot: u32) -> PodMember {
        PodMember {
            guest_id: format!("c{slot}"),
            name: format!("app{slot}"),
            slot,
            lower_slot: None,
            rootfs_fstype: "ext4".into(),
            rootfs_read_only: false,
            spec: serde_json::json!({}),
        }
    }

    #[test]
    fn a_pods_manifest_needs_each_members_disk_and_sane_slots() {
        let d = tempfile::tempdir().unwrap();
        let mut m = sample();
        m.rootfs_slot = Some(0);
        m.pod = Some(PodManifest {
            slots: 9,
            layer_slots: 2,
            members: vec![pod_member(1), pod_member(3)],
            growth: None,
        });
        write_manifest(d.path(), &m).unwrap();
        populate(d.path());
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("slot-1.img is missing"), "{e}");
        std::fs::write(d.path().join(slot_disk(1)), b"d").unwrap();
        std::fs::write(d.path().join(slot_disk(3)), b"d").unwrap();
        assert_eq!(read_manifest(d.path()).unwrap(), m);
        // Two members on one shared image layer: its disk once, needed.
        let shared = PodManifest {
            slots: 9,
            layer_slots: 2,
            members: vec![
                PodMember { lower_slot: Some(5), ..pod_member(1) },
                PodMember { lower_slot: Some(5), ..pod_member(3) },
            ],
            growth: None,
        };
        assert_eq!(shared.lower_slots(), [5]);
        assert_eq!(shared.disk_slots(), [1, 3, 5]);
        m.pod = Some(shared);
        write_manifest(d.path(), &m).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("slot-5.img is missing"), "{e}");
        std::fs::write(d.path().join(slot_disk(5)), b"d").unwrap();
        assert_eq!(read_manifest(d.path()).unwrap(), m);
        let bad = [
            (PodManifest { slots: 9, layer_slots: 0, members: vec![pod_member(0)], growth: None }, "slot 0 is given twice"),
            (PodManifest { slots: 2, layer_slots: 0, members: vec![pod_member(2)], growth: None }, "beyond the VM's 2"),
            (PodManifest { slots: 0, layer_slots: 0, members: vec![], growth: None }, "0 block slots"),
            (PodManifest { slots: 99, layer_slots: 0, members: vec![], growth: None }, "99 block slots"),
            (
                PodManifest { slots: 17, layer_slots: 0, members: (1..18).map(pod_member).collect(), growth: None },
                "17 pod members",
            ),
            (
                PodManifest {
                    slots: 9,
                    layer_slots: 0,
                    members: vec![PodMember { name: String::new(), ..pod_member(1) }],
                    growth: None,
                },
                "bad name",
            ),
            (PodManifest { slots: 2, layer_slots: 3, members: vec![], growth: None }, "3 of 2 block slots"),
            (
                PodManifest {
                    slots: 9,
                    layer_slots: 2,
                    members: vec![PodMember { lower_slot: Some(3), ..pod_member(1) }, pod_member(3)],
                    growth: None,
                },
                "slot 3 is given twice",
            ),
            (
                PodManifest {
                    slots: 9,
                    layer_slots: 2,
                    members: vec![PodMember { lower_slot: Some(9), ..pod_member(1) }],
                    growth: None,
                },
                "beyond the VM's 9",
            ),
        ];
        for (pod, want) in bad {
            m.pod = Some(pod);
            write_manifest(d.path(), &m).unwrap();
            let e = read_manifest(d.path()).unwrap_err();
            assert!(e.to_string().contains(want), "{want}: {e}");
        }
        m.pod = Some(PodManifest { slots: 9, layer_slots: 0, members: vec![], growth: None });
        m.packed = true;
        write_manifest(d.path(), &m).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("never packed"), "{e}");
        m.pod = None;
        m.packed = false;
        m.rootfs_slot = Some(99);
        write_manifest(d.path(), &m).unwrap();
        let e = read_manifest(d.path()).unwrap_err();
        assert!(e.to_string().contains("rootfs slot 99"), "{e}");
    }
}
