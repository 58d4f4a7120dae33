//! Errors the agent returns over ttrpc, each with a gRPC status code.

use burrow_protocol::ttrpc;

/// An error answered to the shim. The variant picks the status code; the
/// message says what went wrong in words a person can act on.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("{0}")]
    Internal(String),
}

pub type Result<T> = std::result::Result<T, AgentError>;

impl AgentError {
    /// An OS error while doing `what`; ENOENT becomes NotFound and so on.
    pub fn os(what: impl std::fmt::Display, err: nix::errno::Errno) -> Self {
        use nix::errno::Errno;
        let msg = format!("{what}: {}", err.desc());
        match err {
            Errno::ENOENT | Errno::ESRCH => AgentError::NotFound(msg),
            Errno::EEXIST => AgentError::AlreadyExists(msg),
            Errno::EACCES | Errno::EPERM => AgentError::PermissionDenied(msg),
            Errno::EXDEV | Errno::ELOOP => {
                AgentError::PermissionDenied(format!("{msg} (path escapes the container root)"))
            }
            Errno::EINVAL
            | Errno::ENOTDIR
            | Errno::EISDIR
            | Errno::ENAMETOOLONG
            | Errno::ENOTEMPTY => AgentError::InvalidArgument(msg),
            _ => AgentError::Internal(msg),
        }
    }

    /// Same as [`AgentError::os`] for a `std::io::Error`.
    pub fn io(what: impl std::fmt::Display, err: std::io::Error) -> Self {
        match err.raw_os_error() {
            Some(code) => Self::os(what, nix::errno::Errno::from_raw(code)),
            None => AgentError::Internal(format!("{what}: {err}")),
        }
    }

    fn code(&self) -> ttrpc::Code {
        match self {
            AgentError::NotFound(_) => ttrpc::Code::NOT_FOUND,
            AgentError::InvalidArgument(_) => ttrpc::Code::INVALID_ARGUMENT,
            AgentError::AlreadyExists(_) => ttrpc::Code::ALREADY_EXISTS,
            AgentError::FailedPrecondition(_) => ttrpc::Code::FAILED_PRECONDITION,
            AgentError::PermissionDenied(_) => ttrpc::Code::PERMISSION_DENIED,
            AgentError::DeadlineExceeded(_) => ttrpc::Code::DEADLINE_EXCEEDED,
            AgentError::OutOfRange(_) => ttrpc::Code::OUT_OF_RANGE,
            AgentError::Internal(_) => ttrpc::Code::INTERNAL,
        }
    }
}

impl From<AgentError> for ttrpc::Error {
    fn from(e: AgentError) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
    }
}

/// Shorthand for an InvalidArgument error.
pub fn invalid(msg: impl Into<String>) -> AgentError {
    AgentError::InvalidArgument(msg.into())
}
