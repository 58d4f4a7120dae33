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
pub mod hibernate;
pub mod named;
pub mod rootfs;
pub mod snapshot;
pub mod sparse;
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
    vcpus: u32,
    memory_mib: u64,
}

struct ContainerRes {
    rootfs: GuestRootfs,
    /// The id the agent in the guest knows the container by: the task id,
    /// except for a task restored from a checkpoint of another container.
    guest_id: String,
    /// The spec as the guest got it (for checkpoint manifests).
    guest_spec: serde_json::Value,
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
    /// Itself, for the tasks it spawns (idle timer, control socket).
    me: std::sync::Weak<VmSandbox>,
    /// Running, hibernating or asleep ([`hibernate`]).
    phase: watch::Sender<hibernate::Phase>,
    /// Last exec, stdio traffic or RPC (for hibernate-on-idle).
    last_activity: std::sync::Mutex<std::time::Instant>,
    /// Frozen by containerd's Pause (not hibernated then).
    paused: std::sync::atomic::AtomicBool,
    /// Stopped by a checkpoint with `exit`: its processes were killed on
    /// purpose (CRIU's checkpoint kills them too), not lost.
    exited_by_checkpoint: std::sync::atomic::AtomicBool,
    /// Where this sandbox's hibernation snapshot goes.
    hibernate_dir: PathBuf,
    /// The hibernation snapshot the running VM was woken from, while it is
    /// still the VM's last snapshot: the next hibernation only writes the
    /// pages dirtied since, on top of it.
    hibernation_chain: std::sync::Mutex<Option<hibernate::Chain>>,
}

/// What [`VmSandbox::write_snapshot`] writes.
#[derive(Debug, Clone, Copy)]
enum SnapshotKind<'a> {
    /// A checkpoint: a full VM snapshot in `vm/` and a copy of the rootfs
    /// disk; `packed` (for containerd) stores the memory file and the disk
    /// as [`sparse`] packs.
    Checkpoint { packed: bool },
    /// A link of the hibernation chain: the VM snapshot in `name`, holding
    /// only the pages dirtied since the VM's last snapshot if `incremental`.
    Hibernation { name: &'a str, incremental: bool },
}

