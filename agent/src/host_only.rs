//! The agent's vsock listener, taking connections from the host only.
//!
//! The agent is guest root with every container's processes in reach. The
//! guest kernel's vsock also connects a guest to itself (its own CID or
//! the local CID 1), so without this check code in any container could
//! call the agent API. Only the host (CID 2, `VMADDR_CID_HOST`) is served;
//! any other peer is closed at once and logged (rate-bounded by the peer
//! having to connect again).

use anyhow::Context;
use burrow_protocol::ttrpc::r#async::transport::Listener;
use tokio_vsock::{VsockAddr, VsockListener, VMADDR_CID_ANY, VMADDR_CID_HOST};

/// Whether a peer may use the agent.
pub fn allowed(peer_cid: u32) -> bool {
    peer_cid == VMADDR_CID_HOST
}

/// Listen on vsock `port` for the host's connections only.
pub fn listen(port: u32) -> anyhow::Result<Listener> {
    let listener = VsockListener::bind(VsockAddr::new(VMADDR_CID_ANY, port))
        .with_context(|| format!("listen on vsock port {port}"))?;
    let conns = futures::stream::unfold(listener, |l| async move {
        loop {
            match l.accept().await {
                Ok((s, peer)) if allowed(peer.cid()) => return Some((Ok(s), l)),
                Ok((_, peer)) => {
                    tracing::warn!(
                        "refused a vsock connection from CID {} (only the host, CID 2, is served)",
                        peer.cid()
                    );
                }
                Err(e) => return Some((Err(e), l)),
            }
        }
    });
    Ok(Listener::new(conns))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_host_is_served() {
        assert!(allowed(2));
        // Local loopback, the guest's own CIDs, the hypervisor, "any".
        for cid in [0, 1, 3, 4, 42, u32::MAX] {
            assert!(!allowed(cid), "CID {cid}");
        }
    }
}
