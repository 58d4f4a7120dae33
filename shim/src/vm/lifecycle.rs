//! The VM's lifecycle: the one owner of the sandbox's VM and the only code
//! that boots, restores, pauses, snapshots, hibernates, wakes and stops it.
//!
//! It publishes where the VM is as a [`Phase`] on one watch channel:
//!
//! ```text
//!  Empty ──start──▶ Booting ──▶ Running ◀──pause/resume──▶ Paused
//!    ▲                 │          │  ▲                        │
//!    └──(failed)───────┘   snapshot  └──(done / failed)─┐      │
//!                                 ▼                     │      │
//!                            Snapshotting ──────────────┘      │
//!                                 │ hibernate                  │
//!                                 ▼                            │
//!                   Asleep(chain) ──wake──▶ Booting ──▶ Running │
//!  any phase ──stop / checkpoint --exit / VMM died──▶ Gone(why) ◀┘
//! ```
//!
//! Transitions are serialized by one async lock that also holds the VMM
//! process; readers never take it. A [`Handle`] (the agent, the VMM's pid
//! and exit, the VM's size) is part of the `Running`, `Paused` and
//! `Snapshotting` phases: clients read it from the phase and keep no copy.
//! Calls that need the guest use [`Lifecycle::awake`] (waits while the VM
//! is booting or snapshotting, wakes it when asleep); calls that block in
//! the agent use [`Lifecycle::across_sleep`] (waits for the VM without
//! waking it and repeats the call after a hibernation cut it off).
//!
//! Repeated hibernation is incremental: the snapshot a VM was woken from
//! stays on disk (the handle's `base`), and the next hibernation writes
//! only the pages the guest dirtied since (`vm-<n>/` on top of
//! `vm-<n-1>/`), up to [`MAX_CHAIN`] links; then a full one again. Any
//! other snapshot moves the VMM's dirty-page base, so the handle that
//! comes out of it has no base.
//!
//! What the VM runs on is behind [`Launcher`] and [`VmProcess`]
//! ([`super::launch`] for burrow-vmm, a fake in the tests).
//!
//! Where coming work fits: a VMM jail or a network tap that must be
//! reopened on restore belong to the launcher (every boot, restore and wake
//! goes through it); starting from a template is [`Lifecycle::start`] with
//! restore arguments; several containers per VM live in the sandbox's
//! registry and reach the guest through the same handle.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use tokio::sync::{watch, Mutex};

use super::agent::Agent;
use burrow_vmm_api::layout;

use super::vmm::{VmmArgs, VmmLaunch};
use crate::sandbox::{AfterCheckpoint, Result, SandboxError};

/// Incremental hibernation snapshots on one full one before the next full
/// one (the VMM follows at most [`layout::MAX_VMM_CHAIN`]).
pub use burrow_vmm_api::layout::MAX_HIBERNATION_CHAIN as MAX_CHAIN;

/// A started VM process (burrow-vmm, or a fake).
#[async_trait]
pub trait VmProcess: Send + Sync {
    fn pid(&self) -> u32;
    /// `Some(why)` once the process has exited.
    fn exited(&self) -> watch::Receiver<Option<String>>;
    async fn pause(&self) -> Result<()>;
    async fn resume(&self) -> Result<()>;
    /// Snapshot the VM into `dir` (its parent exists), only the pages
    /// dirtied since the last snapshot if `incremental`; the VM is left
    /// paused. Returns the VMM's summary for the log.
    async fn snapshot(&self, dir: &Path, incremental: bool) -> Result<String>;
    /// Ask it to stop, give it a moment, then kill it.
    async fn stop(&mut self);
    /// Kill it now.
    async fn kill(&mut self);
}

/// A VM that has just started, with its agent connected.
pub struct Launched {
    pub vm: Box<dyn VmProcess>,
    pub agent: Agent,
}

/// Starts VM processes: boots `args`, or restores the snapshot
/// `args.restore` names; either way the guest's agent answers and its clock
/// (and after a restore, its entropy) is brought up to date.
#[async_trait]
pub trait Launcher: Send + Sync {
    async fn launch(&self, args: &VmmLaunch) -> Result<Launched>;
    /// The VM process was stopped or killed on purpose.
    fn stopped(&self) {}
    /// Kills the VM process it started last, from outside the transition
    /// lock: while a launch that holds it waits on a silent guest, say.
    fn killer(&self) -> Option<Killer> {
        None
    }
}

