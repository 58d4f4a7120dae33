//! Turning OCI objects into what to do: parsing a spec or `process` with
//! size caps, and the [`ChildPlan`] (argv, PATH search, ids, rlimits,
//! capabilities) and /proc masks that `spawn` carries out.

use std::ffi::CString;

use oci_spec::runtime::{Process as OciProcess, Spec};

use crate::error::{invalid, Result};
use crate::spawn::{CapSets, ChildPlan, Namespaces, ProcMasks};

const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
const MAX_ARGS: usize = 4096;
const MAX_ENV: usize = 4096;

/// Parse an OCI runtime spec (JSON) with a size cap.
pub fn parse_spec(json: &[u8]) -> Result<Spec> {
    let spec: Spec = parse_capped(json, "OCI spec")?;
    let process = spec
        .process()
        .as_ref()
        .ok_or_else(|| invalid("bad OCI spec: no \"process\""))?;
    check_process(process)?;
    Ok(spec)
}

/// Parse an OCI `process` object (JSON) with a size cap.
pub fn parse_process(json: &[u8]) -> Result<OciProcess> {
    let p: OciProcess = parse_capped(json, "OCI process")?;
    check_process(&p)?;
    Ok(p)
}

/// Parse `json`, the `what` of a request, refusing more than
/// [`burrow_protocol::MAX_SPEC_BYTES`] before parsing anything.
fn parse_capped<T: serde::de::DeserializeOwned>(json: &[u8], what: &str) -> Result<T> {
    if json.len() > burrow_protocol::MAX_SPEC_BYTES {
        return Err(invalid(format!(
            "{what} is {} bytes, more than the {} allowed",
            json.len(),
            burrow_protocol::MAX_SPEC_BYTES
        )));
    }
    serde_json::from_slice(json).map_err(|e| invalid(format!("bad {what}: {e}")))
}

fn check_process(p: &OciProcess) -> Result<()> {
    let args = p.args().as_deref().unwrap_or_default();
    if args.is_empty() {
        return Err(invalid("bad OCI process: \"args\" is empty"));
    }
    if args.len() > MAX_ARGS || p.env().as_ref().is_some_and(|e| e.len() > MAX_ENV) {
        return Err(invalid("bad OCI process: too many args or env entries"));
    }
    Ok(())
}

fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| invalid(format!("{what} contains a NUL byte")))
}

fn cap_number(name: &str) -> Option<u32> {
    const NAMES: [&str; 41] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ];
    let short = name.strip_prefix("CAP_").unwrap_or(name);
    NAMES
        .iter()
        .position(|n| *n == short)
        .and_then(|i| u32::try_from(i).ok())
}

fn cap_mask(set: &Option<oci_spec::runtime::Capabilities>) -> u64 {
    let mut mask = 0u64;
    for cap in set.iter().flatten() {
        let name = serde_json::to_value(cap)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        match cap_number(&name) {
            Some(n) => mask |= 1u64 << n,
            None => tracing::warn!("ignoring unknown capability {name}"),
        }
    }
    mask
}

fn rlimit_resource(name: &str) -> Option<i32> {
    let r = match name {
        "RLIMIT_CPU" => libc::RLIMIT_CPU,
        "RLIMIT_FSIZE" => libc::RLIMIT_FSIZE,
        "RLIMIT_DATA" => libc::RLIMIT_DATA,
        "RLIMIT_STACK" => libc::RLIMIT_STACK,
        "RLIMIT_CORE" => libc::RLIMIT_CORE,
        "RLIMIT_RSS" => libc::RLIMIT_RSS,
        "RLIMIT_NPROC" => libc::RLIMIT_NPROC,
        "RLIMIT_NOFILE" => libc::RLIMIT_NOFILE,
        "RLIMIT_MEMLOCK" => libc::RLIMIT_MEMLOCK,
        "RLIMIT_AS" => libc::RLIMIT_AS,
        "RLIMIT_LOCKS" => libc::RLIMIT_LOCKS,
        "RLIMIT_SIGPENDING" => libc::RLIMIT_SIGPENDING,
        "RLIMIT_MSGQUEUE" => libc::RLIMIT_MSGQUEUE,
        "RLIMIT_NICE" => libc::RLIMIT_NICE,
        "RLIMIT_RTPRIO" => libc::RLIMIT_RTPRIO,
        "RLIMIT_RTTIME" => libc::RLIMIT_RTTIME,
        _ => return None,
    };
    i32::try_from(r).ok()
}

