//! `burrow mcp`: the sandboxes' tools as a Model Context Protocol server
//! (rmcp, on stdio, or on Streamable HTTP with `--http`: [`http`]). Every tool takes the container id as `sandbox` and
//! goes through that sandbox's shim control socket, the same requests as
//! `burrow exec|read|write|ls|edit` (a hibernated sandbox wakes for them).
//!
//! Results are shaped for a model: command output is shown inline up to
//! [`output::INLINE`] bytes (head and tail, the cut said), the whole of it
//! is kept here on the host and paged with `read_output`; known secret
//! shapes are redacted from everything returned ([`redact`]). What comes
//! from the guest is bounded by the shim and by the reply limit of the
//! control socket before it is read into memory here.

pub mod browser;
pub mod http;
pub mod output;
pub mod redact;
pub mod session;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    EditRequest, ExecRequest, LineRange, LsRequest, ReadRequest, ToolReply, WriteRequest,
    MAX_EXEC_OUTPUT_FULL, MAX_EXEC_TIMEOUT_SECS, MAX_WRITE,
};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock, Implementation, ServerCapabilities, ServerConfig};
use rmcp::{tool, tool_handler, tool_router, ErrorData, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde::Deserialize;

use crate::{sandbox, tools};
use redact::{is_env_file, redact, Redacted};

/// `exec`'s timeout when the model gives none.
const DEFAULT_TIMEOUT_SECS: u64 = 120;

/// The MCP server: sandboxes under `root` in `namespace`.
#[derive(Clone)]
pub struct Burrow {
    root: PathBuf,
    namespace: String,
    /// containerd's socket (`fork` and `restore` start containers).
    containerd: String,
    store: Arc<Mutex<output::Store>>,
    tool_router: ToolRouter<Self>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct NoArgs {}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ExecArgs {
    /// The sandbox (container id; see sandboxes_list).
    pub sandbox: String,
    /// Shell command, run with /bin/sh -c in the sandbox's container.
    pub command: String,
    /// Working directory (absolute; default: the container's).
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Kill the command after this many seconds (default 120; with detach,
    /// none).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// Start it as a session and return its id at once; exec_read reads its
    /// output, also after the sandbox hibernated or was restored.
    #[serde(default)]
    pub detach: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadOutputArgs {
    /// The reference an exec result gave (`out-N`).
    #[serde(rename = "ref")]
    pub reference: String,
    /// `stdout` or `stderr`.
    #[serde(default = "stdout")]
    pub stream: String,
    /// Byte offset to start from.
    #[serde(default)]
    pub offset: usize,
    /// Bytes to return (default 8192, at most 32768).
    #[serde(default)]
    pub length: Option<usize>,
}

fn stdout() -> String {
    "stdout".into()
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ReadFileArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// Absolute path in the container.
    pub path: String,
    /// First line to return (1-based, default 1).
    #[serde(default)]
    pub start_line: Option<u64>,
    /// Last line to return (inclusive; at most 500 lines per call).
    #[serde(default)]
    pub end_line: Option<u64>,
    /// `base64`: return the file's bytes (any file: an image, an archive)
    /// base64-encoded, from `offset`, at most `length` of them, instead of
    /// lines.
    #[serde(default)]
    pub encoding: Option<String>,
    /// With encoding=base64: the byte to start from (default 0).
    #[serde(default)]
    pub offset: Option<u64>,
    /// With encoding=base64: bytes to return (default and most 262144).
    #[serde(default)]
    pub length: Option<u64>,
}

/// Most bytes one base64 `read_file` returns (and the default).
pub const MAX_READ_BYTES: u64 = 256 * 1024;
/// Bytes read on each side of a base64 `read_file`'s range and checked
/// for secrets with it (never returned).
const SECRET_MARGIN: u64 = 4096;

#[derive(Debug, Deserialize, JsonSchema)]
pub struct WriteFileArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// Absolute path in the container; missing parent directories are made.
    pub path: String,
    /// The file's whole new content (UTF-8 text, at most 1 MiB).
    #[serde(default)]
    pub content: Option<String>,
    /// Instead of content: the file's bytes, base64-encoded (at most 1 MiB
    /// decoded); the parent directory must exist.
    #[serde(default)]
    pub content_base64: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct EditFileArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// Absolute path in the container.
    pub path: String,
    /// The exact text to replace; it must occur exactly once in the file.
    pub old_string: String,
    /// The text that replaces it.
    pub new_string: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct PathArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// Absolute path in the container.
    pub path: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct RestoreArgs {
    /// The checkpoint's name (as given to checkpoint).
    pub checkpoint: String,
    /// The id of the new sandbox (a new containerd container) to restore it
    /// into: letters, digits, '-', '_', '.'.
    pub new_sandbox: String,
    /// The sandbox whose image and runtime the new one takes: normally the
    /// one the checkpoint was taken of (it is left as it is).
    pub sandbox: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ForkArgs {
    /// The sandbox to copy (container id).
    pub sandbox: String,
    /// How many copies (1 to 8; default 1).
    #[serde(default)]
    pub copies: Option<u32>,
}

/// Most copies one MCP `fork` makes.
const MAX_MCP_COPIES: u32 = 8;

#[derive(Debug, Deserialize, JsonSchema)]
pub struct CheckpointArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// The checkpoint's name (a new container starts from it with the
    /// annotation io.burrow.restore=NAME).
    pub name: String,
}

/// A tool result the model reads: `text` (already redacted, `found` being
/// what was) and a note on what was redacted.
fn shown(mut r: Redacted) -> CallToolResult {
    if let Some(note) = r.note() {
        if !r.text.ends_with('\n') && !r.text.is_empty() {
            r.text.push('\n');
        }
        r.text.push_str(&note);
    }
    CallToolResult::success(vec![ContentBlock::text(r.text)])
}

/// A tool's failure as the model sees it (redacted too: guest errors may
/// carry file contents).
fn failed(e: impl std::fmt::Display) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(redact(&e.to_string(), false).text)])
}

#[tool_router(router = tool_router)]
impl Burrow {
    pub fn new(root: PathBuf, namespace: String) -> Self {
        Self {
            root,
            namespace,
            containerd: crate::fork::containerd_address(None),
            store: Arc::default(),
            tool_router: Self::tool_router()
                + Self::browser_router()
                + Self::session_router()
                + Self::lifecycle_router(),
        }
    }

    /// The same server with containerd at `address` (None: the default,
    /// see [`crate::fork::containerd_address`]).
    pub fn with_containerd(mut self, address: Option<String>) -> Self {
        self.containerd = crate::fork::containerd_address(address);
        self
    }

    /// Send `req` to sandbox `id` (off the async threads: the control
    /// socket client blocks).
    async fn ask(
        &self,
        id: &str,
        req: SandboxRequest,
        timeout: Duration,
    ) -> Result<ToolReply, String> {
        let (root, ns, id) = (self.root.clone(), self.namespace.clone(), id.to_string());
        tokio::task::spawn_blocking(move || tools::ask(&root, &ns, &id, &req, timeout))
            .await
            .map_err(|e| format!("the request was lost: {e}"))?
            .map_err(|e| format!("{e:#}"))
    }

    /// Ask sandbox `id` for `req` and show the model what `text` makes of
    /// the reply (None: a reply for another tool), redacted (as a `.env`
    /// file with `env_file`); a failure as a tool error.
    async fn answer(
        &self,
        id: &str,
        req: SandboxRequest,
        env_file: bool,
        text: impl FnOnce(ToolReply) -> Option<String>,
    ) -> Result<CallToolResult, ErrorData> {
        let name = req.name();
        Ok(match self.ask(id, req, tools::WAKE_ALLOWANCE).await {
            Ok(reply) => match text(reply) {
                Some(t) => shown(redact(&t, env_file)),
                None => failed(format!(
                    "the shim answered {name} with another tool's result"
                )),
            },
            Err(e) => failed(e),
        })
    }

    /// List the sandboxes this server can reach and their state (running, asleep); a
    /// Kubernetes pod's containers are listed under it, each a sandbox id for the tools.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn sandboxes_list(&self, _: Parameters<NoArgs>) -> Result<CallToolResult, ErrorData> {
        let (root, ns) = (self.root.clone(), self.namespace.clone());
        let text = tokio::task::spawn_blocking(move || {
            let mut text = String::new();
            for (n, id, dir) in sandbox::list(&root) {
                if n == ns {
                    let status =
                        sandbox::request(&dir, &SandboxRequest::Status, Duration::from_secs(5));
                    match status {
                        Ok(s) => {
                            text.push_str(&format!("{id}\t{}\n", s.state));
                            // A CRI pod: its containers, each addressed by its id.
                            for c in s.containers.iter().filter(|c| **c != id) {
                                text.push_str(&format!("{c}\t(container of pod {id})\n"));
                            }
                        }
                        Err(e) => text.push_str(&format!("{id}\tunreachable ({e:#})\n")),
                    }
                }
            }
            if text.is_empty() {
                text = format!("no sandboxes in namespace {ns:?}\n");
            }
            text
        })
        .await
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(shown(redact(&text, false)))
    }

    /// Run a shell command in a sandbox and return its exit status and output. Output past
    /// 8 KiB is shown as its head and tail; the whole of it is kept and read_output pages
    /// through it by the reference given. With detach it starts a session for long-running
    /// commands and returns its id at once (read it with exec_read).
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = true,
        open_world_hint = false
    ))]
    async fn exec(&self, Parameters(a): Parameters<ExecArgs>) -> Result<CallToolResult, ErrorData> {
        let timeout = match (a.detach, a.timeout_secs) {
            (true, None) => 0,
            (_, t) => t
                .unwrap_or(DEFAULT_TIMEOUT_SECS)
                .clamp(1, MAX_EXEC_TIMEOUT_SECS),
        };
        let req = ExecRequest {
            args: vec!["/bin/sh".into(), "-c".into(), a.command],
            cwd: a.cwd,
            env: a.env.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
            timeout_secs: timeout,
            max_output: Some(MAX_EXEC_OUTPUT_FULL as u64),
            ..Default::default()
        };
        if a.detach {
            return self.exec_detached(&a.sandbox, req).await;
        }
        let req = SandboxRequest::Exec(req);
        let limit = Duration::from_secs(timeout) + tools::WAKE_ALLOWANCE;
        let out = match self.ask(&a.sandbox, req, limit).await {
            Ok(ToolReply::Exec(out)) => out,
            Ok(_) => return Ok(failed("the shim answered exec with another tool's result")),
            Err(e) => return Ok(failed(e)),
        };
        let stdout = redact(&out.stdout, false);
        let stderr = redact(&out.stderr, false);
        let mut found = stdout.found.clone();
        found.extend(&stderr.found);
        let mut text = format!("exit status: {}\n", out.status());
        let (bo, be) = output::budgets(stdout.text.len(), stderr.text.len());
        let kept = bo < stdout.text.len() || be < stderr.text.len();
        let reference = if kept {
            let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
            store.keep(stdout.text.clone(), stderr.text.clone())
        } else {
            String::new()
        };
        for (name, r, budget) in [("stdout", &stdout, bo), ("stderr", &stderr, be)] {
            if r.text.is_empty() {
                continue;
            }
            text.push_str(&format!("--- {name} ({} bytes) ---\n", r.text.len()));
            text.push_str(&output::inline(&r.text, budget, name, &reference));
            if !text.ends_with('\n') {
                text.push('\n');
            }
        }
        for note in tools::exec_notes(&out, timeout, MAX_EXEC_OUTPUT_FULL) {
            text.push_str(&format!("[{note}]\n"));
        }
        Ok(shown(Redacted { text, found }))
    }

    /// Read a page of the full output of an earlier exec, by the reference its result gave.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn read_output(
        &self,
        Parameters(a): Parameters<ReadOutputArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        let len = a.length.unwrap_or(output::PAGE);
        Ok(match store.page(&a.reference, &a.stream, a.offset, len) {
            // The page as it is kept (redacted when it was), and where
            // it is as a second block.
            Ok(p) => CallToolResult::success(vec![
                ContentBlock::text(p.text.clone()),
                ContentBlock::text(p.note(&a.reference, &a.stream)),
            ]),
            Err(e) => failed(e),
        })
    }

    /// Read lines of a text file in a sandbox (at most 500 per call); says how many remain
    /// and which start_line comes next. With encoding=base64, any file's bytes instead, a
    /// range (offset, length) at a time.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn read_file(
        &self,
        Parameters(a): Parameters<ReadFileArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        match a.encoding.as_deref() {
            None | Some("text" | "utf-8" | "utf8") => {}
            Some("base64") => return Ok(self.read_base64(a).await),
            Some(other) => {
                return Ok(failed(format!(
                    "encoding {other:?}: read_file returns text, or base64"
                )))
            }
        }
        let lines = LineRange {
            first: a.start_line.unwrap_or(1),
            last: a.end_line,
        };
        if let Err(e) = lines.check() {
            return Ok(failed(e));
        }
        let req = SandboxRequest::Read(ReadRequest {
            path: a.path.clone(),
            lines,
        });
        let env_file = is_env_file(&a.path);
        self.answer(&a.sandbox, req, env_file, |r| {
            let ToolReply::Read(out) = r else { return None };
            let note = tools::read_note(&a.path, &out, |n| format!("start_line={n}"));
            let mut text = out.text;
            if !text.ends_with('\n') && !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&note);
            Some(text)
        })
        .await
    }

    /// `read_file` with encoding=base64: a range of the file's bytes.
    /// Bytes that read as a known secret shape (or any `.env` file) are
    /// withheld, as redaction cannot mark them inside base64.
    async fn read_base64(&self, a: ReadFileArgs) -> CallToolResult {
        let offset = a.offset.unwrap_or(0);
        let length = a.length.unwrap_or(MAX_READ_BYTES).clamp(1, MAX_READ_BYTES);
        let (root, ns) = (self.root.clone(), self.namespace.clone());
        let (id, path) = (a.sandbox.clone(), a.path.clone());
        // Read a margin on both sides, so that a secret split by a range's
        // edge is seen whole in every range that holds a part of it.
        let from = offset.saturating_sub(SECRET_MARGIN);
        let before = (offset - from) as usize;
        let got = tokio::task::spawn_blocking(move || {
            let span = length + (offset - from) + SECRET_MARGIN;
            crate::copy::read_bytes(&root, &ns, &id, &path, from, span)
        })
        .await;
        let (wide, info) = match got {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return failed(format!("{e:#}")),
            Err(e) => return failed(format!("the request was lost: {e}")),
        };
        if is_env_file(&a.path) {
            return failed(format!(
                "{} is an environment file: read it as text (its values are redacted)",
                a.path
            ));
        }
        let seen = redact(&String::from_utf8_lossy(&wide), false);
        let data = wide
            .get(before..)
            .map_or(&[][..], |d| &d[..d.len().min(length as usize)]);
        if !seen.found.is_empty() {
            return failed(format!(
                "bytes {offset}..{} of {} (or the bytes just around them) hold what looks like a secret ({}): withheld; read it as text to see it redacted",
                offset + data.len() as u64,
                a.path,
                seen.found.join(", ")
            ));
        }
        let file_size = info.file_size.unwrap_or(0);
        let next = offset + data.len() as u64;
        let note = if next >= file_size {
            format!(
                "[{}: bytes {offset}..{next} of {file_size}, base64; the end]",
                a.path
            )
        } else {
            format!(
                "[{}: bytes {offset}..{next} of {file_size}, base64; next: offset={next}]",
                a.path
            )
        };
        use base64::Engine;
        CallToolResult::success(vec![
            ContentBlock::text(base64::engine::general_purpose::STANDARD.encode(data)),
            ContentBlock::text(note),
        ])
    }

    /// Replace a file in a sandbox with new content, atomically (its mode is kept):
    /// text in content, or any bytes base64-encoded in content_base64.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = true,
        idempotent_hint = true,
        open_world_hint = false
    ))]
    async fn write_file(
        &self,
        Parameters(a): Parameters<WriteFileArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let content = match (a.content, a.content_base64) {
            (Some(c), None) => c,
            (None, Some(b)) => return Ok(self.write_base64(a.sandbox, a.path, b).await),
            _ => {
                return Ok(failed(
                    "give the file's content as one of content (text) and content_base64",
                ))
            }
        };
        if content.len() > MAX_WRITE {
            return Ok(failed(format!(
                "the content is longer than the {MAX_WRITE} bytes one write carries"
            )));
        }
        let bytes = content.len();
        let req = SandboxRequest::Write(WriteRequest {
            path: a.path.clone(),
            content,
        });
        self.answer(&a.sandbox, req, false, |r| {
            matches!(r, ToolReply::Write { .. })
                .then(|| format!("wrote {bytes} bytes to {}", a.path))
        })
        .await
    }

    /// `write_file` with content_base64: the bytes, decoded and bounded,
    /// through an upload (atomic).
    async fn write_base64(&self, sandbox: String, path: String, b64: String) -> CallToolResult {
        if b64.len() > MAX_WRITE.div_ceil(3) * 4 + 4 {
            return failed(format!(
                "content_base64 holds more than the {MAX_WRITE} bytes one write carries"
            ));
        }
        use base64::Engine;
        let data = match base64::engine::general_purpose::STANDARD.decode(b64.trim()) {
            Ok(d) if d.len() <= MAX_WRITE => d,
            Ok(_) => {
                return failed(format!(
                    "content_base64 holds more than the {MAX_WRITE} bytes one write carries"
                ))
            }
            Err(e) => return failed(format!("content_base64 is not base64: {e}")),
        };
        let (root, ns) = (self.root.clone(), self.namespace.clone());
        let p = path.clone();
        let done = tokio::task::spawn_blocking(move || {
            crate::copy::write_bytes(&root, &ns, &sandbox, &p, &data)
        })
        .await;
        match done {
            Ok(Ok(info)) => shown(redact(
                &format!("wrote {} bytes to {}", info.size, info.path),
                false,
            )),
            Ok(Err(e)) => failed(format!("{e:#}")),
            Err(e) => failed(format!("the request was lost: {e}")),
        }
    }

    /// Replace the one exact occurrence of old_string in a file with new_string; if it occurs
    /// zero or several times nothing changes and the result says so.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        open_world_hint = false
    ))]
    async fn edit_file(
        &self,
        Parameters(a): Parameters<EditFileArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Edit(EditRequest {
            path: a.path.clone(),
            old: a.old_string,
            new: a.new_string,
        });
        self.answer(&a.sandbox, req, false, |r| {
            let ToolReply::Edit { bytes, line } = r else {
                return None;
            };
            Some(format!(
                "edited {}: replaced at line {line} ({bytes} bytes now)",
                a.path
            ))
        })
        .await
    }

    /// List a directory in a sandbox: mode, size and name of each entry (at most 1000).
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn list_dir(
        &self,
        Parameters(a): Parameters<PathArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Ls(LsRequest {
            path: a.path.clone(),
        });
        self.answer(&a.sandbox, req, false, |r| {
            let ToolReply::Ls(out) = r else { return None };
            let mut text = tools::ls_text(&out);
            if out.truncated {
                text.push_str(&format!(
                    "[truncated: only the first {} entries are listed]\n",
                    out.entries.len()
                ));
            }
            if text.is_empty() {
                text = format!("{} is empty\n", a.path);
            }
            Some(text)
        })
        .await
    }

    /// Write a checkpoint of the whole sandbox VM while it runs on; restore starts a new
    /// sandbox from it (as does a container with the annotation io.burrow.restore=NAME).
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        open_world_hint = false
    ))]
    async fn checkpoint(
        &self,
        Parameters(a): Parameters<CheckpointArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let (root, ns, id) = (self.root.clone(), self.namespace.clone(), a.sandbox.clone());
        let name = a.name.clone();
        let done = tokio::task::spawn_blocking(move || -> anyhow::Result<String> {
            let dir = sandbox::sandbox_dir(&root, &ns, &id)?;
            let reply = sandbox::request(
                &dir,
                &SandboxRequest::Checkpoint { name },
                tools::WAKE_ALLOWANCE,
            )?;
            Ok(reply
                .dir
                .map(|d| d.display().to_string())
                .unwrap_or_default())
        })
        .await
        .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(match done {
            Ok(dir) => shown(redact(
                &format!("checkpoint {} of {} written to {dir}", a.name, a.sandbox),
                false,
            )),
            Err(e) => failed(format!("{e:#}")),
        })
    }
}

