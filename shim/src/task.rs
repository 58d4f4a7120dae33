//! containerd's task API v2, implemented on top of a [`Sandbox`].
//!
//! This is the containerd-facing state machine: which containers and
//! processes exist, their states, exit statuses and times, the stdio pumps,
//! and the events containerd expects. It knows nothing about VMs, so the
//! unit tests drive it in-process with a fake sandbox.
//!
//! Every RPC of the `Task` service is implemented here explicitly; none falls
//! back to the generated "not supported" default. `Checkpoint` writes a
//! whole-VM checkpoint and Create with `checkpoint` restores one (see
//! `vm::snapshot` for the layout); `Update` with resources answers UNIMPLEMENTED (a VM's vCPUs and memory
//! are fixed at boot; there is no hotplug yet).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use containerd_shim::api;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::protos::cgroups_v2::metrics as v2;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO, TaskOOM, TaskPaused,
    TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{MessageDyn, MessageField};
use containerd_shim::protos::shim::oci::ProcessDetails;
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::ttrpc::r#async::TtrpcContext;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::{ProcessInfo, Status};
use containerd_shim::TtrpcResult;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::events::{send, EventSink};
use crate::sandbox::{
    AfterCheckpoint, ContainerConfig, ExecConfig, RootfsMount, Sandbox, SandboxError, Stream,
};
use crate::spec;
use crate::stdio::{self, StdioPaths};

/// How long a process's exit waits for its output to drain before the exit
/// is reported anyway.
pub const DEFAULT_IO_DRAIN: Duration = Duration::from_secs(5);

/// Longest exec'd process spec (JSON) accepted.
pub const MAX_PROCESS_SPEC: usize = 256 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ProcState {
    Created,
    Running,
    Stopped,
}

#[derive(Debug, Clone)]
struct Exited {
    status: u32,
    at: Timestamp,
}

struct Process {
    pid: u32,
    state: ProcState,
    stdio: StdioPaths,
    exited: Option<Exited>,
    exit_tx: watch::Sender<Option<Exited>>,
    /// For exec'd processes not started yet.
    exec: Option<ExecConfig>,
    stdin_close: Option<watch::Sender<bool>>,
    pumps: Vec<JoinHandle<()>>,
    /// Init of a task restored from a checkpoint: it runs already, Start
    /// only attaches stdio and the exit watcher.
    restored: bool,
}

impl Process {
    fn new(pid: u32, stdio: StdioPaths, exec: Option<ExecConfig>) -> Self {
        let (exit_tx, _) = watch::channel(None);
        Self {
            pid,
            state: ProcState::Created,
            stdio,
            exited: None,
            exit_tx,
            exec,
            stdin_close: None,
            pumps: Vec::new(),
            restored: false,
        }
    }

    fn status(&self, paused: bool) -> Status {
        match self.state {
            ProcState::Created => Status::CREATED,
            ProcState::Running if paused => Status::PAUSED,
            ProcState::Running => Status::RUNNING,
            ProcState::Stopped => Status::STOPPED,
        }
    }
}

struct Container {
    bundle: String,
    init: Process,
    execs: HashMap<String, Process>,
}

impl Container {
    fn process(&self, exec_id: &str) -> Option<&Process> {
        if exec_id.is_empty() {
            Some(&self.init)
        } else {
            self.execs.get(exec_id)
        }
    }
    fn process_mut(&mut self, exec_id: &str) -> Option<&mut Process> {
        if exec_id.is_empty() {
            Some(&mut self.init)
        } else {
            self.execs.get_mut(exec_id)
        }
    }
}

#[derive(Default)]
struct State {
    containers: HashMap<String, Container>,
    /// Ids whose Create is in progress.
    creating: std::collections::HashSet<String>,
    paused: bool,
}

struct Inner {
    sandbox: Arc<dyn Sandbox>,
    events: Arc<dyn EventSink>,
    exit: Arc<ExitSignal>,
    state: Mutex<State>,
    io_drain: Duration,
    /// Guest OOM kills already published as TaskOOM.
    oom_seen: std::sync::atomic::AtomicU64,
}

/// The task service containerd talks to. Cheap to clone.
#[derive(Clone)]
pub struct TaskService {
    inner: Arc<Inner>,
}