/// Kills a VM process without its lock (burrow-vmm: through a pidfd, so
/// never another process that got its pid).
#[derive(Clone)]
pub struct Killer(Arc<dyn Fn() + Send + Sync>);

impl Killer {
    pub fn new(kill: impl Fn() + Send + Sync + 'static) -> Self {
        Self(Arc::new(kill))
    }

    pub fn kill(&self) {
        (self.0)()
    }
}

/// The newest link of a sandbox's hibernation chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    /// Its directory name inside the hibernation directory (`vm-<n>`).
    pub latest: String,
    /// Incremental links on top of the full snapshot (0: it is the full one).
    pub depth: u32,
}

/// Why a VM is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gone {
    /// Stopped by the shim (its container was deleted, or shutdown).
    Stopped,
    /// Stopped by a checkpoint with `exit`: its processes were killed on
    /// purpose (CRIU's checkpoint kills them too), not lost.
    Checkpointed,
    /// The VMM exited by itself (killed, crashed, the guest powered off).
    Died(String),
    /// Killed by the shim for a SIGKILL its agent did not answer: the
    /// container's processes were killed, as asked (reported as 137).
    Killed,
}

/// A running VM, as its clients see it.
#[derive(Clone)]
pub struct Handle {
    pub agent: Agent,
    /// Counts the VM processes this lifecycle started: a call made on one
    /// can tell whether the VM it reached is still the same.
    pub generation: u64,
    pub pid: u32,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub memory_max_mib: Option<u64>,
    exited: watch::Receiver<Option<String>>,
    /// The hibernation link this VM woke from, while it is still the VM's
    /// last snapshot: the next hibernation writes only the pages dirtied
    /// since, on top of it.
    base: Option<Chain>,
}

/// Where the VM is.
#[derive(Clone)]
pub enum Phase {
    /// No VM yet.
    Empty,
    /// Booting, restoring a checkpoint or waking from hibernation.
    Booting,
    Running(Arc<Handle>),
    /// Frozen by containerd's Pause.
    Paused(Arc<Handle>),
    /// Being snapshotted (a checkpoint or a hibernation); paused meanwhile.
    Snapshotting(Arc<Handle>),
    /// Hibernated: no process; the snapshot is the chain's latest link.
    Asleep(Chain),
    Gone(Gone),
}

impl Phase {
    /// The name the control socket reports.
    pub fn name(&self) -> &'static str {
        match self {
            Phase::Empty => "empty",
            Phase::Booting => "booting",
            Phase::Running(_) => "running",
            Phase::Paused(_) => "paused",
            Phase::Snapshotting(_) => "snapshotting",
            Phase::Asleep(_) => "asleep",
            Phase::Gone(_) => "stopped",
        }
    }

    /// The VM's handle while it has a process.
    pub fn handle(&self) -> Option<&Arc<Handle>> {
        match self {
            Phase::Running(h) | Phase::Paused(h) | Phase::Snapshotting(h) => Some(h),
            _ => None,
        }
    }

    /// The error for a call that needs a VM in this phase.
    fn not_running(&self) -> SandboxError {
        match self {
            Phase::Gone(Gone::Died(why)) => {
                SandboxError::Unavailable(format!("the VM exited: {why}"))
            }
            Phase::Gone(Gone::Checkpointed) => SandboxError::FailedPrecondition(
                "the VM was stopped by a checkpoint with exit".into(),
            ),
            Phase::Gone(Gone::Killed) => SandboxError::Unavailable(
                "the VM was killed: its agent did not answer a SIGKILL".into(),
            ),
            _ => SandboxError::FailedPrecondition("the VM is not running".into()),
        }
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handle")
            .field("generation", &self.generation)
            .field("pid", &self.pid)
            .field("base", &self.base)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Phase::Asleep(c) => write!(f, "Asleep({c:?})"),
            Phase::Gone(g) => write!(f, "Gone({g:?})"),
            p => match p.handle() {
                Some(h) => write!(f, "{}(generation {})", p.name(), h.generation),
                None => f.write_str(p.name()),
            },
        }
    }
}

/// The VM's size, for the manifest a snapshot's writer adds.
#[derive(Debug, Clone, Copy)]
pub struct VmInfo {
    pub vcpus: u32,
    pub memory_mib: u64,
    pub memory_max_mib: Option<u64>,
}

