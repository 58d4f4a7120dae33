//! Terminals for processes: a PTY from the container's own devpts, and
//! the agent's ends of it.

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;

use nix::fcntl::OFlag;
use nix::sys::stat::Mode;

use crate::error::{AgentError, Result};
use crate::process::ParentStdio;

/// The agent's ends of a terminal: master for input, output and resize.
pub(super) fn pty_parent(master: OwnedFd) -> Result<ParentStdio> {
    let dup = |fd: &OwnedFd| {
        fd.try_clone()
            .map_err(|e| AgentError::io("dup the terminal", e))
    };
    Ok(ParentStdio {
        stdin: Some(dup(&master)?),
        stdout: Some(dup(&master)?),
        stderr: None,
        pty: Some(master),
    })
}

/// A terminal for a process whose root is `root`: from that root's own
/// devpts instance (`/dev/pts/ptmx`, mounted `newinstance` by the spec), so
/// that inside the container the terminal is a /dev/pts/N that exists and
/// `tty`/`ttyname` work, as with runc; the agent's devpts otherwise. Both
/// ends close-on-exec (the child dups the slave onto 0-2).
pub(super) fn open_pty(
    root: &Path,
    size: Option<&libc::winsize>,
) -> Result<nix::pty::OpenptyResult> {
    let ptmx = root.join("dev/pts/ptmx");
    if !ptmx.exists() {
        let pty =
            nix::pty::openpty(size, None).map_err(|e| AgentError::os("open a terminal", e))?;
        for fd in [&pty.master, &pty.slave] {
            nix::fcntl::fcntl(
                fd.as_fd(),
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(|e| AgentError::os("set close-on-exec", e))?;
        }
        return Ok(pty);
    }
    let master = nix::fcntl::open(
        &ptmx,
        OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| AgentError::os(format!("open {}", ptmx.display()), e))?;
    let unlock: libc::c_int = 0;
    // SAFETY: ioctls on a terminal master we own, with valid pointers.
    let slave = unsafe {
        if libc::ioctl(master.as_raw_fd(), libc::TIOCSPTLCK, &unlock) < 0 {
            return Err(AgentError::os(
                "unlock the terminal",
                nix::errno::Errno::last(),
            ));
        }
        if let Some(ws) = size {
            libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, ws);
        }
        libc::ioctl(
            master.as_raw_fd(),
            libc::TIOCGPTPEER,
            libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    };
    if slave < 0 {
        return Err(AgentError::os(
            "open the terminal's peer",
            nix::errno::Errno::last(),
        ));
    }
    // SAFETY: TIOCGPTPEER returned a new fd that nothing else owns.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    Ok(nix::pty::OpenptyResult { master, slave })
}
