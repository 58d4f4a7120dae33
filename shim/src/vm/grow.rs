//! A pod's VM grows its vCPUs as containers arrive.
//!
//! A CRI pod's VM boots with `vcpus.max` vCPUs of which only the pod's
//! size run ([`crate::spec::vm_size`]): the rest are present to the guest
//! but offline (`maxcpus=`) and the VMM does not run them (`--max-vcpus`).
//! When the kubelet passed the pod's summed limits
//! (`io.kubernetes.cri.sandbox-cpu-*`) or `io.burrow.vcpus` sized the VM,
//! it grows only if its members' limits outgrow that size; when the VM
//! has the configured default instead, each member's CPU limit is added
//! to it, as Kata does. UpdateContainerResources counts too. It never
//! shrinks (a guest CPU is not taken away), and stops at `vcpus.max`: a
//! container asking for more still runs, within its own cgroup quota.
//!
//! Growing is: the VMM lets the new vCPUs run (`set_vcpus`), then the
//! agent brings them online. Memory does not grow yet (no hotplug device).

use std::collections::BTreeMap;
use std::sync::Mutex;

use burrow_vmm_api::Command;
use serde_json::Value;

use super::{vmm, VmSandbox};
use crate::config::Config;
use crate::sandbox::{Result, SandboxError};
use crate::spec;

/// A pod VM's vCPUs: what it booted with and may grow to, and what its
/// members ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodCpus {
    /// vCPUs it booted with running.
    pub base: u32,
    /// vCPUs it has (`--max-vcpus`).
    pub max: u32,
    /// The pod's own size (kubelet sums or `io.burrow.vcpus`) set `base`:
    /// members' limits are inside it, not added to it.
    pub pod_sized: bool,
    /// vCPUs running now.
    pub running: u32,
    /// Each member's CPU limit in thousandths of a CPU.
    pub members: BTreeMap<String, u64>,
}

impl PodCpus {
    /// vCPUs the pod needs now (at most `max`).
    pub fn needed(&self) -> u32 {
        let millis: u64 = self.members.values().sum();
        let cpus = u32::try_from(millis.div_ceil(1000)).unwrap_or(u32::MAX);
        let want = if self.pod_sized {
            self.base.max(cpus)
        } else {
            self.base.saturating_add(cpus)
        };
        want.clamp(self.running.max(1), self.max.max(self.running).max(1))
    }
}

/// The vCPUs a pod sandbox of `spec` boots with room for: the config's
/// maximum (never less than its size).
pub fn max_vcpus(cfg: &Config, running: u32) -> u32 {
    cfg.vcpus.max.min(u32::from(u8::MAX)).max(running)
}

/// The vCPUs a VM for a container of `spec` has room for: a pod
/// sandbox's grows, any other VM keeps its `running`.
pub fn max_vcpus_for(cfg: &Config, spec: &Value, running: u32) -> u32 {
    if super::pod::role(spec) == super::pod::Role::Sandbox {
        max_vcpus(cfg, running)
    } else {
        running
    }
}

/// `--max-vcpus` for a VM of `running` of `max` vCPUs (none when equal).
pub fn vmm_max(running: u32, max: u32) -> Option<u8> {
    (max > running).then(|| u8::try_from(max).unwrap_or(u8::MAX))
}

/// The growth record of a VM just started for a container of `spec`
/// with `running` of `max` vCPUs: a pod sandbox's, none for the rest.
pub fn record_for(spec: &Value, running: u32, max: u32) -> Option<PodCpus> {
    (super::pod::role(spec) == super::pod::Role::Sandbox).then(|| PodCpus {
        base: running,
        max,
        pod_sized: pod_sized(spec),
        running,
        members: BTreeMap::new(),
    })
}

/// Whether the pod's own annotations (not the config's default) sized it.
pub fn pod_sized(spec: &Value) -> bool {
    [spec::ANNOTATION_VCPUS, spec::CRI_SANDBOX_CPU_QUOTA]
        .iter()
        .any(|k| spec::annotation(spec, k).is_some())
}

/// A CPU limit in thousandths of a CPU from OCI `LinuxResources`' `cpu`
/// (`quota`/`period`); none without a quota.
pub fn cpu_millis(cpu: Option<&Value>) -> Option<u64> {
    let cpu = cpu?;
    let quota = u64::try_from(cpu.get("quota")?.as_i64()?).ok().filter(|q| *q > 0)?;
    let period = cpu
        .get("period")
        .and_then(Value::as_u64)
        .filter(|p| *p > 0)
        .unwrap_or(100_000);
    Some(quota.saturating_mul(1000).div_ceil(period))
}

/// The record of one sandbox (none for a VM that is not a pod's, or one
/// restored from a checkpoint: those do not grow).
#[derive(Debug, Default)]
pub struct Growth(Mutex<Option<PodCpus>>);

