//! burrow's VMM: boots and runs one microVM per process on KVM.
//!
//! Layout: `x86_64/` (memory map, boot protocols, vCPU state), `devices/`
//! (one folder per device), `vcpu` (threads and their control), `bus`
//! (exit dispatch), `vmm` (building a VM and its event loop), `api` (the
//! control socket), `jail` (confinement and seccomp filters).

pub mod api;
pub mod bus;
pub mod capped;
pub mod config;
pub mod devices;
pub mod jail;
pub mod probe;
pub mod snapshot;
pub mod vcpu;
pub mod vmm;
pub mod x86_64;

pub use config::VmConfig;

/// Guest memory. Every write the VMM makes (virtio rings and buffers) is
/// marked in a page bitmap, which incremental snapshots add to KVM's dirty
/// log (that one only sees the guest's own writes).
pub type GuestMemoryMmap = vm_memory::GuestMemoryMmap<vm_memory::bitmap::AtomicBitmap>;
pub use vmm::{Vmm, VmmError};

/// Why a VM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExitReason {
    /// The guest reset the CPU through the i8042 (`reboot` with `reboot=k`).
    Reboot,
    /// The guest halted every CPU for good (`poweroff` without ACPI) or
    /// KVM reported a shutdown system event.
    Poweroff,
    /// The controller asked the VMM to stop.
    Stopped,
    /// The guest kernel panicked (and rebooted).
    Panic,
    /// A triple fault: the guest crashed hard.
    TripleFault,
    /// The VMM failed.
    Error(String),
}

impl ExitReason {
    /// A clean end: the process exits with status 0.
    pub fn success(&self) -> bool {
        matches!(self, Self::Reboot | Self::Poweroff | Self::Stopped)
    }

    pub fn as_str(&self) -> &str {
        match self {
            Self::Reboot => "reboot",
            Self::Poweroff => "poweroff",
            Self::Stopped => "stopped",
            Self::Panic => "panic",
            Self::TripleFault => "triple-fault",
            Self::Error(_) => "error",
        }
    }
}

impl std::fmt::Display for ExitReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Reboot => write!(f, "guest rebooted"),
            Self::Poweroff => write!(f, "guest powered off"),
            Self::Stopped => write!(f, "stopped by the controller"),
            Self::Panic => write!(f, "guest kernel panicked"),
            Self::TripleFault => write!(f, "guest triple-faulted (CPU shutdown)"),
            Self::Error(m) => write!(f, "VMM error: {m}"),
        }
    }
}
