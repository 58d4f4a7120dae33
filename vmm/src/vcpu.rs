//! vCPU threads: the KVM_RUN loop, port/MMIO dispatch, and the control
//! protocol the VMM thread uses to pause, stop or inspect them.
//!
//! A vCPU blocked in KVM_RUN (a halted guest CPU with the in-kernel LAPIC
//! never returns to userspace) is interrupted with a real-time signal:
//! KVM_RUN returns EINTR and the thread checks its requests. The handler
//! sets the thread's `kvm_run.immediate_exit`, so a signal that lands just
//! before KVM_RUN (after the thread last looked at its requests) still makes
//! it return at once: one kick is enough, and nothing is re-sent on a timer.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_ioctls::{VcpuExit, VcpuFd};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::Bus;
use crate::snapshot;
use crate::snapshot::vcpu::VcpuState;
use crate::ExitReason;

/// Events vCPU threads send to the VMM thread.
#[derive(Debug)]
pub enum VcpuEvent {
    Exit(ExitReason),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Want {
    Run,
    Pause,
    Stop,
}

struct CtlState {
    want: Want,
    /// vCPUs `0..running` may run; the others stay parked until granted.
    running: usize,
    parked: usize,
    exited: usize,
    save_seq: u64,
    saves: Vec<(u64, Option<Result<VcpuState, String>>)>,
}

/// Shared between the VMM thread and every vCPU thread.
pub struct VcpuControl {
    /// MSRs each vCPU saves in a snapshot.
    msr_list: Vec<u32>,
    attention: AtomicBool,
    /// Copy of `CtlState::running` for the lock-free check before KVM_RUN.
    running: AtomicUsize,
    state: Mutex<CtlState>,
    cv: Condvar,
}

fn lock(m: &Mutex<CtlState>) -> MutexGuard<'_, CtlState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl VcpuControl {
    /// Control of `count` vCPUs of which the first `running` may run.
    pub fn new(count: usize, running: usize, msr_list: Vec<u32>) -> Arc<Self> {
        let running = running.min(count);
        Arc::new(Self {
            msr_list,
            attention: AtomicBool::new(false),
            running: AtomicUsize::new(running),
            state: Mutex::new(CtlState {
                want: Want::Run,
                running,
                parked: 0,
                exited: 0,
                save_seq: 0,
                saves: (0..count).map(|_| (0, None)).collect(),
            }),
            cv: Condvar::new(),
        })
    }

    /// The MSRs a snapshot saves.
    pub fn msr_list(&self) -> &[u32] {
        &self.msr_list
    }

    /// How many vCPUs may run.
    pub fn running(&self) -> u8 {
        u8::try_from(self.running.load(Ordering::Acquire)).unwrap_or(u8::MAX)
    }

    /// Let exactly the first `count` vCPUs run (at least one): more are let
    /// go at once; those past `count` are kicked out of KVM_RUN and park
    /// until granted again. The guest must have taken them offline first,
    /// or it waits on CPUs that no longer run.
    pub fn set_running(&self, count: u8, threads: &[JoinHandle<()>]) {
        let mut st = lock(&self.state);
        let count = usize::from(count).clamp(1, st.saves.len().max(1));
        let fewer = count < st.running;
        st.running = count;
        self.running.store(count, Ordering::Release);
        self.cv.notify_all();
        drop(st);
        if fewer {
            Self::kick(threads.get(count..).unwrap_or_default());
        }
    }

    /// Called by vCPU `id` before each KVM_RUN and after EINTR. Returns
    /// false if the thread must stop. A vCPU not yet granted stays here,
    /// parked (it answers saves like a paused one), until it is.
    fn checkpoint(&self, id: usize, vcpu: &mut VcpuFd) -> bool {
        if !self.attention.load(Ordering::Acquire) && id < self.running.load(Ordering::Acquire) {
            return true;
        }
        let mut st = lock(&self.state);
        let mut parked = false;
        loop {
            let held = st.want == Want::Pause || id >= st.running;
            match st.want {
                Want::Run if !held => {
                    if parked {
                        st.parked -= 1;
                    }
                    return true;
                }
                Want::Stop => {
                    if parked {
                        st.parked -= 1;
                    }
                    return false;
                }
                Want::Run | Want::Pause => {
                    if !parked {
                        parked = true;
                        st.parked += 1;
                        self.cv.notify_all();
                    }
                    let save_seq = st.save_seq;
                    if let Some(slot) = st.saves.get_mut(id) {
                        if slot.0 != save_seq {
                            *slot = (save_seq, Some(save_state(id, vcpu, &self.msr_list)));
                            self.cv.notify_all();
                        }
                    }
                    st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
                }
            }
        }
    }

