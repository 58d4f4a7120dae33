//! A container's root filesystem and the mounts of its spec, prepared in
//! the agent's mount namespace under the state directory: the root (block
//! device or bind, optional tmpfs overlay), spec and default mounts, /dev
//! nodes, read-only and masked paths.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::Mode;
use oci_spec::runtime::{Mount, Spec};

use crate::error::{invalid, AgentError, Result};
use crate::fs::{self, CleanPath};

const MAX_MOUNTS: usize = 512;

/// Mount flags and data string from mount(8)-style options.
fn parse_options(options: &[String]) -> (MsFlags, bool, String) {
    let mut flags = MsFlags::empty();
    let mut recursive_bind = false;
    let mut data = Vec::new();
    for o in options {
        match o.as_str() {
            "ro" => flags |= MsFlags::MS_RDONLY,
            "rw" => flags &= !MsFlags::MS_RDONLY,
            "nosuid" => flags |= MsFlags::MS_NOSUID,
            "suid" => flags &= !MsFlags::MS_NOSUID,
            "nodev" => flags |= MsFlags::MS_NODEV,
            "dev" => flags &= !MsFlags::MS_NODEV,
            "noexec" => flags |= MsFlags::MS_NOEXEC,
            "exec" => flags &= !MsFlags::MS_NOEXEC,
            "sync" => flags |= MsFlags::MS_SYNCHRONOUS,
            "async" => flags &= !MsFlags::MS_SYNCHRONOUS,
            "dirsync" => flags |= MsFlags::MS_DIRSYNC,
            "noatime" => flags |= MsFlags::MS_NOATIME,
            "atime" => flags &= !MsFlags::MS_NOATIME,
            "nodiratime" => flags |= MsFlags::MS_NODIRATIME,
            "diratime" => flags &= !MsFlags::MS_NODIRATIME,
            "relatime" => flags |= MsFlags::MS_RELATIME,
            "norelatime" => flags &= !MsFlags::MS_RELATIME,
            "strictatime" => flags |= MsFlags::MS_STRICTATIME,
            "bind" => flags |= MsFlags::MS_BIND,
            "rbind" => {
                flags |= MsFlags::MS_BIND;
                recursive_bind = true;
            }
            // Propagation: every container gets private mounts anyway.
            "private" | "rprivate" | "shared" | "rshared" | "slave" | "rslave" | "unbindable"
            | "runbindable" | "defaults" => {}
            other => data.push(other.to_string()),
        }
    }
    (flags, recursive_bind, data.join(","))
}

/// A mount target inside the root: created (directory, or empty file when
/// `file`) and opened without leaving the root.
fn prepare_target(root: &OwnedFd, dest: &CleanPath, file: bool) -> Result<OwnedFd> {
    if file {
        let (parent, _) = dest.split()?;
        fs::mkdir(root, &parent, 0o755, true)?;
        let f = fs::open_in_root(
            root,
            dest,
            OFlag::O_RDONLY | OFlag::O_CREAT,
            Mode::from_bits_truncate(0o644),
        );
        drop(f);
    } else {
        fs::mkdir(root, dest, 0o755, true)?;
    }
    fs::open_in_root(root, dest, OFlag::O_PATH, Mode::empty())
}

fn mount_err(what: String) -> impl FnOnce(nix::errno::Errno) -> AgentError {
    move |e| AgentError::FailedPrecondition(format!("{what}: {}", e.desc()))
}

