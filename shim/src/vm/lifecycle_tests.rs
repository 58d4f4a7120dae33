//! The lifecycle's phase transitions against a fake VM process.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex as StdMutex;
use std::time::Duration;

use burrow_protocol::ttrpc;
use burrow_protocol::AgentClient;
use tokio::sync::Semaphore;

use super::*;

/// What the fakes share with the test.
#[derive(Default)]
struct World {
    /// Launches so far: the snapshot each restored (None: a boot).
    launches: StdMutex<Vec<Option<PathBuf>>>,
    /// Snapshots so far: (directory, incremental).
    snapshots: StdMutex<Vec<(PathBuf, bool)>>,
    /// The exit sender of the newest VM.
    exit: StdMutex<Option<watch::Sender<Option<String>>>>,
    paused: AtomicBool,
    stops: AtomicU32,
    /// Fail the next launch / snapshot.
    fail_launch: AtomicBool,
    fail_snapshot: AtomicBool,
    /// Snapshots wait for a permit when set.
    gate: StdMutex<Option<Arc<Semaphore>>>,
    /// Launches wait (a guest that never answers) until killed.
    hang_launch: AtomicBool,
    killed: AtomicBool,
    unhang: tokio::sync::Notify,
}

impl World {
    fn die(&self, why: &str) {
        if let Some(tx) = self.exit.lock().expect("lock").as_ref() {
            tx.send_replace(Some(why.to_string()));
        }
    }
    fn snapshots(&self) -> Vec<(PathBuf, bool)> {
        self.snapshots.lock().expect("lock").clone()
    }
    fn launches(&self) -> Vec<Option<PathBuf>> {
        self.launches.lock().expect("lock").clone()
    }
}

struct FakeVm {
    world: Arc<World>,
    exited: watch::Receiver<Option<String>>,
    tx: watch::Sender<Option<String>>,
}

#[async_trait]
impl VmProcess for FakeVm {
    fn pid(&self) -> u32 {
        4242
    }
    fn exited(&self) -> watch::Receiver<Option<String>> {
        self.exited.clone()
    }
    async fn pause(&self) -> Result<()> {
        self.world.paused.store(true, Ordering::SeqCst);
        Ok(())
    }
    async fn resume(&self) -> Result<()> {
        self.world.paused.store(false, Ordering::SeqCst);
        Ok(())
    }
    async fn snapshot(&self, dir: &Path, incremental: bool) -> Result<String> {
        let gate = self.world.gate.lock().expect("lock").clone();
        if let Some(gate) = gate {
            let _permit = gate.acquire().await.expect("gate");
        }
        if self.world.fail_snapshot.swap(false, Ordering::SeqCst) {
            return Err(SandboxError::Internal("no space left".into()));
        }
        self.world.paused.store(true, Ordering::SeqCst);
        std::fs::create_dir_all(dir).expect("snapshot dir");
        self.world
            .snapshots
            .lock()
            .expect("lock")
            .push((dir.to_path_buf(), incremental));
        Ok("ok".into())
    }
    async fn stop(&mut self) {
        self.world.stops.fetch_add(1, Ordering::SeqCst);
        self.tx.send_replace(Some("stopped".into()));
    }
    async fn kill(&mut self) {
        self.tx.send_replace(Some("killed".into()));
    }
}

struct FakeLauncher(Arc<World>);

