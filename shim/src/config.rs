//! `/etc/burrow/config.toml`: where the VM's pieces are and how big VMs may
//! be. Every key is optional; a missing file means the defaults.
//!
//! ```toml
//! vmm = "/usr/local/bin/burrow-vmm"   # default: beside the shim, then $PATH
//! kernel = "/var/lib/burrow/vmlinux"
//! initrd = "/var/lib/burrow/initrd.img"
//! kernel_cmdline = "console=ttyS0 reboot=k panic=1 ..."  # default: burrow_vmm_api::BASE_CMDLINE
//! state_dir = "/run/burrow"
//! boot_timeout_secs = 120     # VM start until the agent answers
//! agent_timeout_secs = 30     # one agent call (not Wait)
//! io_drain_secs = 5           # output drain after a process exits
//! rootfs_slack_mib = 256      # free space in a built rootfs image
//! snapshot_dir = "/var/lib/burrow/snapshots"  # hibernated VMs: <dir>/<ns>/<id>
//! image_dir = "/var/lib/burrow/images"  # containers' rootfs images:
//!                              # <dir>/<ns>/<sandbox id>/<container>.rootfs.img
//! sandbox_disk_limit_mib = 65536  # a sandbox's images + hibernation snapshots
//!                              # on disk; 0 = no limit (annotation
//!                              # io.burrow.sandbox_disk_limit_mib only lowers it)
//! checkpoint_key = "/etc/burrow/checkpoint.key"  # signs checkpoints (made 0600 on first use)
//! hibernate_idle_secs = 0      # hibernate after this long idle; 0 = never
//!                              # (annotation io.burrow.hibernate_idle_secs)
//! vmm_jail = true    # run burrow-vmm jailed (namespaces, no privileges)
//! vmm_uid = 64100    # the first of the jailed VMMs' uids (no accounts needed)
//! vmm_uid_count = 800  # uids vmm_uid.. : one per running sandbox, none shared
//! vmm_gid = 64100    # the jailed VMMs' gid
//! pod_disk_slots = 8          # a CRI pod's containers besides its sandbox (1..=16)
//! pod_layer_slots = 2         # more slots for the images a pod's containers
//!                              # share read-only, each writing to its own
//!                              # sparse disk over it (0: a whole copy each)
//! browser = false              # attach the browser image to every sandbox
//!                              # (else annotation io.burrow.browser=true)
//! browser_image = "/var/lib/burrow/browser.img"  # rootfs/browser-image's erofs
//! templates = true             # start containers by restoring a warm template
//!                              # (annotation io.burrow.template=on|off)
//! template_dir = "/var/cache/burrow/templates"  # one snapshot per VM shape
//! layer_cache_dir = "/var/cache/burrow/layers"  # built rootfs images, one per
//!                              # image layer chain, copied per container
//! layer_cache_images = 8       # most images kept there; 0 = no cache
//!
//! [vcpus]
//! default = 1
//! min = 1
//! max = 8
//!
//! [memory_mib]
//! default = 512
//! min = 128
//! max = 16384
//! overhead = 64   # added to a container's memory limit for the guest kernel
//! ```
//!
//! `BURROW_CONFIG` names another file (tests use it).

use std::path::{Path, PathBuf};

use serde::Deserialize;

pub const DEFAULT_PATH: &str = "/etc/burrow/config.toml";
pub const ENV_PATH: &str = "BURROW_CONFIG";
/// Largest config file read.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Bounds<T> {
    pub default: T,
    pub min: T,
    pub max: T,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryBounds {
    pub default: u64,
    pub min: u64,
    pub max: u64,
    pub overhead: u64,
}

impl Default for Bounds<u32> {
    fn default() -> Self {
        Self {
            default: 1,
            min: 1,
            max: 8,
        }
    }
}

