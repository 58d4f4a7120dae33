//! Hibernation: snapshot the VM to `<snapshot_dir>/<namespace>/<sandbox
//! id>/`, stop burrow-vmm (no process, no guest RAM on the host) while
//! containerd still sees the task running, and restore it transparently on
//! the next call that needs the guest.
//!
//! - Calls that need the guest now (exec, kill, stdin, ps, pause,
//!   checkpoint, tools) go through [`VmSandbox::awake_agent`], which wakes
//!   the VM first.
//! - Calls that block in the agent (Wait, stdout/stderr reads) do not wake
//!   it: when hibernation stops the VMM under them they wait until the VM is
//!   awake again and repeat the call.
//! - Repeated hibernation is incremental: the snapshot a VM was woken from
//!   stays on disk, and the next hibernation writes only the pages the
//!   guest dirtied since (`vm-<n>/` on top of `vm-<n-1>/`, see
//!   [`snapshot`]), up to [`MAX_CHAIN`] links; then a full one again. A
//!   checkpoint in between moves the VMM's dirty-page base, so the next
//!   hibernation after one is full.
//! - Hibernate on idle: `hibernate_idle_secs` (config) or the annotation
//!   `io.burrow.hibernate_idle_secs`; a timer hibernates after that long
//!   with no exec, no stdio traffic and no RPC that reached the guest.
//! - A control socket `<state dir>/control.sock` takes JSON lines
//!   `{"cmd":"hibernate"|"wake"|"status"}` or
//!   `{"cmd":"checkpoint","name":NAME}` (see [`super::named`]) and answers
//!   `{"ok":true,"state":"running"|"hibernating"|"asleep"}` (with `"dir"`
//!   for a checkpoint) or `{"ok":false,"error":"..."}` (the `burrow
//!   sandbox` verbs use it).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burrow_vmm_api::layout;
use burrow_vmm_api::sandbox_control::{SandboxReply, SandboxRequest};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::agent::Agent;
use super::snapshot;
use super::VmSandbox;
use crate::sandbox::{Result, SandboxError};
use crate::spec;

/// The control socket's file name in the sandbox's state directory, and
/// its longest request line.
pub use burrow_vmm_api::sandbox_control::{CONTROL_SOCKET, MAX_REQUEST};
/// Incremental hibernation snapshots on one full one before the next full
/// one (the VMM follows at most [`layout::MAX_VMM_CHAIN`]).
pub use burrow_vmm_api::layout::MAX_HIBERNATION_CHAIN as MAX_CHAIN;

/// The newest link of a sandbox's hibernation chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Its directory name inside the hibernation directory (`vm-<n>`).
    pub latest: String,
    /// Incremental links on top of the full snapshot (0: it is the full one).
    pub depth: u32,
}

/// Where the sandbox's VM is. The number counts hibernations, so a call
/// interrupted by one can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Running(u64),
    Hibernating(u64),
    Asleep(u64),
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Running(_) => "running",
            Phase::Hibernating(_) => "hibernating",
            Phase::Asleep(_) => "asleep",
        }
    }
    fn generation(self) -> u64 {
        match self {
            Phase::Running(g) | Phase::Hibernating(g) | Phase::Asleep(g) => g,
        }
    }
}

fn remove_dir(dir: &Path) {
    remove_dir_only(dir);
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

/// Remove directory `dir` and what is in it, if it is there.
fn remove_dir_only(dir: &Path) {
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
}

/// Remove every link of the hibernation chain in `dir` but `keep`.
fn drop_links_but(dir: &Path, keep: &str) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name != keep && layout::is_link_name(&name) {
            remove_dir_only(&e.path());
        }
    }
}

