//! Reading, checking and rewriting the OCI runtime spec containerd writes
//! into the bundle, and sizing the VM from it.

use std::io::Read;
use std::path::Path;

use serde_json::{Map, Value};

use crate::config::Config;

/// Largest config.json accepted (bytes).
pub const MAX_SPEC_BYTES: usize = burrow_protocol::MAX_SPEC_BYTES;

/// Annotation CRI puts on every container of a pod, naming the pod's sandbox.
pub const CRI_SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The annotation CRI puts on every container: `sandbox` or `container`.
pub const CRI_CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// Per-pod overrides of the VM's size (bounded by the config).
pub const ANNOTATION_VCPUS: &str = "io.burrow.vcpus";
pub const ANNOTATION_MEMORY_MIB: &str = "io.burrow.memory_mib";
/// What containerd's CRI plugin (1.6.7 and later) writes on a pod's sandbox
/// container from the kubelet's `LinuxPodSandboxConfig.resources`: the sum
/// of the pod's containers' limits (memory in bytes, CPU as a CFS quota
/// over a period, microseconds). Kata sizes its static pod VMs from them.
pub const CRI_SANDBOX_MEMORY: &str = "io.kubernetes.cri.sandbox-memory";
pub const CRI_SANDBOX_CPU_QUOTA: &str = "io.kubernetes.cri.sandbox-cpu-quota";
pub const CRI_SANDBOX_CPU_PERIOD: &str = "io.kubernetes.cri.sandbox-cpu-period";
/// Hibernate the sandbox after this many seconds without activity (0: never).
pub const ANNOTATION_HIBERNATE_IDLE: &str = "io.burrow.hibernate_idle_secs";
/// Attach the browser image (read-only, shared) so the sandbox's agent can
/// run Chromium (`burrow browse`): `true` or `false`.
pub const ANNOTATION_BROWSER: &str = "io.burrow.browser";
/// Create the container by restoring the named checkpoint that
/// `burrow sandbox checkpoint` wrote (instead of starting the spec's process).
pub const ANNOTATION_RESTORE: &str = "io.burrow.restore";

/// The named checkpoint a container is restored from
/// ([`ANNOTATION_RESTORE`]). Not for a CRI pod's container: containerd
/// copies its pod's annotations onto it, and there the name is the pod's
/// checkpoint, which the pod's sandbox restored whole.
pub fn restore_name(spec: &Value) -> Option<&str> {
    if annotation(spec, CRI_CONTAINER_TYPE) == Some("container") {
        return None;
    }
    annotation(spec, ANNOTATION_RESTORE)
}

#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("reading {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("{path} is larger than {MAX_SPEC_BYTES} bytes")]
    TooLarge { path: String },
    #[error("{path} is not valid JSON: {err}")]
    Json {
        path: String,
        err: serde_json::Error,
    },
    #[error("malformed OCI spec: {0}")]
    Malformed(String),
}

/// Read and check `bundle/config.json`.
pub fn read_spec(bundle: &Path) -> Result<Value, SpecError> {
    let path = bundle.join("config.json");
    let p = path.display().to_string();
    let file = std::fs::File::open(&path).map_err(|err| SpecError::Read {
        path: p.clone(),
        err,
    })?;
    let mut buf = Vec::new();
    file.take(
        u64::try_from(MAX_SPEC_BYTES)
            .unwrap_or(u64::MAX)
            .saturating_add(1),
    )
    .read_to_end(&mut buf)
    .map_err(|err| SpecError::Read {
        path: p.clone(),
        err,
    })?;
    if buf.len() > MAX_SPEC_BYTES {
        return Err(SpecError::TooLarge { path: p });
    }
    let spec: Value =
        serde_json::from_slice(&buf).map_err(|err| SpecError::Json { path: p, err })?;
    validate_spec(&spec)?;
    Ok(spec)
}