fn last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(40)
}

/// Turn an OCI process into a plan for `spawn`.
pub fn plan(p: &OciProcess, namespaces: Namespaces) -> Result<ChildPlan> {
    let args = p.args().as_deref().unwrap_or_default();
    let argv = args
        .iter()
        .map(|a| cstring("an argument", a))
        .collect::<Result<Vec<_>>>()?;
    let env_list = p.env().as_deref().unwrap_or_default();
    let env = env_list
        .iter()
        .map(|e| cstring("an environment variable", e))
        .collect::<Result<Vec<_>>>()?;
    let path_var = env_list
        .iter()
        .rev()
        .find_map(|e| e.strip_prefix("PATH="))
        .unwrap_or(DEFAULT_PATH);
    let argv0 = args.first().map(String::as_str).unwrap_or_default();
    let exec_paths = if argv0.contains('/') {
        vec![cstring("the command", argv0)?]
    } else {
        path_var
            .split(':')
            .map(|dir| {
                let dir = if dir.is_empty() { "." } else { dir };
                cstring("PATH", &format!("{dir}/{argv0}"))
            })
            .collect::<Result<Vec<_>>>()?
    };
    let cwd = p.cwd().to_string_lossy();
    let cwd = cstring("cwd", if cwd.is_empty() { "/" } else { &cwd })?;
    let user = p.user();
    let mut rlimits = Vec::new();
    for rl in p.rlimits().iter().flatten() {
        let name = rl.typ().to_string();
        let name = if name.starts_with("RLIMIT_") {
            name
        } else {
            serde_json::to_value(rl.typ())
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default()
        };
        let res =
            rlimit_resource(&name).ok_or_else(|| invalid(format!("unknown rlimit {name}")))?;
        rlimits.push((res, rl.soft(), rl.hard()));
    }
    let caps = p.capabilities().as_ref().map(|c| CapSets {
        bounding: cap_mask(c.bounding()),
        effective: cap_mask(c.effective()),
        permitted: cap_mask(c.permitted()),
        inheritable: cap_mask(c.inheritable()),
        ambient: cap_mask(c.ambient()),
    });
    Ok(ChildPlan {
        argv,
        env,
        exec_paths,
        cwd,
        uid: user.uid(),
        gid: user.gid(),
        groups: user.additional_gids().clone().unwrap_or_default(),
        umask: user.umask(),
        namespaces,
        rlimits,
        no_new_privileges: p.no_new_privileges().unwrap_or(false),
        caps,
        last_cap: last_cap(),
        terminal: p.terminal().unwrap_or(false),
        pass_fds: Vec::new(),
        seccomp: Default::default(),
        cgroup_procs: None,
        oom_score_adj: cstring(
            "oomScoreAdj",
            &p.oom_score_adj()
                .unwrap_or(0)
                .clamp(-1000, 1000)
                .to_string(),
        )?,
    })
}

/// With a PID namespace in the spec (one to create, or the pod's to join):
/// the /proc masks its init re-applies after mounting that namespace's
/// /proc.
pub fn pid_namespace(spec: &Spec) -> Result<Option<ProcMasks>> {
    let Some(linux) = spec.linux() else {
        return Ok(None);
    };
    let wants = linux
        .namespaces()
        .iter()
        .flatten()
        .any(|ns| ns.typ() == oci_spec::runtime::LinuxNamespaceType::Pid);
    if !wants {
        return Ok(None);
    }
    let under_proc = |paths: &Option<Vec<String>>| {
        paths
            .iter()
            .flatten()
            .filter(|p| p.starts_with("/proc/"))
            .map(|p| cstring("a masked path", p))
            .collect::<Result<Vec<_>>>()
    };
    Ok(Some(ProcMasks {
        masked: under_proc(linux.masked_paths())?,
        readonly: under_proc(linux.readonly_paths())?,
    }))
}
