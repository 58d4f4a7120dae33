//! Mounting the browser image and starting Chromium from it.
//!
//! The image becomes a container root under `<state>/browser/rootfs` (the
//! container code mounts it read-only with a tmpfs overlay, plus /proc,
//! /dev, /sys, a tmpfs /tmp and /dev/shm), the guest's own tree is bound
//! read-only at `/guest` inside it, and Chromium runs there as the
//! unprivileged `browser` user (uid 1000) in mount, UTS and IPC namespaces
//! of its own, with the DevTools pipe on its fds 3 and 4.

use std::ffi::CString;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;
use tokio::io::AsyncReadExt;
use tokio::sync::watch;

use crate::container;
use crate::error::{AgentError, Result};
use crate::spawn::{self, ChildStdio, ExitStatus, Namespaces};

/// Where the browser image comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// An erofs block device (the guest: `burrow.browser=/dev/vdX`).
    Device(PathBuf),
    /// A directory holding the unpacked image (test mode).
    Dir(PathBuf),
}

impl Source {
    pub fn path(&self) -> &Path {
        match self {
            Source::Device(p) | Source::Dir(p) => p,
        }
    }

    /// A block device is mounted as erofs, a directory is bound.
    pub fn from_path(path: PathBuf) -> Self {
        if path.is_dir() {
            Source::Dir(path)
        } else {
            Source::Device(path)
        }
    }
}

/// uid and gid of the `browser` user in the image (rootfs/browser-image).
const BROWSER_UID: u32 = 1000;
/// Chromium inside the image.
const CHROMIUM: &str = "/usr/lib/chromium/chromium";
/// Keep this much of Chromium's stderr for error messages.
const STDERR_TAIL: usize = 8 << 10;

/// A running Chromium.
pub struct Chromium {
    pub pid: i32,
    pub exit: watch::Receiver<Option<ExitStatus>>,
    pub bundle: PathBuf,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// Our ends of the DevTools pipe, taken by the CDP client.
    pub to_chromium: Option<OwnedFd>,
    pub from_chromium: Option<OwnedFd>,
}

impl Chromium {
    /// The last lines Chromium wrote to stderr.
    pub fn stderr_tail(&self) -> String {
        let tail = self.stderr.lock().unwrap_or_else(|p| p.into_inner());
        String::from_utf8_lossy(&tail).trim().to_string()
    }

    pub fn exited(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }
}

fn spec_json(viewport: (u32, u32), sandbox: bool) -> serde_json::Value {
    let mut args: Vec<String> = [
        CHROMIUM,
        "--headless=new",
        "--remote-debugging-pipe",
        "--user-data-dir=/tmp/chromium",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--disable-breakpad",
        "--disable-crash-reporter",
        "--mute-audio",
        "--hide-scrollbars",
        "--password-store=basic",
        "--allow-file-access-from-files",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.push(format!("--window-size={},{}", viewport.0, viewport.1));
    if !sandbox {
        args.push("--no-sandbox".into());
    }
    args.push("about:blank".into());
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": args,
            "env": [
                "PATH=/usr/bin:/bin",
                "HOME=/tmp",
                "LANG=C.UTF-8",
                "XDG_CONFIG_HOME=/tmp/.config",
                "XDG_CACHE_HOME=/tmp/.cache",
            ],
            "cwd": "/tmp",
            "user": {"uid": BROWSER_UID, "gid": BROWSER_UID},
        },
        "root": {"path": "rootfs"},
        "mounts": [
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "nodev", "mode=1777"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "nodev", "noexec", "mode=1777"]},
        ],
    })
}

/// Mount the image under `bundle` and start Chromium there.
pub async fn start(
    source: &Source,
    bundle: &Path,
    viewport: (u32, u32),
    sandbox: bool,
) -> Result<Chromium> {
    if !source.path().exists() {
        return Err(AgentError::FailedPrecondition(format!(
            "the browser image {} does not exist (attach rootfs/browser-image as a disk)",
            source.path().display()
        )));
    }
    let spec_bytes = serde_json::to_vec(&spec_json(viewport, sandbox))
        .map_err(|e| AgentError::Internal(format!("browser spec: {e}")))?;
    let spec = container::parse_spec(&spec_bytes)?;
    let mut rootfs = burrow_protocol::agent::Rootfs::new();
    rootfs.source = source.path().to_string_lossy().into_owned();
    match source {
        Source::Device(_) => {
            rootfs.fstype = "erofs".into();
            rootfs.options = vec!["ro".into()];
        }
        Source::Dir(_) => rootfs.fstype = "bind".into(),
    }
    rootfs.writable_overlay = true;
    let (b, s) = (bundle.to_path_buf(), spec.clone());
    let root = tokio::task::spawn_blocking(move || -> Result<PathBuf> {
        let root = container::mount_container(&b, &s, &rootfs)
            .map_err(|e| AgentError::FailedPrecondition(format!("mount the browser image: {e}")))?;
        if let Err(e) = bind_guest_readonly(&root.join("guest")) {
            container::unmount_container(&b);
            return Err(e);
        }
        Ok(root)
    })
    .await
    .map_err(|e| AgentError::Internal(format!("mount task failed: {e}")))??;
    match spawn_chromium(&spec, &root).await {
        Ok((pid, exit, stderr, to_chromium, from_chromium)) => Ok(Chromium {
            pid,
            exit,
            bundle: bundle.to_path_buf(),
            stderr,
            to_chromium: Some(to_chromium),
            from_chromium: Some(from_chromium),
        }),
        Err(e) => {
            container::unmount_container(bundle);
            Err(e)
        }
    }
}