/// The checks that make a spec usable: an object with a `process` whose
/// `args` is a non-empty list of strings.
pub fn validate_spec(spec: &Value) -> Result<(), SpecError> {
    let obj = spec
        .as_object()
        .ok_or_else(|| malformed("the spec is not a JSON object"))?;
    require(
        obj.get("ociVersion").is_none_or(Value::is_string),
        "ociVersion is not a string",
    )?;
    let process = obj
        .get("process")
        .ok_or_else(|| malformed("no \"process\""))?;
    validate_process(process)?;
    require(
        obj.get("annotations").is_none_or(is_string_map),
        "annotations must map strings to strings",
    )
}

/// Check an OCI `process` object.
pub fn validate_process(process: &Value) -> Result<(), SpecError> {
    let p = process
        .as_object()
        .ok_or_else(|| malformed("\"process\" is not an object"))?;
    let args = p
        .get("args")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed("process.args is missing or not a list"))?;
    require(
        !args.is_empty() && args.iter().all(Value::is_string),
        "process.args must be a non-empty list of strings",
    )?;
    require(
        p.get("env").is_none_or(is_string_list),
        "process.env must be a list of strings",
    )?;
    // As runc: a relative working directory would be resolved against
    // whatever directory the guest's agent happens to be in.
    require(
        p.get("cwd")
            .is_none_or(|c| c.as_str().is_some_and(|c| c.starts_with('/'))),
        "process.cwd must be an absolute path",
    )
}

fn malformed(msg: &str) -> SpecError {
    SpecError::Malformed(msg.into())
}

/// `Ok` if `ok`, else the spec is malformed: `msg`.
fn require(ok: bool, msg: &str) -> Result<(), SpecError> {
    if ok {
        Ok(())
    } else {
        Err(malformed(msg))
    }
}

fn is_string_map(v: &Value) -> bool {
    v.as_object()
        .is_some_and(|m| m.values().all(Value::is_string))
}

fn is_string_list(v: &Value) -> bool {
    v.as_array().is_some_and(|l| l.iter().all(Value::is_string))
}

/// An annotation of the spec.
pub fn annotation<'a>(spec: &'a Value, key: &str) -> Option<&'a str> {
    spec.get("annotations")?.get(key)?.as_str()
}

/// Whether a sandbox of `spec` gets the browser image: its annotation,
/// else the config's `browser`.
pub fn wants_browser(spec: &Value, cfg: &Config) -> bool {
    match annotation(spec, ANNOTATION_BROWSER) {
        Some(v) => v.eq_ignore_ascii_case("true") || v == "1",
        None => cfg.browser,
    }
}

/// What [`for_guest`] removed, for the log.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stripped {
    pub items: Vec<String>,
}

pub(crate) fn is_bind(m: &Map<String, Value>) -> bool {
    let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
    let bind_opt = m.get("options").and_then(Value::as_array).is_some_and(|o| {
        o.iter()
            .any(|x| matches!(x.as_str(), Some("bind" | "rbind")))
    });
    ty == "bind" || bind_opt
}

/// The spec as the guest sees it: everything that names host resources is
/// removed, because it means nothing (or something else) inside the VM:
/// hooks (host binaries), bind mounts of host paths, namespace paths (host
/// netns files), the host cgroup path, host devices, and the root path
/// (the agent mounts the rootfs it is given).
pub fn for_guest(spec: &Value) -> (Value, Stripped) {
    let mut spec = spec.clone();
    let mut stripped = Stripped::default();
    let Some(obj) = spec.as_object_mut() else {
        return (spec, stripped);
    };
    for key in ["hooks", "windows", "solaris", "vm"] {
        if obj.remove(key).is_some() {
            stripped.items.push(key.to_string());
        }
    }
    if let Some(root) = obj.get_mut("root").and_then(Value::as_object_mut) {
        if root.remove("path").is_some() {
            stripped.items.push("root.path".into());
        }
    }
    if let Some(mounts) = obj.get_mut("mounts").and_then(Value::as_array_mut) {
        mounts.retain(|m| {
            let Some(mo) = m.as_object() else {
                stripped.items.push("malformed mount".into());
                return false;
            };
            if is_bind(mo) {
                let dest = mo.get("destination").and_then(Value::as_str).unwrap_or("?");
                stripped.items.push(format!("bind mount {dest}"));
                false
            } else {
                true
            }
        });
    }
    if let Some(linux) = obj.get_mut("linux").and_then(Value::as_object_mut) {
        for key in ["cgroupsPath", "devices", "intelRdt"] {
            if linux.remove(key).is_some() {
                stripped.items.push(format!("linux.{key}"));
            }
        }
        if let Some(nss) = linux.get_mut("namespaces").and_then(Value::as_array_mut) {
            for ns in nss.iter_mut() {
                if let Some(n) = ns.as_object_mut() {
                    if n.remove("path").is_some() {
                        let ty = n.get("type").and_then(Value::as_str).unwrap_or("?");
                        stripped.items.push(format!("{ty} namespace path"));
                    }
                }
            }
        }
        if let Some(res) = linux.get_mut("resources").and_then(Value::as_object_mut) {
            if res.remove("devices").is_some() {
                stripped.items.push("linux.resources.devices".into());
            }
        }
    }
    (spec, stripped)
}

