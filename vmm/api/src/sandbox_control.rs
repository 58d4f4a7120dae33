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
//! The tool requests (`exec`, `read`, `write`, `ls`, `edit`) and their
//! `"tool"` results are in [`crate::sandbox_tools`].
//!
//! It lives here (not in burrow-protocol, the agent's ttrpc protocol) because
//! it is a host-only protocol between two host programs that already link
//! this crate; the CLI needs no protobuf or ttrpc for it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::sandbox_tools::{
    AttachRequest, BrowseRequest, DownloadRequest, EditRequest, ElementRequest, ExecRequest,
    LsRequest, ReadRequest, ScreenshotRequest, ToolReply, UploadRequest, WriteRequest, MAX_WRITE,
};

/// The control socket's file name in a sandbox's state directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Longest request line the shim reads: a `write` of [`MAX_WRITE`] bytes,
/// JSON-escaped (at most 6 bytes each), and room for the rest.
pub const MAX_REQUEST: u64 = (MAX_WRITE as u64) * 6 + 64 * 1024;
/// Longest reply line the CLI reads: a tool's capped result, JSON-escaped.
pub const MAX_REPLY: u64 = 8 << 20;

/// The control socket of the sandbox whose state directory is `dir`.
pub fn control_socket(dir: &Path) -> PathBuf {
    dir.join(CONTROL_SOCKET)
}

/// In a sandbox's state directory: one line saying where its VM's start
/// (create, template restore or checkpoint restore) spent its time, which
/// `burrow sandbox ls -v` shows.
pub const PHASES_FILE: &str = "phases";

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
    /// Run a command in the container (waking the VM first).
    Exec(ExecRequest),
    /// Start a command as a detached session (`timeout_secs` 0: none).
    Detach(ExecRequest),
    /// Read on in a detached session.
    Attach(AttachRequest),
    /// Read lines of a file in the container.
    Read(ReadRequest),
    /// Replace a file in the container atomically.
    Write(WriteRequest),
    /// List a directory in the container.
    Ls(LsRequest),
    /// Replace one unique string in a file in the container.
    Edit(EditRequest),
    /// Copy a file into the container (its bytes follow in frames).
    Upload(UploadRequest),
    /// Copy a file out of the container (its bytes come in frames).
    Download(DownloadRequest),
    /// Load a page in the sandbox's browser and/or read it.
    Browse(BrowseRequest),
    /// Click an element of the browser's page by its index.
    Click(ElementRequest),
    /// Type into an element of the browser's page by its index.
    Type(ElementRequest),
    /// A screenshot of the browser's page.
    Screenshot(ScreenshotRequest),
    /// Tool request `request` for container `container` of a CRI pod's VM
    /// (the pod's shim, addressed by the pod's sandbox id, serves all its
    /// containers; `status` lists them).
    In {
        container: String,
        request: Box<SandboxRequest>,
    },
}

impl SandboxRequest {
    /// The command's name, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Status => "status",
            Self::Hibernate => "hibernate",
            Self::Wake => "wake",
            Self::Checkpoint { .. } => "checkpoint",
            Self::Exec(_) => "exec",
            Self::Detach(_) => "detach",
            Self::Attach(_) => "attach",
            Self::Read(_) => "read",
            Self::Write(_) => "write",
            Self::Ls(_) => "ls",
            Self::Edit(_) => "edit",
            Self::Upload(_) => "upload",
            Self::Download(_) => "download",
            Self::Browse(_) => "browse",
            Self::Click(_) => "click",
            Self::Type(_) => "type",
            Self::Screenshot(_) => "screenshot",
            Self::In { request, .. } => request.name(),
        }
    }

    /// Longest reply line to read for this request: [`MAX_REPLY`], or for
    /// an `exec` that asked for more output, both streams at their cap,
    /// JSON-escaped (at most 6 bytes each), and room for the rest.
    pub fn reply_limit(&self) -> u64 {
        match self {
            Self::Exec(r) => MAX_REPLY.max((r.output_cap() as u64) * 2 * 6 + 64 * 1024),
            Self::In { request, .. } => request.reply_limit(),
            _ => MAX_REPLY,
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
    /// A tool request's result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<ToolReply>,
    /// `status`: the containers this sandbox's VM runs (containerd ids; a
    /// CRI pod's sandbox container first).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<String>,
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
                tool: None,
                containers: Vec::new(),
            },
            Err(e) => Self::failed(state, e),
        }
    }

    /// The reply to a tool request that ended with `result`.
    pub fn tool(state: &str, result: Result<ToolReply, String>) -> Self {
        match result {
            Ok(t) => Self {
                ok: true,
                state: state.into(),
                dir: None,
                error: None,
                tool: Some(t),
                containers: Vec::new(),
            },
            Err(e) => Self::failed(state, e),
        }
    }

    fn failed(state: &str, error: String) -> Self {
        Self {
            ok: false,
            state: state.into(),
            dir: None,
            error: Some(error),
            tool: None,
            containers: Vec::new(),
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
        let exec = SandboxRequest::Exec(ExecRequest {
            args: vec!["sh".into(), "-c".into(), "exit 3".into()],
            cwd: None,
            env: vec!["A=1".into()],
            timeout_secs: 5,
            max_output: None,
            ..Default::default()
        });
        let line = crate::to_line(&exec);
        assert_eq!(
            line,
            b"{\"cmd\":\"exec\",\"args\":[\"sh\",\"-c\",\"exit 3\"],\"env\":[\"A=1\"],\"timeout_secs\":5}\n"
        );
        assert_eq!(
            serde_json::from_slice::<SandboxRequest>(&line).unwrap(),
            exec
        );
        // A read without lines reads from line 1.
        assert_eq!(
            serde_json::from_str::<SandboxRequest>(r#"{"cmd":"read","path":"/a"}"#).unwrap(),
            SandboxRequest::Read(ReadRequest {
                path: "/a".into(),
                lines: crate::sandbox_tools::LineRange::default()
            })
        );
        assert!(serde_json::from_str::<SandboxRequest>(r#"{"cmd":"edit","path":"/a"}"#).is_err());
        let wrote = SandboxReply::tool("running", Ok(ToolReply::Write { bytes: 3 }));
        assert_eq!(
            serde_json::to_string(&wrote).unwrap(),
            r#"{"ok":true,"state":"running","tool":{"tool":"write","bytes":3}}"#
        );
        let back: SandboxReply =
            serde_json::from_str(&serde_json::to_string(&wrote).unwrap()).unwrap();
        assert_eq!(back, wrote);
        // A pod member's request wraps the tool's.
        let inner = SandboxRequest::Ls(LsRequest { path: "/".into() });
        let wrapped = SandboxRequest::In {
            container: "app".into(),
            request: Box::new(inner.clone()),
        };
        let line = crate::to_line(&wrapped);
        assert_eq!(
            line,
            b"{\"cmd\":\"in\",\"container\":\"app\",\"request\":{\"cmd\":\"ls\",\"path\":\"/\"}}\n"
        );
        assert_eq!(
            serde_json::from_slice::<SandboxRequest>(&line).unwrap(),
            wrapped
        );
        assert_eq!((wrapped.name(), wrapped.reply_limit()), ("ls", MAX_REPLY));
        assert_eq!(
            control_socket(Path::new("/run/burrow/default/s1")),
            PathBuf::from("/run/burrow/default/s1/control.sock")
        );
    }
}
