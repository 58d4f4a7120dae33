//! Starting `burrow-vmm` and talking to its control API, both through the
//! types of `burrow-vmm-api` that the VMM parses: [`VmmArgs`] becomes its
//! argv, [`Command`]s go in and [`Response`]s come back as JSON lines (event
//! lines that come in between are skipped). The VMM's errors keep their
//! [`ErrorKind`], which becomes the gRPC code containerd sees.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::fs::File;

use burrow_vmm_api::layout;
use burrow_vmm_api::messages::Answer;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;
use burrow_vmm_api::{ApiError, Command, ErrorKind, Line, Request, Response, SnapshotInfo};
pub use burrow_vmm_api::{DiskArg, VmmArgs};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::sandbox::{Result, SandboxError};

/// Longest control API line read.
const MAX_LINE: usize = burrow_vmm_api::MAX_LINE;
/// Most event lines skipped while waiting for a reply.
const MAX_SKIPPED: usize = 64;
/// How long a plain command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a snapshot may take (it writes all of guest memory).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);

/// What the shim starts: the binary, its arguments, and the size of the VM
/// they give (on a restore the arguments do not say; the checkpoint does).
#[derive(Debug, Clone)]
pub struct VmmLaunch {
    pub binary: PathBuf,
    pub args: VmmArgs,
    pub vcpus: u32,
    pub memory_mib: u64,
    /// What its memory may grow to (`--mem-max`; a restore's is the
    /// snapshot's), when it can grow.
    pub memory_max_mib: Option<u64>,
}

impl VmmLaunch {
    /// The command line, for the log.
    pub fn describe(&self) -> String {
        let argv: Vec<String> = self
            .args
            .to_argv()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        argv.join(" ")
    }
}

/// The VMM's error kinds as the shim reports them to containerd.
impl From<ApiError> for SandboxError {
    fn from(e: ApiError) -> Self {
        let msg = format!("burrow-vmm: {}", e.message);
        match e.kind {
            ErrorKind::NoSpace => SandboxError::ResourceExhausted(msg),
            ErrorKind::PermissionDenied => SandboxError::PermissionDenied(msg),
            ErrorKind::NotFound => SandboxError::NotFound(msg),
            ErrorKind::InvalidState => SandboxError::FailedPrecondition(msg),
            // A corrupt snapshot is an unusable checkpoint, as the shim's
            // own manifest checks call one.
            ErrorKind::InvalidRequest | ErrorKind::Corrupt => SandboxError::InvalidArgument(msg),
            ErrorKind::Unsupported => SandboxError::Unimplemented(msg),
            ErrorKind::Timeout => SandboxError::Timeout(msg),
            ErrorKind::Io | ErrorKind::Internal => SandboxError::Internal(msg),
        }
    }
}

/// A running burrow-vmm.
pub struct Vmm {
    pub pid: u32,
    /// A pidfd of the process, opened before anything could reap it:
    /// signals through it never reach a process that reused the pid.
    pidfd: Option<Arc<std::os::fd::OwnedFd>>,
    api: PathBuf,
    /// `Some(description)` once the process has exited.
    exited: watch::Receiver<Option<String>>,
    /// The typed error it reported when it could not build or restore the
    /// VM (set before `exited`).
    failure: Arc<Mutex<Option<ApiError>>>,
}

