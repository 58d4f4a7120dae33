//! What happens when the VMM itself touches an unplugged block. Device
//! emulation reads and writes wherever the guest's descriptors and rings
//! point, and vm-memory sees the whole region (plugged blocks must be
//! reachable: the guest puts virtqueues and buffers there once it uses
//! them). A hostile guest can point them at a block it unplugged, which
//! is `PROT_NONE`: the VMM thread then takes SIGSEGV. Rather than die of
//! the signal with nothing said, the VMM ends the VM the way a guest
//! touching unplugged memory from a vCPU does (KVM_RUN's EFAULT): exit
//! status 1 with a line on stderr naming the cause. A fault anywhere else
//! goes to the handler that was there before (Rust's stack-overflow
//! report, or the default action).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Host addresses of the region: [START, END).
static START: AtomicUsize = AtomicUsize::new(0);
static END: AtomicUsize = AtomicUsize::new(0);
/// The SIGSEGV action before ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

const MESSAGE: &[u8] = b"burrow-vmm: the guest pointed device I/O at virtio-mem memory it has not plugged; ending the VM\n";

extern "C" fn on_segv(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    if (START.load(Ordering::Relaxed)..END.load(Ordering::Relaxed)).contains(&addr) {
        // SAFETY: write(2) and _exit(2) are async-signal-safe.
        unsafe {
            libc::write(libc::STDERR_FILENO, MESSAGE.as_ptr().cast(), MESSAGE.len());
            libc::_exit(1);
        }
    }
    // Not ours: put the previous action back; returning re-runs the
    // faulting access, which then reaches it.
    match PREVIOUS.get() {
        // SAFETY: restoring an action sigaction(2) gave us.
        Some(prev) => unsafe {
            libc::sigaction(libc::SIGSEGV, prev, std::ptr::null_mut());
        },
        // SAFETY: the default action (terminate) for SIGSEGV.
        None => unsafe {
            libc::signal(libc::SIGSEGV, libc::SIG_DFL);
        },
    }
}

/// Watch the host mapping `[start, start + len)` of the hotplug region
/// (one per process: one VM per VMM).
pub fn install(start: *const u8, len: usize) -> std::io::Result<()> {
    START.store(start as usize, Ordering::Relaxed);
    END.store((start as usize).saturating_add(len), Ordering::Relaxed);
    // SAFETY: a zeroed sigaction is a valid starting point; the handler
    // only uses async-signal-safe calls and atomics.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_segv as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut sa.sa_mask);
        let mut prev: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGSEGV, &sa, &mut prev) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let _ = PREVIOUS.set(prev);
    }
    Ok(())
}
