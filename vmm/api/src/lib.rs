//! The typed interface of `burrow-vmm`, shared by the VMM, the shim and the
//! CLI, so that what one side writes is what the other parses: no argv or
//! JSON is built by hand on either side. No KVM in here; the shim and the
//! CLI link it without the VMM.
//!
//! | module | holds |
//! |---|---|
//! | [`args`] | `burrow-vmm`'s command line ([`VmmArgs`]) and the base guest kernel command line |
//! | [`messages`] | the VMM control API: [`Command`] in, [`Response`] and [`Event`] lines out |
//! | [`jail`] | the VMM's confinement flags ([`jail::JailArgs`]) |
//! | [`error`] | [`ApiError`]: an [`ErrorKind`] and a message, as carried over the wire |
//! | [`net`] | `--net`: the guest NIC's tap and MAC |
//! | [`layout`] | file names and limits of snapshot and checkpoint directories |
//! | [`memory_map`] | where a restore's memory lies in a packed file (mapped in place) |
//! | [`sandbox_control`] | the shim's control socket that `burrow sandbox` talks to |
//! | [`sockpath`] | unix socket paths longer than `sun_path` (CRI's ids) |

pub mod args;
pub mod error;
pub mod jail;
pub mod layout;
pub mod memory_map;
pub mod messages;
pub mod net;
pub mod sandbox_control;
pub mod sandbox_tools;
pub mod sockpath;

pub use args::{
    Cli, DiskArg, VmmArgs, VmmCommand, BASE_CMDLINE, DEFAULT_LOG_MAX, DEFAULT_SERIAL_LOG_MAX,
};
pub use error::{ApiError, ErrorKind};
pub use messages::{Command, Event, Line, MemoryInfo, Request, Response, SnapshotInfo, VmState, MAX_LINE};
pub use net::{Mac, NetArg, TapSource};

/// `msg` as one JSON line (with its newline), the framing of both control
/// sockets.
pub fn to_line<T: serde::Serialize>(msg: &T) -> Vec<u8> {
    // Serializing these types cannot fail: they hold no maps with
    // non-string keys and no failing Serialize impls.
    let mut line = serde_json::to_vec(msg).unwrap_or_default();
    line.push(b'\n');
    line
}