/// An agent whose peer is gone: the lifecycle only hands it out.
fn fake_agent() -> Agent {
    let (a, _) = tokio::net::UnixStream::pair().expect("socketpair");
    let socket = ttrpc::r#async::transport::Socket::new(a);
    Agent::new(
        AgentClient::new(ttrpc::r#async::Client::new(socket)),
        Duration::from_secs(1),
    )
}

#[async_trait]
impl Launcher for FakeLauncher {
    fn killer(&self) -> Option<Killer> {
        let w = self.0.clone();
        Some(Killer::new(move || {
            w.killed.store(true, Ordering::SeqCst);
            w.unhang.notify_one();
        }))
    }

    async fn launch(&self, args: &VmmLaunch) -> Result<Launched> {
        if self.0.hang_launch.load(Ordering::SeqCst) {
            self.0.unhang.notified().await;
            return Err(SandboxError::Unavailable(
                "the VM exited while booting: killed".into(),
            ));
        }
        if self.0.fail_launch.swap(false, Ordering::SeqCst) {
            return Err(SandboxError::Unavailable(
                "the VM exited while booting".into(),
            ));
        }
        self.0
            .launches
            .lock()
            .expect("lock")
            .push(args.args.restore.clone());
        let (tx, exited) = watch::channel(None);
        *self.0.exit.lock().expect("lock") = Some(tx.clone());
        Ok(Launched {
            vm: Box::new(FakeVm {
                world: self.0.clone(),
                exited,
                tx,
            }),
            agent: fake_agent(),
        })
    }
}

struct T {
    lc: Arc<Lifecycle>,
    world: Arc<World>,
    dir: tempfile::TempDir,
}

impl T {
    fn new() -> Self {
        let world = Arc::new(World::default());
        let dir = tempfile::tempdir().expect("tempdir");
        let lc = Lifecycle::new(
            Box::new(FakeLauncher(world.clone())),
            dir.path().join("hib").join("sb"),
        );
        Self {
            lc: Arc::new(lc),
            world,
            dir,
        }
    }

    fn args(&self) -> VmmLaunch {
        let p = self.dir.path();
        VmmLaunch {
            binary: "burrow-vmm".into(),
            args: VmmArgs {
                vsock: Some(p.join("v")),
                vcpus: 2,
                mem_mib: 256,
                ..VmmArgs::boot("/k".into())
            },
            vcpus: 2,
            memory_mib: 256,
            memory_max_mib: None,
        }
    }

    async fn boot(&self) {
        let pid = self
            .lc
            .start(self.args(), |_| async { Ok(7) })
            .await
            .expect("start");
        assert_eq!(pid, 7);
    }

    fn generation(&self) -> u64 {
        self.lc.phase().handle().expect("a running VM").generation
    }

    async fn hibernate(&self) -> Result<()> {
        self.lc.hibernate(|_, _| async { Ok(()) }).await
    }

    async fn checkpoint(&self, after: AfterCheckpoint) -> Result<()> {
        let dir = self.dir.path().join("cp").join("vm");
        self.lc.checkpoint(&dir, after, |_| async { Ok(()) }).await
    }

    /// Wait (bounded) until the phase is one `want` accepts.
    async fn phase_becomes(&self, what: &str, want: impl Fn(&Phase) -> bool) {
        let mut rx = self.lc.subscribe();
        let r = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|p| want(p))).await;
        assert!(
            r.is_ok(),
            "phase never became {what}: {:?}",
            self.lc.phase()
        );
    }
}

fn name(p: &Phase) -> &'static str {
    p.name()
}

#[tokio::test]
async fn boot_pause_resume_stop() {
    let t = T::new();
    assert_eq!(name(&t.lc.phase()), "empty");
    t.boot().await;
    assert_eq!(name(&t.lc.phase()), "running");
    assert_eq!(t.generation(), 1);
    t.lc.pause().await.expect("pause");
    assert_eq!(name(&t.lc.phase()), "paused");
    assert!(t.world.paused.load(Ordering::SeqCst));
    // A paused VM still answers (its calls wait in the guest).
    assert_eq!(t.lc.awake().await.expect("awake").generation, 1);
    t.lc.resume().await.expect("resume");
    assert_eq!(name(&t.lc.phase()), "running");
    assert!(!t.world.paused.load(Ordering::SeqCst));
    // A second VM is refused while one runs.
    let e =
        t.lc.start(t.args(), |_| async { Ok(()) })
            .await
            .expect_err("second start");
    assert!(matches!(e, SandboxError::FailedPrecondition(_)), "{e}");
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
    assert_eq!(t.world.stops.load(Ordering::SeqCst), 1);
    let e = t.lc.awake().await.expect_err("awake after stop");
    assert!(matches!(e, SandboxError::FailedPrecondition(_)), "{e}");
}

#[tokio::test]
async fn a_failed_start_leaves_no_vm() {
    let t = T::new();
    t.world.fail_launch.store(true, Ordering::SeqCst);
    t.lc.start(t.args(), |_| async { Ok(()) })
        .await
        .expect_err("launch fails");
    assert_eq!(name(&t.lc.phase()), "empty");
    // The setup failing kills the VM it started.
    let e =
        t.lc.start(t.args(), |_| async {
            Err::<(), _>(SandboxError::InvalidArgument("bad spec".into()))
        })
        .await
        .expect_err("setup fails");
    assert!(matches!(e, SandboxError::InvalidArgument(_)), "{e}");
    assert_eq!(name(&t.lc.phase()), "empty");
    t.boot().await;
    assert_eq!(name(&t.lc.phase()), "running");
}

