//! Starting `burrow-vmm` and talking to its control API (JSON lines on a
//! unix socket: `{"cmd":"pause"}` → `{"ok":true,"state":"paused"}`; event
//! lines such as `{"event":"paused"}` may come in between and are skipped).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::sync::watch;

use crate::sandbox::{Result, SandboxError};

/// Longest control API line read.
const MAX_LINE: usize = 4096;
/// Most event lines skipped while waiting for a reply.
const MAX_SKIPPED: usize = 64;

/// What the VMM is started with.
#[derive(Debug, Clone)]
pub struct VmmArgs {
    pub binary: PathBuf,
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub disks: Vec<(PathBuf, bool)>,
    pub vsock: PathBuf,
    pub api: PathBuf,
    pub serial_log: PathBuf,
    pub vcpus: u32,
    pub memory_mib: u64,
    /// Restore this snapshot directory instead of booting `kernel` (the
    /// size, kernel and command line then come from the snapshot).
    pub restore: Option<PathBuf>,
}

impl VmmArgs {
    /// The command line (without the binary).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec!["run".to_string()];
        match &self.restore {
            Some(dir) => a.extend(["--restore".into(), dir.display().to_string()]),
            None => a.extend([
                "--kernel".into(),
                self.kernel.display().to_string(),
                "--cmdline".into(),
                self.cmdline.clone(),
            ]),
        }
        a.extend([
            "--vsock".into(),
            self.vsock.display().to_string(),
            "--api".into(),
            self.api.display().to_string(),
            "--serial-log".into(),
            self.serial_log.display().to_string(),
        ]);
        let restoring = self.restore.is_some();
        if !restoring {
            // A restore takes the VM's size and initrd from the snapshot.
            a.extend([
                "--vcpus".into(),
                self.vcpus.to_string(),
                "--mem".into(),
                self.memory_mib.to_string(),
            ]);
            if let Some(i) = &self.initrd {
                a.extend(["--initrd".into(), i.display().to_string()]);
            }
        }
        for (d, ro) in &self.disks {
            a.push("--disk".into());
            // On a restore the read-only flag comes from the snapshot.
            a.push(if *ro && !restoring {
                format!("{}:ro", d.display())
            } else {
                d.display().to_string()
            });
        }
        a
    }
}

#[derive(Debug, Deserialize)]
struct Reply {
    ok: Option<bool>,
    state: Option<String>,
    error: Option<String>,
}

/// A running burrow-vmm.
pub struct Vmm {
    pub pid: u32,
    api: PathBuf,
    /// `Some(description)` once the process has exited.
    exited: watch::Receiver<Option<String>>,
}