/// What the transition lock guards.
#[derive(Default)]
struct Slot {
    vm: Option<Box<dyn VmProcess>>,
    /// What the VM was last started with (a wake restores with the same
    /// disks and sockets).
    args: Option<VmmLaunch>,
    generation: u64,
}

/// The sandbox's VM (see the module doc).
pub struct Lifecycle {
    phase: Arc<watch::Sender<Phase>>,
    slot: Mutex<Slot>,
    launcher: Box<dyn Launcher>,
    /// Where the hibernation chain goes.
    hibernate_dir: PathBuf,
}

impl Lifecycle {
    pub fn new(launcher: Box<dyn Launcher>, hibernate_dir: PathBuf) -> Self {
        Self {
            phase: Arc::new(watch::channel(Phase::Empty).0),
            slot: Mutex::new(Slot::default()),
            launcher,
            hibernate_dir,
        }
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase.borrow().clone()
    }

    /// Where the hibernation chain goes.
    pub fn hibernate_dir(&self) -> &Path {
        &self.hibernate_dir
    }

    /// Follow the phase.
    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    /// Publish `next` unless the VM died meanwhile (the exit watcher has
    /// the last word on a VM that is gone).
    fn settle(&self, next: Phase) {
        self.phase.send_if_modified(|p| {
            if matches!(p, Phase::Gone(_)) {
                false
            } else {
                *p = next;
                true
            }
        });
    }

