//! The ttrpc `Agent` service.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc::{self, r#async::TtrpcContext};
use burrow_protocol::{async_trait, MAX_CHUNK};

use crate::container::cgroup::{self, Cgroup};
use crate::container::{self, Confine, Container};
use crate::error::{invalid, AgentError, Result};
use crate::fs::{self, CleanPath};
use crate::process::Process;
use crate::spawn::Namespaces;

mod session;

/// Most processes (running or not yet deleted) one container may hold.
const MAX_PROCESSES: usize = 4096;
/// Most containers one guest may hold.
const MAX_CONTAINERS: usize = 256;

pub struct AgentService {
    containers: Mutex<HashMap<String, Arc<Container>>>,
    /// Serialises create/delete so one id is never half made twice.
    lifecycle: tokio::sync::Mutex<()>,
    state_dir: PathBuf,
    pid1: bool,
    started: Instant,
    browser: Arc<crate::browser::Browser>,
    sessions: session::Sessions,
    /// The last SetIdentity's machine id and VM generation.
    identity: Mutex<(String, u64)>,
}

type TResult<T> = ttrpc::Result<T>;

impl AgentService {
    pub fn new(state_dir: PathBuf, pid1: bool, browser: Arc<crate::browser::Browser>) -> Self {
        let mut containers = HashMap::new();
        containers.insert(String::new(), Arc::new(Container::guest()));
        AgentService {
            containers: Mutex::new(containers),
            lifecycle: tokio::sync::Mutex::new(()),
            state_dir,
            pid1,
            started: Instant::now(),
            browser,
            sessions: session::Sessions::default(),
            identity: Mutex::new((String::new(), 0)),
        }
    }

    fn container(&self, id: &str) -> Result<Arc<Container>> {
        self.containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned()
            .ok_or_else(|| AgentError::NotFound(format!("no container {id:?}")))
    }

    fn process(&self, container_id: &str, exec_id: &str) -> Result<Arc<Process>> {
        self.container(container_id)?.process(exec_id)
    }

    fn require_pid1(&self, what: &str) -> Result<()> {
        if self.pid1 {
            Ok(())
        } else {
            Err(AgentError::FailedPrecondition(format!(
                "{what} is only done by the agent as PID 1 in a guest, not in test mode"
            )))
        }
    }

