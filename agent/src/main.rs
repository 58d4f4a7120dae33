//! `burrow-agent`: PID 1 inside a burrow microVM (not yet implemented: issue 4).

fn main() -> anyhow::Result<()> {
    anyhow::bail!(
        "burrow-agent is not implemented yet (would listen on vsock port {})",
        burrow_protocol::AGENT_VSOCK_PORT
    )
}
