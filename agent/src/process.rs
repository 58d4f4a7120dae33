//! A running process as the agent sees it: its pid, exit status and stdio.
//!
//! Stdio is never buffered in the agent. Each stream is the parent end of
//! a pipe (or the PTY master); `ReadStdout` reads at most one chunk from it
//! when the shim asks, and `WriteStdin` writes what the pipe accepts and
//! says how much. A process printing faster than the shim reads simply
//! blocks on its full pipe: the kernel's pipe buffer is the only buffer.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Mutex as StdMutex;

use nix::errno::Errno;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{watch, Mutex};

use crate::error::{AgentError, Result};
use crate::spawn::{ExitStatus, Gate};

/// One direction of a process's stdio.
#[derive(Debug)]
pub struct Stream {
    fd: Mutex<Option<AsyncFd<OwnedFd>>>,
}

impl Stream {
    pub fn new(fd: Option<OwnedFd>) -> Result<Self> {
        let fd = match fd {
            Some(fd) => {
                set_nonblocking(&fd)?;
                // SAFETY: the OwnedFd moves into the AsyncFd, so the fd stays
                // open and the same for the AsyncFd's whole life.
                let watched = unsafe { AsyncFd::register(fd) };
                Some(
                    watched
                        .map_err(|e| AgentError::io("watch a stdio fd", std::io::Error::from(e)))?,
                )
            }
            None => None,
        };
        Ok(Stream { fd: Mutex::new(fd) })
    }

    /// Read up to `max` bytes, waiting for data. `Ok(None)` is end of file.
    pub async fn read(&self, max: usize) -> Result<Option<Vec<u8>>> {
        let mut slot = self.fd.lock().await;
        let Some(fd) = slot.as_ref() else {
            return Ok(None);
        };
        let mut buf = vec![0u8; max];
        match when_ready(fd, Interest::READABLE, |fd| nix::unistd::read(fd, &mut buf)).await {
            Ok(0) => {}
            Ok(n) => {
                buf.truncate(n);
                return Ok(Some(buf));
            }
            // A PTY master answers EIO once the terminal's last user closed it.
            Err(e) if e.raw_os_error() == Some(libc::EIO) => {}
            Err(e) => return Err(AgentError::io("read output", e)),
        }
        *slot = None;
        Ok(None)
    }

    /// Write what the pipe takes now (at least one byte, waiting for room).
    pub async fn write(&self, data: &[u8]) -> Result<usize> {
        let slot = self.fd.lock().await;
        let Some(fd) = slot.as_ref() else {
            return Err(AgentError::FailedPrecondition(
                "stdin is closed (or the process was started without stdin)".into(),
            ));
        };
        if data.is_empty() {
            return Ok(0);
        }
        match when_ready(fd, Interest::WRITABLE, |fd| nix::unistd::write(fd, data)).await {
            Ok(n) => Ok(n),
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => Err(AgentError::FailedPrecondition(
                "the process closed its stdin".into(),
            )),
            Err(e) => Err(AgentError::io("write stdin", e)),
        }
    }

    /// Close our end (the process sees EOF on a pipe).
    pub async fn close(&self) {
        *self.fd.lock().await = None;
    }
}

/// Run `op` on `fd` once it is ready for `interest`, again while it would
/// block or is interrupted.
pub(crate) async fn when_ready<R>(
    fd: &AsyncFd<OwnedFd>,
    interest: Interest,
    mut op: impl FnMut(&OwnedFd) -> nix::Result<R>,
) -> std::io::Result<R> {
    fd.async_io(interest, |inner| loop {
        match op(inner) {
            Err(Errno::EINTR) => {}
            r => return r.map_err(std::io::Error::from),
        }
    })
    .await
}

fn set_nonblocking(fd: &OwnedFd) -> Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = fcntl(fd.as_fd(), FcntlArg::F_GETFL).map_err(|e| AgentError::os("F_GETFL", e))?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(fd.as_fd(), FcntlArg::F_SETFL(flags)).map_err(|e| AgentError::os("F_SETFL", e))?;
    Ok(())
}

/// A process started by the agent.
#[derive(Debug)]
pub struct Process {
    pub exec_id: String,
    pub pid: i32,
    exit: watch::Receiver<Option<ExitStatus>>,
    pub stdin: Stream,
    pub stdout: Stream,
    pub stderr: Stream,
    /// PTY master, for resizing (None without a terminal).
    pty: Option<OwnedFd>,
    /// Held before exec until started (container init only).
    gate: StdMutex<Option<Gate>>,
}

/// The agent's ends of a new process's stdio.
pub struct ParentStdio {
    pub stdin: Option<OwnedFd>,
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    pub pty: Option<OwnedFd>,
}

impl Process {
    pub fn new(
        exec_id: String,
        pid: i32,
        exit: watch::Receiver<Option<ExitStatus>>,
        stdio: ParentStdio,
        gate: Option<Gate>,
    ) -> Result<Self> {
        Ok(Process {
            exec_id,
            pid,
            exit,
            stdin: Stream::new(stdio.stdin)?,
            stdout: Stream::new(stdio.stdout)?,
            stderr: Stream::new(stdio.stderr)?,
            pty: stdio.pty,
            gate: StdMutex::new(gate),
        })
    }

    pub fn exit_status(&self) -> Option<ExitStatus> {
        *self.exit.borrow()
    }

    pub fn running(&self) -> bool {
        self.exit_status().is_none()
    }

    /// Wait for the process to end.
    pub async fn wait(&self) -> Result<ExitStatus> {
        let mut rx = self.exit.clone();
        let status = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| AgentError::Internal("lost track of the process".into()))?;
        (*status).ok_or_else(|| AgentError::Internal("lost track of the process".into()))
    }

    /// Take the start gate (present until the process is started).
    pub fn take_gate(&self) -> Option<Gate> {
        self.gate.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Send `signal`; no-op error if it already ended.
    pub fn signal(&self, signal: i32) -> Result<()> {
        if !self.running() {
            return Err(AgentError::NotFound(format!(
                "process {:?} (pid {}) has already exited",
                self.exec_id, self.pid
            )));
        }
        // SAFETY: plain kill(2).
        let rc = unsafe { libc::kill(self.pid, signal) };
        if rc < 0 {
            return Err(AgentError::os(
                format!("signal pid {}", self.pid),
                Errno::last(),
            ));
        }
        Ok(())
    }

    pub fn resize(&self, rows: u16, cols: u16) -> Result<()> {
        let Some(pty) = &self.pty else {
            return Err(AgentError::FailedPrecondition(format!(
                "process {:?} has no terminal to resize",
                self.exec_id
            )));
        };
        let ws = libc::winsize {
            ws_row: rows,
            ws_col: cols,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads a winsize from our stack.
        let rc = unsafe { libc::ioctl(pty.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if rc < 0 {
            return Err(AgentError::os("resize the terminal", Errno::last()));
        }
        Ok(())
    }
}