/// vCPUs and memory (MiB) of a VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VmSize {
    pub vcpus: u32,
    pub memory_mib: u64,
}

fn count_cpuset(s: &str) -> Option<u32> {
    let mut n: u32 = 0;
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim().parse::<u32>().ok()?, b.trim().parse::<u32>().ok()?),
            None => {
                let v = part.parse::<u32>().ok()?;
                (v, v)
            }
        };
        if b < a {
            return None;
        }
        n = n.checked_add(b - a + 1)?;
    }
    (n > 0).then_some(n)
}

/// vCPUs for a CFS `quota` over `period` (microseconds; a period of 0 or
/// none is CFS's default 100 ms): rounded up; none for no quota.
fn vcpus_for_quota(quota: i64, period: Option<u64>) -> Option<u32> {
    let period = period.filter(|p| *p > 0).unwrap_or(100_000);
    let q = u64::try_from(quota).ok().filter(|q| *q > 0)?;
    // More CPUs than u32 holds is "as many as allowed": the caller clamps.
    Some(u32::try_from(q.div_ceil(period)).unwrap_or(u32::MAX))
}

/// MiB of VM for a memory limit of `bytes` (none for no limit): the limit
/// rounded up, plus the guest's own `overhead_mib`.
fn memory_for_limit(bytes: i64, overhead_mib: u64) -> Option<u64> {
    let b = u64::try_from(bytes).ok().filter(|b| *b > 0)?;
    Some(b.div_ceil(1 << 20).saturating_add(overhead_mib))
}

/// An annotation read as a number (none when absent or not a number).
fn annotation_number<T: std::str::FromStr>(spec: &Value, key: &str) -> Option<T> {
    annotation(spec, key).and_then(|v| v.trim().parse::<T>().ok())
}

