//! Turning the snapshotter's rootfs mounts into a block device for the
//! guest.
//!
//! - A single mount of a block device with a file system the guest kernel
//!   reads (devmapper, a raw-block snapshotter) is passed through as it is:
//!   the container's writes go straight into the snapshot.
//! - Anything else (overlayfs snapshots, a pre-populated `bundle/rootfs`) is
//!   mounted on `bundle/rootfs`, copied into a fresh sparse ext4 image with
//!   `mkfs.ext4 -d`, and unmounted again. A fresh overlayfs snapshot's
//!   image is built once per image layer chain and each container gets a
//!   copy of it ([`super::layer_cache`]). The image is writable and lives in
//!   the sandbox's image directory ([`super::disk_budget`]: on disk, not
//!   the tmpfs state directory), so the container keeps its writes for as
//!   long as the task exists (and in VM snapshots); they are not copied
//!   back into the snapshotter's upper directory.

use std::ffi::OsStr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use super::layer_cache::LayerCache;
use crate::sandbox::{ContainerConfig, Result, RootfsMount, SandboxError};

/// File systems passed through as block devices.
const BLOCK_FS: &[&str] = &["ext4", "ext3", "ext2", "xfs", "btrfs", "erofs"];
/// Most files copied into an image.
const MAX_FILES: u64 = 5_000_000;
/// Largest image (MiB): 1 TiB.
const MAX_IMAGE_MIB: u64 = 1 << 20;
/// Smallest image (MiB).
const MIN_IMAGE_MIB: u64 = 64;

/// A rootfs ready to be handed to the VMM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestRootfs {
    /// Disk path for the VMM (image file or block device).
    pub disk: PathBuf,
    pub read_only: bool,
    /// File system type for the agent's mount.
    pub fstype: String,
    /// An image this shim made (removed with the container).
    pub image: Option<PathBuf>,
    /// The read-only image layer under `disk` ([`super::layered`]): `disk`
    /// is then only the container's writable upper layer.
    pub lower: Option<Lower>,
}

/// A read-only lower layer in a block slot, shared by the pod's
/// containers of one image ([`super::layered`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lower {
    /// The image's file in the sandbox's image directory.
    pub disk: PathBuf,
    pub slot: u32,
}

fn is_block_device(path: &str) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device())
}

/// Whether the mounts are one block device we can pass through.
pub fn passthrough(mounts: &[RootfsMount]) -> Option<GuestRootfs> {
    let [m] = mounts else { return None };
    if !BLOCK_FS.contains(&m.kind.as_str()) || !is_block_device(&m.source) {
        return None;
    }
    Some(GuestRootfs {
        disk: PathBuf::from(&m.source),
        read_only: m.options.iter().any(|o| o == "ro"),
        fstype: m.kind.clone(),
        image: None,
        lower: None,
    })
}

/// Bytes used and entries under `dir` (symlinks not followed, one file
/// system).
pub fn usage(dir: &Path) -> Result<(u64, u64)> {
    let root_dev = std::fs::symlink_metadata(dir)
        .map_err(|e| SandboxError::Internal(format!("rootfs {}: {e}", dir.display())))?
        .dev();
    let mut bytes = 0u64;
    let mut files = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d)
            .map_err(|e| SandboxError::Internal(format!("reading {}: {e}", d.display())))?;
        for entry in entries {
            let entry = entry
                .map_err(|e| SandboxError::Internal(format!("reading {}: {e}", d.display())))?;
            let md = entry.metadata().map_err(|e| {
                SandboxError::Internal(format!("stat {}: {e}", entry.path().display()))
            })?;
            files += 1;
            if files > MAX_FILES {
                return Err(SandboxError::InvalidArgument(format!(
                    "the rootfs has more than {MAX_FILES} files"
                )));
            }
            bytes = bytes.saturating_add(md.len().max(md.blocks().saturating_mul(512)));
            if md.is_dir() && md.dev() == root_dev {
                stack.push(entry.path());
            }
        }
    }
    Ok((bytes, files))
}

