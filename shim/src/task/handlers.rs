//! The task RPCs: each checks the state ([`super::state`]), makes one
//! sandbox call and publishes its event; the background work goes to
//! [`super::jobs`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use containerd_shim::api;
use containerd_shim::protos::cgroups_v2::metrics as v2;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskIO, TaskPaused, TaskResumed,
    TaskStart,
};
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::shim::oci::ProcessDetails;
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::ttrpc::r#async::TtrpcContext;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::ProcessInfo;
use containerd_shim::TtrpcResult;

use super::state::{Container, Exited, ProcState, Process};
use super::{
    checkpoint_options, fail, now, status, to_any, validate_id, TaskService, MAX_PROCESS_SPEC,
};
use crate::sandbox::{AfterCheckpoint, ContainerConfig, ExecConfig, RootfsMount};
use crate::spec;

/// The exit status of a task whose init could not be started (the shell's
/// "command not found", which the guest's child exits with too).
const EXEC_FAILED: u32 = 127;
use crate::stdio::{self, StdioPaths};

/// The stdio paths a Create or Exec names, checked.
fn checked_stdio(
    stdin: &str,
    stdout: &str,
    stderr: &str,
    terminal: bool,
) -> TtrpcResult<StdioPaths> {
    let paths = StdioPaths {
        stdin: stdin.to_string(),
        stdout: stdout.to_string(),
        stderr: stderr.to_string(),
        terminal,
    };
    stdio::validate(&paths).map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))?;
    Ok(paths)
}

/// The error for process `exec_id` of container `id`: "process id/exec_id
/// `what`".
fn process_error(code: Code, id: &str, exec_id: &str, what: &str) -> ttrpc::Error {
    status(code, format!("process {id}/{exec_id} {what}"))
}

fn container_exists<T>(id: &str) -> TtrpcResult<T> {
    fail(
        Code::ALREADY_EXISTS,
        format!("container {id} already exists"),
    )
}

/// The process spec of an Exec (bounded, valid JSON, a valid OCI
/// process), with the request's terminal flag set in it.
fn exec_process_spec(req: &api::ExecProcessRequest) -> TtrpcResult<serde_json::Value> {
    let value = req
        .spec
        .as_ref()
        .map(|a| a.value.as_slice())
        .unwrap_or_default();
    if value.len() > MAX_PROCESS_SPEC {
        return fail(
            Code::INVALID_ARGUMENT,
            format!(
                "process spec of {} bytes exceeds {MAX_PROCESS_SPEC}",
                value.len()
            ),
        );
    }
    let invalid = |e: &dyn std::fmt::Display| {
        status(Code::INVALID_ARGUMENT, format!("exec {}: {e}", req.exec_id))
    };
    let mut process: serde_json::Value = serde_json::from_slice(value)
        .map_err(|e| invalid(&format!("process spec is not valid JSON: {e}")))?;
    spec::validate_process(&process).map_err(|e| invalid(&e))?;
    if let Some(obj) = process.as_object_mut() {
        obj.insert("terminal".into(), serde_json::Value::Bool(req.terminal));
    }
    Ok(process)
}

