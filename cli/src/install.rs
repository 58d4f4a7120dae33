//! `burrow install`: put burrow on this host, idempotently, and say what
//! changed. Builds the guest kernel and guest image with the scripts in the
//! source tree (they cache their results), installs the binaries next to
//! containerd's PATH, registers the runtime for CRI in containerd's config
//! and writes burrow's own config if it has none.

use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::containerd_config;

/// Host binaries `burrow install` puts on the PATH.
pub const BINARIES: [&str; 3] = ["containerd-shim-burrow-v2", "burrow-vmm", "burrow"];

/// Guest assets: (script in the source tree, installed name under lib_dir).
pub const ASSETS: [(&str, &str); 2] = [
    ("guest-kernel/build", "kernel/vmlinux"),
    ("rootfs/build", "images/guest-initrd.img"),
];

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} is missing: build the workspace first (cargo build --release --workspace)")]
    MissingBinary(PathBuf),
    #[error("{script} failed ({status}); its output is above")]
    Script { script: PathBuf, status: String },
    #[error("{script} printed no existing path on its last line (got {last:?})")]
    ScriptOutput { script: PathBuf, last: String },
    #[error("{path}: {source}")]
    ContainerdConfig {
        path: PathBuf,
        #[source]
        source: containerd_config::ConfigError,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Where things come from and go to.
#[derive(Debug, Clone)]
pub struct Layout {
    /// burrow's source tree (holds guest-kernel/build and rootfs/build).
    pub source: PathBuf,
    /// Directory holding the built binaries.
    pub built_bins: PathBuf,
    /// Where binaries are installed (on containerd's PATH).
    pub bin_dir: PathBuf,
    /// burrow's data directory (kernel, images, snapshots).
    pub lib_dir: PathBuf,
    pub containerd_config: PathBuf,
    pub burrow_config: PathBuf,
}

impl Layout {
    /// The system layout, with the source tree found from the running binary
    /// (target/<profile>/burrow) or the current directory.
    pub fn system(source: Option<PathBuf>) -> Self {
        let exe = std::env::current_exe().ok();
        let built_bins = exe
            .as_deref()
            .and_then(Path::parent)
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let source = source.unwrap_or_else(|| {
            built_bins
                .ancestors()
                .find(|d| d.join("guest-kernel/build").exists())
                .map(Path::to_path_buf)
                .unwrap_or_else(|| PathBuf::from("."))
        });
        Self {
            source,
            built_bins,
            bin_dir: PathBuf::from("/usr/local/bin"),
            lib_dir: PathBuf::from("/var/lib/burrow"),
            containerd_config: PathBuf::from("/etc/containerd/config.toml"),
            burrow_config: PathBuf::from("/etc/burrow/config.toml"),
        }
    }
}

/// What one install step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Installed(PathBuf),
    Updated(PathBuf),
    Unchanged(PathBuf),
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Change::Installed(p) => write!(f, "installed  {}", p.display()),
            Change::Updated(p) => write!(f, "updated    {}", p.display()),
            Change::Unchanged(p) => write!(f, "unchanged  {}", p.display()),
        }
    }
}