fn status(code: Code, msg: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg.into()))
}

fn not_found(what: impl std::fmt::Display) -> ttrpc::Error {
    status(Code::NOT_FOUND, format!("{what} not found"))
}

impl From<SandboxError> for ttrpc::Error {
    fn from(e: SandboxError) -> Self {
        let code = match &e {
            SandboxError::NotFound(_) => Code::NOT_FOUND,
            SandboxError::InvalidArgument(_) => Code::INVALID_ARGUMENT,
            SandboxError::AlreadyExists(_) => Code::ALREADY_EXISTS,
            SandboxError::FailedPrecondition(_) => Code::FAILED_PRECONDITION,
            SandboxError::Unimplemented(_) => Code::UNIMPLEMENTED,
            SandboxError::Timeout(_) => Code::DEADLINE_EXCEEDED,
            SandboxError::Unavailable(_) => Code::UNAVAILABLE,
            SandboxError::Internal(_) => Code::INTERNAL,
        };
        status(code, e.to_string())
    }
}

/// The current time as a protobuf timestamp.
pub fn now() -> Timestamp {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
        ..Default::default()
    }
}

/// Check a container or exec id: non-empty, bounded, and safe as a path
/// component.
pub fn validate_id(kind: &str, id: &str) -> Result<(), ttrpc::Error> {
    if crate::is_plain_name(id, burrow_protocol::MAX_ID_LEN) {
        Ok(())
    } else {
        Err(status(
            Code::INVALID_ARGUMENT,
            format!(
                "invalid {kind} {id:?}: want 1..={} characters of [A-Za-z0-9_.-]",
                burrow_protocol::MAX_ID_LEN
            ),
        ))
    }
}

/// Whether checkpoint options ask to stop the task afterwards. containerd
/// sends runc's `containerd.runc.v1.CheckpointOptions` (from `ctr c
/// checkpoint`; `ctr task checkpoint` sends none to non-runc runtimes),
/// whose field 1 is `bool exit`. Proto3 writes fields in number order, so a
/// set `exit` is the leading bytes `08 01`.
fn checkpoint_exit(options: Option<&Any>) -> bool {
    options.is_some_and(|o| {
        o.type_url.ends_with("containerd.runc.v1.CheckpointOptions")
            && o.value.starts_with(&[0x08, 0x01])
    })
}

/// Refuse unless container `id`'s init runs.
fn require_running(c: &Container, id: &str) -> TtrpcResult<()> {
    if c.init.state == ProcState::Running {
        Ok(())
    } else {
        Err(status(
            Code::FAILED_PRECONDITION,
            format!("container {id} is not running"),
        ))
    }
}

fn to_any(msg: &dyn MessageDyn) -> TtrpcResult<Any> {
    let mut value = Vec::new();
    msg.write_to_vec_dyn(&mut value)
        .map_err(|e| status(Code::INTERNAL, format!("encoding {e}")))?;
    Ok(Any {
        type_url: msg.descriptor_dyn().full_name().to_string(),
        value,
        ..Default::default()
    })
}

impl TaskService {
    pub fn new(
        sandbox: Arc<dyn Sandbox>,
        events: Arc<dyn EventSink>,
        exit: Arc<ExitSignal>,
    ) -> Self {
        Self::with_io_drain(sandbox, events, exit, DEFAULT_IO_DRAIN)
    }