/// Size (bytes) and inode count of an image holding `bytes` in `files`.
pub fn image_geometry(bytes: u64, files: u64, slack_mib: u64) -> (u64, u64) {
    let inodes = files.saturating_mul(2).saturating_add(16_384);
    let raw = bytes
        .saturating_add(bytes / 5)
        .saturating_add(inodes.saturating_mul(256))
        .saturating_add(slack_mib.saturating_mul(1 << 20));
    let mib = raw.div_ceil(1 << 20).clamp(MIN_IMAGE_MIB, MAX_IMAGE_MIB);
    (mib << 20, inodes)
}

fn mkfs_binary() -> PathBuf {
    for p in ["/usr/sbin/mkfs.ext4", "/sbin/mkfs.ext4"] {
        if Path::new(p).is_file() {
            return PathBuf::from(p);
        }
    }
    PathBuf::from("mkfs.ext4")
}

/// Build an ext4 image at `image` (a new file, see
/// [`super::disk_budget::create_image`]) with the contents of `dir`, once
/// `budget` allowed its size in bytes (the image's apparent size).
pub async fn build_image(
    dir: &Path,
    image: &Path,
    slack_mib: u64,
    budget: impl FnOnce(u64) -> Result<()>,
) -> Result<()> {
    let d = dir.to_path_buf();
    let (bytes, files) = tokio::task::spawn_blocking(move || usage(&d))
        .await
        .map_err(|e| SandboxError::Internal(format!("rootfs walk failed: {e}")))??;
    let (size, inodes) = image_geometry(bytes, files, slack_mib);
    budget(size)?;
    let f = super::disk_budget::create_image(image)?;
    let made = f
        .set_len(size)
        .map_err(|e| SandboxError::io(format_args!("sizing {}", image.display()), &e));
    drop(f);
    let made = match made {
        Ok(()) => mkfs(dir, image, inodes).await,
        Err(e) => Err(e),
    };
    if made.is_err() {
        let _ = std::fs::remove_file(image);
    }
    made
}

/// Run `mkfs.ext4 -d dir` on the sized file `image`.
async fn mkfs(dir: &Path, image: &Path, inodes: u64) -> Result<()> {
    let inodes = inodes.to_string();
    let mut args: Vec<&OsStr> = ["-q", "-F", "-m", "0", "-L", "burrow-rootfs", "-N", &inodes, "-d"]
        .into_iter()
        .map(OsStr::new)
        .collect();
    args.push(dir.as_os_str());
    run_mkfs(&args, image).await
}

/// Run `mkfs.ext4 args image`.
async fn run_mkfs(args: &[&OsStr], image: &Path) -> Result<()> {
    let out = tokio::process::Command::new(mkfs_binary())
        .args(args)
        .arg(image)
        .output()
        .await
        .map_err(|e| {
            SandboxError::FailedPrecondition(format!("running mkfs.ext4 (package e2fsprogs): {e}"))
        })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(
            out.stderr
                .get(..out.stderr.len().min(2048))
                .unwrap_or_default(),
        )
        .into_owned();
        return Err(SandboxError::Internal(format!(
            "mkfs.ext4 {} failed ({}): {}",
            image.display(),
            out.status,
            err.trim()
        )));
    }
    Ok(())
}

/// Detach-unmount `target`; "not mounted" is fine.
pub fn unmount(target: &Path) {
    let Ok(c) = std::ffi::CString::new(target.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: c is a valid path; umount2 has no memory effects.
    let rc = unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINVAL) && e.raw_os_error() != Some(libc::ENOENT) {
            tracing::warn!("unmounting {}: {e}", target.display());
        }
    }
}

fn mount_all(mounts: &[RootfsMount], target: &Path) -> Result<()> {
    for m in mounts {
        containerd_shim::mount::mount_rootfs(
            Some(m.kind.as_str()),
            Some(m.source.as_str()),
            &m.options,
            target,
        )
        .map_err(|e| {
            SandboxError::Internal(format!(
                "mounting {} ({}) on {}: {e}",
                m.source,
                m.kind,
                target.display()
            ))
        })?;
    }
    Ok(())
}

