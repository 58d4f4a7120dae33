//! A pod's VM grows its vCPUs and memory as containers arrive, and gives
//! them back as containers leave.
//!
//! A CRI pod's VM boots with `vcpus.max` vCPUs of which only the pod's
//! size run ([`crate::spec::vm_size`]): the rest are present to the guest
//! but offline (`maxcpus=`) and the VMM does not run them (`--max-vcpus`).
//! Its memory is the pod's size plus a virtio-mem region up to
//! `memory_mib.max` (`--mem-max`), which costs nothing until the guest
//! plugs it. When the kubelet passed the pod's summed limits
//! (`io.kubernetes.cri.sandbox-*`) or `io.burrow.vcpus` /
//! `io.burrow.memory_mib` sized the VM, it grows only if its members'
//! limits outgrow that size; when the VM has the configured default
//! instead, each member's limit is added to it, as Kata does.
//! UpdateContainerResources counts too. When a member is removed (or an
//! update lowers its limits) the VM shrinks back to what the rest need,
//! never below what it booted with.
//!
//! vCPUs stop at `vcpus.max`: a container asking for more still runs,
//! within its own cgroup quota. Memory past `memory_mib.max` is refused
//! (RESOURCE_EXHAUSTED): a limit the VM cannot honour would only surprise
//! later as an OOM.
//!
//! Growing is: the VMM lets the new vCPUs run (`set_vcpus`), then the
//! agent brings them online; the VMM asks the guest to plug memory
//! (`resize_memory`) and the shim waits until it has. Shrinking is the
//! other way round: the agent takes the vCPUs offline, then the VMM holds
//! their threads (a vCPU held while the guest still had it online would
//! stall the guest); the VMM asks the guest to unplug memory, which it
//! does as far as it can free it, in its own time (the shim does not
//! wait). One resize runs at a time, each to what the record says then.
//!
//! A pod's named checkpoint carries its record ([`PodGrowth`], members by
//! CRI name), so a pod restored from it grows on from where it was: its
//! restored members count until they are taken over, then under their new
//! container ids.

use std::collections::BTreeMap;
use std::sync::Mutex;

use burrow_vmm_api::Command;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{vmm, VmSandbox};
use crate::config::Config;
use crate::sandbox::{Result, SandboxError};
use crate::spec;

/// A pod VM's vCPUs: what it booted with and may grow to, and what its
/// members ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
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
    /// vCPUs the pod needs now (at least `base`, at most `max`).
    pub fn needed(&self) -> u32 {
        let millis: u64 = self.members.values().sum();
        let cpus = u32::try_from(millis.div_ceil(1000)).unwrap_or(u32::MAX);
        let want = if self.pod_sized {
            self.base.max(cpus)
        } else {
            self.base.saturating_add(cpus)
        };
        let least = self.base.max(1);
        want.clamp(least, self.max.max(least))
    }
}

/// A pod VM's memory: what it booted with and may grow to, and what its
/// members' limits ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodMemory {
    /// MiB it booted with (`--mem`).
    pub base: u64,
    /// MiB it may grow to (`--mem-max`).
    pub max: u64,
    /// The pod's own size set `base` (members' limits are inside it).
    pub pod_sized: bool,
    /// The guest's share of `base` (`memory_mib.overhead`).
    pub overhead: u64,
    /// MiB asked of the VMM so far (`base` before any).
    pub target: u64,
    /// Each member's memory limit, MiB.
    pub members: BTreeMap<String, u64>,
}

impl PodMemory {
    /// MiB the pod needs with `members` (past `max`: `Err` of it).
    fn needed(&self, members: &BTreeMap<String, u64>) -> std::result::Result<u64, u64> {
        let sum: u64 = members.values().fold(0, |a, b| a.saturating_add(*b));
        let want = if self.pod_sized {
            self.base.max(sum.saturating_add(self.overhead))
        } else {
            self.base.saturating_add(sum)
        };
        // virtio-mem grows in 2 MiB blocks above `base`.
        let want = self.base + (want.saturating_sub(self.base)).div_ceil(2) * 2;
        if want > self.max {
            Err(want)
        } else {
            Ok(want)
        }
    }
}

