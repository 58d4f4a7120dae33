//! vCPU threads: the KVM_RUN loop, port/MMIO dispatch, and the control
//! protocol the VMM thread uses to pause, stop or inspect them.
//!
//! A vCPU blocked in KVM_RUN (a halted guest CPU with the in-kernel LAPIC
//! never returns to userspace) is interrupted with a real-time signal whose
//! handler does nothing: KVM_RUN returns EINTR and the thread checks its
//! requests. Kicks are repeated until acknowledged, which closes the race of
//! a signal landing just before KVM_RUN.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_MP_STATE_HALTED, KVM_MP_STATE_INIT_RECEIVED, KVM_MP_STATE_UNINITIALIZED};
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

/// What a vCPU looked like when polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuProbe {
    /// Halted with interrupts disabled: stopped for good (Linux's halt path).
    pub halted_for_good: bool,
    /// Never started (an AP the guest did not bring up).
    pub not_started: bool,
    /// Where it was (for the record when the VM is judged powered off).
    pub rip: u64,
}

struct CtlState {
    want: Want,
    parked: usize,
    exited: usize,
    poll_seq: u64,
    polls: Vec<(u64, CpuProbe)>,
    save_seq: u64,
    saves: Vec<(u64, Option<Result<VcpuState, String>>)>,
}

/// Shared between the VMM thread and every vCPU thread.
pub struct VcpuControl {
    /// MSRs each vCPU saves in a snapshot.
    msr_list: Vec<u32>,
    attention: AtomicBool,
    state: Mutex<CtlState>,
    cv: Condvar,
}

fn lock(m: &Mutex<CtlState>) -> MutexGuard<'_, CtlState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const RFLAGS_IF: u64 = 1 << 9;

fn probe(vcpu: &VcpuFd) -> CpuProbe {
    let mp = vcpu.get_mp_state().map(|s| s.mp_state).unwrap_or(u32::MAX);
    let regs = vcpu.get_regs().ok();
    let iflag = regs.is_none_or(|r| r.rflags & RFLAGS_IF != 0);
    CpuProbe {
        rip: regs.map_or(0, |r| r.rip),
        halted_for_good: mp == KVM_MP_STATE_HALTED && !iflag,
        not_started: mp == KVM_MP_STATE_UNINITIALIZED || mp == KVM_MP_STATE_INIT_RECEIVED,
    }
}

impl VcpuControl {
    pub fn new(count: usize, msr_list: Vec<u32>) -> Arc<Self> {
        Arc::new(Self {
            msr_list,
            attention: AtomicBool::new(false),
            state: Mutex::new(CtlState {
                want: Want::Run,
                parked: 0,
                exited: 0,
                poll_seq: 0,
                polls: vec![(0, CpuProbe::default()); count],
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

    /// Called by vCPU `id` before each KVM_RUN and after EINTR. Returns
    /// false if the thread must stop.
    fn checkpoint(&self, id: usize, vcpu: &mut VcpuFd) -> bool {
        if !self.attention.load(Ordering::Acquire) {
            return true;
        }
        let mut st = lock(&self.state);
        let mut parked = false;
        loop {
            let seq = st.poll_seq;
            if let Some(slot) = st.polls.get_mut(id) {
                if slot.0 != seq {
                    *slot = (seq, probe(vcpu));
                    self.cv.notify_all();
                }
            }
            match st.want {
                Want::Run => {
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
                Want::Pause => {
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

    /// Kick until `done` holds or `timeout` passes.
    fn kick_until(
        &self,
        threads: &[JoinHandle<()>],
        timeout: Duration,
        done: impl Fn(&CtlState) -> bool,
    ) -> bool {
        let start = Instant::now();
        loop {
            Self::kick(threads);
            let st = lock(&self.state);
            if done(&st) {
                return true;
            }
            let (st, _) = self
                .cv
                .wait_timeout(st, Duration::from_millis(5))
                .unwrap_or_else(|p| p.into_inner());
            if done(&st) {
                return true;
            }
            if start.elapsed() > timeout {
                return false;
            }
        }
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

    /// Probe every vCPU (each answers from its own thread).
    pub fn poll(&self, threads: &[JoinHandle<()>]) -> Option<Vec<CpuProbe>> {
        let seq = {
            let mut st = lock(&self.state);
            st.poll_seq += 1;
            st.poll_seq
        };
        self.attention.store(true, Ordering::Release);
        let ok = self.kick_until(threads, Duration::from_millis(500), |s| {
            s.exited > 0 || s.polls.iter().all(|p| p.0 == seq)
        });
        let st = lock(&self.state);
        if st.want == Want::Run {
            self.attention.store(false, Ordering::Release);
        }
        if !ok || st.exited > 0 {
            return None;
        }
        Some(st.polls.iter().map(|p| p.1).collect())
    }
}

extern "C" fn noop_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// The signal used to kick vCPUs out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

/// Install the no-op kick handler (once per process).
pub fn install_kick_handler() -> std::io::Result<()> {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = vmm_sys_util::signal::register_signal_handler(kick_signal(), noop_handler)
            .map_err(|e| std::io::Error::from_raw_os_error(e.errno()));
    });
    result
}

/// Decide whether the guest has halted for good: every CPU is halted with
/// interrupts off or was never started, and the boot CPU is halted.
///
/// This is how `poweroff` ends a guest without ACPI: with no power-off
/// driver, Linux turns `reboot(POWER_OFF)` into a halt — it stops the other
/// CPUs and parks each one in `hlt` with interrupts disabled. Nothing but
/// an NMI/INIT can wake such a CPU, so the VM is finished. (An idle CPU
/// halts with interrupts enabled, so it is never mistaken for this.)
pub fn guest_halted(probes: &[CpuProbe]) -> bool {
    let Some(bsp) = probes.first() else {
        return false;
    };
    bsp.halted_for_good && probes.iter().all(|p| p.halted_for_good || p.not_started)
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
            Err(e) => return Some(ExitReason::Error(format!("vcpu{id}: KVM_RUN failed: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn halt_detection() {
        let halted = CpuProbe { halted_for_good: true, not_started: false, rip: 0 };
        let idle = CpuProbe::default();
        let off = CpuProbe { halted_for_good: false, not_started: true, rip: 0 };
        assert!(guest_halted(&[halted]));
        assert!(guest_halted(&[halted, off, halted]));
        assert!(!guest_halted(&[halted, idle]));
        assert!(!guest_halted(&[off, halted]));
        assert!(!guest_halted(&[]));
    }
}
