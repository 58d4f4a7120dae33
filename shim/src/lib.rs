//! burrow's containerd shim, `containerd-shim-burrow-v2`.
//!
//! - [`task`]: containerd's task API v2 (the state machine containerd sees)
//! - [`sandbox`]: the backend contract; [`vm`] implements it with a
//!   burrow-vmm microVM and the burrow-agent inside
//! - [`shim`]: the `start` / `delete` / serve protocol of containerd shims
//! - [`stdio`], [`spec`], [`config`], [`events`]: the pieces between

pub mod config;
pub mod events;
pub mod sandbox;
pub mod shim;
pub mod spec;
pub mod stdio;
pub mod task;
pub mod vm;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod task_tests;
