//! The control socket's tool requests on a VM sandbox: `exec`, `read`,
//! `write`, `ls`, `edit` in the sandbox's container, through the guest
//! agent's process and file calls (confined to the container's root in the
//! guest). Every call goes through [`VmSandbox::awake_agent`] or the
//! [`Sandbox`](crate::sandbox::Sandbox) calls, so a hibernated VM wakes
//! first; everything the guest returns is bounded before it is answered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use burrow_protocol::agent as pb;
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    AttachRequest, DirEntry, EditRequest, ExecOutput, ExecRequest, LsOutput, LsRequest, ReadOutput,
    ReadRequest, SessionOutput, SessionStarted, ToolReply, WriteRequest, MAX_ATTACH_BYTES,
    MAX_ATTACH_WAIT_SECS, MAX_EXEC_TIMEOUT_SECS, MAX_LS_ENTRIES, MAX_READ_SCAN, MAX_READ_TEXT,
    MAX_WRITE,
};

use super::agent::Agent;
use super::VmSandbox;
use crate::sandbox::{Result, SandboxError};
use crate::tools::text::{replace_unique, LinePager};
use crate::tools::Sink;

/// Longest name or link target `ls` passes on.
const MAX_NAME: usize = 4096;

tokio::task_local! {
    /// The container a tool request of the control socket names
    /// ([`SandboxRequest::In`]): set while it runs.
    pub(super) static TOOL_TARGET: String;
}

/// The container a tool request without a named one acts on, among
/// `containers` (containerd id -> contents) of sandbox `sandbox` (its
/// shim's id), or the one `target` names. A VM outside a pod runs one
/// container; a CRI pod's runs its sandbox ("pause") container and its
/// members: the pod's id means its only member, and with several the
/// error lists them, as tools never act on the pause container unasked.
fn pick(
    containers: &std::collections::HashMap<String, super::checkpoint::Contents>,
    sandbox: &str,
    target: Option<&str>,
) -> Result<(String, super::checkpoint::Contents)> {
    let listed = || {
        let mut ids: Vec<&str> = containers.keys().map(String::as_str).collect();
        ids.sort_unstable();
        ids.join(", ")
    };
    if let Some(t) = target {
        return containers
            .get_key_value(t)
            .map(|(id, c)| (id.clone(), c.clone()))
            .ok_or_else(|| {
                SandboxError::NotFound(format!(
                    "no container {t:?} in sandbox {sandbox:?} (it runs: {})",
                    listed()
                ))
            });
    }
    let mut members: Vec<(&String, &super::checkpoint::Contents)> = containers
        .iter()
        .filter(|(_, c)| super::pod::role(&c.spec) != super::pod::Role::Sandbox)
        .collect();
    members.sort_by(|a, b| a.0.cmp(b.0));
    match members.as_slice() {
        [(id, c)] => Ok(((*id).clone(), (*c).clone())),
        [] if containers.is_empty() => Err(SandboxError::FailedPrecondition(
            "the sandbox has no container".into(),
        )),
        [] => Err(SandboxError::FailedPrecondition(format!(
            "pod {sandbox:?} has no containers besides its sandbox ({}) yet; tools act on a pod's containers",
            listed()
        ))),
        many => Err(SandboxError::FailedPrecondition(format!(
            "pod {sandbox:?} runs {} containers: {}; address one by its container id",
            many.len(),
            many.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", ")
        ))),
    }
}

impl VmSandbox {
    /// Run tool request `req` (an error for the lifecycle requests).
    pub(super) async fn tool(&self, req: SandboxRequest) -> Result<ToolReply> {
        match req {
            SandboxRequest::Exec(r) => self.tool_exec(r).await.map(ToolReply::Exec),
            SandboxRequest::Detach(r) => self.tool_detach(r).await.map(ToolReply::Detach),
            SandboxRequest::Attach(r) => self.tool_attach(r).await.map(ToolReply::Attach),
            SandboxRequest::Read(r) => self.tool_read(r).await.map(ToolReply::Read),
            SandboxRequest::Write(r) => self.tool_write(r).await,
            SandboxRequest::Ls(r) => self.tool_ls(r).await.map(ToolReply::Ls),
            SandboxRequest::Edit(r) => self.tool_edit(r).await,
            r @ (SandboxRequest::Browse(_)
            | SandboxRequest::Click(_)
            | SandboxRequest::Type(_)
            | SandboxRequest::Screenshot(_)) => self.tool_browser(r).await,
            other => Err(SandboxError::InvalidArgument(format!(
                "{} is not a tool request",
                other.name()
            ))),
        }
    }

