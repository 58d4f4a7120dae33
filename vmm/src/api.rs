//! Control API server side: the connected clients of the unix socket
//! given with `--api`. The messages (requests, responses, events; JSON
//! lines) are defined in `burrow-vmm-api` ([`burrow_vmm_api::messages`]),
//! which the shim links too.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::os::fd::FromRawFd;
use std::os::unix::net::UnixStream;

use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use serde::Serialize;

pub use burrow_vmm_api::{
    ApiError, Command, ErrorKind as ApiErrorKind, Event, Request, Response, SnapshotInfo, VmState,
    MAX_LINE,
};

/// The kind of one error of a failed build or restore, if it is one whose
/// kind is known (the caller walks the chain of causes).
pub fn failure_kind(e: &(dyn std::error::Error + 'static)) -> Option<ApiErrorKind> {
    use crate::snapshot::format::SnapshotError as S;
    use crate::snapshot::microvm::RestoreError as R;
    use crate::vmm::VmmError as V;
    use burrow_vmm_api::error::io_kind;
    if let Some(e) = e.downcast_ref::<S>() {
        return Some(match e {
            S::Io { source, .. } => io_kind(source),
            S::UnsupportedVersion { .. } => ApiErrorKind::Unsupported,
            S::Encode(_) => ApiErrorKind::Internal,
            _ => ApiErrorKind::Corrupt,
        });
    }
    if let Some(e) = e.downcast_ref::<R>() {
        return match e {
            R::State(s) => failure_kind(s),
            R::Invalid(_) => Some(ApiErrorKind::Corrupt),
            R::Io { source, .. } => Some(io_kind(source)),
            R::Map(_) => Some(ApiErrorKind::Internal),
        };
    }
    if let Some(e) = e.downcast_ref::<V>() {
        return match e {
            V::Io(_, source) => Some(io_kind(source)),
            V::Config(_) | V::Restore(_) => Some(ApiErrorKind::InvalidRequest),
            V::Kvm(_) | V::Ioctl(..) | V::Memory(_) => Some(ApiErrorKind::Internal),
            // Boot, device and register errors: look at their causes.
            _ => None,
        };
    }
    e.downcast_ref::<std::io::Error>().map(io_kind)
}

/// Most files one client may have passed and not yet used.
pub const MAX_PASSED_FILES: usize = 2;

/// One connected API client.
pub struct Client {
    pub stream: UnixStream,
    buf: Vec<u8>,
    /// Files it passed (`SCM_RIGHTS`, for a snapshot), oldest first; past
    /// [`MAX_PASSED_FILES`] more are closed.
    pub files: Vec<File>,
}

impl Client {
    pub fn new(stream: UnixStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self {
            stream,
            buf: Vec::new(),
            files: Vec::new(),
        })
    }

    /// Read what is available; returns complete lines, or None when the
    /// client is gone or misbehaved.
    pub fn read_lines(&mut self) -> Option<Vec<Vec<u8>>> {
        let mut chunk = [0u8; 1024];
        loop {
            match self.recv(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(chunk.get(..n)?),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
            if self.buf.len() > MAX_LINE * 4 {
                break;
            }
        }
        let mut lines = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            lines.push(line.get(..nl).map(<[u8]>::to_vec).unwrap_or_default());
        }
        if self.buf.len() > MAX_LINE {
            return None;
        }
        Some(lines)
    }

    /// Read what the socket has, keeping the files passed with it.
    fn recv(&mut self, chunk: &mut [u8]) -> std::io::Result<usize> {
        let mut iov = [libc::iovec {
            iov_base: chunk.as_mut_ptr().cast(),
            iov_len: chunk.len(),
        }];
        let mut fds = [-1; MAX_PASSED_FILES];
        // SAFETY: the iovec points into `chunk`, which recvmsg may fill.
        let (n, nfds) = unsafe { self.stream.recv_with_fds(&mut iov, &mut fds) }
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()))?;
        for &fd in fds.iter().take(nfds) {
            // SAFETY: recvmsg just installed `fd`; nothing else owns it.
            let f = unsafe { File::from_raw_fd(fd) };
            if self.files.len() < MAX_PASSED_FILES {
                self.files.push(f);
            }
        }
        Ok(n)
    }

    /// Send one JSON line (small; a client that cannot take it is dropped).
    pub fn send<T: Serialize>(&mut self, msg: &T) -> bool {
        let line = burrow_vmm_api::to_line(msg);
        self.stream.set_nonblocking(false).is_ok()
            && self
                .stream
                .set_write_timeout(Some(std::time::Duration::from_secs(1)))
                .is_ok()
            && self.stream.write_all(&line).is_ok()
            && self.stream.set_nonblocking(true).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_kinds() {
        use crate::snapshot::format::SnapshotError;
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let e = SnapshotError::Io {
            path: "/s/state".into(),
            source: full,
        };
        assert_eq!(failure_kind(&e), Some(ApiErrorKind::NoSpace));
        let e = SnapshotError::Checksum {
            stored: 1,
            computed: 2,
        };
        assert_eq!(failure_kind(&e), Some(ApiErrorKind::Corrupt));
        let e = crate::snapshot::microvm::RestoreError::State(e);
        assert_eq!(failure_kind(&e), Some(ApiErrorKind::Corrupt));
        let e = crate::vmm::VmmError::Restore("disk /d is 1 bytes".into());
        assert_eq!(failure_kind(&e), Some(ApiErrorKind::InvalidRequest));
        let missing = std::io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(failure_kind(&missing), Some(ApiErrorKind::NotFound));
        assert_eq!(failure_kind(&std::fmt::Error), None);
    }

    #[test]
    fn client_lines_and_limits() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut c = Client::new(a).unwrap();
        b.write_all(b"{\"cmd\":\"status\"}\n{\"cmd\":").unwrap();
        let lines = c.read_lines().unwrap();
        assert_eq!(lines, vec![b"{\"cmd\":\"status\"}".to_vec()]);
        b.write_all(&vec![b'x'; MAX_LINE + 10]).unwrap();
        assert!(c.read_lines().is_none(), "over-long line drops the client");
    }

    /// Random control-API traffic (valid commands, damaged ones, noise,
    /// long lines): lines are bounded and every one parses or is refused.
    #[test]
    fn random_api_lines_never_panic() {
        use burrow_vmm_api::Request;
        let mut rng = fastrand::Rng::with_seed(0x5eed_001a);
        let valid: [&[u8]; 6] = [
            br#"{"cmd":"status"}"#,
            br#"{"cmd":"pause"}"#,
            br#"{"cmd":"snapshot","dir":"/s","incremental":true}"#,
            br#"{"cmd":"attach_disk","slot":4294967295,"path":"/x","read_only":false}"#,
            br#"{"cmd":"detach_disk","slot":1}"#,
            br#"{"cmd":"stop"}"#,
        ];
        let (mut parsed, mut refused) = (0, 0);
        for _ in 0..300 {
            let (a, mut b) = UnixStream::pair().unwrap();
            let mut c = Client::new(a).unwrap();
            for _ in 0..20 {
                let mut msg = match rng.u8(0..4) {
                    0 => (0..rng.usize(0..200)).map(|_| rng.u8(..)).collect(),
                    1 => vec![b'{'; rng.usize(0..MAX_LINE / 2)],
                    _ => valid[rng.usize(0..valid.len())].to_vec(),
                };
                if !msg.is_empty() && rng.bool() {
                    let at = rng.usize(0..msg.len());
                    msg[at] = rng.u8(..);
                }
                msg.push(b'\n');
                b.write_all(&msg).unwrap();
                let Some(lines) = c.read_lines() else {
                    break;
                };
                for line in lines {
                    assert!(line.len() <= MAX_LINE * 5, "a line of {} bytes", line.len());
                    match Request::parse(&line) {
                        Ok(_) => parsed += 1,
                        Err(_) => refused += 1,
                    }
                }
            }
        }
        assert!(parsed > 0 && refused > 0, "{parsed} parsed, {refused} refused");
    }
}