    fn thread_exited(&self) {
        let mut st = lock(&self.state);
        st.exited += 1;
        self.cv.notify_all();
    }

    fn kick(threads: &[JoinHandle<()>]) {
        for t in threads {
            if !t.is_finished() {
                use std::os::unix::thread::JoinHandleExt;
                // SAFETY: the thread is alive (checked above; a race only
                // means signalling a thread that is exiting, which its
                // handle still keeps valid until joined).
                unsafe { libc::pthread_kill(t.as_pthread_t(), kick_signal()) };
            }
        }
    }

    /// Kick once, then wait until `done` holds or `timeout` passes.
    fn kick_until(
        &self,
        threads: &[JoinHandle<()>],
        timeout: Duration,
        done: impl Fn(&CtlState) -> bool,
    ) -> bool {
        Self::kick(threads);
        let st = lock(&self.state);
        let (st, _) = self
            .cv
            .wait_timeout_while(st, timeout, |s| !done(s))
            .unwrap_or_else(|p| p.into_inner());
        done(&st)
    }

    /// Kick every vCPU out of KVM_RUN once; each re-enters at once (see
    /// `--vcpu-kick-ms`).
    pub fn nudge(&self, threads: &[JoinHandle<()>]) {
        Self::kick(threads);
    }

    /// Park every vCPU. Returns false if they did not all park in time.
    pub fn pause(&self, threads: &[JoinHandle<()>]) -> bool {
        lock(&self.state).want = Want::Pause;
        self.attention.store(true, Ordering::Release);
        let n = threads.len();
        self.kick_until(threads, Duration::from_secs(2), |s| s.parked + s.exited >= n)
    }

    pub fn resume(&self) {
        let mut st = lock(&self.state);
        st.want = Want::Run;
        self.attention.store(false, Ordering::Release);
        self.cv.notify_all();
    }

    /// Stop every vCPU thread.
    pub fn stop(&self, threads: &[JoinHandle<()>]) -> bool {
        lock(&self.state).want = Want::Stop;
        self.attention.store(true, Ordering::Release);
        self.cv.notify_all();
        let n = threads.len();
        self.kick_until(threads, Duration::from_secs(2), |s| s.exited >= n)
    }

    /// Save every vCPU's state, each from its own thread. The vCPUs must
    /// be paused ([`Self::pause`] returned true). None if a vCPU thread has
    /// exited or did not answer in time.
    pub fn save_all(&self, threads: &[JoinHandle<()>]) -> Option<Vec<Result<VcpuState, String>>> {
        let mut st = lock(&self.state);
        if st.want != Want::Pause || st.exited > 0 {
            return None;
        }
        st.save_seq += 1;
        let seq = st.save_seq;
        self.cv.notify_all();
        let start = Instant::now();
        let n = threads.len();
        while !(st.exited > 0 || st.saves.iter().take(n).all(|s| s.0 == seq)) {
            if start.elapsed() > Duration::from_secs(10) {
                return None;
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if st.exited > 0 {
            return None;
        }
        Some(st.saves.iter_mut().take(n).map(|s| s.1.take().unwrap_or_else(|| Err("no state".into()))).collect())
    }

}

thread_local! {
    /// This thread's `kvm_run` (null on threads that run no vCPU).
    static KVM_RUN: std::cell::Cell<*mut kvm_bindings::kvm_run> =
        const { std::cell::Cell::new(std::ptr::null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.with(std::cell::Cell::get);
    if !run.is_null() {
        // SAFETY: set by this thread's run loop to its vCPU's kvm_run
        // mapping, which outlives the loop; a volatile byte store is
        // async-signal-safe.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
        std::sync::atomic::fence(Ordering::Release);
    }
}

/// The signal used to kick vCPUs out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Install the kick handler (once per process).
pub fn install_kick_handler() -> std::io::Result<()> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()));
    });
    result
}