#[tokio::test]
async fn hibernation_is_incremental_until_a_checkpoint() {
    let t = T::new();
    t.boot().await;
    t.hibernate().await.expect("hibernate");
    assert_eq!(
        format!("{:?}", t.lc.phase()),
        "Asleep(Chain { latest: \"vm-1\", depth: 0 })"
    );
    assert_eq!(t.world.stops.load(Ordering::SeqCst), 1, "the VMM stopped");
    // Hibernating again is a no-op; stats-like readers see no handle.
    t.hibernate().await.expect("again");
    assert!(t.lc.phase().handle().is_none());
    // Any call that needs the guest wakes it from the latest link.
    let h = t.lc.awake().await.expect("wake");
    assert_eq!(h.generation, 2);
    let hib = t.dir.path().join("hib").join("sb");
    assert_eq!(t.world.launches(), [None, Some(hib.join("vm-1"))]);
    // The next hibernation only writes what changed, on top of vm-1.
    t.hibernate().await.expect("hibernate 2");
    t.lc.wake().await.expect("wake 2");
    assert!(matches!(t.lc.phase(), Phase::Running(_)));
    // A checkpoint moves the VMM's base: the next hibernation is full and
    // drops the old links.
    t.checkpoint(AfterCheckpoint::Resume)
        .await
        .expect("checkpoint");
    t.hibernate().await.expect("hibernate 3");
    let snaps: Vec<(String, bool)> = t
        .world
        .snapshots()
        .into_iter()
        .map(|(d, inc)| {
            (
                d.file_name().unwrap_or_default().to_string_lossy().into(),
                inc,
            )
        })
        .collect();
    assert_eq!(
        snaps,
        [
            ("vm-1".to_string(), false),
            ("vm-2".to_string(), true),
            ("vm".to_string(), false),
            ("vm-3".to_string(), false),
        ]
    );
    assert!(hib.join("vm-3").is_dir());
    assert!(!hib.join("vm-1").exists() && !hib.join("vm-2").exists());
}

#[tokio::test]
async fn a_failed_incremental_hibernation_takes_a_full_one() {
    let t = T::new();
    t.boot().await;
    t.hibernate().await.expect("hibernate");
    t.lc.wake().await.expect("wake");
    t.world.fail_snapshot.store(true, Ordering::SeqCst);
    t.hibernate().await.expect("hibernate after one failure");
    assert_eq!(
        format!("{:?}", t.lc.phase()),
        "Asleep(Chain { latest: \"vm-2\", depth: 0 })"
    );
    let incremental: Vec<bool> = t.world.snapshots().into_iter().map(|s| s.1).collect();
    assert_eq!(incremental, [false, false]);
}

#[tokio::test]
async fn a_failed_wake_stays_asleep_and_a_paused_vm_does_not_hibernate() {
    let t = T::new();
    t.boot().await;
    t.lc.pause().await.expect("pause");
    let e = t.hibernate().await.expect_err("paused");
    assert!(e.to_string().contains("paused"), "{e}");
    t.lc.resume().await.expect("resume");
    t.hibernate().await.expect("hibernate");
    t.world.fail_launch.store(true, Ordering::SeqCst);
    t.lc.awake().await.expect_err("wake fails");
    assert!(matches!(t.lc.phase(), Phase::Asleep(_)));
    // The next call tries again.
    assert_eq!(t.lc.awake().await.expect("wake").generation, 2);
}

#[tokio::test]
async fn a_call_while_snapshotting_waits_for_the_snapshot() {
    let t = T::new();
    t.boot().await;
    let gate = Arc::new(Semaphore::new(0));
    *t.world.gate.lock().expect("lock") = Some(gate.clone());
    let lc = t.lc.clone();
    let dir = t.dir.path().join("cp").join("vm");
    let cp = tokio::spawn(async move {
        lc.checkpoint(&dir, AfterCheckpoint::Resume, |_| async { Ok(()) })
            .await
    });
    t.phase_becomes("snapshotting", |p| matches!(p, Phase::Snapshotting(_)))
        .await;
    let lc = t.lc.clone();
    let call = tokio::spawn(async move { lc.awake().await.map(|h| h.generation) });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!call.is_finished(), "a call went through mid-snapshot");
    gate.add_permits(1);
    assert_eq!(call.await.expect("join").expect("awake"), 1);
    cp.await.expect("join").expect("checkpoint");
    assert!(matches!(t.lc.phase(), Phase::Running(_)));
    assert!(!t.world.paused.load(Ordering::SeqCst), "resumed");
}

#[tokio::test]
async fn checkpoints_end_as_asked_and_failures_resume() {
    let t = T::new();
    t.boot().await;
    t.lc.pause().await.expect("pause");
    t.checkpoint(AfterCheckpoint::StayPaused)
        .await
        .expect("checkpoint");
    assert!(matches!(t.lc.phase(), Phase::Paused(_)));
    t.lc.resume().await.expect("resume");
    t.world.fail_snapshot.store(true, Ordering::SeqCst);
    t.checkpoint(AfterCheckpoint::Exit)
        .await
        .expect_err("snapshot fails");
    assert!(matches!(t.lc.phase(), Phase::Running(_)), "runs on");
    assert!(!t.world.paused.load(Ordering::SeqCst));
    t.checkpoint(AfterCheckpoint::Exit)
        .await
        .expect("checkpoint --exit");
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Checkpointed)));
    // Deleting the container afterwards keeps the reason.
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Checkpointed)));
}

