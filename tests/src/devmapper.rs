//! A device-mapper thin pool on two sparse loop devices, for containerd's
//! devmapper snapshotter: the snapshotter that gives a container's rootfs
//! as a block device, which burrow passes to the VM as its disk.

use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;
/// The pool's data device; containerd's thin devices are sparse in it.
const DATA_BYTES: u64 = 1024 * MIB;
const META_BYTES: u64 = 64 * MIB;

/// `dmsetup ARGS`. With no udev running (hack/testhost has none),
/// libdevmapper must create and remove the `/dev/mapper` nodes itself.
pub fn dmsetup(args: &[&str]) -> Command {
    let mut cmd = Command::new("dmsetup");
    cmd.args(args);
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd
}

/// Run `cmd`, which must succeed; its stdout.
pub fn host(mut cmd: Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `Command` for `argv`.
pub fn command(argv: &[&str]) -> Command {
    let mut cmd = Command::new(argv[0]);
    cmd.args(&argv[1..]);
    cmd
}

/// A thin pool named `name`, removed (with every thin device containerd
/// left in it) on drop.
pub struct ThinPool {
    pub name: String,
    dir: PathBuf,
    loops: Vec<String>,
}

impl ThinPool {
    pub fn create(name: &str) -> Self {
        for m in ["loop", "dm_thin_pool"] {
            let _ = Command::new("modprobe").arg(m).status();
        }
        // /var/lib/containerd is a tmpfs in hack/testhost: sparse files cost
        // only what is written.
        let dir = PathBuf::from("/var/lib/containerd").join(name);
        std::fs::create_dir_all(&dir).expect("create the pool's directory");
        let mut pool = Self {
            name: name.to_string(),
            dir: dir.clone(),
            loops: Vec::new(),
        };
        for (file, size) in [("meta", META_BYTES), ("data", DATA_BYTES)] {
            let path = dir.join(file);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(size))
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let path = path.display().to_string();
            pool.loops
                .push(host(command(&["losetup", "--find", "--show", &path])));
        }
        // start length thin-pool metadata data block-sectors low-water
        // feature-count features
        let table = format!(
            "0 {} thin-pool {} {} 128 1024 1 skip_block_zeroing",
            DATA_BYTES / 512,
            pool.loops[0],
            pool.loops[1]
        );
        host(dmsetup(&["create", name, "--table", &table]));
        let node = pool.device();
        assert!(
            is_block_device(&node),
            "{} is not a block device after dmsetup create: ls /dev/mapper: {:?}; dmsetup ls: {:?}",
            node.display(),
            std::fs::read_dir("/dev/mapper")
                .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>()),
            dmsetup(&["ls"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        );
        pool
    }

    /// The pool's device node.
    pub fn device(&self) -> PathBuf {
        Path::new("/dev/mapper").join(&self.name)
    }

    /// containerd's config table for a devmapper snapshotter on this pool.
    pub fn containerd_config(&self) -> String {
        format!(
            "[plugins.\"io.containerd.snapshotter.v1.devmapper\"]\n  pool_name = {:?}\n  root_path = {:?}\n  base_image_size = \"128MB\"\n",
            self.name,
            self.dir.join("devmapper").display().to_string()
        )
    }

    /// Names of the pool's thin devices (`NAME-snap-N`) now in the kernel.
    pub fn thin_devices(&self) -> Vec<String> {
        let ls = dmsetup(&["ls"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        ls.lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&format!("{}-", self.name)))
            .map(str::to_string)
            .collect()
    }

    /// The pool's snapshot devices among process `pid`'s open files (a
    /// VMM holds a container's thin device itself, however it got it: as
    /// `--disk` on a cold boot, or into a block slot through the control
    /// API when the VM came from a template).
    pub fn held_by(&self, pid: i32) -> Vec<PathBuf> {
        let prefix = format!("{}-snap-", self.name);
        let snaps: Vec<PathBuf> = std::fs::read_dir("/dev/mapper")
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .filter_map(|e| std::fs::canonicalize(e.path()).ok())
            .collect();
        let mut held: Vec<PathBuf> = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| std::fs::read_link(e.path()).ok())
            .filter(|f| snaps.contains(f) && is_block_device(f))
            .collect();
        held.sort();
        held.dedup();
        held
    }
}

/// Whether `path` is a block device node.
pub fn is_block_device(path: &Path) -> bool {
    std::fs::metadata(path)
        .is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
}

impl Drop for ThinPool {
    fn drop(&mut self) {
        // Thin devices first, the pool last.
        for n in self.thin_devices() {
            let _ = dmsetup(&["remove", &n]).status();
        }
        let _ = dmsetup(&["remove", &self.name]).status();
        for l in &self.loops {
            let _ = Command::new("losetup").args(["-d", l]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
