//! virtio-vsock in userspace (our hosts have no `/dev/vhost-vsock`), with
//! Firecracker's hybrid host side:
//!
//! - host → guest: connect to the unix socket at `uds_path`, send
//!   `CONNECT <port>\n`; once the guest accepts, the VMM answers
//!   `OK <host-port>\n` and the stream carries the connection's bytes.
//! - guest → host: a guest connect to CID 2 port P is delivered to the unix
//!   socket `<uds_path>_P` (which a host program listens on).
//!
//! Packet parsing is virtio-vsock's; flow control follows the virtio spec's
//! credit scheme (buf_alloc / fwd_cnt).

mod device;
mod expiry;
mod muxer;
pub mod packet;
pub mod persist;
#[cfg(test)]
mod tests;

pub use device::{Vsock, VsockError, HOST_CID};
