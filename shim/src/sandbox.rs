//! The contract between the containerd-facing task service ([`crate::task`])
//! and whatever actually runs the processes: a burrow microVM
//! ([`crate::vm::VmSandbox`]) in production, an in-process fake in the unit
//! tests.
//!
//! One `Sandbox` is one VM. It can hold several containers (a pod); each
//! container has an init process (exec id "") and exec'd processes.

use std::path::{Path, PathBuf};

use async_trait::async_trait;
use containerd_shim::protos::ttrpc::Code;

/// A rootfs mount as containerd hands it over (`containerd.types.Mount`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootfsMount {
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// Everything the backend needs to create a container.
#[derive(Debug, Clone)]
pub struct ContainerConfig {
    pub id: String,
    /// The bundle directory (holds config.json; `rootfs/` is the mount point).
    pub bundle: PathBuf,
    /// The OCI spec as containerd wrote it (validated JSON, not yet stripped).
    pub spec: serde_json::Value,
    /// The snapshotter's mounts; empty means `bundle/rootfs` is already
    /// populated.
    pub rootfs: Vec<RootfsMount>,
    /// Whether init gets a stdin stream.
    pub stdin: bool,
}

/// An exec'd process.
#[derive(Debug, Clone)]
pub struct ExecConfig {
    /// OCI `process` object (JSON).
    pub process: serde_json::Value,
    pub stdin: bool,
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Code(i32),
    Signal(u32),
}

impl ExitStatus {
    /// The status containerd reports: the exit code, or 128 + the signal.
    pub fn containerd_status(self) -> u32 {
        match self {
            ExitStatus::Code(c) => u32::try_from(c & 0xff).unwrap_or(255),
            ExitStatus::Signal(s) => 128u32.saturating_add(s.min(127)),
        }
    }
}

/// Output stream of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The most bytes one [`Sandbox::read_output`] returns: what a stdio pump
/// holds in memory at once.
pub const OUTPUT_CHUNK: usize = 64 * 1024;

/// One chunk read from a process's output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chunk {
    pub data: Vec<u8>,
    pub eof: bool,
}

/// A process as the backend lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessEntry {
    pub exec_id: String,
    pub pid: u32,
    pub running: bool,
}

/// A container's resource use as its guest counts it (what `Stats`
/// reports): the VM holds one container, so CPU time and memory in use are
/// the guest's; pids are the processes in the container's PID namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxStats {
    pub cpu_usage_usec: u64,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub pids: u64,
    pub oom_kills: u64,
}

/// What the sandbox does once a checkpoint is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCheckpoint {
    /// Run on (the usual case).
    Resume,
    /// Stay paused (it was paused before: containerd pauses around its
    /// checkpoints and resumes afterwards itself).
    StayPaused,
    /// Stop the sandbox: its processes end.
    Exit,
}

