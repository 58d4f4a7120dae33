//! The production [`Sandbox`]: one burrow-vmm microVM per shim, with
//! burrow-agent as PID 1 in the guest.
//!
//! State lives in `<state_dir>/<namespace>/<sandbox id>/`:
//! `vmm.pid`, `api.sock` (VMM control), `vsock.sock` (hybrid vsock),
//! `console.log` (guest serial), `vmm.log` (VMM stderr) and one
//! `<container>.rootfs.img` per container whose rootfs had to be copied.
//! All of it goes when the sandbox shuts down; `containerd-shim-burrow-v2
//! delete` removes what a crashed shim left behind ([`cleanup_state`]).
//!
//! Limits for now: one container per VM (the VMM cannot hot-plug the disk a
//! second container would need); Update of resources is refused (no vCPU or
//! memory hotplug).

pub mod agent;
pub mod rootfs;
pub mod vmm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use burrow_protocol::agent as pb;
use tokio::sync::{watch, Mutex};

use crate::config::Config;
use crate::sandbox::*;
use crate::spec;

use self::agent::{Agent, AgentAddr};
use self::rootfs::GuestRootfs;
use self::vmm::{Vmm, VmmArgs};

/// The guest device the first disk appears as.
pub const GUEST_ROOT_DEVICE: &str = "/dev/vda";
/// Longest unix socket path (sun_path less its NUL).
const MAX_SOCKET_PATH: usize = 107;

struct Vm {
    vmm: Vmm,
    agent: Agent,
    memory_mib: u64,
}

struct ContainerRes {
    rootfs: GuestRootfs,
}

/// A VM-backed sandbox.
pub struct VmSandbox {
    cfg: Result<Config>,
    dir: PathBuf,
    vm: Mutex<Option<Vm>>,
    /// Set once the VM has exited (for calls that block in the agent).
    exited: std::sync::Mutex<Option<watch::Receiver<Option<String>>>>,
    containers: std::sync::Mutex<HashMap<String, ContainerRes>>,
    /// Agent handle for calls that must not queue behind the VM lock.
    agent: std::sync::Mutex<Option<Agent>>,
}

/// The state directory of a sandbox.
pub fn state_dir(root: &Path, namespace: &str, sandbox_id: &str) -> PathBuf {
    root.join(namespace).join(sandbox_id)
}

