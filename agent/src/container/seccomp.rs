//! A container's `linux.seccomp` profile, compiled to BPF the way runc
//! applies it (containerd's default profile included), with seccompiler.
//!
//! A profile has one default action and rules with their own actions; a
//! seccompiler filter has one action on a match and one otherwise. So a
//! profile becomes a stack of filters, which the kernel runs together and
//! of whose answers it takes the most restrictive (for equal actions, the
//! filter installed last):
//!
//! - the allow-list: the rules whose action is `SCMP_ACT_ALLOW` match to
//!   allow, everything else gets the default action;
//! - for every other action: its rules match to that action, everything
//!   else is allowed (so only the allow-list decides there).
//!
//! Rules that repeat the default action add nothing and are left out, as
//! runc does. Syscall names this architecture does not have are skipped
//! (runc skips those libseccomp does not know). `SCMP_ACT_NOTIFY` and the
//! listener are not supported: such a profile is refused, never skipped.

use std::collections::BTreeMap;
use std::str::FromStr;

use oci_spec::runtime::{
    LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArg, LinuxSeccompFilterFlag, LinuxSeccompOperator,
};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use crate::error::{invalid, Result};

/// The BPF programs to install, in order, and the flags for each.
#[derive(Debug, Clone, Default)]
pub struct Seccomp {
    pub filters: Vec<BpfProgram>,
    pub flags: libc::c_ulong,
}

/// Longest program the kernel takes (BPF_MAXINSNS).
const MAX_INSNS: usize = 4096;

const EPERM: u32 = libc::EPERM as u32;

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

/// Compile `profile` (the spec's `linux.seccomp`; none: no filter).
pub fn compile(profile: Option<&LinuxSeccomp>) -> Result<Seccomp> {
    let Some(profile) = profile else {
        return Ok(Seccomp::default());
    };
    if profile.listener_path().is_some() {
        return Err(invalid(
            "linux.seccomp: a seccomp notify listener (listenerPath) is not supported by burrow",
        ));
    }
    let default = action(profile.default_action(), profile.default_errno_ret())?;
    // Rules grouped by action, each group syscall number -> its rules
    // (None: it matches whatever its arguments).
    let mut groups: Vec<(SeccompAction, Rules)> = Vec::new();
    for (i, sc) in profile.syscalls().iter().flatten().enumerate() {
        let act = action(sc.action(), sc.errno_ret())?;
        if act == default {
            continue;
        }
        let rules = rules(sc.args().as_deref().unwrap_or_default())
            .map_err(|e| invalid(format!("linux.seccomp.syscalls[{i}]: {e}")))?;
        let group = match groups.iter_mut().position(|(a, _)| *a == act) {
            Some(g) => &mut groups[g].1,
            None => {
                groups.push((act, BTreeMap::new()));
                &mut groups.last_mut().expect("just pushed").1
            }
        };
        for name in sc.names() {
            let Ok(nr) = syscalls::Sysno::from_str(name) else {
                tracing::debug!(syscall = %name, "linux.seccomp: no such syscall here; skipped");
                continue;
            };
            let entry = group
                .entry(i64::from(nr.id()))
                .or_insert_with(|| Some(Vec::new()));
            match (entry.as_mut(), &rules) {
                // Unconditional wins over any conditions.
                (_, None) => *entry = None,
                (Some(have), Some(more)) => have.extend(more.iter().cloned()),
                (None, Some(_)) => {}
            }
        }
    }
    let mut filters = Vec::new();
    let allow = groups
        .iter()
        .position(|(a, _)| *a == SeccompAction::Allow)
        .map(|g| groups.remove(g).1)
        .unwrap_or_default();
    if default != SeccompAction::Allow {
        filters.push(build(allow, default.clone(), SeccompAction::Allow)?);
    }
    for (act, rules) in groups {
        filters.push(build(rules, SeccompAction::Allow, act)?);
    }
    Ok(Seccomp {
        filters,
        flags: flags(profile.flags().as_deref().unwrap_or_default())?,
    })
}

/// Syscall number -> its rules, None matching whatever the arguments.
type Rules = BTreeMap<i64, Option<Vec<SeccompRule>>>;