/// A memory limit in MiB from OCI `LinuxResources`' `memory`; none
/// without one.
pub fn memory_mib(memory: Option<&Value>) -> Option<u64> {
    let limit = memory?.get("limit")?.as_i64().filter(|l| *l > 0)?;
    u64::try_from(limit).ok().map(|l| l.div_ceil(1 << 20))
}

/// `--mem-max` for a VM of `base` MiB that may grow to `max` (none when
/// it cannot grow).
pub fn vmm_mem_max(base: u64, max: Option<u64>) -> Option<u64> {
    max.filter(|m| *m > base)
}

/// The memory a VM for a container of `spec` may grow to: a pod
/// sandbox's up to `memory_mib.max`, any other VM none.
pub fn memory_max_for(cfg: &Config, spec: &Value, base: u64) -> Option<u64> {
    (super::pod::role(spec) == super::pod::Role::Sandbox && cfg.memory_mib.max > base)
        .then_some(cfg.memory_mib.max)
}

/// The memory growth record of a VM just started for a container of
/// `spec` with `base` MiB that may grow to `max`.
pub fn memory_record_for(cfg: &Config, spec: &Value, base: u64, max: Option<u64>) -> Option<PodMemory> {
    let max = max?;
    (super::pod::role(spec) == super::pod::Role::Sandbox).then(|| PodMemory {
        base,
        max,
        pod_sized: [spec::ANNOTATION_MEMORY_MIB, spec::CRI_SANDBOX_MEMORY]
            .iter()
            .any(|k| spec::annotation(spec, k).is_some()),
        overhead: cfg.memory_mib.overhead,
        target: base,
        members: BTreeMap::new(),
    })
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

/// A pod's growth record as its checkpoint carries it: its members by CRI
/// name (container ids are not kept across a restore).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodGrowth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<PodCpus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<PodMemory>,
}

impl PodGrowth {
    /// Check a record against the VM it is restored with (`vcpus` it has,
    /// `memory_mib` it booted with, `memory_max_mib` it may grow to) and
    /// the pod's members (`members`, at most): the record is signed with
    /// the checkpoint, but only ever believed within the VM's own size.
    pub fn check(
        &self,
        vcpus: u32,
        (memory_mib, memory_max_mib): (u64, Option<u64>),
        members: usize,
    ) -> std::result::Result<(), String> {
        if let Some(c) = &self.cpus {
            if c.max != vcpus || c.base == 0 || c.base > c.running || c.running > c.max {
                return Err(format!(
                    "vCPUs {} running of {} (booted with {}) in a VM of {vcpus}",
                    c.running, c.max, c.base
                ));
            }
            if c.members.len() > members {
                return Err(format!("{} members' CPU limits (at most {members})", c.members.len()));
            }
        }
        if let Some(m) = &self.memory {
            if m.base != memory_mib || Some(m.max) != memory_max_mib || m.target < m.base || m.target > m.max {
                return Err(format!(
                    "memory {} MiB asked of {} (booted with {}) in a VM of {memory_mib} MiB that grows to {memory_max_mib:?}",
                    m.target, m.max, m.base
                ));
            }
            if m.members.len() > members {
                return Err(format!("{} members' memory limits (at most {members})", m.members.len()));
            }
        }
        Ok(())
    }
}

/// `members` with each key `key` gives a new one for (those it gives none
/// for dropped).
fn rekeyed(members: &BTreeMap<String, u64>, key: impl Fn(&str) -> Option<String>) -> BTreeMap<String, u64> {
    members.iter().filter_map(|(k, v)| Some((key(k)?, *v))).collect()
}

/// The record of one sandbox (none for a VM that is not a pod's, or one
/// restored from a checkpoint that carried none: those do not grow), and
/// the lock one resize of its VM holds.
#[derive(Debug, Default)]
pub struct Growth(
    Mutex<Option<PodCpus>>,
    Mutex<Option<PodMemory>>,
    tokio::sync::Mutex<()>,
);

impl Growth {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<PodCpus>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_memory(&self) -> std::sync::MutexGuard<'_, Option<PodMemory>> {
        self.1.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_memory(&self, memory: Option<PodMemory>) {
        *self.lock_memory() = memory;
    }

