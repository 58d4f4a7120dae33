//! Built root filesystem images kept per image layer chain, so the next
//! container of the same image gets a copy instead of a build.
//!
//! An overlayfs snapshot (containerd's default snapshotter) is turned into
//! an ext4 image by walking it and running `mkfs.ext4 -d` over it
//! ([`super::rootfs`]): a copy of every file of the image, paid at each
//! create. A new container's snapshot is its image's layers (`lowerdir`,
//! committed snapshots containerd never changes) under an empty upper
//! directory, so every container of one image would get the same image
//! file. The first one builds it here, `<layer_cache_dir>/<key>.img`, and
//! every container (the first included) gets its own copy: a reflink where
//! the file system can (XFS, btrfs: no data copied), else a sparse copy of
//! its data. The copy is the container's writable disk, exactly as a built
//! image was, so nothing about hibernation, checkpoints or fork changes.
//!
//! - **Key**: a hash of each lower directory's path, device, inode and
//!   change and modification times (to the nanosecond), and the image's
//!   slack. A layer extracted again (containerd's root wiped, a snapshot id
//!   reused) is a new directory with new times: a new key, never a stale
//!   image. Anything but one overlay mount with an empty upper directory
//!   (a container whose snapshot already holds writes, a bind mount, a
//!   read-only view) is built as before and not cached.
//! - **Bounds**: at most `layer_cache_images` images (config; 0 turns the
//!   cache off), the least recently used removed first; half-built images
//!   older than an hour are removed. The cache is not part of any
//!   sandbox's disk budget (it is shared), but each container's copy is,
//!   at its full apparent size, as a built image was.
//! - The directory is made 0700, images 0600 with `O_EXCL`, published by
//!   rename: a reader sees a whole image or none.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use super::disk_budget;
use crate::sandbox::{Result, RootfsMount, SandboxError};

/// A built image's file name ends with this.
const SUFFIX: &str = ".img";
/// A half-built one has this in its name.
const BUILDING: &str = ".building-";
/// A half-built image older than this was left by a shim that died.
const STALE_BUILD: Duration = Duration::from_secs(3600);
/// Most lower directories in one key (containerd's overlay mounts have
/// one per layer; images have at most a few hundred).
const MAX_LAYERS: usize = 512;

/// The cache of one shim's configuration.
#[derive(Debug, Clone)]
pub struct LayerCache {
    dir: PathBuf,
    max: usize,
}

impl LayerCache {
    pub fn new(dir: &Path, max_images: u32) -> Self {
        Self {
            dir: dir.to_path_buf(),
            max: usize::try_from(max_images).unwrap_or(usize::MAX),
        }
    }