impl Vmm {
    /// Spawn it; its stderr goes to `log`.
    pub fn spawn(args: &VmmArgs, log: &Path) -> Result<Self> {
        if u8::try_from(args.vcpus).is_err() {
            return Err(SandboxError::InvalidArgument(format!(
                "{} vCPUs is more than burrow-vmm takes",
                args.vcpus
            )));
        }
        let log_file = std::fs::File::create(log)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", log.display())))?;
        let mut cmd = tokio::process::Command::new(&args.binary);
        cmd.args(args.to_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| {
            SandboxError::FailedPrecondition(format!("starting {}: {e}", args.binary.display()))
        })?;
        let pid = child.id().unwrap_or(0);
        let (tx, rx) = watch::channel(None);
        let log = log.to_path_buf();
        tokio::spawn(async move {
            let what = match child.wait().await {
                Ok(s) => format!("burrow-vmm exited ({s})"),
                Err(e) => format!("burrow-vmm: waiting failed: {e}"),
            };
            let tail = tail_of(&log, 2048);
            let msg = if tail.is_empty() {
                what
            } else {
                format!("{what}: {tail}")
            };
            tracing::info!("{msg}");
            let _ = tx.send(Some(msg));
        });
        Ok(Self {
            pid,
            api: args.api.clone(),
            exited: rx,
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

    /// Wait for the API socket to appear (the VMM creates it while building
    /// the VM).
    pub async fn wait_api(&self, timeout: Duration) -> Result<()> {
        let start = tokio::time::Instant::now();
        loop {
            if let Some(r) = self.exit_reason() {
                return Err(SandboxError::Unavailable(r));
            }
            if UnixStream::connect(&self.api).await.is_ok() {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(SandboxError::Timeout(format!(
                    "burrow-vmm did not open its API socket {} within {}s",
                    self.api.display(),
                    timeout.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Send one command; returns the VM state it reports.
    pub async fn command(&self, cmd: &str) -> Result<String> {
        self.request(&serde_json::json!({ "cmd": cmd }), Duration::from_secs(10))
            .await
    }

    /// Send one request object (`{"cmd":...,...}`); returns the VM state it
    /// reports.
    pub async fn request(&self, body: &serde_json::Value, timeout: Duration) -> Result<String> {
        if let Some(r) = self.exit_reason() {
            return Err(SandboxError::Unavailable(r));
        }
        tokio::time::timeout(timeout, request_at(&self.api, body))
            .await
            .map_err(|_| {
                SandboxError::Timeout(format!(
                    "burrow-vmm did not answer {body} within {}s",
                    timeout.as_secs()
                ))
            })?
    }

    /// Kill it hard and wait (bounded) for it to go.
    pub async fn kill(&mut self) {
        if self.pid != 0 && self.exit_reason().is_none() {
            if let Ok(pid) = i32::try_from(self.pid) {
                // SAFETY: plain kill(2) on our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = tokio::time::timeout(
            Duration::from_secs(5),
            self.exited.wait_for(Option::is_some),
        )
        .await;
    }
}

/// Send `{"cmd":CMD}` to the API socket at `api` and read the reply.
pub async fn command_at(api: &Path, cmd: &str) -> Result<String> {
    request_at(api, &serde_json::json!({ "cmd": cmd })).await
}

/// Send one request object to the API socket at `api` and read the reply.
pub async fn request_at(api: &Path, body: &serde_json::Value) -> Result<String> {
    let cmd = body.get("cmd").and_then(|c| c.as_str()).unwrap_or("?");
    let io = |e: std::io::Error| {
        SandboxError::Unavailable(format!("burrow-vmm API {}: {e}", api.display()))
    };
    let stream = UnixStream::connect(api).await.map_err(io)?;
    let (r, mut w) = stream.into_split();
    w.write_all(format!("{body}\n").as_bytes())
        .await
        .map_err(io)?;
    let mut reader =
        BufReader::new(r).take(u64::try_from(MAX_LINE * (MAX_SKIPPED + 1)).unwrap_or(u64::MAX));
    for _ in 0..=MAX_SKIPPED {
        let mut line = String::new();
        let n = reader.read_line(&mut line).await.map_err(io)?;
        if n == 0 {
            return Err(SandboxError::Unavailable(format!(
                "burrow-vmm API closed before answering {cmd:?}"
            )));
        }
        if line.len() > MAX_LINE {
            return Err(SandboxError::Internal(
                "burrow-vmm API line too long".into(),
            ));
        }
        let reply: Reply = match serde_json::from_str(line.trim()) {
            Ok(r) => r,
            Err(_) => continue,
        };
        match reply.ok {
            None => continue, // an event line
            Some(true) => return Ok(reply.state.unwrap_or_default()),
            Some(false) => {
                return Err(SandboxError::FailedPrecondition(format!(
                    "burrow-vmm refused {cmd:?}: {}",
                    reply.error.unwrap_or_default()
                )))
            }
        }
    }
    Err(SandboxError::Internal(format!(
        "no reply to {cmd:?} from burrow-vmm"
    )))
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
    fn args() {
        let a = VmmArgs {
            binary: "burrow-vmm".into(),
            kernel: "/k".into(),
            initrd: Some("/i".into()),
            cmdline: "console=ttyS0".into(),
            disks: vec![("/d".into(), false), ("/r".into(), true)],
            vsock: "/s/v".into(),
            api: "/s/a".into(),
            serial_log: "/s/c".into(),
            vcpus: 2,
            memory_mib: 256,
            restore: None,
        };
        let v = a.to_args();
        let s = v.join(" ");
        assert!(s.starts_with("run --kernel /k"));
        assert!(s.contains("--disk /d --disk /r:ro"));
        assert!(s.contains("--vcpus 2 --mem 256"));
        assert!(s.contains("--initrd /i"));
        let r = VmmArgs {
            restore: Some("/snap/vm".into()),
            ..a
        };
        assert_eq!(
            r.to_args().join(" "),
            "run --restore /snap/vm --vsock /s/v --api /s/a --serial-log /s/c --disk /d --disk /r"
        );
    }

    #[tokio::test]
    async fn api_skips_events_and_reports_errors() {
        let dir = tempfile::tempdir().expect("tempdir");
        let api = dir.path().join("api.sock");
        let l = tokio::net::UnixListener::bind(&api).expect("bind");
        tokio::spawn(async move {
            for reply in [
                "{\"event\":\"started\"}\n{\"ok\":true,\"state\":\"paused\"}\n",
                "{\"ok\":false,\"error\":\"not running\"}\n",
            ] {
                let (mut s, _) = l.accept().await.expect("accept");
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await;
                s.write_all(reply.as_bytes()).await.expect("write");
            }
        });
        assert_eq!(command_at(&api, "pause").await.expect("pause"), "paused");
        let e = command_at(&api, "resume").await.expect_err("refused");
        assert!(e.to_string().contains("not running"), "{e}");
    }
}
