//! Bounded host writes (issue 15): where a sandbox's rootfs images live,
//! and how much of the host's disk a sandbox may take.
//!
//! - **Images** go to `<image_dir>/<namespace>/<sandbox id>/<container>.rootfs.img`
//!   (config `image_dir`, default `/var/lib/burrow/images`), not into the
//!   state directory: `state_dir` is a tmpfs (`/run/burrow`), where every
//!   block the guest writes would be host RAM. Directories are made 0700,
//!   images 0600 with `O_EXCL` (never an existing file, never through a
//!   symlink). A jailed burrow-vmm needs no view of the directory: its boot
//!   disk is opened before it enters its jail and a block slot's disk is
//!   passed to it as a descriptor ([`super::pod`]).
//! - **The budget** (`sandbox_disk_limit_mib`, default 64 GiB, 0 = none;
//!   the annotation [`ANNOTATION`] may only lower it) covers what a
//!   sandbox keeps on the host's disk: the bytes its images have allocated
//!   (`st_blocks * 512`: they are sparse) and its hibernation snapshot
//!   directory (`<snapshot_dir>/<namespace>/<sandbox id>`, every link of
//!   the chain). It is checked before anything is written, against what
//!   the write can add at most:
//!   - a new image: its full apparent size (`st_size`), all of which the
//!     guest may fill, so one create never promises more than the limit;
//!   - a restore's image: the checkpoint disk's apparent size;
//!   - a hibernation: the VM's memory (what one link of the chain holds
//!     at most; a chain that starts afresh drops its old links only after
//!     the check, so the check is on the safe side);
//!   - a checkpoint: the VM's memory (twice when packed for containerd: the
//!     sparse file and its pack exist at once for a moment) and the disk's
//!     allocated bytes (its copy).
//!
//!   A refusal is RESOURCE_EXHAUSTED naming `sandbox_disk_limit_mib` and the
//!   sizes; nothing is written and nothing is lost (a running VM runs on,
//!   a refused hibernation leaves it running). What a guest writes into an
//!   image it has is not checked again: the image cannot grow past its
//!   apparent size.

use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::sandbox::{Result, SandboxError};

/// Per-container override of `sandbox_disk_limit_mib`: MiB, only lower.
pub const ANNOTATION: &str = "io.burrow.sandbox_disk_limit_mib";
/// An image's name after its container's id.
pub const IMAGE_SUFFIX: &str = ".rootfs.img";
/// Longest file name most file systems take (NAME_MAX).
const NAME_MAX: usize = 255;
/// How much of an over-long container id an image's name keeps.
const KEPT_ID: usize = 200;
const MIB: u64 = 1 << 20;

/// The directory of sandbox `sandbox_id`'s images.
pub fn sandbox_images(image_dir: &Path, namespace: &str, sandbox_id: &str) -> PathBuf {
    image_dir.join(namespace).join(sandbox_id)
}

/// The file name of container `id`'s image: `<id>.rootfs.img`, or for an
/// id too long for one file name (ids may have 256 characters) its first
/// 200 characters and a hash of all of it.
pub fn image_name(id: &str) -> String {
    if id.len() + IMAGE_SUFFIX.len() <= NAME_MAX {
        return format!("{id}{IMAGE_SUFFIX}");
    }
    let hash: String = Sha256::digest(id.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    // Ids are ASCII (validated), so any byte is a boundary; be safe anyway.
    let kept: String = id.chars().take(KEPT_ID).collect();
    format!("{kept}-{hash}{IMAGE_SUFFIX}")
}

/// Make `dir` (and what is missing above it) with mode 0700, and make sure
/// `dir` itself is 0700 if it was there already.
pub fn make_private_dir(dir: &Path) -> Result<()> {
    let mut tries = 0;
    loop {
        let r = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)));
        match r {
            // Another sandbox of the namespace removed its directory, empty
            // for a moment, between the two mkdirs: again.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 3 => tries += 1,
            r => {
                return r
                    .map_err(|e| SandboxError::io(format_args!("creating {}", dir.display()), &e))
            }
        }
    }
}

/// Create image file `path`: new (`O_EXCL`, so neither an existing file
/// nor a symlink is followed), 0600.
pub fn create_image(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| SandboxError::io(format_args!("creating {}", path.display()), &e))
}

/// Remove directory `dir` if it is empty, and then its parent (the
/// namespace's) if that is empty too.
pub fn remove_if_empty(dir: &Path) {
    if std::fs::remove_dir(dir).is_ok() {
        if let Some(parent) = dir.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
}

/// Remove a sandbox's image directory with everything in it, and the
/// namespace's directory once it is empty.
pub fn remove_sandbox_images(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Bytes allocated on disk under `path` (a file, or a directory walked
/// without following symlinks); 0 for what is not there.
pub fn allocated(path: &Path) -> u64 {
    let mut total = 0u64;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(md) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        total = total.saturating_add(md.blocks().saturating_mul(512));
        if md.is_dir() {
            stack.extend(
                std::fs::read_dir(&p)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path()),
            );
        }
    }
    total
}

/// What a sandbox holds on the host's disk now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Allocated bytes of its rootfs images.
    pub images: u64,
    /// Allocated bytes of its hibernation snapshots.
    pub snapshots: u64,
}