impl Vmm {
    /// Spawn it; its stderr goes to `log`.
    pub fn spawn(launch: &VmmLaunch, log: &Path) -> Result<Self> {
        let api = launch.args.api.clone().ok_or_else(|| {
            SandboxError::Internal("burrow-vmm started without an API socket".into())
        })?;
        let log_file = std::fs::File::create(log)
            .map_err(|e| SandboxError::io(format_args!("creating {}", log.display()), &e))?;
        let mut cmd = tokio::process::Command::new(&launch.binary);
        cmd.args(launch.args.to_argv())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        // Descriptors burrow-vmm inherits: the tap, a restore's packed
        // memory. Both are close-on-exec in the shim.
        let tap = match launch.args.net.as_ref().map(|n| n.tap.clone()) {
            Some(burrow_vmm_api::TapSource::Fd(fd)) => Some(fd),
            _ => None,
        };
        let inherit: Vec<i32> = tap.into_iter().chain(launch.args.packed_memory_fd).collect();
        if !inherit.is_empty() {
            // SAFETY: between fork and exec the closure only calls
            // fcntl(2), which is async-signal-safe, on descriptors it was
            // given (no allocation: the list was made before the fork);
            // they stay open in burrow-vmm alone.
            unsafe {
                cmd.pre_exec(move || {
                    for &fd in &inherit {
                        if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().map_err(|e| {
            SandboxError::FailedPrecondition(format!("starting {}: {e}", launch.binary.display()))
        })?;
        let pid = child.id().unwrap_or(0);
        // Before the wait below is spawned: the child cannot be reaped yet.
        let pidfd = pidfd_open(pid).map(Arc::new);
        let (tx, rx) = watch::channel(None);
        let failure = Arc::new(Mutex::new(None));
        let log = log.to_path_buf();
        let failed = failure.clone();
        tokio::spawn(async move {
            let what = match child.wait().await {
                Ok(s) => format!("burrow-vmm exited ({s})"),
                Err(e) => format!("burrow-vmm: waiting failed: {e}"),
            };
            let (tail, typed) = exit_report(&log);
            let msg = if tail.is_empty() {
                what
            } else {
                format!("{what}: {tail}")
            };
            tracing::info!("{msg}");
            *failed.lock().unwrap_or_else(|p| p.into_inner()) = typed;
            let _ = tx.send(Some(msg));
        });
        Ok(Self {
            pid,
            pidfd,
            api,
            exited: rx,
            failure,
        })
    }

    /// Something that kills this VMM from anywhere (SIGKILL through its
    /// pidfd; nothing once it is reaped).
    pub fn killer(&self) -> super::lifecycle::Killer {
        let pidfd = self.pidfd.clone();
        super::lifecycle::Killer::new(move || {
            if let Some(fd) = &pidfd {
                pidfd_kill(fd);
            }
        })
    }

    /// Why the VMM exited, if it has.
    pub fn exit_reason(&self) -> Option<String> {
        self.exited.borrow().clone()
    }

    /// Resolves when the VMM process has exited.
    pub fn exited(&self) -> watch::Receiver<Option<String>> {
        self.exited.clone()
    }

    /// The error for "the VMM exited while `doing`": the VMM's own typed
    /// error when it reported one (a full disk, a corrupt snapshot), else
    /// Unavailable with its exit description and `detail`.
    pub fn exit_error(&self, doing: &str, detail: &str) -> SandboxError {
        let typed = self
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match typed {
            Some(e) => e.context(format!("the VM exited while {doing}")).into(),
            None => SandboxError::Unavailable(format!(
                "the VM exited while {doing}: {} ({detail})",
                self.exit_reason().unwrap_or_default()
            )),
        }
    }

    /// Freeze the vCPUs.
    pub async fn pause(&self) -> Result<()> {
        self.command(Command::Pause, COMMAND_TIMEOUT)
            .await
            .map(drop)
    }

    /// Thaw them.
    pub async fn resume(&self) -> Result<()> {
        self.command(Command::Resume, COMMAND_TIMEOUT)
            .await
            .map(drop)
    }

    /// End the VM (the process exits).
    pub async fn stop(&self) -> Result<()> {
        self.command(Command::Stop, COMMAND_TIMEOUT).await.map(drop)
    }

    /// Pause and write a snapshot to `dir` (incremental: only the pages
    /// written since the last one); the VM stays paused.
    pub async fn snapshot(&self, dir: &Path, incremental: bool) -> Result<SnapshotInfo> {
        let (dir, files) = snapshot_files(dir)?;
        let cmd = Command::Snapshot { dir, incremental };
        self.command_with(cmd, &files, SNAPSHOT_TIMEOUT)
            .await?
            .snapshot
            .ok_or_else(|| {
                SandboxError::Internal("burrow-vmm answered a snapshot without its sizes".into())
            })
    }

    /// Send one command and wait (at most `timeout`) for its answer.
    pub async fn command(&self, cmd: Command, timeout: Duration) -> Result<Answer> {
        self.command_with(cmd, &[], timeout).await
    }

    /// [`Self::command`], passing `files` with it.
    async fn command_with(&self, cmd: Command, files: &[File], timeout: Duration) -> Result<Answer> {
        if let Some(r) = self.exit_reason() {
            return Err(SandboxError::Unavailable(r));
        }
        let what = format!("{cmd:?}");
        tokio::time::timeout(timeout, command_at_with(&self.api, cmd, files))
            .await
            .map_err(|_| {
                SandboxError::Timeout(format!(
                    "burrow-vmm did not answer {what} within {}s",
                    timeout.as_secs()
                ))
            })?
    }

    /// Kill it hard and wait (bounded) for it to go.
    pub async fn kill(&mut self) {
        if self.exit_reason().is_none() {
            if let Some(fd) = &self.pidfd {
                pidfd_kill(fd);
            } else if let Ok(pid) = i32::try_from(self.pid) {
                if pid > 0 {
                    // SAFETY: plain kill(2) on our own child.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.exited.wait_for(Option::is_some),
        )
        .await;
    }
}

/// A pidfd for process `pid` (None for 0 or when the kernel has none).
fn pidfd_open(pid: u32) -> Option<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    let pid = i32::try_from(pid).ok().filter(|&p| p > 0)?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = i32::try_from(fd).ok().filter(|&fd| fd >= 0)?;
    // SAFETY: the descriptor was just returned to us and nothing else owns it.
    Some(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// SIGKILL through a pidfd (ESRCH once the process is gone: ignored).
fn pidfd_kill(fd: &std::os::fd::OwnedFd) {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal reads its arguments; a null info is allowed.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            fd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
}

/// Make `dir` (0700) and in it the two empty files a snapshot is written
/// into (memory, state; 0600, new). They are passed to the VMM, which in
/// its jail sees no snapshot directory. Returns `dir` made absolute.
fn snapshot_files(dir: &Path) -> Result<(PathBuf, [File; 2])> {
    use std::os::unix::fs::OpenOptionsExt;
    let fail = |what: &Path, e: std::io::Error| SandboxError::io(format_args!("creating {}", what.display()), &e);
    std::fs::create_dir_all(dir).map_err(|e| fail(dir, e))?;
    let dir = dir.canonicalize().map_err(|e| fail(dir, e))?;
    let new = |name: &str| {
        let p = dir.join(name);
        File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&p)
            .map_err(|e| fail(&p, e))
    };
    let files = [new(layout::MEMORY_FILE)?, new(layout::STATE_FILE)?];
    Ok((dir, files))
}

/// Connect to the unix socket at `path`, however long.
pub async fn connect(path: &Path) -> std::io::Result<UnixStream> {
    let p = burrow_vmm_api::sockpath::SocketPath::new(path)?;
    UnixStream::connect(p.path()).await
}

/// Send `cmd` to the API socket at `api` and read its response.
pub async fn command_at(api: &Path, cmd: Command) -> Result<Answer> {
    command_at_with(api, cmd, &[]).await
}

/// [`command_at`], passing `files` with the request (`SCM_RIGHTS`).
pub async fn command_at_with(api: &Path, cmd: Command, files: &[File]) -> Result<Answer> {
    let name = format!("{cmd:?}");
    let io = |e: std::io::Error| {
        SandboxError::Unavailable(format!("burrow-vmm API {}: {e}", api.display()))
    };
    let stream = connect(api).await.map_err(io)?;
    let line = burrow_vmm_api::to_line(&Request::from(cmd));
    let stream = if files.is_empty() {
        let mut stream = stream;
        stream.write_all(&line).await.map_err(io)?;
        stream
    } else {
        // One small message on a fresh connection: sendmsg takes it whole.
        let std = stream.into_std().map_err(io)?;
        let fds: Vec<_> = files.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
        let sent = std
            .send_with_fds(&[line.as_slice()], &fds)
            .map_err(|e| io(std::io::Error::from_raw_os_error(e.errno())))?;
        if sent != line.len() {
            return Err(SandboxError::Internal(format!("burrow-vmm API took {sent} of {} bytes", line.len())));
        }
        UnixStream::from_std(std).map_err(io)?
    };
    let (r, _w) = stream.into_split();
    let mut reader =
        BufReader::new(r).take(u64::try_from(MAX_LINE * (MAX_SKIPPED + 1)).unwrap_or(u64::MAX));
    for _ in 0..=MAX_SKIPPED {
        let mut line = String::new();
        let n = reader.read_line(&mut line).await.map_err(io)?;
        if n == 0 {
            return Err(SandboxError::Unavailable(format!(
                "burrow-vmm API closed before answering {name}"
            )));
        }
        if line.len() > MAX_LINE {
            return Err(SandboxError::Internal(
                "burrow-vmm API line too long".into(),
            ));
        }
        match serde_json::from_str::<Line>(line.trim()) {
            Ok(Line::Response(r)) => return answer(r, &name),
            Ok(Line::Event(_)) => continue,
            Err(e) => {
                return Err(SandboxError::Internal(format!(
                    "burrow-vmm answered {name} with {:?}: {e}",
                    line.trim()
                )))
            }
        }
    }
    Err(SandboxError::Internal(format!(
        "no reply to {name} from burrow-vmm"
    )))
}

fn answer(r: Response, name: &str) -> Result<Answer> {
    r.into_result()
        .map_err(|e| SandboxError::from(e.context(format!("{name} refused"))))
}

/// What the VMM's log says about its exit: the last lines as text on one
/// line (without the typed failure line), and the typed failure, if the
/// VMM reported one.
fn exit_report(log: &Path) -> (String, Option<ApiError>) {
    let tail = tail_of(log, 2048);
    let mut typed = None;
    let kept: Vec<&str> = tail
        .split(" | ")
        .filter(|l| match ApiError::from_failure_line(l) {
            Some(e) => {
                typed = Some(e);
                false
            }
            None => true,
        })
        .collect();
    (kept.join(" | "), typed)
}

use tokio::io::AsyncReadExt as _;

/// The last `max` bytes of a file, as text on one line.
pub fn tail_of(path: &Path, max: u64) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut buf = Vec::new();
    let _ = f.take(max).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).trim().replace('\n', " | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_describes_its_argv() {
        let mut args = VmmArgs::boot("/k".into());
        args.disks = vec![DiskArg {
            path: "/r".into(),
            read_only: true,
        }];
        args.api = Some("/s/a".into());
        let l = VmmLaunch {
            binary: "burrow-vmm".into(),
            args,
            vcpus: 2,
            memory_mib: 256,
            memory_max_mib: None,
        };
        let s = l.describe();
        assert!(s.starts_with("run --kernel /k"), "{s}");
        assert!(s.contains("--disk /r:ro"), "{s}");
    }

    #[test]
    fn vmm_error_kinds_become_the_right_codes() {
        use containerd_shim::protos::ttrpc::Code;
        let cases = [
            (ErrorKind::NoSpace, Code::RESOURCE_EXHAUSTED),
            (ErrorKind::PermissionDenied, Code::PERMISSION_DENIED),
            (ErrorKind::NotFound, Code::NOT_FOUND),
            (ErrorKind::InvalidState, Code::FAILED_PRECONDITION),
            (ErrorKind::Corrupt, Code::INVALID_ARGUMENT),
            (ErrorKind::InvalidRequest, Code::INVALID_ARGUMENT),
            (ErrorKind::Unsupported, Code::UNIMPLEMENTED),
            (ErrorKind::Timeout, Code::DEADLINE_EXCEEDED),
            (ErrorKind::Io, Code::INTERNAL),
        ];
        for (kind, code) in cases {
            let e = SandboxError::from(ApiError::new(kind, "m"));
            assert_eq!(e.code(), code, "{kind:?}");
        }
    }

    #[test]
    fn exit_report_separates_the_typed_failure() {
        let d = tempfile::tempdir().expect("tempdir");
        let log = d.path().join("vmm.log");
        let failure = ApiError::new(ErrorKind::NoSpace, "snapshot /s: No space left on device");
        std::fs::write(
            &log,
            format!(
                "burrow-vmm: snapshot /s: No space left on device\n{}\n",
                failure.failure_line()
            ),
        )
        .expect("write");
        let (tail, typed) = exit_report(&log);
        assert_eq!(tail, "burrow-vmm: snapshot /s: No space left on device");
        assert_eq!(typed, Some(failure));
        std::fs::write(&log, "burrow-vmm: guest powered off\n").expect("write");
        assert_eq!(
            exit_report(&log),
            ("burrow-vmm: guest powered off".into(), None)
        );
    }

    #[tokio::test]
    async fn api_skips_events_and_reports_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let api = dir.path().join("api.sock");
        let l = tokio::net::UnixListener::bind(&api).expect("bind");
        tokio::spawn(async move {
            let replies = [
                [
                    burrow_vmm_api::to_line(&Line::Event(burrow_vmm_api::Event::Started)),
                    burrow_vmm_api::to_line(&Response::ok(burrow_vmm_api::VmState::Paused)),
                ]
                .concat(),
                burrow_vmm_api::to_line(&Response::err(ApiError::new(
                    ErrorKind::NoSpace,
                    "disk full",
                ))),
            ];
            for reply in replies {
                let (mut s, _) = l.accept().await.expect("accept");
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await;
                s.write_all(&reply).await.expect("write");
            }
        });
        let a = command_at(&api, Command::Pause).await.expect("pause");
        assert_eq!(a.state, Some(burrow_vmm_api::VmState::Paused));
        let e = command_at(
            &api,
            Command::Snapshot {
                dir: "/s".into(),
                incremental: false,
            },
        )
        .await
        .expect_err("refused");
        assert!(e.to_string().contains("disk full"), "{e}");
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
    }

    /// A snapshot request carries the directory the shim made and its two
    /// new, empty files (memory, state), passed as fds: what the VMM
    /// writes into them lands in those files.
    #[tokio::test]
    async fn a_snapshot_passes_its_new_files() {
        use std::io::{Seek, Write};
        use std::os::fd::FromRawFd;
        let dir = tempfile::tempdir().expect("tempdir");
        let api = dir.path().join("api.sock");
        let l = std::os::unix::net::UnixListener::bind(&api).expect("bind");
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().expect("accept");
            let mut buf = [0u8; 512];
            let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() }];
            let mut fds = [-1; 4];
            // SAFETY: the iovec points into `buf`.
            let (n, nfds) = unsafe { s.recv_with_fds(&mut iov, &mut fds) }.expect("recvmsg");
            let req = Request::parse(buf.get(..n.saturating_sub(1)).unwrap_or_default()).expect("request");
            for (i, &fd) in fds.iter().take(nfds).enumerate() {
                // SAFETY: recvmsg installed `fd` for this thread.
                let mut f = unsafe { File::from_raw_fd(fd) };
                f.seek(std::io::SeekFrom::End(0)).expect("seek");
                write!(f, "written through fd {i}").expect("write");
            }
            let info = SnapshotInfo {
                dir: "/x".into(),
                incremental: false,
                state_bytes: 1,
                memory_bytes: 1,
                memory_pages: 1,
                took_ms: 1,
            };
            (&s).write_all(&burrow_vmm_api::to_line(&Response::snapshot(burrow_vmm_api::VmState::Paused, info))).expect("reply");
            (req, nfds)
        });
        let (tx, exited) = watch::channel(None);
        let vmm = Vmm { pid: 0, pidfd: None, api, exited, failure: Arc::new(Mutex::new(None)) };
        let target = dir.path().join("snap/vm-1");
        std::fs::create_dir(dir.path().join("snap")).expect("mkdir");
        vmm.snapshot(&target, true).await.expect("snapshot");
        drop(tx);
        let (req, nfds) = server.join().expect("server");
        assert_eq!(nfds, 2, "memory and state are passed");
        let Command::Snapshot { dir: got, incremental } = req.cmd else { panic!("{req:?}") };
        assert_eq!((got, incremental), (target.canonicalize().expect("made"), true));
        let read = |n: &str| std::fs::read_to_string(target.join(n)).expect(n);
        assert_eq!(read("memory"), "written through fd 0");
        assert_eq!(read("state"), "written through fd 1");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(target.join("memory")).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // A second snapshot into the same directory is refused, not mixed.
        let e = vmm.snapshot(&target, false).await.expect_err("the files exist");
        assert!(e.to_string().contains(&format!("creating {}", target.join("memory").display())), "{e}");
    }
}