impl Default for MemoryBounds {
    fn default() -> Self {
        Self {
            default: 512,
            min: 128,
            max: 16384,
            overhead: 64,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub vmm: Option<PathBuf>,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub kernel_cmdline: String,
    pub state_dir: PathBuf,
    pub boot_timeout_secs: u64,
    pub agent_timeout_secs: u64,
    pub io_drain_secs: u64,
    pub rootfs_slack_mib: u64,
    pub snapshot_dir: PathBuf,
    /// Where containers' rootfs images are made (not `state_dir`: a tmpfs
    /// would hold what guests write in host RAM); see
    /// [`crate::vm::disk_budget`].
    pub image_dir: PathBuf,
    /// The most a sandbox may keep on the host's disk (images and
    /// hibernation snapshots), MiB; 0 = no limit.
    pub sandbox_disk_limit_mib: u64,
    /// The key that signs this host's checkpoints (see the shim's
    /// `vm::signing`); made on first use.
    pub checkpoint_key: PathBuf,
    pub hibernate_idle_secs: u64,
    /// Empty block slots a CRI pod's VM boots with: one per container of
    /// the pod (the sandbox has the boot disk).
    pub pod_disk_slots: u32,
    /// More block slots a CRI pod's VM boots with, for the layer cache
    /// images its members share read-only under a writable disk each
    /// ([`crate::vm::layered`]); 0: each member gets a whole copy.
    pub pod_layer_slots: u32,
    pub vcpus: Bounds<u32>,
    pub memory_mib: MemoryBounds,
    /// Run burrow-vmm in its jail (see `burrow_vmm_api::jail`); off only
    /// to debug.
    pub vmm_jail: bool,
    /// The first uid of the range each sandbox's VMM gets one of its own
    /// from ([`crate::vm::jail::UidLease`]).
    pub vmm_uid: u32,
    /// How many uids the range has: the most sandboxes a host runs at once.
    pub vmm_uid_count: u32,
    pub vmm_gid: u32,
    pub browser: bool,
    pub browser_image: PathBuf,
    /// Start a container by restoring its VM shape's warm template
    /// ([`crate::vm::template`]) instead of booting.
    pub templates: bool,
    pub template_dir: PathBuf,
    /// Built root filesystem images kept per image layer chain
    /// ([`crate::vm::layer_cache`]), and how many at most (0: none).
    pub layer_cache_dir: PathBuf,
    pub layer_cache_images: u32,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            vmm: None,
            kernel: PathBuf::from("/var/lib/burrow/vmlinux"),
            initrd: Some(PathBuf::from("/var/lib/burrow/initrd.img")),
            kernel_cmdline: burrow_vmm_api::BASE_CMDLINE.into(),
            state_dir: PathBuf::from("/run/burrow"),
            boot_timeout_secs: 120,
            agent_timeout_secs: 30,
            io_drain_secs: 5,
            rootfs_slack_mib: 256,
            snapshot_dir: PathBuf::from("/var/lib/burrow/snapshots"),
            image_dir: PathBuf::from("/var/lib/burrow/images"),
            sandbox_disk_limit_mib: 65536,
            checkpoint_key: PathBuf::from("/etc/burrow/checkpoint.key"),
            hibernate_idle_secs: 0,
            pod_disk_slots: 8,
            pod_layer_slots: 2,
            vcpus: Bounds::default(),
            memory_mib: MemoryBounds::default(),
            vmm_jail: true,
            vmm_uid: burrow_vmm_api::jail::DEFAULT_JAIL_ID,
            // 64100..=64899: below Debian's reserved 65000.. and nobody.
            vmm_uid_count: 800,
            vmm_gid: burrow_vmm_api::jail::DEFAULT_JAIL_ID,
            browser: false,
            browser_image: PathBuf::from("/var/lib/burrow/browser.img"),
            templates: true,
            template_dir: PathBuf::from("/var/cache/burrow/templates"),
            layer_cache_dir: PathBuf::from("/var/cache/burrow/layers"),
            layer_cache_images: 8,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path} is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: String },
    #[error("{path}: {err}")]
    Parse { path: String, err: toml::de::Error },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

impl Config {
    /// Parse a config file's text.
    pub fn parse(text: &str, path: &str) -> Result<Self, ConfigError> {
        let cfg: Config = toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: path.into(),
            err,
        })?;
        let bad = |msg: &str| {
            Err(ConfigError::Invalid {
                path: path.into(),
                msg: msg.into(),
            })
        };
        if cfg.vcpus.min == 0 || cfg.vcpus.min > cfg.vcpus.max || cfg.vcpus.max > 255 {
            return bad("vcpus: want 1 <= min <= max <= 255");
        }
        if cfg.memory_mib.min < 64 || cfg.memory_mib.min > cfg.memory_mib.max {
            return bad("memory_mib: want 64 <= min <= max");
        }
        // The VMM has 19 interrupt lines for virtio devices: the boot disk,
        // vsock and a NIC take three.
        if !(1..=16).contains(&cfg.pod_disk_slots) {
            return bad("pod_disk_slots: want 1..=16");
        }
        if cfg.pod_disk_slots.saturating_add(cfg.pod_layer_slots) > 16 {
            return bad("pod_disk_slots + pod_layer_slots: want at most 16 (the VM's devices)");
        }
        if cfg.layer_cache_images > 4096 {
            return bad("layer_cache_images: want 0..=4096");
        }
        if cfg.kernel_cmdline.len() > 2048 {
            return bad("kernel_cmdline is longer than 2048 bytes");
        }
        Ok(cfg)
    }

    /// Load `path`; a missing file gives the defaults.
    pub fn load_from(path: &Path) -> Result<Self, ConfigError> {
        use std::io::Read;
        let p = path.display().to_string();
        let file = match std::fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(err) => return Err(ConfigError::Read { path: p, err }),
        };
        let mut text = String::new();
        file.take(MAX_CONFIG_BYTES + 1)
            .read_to_string(&mut text)
            .map_err(|err| ConfigError::Read {
                path: p.clone(),
                err,
            })?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge { path: p });
        }
        Self::parse(&text, &p)
    }

    /// Load from `$BURROW_CONFIG` or [`DEFAULT_PATH`].
    pub fn load() -> Result<Self, ConfigError> {
        let path =
            std::env::var_os(ENV_PATH).map_or_else(|| PathBuf::from(DEFAULT_PATH), PathBuf::from);
        Self::load_from(&path)
    }

    /// The burrow-vmm binary: configured, else beside this executable, else
    /// found on `$PATH` by name.
    pub fn vmm_binary(&self) -> PathBuf {
        if let Some(p) = &self.vmm {
            return p.clone();
        }
        if let Some(dir) = std::env::current_exe()
            .ok()
            .as_deref()
            .and_then(Path::parent)
        {
            let p = dir.join("burrow-vmm");
            if p.is_file() {
                return p;
            }
        }
        PathBuf::from("burrow-vmm")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_missing() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert_eq!(
            Config::load_from(&dir.path().join("none.toml")).ok(),
            Some(Config::default())
        );
    }

    #[test]
    fn parses_partial_files() {
        let c = Config::parse("kernel = \"/k\"\n[vcpus]\nmax = 4\n", "t").expect("parse");
        assert_eq!(c.kernel, PathBuf::from("/k"));
        assert_eq!(
            c.vcpus,
            Bounds {
                default: 1,
                min: 1,
                max: 4
            }
        );
        assert_eq!(c.memory_mib, MemoryBounds::default());
        assert_eq!(c.image_dir, PathBuf::from("/var/lib/burrow/images"));
        assert_eq!(c.sandbox_disk_limit_mib, 65536);
        let c = Config::parse(
            "image_dir = \"/srv/img\"\nsandbox_disk_limit_mib = 0\n",
            "t",
        )
        .expect("parse");
        assert_eq!(
            (c.image_dir, c.sandbox_disk_limit_mib),
            (PathBuf::from("/srv/img"), 0)
        );
    }

    #[test]
    fn rejects_bad_files() {
        // An unknown key.
        assert!(matches!(
            Config::parse("kernal = 1", "t"),
            Err(ConfigError::Parse { .. })
        ));
        // Bounds out of range.
        for text in [
            "[vcpus]\nmin = 0",
            "[vcpus]\nmin = 9",
            "[memory_mib]\nmin = 1",
        ] {
            assert!(
                matches!(Config::parse(text, "t"), Err(ConfigError::Invalid { .. })),
                "{text:?}"
            );
        }
    }
}
