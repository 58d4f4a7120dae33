//! Deadlines of the vsock connections that wait on the other side (issue
//! 15): a host connection that never sends its CONNECT line, a host CONNECT
//! the guest never answers, a connection the host closed whose RST from the
//! guest never comes. Each holds a slot of the bounded connection table
//! (and a host socket), so a silent guest or a host client that connects
//! and waits could fill it; past its deadline the muxer drops it.
//!
//! One timerfd, in the muxer's epoll, armed for the earliest deadline only
//! while there is one: an idle VM has no timer (issue 16).

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::timerfd::TimerFd;

/// How long a connection may wait on its peer (Firecracker uses 2 s for
/// both a connect and a shutdown).
pub const WAIT_LIMIT: Duration = Duration::from_secs(2);

pub(crate) struct Expiry {
    timer: TimerFd,
    /// When the timer fires, if armed.
    armed: Option<Instant>,
    pub limit: Duration,
}

impl Expiry {
    pub fn new() -> std::io::Result<Self> {
        let timer = TimerFd::new()?;
        // A stale readiness must not block the event loop in read().
        // SAFETY: fcntl on a descriptor this struct owns.
        let flags = unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(timer.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { timer, armed: None, limit: WAIT_LIMIT })
    }

    pub fn fd(&self) -> RawFd {
        self.timer.as_raw_fd()
    }

    /// A new deadline, `limit` from now; the timer fires no later.
    pub fn deadline(&mut self) -> Instant {
        let at = Instant::now() + self.limit;
        self.arm(Some(at));
        at
    }

    /// The timer fired: consume it (it is re-armed by [`Self::arm`]).
    pub fn fired(&mut self) {
        let _ = self.timer.wait();
        self.armed = None;
    }

    /// Make the timer fire at `next` (the earliest deadline left) if that
    /// is sooner than it would, or stop it when there is none.
    pub fn arm(&mut self, next: Option<Instant>) {
        let Some(at) = next else {
            if self.armed.take().is_some() {
                let _ = self.timer.clear();
            }
            return;
        };
        if self.armed.is_some_and(|armed| armed <= at) {
            return;
        }
        // A zero duration would disarm it: at least a nanosecond.
        let after = at.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1));
        match self.timer.reset(after, None) {
            Ok(()) => self.armed = Some(at),
            Err(e) => tracing::warn!("vsock: arming the expiry timer: {e}"),
        }
    }

    /// Re-arm for exactly `next` after a sweep (the earliest deadline left).
    pub fn rearm(&mut self, next: Option<Instant>) {
        self.armed = None;
        let _ = self.timer.clear();
        self.arm(next);
    }
}