    /// The key of `mounts`' image (see the module doc), or none when they
    /// are not a cacheable snapshot or the cache is off.
    pub fn key(&self, mounts: &[RootfsMount], slack_mib: u64) -> Option<String> {
        if self.max == 0 {
            return None;
        }
        let [m] = mounts else { return None };
        if m.kind != "overlay" {
            return None;
        }
        let option = |name: &str| {
            m.options
                .iter()
                .find_map(|o| o.strip_prefix(name)?.strip_prefix('='))
        };
        let upper = option("upperdir")?;
        if std::fs::read_dir(upper).ok()?.next().is_some() {
            return None;
        }
        let lowers: Vec<&str> = option("lowerdir")?.split(':').collect();
        if lowers.len() > MAX_LAYERS {
            return None;
        }
        let mut h = Sha256::new();
        h.update(format!("burrow layer image 1, slack {slack_mib} MiB\n"));
        for lower in lowers {
            let md = std::fs::symlink_metadata(lower).ok().filter(|m| m.is_dir())?;
            h.update(format!(
                "{lower}\0{} {} {}.{} {}.{}\n",
                md.dev(),
                md.ino(),
                md.ctime(),
                md.ctime_nsec(),
                md.mtime(),
                md.mtime_nsec()
            ));
        }
        Some(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
    }

    /// The published image of `key`, marked as just used; none if there
    /// is none.
    pub fn lookup(&self, key: &str) -> Option<PathBuf> {
        let path = self.dir.join(format!("{key}{SUFFIX}"));
        let f = std::fs::File::options().write(true).open(&path).ok()?;
        if let Err(e) = f.set_modified(SystemTime::now()) {
            tracing::debug!("marking {} used: {e}", path.display());
        }
        Some(path)
    }

    /// A fresh path to build `key`'s image at (the directory made).
    pub fn building(&self, key: &str) -> Result<PathBuf> {
        disk_budget::make_private_dir(&self.dir)?;
        let nonce = super::template::random_hex()?;
        Ok(self.dir.join(format!("{key}{SUFFIX}{BUILDING}{nonce}")))
    }

    /// Publish the image built at `built` as `key`'s, then keep the cache
    /// within its bounds. Returns the published path.
    pub fn publish(&self, built: &Path, key: &str) -> Result<PathBuf> {
        let path = self.dir.join(format!("{key}{SUFFIX}"));
        std::fs::rename(built, &path).map_err(|e| {
            let _ = std::fs::remove_file(built);
            SandboxError::io(format_args!("publishing {}", path.display()), &e)
        })?;
        self.trim(&path);
        Ok(path)
    }

    /// Remove the least recently used images beyond the bound (never
    /// `keep`), and half-built ones left long ago.
    fn trim(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let now = SystemTime::now();
        let mut images = Vec::new();
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(md) = e.metadata() else { continue };
            let used = md.modified().unwrap_or(now);
            if name.contains(BUILDING) {
                if now.duration_since(used).unwrap_or_default() > STALE_BUILD {
                    let _ = std::fs::remove_file(e.path());
                }
            } else if name.ends_with(SUFFIX) && e.path() != keep {
                images.push((used, e.path()));
            }
        }
        // Newest first; `keep` counts as the newest.
        images.sort_by_key(|i| std::cmp::Reverse(i.0));
        for (_, old) in images.into_iter().skip(self.max.saturating_sub(1)) {
            tracing::info!("layer cache: removing {} (least recently used)", old.display());
            let _ = std::fs::remove_file(old);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn overlay(lower: &str, upper: &Path) -> Vec<RootfsMount> {
        vec![RootfsMount {
            kind: "overlay".into(),
            source: "overlay".into(),
            options: vec![
                "index=off".into(),
                format!("workdir={}/../work", upper.display()),
                format!("upperdir={}", upper.display()),
                format!("lowerdir={lower}"),
            ],
        }]
    }

    #[test]
    fn a_fresh_overlay_snapshot_has_a_key_that_follows_its_layers() {
        let d = tempfile::tempdir().unwrap();
        let cache = LayerCache::new(&d.path().join("cache"), 4);
        let (l1, l2, upper) = (d.path().join("l1"), d.path().join("l2"), d.path().join("up"));
        for p in [&l1, &l2, &upper] {
            std::fs::create_dir(p).unwrap();
        }
        let chain = format!("{}:{}", l2.display(), l1.display());
        let k = cache.key(&overlay(&chain, &upper), 256).expect("a key");
        assert_eq!(k.len(), 64);
        assert_eq!(cache.key(&overlay(&chain, &upper), 256), Some(k.clone()));
        // Other slack, other layer order, one layer less: other images.
        assert_ne!(cache.key(&overlay(&chain, &upper), 128), Some(k.clone()));
        let reversed = format!("{}:{}", l1.display(), l2.display());
        assert_ne!(cache.key(&overlay(&reversed, &upper), 256), Some(k.clone()));
        let one = l1.display().to_string();
        assert_ne!(cache.key(&overlay(&one, &upper), 256), Some(k.clone()));
        // A layer extracted again at the same path: a new key.
        std::fs::remove_dir(&l1).unwrap();
        std::fs::create_dir(&l1).unwrap();
        std::fs::write(l1.join("f"), b"new").unwrap();
        assert_ne!(cache.key(&overlay(&chain, &upper), 256), Some(k));
    }

    #[test]
    fn only_fresh_overlay_snapshots_are_cached() {
        let d = tempfile::tempdir().unwrap();
        let (lower, upper) = (d.path().join("l"), d.path().join("up"));
        std::fs::create_dir(&lower).unwrap();
        std::fs::create_dir(&upper).unwrap();
        let l = lower.display().to_string();
        let on = LayerCache::new(&d.path().join("cache"), 4);
        assert!(on.key(&overlay(&l, &upper), 0).is_some());
        // Off by config.
        assert!(LayerCache::new(&d.path().join("cache"), 0)
            .key(&overlay(&l, &upper), 0)
            .is_none());
        // Writes in the snapshot already: built as it is.
        std::fs::write(upper.join("x"), b"x").unwrap();
        assert!(on.key(&overlay(&l, &upper), 0).is_none());
        std::fs::remove_file(upper.join("x")).unwrap();
        // A missing layer, a bind mount, two mounts, no upper: none.
        let missing = d.path().join("gone").display().to_string();
        assert!(on.key(&overlay(&missing, &upper), 0).is_none());
        let bind = RootfsMount {
            kind: "bind".into(),
            source: l.clone(),
            options: vec!["rbind".into(), "rw".into()],
        };
        assert!(on.key(&[bind], 0).is_none());
        let mut two = overlay(&l, &upper);
        two.extend(overlay(&l, &upper));
        assert!(on.key(&two, 0).is_none());
        let mut ro = overlay(&l, &upper);
        ro[0].options.retain(|o| !o.starts_with("upperdir="));
        assert!(on.key(&ro, 0).is_none());
    }

    #[test]
    fn publishing_keeps_the_most_recently_used_images() {
        let d = tempfile::tempdir().unwrap();
        let cache = LayerCache::new(&d.path().join("cache"), 2);
        let put = |key: &str| {
            let b = cache.building(key).unwrap();
            std::fs::write(&b, key).unwrap();
            cache.publish(&b, key).unwrap()
        };
        let a = put("a");
        std::thread::sleep(Duration::from_millis(20));
        let b = put("b");
        std::thread::sleep(Duration::from_millis(20));
        // `a` used again: `b` is now the least recently used.
        assert_eq!(cache.lookup("a"), Some(a.clone()));
        std::thread::sleep(Duration::from_millis(20));
        let c = put("c");
        assert!(a.exists() && c.exists(), "the two most recently used stay");
        assert!(!b.exists(), "the least recently used goes");
        assert_eq!(cache.lookup("b"), None);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(d.path().join("cache")).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "the cache directory is private");
    }
}