impl VmSandbox {
    /// Record activity (resets the idle timer).
    pub(super) fn touch(&self) {
        *self.last_activity.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle_for(&self) -> Duration {
        self.last_activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    pub(super) fn is_asleep(&self) -> bool {
        !matches!(*self.phase.borrow(), Phase::Running(_))
    }

    /// Whether a call made at `generation` was interrupted by a hibernation.
    pub(super) fn slept_since(&self, generation: u64) -> bool {
        *self.phase.borrow() != Phase::Running(generation)
    }

    /// The agent, waking the VM first if it is hibernated.
    pub(super) async fn awake_agent(&self) -> Result<Agent> {
        self.touch();
        self.wake().await?;
        self.agent()
    }

    /// The agent once the VM is awake (does not wake it), with the
    /// hibernation count it belongs to.
    pub(super) async fn agent_when_awake(&self) -> Result<(Agent, u64)> {
        let mut rx = self.phase.subscribe();
        loop {
            if let Phase::Running(g) = *rx.borrow_and_update() {
                return self.agent().map(|a| (a, g));
            }
            rx.changed()
                .await
                .map_err(|_| SandboxError::Unavailable("the sandbox is gone".into()))?;
        }
    }

    /// Run a blocking agent call that must not wake the VM (wait, output
    /// reads, the OOM watch): once the VM is awake, and again after the
    /// next wake when a hibernation cuts it off.
    /// `what` names the call in the log (built only when it is logged).
    pub(super) async fn across_hibernation<T, F, Fut>(
        &self,
        what: impl Fn() -> String,
        call: F,
    ) -> Result<T>
    where
        F: Fn(Agent) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        loop {
            let (agent, generation) = self.agent_when_awake().await?;
            match self.unless_vm_exits(call(agent)).await {
                Err(e) if self.slept_since(generation) => {
                    tracing::debug!("{} interrupted by hibernation: {e}", what());
                }
                r => return r,
            }
        }
    }

    /// Write one link of the hibernation chain into `dir/name`.
    async fn hibernation_link(
        &self,
        vm: &super::Vm,
        dir: &Path,
        name: &str,
        incremental: bool,
    ) -> Result<()> {
        // (write_snapshot creates `dir`.)
        remove_dir_only(&dir.join(name));
        let r = self
            .write_snapshot(
                vm,
                dir,
                super::SnapshotKind::Hibernation { name, incremental },
            )
            .await;
        if r.is_err() {
            remove_dir_only(&dir.join(name));
        }
        r
    }

    /// Drop a hibernation snapshot (the sandbox is being removed).
    pub(super) fn forget_hibernation(&self) {
        *self
            .hibernation_chain
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = None;
        let g = self.phase.borrow().generation();
        if !matches!(*self.phase.borrow(), Phase::Running(_)) {
            // Wake anything waiting: the agent is gone, so it fails.
            self.phase.send_replace(Phase::Running(g.saturating_add(1)));
        }
        remove_dir(&self.hibernate_dir);
    }

    /// Snapshot the VM and stop burrow-vmm. A no-op when already asleep.
    pub async fn hibernate(&self) -> Result<()> {
        if self.paused.load(Ordering::SeqCst) {
            return Err(SandboxError::FailedPrecondition(
                "the task is paused: resume it before hibernating".into(),
            ));
        }
        let mut slot = self.vm.lock().await;
        let generation = match *self.phase.borrow() {
            Phase::Running(g) => g,
            _ => return Ok(()),
        };
        let Some(vm) = slot.as_ref() else {
            return Err(SandboxError::FailedPrecondition(
                "the VM is not running".into(),
            ));
        };
        let started = Instant::now();
        self.phase.send_replace(Phase::Hibernating(generation));
        let dir = self.hibernate_dir.clone();
        let chain = self
            .hibernation_chain
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let on_top = chain.filter(|c| c.depth < MAX_CHAIN && dir.join(&c.latest).is_dir());
        if on_top.is_none() {
            // A fresh chain. Links a running VMM still maps may go: its
            // mapping is private and outlives the file.
            remove_dir(&dir);
        }
        // A new name each time: never write over a file a VMM maps.
        let name = layout::link_name(generation);
        let mut depth = on_top.as_ref().map_or(0, |c| c.depth.saturating_add(1));
        let mut written = self
            .hibernation_link(vm, &dir, &name, on_top.is_some())
            .await;
        if let (Err(e), Some(_)) = (&written, &on_top) {
            tracing::warn!("incremental hibernation snapshot failed ({e}): taking a full one");
            depth = 0;
            written = self.hibernation_link(vm, &dir, &name, false).await;
        }
        if let Err(e) = written {
            if let Err(r) = vm.vmm.resume().await {
                tracing::error!("resuming after a failed hibernation: {r}");
            }
            if on_top.is_none() {
                remove_dir(&dir);
            }
            self.phase.send_replace(Phase::Running(generation));
            return Err(e);
        }
        if depth == 0 {
            drop_links_but(&dir, &name);
        }
        *self
            .hibernation_chain
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Chain {
            latest: name,
            depth,
        });
        *self.agent.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if let Some(mut vm) = slot.take() {
            if let Err(e) = vm.vmm.stop().await {
                tracing::debug!("stopping the VM through its API: {e}");
            }
            let mut rx = vm.vmm.exited();
            let _ =
                tokio::time::timeout(Duration::from_secs(3), rx.wait_for(Option::is_some)).await;
            vm.vmm.kill().await;
        }
        let _ = std::fs::remove_file(self.path("vmm.pid"));
        self.phase.send_replace(Phase::Asleep(generation));
        tracing::info!(
            "hibernated to {} in {} ms",
            dir.display(),
            started.elapsed().as_millis()
        );
        Ok(())
    }