/// Prepare the rootfs of `cfg` for the guest; an image goes to `image`
/// once `budget` allowed its size (see [`build_image`]): a copy of the
/// cached image of its layers when `cache` has one (or builds one now),
/// else built from its files.
pub async fn prepare(
    cfg: &ContainerConfig,
    image: &Path,
    slack_mib: u64,
    cache: &LayerCache,
    budget: impl Fn(u64) -> Result<()>,
) -> Result<GuestRootfs> {
    if let Some(p) = passthrough(&cfg.rootfs) {
        return Ok(p);
    }
    let made = GuestRootfs {
        disk: image.to_path_buf(),
        read_only: false,
        fstype: "ext4".into(),
        image: Some(image.to_path_buf()),
        lower: None,
    };
    let key = cache.key(&cfg.rootfs, slack_mib);
    if let Some(cached) = key.as_deref().and_then(|k| cache.lookup(k)) {
        let started = std::time::Instant::now();
        match copy_image(&cached, image, &budget).await {
            Ok(()) => {
                tracing::info!(
                    "{}: root filesystem copied from the layer cache in {} ms",
                    cfg.id,
                    started.elapsed().as_millis()
                );
                return Ok(made);
            }
            Err(e @ SandboxError::ResourceExhausted(_)) => return Err(e),
            // (removed from the cache meanwhile, say): built below.
            Err(e) => tracing::warn!("{}: copying the cached image: {e}", cfg.id),
        }
    }
    let target = mount_on_bundle(cfg).await?;
    let mounted = !cfg.rootfs.is_empty();
    let built = match &key {
        Some(k) => build_into_cache(&target, image, cache, k, slack_mib, &budget).await,
        None => build_image(&target, image, slack_mib, &budget).await,
    };
    if mounted {
        unmount(&target);
    }
    built?;
    Ok(made)
}

/// Build the image of `dir` into `cache` as `key`'s and copy it to `image`
/// before publishing it (so another create's trim cannot remove it first).
async fn build_into_cache(
    dir: &Path,
    image: &Path,
    cache: &LayerCache,
    key: &str,
    slack_mib: u64,
    budget: impl Fn(u64) -> Result<()>,
) -> Result<()> {
    let building = match cache.building(key) {
        Ok(b) => b,
        Err(e) => {
            // A cache that cannot be written costs its speed, not the create.
            tracing::warn!("layer cache unusable, building without it: {e}");
            return build_image(dir, image, slack_mib, budget).await;
        }
    };
    build_image(dir, &building, slack_mib, budget).await?;
    // Its size was allowed by the budget already.
    if let Err(e) = copy_image(&building, image, |_| Ok(())).await {
        let _ = std::fs::remove_file(&building);
        return Err(e);
    }
    keep_in_cache(cache, &building, key);
    Ok(())
}

/// Publish the image built at `building` as `key`'s: the container has its
/// disk already, so a cache that cannot keep it is no error.
fn keep_in_cache(cache: &LayerCache, building: &Path, key: &str) {
    match cache.publish(building, key) {
        Ok(_) => tracing::info!("root filesystem built into the layer cache as {key}"),
        Err(e) => tracing::warn!("keeping the built root filesystem in the layer cache: {e}"),
    }
}

/// Mount `cfg`'s rootfs mounts (if any) on `bundle/rootfs`, made if need
/// be; returns that directory. On error nothing stays mounted.
async fn mount_on_bundle(cfg: &ContainerConfig) -> Result<PathBuf> {
    let target = cfg.bundle.join("rootfs");
    std::fs::create_dir_all(&target)
        .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", target.display())))?;
    if cfg.rootfs.is_empty() {
        return Ok(target);
    }
    let (m, t) = (cfg.rootfs.clone(), target.clone());
    let r = tokio::task::spawn_blocking(move || mount_all(&m, &t))
        .await
        .map_err(|e| SandboxError::Internal(format!("mount task failed: {e}")))?;
    if let Err(e) = r {
        unmount(&target);
        return Err(e);
    }
    Ok(target)
}