    /// The container the tools act on, with its containerd id: the one
    /// the request names ([`TOOL_TARGET`]), else the VM's only one (in a
    /// CRI pod, its only container besides the pod's sandbox).
    fn tool_container(&self) -> Result<(String, super::checkpoint::Contents)> {
        let target = TOOL_TARGET.try_with(Clone::clone).ok();
        pick(&self.registry(), &self.sandbox_id(), target.as_deref())
    }

    /// The containers this VM runs (containerd ids), a CRI pod's sandbox
    /// container first.
    pub(super) fn tool_containers(&self) -> Vec<String> {
        let reg = self.registry();
        let mut ids: Vec<(bool, String)> = reg
            .iter()
            .map(|(id, c)| {
                (
                    super::pod::role(&c.spec) != super::pod::Role::Sandbox,
                    id.clone(),
                )
            })
            .collect();
        ids.sort();
        ids.into_iter().map(|(_, id)| id).collect()
    }

    /// The agent (the VM woken if it sleeps) and the container's guest id.
    pub(super) async fn tool_agent(&self) -> Result<(Agent, String)> {
        let guest_id = self.tool_container()?.1.guest_id;
        Ok((self.awake_agent().await?, guest_id))
    }

    async fn tool_exec(&self, r: ExecRequest) -> Result<ExecOutput> {
        let cap = r.output_cap();
        self.tool_exec_to(r, Sink::Keep(cap), None).await
    }

    /// Run `r` in the container, its output going to `sink` (streamed to
    /// the control socket's caller, or kept for the reply), fed `input`
    /// if it is interactive ([`ExecRequest::stdin`]).
    pub(super) async fn tool_exec_to(
        &self,
        r: ExecRequest,
        sink: Sink,
        input: Option<tokio::sync::mpsc::Receiver<burrow_vmm_api::sandbox_tools::ExecInput>>,
    ) -> Result<ExecOutput> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        if r.stdin != input.is_some() {
            return Err(SandboxError::InvalidArgument(
                "an exec with stdin is streamed (stream and stdin go together)".into(),
            ));
        }
        let (id, c) = self.tool_container()?;
        let process = crate::tools::exec_process(c.spec.get("process"), &r)?;
        let timeout = Duration::from_secs(r.timeout_secs.clamp(1, MAX_EXEC_TIMEOUT_SECS));
        let me = self
            .me
            .upgrade()
            .ok_or_else(|| SandboxError::Unavailable("the sandbox is shutting down".into()))?;
        let exec_id = format!("burrow-tool-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        crate::tools::run_exec_to(me, &id, &exec_id, process, timeout, sink, input).await
    }

    /// Start `r` as a detached session: the agent keeps its output (the
    /// shim keeps nothing, so it is there after a wake or a restore).
    async fn tool_detach(&self, r: ExecRequest) -> Result<SessionStarted> {
        if r.stdin {
            return Err(SandboxError::InvalidArgument(
                "a detached session has no stdin".into(),
            ));
        }
        let (_, c) = self.tool_container()?;
        let process = crate::tools::exec_process(c.spec.get("process"), &r)?;
        let process = serde_json::to_vec(&process)
            .map_err(|e| SandboxError::Internal(format!("the exec's process: {e}")))?;
        let (agent, gid) = self.tool_agent().await?;
        let timeout = r.timeout_secs.min(MAX_EXEC_TIMEOUT_SECS);
        let (session, pid) = agent.start_session(&gid, &process, timeout).await?;
        Ok(SessionStarted { session, pid })
    }

