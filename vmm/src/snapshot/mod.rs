//! Whole-VM snapshots: the state file format, the trait every part of the
//! VM implements to be saved and rebuilt, vCPU and VM (irqchip, PIT,
//! clock) state, and guest memory files.

pub mod format;
pub mod fuzz;
pub mod kvm_serde;
pub mod memory;
pub mod microvm;
pub mod untrusted;
#[cfg(test)]
mod fuzz_tests;
pub mod vcpu;
pub mod vm;
#[cfg(test)]
mod persist_tests;

pub use format::{read_state_file, write_state_file, write_state_to, SnapshotError, FORMAT_VERSION, MAX_STATE_LEN};

/// Save a part of the VM (a device, a vCPU, the VM itself) to a plain state
/// value, and rebuild it from one. Every device implements this, and one
/// generic test round-trips each of them.
pub trait Persist: Sized {
    /// The serializable state.
    type State: serde::Serialize + serde::de::DeserializeOwned;
    /// What rebuilding needs besides the state (guest memory, event fds, ...).
    type Context;
    /// Why rebuilding can fail (state that does not fit the context).
    type Error: std::error::Error;

    /// The part's state, taken while the VM is paused.
    fn save(&self) -> Self::State;
    /// Rebuild the part from `state`. Must reject state that is invalid
    /// for `ctx` (indexes out of range, addresses outside guest memory)
    /// rather than trust it: a snapshot file is input like any other.
    fn restore(ctx: Self::Context, state: &Self::State) -> Result<Self, Self::Error>;
}