impl Usage {
    /// Measure a sandbox's image directory and hibernation directory.
    pub fn of(images: &Path, snapshots: &Path) -> Self {
        Self {
            images: allocated(images),
            snapshots: allocated(snapshots),
        }
    }

    pub fn total(&self) -> u128 {
        u128::from(self.images) + u128::from(self.snapshots)
    }
}

/// The sandbox's limit in MiB (0: none): the config's, lowered by the
/// spec's [`ANNOTATION`] if it has one. The annotation cannot raise it nor
/// lift it (0 there is refused).
pub fn limit_mib(config_mib: u64, spec: &serde_json::Value) -> Result<u64> {
    let Some(v) = crate::spec::annotation(spec, ANNOTATION) else {
        return Ok(config_mib);
    };
    let asked = v
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| {
            SandboxError::InvalidArgument(format!(
                "annotation {ANNOTATION}={v:?}: want a number of MiB above 0 (it may only lower sandbox_disk_limit_mib)"
            ))
        })?;
    Ok(if config_mib == 0 {
        asked
    } else {
        asked.min(config_mib)
    })
}

/// Bytes as MiB with one decimal (rounded up), for messages.
fn mib(bytes: impl Into<u128>) -> String {
    let tenths = (bytes.into() * 10).div_ceil(u128::from(MIB));
    format!("{}.{} MiB", tenths / 10, tenths % 10)
}