    /// Whether the VM's memory can grow (a pod VM this shim started).
    pub fn memory_grows(&self) -> bool {
        self.lock_memory().is_some()
    }

    /// Record member `id`'s memory limit (none: it has none): `Ok` of the
    /// MiB the VM must have if not what was asked so far; `Err` of what
    /// the pod would need when that is past the maximum (nothing is
    /// recorded then).
    fn record_memory(&self, id: &str, mib: Option<u64>) -> std::result::Result<Option<u64>, (u64, u64)> {
        let mut g = self.lock_memory();
        let Some(p) = g.as_mut() else {
            return Ok(None);
        };
        let mut members = p.members.clone();
        match mib {
            Some(m) => members.insert(id.to_string(), m),
            None => members.remove(id),
        };
        let need = p.needed(&members).map_err(|n| (n, p.max))?;
        p.members = members;
        Ok((need != p.target).then_some(need))
    }

    /// MiB the pod needs now and MiB asked so far (none: it does not grow).
    fn memory_wanted(&self) -> Option<(u64, u64)> {
        let g = self.lock_memory();
        let p = g.as_ref()?;
        Some((p.needed(&p.members).unwrap_or(p.max), p.target))
    }

    fn asked_memory(&self, mib: u64) {
        if let Some(p) = self.lock_memory().as_mut() {
            p.target = mib;
        }
    }

    pub fn set(&self, cpus: Option<PodCpus>) {
        *self.lock() = cpus;
    }

    pub fn get(&self) -> Option<PodCpus> {
        self.lock().clone()
    }

    /// Record member `id`'s limit (none: it has none); the vCPUs the pod
    /// needs now if that is not what runs.
    fn record(&self, id: &str, millis: Option<u64>) -> Option<u32> {
        let mut g = self.lock();
        let p = g.as_mut()?;
        match millis {
            Some(m) => p.members.insert(id.to_string(), m),
            None => p.members.remove(id),
        };
        let need = p.needed();
        (need != p.running).then_some(need)
    }

    /// The guest says `count` vCPUs are online (its word: bounded by the
    /// VM's own).
    fn ran(&self, count: u32) {
        if let Some(p) = self.lock().as_mut() {
            p.running = count.clamp(1, p.max.max(1));
        }
    }

    /// The record for a checkpoint, each member under the name `name`
    /// gives its key (none: not carried); none when the VM does not grow.
    pub fn carried(&self, name: impl Fn(&str) -> Option<String>) -> Option<PodGrowth> {
        let cpus = self.get().map(|mut c| {
            c.members = rekeyed(&c.members, &name);
            c
        });
        let memory = self.lock_memory().clone().map(|mut m| {
            m.members = rekeyed(&m.members, &name);
            m
        });
        (cpus.is_some() || memory.is_some()).then_some(PodGrowth { cpus, memory })
    }

    /// Take up a checkpoint's record (checked with [`PodGrowth::check`]),
    /// each member under the key `key` gives its name, the guest's share of
    /// the memory as this host's config says (`overhead`).
    pub fn restore(&self, g: PodGrowth, overhead: u64, key: impl Fn(&str) -> String) {
        let some = |n: &str| Some(key(n));
        self.set(g.cpus.map(|mut c| {
            c.members = rekeyed(&c.members, some);
            c
        }));
        self.set_memory(g.memory.map(|mut m| {
            m.members = rekeyed(&m.members, some);
            m.overhead = overhead;
            m
        }));
    }

    /// Apply `f` to the members' CPU limits and to their memory limits.
    fn each_members(&self, f: impl Fn(&mut BTreeMap<String, u64>)) {
        if let Some(p) = self.lock().as_mut() {
            f(&mut p.members);
        }
        if let Some(p) = self.lock_memory().as_mut() {
            f(&mut p.members);
        }
    }

    /// Count member `from`'s limits as `to`'s (a restored member taken
    /// over by a new container).
    pub fn rename(&self, from: &str, to: &str) {
        self.each_members(|m| {
            if let Some(v) = m.remove(from) {
                m.insert(to.to_string(), v);
            }
        });
    }