    async fn tool_attach(&self, r: AttachRequest) -> Result<SessionOutput> {
        let (agent, _) = self.tool_agent().await?;
        let max = r
            .max_bytes
            .unwrap_or(MAX_ATTACH_BYTES)
            .clamp(1, MAX_ATTACH_BYTES);
        let wait = Duration::from_secs(r.wait_secs.min(MAX_ATTACH_WAIT_SECS));
        let reply = agent
            .read_session(&r.session, r.from, max as usize, wait)
            .await?;
        crate::tools::session::session_output(r.from, reply, max as usize, r.whole_lines)
    }

    async fn tool_read(&self, r: ReadRequest) -> Result<ReadOutput> {
        r.lines.check().map_err(SandboxError::InvalidArgument)?;
        let (agent, gid) = self.tool_agent().await?;
        let mut pager = LinePager::new(r.lines.first, r.lines.last_served(), MAX_READ_TEXT);
        let mut offset = 0u64;
        let counted = loop {
            let (data, _, eof) = agent
                .read_file(&gid, &r.path, offset, burrow_protocol::MAX_CHUNK)
                .await?;
            pager.feed(&data);
            offset = offset.saturating_add(data.len() as u64);
            if eof || data.is_empty() {
                break true;
            }
            if offset >= MAX_READ_SCAN {
                break false;
            }
        };
        let page = pager.finish();
        if page.first == 0 && r.lines.first > 1 {
            return Err(SandboxError::OutOfRange(if counted {
                format!(
                    "{} has {} lines: line {} is past its end",
                    r.path, page.lines, r.lines.first
                )
            } else {
                format!(
                    "line {} of {} is past the first {} MiB, which is all read reads",
                    r.lines.first,
                    r.path,
                    MAX_READ_SCAN >> 20
                )
            }));
        }
        Ok(ReadOutput {
            text: page.text,
            first: page.first,
            last: page.last,
            total: counted.then_some(page.lines),
            line_cut: page.line_cut,
        })
    }

    /// The permission bits a replacement of `path` keeps: the regular
    /// file's, 0 (0644) for a new one; an error for a directory.
    async fn kept_mode(agent: &Agent, gid: &str, path: &str) -> Result<u32> {
        match agent.stat(gid, path).await {
            Ok(info) if info.type_.enum_value() == Ok(pb::FileType::DIRECTORY) => Err(
                SandboxError::InvalidArgument(format!("{path} is a directory")),
            ),
            Ok(info) if info.type_.enum_value() == Ok(pb::FileType::REGULAR) => Ok(info.mode),
            Ok(_) | Err(SandboxError::NotFound(_)) => Ok(0),
            Err(e) => Err(e),
        }
    }

    async fn tool_write(&self, r: WriteRequest) -> Result<ToolReply> {
        if r.content.len() > MAX_WRITE {
            return Err(SandboxError::InvalidArgument(format!(
                "{} bytes is more than the {MAX_WRITE} one write carries",
                r.content.len()
            )));
        }
        let (agent, gid) = self.tool_agent().await?;
        let mode = Self::kept_mode(&agent, &gid, &r.path).await?;
        agent
            .write_file(&gid, &r.path, r.content.as_bytes(), mode)
            .await?;
        Ok(ToolReply::Write {
            bytes: r.content.len() as u64,
        })
    }

    async fn tool_ls(&self, r: LsRequest) -> Result<LsOutput> {
        let (agent, gid) = self.tool_agent().await?;
        let (infos, truncated) = agent.list_dir(&gid, &r.path, MAX_LS_ENTRIES).await?;
        let entries = infos
            .into_iter()
            .map(|i| {
                let kind = match i.type_.enum_value() {
                    Ok(pb::FileType::REGULAR) => "file",
                    Ok(pb::FileType::DIRECTORY) => "dir",
                    Ok(pb::FileType::SYMLINK) => "symlink",
                    _ => "other",
                };
                DirEntry {
                    name: cut(i.name),
                    kind: kind.into(),
                    size: i.size,
                    mode: i.mode & 0o7777,
                    target: (kind == "symlink").then(|| cut(i.symlink_target)),
                }
            })
            .collect();
        Ok(LsOutput { entries, truncated })
    }

