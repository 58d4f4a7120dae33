//! `containerd-shim-burrow-v2` (not yet implemented: issue 5).

fn main() -> anyhow::Result<()> {
    anyhow::bail!(
        "containerd-shim-burrow-v2 is not implemented yet (agent port {})",
        burrow_protocol::AGENT_VSOCK_PORT
    )
}