/// Make `to` (a new file) the layer cache's image of `cfg`'s layers,
/// `key` (built now if the cache has none, once `budget` allowed its
/// size): a hard link to it where the cache is on the same file system
/// (no data copied; the image outlives the cache's trim for as long as `to`
/// does), else a copy.
pub async fn cached_layers(
    cfg: &ContainerConfig,
    (cache, key): (&LayerCache, &str),
    slack_mib: u64,
    to: &Path,
    budget: impl Fn(u64) -> Result<()>,
) -> Result<()> {
    if let Some(cached) = cache.lookup(key) {
        let size = std::fs::metadata(&cached)
            .map_err(|e| SandboxError::io(format_args!("reading {}", cached.display()), &e))?
            .len();
        budget(size)?;
        return link_or_copy(&cached, to).await;
    }
    let target = mount_on_bundle(cfg).await?;
    let built = async {
        let building = cache.building(key)?;
        build_image(&target, &building, slack_mib, &budget).await?;
        // Linked before it is published: no trim removes it first.
        if let Err(e) = link_or_copy(&building, to).await {
            let _ = std::fs::remove_file(&building);
            return Err(e);
        }
        keep_in_cache(cache, &building, key);
        Ok(())
    }
    .await;
    unmount(&target);
    built
}

/// Hard-link `from` at the new path `to`, else copy it there.
async fn link_or_copy(from: &Path, to: &Path) -> Result<()> {
    match std::fs::hard_link(from, to) {
        Ok(()) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::EXDEV) || e.raw_os_error() == Some(libc::EPERM) => {
            drop(super::disk_budget::create_image(to)?);
            super::snapshot::copy_disk(from, to).await
        }
        Err(e) => Err(SandboxError::io(
            format_args!("linking {} at {}", from.display(), to.display()),
            &e,
        )),
    }
}