#[tool_router(router = lifecycle_router, vis = "pub(crate)")]
impl Burrow {
    /// Run `f` off the async threads (it runs ctr and waits on shims); its
    /// text, or its error, as the model sees them.
    async fn blocking(
        &self,
        f: impl FnOnce(&Self) -> anyhow::Result<String> + Send + 'static,
    ) -> Result<CallToolResult, ErrorData> {
        let me = self.clone();
        let done = tokio::task::spawn_blocking(move || f(&me))
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        Ok(match done {
            Ok(text) => shown(redact(&text, false)),
            Err(e) => failed(format!("{e:#}")),
        })
    }

    /// Start a new sandbox from a named checkpoint: the whole VM as it was at the checkpoint
    /// (processes, memory, files), with a fresh identity, as a new container new_sandbox. The
    /// sandbox it was taken of runs on untouched (a running sandbox is not rolled back in
    /// place); the checkpoint stays for further restores.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        idempotent_hint = false,
        open_world_hint = false
    ))]
    async fn restore(
        &self,
        Parameters(a): Parameters<RestoreArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        self.blocking(move |me| {
            // The same name checks as every other tool's sandbox argument.
            sandbox::sandbox_dir(&me.root, &me.namespace, &a.new_sandbox)?;
            crate::fork::restore(
                &me.containerd,
                &me.namespace,
                &a.sandbox,
                &a.checkpoint,
                &a.new_sandbox,
            )?;
            Ok(format!(
                "restored checkpoint {} into a new sandbox {}, running",
                a.checkpoint, a.new_sandbox
            ))
        })
        .await
    }

    /// Copy a running sandbox: each copy continues from one instant of it (processes, memory,
    /// files; memory shared copy-on-write) with a fresh identity, as a new sandbox
    /// SANDBOX-fork-K. The source runs on. Returns the copies' ids.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        idempotent_hint = false,
        open_world_hint = false
    ))]
    async fn fork(&self, Parameters(a): Parameters<ForkArgs>) -> Result<CallToolResult, ErrorData> {
        let n = a.copies.unwrap_or(1);
        if n == 0 || n > MAX_MCP_COPIES {
            return Ok(failed(format!("copies: want 1 to {MAX_MCP_COPIES}")));
        }
        self.blocking(move |me| {
            let dir = sandbox::sandbox_dir(&me.root, &me.namespace, &a.sandbox)?;
            if !dir.exists() {
                anyhow::bail!(
                    "there is no sandbox {:?} in namespace {:?}",
                    a.sandbox,
                    me.namespace
                );
            }
            let copies = crate::fork::fork(&dir, &me.containerd, &me.namespace, &a.sandbox, n)?;
            Ok(format!(
                "forked {} into {} running copies:\n{}\n",
                a.sandbox,
                copies.len(),
                copies.join("\n")
            ))
        })
        .await
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Burrow {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("burrow", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "Tools of burrow sandboxes (KVM microVMs): run commands, read and edit files. \
                 Every tool takes the sandbox's id (sandboxes_list). Output is capped; long \
                 output is paged with read_output. Long-running commands: exec with detach, \
                 then exec_read by session id and offset. checkpoint saves a whole sandbox; \
                 restore starts a new sandbox from it; fork copies a running one. Secrets in \
                 results are redacted.",
            )
    }
}

/// `burrow mcp`: serve `server` on stdio until the client closes it.
pub fn serve_stdio(server: Burrow) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let server = server
            .serve(rmcp::transport::stdio())
            .await
            .context("starting the MCP session")?;
        server.waiting().await.context("the MCP session")?;
        anyhow::Ok(())
    })
}