/// Write `bytes` to `dst` atomically unless it already holds them.
fn put(dst: &Path, bytes: &[u8], mode: u32) -> Result<Change, InstallError> {
    let existed = dst.exists();
    if existed && fs::read(dst).map_err(io(dst))? == bytes {
        return Ok(Change::Unchanged(dst.to_path_buf()));
    }
    let dir = dst.parent().unwrap_or(Path::new("/"));
    fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!(
        ".{}.burrow-install",
        dst.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
    f.write_all(bytes).map_err(io(&tmp))?;
    f.set_permissions(fs::Permissions::from_mode(mode))
        .map_err(io(&tmp))?;
    f.sync_all().map_err(io(&tmp))?;
    fs::rename(&tmp, dst).map_err(io(dst))?;
    Ok(if existed {
        Change::Updated(dst.to_path_buf())
    } else {
        Change::Installed(dst.to_path_buf())
    })
}

/// Run an asset build script; its last stdout line is the built file.
fn build_asset(script: &Path) -> Result<PathBuf, InstallError> {
    eprintln!("burrow install: running {}", script.display());
    let out = Command::new(script)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(io(script))?;
    if !out.status.success() {
        return Err(InstallError::Script {
            script: script.to_path_buf(),
            status: out.status.to_string(),
        });
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let last = text.lines().last().unwrap_or("").trim().to_string();
    let path = PathBuf::from(&last);
    if last.is_empty() || !path.is_file() {
        return Err(InstallError::ScriptOutput {
            script: script.to_path_buf(),
            last,
        });
    }
    Ok(path)
}

/// The config `burrow install` writes when the host has none, in the
/// shim's schema (`burrow_shim::config`: top-level keys, every one optional).
pub fn default_config(layout: &Layout) -> String {
    format!(
        "# burrow's host config (read by containerd-shim-burrow-v2); per-pod\n\
         # overrides come from io.burrow.* annotations. Every key is optional:\n\
         # see shim/src/config.rs for the full list and defaults.\n\
         vmm = \"{}\"\n\
         kernel = \"{}\"\n\
         initrd = \"{}\"\n",
        layout.bin_dir.join("burrow-vmm").display(),
        layout.lib_dir.join(ASSETS[0].1).display(),
        layout.lib_dir.join(ASSETS[1].1).display(),
    )
}

/// Install everything; returns each step's change in order.
pub fn install(layout: &Layout) -> Result<Vec<Change>, InstallError> {
    let mut changes = Vec::new();
    for name in BINARIES {
        let src = layout.built_bins.join(name);
        if !src.is_file() {
            return Err(InstallError::MissingBinary(src));
        }
        let bytes = fs::read(&src).map_err(io(&src))?;
        changes.push(put(&layout.bin_dir.join(name), &bytes, 0o755)?);
    }
    for (script, installed) in ASSETS {
        let built = build_asset(&layout.source.join(script))?;
        let bytes = fs::read(&built).map_err(io(&built))?;
        changes.push(put(&layout.lib_dir.join(installed), &bytes, 0o644)?);
    }

    let cfg = &layout.containerd_config;
    let text = match fs::read_to_string(cfg) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io(cfg)(e)),
    };
    let (new, changed) =
        containerd_config::register(&text).map_err(|source| InstallError::ContainerdConfig {
            path: cfg.clone(),
            source,
        })?;
    changes.push(if changed {
        put(cfg, new.as_bytes(), 0o644)?
    } else {
        Change::Unchanged(cfg.clone())
    });

    let own = &layout.burrow_config;
    changes.push(if own.exists() {
        Change::Unchanged(own.clone())
    } else {
        put(own, default_config(layout).as_bytes(), 0o644)?
    });
    Ok(changes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_tree(root: &Path) -> Layout {
        let source = root.join("src");
        for (script, _) in ASSETS {
            let path = source.join(script);
            fs::create_dir_all(path.parent().unwrap()).unwrap();
            let built = root.join(format!("built-{}", script.replace('/', "-")));
            fs::write(&built, script.as_bytes()).unwrap();
            fs::write(
                &path,
                format!("#!/bin/sh\necho progress >&2\necho {}\n", built.display()),
            )
            .unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
        }
        let bins = root.join("bins");
        fs::create_dir_all(&bins).unwrap();
        for b in BINARIES {
            fs::write(bins.join(b), b.as_bytes()).unwrap();
        }
        Layout {
            source,
            built_bins: bins,
            bin_dir: root.join("usr/local/bin"),
            lib_dir: root.join("var/lib/burrow"),
            containerd_config: root.join("etc/containerd/config.toml"),
            burrow_config: root.join("etc/burrow/config.toml"),
        }
    }

    #[test]
    fn installs_then_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let layout = fake_tree(dir.path());
        let first = install(&layout).unwrap();
        assert!(first.iter().all(|c| matches!(c, Change::Installed(_))), "{first:?}");
        assert_eq!(first.len(), BINARIES.len() + ASSETS.len() + 2);
        let shim = layout.bin_dir.join("containerd-shim-burrow-v2");
        assert_eq!(fs::metadata(&shim).unwrap().permissions().mode() & 0o777, 0o755);
        let cfg = fs::read_to_string(&layout.containerd_config).unwrap();
        assert!(cfg.contains("io.containerd.burrow.v2"));
        assert!(fs::read_to_string(&layout.burrow_config).unwrap().contains("vmlinux"));

        let second = install(&layout).unwrap();
        assert!(second.iter().all(|c| matches!(c, Change::Unchanged(_))), "{second:?}");

        fs::write(layout.built_bins.join("burrow-vmm"), b"new build").unwrap();
        let third = install(&layout).unwrap();
        assert!(third.contains(&Change::Updated(layout.bin_dir.join("burrow-vmm"))));
    }

    #[test]
    fn the_written_config_is_one_the_shim_accepts() {
        let dir = tempfile::tempdir().unwrap();
        let layout = fake_tree(dir.path());
        install(&layout).unwrap();
        let text = fs::read_to_string(&layout.burrow_config).unwrap();
        let cfg = burrow_shim::config::Config::parse(&text, "config.toml")
            .unwrap_or_else(|e| panic!("the shim refuses what install wrote: {e}\n{text}"));
        assert_eq!(cfg.kernel, layout.lib_dir.join("kernel/vmlinux"));
        assert_eq!(cfg.initrd, Some(layout.lib_dir.join("images/guest-initrd.img")));
        assert_eq!(cfg.vmm_binary(), layout.bin_dir.join("burrow-vmm"));
    }

    #[test]
    fn missing_binary_and_failing_script_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let layout = fake_tree(dir.path());
        fs::remove_file(layout.built_bins.join("burrow-vmm")).unwrap();
        let err = install(&layout).unwrap_err();
        assert!(err.to_string().contains("cargo build --release"), "{err}");

        let layout = fake_tree(dir.path());
        fs::write(layout.source.join("rootfs/build"), "#!/bin/sh\nexit 3\n").unwrap();
        let err = install(&layout).unwrap_err();
        assert!(err.to_string().contains("rootfs/build failed"), "{err}");

        fs::write(layout.source.join("rootfs/build"), "#!/bin/sh\necho /nonexistent\n").unwrap();
        let err = install(&layout).unwrap_err();
        assert!(err.to_string().contains("/nonexistent"), "{err}");
    }

    #[test]
    fn refuses_a_broken_containerd_config_without_touching_it() {
        let dir = tempfile::tempdir().unwrap();
        let layout = fake_tree(dir.path());
        fs::create_dir_all(layout.containerd_config.parent().unwrap()).unwrap();
        fs::write(&layout.containerd_config, "[plugins").unwrap();
        let err = install(&layout).unwrap_err();
        assert!(err.to_string().contains("not valid TOML"), "{err}");
        assert_eq!(fs::read_to_string(&layout.containerd_config).unwrap(), "[plugins");
    }
}