    async fn create(&self, req: CreateContainerRequest) -> Result<CreateContainerResponse> {
        container::check_id("container id", &req.container_id)?;
        let spec = container::parse_spec(&req.oci_spec)?;
        // Compiled before anything is mounted: a profile burrow cannot
        // apply is a clear error, never skipped.
        let seccomp =
            container::seccomp::compile(spec.linux().as_ref().and_then(|l| l.seccomp().as_ref()))?;
        let rootfs = req
            .rootfs
            .into_option()
            .ok_or_else(|| invalid("rootfs is missing"))?;
        let _guard = self.lifecycle.lock().await;
        {
            let containers = self.containers.lock().unwrap_or_else(|p| p.into_inner());
            if containers.contains_key(&req.container_id) {
                return Err(AgentError::AlreadyExists(format!(
                    "container {:?} already exists",
                    req.container_id
                )));
            }
            if containers.len() > MAX_CONTAINERS {
                return Err(AgentError::FailedPrecondition("too many containers".into()));
            }
        }
        // The cgroup first: resources the guest kernel cannot apply are a
        // clear error with nothing mounted.
        let t = std::time::Instant::now();
        let cgroup = if self.pid1 {
            let resources = spec.linux().as_ref().and_then(|l| l.resources().clone());
            let id = req.container_id.clone();
            Some(
                tokio::task::spawn_blocking(move || {
                    Cgroup::create(Path::new(cgroup::MOUNT), &id, resources.as_ref())
                })
                .await
                .map_err(|e| AgentError::Internal(format!("cgroup task failed: {e}")))??,
            )
        } else {
            None
        };
        let confine = Confine { seccomp, cgroup };
        let cgroup_us = t.elapsed().as_micros();
        let undo = |bundle: Option<&Path>| {
            if let Some(b) = bundle {
                container::unmount_container(b);
            }
            if let Some(cg) = &confine.cgroup {
                cg.remove();
            }
        };
        let bundle = self.state_dir.join("containers").join(&req.container_id);
        let (b, s) = (bundle.clone(), spec.clone());
        let rootfs_path =
            match tokio::task::spawn_blocking(move || container::mount_container(&b, &s, &rootfs))
                .await
                .map_err(|e| AgentError::Internal(format!("mount task failed: {e}")))
                .and_then(|r| r)
            {
                Ok(p) => p,
                Err(e) => {
                    undo(None);
                    return Err(e);
                }
            };
        let mounted_us = t.elapsed().as_micros();
        let pid_masks = match container::pid_namespace(&spec) {
            Ok(m) => m,
            Err(e) => {
                undo(Some(&bundle));
                return Err(e);
            }
        };
        let own_pid_ns = pid_masks.is_some();
        let started = async {
            let process = spec
                .process()
                .as_ref()
                .ok_or_else(|| invalid("bad OCI spec: no \"process\""))?;
            let hostname = spec
                .hostname()
                .as_deref()
                .map(|h| CString::new(h).map_err(|_| invalid("hostname contains NUL")))
                .transpose()?;
            let rootfs_c = CString::new(rootfs_path.to_string_lossy().as_bytes())
                .map_err(|_| invalid("state directory path contains NUL"))?;
            let ns = Namespaces::NewContainer {
                rootfs: rootfs_c,
                hostname,
                pid: pid_masks,
                join: container::pod_namespaces(&spec)?,
            };
            container::start_process("", process, &rootfs_path, ns, &confine, req.stdin, true).await
        }
        .await;
        let init = match started {
            Ok(p) => p,
            Err(e) => {
                undo(Some(&bundle));
                return Err(e);
            }
        };
        let pid = init.pid;
        let c = Container {
            id: req.container_id.clone(),
            bundle: Some(bundle),
            rootfs: rootfs_path,
            own_pid_ns,
            processes: Mutex::new(HashMap::from([(String::new(), Arc::new(init))])),
            confine,
        };
        self.containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(req.container_id.clone(), Arc::new(c));
        // Where a create's time went (a start's cost is mostly here).
        tracing::info!(
            container = %req.container_id,
            pid,
            cgroup_us,
            mounted_us,
            spawned_us = t.elapsed().as_micros(),
            "container created"
        );
        let mut resp = CreateContainerResponse::new();
        resp.pid = u32::try_from(pid).unwrap_or(0);
        Ok(resp)
    }

    async fn start(&self, id: &str) -> Result<()> {
        let init = self.process(id, "")?;
        let gate = init.take_gate().ok_or_else(|| {
            AgentError::FailedPrecondition(format!("container {id:?} was already started"))
        })?;
        gate.release().await?;
        tracing::info!(container = %id, pid = init.pid, "container started");
        Ok(())
    }

    async fn delete(&self, id: &str) -> Result<()> {
        if id.is_empty() {
            return Err(invalid("the guest itself cannot be deleted"));
        }
        let _guard = self.lifecycle.lock().await;
        let c = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
            .ok_or_else(|| AgentError::NotFound(format!("no container {id:?}")))?;
        let procs = c.all_processes();
        for p in &procs {
            // Dropping an unstarted init's gate makes it exit by itself.
            drop(p.take_gate());
            if p.running() {
                let _ = p.signal(libc::SIGKILL);
            }
        }
        for p in &procs {
            if tokio::time::timeout(Duration::from_secs(5), p.wait())
                .await
                .is_err()
            {
                tracing::warn!(container = %id, pid = p.pid, "process did not exit after SIGKILL");
            }
        }
        tokio::task::spawn_blocking(move || {
            // What the container forked outside the agent's view goes too.
            if let Some(cg) = &c.confine.cgroup {
                cg.remove();
            }
            if let Some(bundle) = &c.bundle {
                container::unmount_container(bundle);
            }
        })
        .await
        .map_err(|e| AgentError::Internal(format!("unmount task failed: {e}")))?;
        tracing::info!(container = %id, "container deleted");
        Ok(())
    }