/// Remove what a sandbox left in `dir`: kill its VMM (if the pid file names
/// a live burrow-vmm) and delete the directory. Used by `delete` after a
/// crash and by shutdown.
pub fn cleanup_state(dir: &Path) {
    if let Ok(text) = std::fs::read_to_string(dir.join("vmm.pid")) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let is_vmm = cmdline
                .split(|b| *b == 0)
                .next()
                .is_some_and(|argv0| argv0.ends_with(b"burrow-vmm"));
            if pid > 1 && is_vmm {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                for _ in 0..100 {
                    if !Path::new(&format!("/proc/{pid}")).exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
    // Drop the namespace directory too once it is empty.
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

impl VmSandbox {
    pub fn new(
        cfg: std::result::Result<Config, String>,
        namespace: &str,
        sandbox_id: &str,
    ) -> Self {
        let cfg = cfg.map_err(|e| SandboxError::FailedPrecondition(format!("burrow config: {e}")));
        let root = cfg
            .as_ref()
            .map_or_else(|_| PathBuf::from("/run/burrow"), |c| c.state_dir.clone());
        Self {
            cfg,
            dir: state_dir(&root, namespace, sandbox_id),
            vm: Mutex::new(None),
            exited: std::sync::Mutex::new(None),
            containers: std::sync::Mutex::new(HashMap::new()),
            agent: std::sync::Mutex::new(None),
        }
    }

    fn cfg(&self) -> Result<&Config> {
        self.cfg
            .as_ref()
            .map_err(|e| SandboxError::FailedPrecondition(e.to_string()))
    }

    fn agent(&self) -> Result<Agent> {
        self.agent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))
    }

    /// Run a call that blocks in the agent, failing when the VM dies.
    async fn unless_vm_exits<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let rx = self
            .exited
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(mut rx) = rx else { return fut.await };
        tokio::select! {
            r = fut => r,
            gone = rx.wait_for(Option::is_some) => {
                let why = gone.ok().and_then(|g| g.clone()).unwrap_or_else(|| "burrow-vmm is gone".into());
                Err(SandboxError::Unavailable(format!("the VM exited: {why}")))
            }
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    async fn boot(
        &self,
        cfg: &Config,
        spec_value: &serde_json::Value,
        rootfs: &GuestRootfs,
    ) -> Result<Vm> {
        let size = spec::vm_size(spec_value, cfg);
        let vsock = self.path("vsock.sock");
        let api = self.path("api.sock");
        for p in [&vsock, &api] {
            // The VMM appends "_<port>" for guest-initiated connections.
            if p.as_os_str().len() + 12 > MAX_SOCKET_PATH {
                return Err(SandboxError::InvalidArgument(format!(
                    "socket path {} is too long for a unix socket: use a shorter state_dir",
                    p.display()
                )));
            }
        }
        if !cfg.kernel.is_file() {
            return Err(SandboxError::FailedPrecondition(format!(
                "guest kernel {} is missing: run `burrow install` or set `kernel` in {}",
                cfg.kernel.display(),
                crate::config::DEFAULT_PATH
            )));
        }
        let args = VmmArgs {
            binary: cfg.vmm_binary(),
            kernel: cfg.kernel.clone(),
            initrd: cfg.initrd.clone(),
            cmdline: cfg.kernel_cmdline.clone(),
            disks: vec![(rootfs.disk.clone(), rootfs.read_only)],
            vsock: vsock.clone(),
            api,
            serial_log: self.path("console.log"),
            vcpus: size.vcpus,
            memory_mib: size.memory_mib,
        };
        tracing::info!(
            "booting VM: {} vCPUs, {} MiB, {}",
            size.vcpus,
            size.memory_mib,
            args.to_args().join(" ")
        );
        let mut vmm = Vmm::spawn(&args, &self.path("vmm.log"))?;
        let _ = std::fs::write(self.path("vmm.pid"), vmm.pid.to_string());
        let boot_timeout = Duration::from_secs(cfg.boot_timeout_secs.max(1));
        let agent_timeout = Duration::from_secs(cfg.agent_timeout_secs.max(1));
        let mut exited = vmm.exited();
        let addr = AgentAddr::Vsock {
            path: vsock,
            port: burrow_protocol::AGENT_VSOCK_PORT,
        };
        let connected = tokio::select! {
            r = Agent::connect(&addr, agent_timeout, boot_timeout) => r,
            gone = exited.wait_for(Option::is_some) => {
                let why = gone.ok().and_then(|g| g.clone()).unwrap_or_default();
                Err(SandboxError::Unavailable(format!(
                    "the VM exited while booting: {why} (guest console: {})",
                    vmm::tail_of(&self.path("console.log"), 1024)
                )))
            }
        };
        let agent = match connected {
            Ok(a) => a,
            Err(e) => {
                vmm.kill().await;
                return Err(e);
            }
        };
        if let Err(e) = agent.set_time_now().await {
            tracing::warn!("setting the guest clock: {e}");
        }
        Ok(Vm {
            vmm,
            agent,
            memory_mib: size.memory_mib,
        })
    }

    async fn create_inner(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        vm_slot: &mut Option<Vm>,
    ) -> Result<u32> {
        if vm_slot.is_some()
            || !self
                .containers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
        {
            return Err(SandboxError::Unimplemented(
                "a burrow VM runs one container for now: a second container would need disk hotplug".into(),
            ));
        }
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", self.dir.display())))?;
        let (guest_spec, stripped) = spec::for_guest(&c.spec);
        if !stripped.items.is_empty() {
            tracing::info!(
                "{}: not forwarded to the guest: {}",
                c.id,
                stripped.items.join(", ")
            );
        }
        let spec_json = serde_json::to_vec(&guest_spec)
            .map_err(|e| SandboxError::InvalidArgument(format!("encoding the spec: {e}")))?;
        if spec_json.len() > burrow_protocol::MAX_SPEC_BYTES {
            return Err(SandboxError::InvalidArgument(
                "the OCI spec is too large".into(),
            ));
        }
        let rootfs = rootfs::prepare(
            c,
            &self.path(&format!("{}.rootfs.img", c.id)),
            cfg.rootfs_slack_mib,
        )
        .await?;
        self.containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                c.id.clone(),
                ContainerRes {
                    rootfs: rootfs.clone(),
                },
            );
        let vm = self.boot(cfg, &c.spec, &rootfs).await?;
        let read_only = rootfs.read_only
            || c.spec
                .get("root")
                .and_then(|r| r.get("readonly"))
                .and_then(serde_json::Value::as_bool)
                == Some(true);
        let guest_rootfs = pb::Rootfs {
            source: GUEST_ROOT_DEVICE.into(),
            fstype: rootfs.fstype.clone(),
            options: if read_only { vec!["ro".into()] } else { vec![] },
            writable_overlay: false,
            ..Default::default()
        };
        let pid = match vm
            .agent
            .create_container(&c.id, &spec_json, guest_rootfs, c.stdin)
            .await
        {
            Ok(pid) => pid,
            Err(e) => {
                let mut vm = vm;
                vm.vmm.kill().await;
                return Err(e);
            }
        };
        *self.exited.lock().unwrap_or_else(|p| p.into_inner()) = Some(vm.vmm.exited());
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = Some(vm.agent.clone());
        *vm_slot = Some(vm);
        Ok(pid)
    }

    fn drop_container_files(&self, id: &str) {
        let res = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id);
        if let Some(img) = res.and_then(|r| r.rootfs.image) {
            let _ = std::fs::remove_file(img);
        }
    }

    async fn stop_vm(&self) {
        let vm = self.vm.lock().await.take();
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if let Some(mut vm) = vm {
            if vm.vmm.exit_reason().is_none() {
                if let Err(e) = vm.vmm.command("stop").await {
                    tracing::debug!("stopping the VM through its API: {e}");
                }
                let mut rx = vm.vmm.exited();
                if tokio::time::timeout(Duration::from_secs(3), rx.wait_for(Option::is_some))
                    .await
                    .is_err()
                {
                    tracing::warn!("burrow-vmm did not stop; killing it");
                }
            }
            vm.vmm.kill().await;
        }
    }
}