/// Errors of a sandbox backend. Each maps to one gRPC code for containerd.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("already exists: {0}")]
    AlreadyExists(String),
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    #[error("not supported: {0}")]
    Unimplemented(String),
    #[error("timed out: {0}")]
    Timeout(String),
    /// Out of disk space (or another resource), e.g. writing a checkpoint.
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    #[error("out of range: {0}")]
    OutOfRange(String),
    /// The VM (or the agent in it) is gone.
    #[error("sandbox unavailable: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl SandboxError {
    /// The gRPC code containerd gets for this error.
    pub fn code(&self) -> Code {
        match self {
            Self::NotFound(_) => Code::NOT_FOUND,
            Self::InvalidArgument(_) => Code::INVALID_ARGUMENT,
            Self::AlreadyExists(_) => Code::ALREADY_EXISTS,
            Self::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            Self::Unimplemented(_) => Code::UNIMPLEMENTED,
            Self::Timeout(_) => Code::DEADLINE_EXCEEDED,
            Self::ResourceExhausted(_) => Code::RESOURCE_EXHAUSTED,
            Self::PermissionDenied(_) => Code::PERMISSION_DENIED,
            Self::OutOfRange(_) => Code::OUT_OF_RANGE,
            Self::Unavailable(_) => Code::UNAVAILABLE,
            Self::Internal(_) => Code::INTERNAL,
        }
    }

    /// The error for a gRPC `code` (as the agent answers), so the code
    /// reaches containerd unchanged; codes without a variant become
    /// [`Internal`](Self::Internal).
    pub fn from_code(code: Code, msg: String) -> Self {
        match code {
            Code::NOT_FOUND => Self::NotFound(msg),
            Code::INVALID_ARGUMENT => Self::InvalidArgument(msg),
            Code::ALREADY_EXISTS => Self::AlreadyExists(msg),
            Code::FAILED_PRECONDITION => Self::FailedPrecondition(msg),
            Code::UNIMPLEMENTED => Self::Unimplemented(msg),
            Code::DEADLINE_EXCEEDED => Self::Timeout(msg),
            Code::RESOURCE_EXHAUSTED => Self::ResourceExhausted(msg),
            Code::PERMISSION_DENIED => Self::PermissionDenied(msg),
            Code::OUT_OF_RANGE => Self::OutOfRange(msg),
            Code::UNAVAILABLE => Self::Unavailable(msg),
            _ => Self::Internal(msg),
        }
    }

    /// A host I/O error `e` while doing `what`: a full disk is
    /// [`ResourceExhausted`](Self::ResourceExhausted), a refused path
    /// [`PermissionDenied`](Self::PermissionDenied), anything else
    /// [`Internal`](Self::Internal).
    pub fn io(what: impl std::fmt::Display, e: &std::io::Error) -> Self {
        let msg = format!("{what}: {e}");
        match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => Self::ResourceExhausted(msg),
            Some(libc::EACCES | libc::EPERM | libc::EROFS) => Self::PermissionDenied(msg),
            _ => Self::Internal(msg),
        }
    }
}

pub type Result<T> = std::result::Result<T, SandboxError>;