    async fn exec(&self, req: ExecProcessRequest) -> Result<ExecProcessResponse> {
        container::check_id("exec id", &req.exec_id)?;
        let c = self.container(&req.container_id)?;
        let oci = container::parse_process(&req.oci_process)?;
        {
            let procs = c.processes.lock().unwrap_or_else(|p| p.into_inner());
            if procs.contains_key(&req.exec_id) {
                return Err(AgentError::AlreadyExists(format!(
                    "process {:?} already exists in container {:?}",
                    req.exec_id, req.container_id
                )));
            }
            if procs.len() >= MAX_PROCESSES {
                return Err(AgentError::FailedPrecondition(
                    "too many processes in this container; delete finished ones".into(),
                ));
            }
        }
        let (ns, pty_root) = if c.id.is_empty() {
            (Namespaces::Guest, PathBuf::from("/"))
        } else {
            let init = c.process("")?;
            if !init.running() {
                return Err(AgentError::FailedPrecondition(format!(
                    "container {:?} is not running",
                    c.id
                )));
            }
            (
                container::join_namespaces(init.pid, c.own_pid_ns)?,
                PathBuf::from(format!("/proc/{}/root", init.pid)),
            )
        };
        let p = Arc::new(
            container::start_process(
                &req.exec_id,
                &oci,
                &pty_root,
                ns,
                &c.confine,
                req.stdin,
                false,
            )
            .await?,
        );
        let pid = p.pid;
        let mut procs = c.processes.lock().unwrap_or_else(|p| p.into_inner());
        if procs.contains_key(&req.exec_id) {
            let _ = p.signal(libc::SIGKILL);
            return Err(AgentError::AlreadyExists(format!(
                "process {:?} already exists in container {:?}",
                req.exec_id, req.container_id
            )));
        }
        procs.insert(req.exec_id.clone(), p);
        tracing::info!(container = %req.container_id, exec = %req.exec_id, pid, "process started");
        let mut resp = ExecProcessResponse::new();
        resp.pid = u32::try_from(pid).unwrap_or(0);
        Ok(resp)
    }

    fn signal(&self, req: &SignalProcessRequest) -> Result<()> {
        let sig = i32::try_from(req.signal)
            .ok()
            .filter(|s| (1..=64).contains(s))
            .ok_or_else(|| {
                invalid(format!(
                    "signal {} is not a valid signal number",
                    req.signal
                ))
            })?;
        let c = self.container(&req.container_id)?;
        if req.all {
            for p in c.all_processes() {
                if p.running() {
                    let _ = p.signal(sig);
                }
            }
            return Ok(());
        }
        c.process(&req.exec_id)?.signal(sig)
    }

    fn delete_process(&self, req: &ProcessRequest) -> Result<()> {
        if req.exec_id.is_empty() {
            return Err(invalid("the init process goes with DeleteContainer"));
        }
        let c = self.container(&req.container_id)?;
        let mut procs = c.processes.lock().unwrap_or_else(|p| p.into_inner());
        let p = procs.get(&req.exec_id).ok_or_else(|| {
            AgentError::NotFound(format!(
                "no process {:?} in container {:?}",
                req.exec_id, req.container_id
            ))
        })?;
        if p.running() {
            return Err(AgentError::FailedPrecondition(format!(
                "process {:?} is still running; kill and wait for it first",
                req.exec_id
            )));
        }
        procs.remove(&req.exec_id);
        Ok(())
    }

    /// Run a file operation on a blocking thread, in the container's root.
    async fn in_root<T: Send + 'static>(
        &self,
        container_id: &str,
        path: &str,
        f: impl FnOnce(&std::os::fd::OwnedFd, &CleanPath) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let c = self.container(container_id)?;
        let path = CleanPath::parse(path)?;
        tokio::task::spawn_blocking(move || {
            let root = c.root_fd()?;
            f(&root, &path)
        })
        .await
        .map_err(|e| AgentError::Internal(format!("file task failed: {e}")))?
    }
}

fn empty() -> Empty {
    Empty::new()
}