/// Size the VM from the spec, first found wins:
/// 1. annotations `io.burrow.vcpus` / `io.burrow.memory_mib`;
/// 2. a CRI pod's summed container limits (`io.kubernetes.cri.sandbox-*`,
///    see [`CRI_SANDBOX_MEMORY`]), so a Kubernetes pod whose containers
///    declare limits gets a VM they fit in without any burrow annotation;
/// 3. `linux.resources` (CPU quota/period rounded up, or the cpuset's size;
///    the memory limit);
/// 4. the configured defaults.
///
/// A memory limit becomes the limit plus the configured guest overhead;
/// the result is always clamped to the configured bounds.
pub fn vm_size(spec: &Value, cfg: &Config) -> VmSize {
    let res = spec.get("linux").and_then(|l| l.get("resources"));
    let cpu = res.and_then(|r| r.get("cpu"));
    let from_pod_quota = annotation_number::<i64>(spec, CRI_SANDBOX_CPU_QUOTA).and_then(|q| {
        vcpus_for_quota(q, annotation_number::<u64>(spec, CRI_SANDBOX_CPU_PERIOD))
    });
    let from_quota = cpu.and_then(|c| {
        vcpus_for_quota(
            c.get("quota")?.as_i64()?,
            c.get("period").and_then(Value::as_u64),
        )
    });
    let from_cpuset = cpu
        .and_then(|c| c.get("cpus")?.as_str())
        .and_then(count_cpuset);
    let vcpus = annotation_number::<u32>(spec, ANNOTATION_VCPUS)
        .or(from_pod_quota)
        .or(from_quota)
        .or(from_cpuset)
        .unwrap_or(cfg.vcpus.default);

    let overhead = cfg.memory_mib.overhead;
    let from_pod_memory = annotation_number::<i64>(spec, CRI_SANDBOX_MEMORY)
        .and_then(|b| memory_for_limit(b, overhead));
    let from_limit = res
        .and_then(|r| r.get("memory")?.get("limit")?.as_i64())
        .and_then(|l| memory_for_limit(l, overhead));
    let memory_mib = annotation_number::<u64>(spec, ANNOTATION_MEMORY_MIB)
        .or(from_pod_memory)
        .or(from_limit)
        .unwrap_or(cfg.memory_mib.default);

    VmSize {
        vcpus: vcpus.clamp(cfg.vcpus.min, cfg.vcpus.max.max(cfg.vcpus.min)),
        memory_mib: memory_mib.clamp(
            cfg.memory_mib.min,
            cfg.memory_mib.max.max(cfg.memory_mib.min),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg() -> Config {
        Config::default()
    }

    #[test]
    fn validates() {
        assert!(validate_spec(&json!({"process": {"args": ["sh"]}})).is_ok());
        assert!(validate_spec(&json!([])).is_err());
        assert!(validate_spec(&json!({})).is_err());
        assert!(validate_spec(&json!({"process": {"args": []}})).is_err());
        assert!(validate_spec(&json!({"process": {"args": [1]}})).is_err());
        assert!(validate_spec(&json!({"process": {"args": ["a"], "env": "x"}})).is_err());
        assert!(validate_spec(&json!({"process": {"args": ["a"], "cwd": "/w"}})).is_ok());
        for cwd in [json!("w"), json!(""), json!(1)] {
            let e = validate_spec(&json!({"process": {"args": ["a"], "cwd": cwd}}));
            assert!(
                e.is_err_and(|e| e.to_string().contains("absolute path")),
                "{cwd}"
            );
        }
        assert!(
            validate_spec(&json!({"process": {"args": ["a"]}, "annotations": {"a": 1}})).is_err()
        );
    }

    #[test]
    fn reads_and_bounds_config_json() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(matches!(read_spec(dir.path()), Err(SpecError::Read { .. })));
        std::fs::write(dir.path().join("config.json"), "{not json").expect("write");
        assert!(matches!(read_spec(dir.path()), Err(SpecError::Json { .. })));
        std::fs::write(
            dir.path().join("config.json"),
            vec![b' '; MAX_SPEC_BYTES + 1],
        )
        .expect("write");
        assert!(matches!(
            read_spec(dir.path()),
            Err(SpecError::TooLarge { .. })
        ));
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"process":{"args":["true"]}}"#,
        )
        .expect("write");
        assert!(read_spec(dir.path()).is_ok());
    }

    #[test]
    fn strips_host_only_parts() {
        let spec = json!({
            "process": {"args": ["sh"]},
            "root": {"path": "/run/containerd/x/rootfs", "readonly": false},
            "hooks": {"prestart": [{"path": "/usr/bin/nvidia"}]},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts", "options": ["rbind", "ro"]},
                {"destination": "/data", "source": "/srv", "options": ["bind"]},
            ],
            "linux": {
                "cgroupsPath": "/default/x",
                "devices": [{"path": "/dev/fuse"}],
                "namespaces": [{"type": "pid"}, {"type": "network", "path": "/var/run/netns/cni-1"}],
                "resources": {"devices": [{"allow": false, "access": "rwm"}], "memory": {"limit": 1}},
            },
        });
        let (g, s) = for_guest(&spec);
        assert!(g.get("hooks").is_none());
        assert_eq!(g["root"], json!({"readonly": false}));
        assert_eq!(g["mounts"].as_array().map(Vec::len), Some(1));
        assert!(g["linux"].get("cgroupsPath").is_none());
        assert!(g["linux"].get("devices").is_none());
        assert_eq!(g["linux"]["namespaces"][1], json!({"type": "network"}));
        assert_eq!(g["linux"]["resources"], json!({"memory": {"limit": 1}}));
        assert!(s.items.iter().any(|i| i == "bind mount /etc/hosts"));
        assert_eq!(g["process"], spec["process"]);
    }

    #[test]
    fn sizes_vm_within_bounds() {
        let c = cfg();
        let d = vm_size(&json!({"process": {"args": ["sh"]}}), &c);
        assert_eq!(
            d,
            VmSize {
                vcpus: c.vcpus.default,
                memory_mib: c.memory_mib.default
            }
        );

        let s = json!({"linux": {"resources": {"cpu": {"quota": 150000, "period": 100000}, "memory": {"limit": 512u64 << 20}}}});
        assert_eq!(
            vm_size(&s, &c),
            VmSize {
                vcpus: 2,
                memory_mib: 512 + c.memory_mib.overhead
            }
        );

        let s = json!({"linux": {"resources": {"cpu": {"cpus": "0-2,5"}}}});
        assert_eq!(vm_size(&s, &c).vcpus, 4);

        let s = json!({"linux": {"resources": {"cpu": {"quota": 1_000_000_000i64, "period": 1}, "memory": {"limit": i64::MAX}}}});
        assert_eq!(
            vm_size(&s, &c),
            VmSize {
                vcpus: c.vcpus.max,
                memory_mib: c.memory_mib.max
            }
        );

        let s = json!({"annotations": {ANNOTATION_VCPUS: "0", ANNOTATION_MEMORY_MIB: "1"}});
        assert_eq!(
            vm_size(&s, &c),
            VmSize {
                vcpus: c.vcpus.min,
                memory_mib: c.memory_mib.min
            }
        );

        let s = json!({"annotations": {ANNOTATION_VCPUS: "3"}, "linux": {"resources": {"cpu": {"quota": -1}}}});
        assert_eq!(vm_size(&s, &c).vcpus, 3);
    }

    #[test]
    fn a_cri_pod_is_sized_by_its_containers_summed_limits() {
        let c = cfg();
        let pod = |mem: &str, quota: &str, period: &str| {
            json!({"annotations": {
                CRI_SANDBOX_MEMORY: mem,
                CRI_SANDBOX_CPU_QUOTA: quota,
                CRI_SANDBOX_CPU_PERIOD: period,
                // containerd's sandbox container: CPU shares, no limit
            }, "linux": {"resources": {"cpu": {"shares": 2}}}})
        };
        // 1 GiB and 2.5 CPUs summed over the pod's containers.
        assert_eq!(
            vm_size(&pod("1073741824", "250000", "100000"), &c),
            VmSize {
                vcpus: 3,
                memory_mib: 1024 + c.memory_mib.overhead
            }
        );
        // No limits anywhere in the pod: the kubelet sends zeros.
        assert_eq!(
            vm_size(&pod("0", "0", "0"), &c),
            VmSize {
                vcpus: c.vcpus.default,
                memory_mib: c.memory_mib.default
            }
        );
        // A period of 0 is CFS's default 100 ms; garbage is no value.
        assert_eq!(vm_size(&pod("x", "150000", "0"), &c).vcpus, 2);
        assert_eq!(vm_size(&pod("-5", "-1", "y"), &c).memory_mib, c.memory_mib.default);
        // Clamped to the configured maximum, however large the sum.
        assert_eq!(
            vm_size(&pod("9223372036854775807", "9223372036854775807", "1"), &c),
            VmSize {
                vcpus: c.vcpus.max,
                memory_mib: c.memory_mib.max
            }
        );
        // burrow's own annotations still win over the kubelet's sums.
        let mut s = pod("1073741824", "400000", "100000");
        s["annotations"][ANNOTATION_MEMORY_MIB] = json!("384");
        s["annotations"][ANNOTATION_VCPUS] = json!("1");
        assert_eq!(
            vm_size(&s, &c),
            VmSize {
                vcpus: 1,
                memory_mib: 384
            }
        );
    }

    #[test]
    fn cpusets() {
        assert_eq!(count_cpuset("0"), Some(1));
        assert_eq!(count_cpuset("0-3,8"), Some(5));
        assert_eq!(count_cpuset("3-1"), None);
        assert_eq!(count_cpuset("x"), None);
        assert_eq!(count_cpuset(""), None);
    }
}