#[async_trait]
impl Sandbox for VmSandbox {
    async fn create_container(&self, c: &ContainerConfig) -> Result<u32> {
        let cfg = self.cfg()?.clone();
        let mut slot = self.vm.lock().await;
        let r = self.create_inner(&cfg, c, &mut slot).await;
        if r.is_err() && slot.is_none() {
            drop(slot);
            self.drop_container_files(&c.id);
            cleanup_state(&self.dir);
        }
        r
    }

    async fn start_container(&self, id: &str) -> Result<()> {
        self.agent()?.start_container(id).await
    }

    async fn delete_container(&self, id: &str) -> Result<()> {
        if let Ok(agent) = self.agent() {
            match agent.delete_container(id).await {
                Ok(()) | Err(SandboxError::NotFound(_)) | Err(SandboxError::Unavailable(_)) => {}
                Err(e) => tracing::warn!("{id}: agent DeleteContainer: {e}"),
            }
        }
        self.drop_container_files(id);
        // One container per VM: the VM goes with it.
        if self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
        {
            self.stop_vm().await;
        }
        Ok(())
    }

    async fn exec_process(&self, id: &str, exec_id: &str, cfg: &ExecConfig) -> Result<u32> {
        let json = serde_json::to_vec(&cfg.process)
            .map_err(|e| SandboxError::InvalidArgument(format!("encoding the process: {e}")))?;
        self.agent()?.exec(id, exec_id, &json, cfg.stdin).await
    }

    async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()> {
        self.agent()?.delete_process(id, exec_id).await
    }

    async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        self.agent()?.signal(id, exec_id, signal, all).await
    }

    async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus> {
        let agent = self.agent()?;
        self.unless_vm_exits(agent.wait(id, exec_id)).await
    }

    async fn read_output(
        &self,
        id: &str,
        exec_id: &str,
        stream: Stream,
        max: usize,
    ) -> Result<Chunk> {
        let agent = self.agent()?;
        self.unless_vm_exits(agent.read(id, exec_id, stream, max))
            .await
    }

    async fn wait_oom(&self, seen: u64) -> Result<u64> {
        let agent = self.agent()?;
        self.unless_vm_exits(agent.wait_oom_kill(seen)).await
    }

    async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize> {
        self.agent()?.write_stdin(id, exec_id, data).await
    }

    async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.agent()?.close_stdin(id, exec_id).await
    }

    async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        self.agent()?.resize_pty(id, exec_id, rows, cols).await
    }

    async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>> {
        self.agent()?.processes(id).await
    }

    async fn pause(&self) -> Result<()> {
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        vm.vmm.command("pause").await.map(drop)
    }

    async fn resume(&self) -> Result<()> {
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        vm.vmm.command("resume").await.map(drop)
    }

    async fn stats(&self) -> Result<SandboxStats> {
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        let (cpu, rss) = vmm::process_usage(vm.vmm.pid);
        Ok(SandboxStats {
            cpu_usage_usec: cpu,
            memory_bytes: rss,
            memory_limit_bytes: vm.memory_mib.saturating_mul(1 << 20),
            pids: 1,
        })
    }

    async fn shutdown(&self) -> Result<()> {
        let ids: Vec<String> = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        for id in ids {
            self.drop_container_files(&id);
        }
        self.stop_vm().await;
        cleanup_state(&self.dir);
        Ok(())
    }
}
