//! burrow's VMM: boots and runs one microVM per process on KVM.

pub mod devices;
pub mod probe;
pub mod snapshot;
pub mod x86_64;
