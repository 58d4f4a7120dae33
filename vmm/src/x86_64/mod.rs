//! x86_64 specifics: memory layout, boot protocols, vCPU setup, MP table.

pub mod boot;
pub mod cpuid;
pub mod e820;
pub mod fault;
pub mod layout;
pub mod mptable;
pub mod regs;