    pub fn with_io_drain(
        sandbox: Arc<dyn Sandbox>,
        events: Arc<dyn EventSink>,
        exit: Arc<ExitSignal>,
        io_drain: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                sandbox,
                events,
                exit,
                state: Mutex::new(State::default()),
                io_drain,
                oom_seen: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Number of containers this shim still tracks.
    pub fn container_count(&self) -> usize {
        self.lock().containers.len()
    }

    /// Start the stdio pumps and the exit watcher of a process that has just
    /// been started in the sandbox.
    fn spawn_process_tasks(
        &self,
        id: &str,
        exec_id: &str,
        stdio: &StdioPaths,
    ) -> (Vec<JoinHandle<()>>, Option<watch::Sender<bool>>) {
        let sb = self.inner.sandbox.clone();
        let mut pumps = vec![tokio::spawn(stdio::pump_output(
            sb.clone(),
            id.to_string(),
            exec_id.to_string(),
            Stream::Stdout,
            stdio.stdout.clone(),
        ))];
        if !stdio.terminal {
            pumps.push(tokio::spawn(stdio::pump_output(
                sb.clone(),
                id.to_string(),
                exec_id.to_string(),
                Stream::Stderr,
                stdio.stderr.clone(),
            )));
        }
        let stdin_close = if stdio.stdin.is_empty() {
            None
        } else {
            let (tx, rx) = watch::channel(false);
            tokio::spawn(stdio::pump_stdin(
                sb,
                id.to_string(),
                exec_id.to_string(),
                stdio.stdin.clone(),
                rx,
            ));
            Some(tx)
        };
        (pumps, stdin_close)
    }

    /// Publish containerd's TaskOOM for container `id` if the guest's OOM
    /// kill count `kills` is news.
    async fn note_oom(&self, id: &str, kills: u64) {
        let before = self
            .inner
            .oom_seen
            .fetch_max(kills, std::sync::atomic::Ordering::SeqCst);
        if kills > before {
            tracing::warn!("{id}: the guest's OOM killer killed a process ({kills} so far)");
            send(
                self.inner.events.as_ref(),
                TaskOOM {
                    container_id: id.to_string(),
                    ..Default::default()
                },
            )
            .await;
        }
    }

    fn oom_seen(&self) -> u64 {
        self.inner
            .oom_seen
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Publish TaskOOM for container `id` each time the sandbox's OOM
    /// killer strikes, until the sandbox is gone.
    fn spawn_oom_watcher(&self, id: String) {
        let this = self.clone();
        tokio::spawn(async move {
            tracing::info!("{id}: watching the guest's OOM kills");
            loop {
                match this.inner.sandbox.wait_oom(this.oom_seen()).await {
                    Ok(kills) => this.note_oom(&id, kills).await,
                    Err(e) => {
                        tracing::info!("{id}: no more OOM events: {e}");
                        break;
                    }
                }
            }
        });
    }

    fn spawn_waiter(&self, id: String, exec_id: String) {
        let this = self.clone();
        tokio::spawn(async move {
            let status = match this.inner.sandbox.wait(&id, &exec_id).await {
                Ok(s) => s.containerd_status(),
                Err(e) => {
                    tracing::error!("{id}/{exec_id}: lost the process: {e}");
                    255
                }
            };
            // A SIGKILL may be the OOM killer's: containerd learns of the
            // OOM before the exit, as with runc. The guest counts the kill
            // before the process is gone, so this answers at once if so.
            if status == 128 + 9 {
                let check = this.inner.sandbox.wait_oom(this.oom_seen());
                if let Ok(Ok(kills)) = tokio::time::timeout(Duration::from_secs(1), check).await {
                    this.note_oom(&id, kills).await;
                }
            }
            this.process_exited(&id, &exec_id, status).await;
        });
    }

    async fn process_exited(&self, id: &str, exec_id: &str, exit_status: u32) {
        // Let the output drain first, so that containerd has all of it when
        // it learns of the exit.
        let pumps = {
            let mut st = self.lock();
            match st
                .containers
                .get_mut(id)
                .and_then(|c| c.process_mut(exec_id))
            {
                Some(p) => std::mem::take(&mut p.pumps),
                None => Vec::new(),
            }
        };
        for mut pump in pumps {
            if tokio::time::timeout(self.inner.io_drain, &mut pump)
                .await
                .is_err()
            {
                tracing::warn!(
                    "{id}/{exec_id}: output did not drain in {:?}",
                    self.inner.io_drain
                );
                pump.abort();
            }
        }
        let exited = Exited {
            status: exit_status,
            at: now(),
        };
        let pid = {
            let mut st = self.lock();
            let Some(p) = st
                .containers
                .get_mut(id)
                .and_then(|c| c.process_mut(exec_id))
            else {
                return;
            };
            p.state = ProcState::Stopped;
            p.exited = Some(exited.clone());
            // Dropping the sender ends the stdin pump.
            p.stdin_close = None;
            p.pid
        };
        send(
            self.inner.events.as_ref(),
            TaskExit {
                container_id: id.to_string(),
                id: if exec_id.is_empty() {
                    id.to_string()
                } else {
                    exec_id.to_string()
                },
                pid,
                exit_status,
                exited_at: MessageField::some(exited.at.clone()),
                ..Default::default()
            },
        )
        .await;
        let st = self.lock();
        if let Some(p) = st.containers.get(id).and_then(|c| c.process(exec_id)) {
            p.exit_tx.send_replace(Some(exited));
        }
    }

    fn read_bundle_spec(bundle: &str) -> TtrpcResult<serde_json::Value> {
        spec::read_spec(Path::new(bundle))
            .map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))
    }
}

