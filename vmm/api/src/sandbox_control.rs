//! The shim's control socket, which `burrow sandbox` talks to:
//! `<state_dir>/<namespace>/<sandbox id>/control.sock`, one JSON
//! [`SandboxRequest`] line in, one [`SandboxReply`] line out, then the
//! shim closes the connection.
//!
//! ```text
//! {"cmd":"hibernate"}                  -> {"ok":true,"state":"asleep"}
//! {"cmd":"checkpoint","name":"cp1"}    -> {"ok":true,"state":"running","dir":"/var/lib/burrow/snapshots/.checkpoints/cp1"}
//! {"cmd":"wake"}                       -> {"ok":false,"state":"running","error":"..."}
//! ```
//!
//! It lives here (not in burrow-protocol, the agent's ttrpc protocol) because
//! it is a host-only protocol between two host programs that already link
//! this crate; the CLI needs no protobuf or ttrpc for it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The control socket's file name in a sandbox's state directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Longest request line the shim reads.
pub const MAX_REQUEST: u64 = 4096;
/// Longest reply line the CLI reads.
pub const MAX_REPLY: u64 = 64 * 1024;

/// The control socket of the sandbox whose state directory is `dir`.
pub fn control_socket(dir: &Path) -> PathBuf {
    dir.join(CONTROL_SOCKET)
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum SandboxRequest {
    /// Report the sandbox's state.
    Status,
    /// Snapshot the VM and stop it (it wakes on the next request for it).
    Hibernate,
    /// Restore a hibernated VM now.
    Wake,
    /// Write named checkpoint `name` (the sandbox runs on).
    Checkpoint { name: String },
}

impl SandboxRequest {
    /// The command's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::Hibernate => "hibernate",
            Self::Wake => "wake",
            Self::Checkpoint { .. } => "checkpoint",
        }
    }
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxReply {
    pub ok: bool,
    /// The sandbox's state after the request (`running`, `hibernating`,
    /// `asleep`).
    pub state: String,
    /// Where a checkpoint was written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl SandboxReply {
    /// The reply to a request that ended with `result`, the sandbox now
    /// being in `state`.
    pub fn new(state: &str, result: Result<Option<PathBuf>, String>) -> Self {
        match result {
            Ok(dir) => Self {
                ok: true,
                state: state.into(),
                dir,
                error: None,
            },
            Err(e) => Self {
                ok: false,
                state: state.into(),
                dir: None,
                error: Some(e),
            },
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn wire_form() {
        let req = SandboxRequest::Checkpoint { name: "cp1".into() };
        let line = crate::to_line(&req);
        assert_eq!(line, b"{\"cmd\":\"checkpoint\",\"name\":\"cp1\"}\n");
        assert_eq!(
            serde_json::from_slice::<SandboxRequest>(&line).unwrap(),
            req
        );
        assert_eq!(
            serde_json::from_str::<SandboxRequest>(r#"{"cmd":"hibernate"}"#).unwrap(),
            SandboxRequest::Hibernate
        );
        assert!(serde_json::from_str::<SandboxRequest>(r#"{"cmd":"checkpoint"}"#).is_err());
        assert!(serde_json::from_str::<SandboxRequest>(r#"{"cmd":"explode"}"#).is_err());
        let ok = SandboxReply::new("running", Ok(Some("/c/cp1".into())));
        assert_eq!(
            serde_json::to_string(&ok).unwrap(),
            r#"{"ok":true,"state":"running","dir":"/c/cp1"}"#
        );
        let refused = SandboxReply::new("asleep", Err("no".into()));
        assert_eq!(
            serde_json::to_string(&refused).unwrap(),
            r#"{"ok":false,"state":"asleep","error":"no"}"#
        );
        assert_eq!(
            control_socket(Path::new("/run/burrow/default/s1")),
            PathBuf::from("/run/burrow/default/s1/control.sock")
        );
    }
}