impl TaskService {
    async fn create_reserved(
        &self,
        req: &api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let stdio = checked_stdio(&req.stdin, &req.stdout, &req.stderr, req.terminal)?;
        let spec = Self::read_bundle_spec(&req.bundle)?;
        let cfg = ContainerConfig {
            id: req.id.clone(),
            bundle: PathBuf::from(&req.bundle),
            spec,
            rootfs: req
                .rootfs
                .iter()
                .map(|m| RootfsMount {
                    kind: m.type_.clone(),
                    source: m.source.clone(),
                    options: m.options.clone(),
                })
                .collect(),
            stdin: !req.stdin.is_empty(),
        };
        // A restored pod's container continues (its process runs already);
        // else containerd's checkpoint (ctr c restore), else a named one.
        let taken = self.sandbox().take_over_restored(&cfg).await?;
        let from = if taken.is_some() {
            None
        } else if !req.checkpoint.is_empty() {
            Some(PathBuf::from(&req.checkpoint))
        } else if let Some(name) = spec::restore_name(&cfg.spec) {
            Some(self.sandbox().named_checkpoint(name)?)
        } else {
            None
        };
        let restored = from.is_some() || taken.is_some();
        let pid = if let Some(pid) = taken {
            pid
        } else if let Some(from) = from {
            self.sandbox().restore_container(&cfg, &from).await?
        } else {
            self.sandbox().create_container(&cfg).await?
        };
        if restored {
            // The restored guest counts the OOM kills from before its
            // checkpoint: those are not news to this task.
            match self.sandbox().oom_kills(&req.id).await {
                Ok(kills) => {
                    self.seen_oom(&req.id, kills);
                }
                Err(e) => tracing::warn!("{}: reading the guest's OOM kills: {e}", req.id),
            }
        }
        let raced = {
            let mut st = self.lock();
            if st.containers.contains_key(&req.id) {
                true
            } else {
                st.containers.insert(
                    req.id.clone(),
                    Container {
                        bundle: req.bundle.clone(),
                        init: Process {
                            restored,
                            ..Process::new(pid, stdio.clone(), None)
                        },
                        execs: HashMap::new(),
                    },
                );
                false
            }
        };
        if raced {
            let _ = self.sandbox().delete_container(&req.id).await;
            return container_exists(&req.id);
        }
        self.publish(TaskCreate {
            container_id: req.id.clone(),
            bundle: req.bundle.clone(),
            rootfs: req.rootfs.clone(),
            io: MessageField::some(TaskIO {
                stdin: stdio.stdin,
                stdout: stdio.stdout,
                stderr: stdio.stderr,
                terminal: stdio.terminal,
                ..Default::default()
            }),
            pid,
            ..Default::default()
        })
        .await;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    /// Pause (or resume) container `id`'s sandbox; publishes TaskPaused
    /// (TaskResumed).
    async fn set_paused(&self, id: &str, pause: bool) -> TtrpcResult<api::Empty> {
        {
            let st = self.lock();
            let c = st.container(id)?;
            if pause {
                c.require_running(id)?;
            }
            if st.paused == pause {
                let already = if pause { "already" } else { "not" };
                return fail(
                    Code::FAILED_PRECONDITION,
                    format!("container {id} is {already} paused"),
                );
            }
        }
        if pause {
            self.sandbox().pause().await?;
        } else {
            self.sandbox().resume().await?;
        }
        self.lock().paused = pause;
        let container_id = id.to_string();
        if pause {
            self.publish(TaskPaused {
                container_id,
                ..Default::default()
            })
            .await;
        } else {
            self.publish(TaskResumed {
                container_id,
                ..Default::default()
            })
            .await;
        }
        Ok(api::Empty::default())
    }

    async fn start_process(&self, req: &api::StartRequest) -> TtrpcResult<api::StartResponse> {
        let (stdio, exec, restored) = {
            let st = self.lock();
            let (c, p) = st.process(&req.id, &req.exec_id)?;
            if p.state != ProcState::Created {
                return Err(process_error(
                    Code::FAILED_PRECONDITION,
                    &req.id,
                    &req.exec_id,
                    "was already started",
                ));
            }
            if !req.exec_id.is_empty() {
                c.require_running(&req.id)?;
            }
            (p.stdio.clone(), p.exec.clone(), p.restored)
        };
        let pid = if req.exec_id.is_empty() {
            if !restored {
                let t = std::time::Instant::now();
                let r = self.sandbox().start_container(&req.id).await;
                // Where a start's time goes (bench/runtimes reads these).
                tracing::info!("{}: started in {} ms", req.id, t.elapsed().as_millis());
                if let Err(e) = r {
                    // Its init never ran (exec failed in the guest, say): a
                    // task that has ended, as runc's does, so that a wait
                    // returns and a delete (CRI's cleanup) goes through.
                    self.process_exited(&req.id, "", EXEC_FAILED).await;
                    return Err(e.into());
                }
            }
            self.lock()
                .containers
                .get(&req.id)
                .map_or(0, |c| c.init.pid)
        } else {
            let exec = exec.ok_or_else(|| status(Code::INTERNAL, "exec without a process spec"))?;
            self.sandbox()
                .exec_process(&req.id, &req.exec_id, &exec)
                .await?
        };
        let (pumps, stdin_close) = self.spawn_process_tasks(&req.id, &req.exec_id, &stdio);
        {
            let mut st = self.lock();
            let Some(p) = st.process_mut(&req.id, &req.exec_id) else {
                for p in pumps {
                    p.abort();
                }
                return Err(process_error(
                    Code::NOT_FOUND,
                    &req.id,
                    &req.exec_id,
                    "not found",
                ));
            };
            p.pid = pid;
            p.state = ProcState::Running;
            p.pumps = pumps;
            p.stdin_close = stdin_close;
        }
        self.spawn_waiter(req.id.clone(), req.exec_id.clone());
        if req.exec_id.is_empty() {
            self.spawn_oom_watcher(req.id.clone());
            self.publish(TaskStart {
                container_id: req.id.clone(),
                pid,
                ..Default::default()
            })
            .await;
        } else {
            self.publish(TaskExecStarted {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                pid,
                ..Default::default()
            })
            .await;
        }
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }
}

#[async_trait]
impl Task for TaskService {
    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let st = self.lock();
        let (c, p) = st.process(&req.id, &req.exec_id)?;
        Ok(api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.clone(),
            pid: p.pid,
            status: p.status(st.paused).into(),
            stdin: p.stdio.stdin.clone(),
            stdout: p.stdio.stdout.clone(),
            stderr: p.stdio.stderr.clone(),
            terminal: p.stdio.terminal,
            exit_status: p.exited.as_ref().map_or(0, |e| e.status),
            exited_at: p.exited.as_ref().map(|e| e.at.clone()).into(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        validate_id("container id", &req.id)?;
        if !req.parent_checkpoint.is_empty() {
            return fail(
                Code::UNIMPLEMENTED,
                "creating a task from a parent checkpoint (incremental) is not supported",
            );
        }
        {
            let mut st = self.lock();
            if st.containers.contains_key(&req.id) || !st.creating.insert(req.id.clone()) {
                return container_exists(&req.id);
            }
        }
        let r = self.create_reserved(&req).await;
        self.lock().creating.remove(&req.id);
        r
    }

    async fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        self.start_process(&req).await
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let (pid, exited, started) = {
            let st = self.lock();
            let (c, p) = st.process(&req.id, &req.exec_id)?;
            if p.state == ProcState::Running {
                return Err(process_error(
                    Code::FAILED_PRECONDITION,
                    &req.id,
                    &req.exec_id,
                    "is still running",
                ));
            }
            if req.exec_id.is_empty() {
                if let Some((eid, _)) = c.execs.iter().find(|(_, e)| e.state == ProcState::Running)
                {
                    let msg = format!("exec {eid} of {} is still running", req.id);
                    return fail(Code::FAILED_PRECONDITION, msg);
                }
            }
            (p.pid, p.exited.clone(), p.state == ProcState::Stopped)
        };
        let exited = exited.unwrap_or_else(|| Exited {
            status: 0,
            at: now(),
        });
        if req.exec_id.is_empty() {
            let t = std::time::Instant::now();
            self.sandbox().delete_container(&req.id).await?;
            tracing::info!("{}: deleted in {} ms", req.id, t.elapsed().as_millis());
            self.lock().containers.remove(&req.id);
            self.publish(TaskDelete {
                container_id: req.id.clone(),
                pid,
                exit_status: exited.status,
                exited_at: MessageField::some(exited.at.clone()),
                id: req.id.clone(),
                ..Default::default()
            })
            .await;
            self.tear_down_if_empty().await;
        } else {
            if started {
                if let Err(e) = self.sandbox().delete_process(&req.id, &req.exec_id).await {
                    tracing::debug!("{}/{}: deleting in the sandbox: {e}", req.id, req.exec_id);
                }
            }
            if let Some(c) = self.lock().containers.get_mut(&req.id) {
                c.execs.remove(&req.exec_id);
            }
        }
        Ok(api::DeleteResponse {
            pid,
            exit_status: exited.status,
            exited_at: MessageField::some(exited.at),
            ..Default::default()
        })
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        self.lock().container(&req.id)?;
        let procs = self.sandbox().processes(&req.id).await?;
        let mut processes = Vec::with_capacity(procs.len());
        for p in procs {
            let info = if p.exec_id.is_empty() {
                MessageField::none()
            } else {
                let details = ProcessDetails {
                    exec_id: p.exec_id.clone(),
                    ..Default::default()
                };
                MessageField::some(to_any(&details)?)
            };
            processes.push(ProcessInfo {
                pid: p.pid,
                info,
                ..Default::default()
            });
        }
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, true).await
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, false).await
    }

    async fn checkpoint(
        &self,
        _ctx: &TtrpcContext,
        req: api::CheckpointTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        let paused = {
            let st = self.lock();
            let c = st.container(&req.id)?;
            c.require_running(&req.id)?;
            st.paused
        };
        if req.path.is_empty() {
            let msg = "checkpoint: no path to write the checkpoint to";
            return fail(Code::INVALID_ARGUMENT, msg);
        }
        let after = if checkpoint_options(req.options.as_ref())?.exit {
            AfterCheckpoint::Exit
        } else if paused {
            AfterCheckpoint::StayPaused
        } else {
            AfterCheckpoint::Resume
        };
        tracing::info!("{}: checkpoint to {} ({after:?})", req.id, req.path);
        self.sandbox()
            .checkpoint(Path::new(&req.path), after)
            .await?;
        Ok(api::Empty::default())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let refused = match self.lock().process(&req.id, &req.exec_id)?.1.state {
            ProcState::Stopped if !req.all => Some((Code::NOT_FOUND, "already finished")),
            ProcState::Created if !req.exec_id.is_empty() => {
                Some((Code::FAILED_PRECONDITION, "was not started"))
            }
            _ => None,
        };
        if let Some((code, what)) = refused {
            return Err(process_error(code, &req.id, &req.exec_id, what));
        }
        if req.signal == 0 || req.signal > 64 {
            return fail(
                Code::INVALID_ARGUMENT,
                format!("invalid signal {}", req.signal),
            );
        }
        let (id, exec_id) = (&req.id, &req.exec_id);
        self.sandbox()
            .signal(id, exec_id, req.signal, req.all)
            .await?;
        Ok(api::Empty::default())
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        validate_id("exec id", &req.exec_id)?;
        let stdio = checked_stdio(&req.stdin, &req.stdout, &req.stderr, req.terminal)?;
        let process = exec_process_spec(&req)?;
        {
            let mut st = self.lock();
            let c = st.container_mut(&req.id)?;
            c.require_running(&req.id)?;
            if c.execs.contains_key(&req.exec_id) {
                let msg = format!("exec {} already exists in {}", req.exec_id, req.id);
                return fail(Code::ALREADY_EXISTS, msg);
            }
            let exec = ExecConfig {
                process,
                stdin: !req.stdin.is_empty(),
            };
            c.execs
                .insert(req.exec_id.clone(), Process::new(0, stdio, Some(exec)));
        }
        self.publish(TaskExecAdded {
            container_id: req.id.clone(),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
        .await;
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let (id, exec_id) = (&req.id, &req.exec_id);
        let (terminal, state) = {
            let st = self.lock();
            let p = st.process(id, exec_id)?.1;
            (p.stdio.terminal, p.state)
        };
        if !terminal {
            return Err(process_error(
                Code::FAILED_PRECONDITION,
                id,
                exec_id,
                "has no terminal",
            ));
        }
        // Resizing before start or after exit is harmless: ignore it.
        if state == ProcState::Running {
            self.sandbox()
                .resize_pty(id, exec_id, req.height, req.width)
                .await?;
        }
        Ok(api::Empty::default())
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        let pump = {
            let st = self.lock();
            let (_, p) = st.process(&req.id, &req.exec_id)?;
            if !req.stdin || p.state != ProcState::Running {
                return Ok(api::Empty::default());
            }
            p.stdin_close
                .as_ref()
                .map(|tx| tx.send_replace(true))
                .is_some()
        };
        if !pump {
            self.sandbox().close_stdin(&req.id, &req.exec_id).await?;
        }
        Ok(api::Empty::default())
    }

    async fn update(
        &self,
        _ctx: &TtrpcContext,
        req: api::UpdateTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        self.lock().container(&req.id)?;
        let Some(any) = req.resources.as_ref().filter(|r| !r.value.is_empty()) else {
            return Ok(api::Empty::default());
        };
        // containerd sends the OCI LinuxResources as JSON (typeurl).
        if !any.type_url.ends_with("/LinuxResources") {
            return fail(
                Code::INVALID_ARGUMENT,
                format!(
                    "task {}: resources of type {:?} are not Linux resources",
                    req.id, any.type_url
                ),
            );
        }
        // The container's cgroup in the guest takes them; the VM's own
        // vCPUs and memory stay as they booted.
        self.sandbox().update_resources(&req.id, &any.value).await?;
        Ok(api::Empty::default())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let mut rx = self
            .lock()
            .process(&req.id, &req.exec_id)?
            .1
            .exit_tx
            .subscribe();
        let exited = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| process_error(Code::NOT_FOUND, &req.id, &req.exec_id, "was deleted"))?
            .clone()
            .ok_or_else(|| status(Code::INTERNAL, "exit status missing"))?;
        Ok(api::WaitResponse {
            exit_status: exited.status,
            exited_at: MessageField::some(exited.at),
            ..Default::default()
        })
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        self.lock().container(&req.id)?;
        let s = self.sandbox().stats(&req.id).await?;
        let metrics = v2::Metrics {
            pids: MessageField::some(v2::PidsStat {
                current: s.pids,
                ..Default::default()
            }),
            cpu: MessageField::some(v2::CPUStat {
                usage_usec: s.cpu_usage_usec,
                ..Default::default()
            }),
            memory: MessageField::some(v2::MemoryStat {
                usage: s.memory_bytes,
                usage_limit: s.memory_limit_bytes,
                ..Default::default()
            }),
            ..Default::default()
        };
        Ok(api::StatsResponse {
            stats: MessageField::some(to_any(&metrics)?),
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let task_pid = self
            .lock()
            .containers
            .get(&req.id)
            .map_or(0, |c| c.init.pid);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: format!("burrow {}", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        })
    }

    async fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ShutdownRequest,
    ) -> TtrpcResult<api::Empty> {
        // containerd calls this after each Delete; the shim serves a whole
        // sandbox, so it only goes once its last container is gone.
        if self.container_count() > 0 {
            return Ok(api::Empty::default());
        }
        // Normally done by the last Delete already.
        self.tear_down_if_empty().await;
        self.inner.exit.signal();
        Ok(api::Empty::default())
    }
}
