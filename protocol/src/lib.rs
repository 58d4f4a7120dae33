//! The protocol between burrow's shim (host) and `burrow-agent` (guest PID 1).
//!
//! The service is defined in `proto/agent.proto` and compiled at build time
//! with ttrpc-codegen's pure-Rust parser (no `protoc`). Both sides use the
//! ttrpc (0.9, async) and protobuf (3.7) versions that `containerd-shim`
//! 0.11 uses; they are re-exported here so the shim and the agent cannot
//! drift apart.
//!
//! # Connecting (host side)
//!
//! Connect to the VMM's vsock unix socket, write `CONNECT 1024\n`
//! ([`AGENT_VSOCK_PORT`]), read the `OK <n>\n` line byte by byte, then:
//!
//! ```ignore
//! stream.set_nonblocking(true)?;
//! let stream = tokio::net::UnixStream::from_std(stream)?;
//! let client = ttrpc::r#async::Client::new(ttrpc::r#async::transport::Socket::new(stream));
//! let agent = burrow_protocol::AgentClient::new(client);
//! agent.health(ttrpc::context::with_duration(timeout), &HealthRequest::new()).await?;
//! ```
//!
//! # Lifecycle, as containerd's task API maps onto it
//!
//! - Create → `CreateContainer{container_id, oci_spec (config.json bytes),
//!   rootfs{source: "/dev/vdX", fstype: "ext4", options, writable_overlay},
//!   stdin}`: mounts the root and the spec's mounts and forks the init,
//!   held before exec; returns its guest pid.
//! - Start → `StartContainer`: the init execs (an exec failure such as a
//!   missing binary is reported here, NOT_FOUND).
//! - Exec → `ExecProcess{container_id, exec_id, oci_process (the task API's
//!   process spec JSON), stdin}`: starts at once in the init's namespaces.
//! - Stdio: one pump per stream calling `ReadStdout`/`ReadStderr` in a loop
//!   (each returns one chunk of at most `max_bytes` ≤ [`MAX_CHUNK`], or
//!   `eof`); `WriteStdin` returns how many bytes the pipe took (write the
//!   rest next); `CloseStdin` when the FIFO closes. With a terminal
//!   (`process.terminal`), stdout carries the PTY and stderr is at EOF at
//!   once; `ResizePty` resizes it. Nothing is buffered in the agent: if
//!   nobody reads, the process blocks on its pipe.
//! - Wait → `WaitProcess` (blocks; `exit_code` is 128+signal when `signal`
//!   is non-zero). Kill → `SignalProcess` (`all` for every process of the
//!   container). Pids → `ListProcesses`. Stats → `ContainerStats`. Delete (exec) → `DeleteProcess`
//!   after it exited; Delete (init) → `DeleteContainer`, which kills what is
//!   left and unmounts everything.
//! - exec_id "" is the init; container_id "" is the guest itself (handy for
//!   diagnostics: exec a shell in the VM, read `/proc/1/status`).
//! - After a snapshot restore: reconnect, then `SetTime` and `AddEntropy`.
//!   `PowerOff` answers, then powers the VM off 100 ms later.
//! - A pod's VM that grows: once burrow-vmm lets more vCPUs run
//!   (`set_vcpus`), `OnlineCpus{count}` brings CPUs `0..count` online
//!   through sysfs, takes those past them offline, and answers how many
//!   are online (INVALID_ARGUMENT past the present ones). A VM that
//!   shrinks takes them offline first, then burrow-vmm holds them.
//!
//! # Detached sessions
//!
//! `StartSession{container_id, oci_process, timeout_secs}` starts a process
//! like `ExecProcess` whose stdout and stderr the agent itself drains into
//! one ring of the last [`MAX_SESSION_BUFFER`] bytes; `ReadSession{
//! session_id, offset, wait_ms}` answers the output from `offset` (or from
//! the oldest byte kept, with `dropped` saying how much is gone), where it
//! ends, and the exit status once done. The ring is guest memory, so a
//! session survives hibernation and checkpoint/restore with its VM; the
//! host keeps nothing per session. At most [`MAX_SESSIONS`] per guest.
//!
//! # Browser
//!
//! `BrowserNavigate`, `BrowserScreenshot`, `BrowserText`, `BrowserClick`,
//! `BrowserType` drive one headless Chromium page in the guest, started on
//! the first call from the browser image (`rootfs/browser-image`, attached
//! as a virtio-blk disk and named on the kernel command line with
//! `burrow.browser=/dev/vdX`); `BrowserClose` stops it. Give the guest at
//! least 1 GiB. Chromium sees the guest's files read-only under `/guest`.
//! Errors: FAILED_PRECONDITION (no browser image, Chromium failed to start
//! or died), NOT_FOUND (no element matches the selector), INVALID_ARGUMENT
//! (bad URL or selector), DEADLINE_EXCEEDED (no load event in time),
//! OUT_OF_RANGE (screenshot over [`MAX_SCREENSHOT_BYTES`]).
//!
//! Errors are ttrpc status errors: NOT_FOUND (no such container, process,
//! file), INVALID_ARGUMENT (bad spec, bad id, oversized field),
//! ALREADY_EXISTS, FAILED_PRECONDITION (not running, already started,
//! stdin closed, mount failed), PERMISSION_DENIED, INTERNAL.

pub mod net;

pub use protobuf;
pub use ttrpc;

/// Generated protobuf messages (`burrow.agent.v1`).
#[allow(clippy::all, warnings, missing_docs)]
pub mod agent {
    include!(concat!(env!("OUT_DIR"), "/gen/agent.rs"));
}

/// Generated async ttrpc client and server glue.
#[allow(clippy::all, warnings, missing_docs)]
pub mod agent_ttrpc {
    include!(concat!(env!("OUT_DIR"), "/gen/agent_ttrpc.rs"));
}

pub use agent_ttrpc::{create_agent, Agent, AgentClient};

/// vsock port the guest agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 1024;

/// Version of this protocol; bumped on incompatible changes.
pub const PROTOCOL_VERSION: u32 = 1;

/// Largest payload of one stdio chunk, file read or file write (bytes).
/// ttrpc caps a whole message at 4 MiB; this leaves ample room.
pub const MAX_CHUNK: usize = 1 << 20;

/// Most entries one `ListDir` call returns.
pub const MAX_DIR_ENTRIES: usize = 10_000;

/// Largest OCI spec (JSON) `CreateContainer` accepts (bytes).
pub const MAX_SPEC_BYTES: usize = 1 << 20;

/// Largest `AddEntropy` payload (bytes).
pub const MAX_ENTROPY_BYTES: usize = 4096;

/// Longest container or exec id (bytes).
pub const MAX_ID_LEN: usize = 256;

/// Longest path in a file request (bytes).
pub const MAX_PATH_LEN: usize = 4096;

/// Largest PNG `BrowserScreenshot` returns (bytes); a larger screenshot
/// fails with OUT_OF_RANGE (ask for a smaller viewport).
pub const MAX_SCREENSHOT_BYTES: usize = 3 << 20;

/// Most output bytes a detached session keeps (`StartSession`): older
/// output is dropped, and `ReadSession` says how much.
pub const MAX_SESSION_BUFFER: usize = 1 << 20;

/// Most detached sessions one guest holds; a new one replaces the oldest
/// finished one, and is refused when all are running.
pub const MAX_SESSIONS: usize = 16;

/// Longest `ReadSession` wait (milliseconds).
pub const MAX_SESSION_WAIT_MS: u32 = 60_000;

/// The `#[async_trait]` attribute the generated [`Agent`] trait needs.
pub use async_trait::async_trait;