type Spawned = (
    i32,
    watch::Receiver<Option<ExitStatus>>,
    Arc<Mutex<Vec<u8>>>,
    OwnedFd,
    OwnedFd,
);

async fn spawn_chromium(spec: &oci_spec::runtime::Spec, root: &Path) -> Result<Spawned> {
    let process = spec
        .process()
        .as_ref()
        .ok_or_else(|| AgentError::Internal("browser spec has no process".into()))?;
    let root_c = CString::new(root.to_string_lossy().as_bytes())
        .map_err(|_| AgentError::Internal("state directory path contains NUL".into()))?;
    let mut plan = container::plan(
        process,
        Namespaces::NewContainer {
            rootfs: root_c,
            hostname: None,
            // Chromium's sandbox makes the PID namespaces it wants.
            pid: None,
            join: Vec::new(),
        },
    )?;
    let pipe =
        || nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(|e| AgentError::os("create a pipe", e));
    // Chromium reads commands on fd 3 and writes replies on fd 4.
    let (cmd_r, cmd_w) = pipe()?;
    let (reply_r, reply_w) = pipe()?;
    let (err_r, err_w) = pipe()?;
    plan.pass_fds = vec![cmd_r, reply_w];
    let null = |flags| {
        nix::fcntl::open("/dev/null", flags | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| AgentError::os("open /dev/null", e))
    };
    let stdio = ChildStdio {
        stdin: null(OFlag::O_RDONLY)?,
        stdout: null(OFlag::O_WRONLY)?,
        stderr: err_w,
    };
    let (pid, exit, _) = spawn::spawn(plan, stdio, false).await?;
    let tail = Arc::new(Mutex::new(Vec::new()));
    tokio::spawn(keep_stderr(err_r, tail.clone()));
    tracing::info!(pid, "chromium started");
    Ok((pid, exit, tail, cmd_w, reply_r))
}

/// Log Chromium's stderr (debug level) and keep its last [`STDERR_TAIL`]
/// bytes.
async fn keep_stderr(fd: OwnedFd, tail: Arc<Mutex<Vec<u8>>>) {
    let Ok(mut rx) = tokio::net::unix::pipe::Receiver::from_owned_fd(fd) else {
        return;
    };
    let mut buf = vec![0u8; 4096];
    while let Ok(n) = rx.read(&mut buf).await {
        if n == 0 {
            break;
        }
        let data = buf.get(..n).unwrap_or_default();
        tracing::debug!("chromium: {}", String::from_utf8_lossy(data).trim_end());
        let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
        t.extend_from_slice(data);
        if t.len() > STDERR_TAIL {
            let cut = t.len() - STDERR_TAIL;
            t.drain(..cut);
        }
    }
}

/// Bind the guest's whole tree (as the agent sees it) read-only, nosuid
/// and nodev, recursively, at `target`: Chromium can open the guest's
/// files (file:///guest/...) but change nothing.
fn bind_guest_readonly(target: &Path) -> Result<()> {
    std::fs::create_dir_all(target)
        .map_err(|e| AgentError::io(format!("mkdir {}", target.display()), e))?;
    const OPEN_TREE_CLONE: libc::c_uint = 1;
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const MOUNT_ATTR_NOSUID: u64 = 0x2;
    const MOUNT_ATTR_NODEV: u64 = 0x4;
    const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    let err = |what: &str| AgentError::os(what, nix::errno::Errno::last());
    // SAFETY: open_tree on a constant path; the fd is owned right away.
    let tree = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c"/".as_ptr(),
            OPEN_TREE_CLONE | AT_RECURSIVE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if tree < 0 {
        return Err(err("open_tree / for the browser"));
    }
    let tree_fd = i32::try_from(tree).map_err(|_| AgentError::Internal("open_tree fd".into()))?;
    // SAFETY: a fresh fd from open_tree that nothing else owns.
    let tree: OwnedFd = unsafe { std::os::fd::FromRawFd::from_raw_fd(tree_fd) };
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV,
        attr_clr: 0,
        propagation: libc::MS_PRIVATE,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads `attr` (its size is passed).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH as libc::c_uint | AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(err("make the guest tree read-only for the browser"));
    }
    let target_c = CString::new(target.to_string_lossy().as_bytes())
        .map_err(|_| AgentError::Internal("path contains NUL".into()))?;
    // SAFETY: move_mount of our detached tree onto a path we created.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_FDCWD,
            target_c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if rc < 0 {
        return Err(err("mount the guest tree in the browser's root"));
    }
    Ok(())
}

/// Stop Chromium (the whole process group) and unmount its root.
pub async fn stop(chromium: &mut Chromium) {
    // SAFETY: plain kill(2) of the process group Chromium leads (spawn
    // makes every child a session leader).
    if chromium.exited().is_none() {
        unsafe { libc::kill(-chromium.pid, libc::SIGKILL) };
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            chromium.exit.wait_for(Option::is_some),
        )
        .await;
    }
    // Renderers and the zygote may outlive the leader for a moment; the
    // mounts are detached lazily in any case.
    unsafe { libc::kill(-chromium.pid, libc::SIGKILL) };
    let bundle = chromium.bundle.clone();
    let _ = tokio::task::spawn_blocking(move || container::unmount_container(&bundle)).await;
    tracing::info!(pid = chromium.pid, "chromium stopped");
}