/// Make `image` (a new file) an empty sparse ext4 file system of `size`
/// bytes: a container's writable upper layer. Its inode tables and journal
/// are left for lazy initialisation (the guest mounts it `noinit_itable`):
/// nothing of its size is written here.
pub async fn make_upper(image: &Path, size: u64) -> Result<()> {
    let f = super::disk_budget::create_image(image)?;
    let sized = f
        .set_len(size)
        .map_err(|e| SandboxError::io(format_args!("sizing {}", image.display()), &e));
    drop(f);
    let made = match sized {
        Ok(()) => {
            let args = [
                "-q",
                "-F",
                "-m",
                "0",
                "-L",
                "burrow-upper",
                "-E",
                "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            ]
            .map(OsStr::new);
            run_mkfs(&args, image).await
        }
        Err(e) => Err(e),
    };
    if made.is_err() {
        let _ = std::fs::remove_file(image);
    }
    made
}

/// Copy image `from` to the new file `to` (a reflink where the file system
/// can, else its data only), once `budget` allowed its apparent size.
async fn copy_image(from: &Path, to: &Path, budget: impl Fn(u64) -> Result<()>) -> Result<()> {
    let size = std::fs::metadata(from)
        .map_err(|e| SandboxError::io(format_args!("reading {}", from.display()), &e))?
        .len();
    budget(size)?;
    drop(super::disk_budget::create_image(to)?);
    super::snapshot::copy_disk(from, to).await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn geometry_is_bounded_and_has_room() {
        let (size, inodes) = image_geometry(0, 0, 0);
        assert_eq!(size, MIN_IMAGE_MIB << 20);
        assert_eq!(inodes, 16_384);
        let (size, _) = image_geometry(1 << 30, 10_000, 256);
        assert!(size > (1 << 30) + (256 << 20));
        let (size, _) = image_geometry(u64::MAX, u64::MAX, u64::MAX);
        assert_eq!(size, MAX_IMAGE_MIB << 20);
    }

    #[test]
    fn no_passthrough_for_overlay_or_files() {
        let m = RootfsMount {
            kind: "overlay".into(),
            source: "overlay".into(),
            options: vec![],
        };
        assert_eq!(passthrough(&[m]), None);
        let m = RootfsMount {
            kind: "ext4".into(),
            source: "/etc/hostname".into(),
            options: vec![],
        };
        assert_eq!(passthrough(&[m]), None);
        assert_eq!(passthrough(&[]), None);
    }

    #[test]
    fn usage_counts_files() {
        let d = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir(d.path().join("a")).expect("mkdir");
        std::fs::write(d.path().join("a/f"), vec![0u8; 10_000]).expect("write");
        let (bytes, files) = usage(d.path()).expect("usage");
        assert_eq!(files, 2);
        assert!(bytes >= 10_000);
    }

    /// Needs mkfs.ext4 (e2fsprogs), which hack/setup installs.
    #[tokio::test]
    async fn builds_an_ext4_image_from_a_directory() {
        let d = tempfile::tempdir().expect("tempdir");
        let root = d.path().join("rootfs");
        std::fs::create_dir_all(root.join("bin")).expect("mkdir");
        std::fs::write(root.join("bin/hello"), b"hi").expect("write");
        let img = d.path().join("rootfs.img");
        // Refused by its budget: nothing is made.
        let e = build_image(&root, &img, 0, |size| {
            assert_eq!(size, MIN_IMAGE_MIB << 20, "the full apparent size");
            Err(SandboxError::ResourceExhausted("over".into()))
        })
        .await
        .expect_err("refused");
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
        assert!(!img.exists());
        build_image(&root, &img, 0, |_| Ok(())).await.expect("mkfs");
        let md = std::fs::metadata(&img).expect("image");
        assert_eq!(md.len(), MIN_IMAGE_MIB << 20);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(md.permissions().mode() & 0o777, 0o600);
        // Never over an existing file.
        let e = build_image(&root, &img, 0, |_| Ok(()))
            .await
            .expect_err("exists");
        assert!(e.to_string().contains("exists"), "{e}");
        assert!(img.exists(), "the first image stays");
        // ext4 superblock magic 0xEF53 at byte 1024 + 56.
        let data = std::fs::read(&img).expect("read");
        assert_eq!(data.get(1080..1082), Some(&[0x53, 0xEF][..]));
    }

    /// Needs mkfs.ext4 (e2fsprogs), which hack/setup installs.
    #[tokio::test]
    async fn a_writable_layer_is_a_sparse_empty_ext4() {
        let d = tempfile::tempdir().expect("tempdir");
        let img = d.path().join("up.img");
        make_upper(&img, 512 << 20).await.expect("made");
        let md = std::fs::metadata(&img).expect("image");
        assert_eq!(md.len(), 512 << 20);
        assert!(
            md.blocks() * 512 < 32 << 20,
            "nothing of its size is written: {} bytes allocated",
            md.blocks() * 512
        );
        let head = std::fs::read(&img).expect("read");
        assert_eq!(head.get(1080..1082), Some(&[0x53, 0xEF][..]), "ext4");
        // Volume label at superblock offset 0x78.
        assert_eq!(head.get(1024 + 0x78..1024 + 0x78 + 12), Some(&b"burrow-upper"[..]));
        let e = make_upper(&img, 1 << 20).await.expect_err("exists");
        assert!(e.to_string().contains("exists"), "{e}");
    }

    #[tokio::test]
    async fn a_cached_image_is_linked_not_copied() {
        let d = tempfile::tempdir().expect("tempdir");
        let cache = LayerCache::new(&d.path().join("cache"), 4);
        let b = cache.building("k").expect("building");
        std::fs::write(&b, vec![7u8; 4096]).expect("write");
        let cached = cache.publish(&b, "k").expect("published");
        let cfg = ContainerConfig {
            id: "c".into(),
            bundle: d.path().join("bundle"),
            spec: serde_json::json!({}),
            rootfs: vec![],
            stdin: false,
        };
        let to = d.path().join("layer.img");
        let refuse = |_| Err(SandboxError::ResourceExhausted("over".into()));
        let e = cached_layers(&cfg, (&cache, "k"), 0, &to, refuse)
            .await
            .expect_err("over budget");
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
        assert!(!to.exists());
        cached_layers(&cfg, (&cache, "k"), 0, &to, |size| {
            assert_eq!(size, 4096);
            Ok(())
        })
        .await
        .expect("linked");
        let (a, b) = (std::fs::metadata(&cached).unwrap(), std::fs::metadata(&to).unwrap());
        assert_eq!((a.dev(), a.ino()), (b.dev(), b.ino()), "the same file");
        // The cache's trim removes its name only: the link keeps the data.
        std::fs::remove_file(&cached).unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), vec![7u8; 4096]);
    }

}