/// Run a [`sparse`] pack or unpack of `from` into `to` off the async threads.
async fn sparse_job<T: Send + 'static>(
    what: &'static str,
    from: PathBuf,
    to: PathBuf,
    job: fn(&Path, &Path) -> std::io::Result<T>,
) -> Result<T> {
    let (f, t) = (from.clone(), to.clone());
    tokio::task::spawn_blocking(move || job(&f, &t))
        .await
        .map_err(|e| SandboxError::Internal(format!("{what} {}: {e}", from.display())))?
        .map_err(|e| {
            let _ = std::fs::remove_file(&to);
            SandboxError::Internal(format!(
                "{what} {} into {}: {e}",
                from.display(),
                to.display()
            ))
        })
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
    ) -> std::sync::Arc<Self> {
        let cfg = cfg.map_err(|e| SandboxError::FailedPrecondition(format!("burrow config: {e}")));
        let root = cfg
            .as_ref()
            .map_or_else(|_| PathBuf::from("/run/burrow"), |c| c.state_dir.clone());
        let snapshots = cfg.as_ref().map_or_else(
            |_| PathBuf::from("/var/lib/burrow/snapshots"),
            |c| c.snapshot_dir.clone(),
        );
        std::sync::Arc::new_cyclic(|me| Self {
            cfg,
            dir: state_dir(&root, namespace, sandbox_id),
            vm: Mutex::new(None),
            exited: std::sync::Mutex::new(None),
            containers: std::sync::Mutex::new(HashMap::new()),
            agent: std::sync::Mutex::new(None),
            me: me.clone(),
            phase: watch::channel(hibernate::Phase::Running(0)).0,
            last_activity: std::sync::Mutex::new(std::time::Instant::now()),
            paused: std::sync::atomic::AtomicBool::new(false),
            exited_by_checkpoint: std::sync::atomic::AtomicBool::new(false),
            hibernate_dir: state_dir(&snapshots, namespace, sandbox_id),
            hibernation_chain: std::sync::Mutex::new(None),
        })
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
        self.check_socket_paths()?;
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
            vsock,
            api,
            serial_log: self.path("console.log"),
            vcpus: size.vcpus,
            memory_mib: size.memory_mib,
            restore: None,
        };
        tracing::info!(
            "booting VM: {} vCPUs, {} MiB, {}",
            size.vcpus,
            size.memory_mib,
            args.to_args().join(" ")
        );
        let vm = self.launch(cfg, &args).await?;
        if let Err(e) = vm.agent.set_time_now().await {
            tracing::warn!("setting the guest clock: {e}");
        }
        Ok(vm)
    }

    /// Check the lengths of the socket paths in the state directory.
    fn check_socket_paths(&self) -> Result<()> {
        for p in [self.path("vsock.sock"), self.path("api.sock")] {
            // The VMM appends "_<port>" for guest-initiated connections.
            if p.as_os_str().len() + 12 > MAX_SOCKET_PATH {
                return Err(SandboxError::InvalidArgument(format!(
                    "socket path {} is too long for a unix socket: use a shorter state_dir",
                    p.display()
                )));
            }
        }
        Ok(())
    }

    /// Spawn burrow-vmm (boot or restore) and connect to the agent.
    async fn launch(&self, cfg: &Config, args: &VmmArgs) -> Result<Vm> {
        let vsock = args.vsock.clone();
        let what = if args.restore.is_some() {
            "restoring the checkpoint"
        } else {
            "booting"
        };
        let mut vmm = Vmm::spawn(args, &self.path("vmm.log"))?;
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
                    "the VM exited while {what}: {why} (guest console: {})",
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
        Ok(Vm {
            vmm,
            agent,
            vcpus: args.vcpus,
            memory_mib: args.memory_mib,
        })
    }

    /// Refuse (saying `why`) when this sandbox has a VM or a container
    /// already: a burrow VM runs one container for now.
    fn require_no_container(&self, vm_slot: &Option<Vm>, why: &str) -> Result<()> {
        let empty = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty();
        if vm_slot.is_none() && empty {
            Ok(())
        } else {
            Err(SandboxError::Unimplemented(format!(
                "a burrow VM runs one container for now: {why}"
            )))
        }
    }

    /// burrow-vmm's arguments to restore the snapshot in `vm_dir` (taken
    /// with `manifest`) onto `disk`.
    fn restore_args(
        &self,
        cfg: &Config,
        manifest: &snapshot::Manifest,
        disk: (PathBuf, bool),
        vm_dir: PathBuf,
    ) -> VmmArgs {
        VmmArgs {
            binary: cfg.vmm_binary(),
            kernel: cfg.kernel.clone(),
            initrd: None,
            cmdline: String::new(),
            disks: vec![disk],
            vsock: self.path("vsock.sock"),
            api: self.path("api.sock"),
            serial_log: self.path("console.log"),
            vcpus: manifest.vcpus,
            memory_mib: manifest.memory_mib,
            restore: Some(vm_dir),
        }
    }

    async fn create_inner(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        vm_slot: &mut Option<Vm>,
    ) -> Result<u32> {
        self.require_no_container(vm_slot, "a second container would need disk hotplug")?;
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
                    guest_id: c.id.clone(),
                    guest_spec: guest_spec.clone(),
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

    /// The id the guest's agent knows container `id` by.
    fn gid(&self, id: &str) -> String {
        self.containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map_or_else(|| id.to_string(), |c| c.guest_id.clone())
    }

    async fn restore_inner(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        dir: &Path,
        vm_slot: &mut Option<Vm>,
    ) -> Result<u32> {
        self.require_no_container(vm_slot, "cannot restore into a sandbox that has one")?;
        let manifest = snapshot::read_manifest(dir)?;
        self.check_socket_paths()?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", self.dir.display())))?;
        // The memory snapshot matches this disk, so the VM gets its own
        // copy of it (the checkpoint stays usable for more restores).
        let img = self.path(&format!("{}.rootfs.img", c.id));
        let rootfs = GuestRootfs {
            disk: img.clone(),
            read_only: manifest.rootfs_read_only,
            fstype: manifest.rootfs_fstype.clone(),
            image: Some(img.clone()),
        };
        self.containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                c.id.clone(),
                ContainerRes {
                    rootfs,
                    guest_id: manifest.container_id.clone(),
                    guest_spec: manifest.spec.clone(),
                },
            );
        // A packed checkpoint (from containerd) is unpacked into the state
        // dir; the VMM maps the memory file privately, so it goes once the
        // VM runs.
        let unpacked = self.path("restore-vm");
        let vm_dir = if manifest.packed {
            let from = snapshot::vm_dir(dir);
            let _ = std::fs::remove_dir_all(&unpacked);
            std::fs::create_dir_all(&unpacked)
                .and_then(|()| std::fs::copy(from.join("state"), unpacked.join("state")))
                .map_err(|e| {
                    SandboxError::Internal(format!("copying the VM state to {}: {e}", unpacked.display()))
                })?;
            let memory = (
                from.join(snapshot::packed(snapshot::MEMORY)),
                unpacked.join(snapshot::MEMORY),
            );
            sparse_job("unpacking", memory.0, memory.1, sparse::unpack).await?;
            let disk = dir.join(snapshot::packed(snapshot::ROOTFS));
            sparse_job("unpacking", disk, img.clone(), sparse::unpack).await?;
            unpacked.clone()
        } else {
            snapshot::copy_disk(&dir.join(snapshot::ROOTFS), &img).await?;
            snapshot::vm_dir(dir)
        };
        let args = self.restore_args(cfg, &manifest, (img, manifest.rootfs_read_only), vm_dir);
        tracing::info!(
            "{}: restoring container {} from {}: {}",
            c.id,
            manifest.container_id,
            dir.display(),
            args.to_args().join(" ")
        );
        let r = self
            .launch_restored(cfg, &args, &manifest.container_id, vm_slot)
            .await;
        if manifest.packed {
            let _ = std::fs::remove_dir_all(&unpacked);
        }
        r
    }

    /// Start burrow-vmm with restore `args`, bring the guest up to date
    /// ([`after_restore`](Self::after_restore)) and make it this sandbox's
    /// VM; returns the pid of container `guest_id`'s init.
    async fn launch_restored(
        &self,
        cfg: &Config,
        args: &VmmArgs,
        guest_id: &str,
        vm_slot: &mut Option<Vm>,
    ) -> Result<u32> {
        let mut vm = self.launch(cfg, args).await?;
        let pid = match self.after_restore(&vm.agent, guest_id).await {
            Ok(pid) => pid,
            Err(e) => {
                vm.vmm.kill().await;
                return Err(e);
            }
        };
        *self.exited.lock().unwrap_or_else(|p| p.into_inner()) = Some(vm.vmm.exited());
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = Some(vm.agent.clone());
        *vm_slot = Some(vm);
        Ok(pid)
    }

    /// A restored guest continues with the clock and RNG state of the
    /// snapshot: step the clock, reseed, and find the container's init.
    async fn after_restore(&self, agent: &Agent, guest_id: &str) -> Result<u32> {
        agent.set_time_now().await?;
        agent.add_entropy().await?;
        let procs = agent.processes(guest_id).await?;
        procs
            .iter()
            .find(|p| p.exec_id.is_empty())
            .map(|p| p.pid)
            .ok_or_else(|| {
                SandboxError::FailedPrecondition(format!(
                    "the restored guest has no init process for container {guest_id}"
                ))
            })
    }

    async fn checkpoint_inner(&self, dir: &Path, packed: bool) -> Result<()> {
        self.wake().await?;
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        self.write_snapshot(vm, dir, SnapshotKind::Checkpoint { packed })
            .await
    }

    /// Write a checkpoint into `dir` (packed for containerd, or plain), then
    /// do what `after` says.
    pub(super) async fn checkpoint_to(
        &self,
        dir: &Path,
        after: AfterCheckpoint,
        packed: bool,
    ) -> Result<()> {
        let r = self.checkpoint_inner(dir, packed).await;
        if r.is_err() {
            for name in [
                snapshot::VM_DIR.to_string(),
                snapshot::ROOTFS.to_string(),
                snapshot::packed(snapshot::ROOTFS),
                snapshot::MANIFEST.to_string(),
            ] {
                let p = dir.join(name);
                let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            }
        }
        // The VMM leaves the VM paused after a snapshot (and after most
        // failures).
        match after {
            AfterCheckpoint::StayPaused => {}
            AfterCheckpoint::Resume => {
                let vm = self.vm.lock().await;
                if let Some(vm) = vm.as_ref() {
                    if let Err(e) = vm.vmm.command("resume").await {
                        tracing::error!("resuming the VM after a checkpoint: {e}");
                        if r.is_ok() {
                            return Err(e);
                        }
                    }
                }
            }
            AfterCheckpoint::Exit => {
                if r.is_ok() {
                    self.exited_by_checkpoint
                        .store(true, std::sync::atomic::Ordering::SeqCst);
                    self.stop_vm().await;
                }
            }
        }
        r
    }

    /// Snapshot the VM (left paused) into `dir` with a manifest (see
    /// [`SnapshotKind`]).
    async fn write_snapshot(&self, vm: &Vm, dir: &Path, kind: SnapshotKind<'_>) -> Result<()> {
        let (id, guest_id, rootfs, spec) = {
            let cs = self.containers.lock().unwrap_or_else(|p| p.into_inner());
            let (id, c) = cs.iter().next().ok_or_else(|| {
                SandboxError::FailedPrecondition("the sandbox has no container".into())
            })?;
            (
                id.clone(),
                c.guest_id.clone(),
                c.rootfs.clone(),
                c.guest_spec.clone(),
            )
        };
        std::fs::create_dir_all(dir)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", dir.display())))?;
        let (vm_name, incremental, packed) = match kind {
            SnapshotKind::Checkpoint { packed } => (None, false, packed),
            SnapshotKind::Hibernation { name, incremental } => (Some(name), incremental, false),
        };
        let vm_dir = dir.join(vm_name.unwrap_or(snapshot::VM_DIR));
        let started = std::time::Instant::now();
        // Any snapshot moves the base the VMM's next incremental one is
        // taken against: the chain holds only when hibernation renews it.
        *self
            .hibernation_chain
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        let answer = vm
            .vmm
            .request(
                &serde_json::json!({"cmd": "snapshot", "dir": vm_dir, "incremental": incremental}),
                Duration::from_secs(600),
            )
            .await?;
        // The VM is paused now, so the disk matches the memory snapshot.
        if packed {
            let memory = vm_dir.join(snapshot::MEMORY);
            let jobs = [
                (memory.clone(), vm_dir.join(snapshot::packed(snapshot::MEMORY))),
                (rootfs.disk.clone(), dir.join(snapshot::packed(snapshot::ROOTFS))),
            ];
            for (from, to) in jobs {
                sparse_job("packing", from, to, sparse::pack).await?;
            }
            std::fs::remove_file(&memory).map_err(|e| {
                SandboxError::Internal(format!("removing {}: {e}", memory.display()))
            })?;
        } else if matches!(kind, SnapshotKind::Checkpoint { .. }) {
            snapshot::copy_disk(&rootfs.disk, &dir.join(snapshot::ROOTFS)).await?;
        }
        snapshot::write_manifest(
            dir,
            &snapshot::Manifest {
                kind: snapshot::KIND.into(),
                format_version: snapshot::FORMAT_VERSION,
                container_id: guest_id,
                vcpus: vm.vcpus,
                memory_mib: vm.memory_mib,
                rootfs_fstype: rootfs.fstype.clone(),
                rootfs_read_only: rootfs.read_only,
                created_unix: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                spec,
                vm: vm_name.map(String::from),
                packed,
            },
        )?;
        tracing::info!(
            "{id}: snapshot written to {} in {} ms: {}",
            vm_dir.display(),
            started.elapsed().as_millis(),
            answer.trim()
        );
        Ok(())
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
        self.forget_hibernation();
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
        drop(slot);
        match &r {
            Ok(_) => self.started(&c.spec),
            Err(_) if self.vm.lock().await.is_none() => {
                self.drop_container_files(&c.id);
                cleanup_state(&self.dir);
            }
            Err(_) => {}
        }
        r
    }

    async fn restore_container(&self, c: &ContainerConfig, dir: &Path) -> Result<u32> {
        let cfg = self.cfg()?.clone();
        let mut slot = self.vm.lock().await;
        let r = self.restore_inner(&cfg, c, dir, &mut slot).await;
        drop(slot);
        match &r {
            Ok(_) => self.started(&c.spec),
            Err(_) if self.vm.lock().await.is_none() => {
                self.drop_container_files(&c.id);
                cleanup_state(&self.dir);
            }
            Err(_) => {}
        }
        r
    }

    fn named_checkpoint(&self, name: &str) -> Result<PathBuf> {
        self.named_checkpoint_dir(name)
    }

    async fn checkpoint(&self, dir: &Path, after: AfterCheckpoint) -> Result<()> {
        // containerd tars it without holes: pack the sparse files.
        self.checkpoint_to(dir, after, true).await
    }

    async fn start_container(&self, id: &str) -> Result<()> {
        self.awake_agent()
            .await?
            .start_container(&self.gid(id))
            .await
    }

    async fn delete_container(&self, id: &str) -> Result<()> {
        if let Ok(agent) = self.agent() {
            match agent.delete_container(&self.gid(id)).await {
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
        self.awake_agent()
            .await?
            .exec(&self.gid(id), exec_id, &json, cfg.stdin)
            .await
    }

    async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()> {
        self.awake_agent()
            .await?
            .delete_process(&self.gid(id), exec_id)
            .await
    }

    async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        self.awake_agent()
            .await?
            .signal(&self.gid(id), exec_id, signal, all)
            .await
    }

    async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus> {
        let gid = &self.gid(id);
        let r = self
            .across_hibernation(
                || format!("{id}/{exec_id}: wait"),
                |agent| async move { agent.wait(gid, exec_id).await },
            )
            .await;
        match r {
            // Reported like runc's: killed (137), not lost (255).
            Err(_)
                if self
                    .exited_by_checkpoint
                    .load(std::sync::atomic::Ordering::SeqCst) =>
            {
                Ok(ExitStatus::Signal(9))
            }
            r => r,
        }
    }

    async fn read_output(
        &self,
        id: &str,
        exec_id: &str,
        stream: Stream,
        max: usize,
    ) -> Result<Chunk> {
        let gid = &self.gid(id);
        let chunk = self
            .across_hibernation(
                || format!("{id}/{exec_id}: read"),
                |agent| async move { agent.read(gid, exec_id, stream, max).await },
            )
            .await?;
        if !chunk.data.is_empty() {
            self.touch();
        }
        Ok(chunk)
    }

    async fn wait_oom(&self, seen: u64) -> Result<u64> {
        self.across_hibernation(
            || "OOM watch".to_string(),
            |agent| async move { agent.wait_oom_kill(seen).await },
        )
        .await
    }

    async fn oom_kills(&self) -> Result<u64> {
        Ok(self.awake_agent().await?.health().await?.oom_kills)
    }

    async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize> {
        self.awake_agent()
            .await?
            .write_stdin(&self.gid(id), exec_id, data)
            .await
    }

    async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.awake_agent()
            .await?
            .close_stdin(&self.gid(id), exec_id)
            .await
    }

    async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        self.awake_agent()
            .await?
            .resize_pty(&self.gid(id), exec_id, rows, cols)
            .await
    }

    async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>> {
        self.awake_agent().await?.processes(&self.gid(id)).await
    }

    async fn pause(&self) -> Result<()> {
        self.wake().await?;
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        vm.vmm.command("pause").await?;
        self.paused.store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        let vm = self.vm.lock().await;
        let vm = vm
            .as_ref()
            .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))?;
        vm.vmm.command("resume").await?;
        self.paused
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.touch();
        Ok(())
    }

    async fn stats(&self, id: &str) -> Result<SandboxStats> {
        if self.is_asleep() {
            // Hibernated: no guest runs to count anything.
            return Ok(SandboxStats::default());
        }
        if self.paused.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(SandboxError::FailedPrecondition(
                "the VM is paused: its guest reports its resource use once resumed".into(),
            ));
        }
        // Neither wakes the VM nor counts as activity: polling stats must
        // not keep a sandbox from hibernating when idle.
        self.agent()?.stats(&self.gid(id)).await
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