impl Growth {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<PodCpus>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set(&self, cpus: Option<PodCpus>) {
        *self.lock() = cpus;
    }

    pub fn get(&self) -> Option<PodCpus> {
        self.lock().clone()
    }

    /// Record member `id`'s limit (none: it has none); the vCPUs the pod
    /// needs now if that is more than run.
    fn record(&self, id: &str, millis: Option<u64>) -> Option<u32> {
        let mut g = self.lock();
        let p = g.as_mut()?;
        match millis {
            Some(m) => p.members.insert(id.to_string(), m),
            None => p.members.remove(id),
        };
        let need = p.needed();
        (need > p.running).then_some(need)
    }

    fn ran(&self, count: u32) {
        if let Some(p) = self.lock().as_mut() {
            p.running = p.running.max(count);
        }
    }

    /// Forget member `id` (the VM keeps its vCPUs).
    pub fn forget(&self, id: &str) {
        if let Some(p) = self.lock().as_mut() {
            p.members.remove(id);
        }
    }
}

impl VmSandbox {
    /// Count member `id`'s CPU limit (`cpu` of its `LinuxResources`) and
    /// grow the VM if the pod now needs more vCPUs than run.
    pub(super) async fn grow_for(&self, id: &str, cpu: Option<&Value>) -> Result<()> {
        let Some(count) = self.growth.record(id, cpu_millis(cpu)) else {
            return Ok(());
        };
        let handle = self.vm.awake().await?;
        let n = u8::try_from(count)
            .map_err(|_| SandboxError::InvalidArgument(format!("{count} vCPUs")))?;
        vmm::command_at_with(&self.path("api.sock"), Command::SetVcpus { count: n }, &[])
            .await
            .map_err(|e| SandboxError::Internal(format!("letting {count} vCPUs run: {e}")))?;
        let online = handle.agent.online_cpus(count).await?;
        self.growth.ran(online);
        tracing::info!("{id}: the pod's VM has {online} vCPUs online (asked for {count})");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(base: u32, max: u32, pod_sized: bool) -> PodCpus {
        PodCpus {
            base,
            max,
            pod_sized,
            running: base,
            members: BTreeMap::new(),
        }
    }

    #[test]
    fn a_default_sized_pod_adds_each_members_limit() {
        let g = Growth::default();
        g.set(Some(pod(1, 4, false)));
        assert_eq!(g.record("a", None), None, "no limit, no growth");
        assert_eq!(g.record("b", Some(500)), Some(2));
        g.ran(2);
        assert_eq!(g.record("c", Some(500)), None, "1.0 CPU in all: still 2");
        assert_eq!(g.record("d", Some(2500)), Some(4), "clamped to the maximum");
        g.ran(4);
        g.forget("d");
        assert_eq!(g.record("e", Some(100)), None, "never shrinks, never asks again");
        assert_eq!(g.get().unwrap().running, 4);
    }

    #[test]
    fn a_pod_sized_by_its_sums_grows_only_past_them() {
        let g = Growth::default();
        g.set(Some(pod(2, 8, true)));
        assert_eq!(g.record("a", Some(1000)), None);
        assert_eq!(g.record("b", Some(1000)), None);
        assert_eq!(g.record("b", Some(2000)), Some(3), "an update outgrows the sums");
    }

    #[test]
    fn a_vm_without_a_record_never_grows() {
        let g = Growth::default();
        assert_eq!(g.record("a", Some(8000)), None);
    }

    #[test]
    fn cpu_limits_in_millis() {
        assert_eq!(cpu_millis(Some(&json!({"quota": 50000, "period": 100000}))), Some(500));
        assert_eq!(cpu_millis(Some(&json!({"quota": 150000}))), Some(1500));
        assert_eq!(cpu_millis(Some(&json!({"quota": 1, "period": 3}))), Some(334));
        assert_eq!(cpu_millis(Some(&json!({"quota": -1}))), None);
        assert_eq!(cpu_millis(Some(&json!({"shares": 2}))), None);
        assert_eq!(cpu_millis(None), None);
        assert_eq!(cpu_millis(Some(&json!({"quota": i64::MAX, "period": 1}))), Some(u64::MAX));
    }

    #[test]
    fn sized_by_the_pod_or_the_default() {
        assert!(pod_sized(&json!({"annotations": {spec::CRI_SANDBOX_CPU_QUOTA: "200000"}})));
        assert!(pod_sized(&json!({"annotations": {spec::ANNOTATION_VCPUS: "2"}})));
        assert!(!pod_sized(&json!({"annotations": {spec::CRI_SANDBOX_MEMORY: "1"}})));
        assert!(!pod_sized(&json!({})));
    }
}
