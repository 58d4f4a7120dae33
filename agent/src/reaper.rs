//! Reaping children: every exit (ours and orphans re-parented to PID 1 or
//! to the agent as subreaper) is collected with `waitpid(-1)`; exits of
//! processes we started are handed to their waiters.

use nix::errno::Errno;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use tokio::signal::unix::{signal, SignalKind};

use crate::spawn::{ExitStatus, CHILDREN};

/// Start watching SIGCHLD. Call before the first child is forked.
pub fn start() -> anyhow::Result<()> {
    let mut sigchld = signal(SignalKind::child())?;
    tokio::spawn(async move {
        loop {
            reap_all();
            if sigchld.recv().await.is_none() {
                tracing::error!("SIGCHLD stream ended; children will no longer be reaped");
                return;
            }
        }
    });
    Ok(())
}

fn reap_all() {
    loop {
        let (pid, status) = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => (pid, ExitStatus { code, signal: 0 }),
            Ok(WaitStatus::Signaled(pid, sig, _)) => {
                let signal = sig as i32;
                (
                    pid,
                    ExitStatus {
                        code: 128 + signal,
                        signal: u32::try_from(signal).unwrap_or(0),
                    },
                )
            }
            Ok(WaitStatus::StillAlive) | Err(Errno::ECHILD) => return,
            Ok(_) => continue,
            Err(Errno::EINTR) => continue,
            Err(e) => {
                tracing::warn!("waitpid failed: {e}");
                return;
            }
        };
        let tx = CHILDREN
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pid.as_raw());
        match tx {
            Some(tx) => {
                tracing::debug!(pid = pid.as_raw(), ?status, "process exited");
                tx.send_replace(Some(status));
            }
            None => tracing::debug!(pid = pid.as_raw(), ?status, "reaped an orphan"),
        }
    }
}