#[async_trait]
impl burrow_protocol::Agent for AgentService {
    async fn health(&self, _ctx: &TtrpcContext, _req: HealthRequest) -> TResult<HealthResponse> {
        let mut r = HealthResponse::new();
        r.version = env!("CARGO_PKG_VERSION").to_string();
        r.protocol_version = burrow_protocol::PROTOCOL_VERSION;
        r.pid1 = self.pid1;
        r.uptime_ms = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        r.oom_kills = crate::init::oom_kills().unwrap_or(0);
        let identity = self.identity.lock().unwrap_or_else(|p| p.into_inner());
        r.machine_id = identity.0.clone();
        r.vm_generation = identity.1;
        Ok(r)
    }

    async fn wait_oom_kill(
        &self,
        _ctx: &TtrpcContext,
        req: WaitOomKillRequest,
    ) -> TResult<WaitOomKillResponse> {
        let mut log = crate::oom::KernelLog::open();
        let cgroup = if req.container_id.is_empty() {
            None
        } else {
            Some(self.container(&req.container_id)?)
        };
        loop {
            // The kernel logs each kill before it counts it in memory.events.
            if cgroup.is_some() {
                // Gone: no more kills to wait for.
                self.container(&req.container_id)?;
            }
            let kills = match cgroup.as_ref().and_then(|c| c.confine.cgroup.as_ref()) {
                Some(cg) => cg.usage().oom_kills,
                None => crate::init::oom_kills()?,
            };
            if kills > req.seen {
                let mut r = WaitOomKillResponse::new();
                r.kills = kills;
                return Ok(r);
            }
            log.changed().await;
        }
    }

    async fn set_time(&self, _ctx: &TtrpcContext, req: SetTimeRequest) -> TResult<Empty> {
        self.require_pid1("setting the clock")?;
        crate::init::set_time(req.unix_seconds, req.nanos)?;
        tracing::info!(secs = req.unix_seconds, "clock stepped");
        Ok(empty())
    }

    async fn add_entropy(&self, _ctx: &TtrpcContext, req: AddEntropyRequest) -> TResult<Empty> {
        crate::init::add_entropy(&req.data)?;
        Ok(empty())
    }

    async fn set_hostname(&self, _ctx: &TtrpcContext, req: SetHostnameRequest) -> TResult<Empty> {
        if req.hostname.is_empty() || req.hostname.len() > 64 || req.hostname.contains('\0') {
            return Err(invalid("hostname must be 1 to 64 bytes without NUL").into());
        }
        // In test mode the agent runs in a UTS namespace of its own.
        nix::unistd::sethostname(&req.hostname).map_err(|e| AgentError::os("sethostname", e))?;
        Ok(empty())
    }

    async fn configure_network(
        &self,
        _ctx: &TtrpcContext,
        req: ConfigureNetworkRequest,
    ) -> TResult<Empty> {
        self.require_pid1("configuring the NIC")?;
        let nic: [u8; 6] = req
            .nic_mac
            .as_slice()
            .try_into()
            .map_err(|_| invalid("nic_mac must be 6 bytes"))?;
        let net: burrow_protocol::net::GuestNet = req
            .config
            .parse()
            .map_err(|e| invalid(format!("network config: {e}")))?;
        crate::net::configure_nic(nic, &net)
            .await
            .map_err(|e| AgentError::FailedPrecondition(format!("configuring the NIC: {e:#}")))?;
        Ok(empty())
    }

    async fn set_identity(&self, _ctx: &TtrpcContext, req: SetIdentityRequest) -> TResult<Empty> {
        self.require_pid1("setting the machine id")?;
        crate::init::set_machine_id(&req.machine_id)?;
        *self.identity.lock().unwrap_or_else(|p| p.into_inner()) =
            (req.machine_id.clone(), req.vm_generation);
        tracing::info!(generation = req.vm_generation, "identity set");
        Ok(empty())
    }

    async fn online_cpus(
        &self,
        _ctx: &TtrpcContext,
        req: OnlineCpusRequest,
    ) -> TResult<OnlineCpusResponse> {
        self.require_pid1("bringing CPUs online")?;
        let count = req.count;
        let online = tokio::task::spawn_blocking(move || crate::cpus::online(count))
            .await
            .map_err(|e| AgentError::Internal(format!("onlining CPUs: {e}")))??;
        Ok(OnlineCpusResponse {
            online,
            ..Default::default()
        })
    }

