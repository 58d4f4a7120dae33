//! `burrow-agent`'s library: everything but `main`, so that the cargo-fuzz
//! targets in `agent/fuzz` can reach the request decoding
//! ([`container::fuzz`]). The binary (`src/main.rs`) is PID 1 in every
//! guest.

pub mod browser;
pub mod container;
pub mod cpus;
pub mod error;
pub mod fs;
pub mod host_only;
pub mod init;
pub mod net;
pub mod oom;
pub mod process;
pub mod reaper;
pub mod service;
pub mod spawn;
pub mod stats;