    /// Forget member `id` ([`VmSandbox::fit_to_members`] then gives back
    /// what it alone needed).
    pub fn forget(&self, id: &str) {
        self.each_members(|m| {
            m.remove(id);
        });
    }
}

/// How long the guest may take to plug the memory asked of it.
const PLUG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

impl VmSandbox {
    /// Count member `id`'s memory limit (`memory` of its
    /// `LinuxResources`) and resize the VM's memory to what the pod needs,
    /// waiting until the guest has plugged it when it grows. A limit the
    /// VM cannot reach even at its maximum is refused.
    pub(super) async fn grow_memory_for(&self, id: &str, memory: Option<&Value>) -> Result<()> {
        match self.growth.record_memory(id, memory_mib(memory)) {
            Ok(Some(_)) => self.fit_memory(id).await,
            Ok(None) => Ok(()),
            Err((need, max)) => Err(SandboxError::ResourceExhausted(format!(
                "container {id}: its memory limit makes its pod need {need} MiB, past the {max} MiB a VM may have here (memory_mib.max in the burrow config)"
            ))),
        }
    }

    /// Count member `id`'s CPU limit (`cpu` of its `LinuxResources`) and
    /// resize the VM if the pod now needs another number of vCPUs.
    pub(super) async fn grow_for(&self, id: &str, cpu: Option<&Value>) -> Result<()> {
        match self.growth.record(id, cpu_millis(cpu)) {
            Some(_) => self.fit_vcpus(id).await,
            None => Ok(()),
        }
    }

    /// Member `id` has left: give back the vCPUs and memory it alone
    /// needed, if the VM runs (a sleeping or stopped one keeps its size).
    pub(super) async fn fit_to_members(&self, id: &str) {
        self.growth.forget(id);
        if self.vm.phase().handle().is_none() {
            return;
        }
        if let Err(e) = self.fit_vcpus(id).await {
            tracing::warn!("{id}: the pod's VM kept its vCPUs: {e}");
        }
        if let Err(e) = self.fit_memory(id).await {
            tracing::warn!("{id}: the pod's VM kept its memory: {e}");
        }
    }

