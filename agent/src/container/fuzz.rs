//! The agent's request decoding as a fuzz harness (issue 15): what
//! CreateContainer and Exec carry (an OCI spec, a process) through
//! parsing, the child plan, the PID-namespace choice and the seccomp
//! compiler. No input may panic the agent, its guest's PID 1. Shared by
//! the randomized test (`fuzz_tests`) and the cargo-fuzz target in
//! `agent/fuzz`.

use super::plan::{parse_process, parse_spec, pid_namespace, plan};
use super::seccomp::compile;
use crate::spawn::Namespaces;

/// How far one input got.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reached {
    /// It parsed as a spec whose process has a plan.
    pub planned: bool,
    /// Its `linux.seccomp` compiled.
    pub compiled: bool,
}

/// Decode `bytes` as a container spec, and `process` (if any) as an exec's
/// process, as the agent's service would.
pub fn decode(bytes: &[u8], process: Option<&[u8]>) -> Reached {
    let mut reached = Reached::default();
    if let Ok(spec) = parse_spec(bytes) {
        if let Some(p) = spec.process() {
            reached.planned = plan(p, Namespaces::Guest).is_ok();
        }
        let _ = pid_namespace(&spec);
        reached.compiled =
            compile(spec.linux().as_ref().and_then(|l| l.seccomp().as_ref())).is_ok();
    }
    if let Some(p) = process {
        let _ = parse_process(p);
    }
    reached
}
