//! The protocol between burrow's shim and its guest agent.

/// vsock port the guest agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 1024;