/// Mount one spec mount inside `rootfs`.
fn do_mount(rootfs: &Path, m: &Mount) -> Result<()> {
    let dest_str = m.destination().to_string_lossy().into_owned();
    let dest = CleanPath::parse(&dest_str)?;
    if dest.is_root() {
        return Err(invalid("a mount onto the container's / is not supported"));
    }
    let typ = m.typ().clone().unwrap_or_default();
    let options = m.options().clone().unwrap_or_default();
    let (flags, rbind, data) = parse_options(&options);
    let source = m
        .source()
        .as_ref()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let root = fs::open_root(rootfs)?;
    let is_bind = flags.contains(MsFlags::MS_BIND) || typ == "bind";
    if is_bind {
        let meta = std::fs::metadata(&source).map_err(|e| {
            AgentError::FailedPrecondition(format!(
                "bind mount source {source} for {dest_str}: {e}"
            ))
        })?;
        let target = prepare_target(&root, &dest, !meta.is_dir())?;
        let tpath = fs::proc_fd_path(&target);
        let mut bflags = MsFlags::MS_BIND;
        if rbind {
            bflags |= MsFlags::MS_REC;
        }
        mount(
            Some(source.as_str()),
            tpath.as_str(),
            None::<&str>,
            bflags,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {source} onto {dest_str}")))?;
        let extra = flags & !MsFlags::MS_BIND;
        if !extra.is_empty() {
            // Flags of a bind mount only take with a remount of the new mount.
            let target = fs::open_in_root(&root, &dest, OFlag::O_PATH, Mode::empty())?;
            let tpath = fs::proc_fd_path(&target);
            mount(
                None::<&str>,
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REMOUNT | extra,
                None::<&str>,
            )
            .map_err(mount_err(format!("remount {dest_str} with {options:?}")))?;
        }
        return Ok(());
    }
    let fstype = match typ.as_str() {
        // A cgroup v1 hierarchy is not set up in the guest: give cgroup2.
        "cgroup" => "cgroup2",
        "" => return Err(invalid(format!("mount {dest_str} has no type"))),
        t => t,
    };
    let target = prepare_target(&root, &dest, false)?;
    let tpath = fs::proc_fd_path(&target);
    let src = if source.is_empty() {
        fstype.to_string()
    } else {
        source
    };
    let data_opt = (!data.is_empty()).then_some(data.as_str());
    let res = mount(
        Some(src.as_str()),
        tpath.as_str(),
        Some(fstype),
        flags,
        data_opt,
    );
    match res {
        Ok(()) => Ok(()),
        // Optional kernel features: a missing one must not stop the container.
        Err(e) if matches!(fstype, "cgroup2" | "mqueue") => {
            tracing::warn!("skipping mount {dest_str} ({fstype}): {}", e.desc());
            Ok(())
        }
        Err(e) => Err(mount_err(format!("mount {fstype} on {dest_str}"))(e)),
    }
}

fn default_mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount> {
    let json = serde_json::json!({
        "destination": dest, "type": typ, "source": source, "options": options,
    });
    serde_json::from_value(json).map_err(|e| AgentError::Internal(format!("default mount: {e}")))
}

/// Device nodes bound from the guest's /dev into a container's /dev.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

fn populate_dev(rootfs: &Path) -> Result<()> {
    let root = fs::open_root(rootfs)?;
    for dev in DEVICES {
        let dest = CleanPath::parse(&format!("/dev/{dev}"))?;
        let target = prepare_target(&root, &dest, true)?;
        let tpath = fs::proc_fd_path(&target);
        let src = format!("/dev/{dev}");
        mount(
            Some(src.as_str()),
            tpath.as_str(),
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {src} into the container")))?;
    }
    let dev = fs::open_in_root(
        &root,
        &CleanPath::parse("/dev")?,
        OFlag::O_PATH | OFlag::O_DIRECTORY,
        Mode::empty(),
    )?;
    for (name, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
        ("ptmx", "pts/ptmx"),
    ] {
        match nix::unistd::symlinkat(target, dev.as_fd(), name) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => return Err(AgentError::os(format!("symlink /dev/{name}"), e)),
        }
    }
    Ok(())
}

/// Mount what holds a writable overlay's upper and work directories on
/// `scratch`: the ext4 disk `upper` names (a pod member's own disk over its
/// image's shared read-only one: its writes persist with that disk, in
/// hibernation and checkpoints), else a tmpfs (writes go with the VM).
fn mount_upper(scratch: &Path, upper: &str) -> Result<()> {
    if upper.is_empty() {
        return mount(
            Some("tmpfs"),
            scratch,
            Some("tmpfs"),
            MsFlags::empty(),
            Some("mode=0755"),
        )
        .map_err(mount_err("mount the overlay's tmpfs".into()));
    }
    let dev = super::slot::resolve(upper)?;
    // The host formats it with lazily initialised inode tables: nothing
    // needs zeroing in the guest (no background writer).
    mount(
        Some(dev.as_str()),
        scratch,
        Some("ext4"),
        MsFlags::empty(),
        Some("noinit_itable"),
    )
    .map_err(mount_err(format!("mount {dev} (ext4) as the overlay's upper layer")))
}

/// Mount the container's root filesystem and every mount of its spec
/// under `bundle`. On error, everything mounted so far is detached.
pub fn mount_container(
    bundle: &Path,
    spec: &Spec,
    rootfs: &burrow_protocol::agent::Rootfs,
) -> Result<PathBuf> {
    let target = bundle.join("rootfs");
    let res = mount_container_inner(bundle, &target, spec, rootfs);
    if res.is_err() {
        unmount_container(bundle);
    }
    res.map(|()| target)
}

fn mount_container_inner(
    bundle: &Path,
    target: &Path,
    spec: &Spec,
    rootfs: &burrow_protocol::agent::Rootfs,
) -> Result<()> {
    let mkdir = |p: &Path| {
        std::fs::create_dir_all(p).map_err(|e| AgentError::io(format!("mkdir {}", p.display()), e))
    };
    mkdir(target)?;
    let (flags, _, data) = parse_options(&rootfs.options);
    let data_opt = (!data.is_empty()).then_some(data.as_str());
    if rootfs.source.is_empty() {
        return Err(invalid("rootfs.source is empty"));
    }
    let source = &super::slot::resolve(&rootfs.source)?;
    let source = source.as_str();
    let lower = if rootfs.writable_overlay {
        bundle.join("lower")
    } else {
        target.to_path_buf()
    };
    mkdir(&lower)?;
    if rootfs.fstype == "bind" {
        if !Path::new(source).is_dir() {
            return Err(invalid(format!(
                "rootfs source {source} is not a directory"
            )));
        }
        mount(
            Some(source),
            &lower,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            None::<&str>,
        )
        .map_err(mount_err(format!("bind {source} as the container root")))?;
    } else {
        if rootfs.fstype.is_empty() {
            return Err(invalid(
                "rootfs.fstype is empty (want e.g. ext4, or \"bind\")",
            ));
        }
        let flags = if rootfs.writable_overlay {
            flags | MsFlags::MS_RDONLY
        } else {
            flags
        };
        mount(
            Some(source),
            &lower,
            Some(rootfs.fstype.as_str()),
            flags,
            data_opt,
        )
        .map_err(mount_err(format!(
            "mount {source} ({}) as the container root",
            rootfs.fstype
        )))?;
    }
    if rootfs.writable_overlay {
        let scratch = bundle.join("scratch");
        mkdir(&scratch)?;
        mount_upper(&scratch, &rootfs.upper)?;
        mkdir(&scratch.join("upper"))?;
        mkdir(&scratch.join("work"))?;
        let opts = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.display(),
            scratch.join("upper").display(),
            scratch.join("work").display()
        );
        mount(
            Some("overlay"),
            target,
            Some("overlay"),
            MsFlags::empty(),
            Some(opts.as_str()),
        )
        .map_err(mount_err("mount the writable overlay".into()))?;
    }
    let mut mounts: Vec<Mount> = spec.mounts().clone().unwrap_or_default();
    if mounts.len() > MAX_MOUNTS {
        return Err(invalid(format!(
            "spec has {} mounts, more than {MAX_MOUNTS}",
            mounts.len()
        )));
    }
    let has = |mounts: &[Mount], d: &str| mounts.iter().any(|m| m.destination() == Path::new(d));
    let mut defaults = Vec::new();
    if !has(&mounts, "/proc") {
        defaults.push(default_mount(
            "/proc",
            "proc",
            "proc",
            &["nosuid", "noexec", "nodev"],
        )?);
    }
    if !has(&mounts, "/dev") {
        defaults.push(default_mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?);
        if !has(&mounts, "/dev/pts") {
            defaults.push(default_mount(
                "/dev/pts",
                "devpts",
                "devpts",
                &[
                    "nosuid",
                    "noexec",
                    "newinstance",
                    "ptmxmode=0666",
                    "mode=0620",
                ],
            )?);
        }
    }
    if !has(&mounts, "/sys") {
        defaults.push(default_mount(
            "/sys",
            "sysfs",
            "sysfs",
            &["nosuid", "noexec", "nodev", "ro"],
        )?);
    }
    defaults.append(&mut mounts);
    let mounts = defaults;
    for m in &mounts {
        let carried = super::hostfiles::resolve(bundle, spec, m)?;
        do_mount(target, carried.as_ref().unwrap_or(m))?;
    }
    populate_dev(target)?;
    if let Some(linux) = spec.linux() {
        let root = fs::open_root(target)?;
        for p in linux.readonly_paths().iter().flatten() {
            let Ok(fd) =
                fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())
            else {
                continue;
            };
            let tpath = fs::proc_fd_path(&fd);
            mount(
                Some(tpath.as_str()),
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(mount_err(format!("bind readonly path {p}")))?;
            let fd = fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())?;
            let tpath = fs::proc_fd_path(&fd);
            mount(
                None::<&str>,
                tpath.as_str(),
                None::<&str>,
                MsFlags::MS_BIND
                    | MsFlags::MS_REMOUNT
                    | MsFlags::MS_RDONLY
                    | MsFlags::MS_NOSUID
                    | MsFlags::MS_NODEV
                    | MsFlags::MS_NOEXEC,
                None::<&str>,
            )
            .map_err(mount_err(format!("make {p} read-only")))?;
        }
        for p in linux.masked_paths().iter().flatten() {
            let Ok(fd) =
                fs::open_in_root(&root, &CleanPath::parse(p)?, OFlag::O_PATH, Mode::empty())
            else {
                continue;
            };
            let tpath = fs::proc_fd_path(&fd);
            let is_dir = nix::sys::stat::fstat(fd.as_fd())
                .map(|st| st.st_mode & libc::S_IFMT == libc::S_IFDIR)
                .unwrap_or(false);
            let res = if is_dir {
                mount(
                    Some("tmpfs"),
                    tpath.as_str(),
                    Some("tmpfs"),
                    MsFlags::MS_RDONLY,
                    None::<&str>,
                )
            } else {
                mount(
                    Some("/dev/null"),
                    tpath.as_str(),
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
            };
            res.map_err(mount_err(format!("mask {p}")))?;
        }
    }
    if spec
        .root()
        .as_ref()
        .and_then(|r| r.readonly())
        .unwrap_or(false)
    {
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(mount_err("make the container root read-only".into()))?;
    }
    Ok(())
}

/// Detach everything mounted for a container and remove its directories
/// (only empty ones: a failed unmount never deletes container data).
pub fn unmount_container(bundle: &Path) {
    for sub in ["rootfs", "scratch", "lower"] {
        let p = bundle.join(sub);
        if p.exists() {
            let _ = umount2(&p, MntFlags::MNT_DETACH);
            let _ = std::fs::remove_dir(&p);
        }
    }
    let _ = std::fs::remove_dir(bundle);
}