    /// Restore a hibernated VM and reconnect. A no-op when it runs.
    pub async fn wake(&self) -> Result<()> {
        if matches!(*self.phase.borrow(), Phase::Running(_)) {
            return Ok(());
        }
        let mut slot = self.vm.lock().await;
        let generation = match *self.phase.borrow() {
            Phase::Asleep(g) => g,
            _ => return Ok(()),
        };
        let started = Instant::now();
        let cfg = self.cfg()?.clone();
        let dir = self.hibernate_dir.clone();
        let manifest = snapshot::read_manifest_with(&dir, false)?;
        let disk = self
            .containers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .next()
            .map(|c| (c.rootfs.disk.clone(), c.rootfs.read_only))
            .ok_or_else(|| {
                SandboxError::FailedPrecondition("the sandbox has no container".into())
            })?;
        let args = self.restore_args(&cfg, &manifest, disk, manifest.vm_dir(&dir));
        self.launch_restored(&cfg, &args, &manifest.container_id, &mut slot)
            .await?;
        // The snapshot stays: the base of the next hibernation's.
        self.touch();
        self.phase
            .send_replace(Phase::Running(generation.saturating_add(1)));
        tracing::info!(
            "woke from hibernation in {} ms",
            started.elapsed().as_millis()
        );
        Ok(())
    }

    /// After a container's VM is up: the control socket, and the idle timer
    /// if the config or the spec asks for one.
    pub(super) fn started(&self, container_spec: &serde_json::Value) {
        self.touch();
        let idle = spec::annotation(container_spec, spec::ANNOTATION_HIBERNATE_IDLE)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .or_else(|| self.cfg().ok().map(|c| c.hibernate_idle_secs))
            .unwrap_or(0);
        let sock = self.path(CONTROL_SOCKET);
        let _ = std::fs::remove_file(&sock);
        match UnixListener::bind(&sock) {
            Ok(l) => {
                tokio::spawn(serve_control(self.me.clone(), l));
            }
            Err(e) => tracing::warn!("control socket {}: {e}", sock.display()),
        }
        if idle > 0 {
            tracing::info!("hibernating after {idle}s idle");
            tokio::spawn(idle_timer(self.me.clone(), Duration::from_secs(idle)));
        }
    }
}

async fn idle_timer(me: std::sync::Weak<VmSandbox>, idle: Duration) {
    let tick = Duration::from_secs(1).min(idle);
    loop {
        tokio::time::sleep(tick).await;
        let Some(sb) = me.upgrade() else { return };
        let running = matches!(*sb.phase.borrow(), Phase::Running(_));
        if running && sb.agent().is_err() {
            return; // the VM was stopped for good
        }
        if running && !sb.paused.load(Ordering::SeqCst) && sb.idle_for() >= idle {
            tracing::info!("idle for {}s: hibernating", idle.as_secs());
            if let Err(e) = sb.hibernate().await {
                tracing::warn!("hibernate on idle: {e}");
                sb.touch();
            }
        }
    }
}

async fn serve_control(me: std::sync::Weak<VmSandbox>, l: UnixListener) {
    loop {
        let Ok((s, _)) = l.accept().await else { return };
        let Some(sb) = me.upgrade() else { return };
        tokio::spawn(async move {
            if let Err(e) = handle_control(&sb, s).await {
                tracing::debug!("control socket: {e}");
            }
        });
    }
}

async fn handle_control(sb: &VmSandbox, s: UnixStream) -> std::io::Result<()> {
    let (r, mut w) = s.into_split();
    let mut line = String::new();
    BufReader::new(r.take(MAX_REQUEST))
        .read_line(&mut line)
        .await?;
    let result = match serde_json::from_str::<SandboxRequest>(line.trim()) {
        Err(e) => Err(format!("bad request: {e}")),
        Ok(req) => match req {
            SandboxRequest::Hibernate => sb.hibernate().await.map(|()| None),
            SandboxRequest::Wake => sb.wake().await.map(|()| None),
            SandboxRequest::Status => Ok(None),
            SandboxRequest::Checkpoint { name } => sb.checkpoint_named(&name).await.map(Some),
        }
        .map_err(|e| e.to_string()),
    };
    let reply = SandboxReply::new(sb.phase.borrow().name(), result);
    w.write_all(&burrow_vmm_api::to_line(&reply)).await?;
    w.shutdown().await
}