/// Refuse `what`, which may add `adding` bytes to a sandbox holding
/// `used`, when that would take it over `limit_mib` (0: no limit).
pub fn check(limit_mib: u64, used: Usage, adding: u64, what: &str) -> Result<()> {
    if limit_mib == 0 {
        return Ok(());
    }
    // In u128: no sum or product here can overflow it.
    let limit = u128::from(limit_mib) * u128::from(MIB);
    let total = used.total() + u128::from(adding);
    if total <= limit {
        return Ok(());
    }
    Err(SandboxError::ResourceExhausted(format!(
        "sandbox disk limit: {what} may write {}, and the sandbox holds {} already ({} in rootfs images, {} in hibernation snapshots): {} is over its limit of {limit_mib} MiB (sandbox_disk_limit_mib in the burrow config; the annotation {ANNOTATION} may lower it); nothing was written",
        mib(adding),
        mib(used.total()),
        mib(used.images),
        mib(used.snapshots),
        mib(total),
    )))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn images_are_per_namespace_and_sandbox() {
        let root = Path::new("/var/lib/burrow/images");
        let id = "a".repeat(64);
        let dir = sandbox_images(root, "k8s.io", &id);
        assert_eq!(dir, root.join("k8s.io").join(&id));
        let img = dir.join(image_name("c1"));
        assert_eq!(
            img,
            PathBuf::from(format!("/var/lib/burrow/images/k8s.io/{id}/c1.rootfs.img"))
        );
        assert!(!img.starts_with("/run"));
        // CRI's 64-character ids fit as they are.
        assert_eq!(image_name(&id), format!("{id}.rootfs.img"));
    }

    #[test]
    fn an_over_long_id_still_names_one_file_of_its_own() {
        let longest = "b".repeat(NAME_MAX - IMAGE_SUFFIX.len());
        assert_eq!(image_name(&longest), format!("{longest}{IMAGE_SUFFIX}"));
        let a = format!("{}x", "c".repeat(255));
        let b = format!("{}y", "c".repeat(255));
        let (na, nb) = (image_name(&a), image_name(&b));
        assert!(na.len() <= NAME_MAX && nb.len() <= NAME_MAX, "{na}");
        assert_ne!(na, nb, "a hash of the whole id tells them apart");
        assert!(na.ends_with(IMAGE_SUFFIX) && na.starts_with(&"c".repeat(KEPT_ID)));
        assert_eq!(image_name(&a), na, "stable: delete finds it again");
        // The file system takes it.
        let d = tempfile::tempdir().unwrap();
        create_image(&d.path().join(&na)).unwrap();
    }

    #[test]
    fn directories_are_0700_and_images_0600_and_new() {
        let d = tempfile::tempdir().unwrap();
        let dir = sandbox_images(&d.path().join("images"), "default", "sb");
        make_private_dir(&dir).unwrap();
        for p in [
            d.path().join("images"),
            d.path().join("images/default"),
            dir.clone(),
        ] {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode & 0o077, 0, "{} is {mode:o}", p.display());
        }
        // An existing directory is made private again.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        make_private_dir(&dir).unwrap();
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700);
        let img = dir.join(image_name("c1"));
        create_image(&img).unwrap();
        let mode = std::fs::metadata(&img).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
        // Never an existing file, never through a symlink.
        assert!(create_image(&img).is_err());
        let target = d.path().join("elsewhere");
        std::os::unix::fs::symlink(&target, dir.join("c2.rootfs.img")).unwrap();
        assert!(create_image(&dir.join("c2.rootfs.img")).is_err());
        assert!(!target.exists());
        std::fs::remove_file(dir.join("c2.rootfs.img")).unwrap();
        // Removing: a non-empty directory stays, an empty one goes with its
        // namespace directory; the whole sandbox directory goes at once.
        remove_if_empty(&dir);
        assert!(img.exists());
        std::fs::remove_file(&img).unwrap();
        remove_if_empty(&dir);
        assert!(!d.path().join("images/default").exists());
        assert!(d.path().join("images").exists(), "image_dir itself stays");
        make_private_dir(&dir).unwrap();
        create_image(&dir.join(image_name("c3"))).unwrap();
        remove_sandbox_images(&dir);
        assert!(!d.path().join("images/default").exists());
    }

    #[test]
    fn usage_counts_allocated_blocks_not_apparent_size() {
        let d = tempfile::tempdir().unwrap();
        let images = d.path().join("images");
        let snaps = d.path().join("snaps");
        make_private_dir(&images).unwrap();
        // A sparse 1 GiB image with 1 MiB written.
        let f = create_image(&images.join(image_name("c1"))).unwrap();
        f.set_len(1 << 30).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &vec![1u8; 1 << 20], 0).unwrap();
        drop(f);
        // A chain of two links.
        std::fs::create_dir_all(snaps.join("vm-1")).unwrap();
        std::fs::create_dir_all(snaps.join("vm-2")).unwrap();
        std::fs::write(snaps.join("vm-1/memory"), vec![2u8; 256 << 10]).unwrap();
        std::fs::write(snaps.join("vm-2/memory"), vec![3u8; 256 << 10]).unwrap();
        let u = Usage::of(&images, &snaps);
        assert!(u.images >= 1 << 20 && u.images < 64 << 20, "{u:?}");
        assert!(u.snapshots >= 512 << 10 && u.snapshots < 64 << 20, "{u:?}");
        assert_eq!(u.total(), u128::from(u.images + u.snapshots));
        assert_eq!(
            Usage::of(&d.path().join("none"), &d.path().join("none")),
            Usage::default()
        );
    }

    #[test]
    fn the_budget_refuses_what_would_go_over_and_says_why() {
        let used = Usage {
            images: 30 * MIB,
            snapshots: 10 * MIB,
        };
        assert!(check(100, used, 60 * MIB, "x").is_ok(), "exactly the limit");
        assert!(check(0, used, u64::MAX, "x").is_ok(), "0: no limit");
        let e = check(100, used, 60 * MIB + 1, "the rootfs image of container c1").unwrap_err();
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
        let msg = e.to_string();
        for want in [
            "sandbox_disk_limit_mib",
            "the rootfs image of container c1",
            "60.1 MiB",
            "40.0 MiB",
            "30.0 MiB in rootfs images",
            "10.0 MiB in hibernation snapshots",
            "100.1 MiB is over its limit of 100 MiB",
            ANNOTATION,
        ] {
            assert!(msg.contains(want), "{want:?} missing: {msg}");
        }
        // One create alone cannot promise more than the limit.
        assert!(check(64, Usage::default(), 65 * MIB, "x").is_err());
        // Nothing overflows (or saturates into a wrong answer).
        let huge = Usage {
            images: u64::MAX,
            snapshots: u64::MAX,
        };
        assert!(check(u64::MAX, huge, u64::MAX, "x").is_ok());
        let e = check(1, huge, u64::MAX, "x").unwrap_err().to_string();
        assert!(e.contains("over its limit of 1 MiB"), "{e}");
        assert!(check(u64::MAX >> 20, Usage::default(), u64::MAX, "x").is_err());
    }

    #[test]
    fn the_annotation_only_lowers_the_limit() {
        let with = |v: &str| serde_json::json!({"annotations": {ANNOTATION: v}});
        assert_eq!(limit_mib(1000, &serde_json::json!({})).unwrap(), 1000);
        assert_eq!(limit_mib(1000, &with("100")).unwrap(), 100);
        assert_eq!(
            limit_mib(1000, &with(" 5000 ")).unwrap(),
            1000,
            "not raised"
        );
        assert_eq!(
            limit_mib(0, &with("100")).unwrap(),
            100,
            "a limit where none was"
        );
        for bad in ["0", "-1", "lots", ""] {
            let e = limit_mib(1000, &with(bad)).unwrap_err();
            assert!(
                matches!(e, SandboxError::InvalidArgument(_)),
                "{bad}: {e:?}"
            );
            assert!(e.to_string().contains(ANNOTATION), "{e}");
        }
    }
}