    async fn power_off(&self, _ctx: &TtrpcContext, req: PowerOffRequest) -> TResult<Empty> {
        self.require_pid1("powering off")?;
        tracing::info!(reboot = req.reboot, "powering off on request");
        // Answer first, then go down.
        let browser = self.browser.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            browser.close().await;
            if let Err(e) = crate::init::power_off(req.reboot) {
                tracing::error!("power off failed: {e}");
            }
        });
        Ok(empty())
    }

    async fn create_container(
        &self,
        _ctx: &TtrpcContext,
        req: CreateContainerRequest,
    ) -> TResult<CreateContainerResponse> {
        Ok(self.create(req).await?)
    }

    async fn start_container(&self, _ctx: &TtrpcContext, req: ContainerRequest) -> TResult<Empty> {
        self.start(&req.container_id).await?;
        Ok(empty())
    }

    async fn delete_container(&self, _ctx: &TtrpcContext, req: ContainerRequest) -> TResult<Empty> {
        self.delete(&req.container_id).await?;
        Ok(empty())
    }

    async fn list_processes(
        &self,
        _ctx: &TtrpcContext,
        req: ContainerRequest,
    ) -> TResult<ListProcessesResponse> {
        let c = self.container(&req.container_id)?;
        let mut r = ListProcessesResponse::new();
        let mut procs = c.all_processes();
        procs.sort_by(|a, b| a.exec_id.cmp(&b.exec_id));
        for p in procs {
            let mut info = ProcessInfo::new();
            info.exec_id = p.exec_id.clone();
            info.pid = u32::try_from(p.pid).unwrap_or(0);
            info.running = p.running();
            r.processes.push(info);
        }
        Ok(r)
    }

    async fn container_stats(
        &self,
        _ctx: &TtrpcContext,
        req: ContainerRequest,
    ) -> TResult<ContainerStatsResponse> {
        let c = self.container(&req.container_id)?;
        let init = c.process("").ok().map(|p| p.pid);
        let running = c.all_processes().iter().filter(|p| p.running()).count() as u64;
        let own_pid_ns = c.own_pid_ns;
        let has_cgroup = c.confine.cgroup.is_some();
        let mut r = tokio::task::spawn_blocking(move || -> Result<ContainerStatsResponse> {
            let mut r = ContainerStatsResponse::new();
            (r.memory_usage_bytes, r.memory_total_bytes) = crate::stats::memory()?;
            if let Some(cg) = &c.confine.cgroup {
                // The container's own share of the VM.
                let u = cg.usage();
                r.cpu_usage_usec = u.cpu_usec;
                r.memory_usage_bytes = u.memory_bytes;
                r.memory_total_bytes = u
                    .memory_limit
                    .map_or(r.memory_total_bytes, |l| l.min(r.memory_total_bytes));
                r.pids = u.pids;
                r.oom_kills = u.oom_kills;
                return Ok(r);
            }
            r.cpu_usage_usec = crate::stats::cpu_usec()?;
            r.pids = match init {
                Some(pid) if own_pid_ns => crate::stats::processes_in_pid_namespace_of(pid),
                _ => 0,
            };
            Ok(r)
        })
        .await
        .map_err(|e| AgentError::Internal(format!("stats task failed: {e}")))??;
        if !own_pid_ns && !has_cgroup {
            // Sharing the guest's PID namespace: count what the agent started.
            r.pids = running;
        }
        Ok(r)
    }

    async fn update_container(
        &self,
        _ctx: &TtrpcContext,
        req: UpdateContainerRequest,
    ) -> TResult<Empty> {
        if req.resources.len() > burrow_protocol::MAX_SPEC_BYTES {
            return Err(invalid("resources are too large").into());
        }
        let resources: oci_spec::runtime::LinuxResources =
            serde_json::from_slice(&req.resources)
                .map_err(|e| invalid(format!("bad linux.resources: {e}")))?;
        let c = self.container(&req.container_id)?;
        if c.id.is_empty() || c.confine.cgroup.is_none() {
            return Err(AgentError::FailedPrecondition(format!(
                "container {:?} has no cgroup to update",
                req.container_id
            ))
            .into());
        }
        tokio::task::spawn_blocking(move || match &c.confine.cgroup {
            Some(cg) => cg.apply(&resources),
            None => Ok(()),
        })
        .await
        .map_err(|e| AgentError::Internal(format!("update task failed: {e}")))??;
        tracing::info!(container = %req.container_id, "resources updated");
        Ok(empty())
    }

    async fn exec_process(
        &self,
        _ctx: &TtrpcContext,
        req: ExecProcessRequest,
    ) -> TResult<ExecProcessResponse> {
        Ok(self.exec(req).await?)
    }

    async fn signal_process(
        &self,
        _ctx: &TtrpcContext,
        req: SignalProcessRequest,
    ) -> TResult<Empty> {
        self.signal(&req)?;
        Ok(empty())
    }

    async fn wait_process(
        &self,
        _ctx: &TtrpcContext,
        req: ProcessRequest,
    ) -> TResult<WaitProcessResponse> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        let st = p.wait().await?;
        let mut r = WaitProcessResponse::new();
        r.exit_code = st.code;
        r.signal = st.signal;
        Ok(r)
    }

    async fn delete_process(&self, _ctx: &TtrpcContext, req: ProcessRequest) -> TResult<Empty> {
        self.delete_process(&req)?;
        Ok(empty())
    }

    async fn write_stdin(
        &self,
        _ctx: &TtrpcContext,
        req: WriteStdinRequest,
    ) -> TResult<WriteStdinResponse> {
        if req.data.len() > MAX_CHUNK {
            return Err(invalid(format!(
                "stdin chunk of {} bytes is over {MAX_CHUNK}",
                req.data.len()
            ))
            .into());
        }
        let p = self.process(&req.container_id, &req.exec_id)?;
        let n = p.stdin.write(&req.data).await?;
        let mut r = WriteStdinResponse::new();
        r.written = u32::try_from(n).unwrap_or(0);
        Ok(r)
    }

    async fn close_stdin(&self, _ctx: &TtrpcContext, req: ProcessRequest) -> TResult<Empty> {
        self.process(&req.container_id, &req.exec_id)?
            .stdin
            .close()
            .await;
        Ok(empty())
    }

    async fn read_stdout(
        &self,
        _ctx: &TtrpcContext,
        req: ReadStreamRequest,
    ) -> TResult<ReadStreamResponse> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        Ok(stream_response(
            p.stdout.read(fs::chunk_len(req.max_bytes)).await?,
        ))
    }

    async fn read_stderr(
        &self,
        _ctx: &TtrpcContext,
        req: ReadStreamRequest,
    ) -> TResult<ReadStreamResponse> {
        let p = self.process(&req.container_id, &req.exec_id)?;
        Ok(stream_response(
            p.stderr.read(fs::chunk_len(req.max_bytes)).await?,
        ))
    }

    async fn start_session(
        &self,
        _ctx: &TtrpcContext,
        req: StartSessionRequest,
    ) -> TResult<StartSessionResponse> {
        Ok(self.start_session(req).await?)
    }

    async fn read_session(
        &self,
        _ctx: &TtrpcContext,
        req: ReadSessionRequest,
    ) -> TResult<ReadSessionResponse> {
        Ok(self.read_session(req).await?)
    }

    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> TResult<Empty> {
        let rows = u16::try_from(req.rows).map_err(|_| invalid("rows must fit in 16 bits"))?;
        let cols = u16::try_from(req.cols).map_err(|_| invalid("cols must fit in 16 bits"))?;
        self.process(&req.container_id, &req.exec_id)?
            .resize(rows, cols)?;
        Ok(empty())
    }

    async fn read_file(
        &self,
        _ctx: &TtrpcContext,
        req: ReadFileRequest,
    ) -> TResult<ReadFileResponse> {
        let (offset, max) = (req.offset, req.max_bytes);
        let (data, size, eof) = self
            .in_root(&req.container_id, &req.path, move |root, path| {
                fs::read(root, path, offset, max)
            })
            .await?;
        let mut r = ReadFileResponse::new();
        r.data = data;
        r.size = size;
        r.eof = eof;
        Ok(r)
    }

    async fn write_file(&self, _ctx: &TtrpcContext, req: WriteFileRequest) -> TResult<Empty> {
        let WriteFileRequest {
            container_id,
            path,
            data,
            mode,
            append,
            make_parents,
            ..
        } = req;
        self.in_root(&container_id, &path, move |root, p| {
            fs::write(root, p, &data, mode, append, make_parents)
        })
        .await?;
        Ok(empty())
    }

    async fn list_dir(&self, _ctx: &TtrpcContext, req: ListDirRequest) -> TResult<ListDirResponse> {
        let max = req.max_entries;
        let (entries, truncated) = self
            .in_root(&req.container_id, &req.path, move |root, p| {
                fs::list(root, p, max)
            })
            .await?;
        let mut r = ListDirResponse::new();
        r.entries = entries;
        r.truncated = truncated;
        Ok(r)
    }

    async fn stat(&self, _ctx: &TtrpcContext, req: PathRequest) -> TResult<FileInfo> {
        Ok(self.in_root(&req.container_id, &req.path, fs::stat).await?)
    }

    async fn make_dir(&self, _ctx: &TtrpcContext, req: MakeDirRequest) -> TResult<Empty> {
        let (mode, parents) = (req.mode, req.parents);
        self.in_root(&req.container_id, &req.path, move |root, p| {
            fs::mkdir(root, p, mode, parents)
        })
        .await?;
        Ok(empty())
    }

    async fn remove(&self, _ctx: &TtrpcContext, req: RemoveRequest) -> TResult<Empty> {
        let recursive = req.recursive;
        self.in_root(&req.container_id, &req.path, move |root, p| {
            fs::remove(root, p, recursive)
        })
        .await?;
        Ok(empty())
    }

    async fn rename(&self, _ctx: &TtrpcContext, req: RenameRequest) -> TResult<Empty> {
        let to = CleanPath::parse(&req.to)?;
        self.in_root(&req.container_id, &req.from, move |root, from| {
            fs::rename(root, from, &to)
        })
        .await?;
        Ok(empty())
    }

    async fn browser_navigate(
        &self,
        _ctx: &TtrpcContext,
        req: BrowserNavigateRequest,
    ) -> TResult<BrowserNavigateResponse> {
        let (url, title) = self.browser.navigate(&req.url, req.timeout_ms).await?;
        let mut r = BrowserNavigateResponse::new();
        r.url = url;
        r.title = title;
        Ok(r)
    }

    async fn browser_screenshot(
        &self,
        _ctx: &TtrpcContext,
        req: BrowserScreenshotRequest,
    ) -> TResult<BrowserScreenshotResponse> {
        let (png, width, height) = self.browser.screenshot(req.width, req.height).await?;
        let mut r = BrowserScreenshotResponse::new();
        r.png = png;
        r.width = width;
        r.height = height;
        Ok(r)
    }

    async fn browser_text(
        &self,
        _ctx: &TtrpcContext,
        req: BrowserTextRequest,
    ) -> TResult<BrowserTextResponse> {
        let (text, truncated) = self.browser.text(req.max_bytes, req.elements).await?;
        let mut r = BrowserTextResponse::new();
        r.text = text;
        r.truncated = truncated;
        Ok(r)
    }

    async fn browser_click(&self, _ctx: &TtrpcContext, req: BrowserClickRequest) -> TResult<Empty> {
        self.browser.click(&req.selector).await?;
        Ok(empty())
    }

    async fn browser_type(&self, _ctx: &TtrpcContext, req: BrowserTypeRequest) -> TResult<Empty> {
        self.browser.type_text(&req.selector, &req.text).await?;
        Ok(empty())
    }

    async fn browser_close(
        &self,
        _ctx: &TtrpcContext,
        _req: BrowserCloseRequest,
    ) -> TResult<Empty> {
        self.browser.close().await;
        Ok(empty())
    }
}

fn stream_response(data: Option<Vec<u8>>) -> ReadStreamResponse {
    let mut r = ReadStreamResponse::new();
    match data {
        Some(d) => r.data = d,
        None => r.eof = true,
    }
    r
}
