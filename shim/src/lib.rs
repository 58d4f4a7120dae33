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
pub mod tools;
pub mod vm;

/// Whether `name` is safe as one path component: 1..=`max` bytes of
/// `[A-Za-z0-9_.-]`, not `.` or `..` (container and exec ids, checkpoint
/// and snapshot directory names).
pub fn is_plain_name(name: &str, max: usize) -> bool {
    !name.is_empty()
        && name.len() <= max
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

#[cfg(test)]
mod fake;
