//! The MCP side of detached sessions: `exec` with `detach` starts one and
//! `exec_read` reads its output by offset. The output lives in the guest
//! (the last 1 MiB), so a session survives the sandbox's hibernation and a
//! checkpoint/restore, and a model reads on from the offset it had; this
//! server keeps nothing of it. Pieces end on a line (or a space) while the
//! command runs, so a secret is redacted whole; one in a line longer than
//! the piece asked for may still be split.

use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    AttachRequest, ExecRequest, SessionOutput, ToolReply, MAX_ATTACH_WAIT_SECS,
};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::CallToolResult;
use rmcp::{tool, tool_router, ErrorData};
use schemars::JsonSchema;
use serde::Deserialize;

use super::redact::redact;
use super::{failed, output, shown, Burrow};
use crate::tools::WAKE_ALLOWANCE;

/// Most bytes one `exec_read` returns.
const MAX_PAGE: u64 = 32 * 1024;

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecReadArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// The session id exec with detach gave (`s1`).
    pub session: String,
    /// Output offset to read from: 0, or the `next` the last read gave.
    #[serde(default)]
    pub from: u64,
    /// Wait up to this many seconds for output when there is none yet
    /// (default 0, at most 60).
    #[serde(default)]
    pub wait_secs: u64,
    /// Bytes to return (default 8192, at most 32768).
    #[serde(default)]
    pub max_bytes: Option<u64>,
}

impl Burrow {
    /// `exec` with `detach`: start the command as a session.
    pub(super) async fn exec_detached(
        &self,
        sandbox: &str,
        req: ExecRequest,
    ) -> Result<CallToolResult, ErrorData> {
        self.answer(sandbox, SandboxRequest::Detach(req), false, |r| {
            let ToolReply::Detach(s) = r else { return None };
            Some(format!(
                "started session {} (pid {}); read its output with exec_read \
                 (sandbox={sandbox}, session={}, from=0); it keeps running and keeps its \
                 output across hibernation and checkpoint/restore",
                s.session, s.pid, s.session
            ))
        })
        .await
    }
}

/// The model's view of a piece of session output: the output, then where
/// it stands.
pub fn session_text(session: &str, out: &SessionOutput) -> String {
    let mut text = out.output.clone();
    if !text.is_empty() && !text.ends_with('\n') {
        text.push('\n');
    }
    let mut note = format!(
        "[session {session}: bytes {}-{} of {}",
        out.from, out.next, out.end
    );
    if out.dropped > 0 {
        note.push_str(&format!(
            "; {} bytes before {} were dropped (a session keeps its last 1 MiB)",
            out.dropped, out.from
        ));
    }
    match out.status() {
        Some(status) if out.timed_out => {
            note.push_str(&format!("; killed at its timeout, exit status {status}"))
        }
        Some(status) => note.push_str(&format!("; exited with status {status}")),
        None if out.next < out.end => note.push_str(&format!("; more: from={}", out.next)),
        None => note.push_str(&format!("; running; next: from={}", out.next)),
    }
    note.push_str("]\n");
    text.push_str(&note);
    text
}

#[tool_router(router = session_router, vis = "pub")]
impl Burrow {
    /// Read the output (stdout and stderr together) of a session exec started with detach,
    /// from an offset; says where to read on, and the exit status once it ended. Works
    /// after the sandbox hibernated or was restored from a checkpoint.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn exec_read(
        &self,
        Parameters(a): Parameters<ExecReadArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let wait = a.wait_secs.min(MAX_ATTACH_WAIT_SECS);
        let req = SandboxRequest::Attach(AttachRequest {
            session: a.session.clone(),
            from: a.from,
            wait_secs: wait,
            max_bytes: Some(
                a.max_bytes
                    .unwrap_or(output::PAGE as u64)
                    .clamp(1, MAX_PAGE),
            ),
            whole_lines: true,
        });
        let limit = std::time::Duration::from_secs(wait) + WAKE_ALLOWANCE;
        Ok(match self.ask(&a.sandbox, req, limit).await {
            Ok(ToolReply::Attach(out)) => shown(redact(&session_text(&a.session, &out), false)),
            Ok(_) => failed("the shim answered attach with another tool's result"),
            Err(e) => failed(e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_told_where_to_read_on_and_how_it_ended() {
        let running = SessionOutput {
            output: "one\ntwo".into(),
            from: 100,
            next: 107,
            end: 107,
            ..Default::default()
        };
        assert_eq!(
            session_text("s2", &running),
            "one\ntwo\n[session s2: bytes 100-107 of 107; running; next: from=107]\n"
        );
        let more = SessionOutput {
            end: 500,
            dropped: 40,
            ..running.clone()
        };
        assert!(session_text("s2", &more).ends_with(
            "; 40 bytes before 100 were dropped (a session keeps its last 1 MiB); more: from=107]\n"
        ));
        let done = SessionOutput {
            done: true,
            exit_code: Some(3),
            ..running
        };
        assert!(session_text("s2", &done).ends_with("; exited with status 3]\n"));
    }
}