fn build(rules: Rules, mismatch: SeccompAction, on_match: SeccompAction) -> Result<BpfProgram> {
    // seccompiler reads an empty rule list as "match unconditionally".
    let rules = rules
        .into_iter()
        .map(|(nr, r)| (nr, r.unwrap_or_default()))
        .collect();
    let filter = SeccompFilter::new(rules, mismatch, on_match, ARCH)
        .map_err(|e| invalid(format!("linux.seccomp: {e}")))?;
    let prog: BpfProgram = filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| invalid(format!("linux.seccomp: {e}")))?;
    if prog.len() > MAX_INSNS {
        return Err(invalid(format!(
            "linux.seccomp: the profile compiles to {} BPF instructions, more than the kernel's {MAX_INSNS}",
            prog.len()
        )));
    }
    Ok(prog)
}

fn action(a: LinuxSeccompAction, errno: Option<u32>) -> Result<SeccompAction> {
    Ok(match a {
        LinuxSeccompAction::ScmpActAllow => SeccompAction::Allow,
        LinuxSeccompAction::ScmpActErrno => SeccompAction::Errno(errno.unwrap_or(EPERM)),
        LinuxSeccompAction::ScmpActKill | LinuxSeccompAction::ScmpActKillThread => {
            SeccompAction::KillThread
        }
        LinuxSeccompAction::ScmpActKillProcess => SeccompAction::KillProcess,
        LinuxSeccompAction::ScmpActTrap => SeccompAction::Trap,
        LinuxSeccompAction::ScmpActTrace => SeccompAction::Trace(errno.unwrap_or(EPERM)),
        LinuxSeccompAction::ScmpActLog => SeccompAction::Log,
        LinuxSeccompAction::ScmpActNotify => {
            return Err(invalid(
                "linux.seccomp: SCMP_ACT_NOTIFY (a user-space seccomp agent) is not supported by burrow",
            ))
        }
    })
}

/// The rules of one syscall entry: None when it has no conditions. Its
/// conditions must all hold, except that several on the same argument are
/// alternatives (runc's reading, which containerd's profile relies on).
fn rules(args: &[LinuxSeccompArg]) -> std::result::Result<Option<Vec<SeccompRule>>, String> {
    if args.is_empty() {
        return Ok(None);
    }
    let conds = args
        .iter()
        .map(condition)
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let same_arg = args.len() > 1 && args.iter().all(|a| a.index() == args[0].index());
    let rules = if same_arg {
        conds
            .into_iter()
            .map(|c| SeccompRule::new(vec![c]))
            .collect::<std::result::Result<Vec<_>, _>>()
    } else {
        SeccompRule::new(conds).map(|r| vec![r])
    };
    rules.map(Some).map_err(|e| e.to_string())
}

fn condition(a: &LinuxSeccompArg) -> std::result::Result<SeccompCondition, String> {
    let index = u8::try_from(a.index())
        .ok()
        .filter(|i| *i < 6)
        .ok_or_else(|| format!("argument index {} is not 0 to 5", a.index()))?;
    let (op, value) = match a.op() {
        LinuxSeccompOperator::ScmpCmpNe => (SeccompCmpOp::Ne, a.value()),
        LinuxSeccompOperator::ScmpCmpLt => (SeccompCmpOp::Lt, a.value()),
        LinuxSeccompOperator::ScmpCmpLe => (SeccompCmpOp::Le, a.value()),
        LinuxSeccompOperator::ScmpCmpEq => (SeccompCmpOp::Eq, a.value()),
        LinuxSeccompOperator::ScmpCmpGe => (SeccompCmpOp::Ge, a.value()),
        LinuxSeccompOperator::ScmpCmpGt => (SeccompCmpOp::Gt, a.value()),
        // libseccomp: (arg & value) == valueTwo.
        LinuxSeccompOperator::ScmpCmpMaskedEq => (
            SeccompCmpOp::MaskedEq(a.value()),
            a.value_two().unwrap_or(0),
        ),
    };
    // libseccomp compares all 64 bits on a 64-bit architecture.
    SeccompCondition::new(index, SeccompCmpArgLen::Qword, op, value).map_err(|e| e.to_string())
}

fn flags(flags: &[LinuxSeccompFilterFlag]) -> Result<libc::c_ulong> {
    let mut bits = 0;
    for f in flags {
        bits |= match f {
            LinuxSeccompFilterFlag::SeccompFilterFlagLog => libc::SECCOMP_FILTER_FLAG_LOG,
            LinuxSeccompFilterFlag::SeccompFilterFlagSpecAllow => {
                libc::SECCOMP_FILTER_FLAG_SPEC_ALLOW
            }
            // One thread installs it before exec: nothing to synchronize.
            LinuxSeccompFilterFlag::SeccompFilterFlagTsync => 0,
            other => {
                return Err(invalid(format!(
                    "linux.seccomp: flag {other} is not supported by burrow"
                )))
            }
        };
    }
    Ok(bits)
}