    /// Boot (or restore) a VM with `args` and run `setup` on its agent
    /// (create the container, bring a restored guest up to date); the VM
    /// runs once both succeeded. Only when there is no VM.
    pub async fn start<T, F, Fut>(&self, args: VmmLaunch, setup: F) -> Result<T>
    where
        F: FnOnce(Agent) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let mut slot = self.slot.lock().await;
        let before = self.phase();
        if !matches!(before, Phase::Empty | Phase::Gone(_)) {
            return Err(SandboxError::FailedPrecondition(format!(
                "the sandbox's VM is {} already",
                before.name()
            )));
        }
        self.phase.send_replace(Phase::Booting);
        let r = self.launch(&mut slot, args, None, setup).await;
        if r.is_err() {
            self.phase.send_replace(before);
        }
        r
    }

    /// Launch, set up, and publish a new VM as running.
    async fn launch<T, F, Fut>(
        &self,
        slot: &mut Slot,
        args: VmmLaunch,
        base: Option<Chain>,
        setup: F,
    ) -> Result<T>
    where
        F: FnOnce(Agent) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let Launched { mut vm, agent } = self.launcher.launch(&args).await?;
        let out = match setup(agent.clone()).await {
            Ok(out) => out,
            Err(e) => {
                vm.kill().await;
                self.launcher.stopped();
                return Err(e);
            }
        };
        slot.generation = slot.generation.saturating_add(1);
        let handle = Arc::new(Handle {
            agent,
            generation: slot.generation,
            pid: vm.pid(),
            vcpus: args.vcpus,
            memory_mib: args.memory_mib,
            memory_max_mib: args.memory_max_mib,
            exited: vm.exited(),
            base,
        });
        slot.vm = Some(vm);
        // Kept for a wake, which restores its own snapshot: not a
        // descriptor that was this launch's alone (a restore's packed
        // memory, closed once the VM runs; its number may be reused).
        let mut args = args;
        args.args.packed_memory_fd = None;
        slot.args = Some(args);
        self.phase.send_replace(Phase::Running(handle.clone()));
        self.watch_exit(&handle);
        Ok(out)
    }

    /// Turn the phase to `Gone(Died)` when this VM's process exits while it
    /// is still the VM (deliberate stops change the phase first).
    fn watch_exit(&self, handle: &Handle) {
        let phase = Arc::downgrade(&self.phase);
        let mut exited = handle.exited.clone();
        let generation = handle.generation;
        tokio::spawn(async move {
            let why = match exited.wait_for(Option::is_some).await {
                Ok(why) => why.clone().unwrap_or_default(),
                Err(_) => "burrow-vmm is gone".to_string(),
            };
            let Some(phase) = phase.upgrade() else { return };
            phase.send_if_modified(|p| {
                if p.handle().is_some_and(|h| h.generation == generation) {
                    tracing::warn!("the VM died: {why}");
                    *p = Phase::Gone(Gone::Died(why));
                    true
                } else {
                    false
                }
            });
        });
    }

    /// Restore a hibernated VM. A no-op unless it is asleep.
    pub async fn wake(&self) -> Result<()> {
        if !matches!(*self.phase.borrow(), Phase::Asleep(_)) {
            return Ok(());
        }
        let mut slot = self.slot.lock().await;
        self.wake_locked(&mut slot).await
    }

    async fn wake_locked(&self, slot: &mut Slot) -> Result<()> {
        let Phase::Asleep(chain) = self.phase() else {
            return Ok(());
        };
        let args = slot.args.clone().ok_or_else(|| {
            SandboxError::Internal("a hibernated VM without its arguments".into())
        })?;
        let args = VmmLaunch {
            args: VmmArgs {
                kernel: None,
                restore: Some(self.hibernate_dir.join(&chain.latest)),
                ..args.args
            },
            ..args
        };
        let started = Instant::now();
        self.phase.send_replace(Phase::Booting);
        let woken = self
            .launch(slot, args, Some(chain.clone()), |_| async { Ok(()) })
            .await;
        if let Err(e) = woken {
            self.phase.send_replace(Phase::Asleep(chain));
            return Err(e);
        }
        tracing::info!(
            "woke from hibernation in {} ms",
            started.elapsed().as_millis()
        );
        Ok(())
    }

    /// The VM's handle once it can take calls: waits while it boots or is
    /// snapshotted, wakes it if it is asleep.
    pub async fn awake(&self) -> Result<Arc<Handle>> {
        self.ready(true).await
    }

    /// The VM's handle once it runs, without waking it.
    async fn when_running(&self) -> Result<Arc<Handle>> {
        self.ready(false).await
    }

    async fn ready(&self, wake: bool) -> Result<Arc<Handle>> {
        let mut rx = self.phase.subscribe();
        loop {
            let phase = rx.borrow_and_update().clone();
            match phase {
                Phase::Running(h) | Phase::Paused(h) => return Ok(h),
                Phase::Asleep(_) if wake => self.wake().await?,
                Phase::Asleep(_) | Phase::Booting | Phase::Snapshotting(_) => {
                    changed(&mut rx).await?
                }
                Phase::Empty | Phase::Gone(_) => return Err(phase.not_running()),
            }
        }
    }

    /// The phase once the VM is not booting (does not wake it).
    pub async fn settled(&self) -> Result<Phase> {
        let mut rx = self.phase.subscribe();
        loop {
            let phase = rx.borrow_and_update().clone();
            if !matches!(phase, Phase::Booting) {
                return Ok(phase);
            }
            changed(&mut rx).await?;
        }
    }

    /// Whether the VM a call reached at `generation` has gone to sleep (or
    /// been replaced by a woken one) since: not when it died or stopped.
    fn slept_since(&self, generation: u64) -> bool {
        match &*self.phase.borrow() {
            Phase::Running(h) | Phase::Paused(h) => h.generation != generation,
            Phase::Snapshotting(_) | Phase::Booting | Phase::Asleep(_) => true,
            Phase::Empty | Phase::Gone(_) => false,
        }
    }

    /// Run an agent call that blocks (wait, output reads, the OOM watch)
    /// and must not wake the VM: once the VM runs, failing when it dies,
    /// and again after the next wake when a hibernation cuts it off.
    /// `what` names the call in the log (built only when it is logged).
    pub async fn across_sleep<T, F, Fut>(&self, what: impl Fn() -> String, call: F) -> Result<T>
    where
        F: Fn(Agent) -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        loop {
            let h = self.when_running().await?;
            let mut exited = h.exited.clone();
            let r = tokio::select! {
                r = call(h.agent.clone()) => r,
                gone = exited.wait_for(Option::is_some) => {
                    let why = gone.ok().and_then(|g| g.clone()).unwrap_or_else(|| "burrow-vmm is gone".into());
                    Err(SandboxError::Unavailable(format!("the VM exited: {why}")))
                }
            };
            match r {
                Err(e) if self.slept_since(h.generation) => {
                    tracing::debug!("{} interrupted by hibernation: {e}", what());
                }
                r => return r,
            }
        }
    }

    /// Freeze the VM (waking it first if it is asleep).
    pub async fn pause(&self) -> Result<()> {
        let mut slot = self.slot.lock().await;
        self.wake_locked(&mut slot).await?;
        match self.phase() {
            Phase::Running(h) => {
                running(&slot)?.pause().await?;
                self.settle(Phase::Paused(h));
                Ok(())
            }
            Phase::Paused(_) => Ok(()),
            other => Err(other.not_running()),
        }
    }

    /// Thaw a paused VM.
    pub async fn resume(&self) -> Result<()> {
        let slot = self.slot.lock().await;
        match self.phase() {
            Phase::Paused(h) => {
                running(&slot)?.resume().await?;
                self.settle(Phase::Running(h));
                Ok(())
            }
            Phase::Running(_) => Ok(()),
            other => Err(other.not_running()),
        }
    }

    /// Snapshot the VM into `vm_dir` (waking it first if it is asleep),
    /// let `write` add the rest of the checkpoint (disk, manifest) while
    /// the VM is still paused, then do what `after` says. On failure the
    /// VM goes back to running (or stays paused if it was).
    pub async fn checkpoint<F, Fut>(
        &self,
        vm_dir: &Path,
        after: AfterCheckpoint,
        write: F,
    ) -> Result<()>
    where
        F: FnOnce(VmInfo) -> Fut,
        Fut: Future<Output = Result<()>>,
    {
        let mut slot = self.slot.lock().await;
        self.wake_locked(&mut slot).await?;
        let (h, was_paused) = match self.phase() {
            Phase::Running(h) => (h, false),
            Phase::Paused(h) => (h, true),
            other => return Err(other.not_running()),
        };
        self.phase.send_replace(Phase::Snapshotting(h.clone()));
        // Any snapshot moves the base of the VMM's next incremental one.
        let h = Arc::new(Handle {
            base: None,
            ..(*h).clone()
        });
        let vm = running(&slot)?;
        let written = snapshot_with(vm, &h, vm_dir, false, write).await;
        let after = match (&written, after) {
            (Err(_), _) if was_paused => AfterCheckpoint::StayPaused,
            (Err(_), _) => AfterCheckpoint::Resume,
            (Ok(()), after) => after,
        };
        match after {
            AfterCheckpoint::Resume => {
                let resumed = vm.resume().await;
                self.settle(match resumed {
                    Ok(()) => Phase::Running(h),
                    Err(_) => Phase::Paused(h),
                });
                if let Err(e) = resumed {
                    tracing::error!("resuming the VM after a checkpoint: {e}");
                    written?;
                    return Err(e);
                }
            }
            AfterCheckpoint::StayPaused => self.settle(Phase::Paused(h)),
            AfterCheckpoint::Exit => self.stop_locked(&mut slot, Gone::Checkpointed).await,
        }
        written
    }

    /// Snapshot the VM into the next link of the hibernation chain and stop
    /// its process; `write` adds the manifest (given the link's name). A
    /// no-op when it is asleep already; refused while it is paused.
    pub async fn hibernate<F, Fut>(&self, write: F) -> Result<()>
    where
        F: Fn(VmInfo, String) -> Fut,
        Fut: Future<Output = Result<()>>,
    {
        let mut slot = self.slot.lock().await;
        let h = match self.phase() {
            Phase::Running(h) => h,
            Phase::Asleep(_) => return Ok(()),
            Phase::Paused(_) => {
                return Err(SandboxError::FailedPrecondition(
                    "the task is paused: resume it before hibernating".into(),
                ))
            }
            other => return Err(other.not_running()),
        };
        let started = Instant::now();
        self.phase.send_replace(Phase::Snapshotting(h.clone()));
        let dir = self.hibernate_dir.clone();
        let on_top = h
            .base
            .clone()
            .filter(|c| c.depth < MAX_CHAIN && dir.join(&c.latest).is_dir());
        if on_top.is_none() {
            // A fresh chain. Links a running VMM still maps may go: its
            // mapping is private and outlives the file.
            remove_dir(&dir);
        }
        // A new name each time: never write over a file a VMM maps.
        let name = layout::link_name(h.generation);
        let link = dir.join(&name);
        let vm = running(&slot)?;
        let mut depth = on_top.as_ref().map_or(0, |c| c.depth.saturating_add(1));
        let write_link = |incremental: bool| {
            let (h, link, write) = (&h, &link, &write);
            remove_dir_only(link);
            let name = name.clone();
            async move {
                let r = snapshot_with(vm, h, link, incremental, |info| write(info, name)).await;
                if r.is_err() {
                    remove_dir_only(link);
                }
                r
            }
        };
        let mut written = write_link(on_top.is_some()).await;
        if let (Err(e), Some(_)) = (&written, &on_top) {
            tracing::warn!("incremental hibernation snapshot failed ({e}): taking a full one");
            depth = 0;
            written = write_link(false).await;
        }
        if let Err(e) = written {
            if let Err(r) = vm.resume().await {
                tracing::error!("resuming after a failed hibernation: {r}");
            }
            if on_top.is_none() {
                remove_dir(&dir);
            }
            self.settle(Phase::Running(Arc::new(Handle {
                base: None,
                ..(*h).clone()
            })));
            return Err(e);
        }
        if depth == 0 {
            drop_links_but(&dir, &name);
        }
        self.settle(Phase::Asleep(Chain {
            latest: name,
            depth,
        }));
        if let Some(mut vm) = slot.vm.take() {
            vm.stop().await;
            self.launcher.stopped();
        }
        tracing::info!(
            "hibernated to {} in {} ms",
            dir.display(),
            started.elapsed().as_millis()
        );
        Ok(())
    }

    /// Stop the VM for good (from any phase) and drop its hibernation
    /// chain. Idempotent; a VM that is gone keeps its first reason.
    pub async fn stop(&self, why: Gone) {
        // Not behind a transition that may wait on the guest (a wake's
        // connect, a snapshot): kill the VM, and that transition fails at
        // once.
        let mut slot = match self.slot.try_lock() {
            Ok(slot) => slot,
            Err(_) => {
                if let Some(k) = self.launcher.killer() {
                    tracing::info!("stopping the VM while a transition holds it: killing burrow-vmm");
                    k.kill();
                }
                self.slot.lock().await
            }
        };
        self.stop_locked(&mut slot, why).await;
    }

    /// Kill the VM now (its agent does not answer), without waiting for the
    /// transition lock, and stop it for good.
    pub async fn kill(&self, why: Gone) {
        // The reason first: the VMM's exit must not read as a death.
        let reason = why.clone();
        self.phase.send_if_modified(move |p| {
            if matches!(p, Phase::Gone(_)) {
                false
            } else {
                *p = Phase::Gone(reason);
                true
            }
        });
        if let Some(k) = self.launcher.killer() {
            k.kill();
        }
        self.stop(why).await;
    }

    async fn stop_locked(&self, slot: &mut Slot, why: Gone) {
        self.phase.send_if_modified(|p| {
            if matches!(p, Phase::Gone(_)) {
                false
            } else {
                *p = Phase::Gone(why);
                true
            }
        });
        if let Some(mut vm) = slot.vm.take() {
            vm.stop().await;
            self.launcher.stopped();
        }
        remove_dir(&self.hibernate_dir);
    }
}