/// What runs the containers. All calls may be made concurrently.
#[async_trait]
pub trait Sandbox: Send + Sync + 'static {
    /// Create (but do not start) a container; boots the VM on first use.
    /// Returns the (guest) pid of init.
    async fn create_container(&self, cfg: &ContainerConfig) -> Result<u32>;
    /// Start a created container's init.
    async fn start_container(&self, id: &str) -> Result<()>;
    /// Remove a container whose processes have all exited (or never ran),
    /// releasing its rootfs.
    async fn delete_container(&self, id: &str) -> Result<()>;
    /// Start an exec'd process; returns its pid.
    async fn exec_process(&self, id: &str, exec_id: &str, cfg: &ExecConfig) -> Result<u32>;
    /// Forget an exited exec'd process.
    async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()>;
    /// Send a signal to a process (`all`: to every process of the container).
    async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()>;
    /// Wait until a started process exits. Fails if the sandbox dies.
    async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus>;
    /// Read the next chunk of a process's output, at most
    /// [`OUTPUT_CHUNK`] bytes (waits for data).
    async fn read_output(&self, id: &str, exec_id: &str, stream: Stream) -> Result<Chunk>;
    /// Write to a process's stdin; returns how much was accepted.
    async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize>;
    /// Close a process's stdin.
    async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()>;
    /// Resize a process's terminal.
    async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()>;
    /// The processes of a container.
    async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>>;
    /// Wait until the OOM killer has killed more than `seen` processes of
    /// container `id` in all; returns that total. Fails when the sandbox
    /// or the container is gone.
    async fn wait_oom(&self, id: &str, seen: u64) -> Result<u64>;
    /// How many processes of container `id` the OOM killer has killed so
    /// far (a restored guest remembers the kills from before its checkpoint).
    async fn oom_kills(&self, id: &str) -> Result<u64>;
    /// New resource limits (OCI `linux.resources`, JSON) for container `id`.
    async fn update_resources(&self, id: &str, resources: &[u8]) -> Result<()> {
        let _ = (id, resources);
        Err(SandboxError::Unimplemented(
            "this sandbox cannot update resources".into(),
        ))
    }
    /// Freeze the whole sandbox (all vCPUs).
    async fn pause(&self) -> Result<()>;
    /// Thaw it.
    async fn resume(&self) -> Result<()>;
    /// Container `id`'s resource use, as its guest counts it.
    async fn stats(&self, id: &str) -> Result<SandboxStats>;
    /// Stop the VM and remove everything it left on the host. Idempotent.
    async fn shutdown(&self) -> Result<()>;
    /// Write a checkpoint of the whole sandbox into `dir`.
    async fn checkpoint(&self, dir: &Path, after: AfterCheckpoint) -> Result<()> {
        let _ = (dir, after);
        Err(SandboxError::Unimplemented(
            "this sandbox cannot be checkpointed".into(),
        ))
    }
    /// Create a container by restoring the checkpoint in `dir`: its
    /// processes are running already (Start only attaches to them).
    /// Returns the pid of init.
    async fn restore_container(&self, cfg: &ContainerConfig, dir: &Path) -> Result<u32> {
        let _ = (cfg, dir);
        Err(SandboxError::Unimplemented(
            "this sandbox cannot restore checkpoints".into(),
        ))
    }
    /// A container of a restored CRI pod whose name the pod's checkpoint
    /// has: take that running container over (as a restore does) and
    /// return the pid of its init; None when none waits for it (create it).
    async fn take_over_restored(&self, cfg: &ContainerConfig) -> Result<Option<u32>> {
        let _ = cfg;
        Ok(None)
    }
    /// The directory of the named checkpoint `name` (written by `burrow
    /// sandbox checkpoint`), refusing names that are not plain.
    fn named_checkpoint(&self, name: &str) -> Result<std::path::PathBuf> {
        let _ = name;
        Err(SandboxError::Unimplemented(
            "this sandbox has no named checkpoints".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_keeps_its_code_both_ways() {
        let all = [
            SandboxError::NotFound(String::new()),
            SandboxError::InvalidArgument(String::new()),
            SandboxError::AlreadyExists(String::new()),
            SandboxError::FailedPrecondition(String::new()),
            SandboxError::Unimplemented(String::new()),
            SandboxError::Timeout(String::new()),
            SandboxError::ResourceExhausted(String::new()),
            SandboxError::PermissionDenied(String::new()),
            SandboxError::OutOfRange(String::new()),
            SandboxError::Unavailable(String::new()),
            SandboxError::Internal(String::new()),
        ];
        for e in all {
            let code = e.code();
            assert_eq!(
                SandboxError::from_code(code, "m".into()).code(),
                code,
                "{e:?}"
            );
        }
        // What the agent answers reaches containerd with the same code.
        for code in [
            Code::PERMISSION_DENIED,
            Code::OUT_OF_RANGE,
            Code::RESOURCE_EXHAUSTED,
        ] {
            assert_eq!(
                SandboxError::from_code(code, "agent kill: m".into()).code(),
                code
            );
        }
        assert_eq!(
            SandboxError::from_code(Code::DATA_LOSS, "m".into()).code(),
            Code::INTERNAL
        );
    }

    #[test]
    fn host_io_errors() {
        let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let e = SandboxError::io("writing /c/rootfs.img", &full);
        assert_eq!(e.code(), Code::RESOURCE_EXHAUSTED);
        assert!(e.to_string().contains("writing /c/rootfs.img"), "{e}");
        let denied = std::io::Error::from_raw_os_error(libc::EACCES);
        assert_eq!(
            SandboxError::io("x", &denied).code(),
            Code::PERMISSION_DENIED
        );
        let other = std::io::Error::from_raw_os_error(libc::EIO);
        assert_eq!(SandboxError::io("x", &other).code(), Code::INTERNAL);
    }
}