#[tokio::test]
async fn stop_from_every_phase() {
    // Empty.
    let t = T::new();
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
    // Paused.
    let t = T::new();
    t.boot().await;
    t.lc.pause().await.expect("pause");
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
    assert_eq!(t.world.stops.load(Ordering::SeqCst), 1);
    // Asleep: no process to stop; the chain goes.
    let t = T::new();
    t.boot().await;
    t.hibernate().await.expect("hibernate");
    let hib = t.dir.path().join("hib").join("sb");
    assert!(hib.join("vm-1").is_dir());
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
    assert!(!hib.exists(), "the hibernation chain is gone");
    assert_eq!(
        t.world.stops.load(Ordering::SeqCst),
        1,
        "only hibernation's"
    );
    // Snapshotting: the stop waits for the snapshot, then stops.
    let t = T::new();
    t.boot().await;
    let gate = Arc::new(Semaphore::new(0));
    *t.world.gate.lock().expect("lock") = Some(gate.clone());
    let lc = t.lc.clone();
    let hib = tokio::spawn(async move { lc.hibernate(|_, _| async { Ok(()) }).await });
    t.phase_becomes("snapshotting", |p| matches!(p, Phase::Snapshotting(_)))
        .await;
    let lc = t.lc.clone();
    let stop = tokio::spawn(async move { lc.stop(Gone::Stopped).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!stop.is_finished());
    gate.add_permits(1);
    hib.await.expect("join").expect("hibernate");
    stop.await.expect("join");
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
    // Gone: idempotent.
    t.lc.stop(Gone::Stopped).await;
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)));
}

#[tokio::test]
async fn a_dead_vmm_makes_the_vm_gone_and_ends_blocked_calls() {
    let t = T::new();
    t.boot().await;
    let lc = t.lc.clone();
    let blocked = tokio::spawn(async move {
        lc.across_sleep(|| "wait".into(), |_| std::future::pending::<Result<()>>())
            .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    t.world.die("burrow-vmm exited (signal: 9)");
    t.phase_becomes("gone", |p| matches!(p, Phase::Gone(Gone::Died(_))))
        .await;
    let e = blocked.await.expect("join").expect_err("the VM died");
    assert!(matches!(e, SandboxError::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("signal: 9"), "{e}");
    let e = t.lc.awake().await.expect_err("awake");
    assert!(e.to_string().contains("signal: 9"), "{e}");
    // A new VM may start after a death (a new container).
    t.boot().await;
    assert_eq!(t.generation(), 2);
}

#[tokio::test]
async fn blocked_calls_survive_a_hibernation_without_waking_the_vm() {
    let t = T::new();
    t.boot().await;
    let calls = Arc::new(AtomicU32::new(0));
    let lc = t.lc.clone();
    let n = calls.clone();
    let blocked = tokio::spawn(async move {
        lc.across_sleep(
            || "read".into(),
            move |_| {
                let first = n.fetch_add(1, Ordering::SeqCst) == 0;
                async move {
                    if first {
                        std::future::pending::<()>().await;
                    }
                    Ok("data")
                }
            },
        )
        .await
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    t.hibernate().await.expect("hibernate");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(matches!(t.lc.phase(), Phase::Asleep(_)), "not woken");
    assert!(!blocked.is_finished());
    t.lc.wake().await.expect("wake");
    assert_eq!(blocked.await.expect("join").expect("read"), "data");
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn stop_kills_a_launch_that_waits_on_a_silent_guest_instead_of_waiting() {
    let t = T::new();
    t.world.hang_launch.store(true, Ordering::SeqCst);
    let (lc, args) = (t.lc.clone(), t.args());
    let start = tokio::spawn(async move { lc.start(args, |_| async { Ok(()) }).await });
    let mut rx = t.lc.subscribe();
    rx.wait_for(|p| matches!(p, Phase::Booting)).await.expect("booting");
    tokio::time::timeout(Duration::from_secs(5), t.lc.stop(Gone::Stopped))
        .await
        .expect("stop waited for the launch's lock");
    assert!(t.world.killed.load(Ordering::SeqCst), "the VM process was killed");
    assert!(start.await.expect("join").is_err(), "the launch failed");
    assert!(matches!(t.lc.phase(), Phase::Gone(Gone::Stopped)), "{:?}", t.lc.phase());
}

#[tokio::test]
async fn an_uncontended_stop_does_not_kill() {
    let t = T::new();
    t.lc.start(t.args(), |_| async { Ok(()) }).await.expect("start");
    t.lc.stop(Gone::Stopped).await;
    assert!(!t.world.killed.load(Ordering::SeqCst), "stopped through its API, not killed");
    assert_eq!(t.world.stops.load(Ordering::SeqCst), 1);
}