impl TaskService {
    async fn create_reserved(
        &self,
        req: &api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let stdio = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        stdio::validate(&stdio).map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))?;
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
        // containerd's checkpoint (ctr c restore), else a named one.
        let from = if !req.checkpoint.is_empty() {
            Some(PathBuf::from(&req.checkpoint))
        } else if let Some(name) = spec::annotation(&cfg.spec, spec::ANNOTATION_RESTORE) {
            Some(self.inner.sandbox.named_checkpoint(name)?)
        } else {
            None
        };
        let restored = from.is_some();
        let pid = if let Some(from) = from {
            let pid = self.inner.sandbox.restore_container(&cfg, &from).await?;
            // The restored guest counts the OOM kills from before its
            // checkpoint: those are not news to this task.
            match self.inner.sandbox.oom_kills().await {
                Ok(kills) => {
                    self.inner
                        .oom_seen
                        .fetch_max(kills, std::sync::atomic::Ordering::SeqCst);
                }
                Err(e) => tracing::warn!("{}: reading the guest's OOM kills: {e}", req.id),
            }
            pid
        } else {
            self.inner.sandbox.create_container(&cfg).await?
        };
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
            let _ = self.inner.sandbox.delete_container(&req.id).await;
            return Err(status(
                Code::ALREADY_EXISTS,
                format!("container {} already exists", req.id),
            ));
        }
        send(
            self.inner.events.as_ref(),
            TaskCreate {
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
            },
        )
        .await;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start_process(&self, req: &api::StartRequest) -> TtrpcResult<api::StartResponse> {
        let (stdio, exec, restored) = {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            if p.state != ProcState::Created {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("process {}/{} was already started", req.id, req.exec_id),
                ));
            }
            if !req.exec_id.is_empty() {
                require_running(c, &req.id)?;
            }
            (p.stdio.clone(), p.exec.clone(), p.restored)
        };
        let pid = if req.exec_id.is_empty() {
            if !restored {
                self.inner.sandbox.start_container(&req.id).await?;
            }
            self.lock()
                .containers
                .get(&req.id)
                .map_or(0, |c| c.init.pid)
        } else {
            let exec = exec.ok_or_else(|| status(Code::INTERNAL, "exec without a process spec"))?;
            self.inner
                .sandbox
                .exec_process(&req.id, &req.exec_id, &exec)
                .await?
        };
        let (pumps, stdin_close) = self.spawn_process_tasks(&req.id, &req.exec_id, &stdio);
        {
            let mut st = self.lock();
            let Some(p) = st
                .containers
                .get_mut(&req.id)
                .and_then(|c| c.process_mut(&req.exec_id))
            else {
                for p in pumps {
                    p.abort();
                }
                return Err(not_found(format!("process {}/{}", req.id, req.exec_id)));
            };
            p.pid = pid;
            p.state = ProcState::Running;
            p.pumps = pumps;
            p.stdin_close = stdin_close;
        }
        self.spawn_waiter(req.id.clone(), req.exec_id.clone());
        if req.exec_id.is_empty() {
            self.spawn_oom_watcher(req.id.clone());
            send(
                self.inner.events.as_ref(),
                TaskStart {
                    container_id: req.id.clone(),
                    pid,
                    ..Default::default()
                },
            )
            .await;
        } else {
            send(
                self.inner.events.as_ref(),
                TaskExecStarted {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    pid,
                    ..Default::default()
                },
            )
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
        let c = st
            .containers
            .get(&req.id)
            .ok_or_else(|| not_found(format!("container {}", req.id)))?;
        let p = c
            .process(&req.exec_id)
            .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
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
            return Err(status(
                Code::UNIMPLEMENTED,
                "creating a task from a parent checkpoint (incremental) is not supported",
            ));
        }
        {
            let mut st = self.lock();
            if st.containers.contains_key(&req.id) || !st.creating.insert(req.id.clone()) {
                return Err(status(
                    Code::ALREADY_EXISTS,
                    format!("container {} already exists", req.id),
                ));
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
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            if p.state == ProcState::Running {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("process {}/{} is still running", req.id, req.exec_id),
                ));
            }
            if req.exec_id.is_empty() {
                if let Some((eid, _)) = c.execs.iter().find(|(_, e)| e.state == ProcState::Running)
                {
                    return Err(status(
                        Code::FAILED_PRECONDITION,
                        format!("exec {eid} of {} is still running", req.id),
                    ));
                }
            }
            (p.pid, p.exited.clone(), p.state == ProcState::Stopped)
        };
        let exited = exited.unwrap_or_else(|| Exited {
            status: 0,
            at: now(),
        });
        if req.exec_id.is_empty() {
            self.inner.sandbox.delete_container(&req.id).await?;
            self.lock().containers.remove(&req.id);
            send(
                self.inner.events.as_ref(),
                TaskDelete {
                    container_id: req.id.clone(),
                    pid,
                    exit_status: exited.status,
                    exited_at: MessageField::some(exited.at.clone()),
                    id: req.id.clone(),
                    ..Default::default()
                },
            )
            .await;
        } else {
            if started {
                if let Err(e) = self
                    .inner
                    .sandbox
                    .delete_process(&req.id, &req.exec_id)
                    .await
                {
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
        if !self.lock().containers.contains_key(&req.id) {
            return Err(not_found(format!("container {}", req.id)));
        }
        let procs = self.inner.sandbox.processes(&req.id).await?;
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
        {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            require_running(c, &req.id)?;
            if st.paused {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("container {} is already paused", req.id),
                ));
            }
        }
        self.inner.sandbox.pause().await?;
        self.lock().paused = true;
        send(
            self.inner.events.as_ref(),
            TaskPaused {
                container_id: req.id.clone(),
                ..Default::default()
            },
        )
        .await;
        Ok(api::Empty::default())
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        {
            let st = self.lock();
            if !st.containers.contains_key(&req.id) {
                return Err(not_found(format!("container {}", req.id)));
            }
            if !st.paused {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("container {} is not paused", req.id),
                ));
            }
        }
        self.inner.sandbox.resume().await?;
        self.lock().paused = false;
        send(
            self.inner.events.as_ref(),
            TaskResumed {
                container_id: req.id.clone(),
                ..Default::default()
            },
        )
        .await;
        Ok(api::Empty::default())
    }

    async fn checkpoint(
        &self,
        _ctx: &TtrpcContext,
        req: api::CheckpointTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        let paused = {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            require_running(c, &req.id)?;
            st.paused
        };
        if req.path.is_empty() {
            return Err(status(
                Code::INVALID_ARGUMENT,
                "checkpoint: no path to write the checkpoint to",
            ));
        }
        let after = if checkpoint_exit(req.options.as_ref()) {
            AfterCheckpoint::Exit
        } else if paused {
            AfterCheckpoint::StayPaused
        } else {
            AfterCheckpoint::Resume
        };
        tracing::info!("{}: checkpoint to {} ({after:?})", req.id, req.path);
        self.inner
            .sandbox
            .checkpoint(Path::new(&req.path), after)
            .await?;
        Ok(api::Empty::default())
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            match p.state {
                ProcState::Stopped if !req.all => {
                    return Err(status(
                        Code::NOT_FOUND,
                        format!("process {}/{} already finished", req.id, req.exec_id),
                    ));
                }
                ProcState::Created if !req.exec_id.is_empty() => {
                    return Err(status(
                        Code::FAILED_PRECONDITION,
                        format!("process {}/{} was not started", req.id, req.exec_id),
                    ));
                }
                _ => {}
            }
        }
        if req.signal == 0 || req.signal > 64 {
            return Err(status(
                Code::INVALID_ARGUMENT,
                format!("invalid signal {}", req.signal),
            ));
        }
        self.inner
            .sandbox
            .signal(&req.id, &req.exec_id, req.signal, req.all)
            .await?;
        Ok(api::Empty::default())
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        validate_id("exec id", &req.exec_id)?;
        let stdio = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        stdio::validate(&stdio).map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))?;
        let value = req
            .spec
            .as_ref()
            .map(|a| a.value.as_slice())
            .unwrap_or_default();
        if value.len() > MAX_PROCESS_SPEC {
            return Err(status(
                Code::INVALID_ARGUMENT,
                format!(
                    "process spec of {} bytes exceeds {MAX_PROCESS_SPEC}",
                    value.len()
                ),
            ));
        }
        let mut process: serde_json::Value = serde_json::from_slice(value).map_err(|e| {
            status(
                Code::INVALID_ARGUMENT,
                format!("exec {}: process spec is not valid JSON: {e}", req.exec_id),
            )
        })?;
        spec::validate_process(&process)
            .map_err(|e| status(Code::INVALID_ARGUMENT, format!("exec {}: {e}", req.exec_id)))?;
        if let Some(obj) = process.as_object_mut() {
            obj.insert("terminal".into(), serde_json::Value::Bool(req.terminal));
        }
        {
            let mut st = self.lock();
            let c = st
                .containers
                .get_mut(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            require_running(c, &req.id)?;
            if c.execs.contains_key(&req.exec_id) {
                return Err(status(
                    Code::ALREADY_EXISTS,
                    format!("exec {} already exists in {}", req.exec_id, req.id),
                ));
            }
            let exec = ExecConfig {
                process,
                stdin: !req.stdin.is_empty(),
            };
            c.execs
                .insert(req.exec_id.clone(), Process::new(0, stdio, Some(exec)));
        }
        send(
            self.inner.events.as_ref(),
            TaskExecAdded {
                container_id: req.id.clone(),
                exec_id: req.exec_id.clone(),
                ..Default::default()
            },
        )
        .await;
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            if !p.stdio.terminal {
                return Err(status(
                    Code::FAILED_PRECONDITION,
                    format!("process {}/{} has no terminal", req.id, req.exec_id),
                ));
            }
            if p.state != ProcState::Running {
                // Resizing before start or after exit is harmless: ignore.
                return Ok(api::Empty::default());
            }
        }
        self.inner
            .sandbox
            .resize_pty(&req.id, &req.exec_id, req.height, req.width)
            .await?;
        Ok(api::Empty::default())
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        let pump = {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            if !req.stdin || p.state != ProcState::Running {
                return Ok(api::Empty::default());
            }
            p.stdin_close
                .as_ref()
                .map(|tx| tx.send_replace(true))
                .is_some()
        };
        if !pump {
            self.inner
                .sandbox
                .close_stdin(&req.id, &req.exec_id)
                .await?;
        }
        Ok(api::Empty::default())
    }

    async fn update(
        &self,
        _ctx: &TtrpcContext,
        req: api::UpdateTaskRequest,
    ) -> TtrpcResult<api::Empty> {
        if !self.lock().containers.contains_key(&req.id) {
            return Err(not_found(format!("container {}", req.id)));
        }
        if req.resources.as_ref().is_some_and(|r| !r.value.is_empty()) {
            return Err(status(
                Code::UNIMPLEMENTED,
                format!(
                    "updating the resources of task {} is not supported: a burrow VM's vCPUs and memory are fixed when it boots",
                    req.id
                ),
            ));
        }
        Ok(api::Empty::default())
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let mut rx = {
            let st = self.lock();
            let c = st
                .containers
                .get(&req.id)
                .ok_or_else(|| not_found(format!("container {}", req.id)))?;
            let p = c
                .process(&req.exec_id)
                .ok_or_else(|| not_found(format!("process {}", req.exec_id)))?;
            p.exit_tx.subscribe()
        };
        let exited = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| {
                status(
                    Code::NOT_FOUND,
                    format!("process {}/{} was deleted", req.id, req.exec_id),
                )
            })?
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
        if !self.lock().containers.contains_key(&req.id) {
            return Err(not_found(format!("container {}", req.id)));
        }
        let s = self.inner.sandbox.stats(&req.id).await?;
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
        if let Err(e) = self.inner.sandbox.shutdown().await {
            tracing::warn!("shutting the sandbox down: {e}");
        }
        self.inner.exit.signal();
        Ok(api::Empty::default())
    }
}