    /// Resize the VM's memory to what its record says the pod needs now
    /// (one resize at a time; `id` names the member it is for in logs).
    async fn fit_memory(&self, id: &str) -> Result<()> {
        let _one = self.growth.2.lock().await;
        let Some((need, asked)) = self.growth.memory_wanted() else {
            return Ok(());
        };
        if need == asked {
            return Ok(());
        }
        self.vm.awake().await?;
        let api = self.path("api.sock");
        vmm::command_at_with(&api, Command::ResizeMemory { mib: need }, &[])
            .await
            .map_err(|e| SandboxError::Internal(format!("resizing the VM's memory to {need} MiB: {e}")))?;
        self.growth.asked_memory(need);
        if need < asked {
            tracing::info!("{id}: the pod's VM gives back memory: {asked} -> {need} MiB asked");
            return Ok(());
        }
        let started = std::time::Instant::now();
        loop {
            let answer = vmm::command_at_with(&api, Command::Status, &[])
                .await
                .map_err(|e| SandboxError::Internal(format!("asking burrow-vmm for its memory: {e}")))?;
            let plugged = answer.memory.map_or(0, |m| m.plugged_mib);
            if plugged >= need {
                tracing::info!(
                    "{id}: the pod's VM has {plugged} MiB (plugged in {} ms)",
                    started.elapsed().as_millis()
                );
                return Ok(());
            }
            if started.elapsed() > PLUG_TIMEOUT {
                return Err(SandboxError::Timeout(format!(
                    "the guest plugged {plugged} of {need} MiB in {} s",
                    PLUG_TIMEOUT.as_secs()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }

    /// Run as many vCPUs as the record says the pod needs now: more are
    /// let run by the VMM, then brought online by the agent; fewer are
    /// taken offline by the agent, then held by the VMM.
    async fn fit_vcpus(&self, id: &str) -> Result<()> {
        let _one = self.growth.2.lock().await;
        let Some(p) = self.growth.get() else {
            return Ok(());
        };
        let (count, running) = (p.needed(), p.running);
        if count == running {
            return Ok(());
        }
        let handle = self.vm.awake().await?;
        let n = u8::try_from(count)
            .map_err(|_| SandboxError::InvalidArgument(format!("{count} vCPUs")))?;
        let set_vcpus = || async {
            vmm::command_at_with(&self.path("api.sock"), Command::SetVcpus { count: n }, &[])
                .await
                .map_err(|e| SandboxError::Internal(format!("letting {count} vCPUs run: {e}")))
        };
        if count > running {
            set_vcpus().await?;
            let online = handle.agent.online_cpus(count).await?;
            self.growth.ran(online);
            tracing::info!("{id}: the pod's VM has {online} vCPUs online (asked for {count})");
            return Ok(());
        }
        let online = handle.agent.online_cpus(count).await?;
        self.growth.ran(online);
        if online != count {
            // The VMM goes on running every vCPU the guest has online.
            return Err(SandboxError::FailedPrecondition(format!(
                "the guest has {online} vCPUs online, asked for {count}"
            )));
        }
        set_vcpus().await?;
        tracing::info!("{id}: the pod's VM gives back vCPUs: {running} -> {count}");
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
        assert_eq!(g.get().unwrap().needed(), 2, "d gone: 1 + 1.0 CPU");
        assert_eq!(g.record("e", Some(100)), Some(3), "1 + 1.1 CPUs: 3, fewer than run");
        g.ran(3);
        g.forget("b");
        g.forget("c");
        g.forget("e");
        assert_eq!(g.get().unwrap().needed(), 1, "never below what it booted with");
    }

    #[test]
    fn a_pod_sized_by_its_sums_grows_only_past_them() {
        let g = Growth::default();
        g.set(Some(pod(2, 8, true)));
        assert_eq!(g.record("a", Some(1000)), None);
        assert_eq!(g.record("b", Some(1000)), None);
        assert_eq!(g.record("b", Some(2000)), Some(3), "an update outgrows the sums");
    }

    fn memory(base: u64, max: u64, pod_sized: bool) -> PodMemory {
        PodMemory {
            base,
            max,
            pod_sized,
            overhead: 64,
            target: base,
            members: BTreeMap::new(),
        }
    }

    #[test]
    fn memory_grows_by_members_limits_in_2_mib_steps_and_stops_at_the_max() {
        let g = Growth::default();
        assert!(!g.memory_grows());
        assert_eq!(g.record_memory("a", Some(1 << 30)), Ok(None), "no record, no growth");
        g.set_memory(Some(memory(256, 1024, false)));
        assert!(g.memory_grows());
        assert_eq!(g.record_memory("a", None), Ok(None));
        assert_eq!(g.record_memory("b", Some(127)), Ok(Some(384)), "256 + 127, rounded up to 2 MiB");
        g.asked_memory(384);
        assert_eq!(g.record_memory("c", Some(1)), Ok(None), "128 MiB in all: still 384");
        assert_eq!(g.record_memory("c", Some(2)), Ok(Some(386)));
        g.asked_memory(386);
        assert_eq!(g.record_memory("d", Some(800)), Err((1186, 1024)), "past the max: refused");
        assert_eq!(g.record_memory("e", Some(3)), Ok(Some(388)), "d was not recorded");
        g.asked_memory(388);
        g.forget("b");
        assert_eq!(g.memory_wanted(), Some((262, 388)), "b gone: 256 + 5, rounded up");
        assert_eq!(g.record_memory("f", Some(2)), Ok(Some(264)), "256 + 7, rounded up");
        g.asked_memory(264);
        for m in ["c", "e", "f"] {
            g.forget(m);
        }
        assert_eq!(g.memory_wanted(), Some((256, 264)), "never below what it booted with");
    }

    #[test]
    fn a_pod_sized_memory_grows_only_past_its_sums() {
        let g = Growth::default();
        g.set_memory(Some(memory(384, 16384, true)));
        assert_eq!(g.record_memory("tight", Some(256)), Ok(None), "256 + 64 fits 384");
        assert_eq!(g.record_memory("big", Some(512)), Ok(Some(832)), "256 + 512 + 64");
    }

    #[test]
    fn memory_limits_in_mib() {
        assert_eq!(memory_mib(Some(&json!({"limit": 1 << 20}))), Some(1));
        assert_eq!(memory_mib(Some(&json!({"limit": (1 << 20) + 1}))), Some(2));
        assert_eq!(memory_mib(Some(&json!({"limit": 0}))), None);
        assert_eq!(memory_mib(Some(&json!({"limit": -1}))), None);
        assert_eq!(memory_mib(Some(&json!({"swap": 5}))), None);
        assert_eq!(memory_mib(None), None);
        assert_eq!(vmm_mem_max(256, Some(256)), None);
        assert_eq!(vmm_mem_max(256, Some(512)), Some(512));
    }

    #[test]
    fn a_checkpoint_carries_the_record_by_name_and_a_restore_grows_on() {
        let g = Growth::default();
        g.set(Some(pod(1, 8, false)));
        g.set_memory(Some(memory(512, 4096, false)));
        g.record("id-a", Some(1500));
        g.ran(3);
        g.record_memory("id-a", Some(128)).unwrap();
        g.asked_memory(640);
        g.record("id-gone", Some(1000));
        let names = |id: &str| (id == "id-a").then(|| "a".to_string());
        let carried = g.carried(names).unwrap();
        let cpus = carried.cpus.as_ref().unwrap();
        assert_eq!((cpus.running, cpus.members.len()), (3, 1), "{carried:?}");
        assert_eq!(cpus.members.get("a"), Some(&1500));
        assert_eq!(carried.memory.as_ref().unwrap().target, 640);
        // Through the manifest's JSON.
        let json = serde_json::to_string(&carried).unwrap();
        let back: PodGrowth = serde_json::from_str(&json).unwrap();
        assert_eq!(back, carried);
        assert_eq!(back.check(8, (512, Some(4096)), 16), Ok(()));

        let r = Growth::default();
        r.restore(back, 32, |name| format!("restored {name}"));
        assert_eq!(r.lock_memory().as_ref().unwrap().overhead, 32, "this host's overhead");
        // "a" counts until it is taken over, then as its new id.
        assert_eq!(r.record("new-b", Some(1000)), Some(4), "1 + 1.5 + 1 CPUs");
        r.ran(4);
        r.rename("restored a", "id-a2");
        r.forget("id-a2");
        assert_eq!(r.record("new-c", Some(1000)), Some(3), "1 + 1 + 1: one fewer than run");
        assert_eq!(r.record_memory("new-b", Some(64)), Ok(Some(576)), "512 + 64: less than asked");
        assert_eq!(r.record_memory("new-c", Some(128)), Ok(Some(704)), "512 + 64 + 128");
    }

    #[test]
    fn a_carried_record_outside_its_vm_is_refused() {
        let ok = PodGrowth {
            cpus: Some(pod(1, 8, false)),
            memory: Some(memory(512, 4096, false)),
        };
        assert_eq!(ok.check(8, (512, Some(4096)), 16), Ok(()));
        assert!(ok.check(4, (512, Some(4096)), 16).is_err(), "another vCPU count");
        assert!(ok.check(8, (1024, Some(4096)), 16).is_err(), "another base");
        assert!(ok.check(8, (512, None), 16).is_err(), "a VM that cannot grow");
        let mut bad = ok.clone();
        bad.cpus.as_mut().unwrap().running = 9;
        assert!(bad.check(8, (512, Some(4096)), 16).is_err(), "more running than it has");
        let mut bad = ok.clone();
        bad.cpus.as_mut().unwrap().base = 0;
        assert!(bad.check(8, (512, Some(4096)), 16).is_err(), "none running");
        let mut bad = ok.clone();
        bad.memory.as_mut().unwrap().target = 4098;
        assert!(bad.check(8, (512, Some(4096)), 16).is_err(), "past its max");
        let mut bad = ok.clone();
        bad.memory.as_mut().unwrap().target = 256;
        assert!(bad.check(8, (512, Some(4096)), 16).is_err(), "below its base");
        let mut bad = ok;
        bad.cpus.as_mut().unwrap().members = (0..17).map(|i| (i.to_string(), 1)).collect();
        assert!(bad.check(8, (512, Some(4096)), 16).is_err(), "more members than a pod has");
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