    async fn tool_edit(&self, r: EditRequest) -> Result<ToolReply> {
        let (agent, gid) = self.tool_agent().await?;
        let info = agent.stat(&gid, &r.path).await?;
        if info.type_.enum_value() != Ok(pb::FileType::REGULAR) {
            return Err(SandboxError::InvalidArgument(format!(
                "{} is not a regular file",
                r.path
            )));
        }
        let too_big = || {
            SandboxError::InvalidArgument(format!(
                "{} is larger than the {MAX_WRITE} bytes edit changes at once",
                r.path
            ))
        };
        if info.size > MAX_WRITE as u64 {
            return Err(too_big());
        }
        let (data, _, eof) = agent.read_file(&gid, &r.path, 0, MAX_WRITE).await?;
        if !eof {
            return Err(too_big());
        }
        let text = String::from_utf8(data)
            .map_err(|_| SandboxError::InvalidArgument(format!("{} is not UTF-8 text", r.path)))?;
        let (new, line) = replace_unique(&text, &r.old, &r.new)
            .map_err(|e| SandboxError::InvalidArgument(format!("{}: {e}", r.path)))?;
        if new.len() > MAX_WRITE {
            return Err(too_big());
        }
        agent
            .write_file(&gid, &r.path, new.as_bytes(), info.mode)
            .await?;
        Ok(ToolReply::Edit {
            bytes: new.len() as u64,
            line,
        })
    }
}

/// `s` cut to [`MAX_NAME`] bytes (on a character boundary).
pub(super) fn cut(mut s: String) -> String {
    s.truncate(s.floor_char_boundary(MAX_NAME));
    s
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::vm::checkpoint::Contents;
    use crate::vm::rootfs::GuestRootfs;

    fn contents(cri_type: Option<&str>) -> Contents {
        let spec = match cri_type {
            Some(t) => {
                serde_json::json!({"annotations": {super::super::pod::CRI_CONTAINER_TYPE: t}})
            }
            None => serde_json::json!({}),
        };
        Contents {
            guest_id: "g".into(),
            rootfs: GuestRootfs {
                disk: "/d".into(),
                read_only: false,
                fstype: "ext4".into(),
                image: None,
                lower: None,
            },
            spec,
        }
    }

    #[test]
    fn tools_act_on_the_named_container_or_the_only_one_never_the_pause() {
        let id = |r: Result<(String, Contents)>| r.map(|(id, _)| id);
        // One container outside a pod.
        let mut m = HashMap::new();
        m.insert("c1".to_string(), contents(None));
        assert_eq!(id(pick(&m, "c1", None)).unwrap(), "c1");
        assert!(pick(&HashMap::new(), "c1", None).is_err());
        // A pod: the pause alone, then one member (the pod's id means it),
        // then two (named, or an error listing them).
        let mut pod = HashMap::new();
        pod.insert("pod1".to_string(), contents(Some("sandbox")));
        let e = pick(&pod, "pod1", None).unwrap_err().to_string();
        assert!(e.contains("no containers besides its sandbox"), "{e}");
        pod.insert("app".to_string(), contents(Some("container")));
        assert_eq!(id(pick(&pod, "pod1", None)).unwrap(), "app");
        pod.insert("side".to_string(), contents(Some("container")));
        let e = pick(&pod, "pod1", None).unwrap_err().to_string();
        assert!(
            e.contains("runs 2 containers: app, side; address one by its container id"),
            "{e}"
        );
        assert_eq!(id(pick(&pod, "pod1", Some("side"))).unwrap(), "side");
        assert_eq!(id(pick(&pod, "pod1", Some("pod1"))).unwrap(), "pod1");
        let e = pick(&pod, "pod1", Some("nope")).unwrap_err().to_string();
        assert!(e.contains("(it runs: app, pod1, side)"), "{e}");
    }
}
