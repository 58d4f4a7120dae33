//! The protocol between burrow's shim (host) and `burrow-agent` (guest PID 1).
//!
//! The service is defined in `proto/agent.proto` and compiled at build time
//! with ttrpc-codegen's pure-Rust parser. Both sides use the ttrpc and
//! protobuf versions that `containerd-shim` 0.11 uses; they are re-exported
//! here so the shim and the agent cannot drift apart.
//!
//! Host side: connect to the VMM's vsock unix socket, write
//! `CONNECT 1024\n`, read `OK <n>\n`, then wrap the stream with
//! [`ttrpc::r#async::transport::Socket::new`] and
//! [`ttrpc::r#async::Client::new`], and build an [`AgentClient`].

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

/// The `#[async_trait]` attribute the generated [`Agent`] trait needs.
pub use async_trait::async_trait;
