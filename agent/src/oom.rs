//! Waiting for the kernel's OOM killer without a timer.
//!
//! The kill count lives in `/proc/vmstat`, which cannot be watched. Every
//! OOM kill also writes to the kernel log, so a waiter reads `/dev/kmsg`
//! from its end and re-reads the count after each new record: an idle guest
//! wakes the agent only when its kernel logs something.

use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::process::when_ready;

/// A kernel log reader positioned at the log's end (or, where `/dev/kmsg`
/// cannot be read, a one-second timer).
pub struct KernelLog {
    kmsg: Option<AsyncFd<OwnedFd>>,
}

impl KernelLog {
    /// Open `/dev/kmsg` at its end. Create this before reading the count it
    /// guards, so a kill between the two is not missed.
    pub fn open() -> Self {
        // SAFETY: the OwnedFd moves into the AsyncFd, which owns it for
        // its whole life.
        let watch = |fd| unsafe { AsyncFd::register(fd) }.map_err(std::io::Error::from);
        let kmsg = match open_at_end().and_then(watch) {
            Ok(fd) => Some(fd),
            Err(e) => {
                tracing::warn!("/dev/kmsg: {e}; watching for OOM kills once a second instead");
                None
            }
        };
        KernelLog { kmsg }
    }

    /// Wait until the kernel logs something new.
    pub async fn changed(&mut self) {
        if let Some(kmsg) = &self.kmsg {
            // One record per read; longer ones are cut (EINVAL would mean
            // our buffer is too small, which 8 KiB is not).
            let mut buf = [0u8; 8192];
            match when_ready(kmsg, Interest::READABLE, |fd| {
                nix::unistd::read(fd, &mut buf)
            })
            .await
            {
                Ok(n) if n > 0 => return,
                // EPIPE: records were overwritten before we read them; the
                // next read goes on from the oldest one left. Either way
                // the count is worth reading again.
                Err(e) if e.raw_os_error() == Some(libc::EPIPE) => return,
                _ => {
                    tracing::warn!(
                        "/dev/kmsg stopped; watching for OOM kills once a second instead"
                    );
                    self.kmsg = None;
                }
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

fn open_at_end() -> std::io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/kmsg")?;
    let fd = OwnedFd::from(f);
    nix::unistd::lseek(&fd, 0, nix::unistd::Whence::SeekEnd).map_err(std::io::Error::from)?;
    Ok(fd)
}
