//! How `burrow-vmm` confines itself once its VM is built (issue 15): the
//! `--jail*` flags of [`crate::VmmArgs`]. The VMM opens everything it needs
//! first (`/dev/kvm`, kernel, disks, snapshot files, its sockets and logs),
//! then enters the jail: its own mount (a read-only tmpfs root holding only
//! the directories of its sockets and serial log), network, IPC and UTS
//! namespaces, an unprivileged uid/gid without capabilities, rlimits, the
//! sandbox's cgroup and OOM score. Seccomp filters (one per kind of thread)
//! apply whether or not it is jailed, unless `--no-seccomp`.

use std::ffi::OsString;
use std::path::PathBuf;

/// The uid and gid a jailed VMM runs as when none is given: a fixed id
/// with no account and no files of its own on the host.
pub const DEFAULT_JAIL_ID: u32 = 64_100;

/// `burrow-vmm run`'s confinement flags.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct JailArgs {
    /// Enter the jail (namespaces, unprivileged ids, rlimits) after the VM
    /// is built. Needs root.
    #[arg(long)]
    pub jail: bool,
    /// The uid the jailed VMM runs as.
    #[arg(long, default_value_t = DEFAULT_JAIL_ID, requires = "jail")]
    pub jail_uid: u32,
    /// Its gid (its only group).
    #[arg(long, default_value_t = DEFAULT_JAIL_ID, requires = "jail")]
    pub jail_gid: u32,
    /// A cgroup (v2) directory to move into before dropping privileges.
    #[arg(long)]
    pub cgroup: Option<PathBuf>,
    /// The OOM score adjustment (-1000..=1000), set before dropping
    /// privileges.
    #[arg(long, allow_hyphen_values = true, value_parser = clap::value_parser!(i32).range(-1000..=1000))]
    pub oom_score_adj: Option<i32>,
    /// Debugging only (the shim never passes it): no seccomp filters.
    #[arg(long)]
    pub no_seccomp: bool,
    /// Tests only: make one syscall no filter allows, right after the
    /// filters are installed (the VMM must die of SIGSYS).
    #[arg(long, hide = true)]
    pub test_forbidden_syscall: bool,
}

impl Default for JailArgs {
    fn default() -> Self {
        Self {
            jail: false,
            jail_uid: DEFAULT_JAIL_ID,
            jail_gid: DEFAULT_JAIL_ID,
            cgroup: None,
            oom_score_adj: None,
            no_seccomp: false,
            test_forbidden_syscall: false,
        }
    }
}

impl JailArgs {
    /// Append these flags to an argv (defaults left out).
    pub fn push_argv(&self, a: &mut Vec<OsString>) {
        if self.jail {
            a.push("--jail".into());
            a.extend(["--jail-uid".into(), self.jail_uid.to_string().into()]);
            a.extend(["--jail-gid".into(), self.jail_gid.to_string().into()]);
        }
        if let Some(c) = &self.cgroup {
            a.extend(["--cgroup".into(), c.into()]);
        }
        if let Some(o) = self.oom_score_adj {
            a.extend(["--oom-score-adj".into(), o.to_string().into()]);
        }
        if self.no_seccomp {
            a.push("--no-seccomp".into());
        }
        if self.test_forbidden_syscall {
            a.push("--test-forbidden-syscall".into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{VmmArgs, VmmCommand};

    #[test]
    fn jail_flags_round_trip() {
        let mut a = VmmArgs::boot("/k".into());
        a.jail = JailArgs {
            jail: true,
            jail_uid: 1234,
            jail_gid: 4321,
            cgroup: Some("/sys/fs/cgroup/pod".into()),
            oom_score_adj: Some(-998),
            no_seccomp: true,
            test_forbidden_syscall: true,
        };
        let argv = a.to_argv();
        let parsed = VmmArgs::parse_argv(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        assert_eq!(parsed, VmmCommand::Run(Box::new(a)));
    }

    #[test]
    fn jail_flags_are_checked() {
        assert!(
            VmmArgs::parse_argv(["run", "--kernel", "/k", "--jail-uid", "5"]).is_err(),
            "uid without --jail"
        );
        assert!(
            VmmArgs::parse_argv(["run", "--kernel", "/k", "--oom-score-adj", "-1001"]).is_err()
        );
        let VmmCommand::Run(a) = VmmArgs::parse_argv(["run", "--kernel", "/k", "--jail"]).unwrap()
        else {
            panic!("not run")
        };
        assert_eq!(
            (a.jail.jail_uid, a.jail.jail_gid),
            (DEFAULT_JAIL_ID, DEFAULT_JAIL_ID)
        );
        assert!(!a.jail.no_seccomp);
    }
}
