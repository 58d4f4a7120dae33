//! Errors as the VMM reports them: a kind the caller can act on (the shim
//! maps it to a gRPC code for containerd) and a message for people.
//!
//! They travel in a control API [`Response`](crate::Response), and, when
//! the VMM could not build (or restore) the VM at all, as its last line on
//! stderr: [`FAILURE_PREFIX`] followed by the error as JSON (see
//! [`ApiError::failure_line`] and [`ApiError::from_failure_line`]).

use serde::{Deserialize, Serialize};

/// What kind of failure; stable on the wire (snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request (or command line) is malformed or names something
    /// unusable: a bad line, a disk whose size differs from the snapshot's.
    InvalidRequest,
    /// The VM is not in a state that allows it (resume an exited VM, an
    /// incremental snapshot without a base).
    InvalidState,
    /// A file or directory the request names does not exist.
    NotFound,
    /// The file system is full (ENOSPC, EDQUOT).
    NoSpace,
    /// The VMM may not read or write a path (EACCES, EPERM, EROFS).
    PermissionDenied,
    /// A snapshot that fails its checks (checksum, bounds, version).
    Corrupt,
    /// The VM has something this operation does not support.
    Unsupported,
    /// vCPUs or devices did not respond in time.
    Timeout,
    /// Another I/O error.
    Io,
    /// A failure of the VMM or KVM itself.
    Internal,
}

/// An error with its kind.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
}

/// Start of the VMM's last stderr line when it exits because it could not
/// build or restore the VM (exit status 2).
pub const FAILURE_PREFIX: &str = "burrow-vmm failure: ";

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// An I/O error `e` while doing `what` (for example "writing
    /// /s/memory"), its kind from the errno.
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> Self {
        Self::new(io_kind(e), format!("{what}: {e}"))
    }

    /// The same error with `context` in front of its message.
    pub fn context(self, context: impl std::fmt::Display) -> Self {
        Self {
            kind: self.kind,
            message: format!("{context}: {}", self.message),
        }
    }

    /// The stderr line (without newline) that reports this error as the
    /// reason the VMM exits.
    pub fn failure_line(&self) -> String {
        format!(
            "{FAILURE_PREFIX}{}",
            serde_json::to_string(self).unwrap_or_default()
        )
    }

    /// The error of a [`failure_line`](Self::failure_line), if `line` is one.
    pub fn from_failure_line(line: &str) -> Option<Self> {
        serde_json::from_str(line.trim().strip_prefix(FAILURE_PREFIX)?).ok()
    }
}

/// The kind of an I/O error.
pub fn io_kind(e: &std::io::Error) -> ErrorKind {
    match e.raw_os_error() {
        Some(libc::ENOSPC | libc::EDQUOT) => ErrorKind::NoSpace,
        Some(libc::ENOENT | libc::ENOTDIR) => ErrorKind::NotFound,
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => ErrorKind::PermissionDenied,
        _ => match e.kind() {
            std::io::ErrorKind::NotFound => ErrorKind::NotFound,
            std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            std::io::ErrorKind::TimedOut => ErrorKind::Timeout,
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof => {
                ErrorKind::Corrupt
            }
            _ => ErrorKind::Io,
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_get_their_kind() {
        let e = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let a = ApiError::io("writing /s/memory", &e);
        assert_eq!(a.kind, ErrorKind::NoSpace);
        assert!(a.message.starts_with("writing /s/memory: "), "{a}");
        assert_eq!(
            io_kind(&std::io::Error::from_raw_os_error(libc::EDQUOT)),
            ErrorKind::NoSpace
        );
        assert_eq!(
            io_kind(&std::io::Error::from_raw_os_error(libc::ENOENT)),
            ErrorKind::NotFound
        );
        assert_eq!(
            io_kind(&std::io::Error::from_raw_os_error(libc::EROFS)),
            ErrorKind::PermissionDenied
        );
        assert_eq!(
            io_kind(&std::io::Error::from_raw_os_error(libc::EIO)),
            ErrorKind::Io
        );
        let bad = std::io::Error::new(std::io::ErrorKind::InvalidData, "checksum");
        assert_eq!(io_kind(&bad), ErrorKind::Corrupt);
    }

    #[test]
    fn wire_form() {
        let e = ApiError::new(ErrorKind::NoSpace, "disk full");
        assert_eq!(
            serde_json::to_string(&e).unwrap(),
            r#"{"kind":"no_space","message":"disk full"}"#
        );
        let line = e.clone().context("snapshot").failure_line();
        assert!(line.starts_with(FAILURE_PREFIX));
        assert_eq!(
            ApiError::from_failure_line(&format!("{line}\n")),
            Some(ApiError::new(ErrorKind::NoSpace, "snapshot: disk full"))
        );
        assert_eq!(
            ApiError::from_failure_line("burrow-vmm: guest powered off"),
            None
        );
        assert_eq!(
            ApiError::from_failure_line(&format!("{FAILURE_PREFIX}{{")),
            None
        );
    }
}