/// Wait for the next phase.
async fn changed(rx: &mut watch::Receiver<Phase>) -> Result<()> {
    rx.changed()
        .await
        .map_err(|_| SandboxError::Unavailable("the sandbox is gone".into()))
}

/// The VM process of a phase that has one.
fn running(slot: &Slot) -> Result<&dyn VmProcess> {
    slot.vm
        .as_deref()
        .ok_or_else(|| SandboxError::FailedPrecondition("the VM is not running".into()))
}

/// Snapshot `vm` into `dir`, then run `write`.
async fn snapshot_with<F, Fut>(
    vm: &dyn VmProcess,
    h: &Handle,
    dir: &Path,
    incremental: bool,
    write: F,
) -> Result<()>
where
    F: FnOnce(VmInfo) -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let started = Instant::now();
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", parent.display())))?;
    }
    let summary = vm.snapshot(dir, incremental).await?;
    write(VmInfo {
        vcpus: h.vcpus,
        memory_mib: h.memory_mib,
        memory_max_mib: h.memory_max_mib,
    })
    .await?;
    tracing::info!(
        "snapshot written to {} in {} ms: {}",
        dir.display(),
        started.elapsed().as_millis(),
        summary.trim()
    );
    Ok(())
}

/// Remove directory `dir` with what is in it, and its parent once empty.
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

#[cfg(test)]
#[path = "lifecycle_tests.rs"]
mod tests;