/// Save a vCPU that is out of KVM_RUN. First a KVM_RUN with immediate_exit
/// set lets KVM finish an instruction the vCPU exited for (an I/O read whose
/// data userspace supplied): otherwise the saved registers would describe a
/// half-done instruction.
pub fn save_state(id: usize, vcpu: &mut VcpuFd, msr_list: &[u32]) -> Result<VcpuState, String> {
    vcpu.set_kvm_immediate_exit(1);
    let r = vcpu.run().map(|exit| format!("{exit:?}"));
    vcpu.set_kvm_immediate_exit(0);
    match r {
        Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
        Err(e) => return Err(format!("vcpu{id}: completing pending I/O: {e}")),
        Ok(exit) => return Err(format!("vcpu{id}: unexpected exit completing pending I/O: {exit:?}")),
    }
    snapshot::vcpu::save(id, vcpu, msr_list).map_err(|e| format!("vcpu{id}: {e}"))
}

/// Spawn the thread for one vCPU.
pub fn spawn(
    id: usize,
    mut vcpu: VcpuFd,
    bus: Arc<Bus>,
    ctl: Arc<VcpuControl>,
    events: Sender<VcpuEvent>,
    wake: Arc<EventFd>,
) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("vcpu{id}"))
        .spawn(move || {
            // Before the guest runs a single instruction on this vCPU.
            let reason = match crate::jail::seccomp::apply(crate::jail::seccomp::Thread::Vcpu) {
                Ok(()) => run_loop(id, &mut vcpu, &bus, &ctl),
                Err(e) => Some(ExitReason::Error(e.to_string())),
            };
            if let Some(r) = reason {
                let _ = events.send(VcpuEvent::Exit(r));
                let _ = wake.write(1);
            }
            ctl.thread_exited();
        })
}

/// Run until the guest exits (Some) or the VMM stops us (None).
fn run_loop(id: usize, vcpu: &mut VcpuFd, bus: &Bus, ctl: &VcpuControl) -> Option<ExitReason> {
    KVM_RUN.with(|r| r.set(vcpu.get_kvm_run()));
    let reason = run_until_exit(id, vcpu, bus, ctl);
    KVM_RUN.with(|r| r.set(std::ptr::null_mut()));
    reason
}

fn run_until_exit(id: usize, vcpu: &mut VcpuFd, bus: &Bus, ctl: &VcpuControl) -> Option<ExitReason> {
    loop {
        if !ctl.checkpoint(id, vcpu) {
            return None;
        }
        match vcpu.run() {
            Ok(VcpuExit::IoIn(port, data)) => bus.pio_read(port, data),
            Ok(VcpuExit::IoOut(port, data)) => bus.pio_write(port, data),
            Ok(VcpuExit::MmioRead(addr, data)) => bus.mmio_read(addr, data),
            Ok(VcpuExit::MmioWrite(addr, data)) => bus.mmio_write(addr, data),
            Ok(VcpuExit::Hlt) => {
                // The in-kernel LAPIC handles HLT itself; KVM reports it
                // only when the vCPU can never wake. Say where it stopped.
                tracing::warn!(
                    "vcpu{id}: halted with no way to wake (KVM_EXIT_HLT): {}",
                    crate::x86_64::fault::describe(vcpu)
                );
                return Some(ExitReason::Poweroff);
            }
            Ok(VcpuExit::Shutdown) => {
                tracing::error!(
                    "vcpu{id}: guest triple fault: {}",
                    crate::x86_64::fault::describe(vcpu)
                );
                return Some(ExitReason::TripleFault);
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                return Some(match kind {
                    kvm_bindings::KVM_SYSTEM_EVENT_SHUTDOWN => ExitReason::Poweroff,
                    kvm_bindings::KVM_SYSTEM_EVENT_RESET => ExitReason::Reboot,
                    other => ExitReason::Error(format!("vcpu{id}: system event {other}")),
                })
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                return Some(ExitReason::Error(format!(
                    "vcpu{id}: KVM entry failed (hardware reason {reason:#x}, cpu {cpu})"
                )))
            }
            Ok(VcpuExit::InternalError) => {
                return Some(ExitReason::Error(format!("vcpu{id}: KVM internal error")))
            }
            Ok(other) => {
                return Some(ExitReason::Error(format!("vcpu{id}: unexpected exit {other:?}")))
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                vcpu.set_kvm_immediate_exit(0);
            }
            Err(e) if e.errno() == libc::EFAULT => {
                return Some(ExitReason::Error(format!(
                    "vcpu{id}: KVM_RUN failed with EFAULT: the guest touched memory it has not plugged \
                     (virtio-mem) or that the host cannot back: {e}"
                )))
            }
            Err(e) => return Some(ExitReason::Error(format!("vcpu{id}: KVM_RUN failed: {e}"))),
        }
    }
}
