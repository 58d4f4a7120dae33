//! A CRI pod's named checkpoint and its restore: the whole VM, with every
//! container's disk beside it (see [`snapshot::PodManifest`]).
//!
//! - `burrow sandbox checkpoint POD NAME` snapshots the pod's VM once and
//!   copies the sandbox container's disk (`rootfs.img`) and each member's
//!   (`slot-<n>.img`, by the slot it is in) while the VM is paused.
//! - A pod started with the annotation `io.burrow.restore=NAME` (containerd
//!   passes it to the sandbox container when the runtime's
//!   `pod_annotations` allow `io.burrow.*`, as `burrow install` sets)
//!   restores that VM, each disk copied back into the slot it was in, the
//!   members running in the guest as they were. Each one waits for its
//!   container: the kubelet's CreateContainer with the same CRI name
//!   (`io.kubernetes.cri.container-name`) takes it over, process, disk and
//!   all, as a restored task (Start does not start it again); the image and
//!   command of that request are not used. A container of another name is
//!   created in a free slot as usual.
//!
//! containerd's own checkpoint (`ctr task checkpoint`) is of one task and
//! is refused for a pod.

use std::path::PathBuf;

use super::checkpoint::{Carried, Contents, PodDisks};
use super::intake::Intake;
use super::rootfs::GuestRootfs;
use super::snapshot::{self, PodManifest, PodMember};
use super::{pod, VmSandbox};
use crate::sandbox::{ContainerConfig, Result, SandboxError};
use crate::spec;

/// The annotation CRI gives each container its name by.
pub const CRI_CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";

/// A restored member no container has taken over yet.
#[derive(Debug, Clone)]
pub struct Waiting {
    pub name: String,
    pub slot: u32,
    pub contents: Contents,
}

/// What holds the slot of waiting member `name` (never a container id:
/// those have no NUL).
fn placeholder(name: &str) -> String {
    format!("\0restored {name}")
}

/// A container's CRI name, else its id.
fn name_of(id: &str, spec: &serde_json::Value) -> String {
    spec::annotation(spec, CRI_CONTAINER_NAME).map_or_else(|| id.to_string(), str::to_string)
}

impl VmSandbox {
    /// What a checkpoint of this VM carries: its one container, or for a
    /// CRI pod its sandbox container and every other container with the
    /// slot its disk is in (a named checkpoint only: `packed` ones are
    /// containerd's, of one task).
    pub(super) fn checkpointed(&self, packed: bool) -> Result<Carried> {
        let r = self.registry();
        if !self.slots.is_pod() {
            if r.len() > 1 {
                return Err(SandboxError::Internal(
                    "a VM outside a pod holds more than one container".into(),
                ));
            }
            let (id, c) = r.iter().next().ok_or_else(|| {
                SandboxError::FailedPrecondition("the sandbox has no container".into())
            })?;
            return Ok(Carried {
                container: c.clone(),
                slot: self.slots.of(id),
                pod: None,
            });
        }
        let pod_id = self.sandbox_id();
        if packed {
            return Err(SandboxError::FailedPrecondition(format!(
                "this VM runs pod {pod_id}: containerd's checkpoint is of one task, so a pod is checkpointed whole by name instead (`burrow sandbox checkpoint {pod_id} NAME`) and restored as a pod (annotation io.burrow.restore=NAME)"
            )));
        }
        let sandbox = r.get(&pod_id).cloned().ok_or_else(|| {
            SandboxError::FailedPrecondition(format!(
                "pod {pod_id}: its sandbox container is gone"
            ))
        })?;
        let mut members = Vec::new();
        let mut disks = Vec::new();
        let mut ids: Vec<&String> = r.keys().filter(|id| **id != pod_id).collect();
        ids.sort_unstable();
        // The growth record's members by name: each container's CRI name,
        // a waiting one's own.
        let mut names: Vec<(String, String)> = Vec::new();
        for id in ids {
            let (Some(c), Some(slot)) = (r.get(id), self.slots.of(id)) else {
                return Err(SandboxError::Internal(format!(
                    "container {id} of pod {pod_id} holds no block slot"
                )));
            };
            let name = name_of(id, &c.spec);
            names.push((id.clone(), name.clone()));
            members.push(member(name, slot, c));
            disks.extend(member_disks(slot, c));
        }
        for w in self.waiting().iter() {
            names.push((placeholder(&w.name), w.name.clone()));
            members.push(member(w.name.clone(), w.slot, &w.contents));
            disks.extend(member_disks(w.slot, &w.contents));
        }
        let growth = self.growth.carried(|key| {
            names.iter().find(|(k, _)| k == key).map(|(_, n)| n.clone())
        });
        // A shared image layer once.
        disks.sort();
        disks.dedup_by_key(|d| d.0);
        let manifest = PodManifest {
            slots: self.slots.count(),
            layer_slots: self.slots.for_layers(),
            members,
            growth,
        };
        let slot = self.slots.of(&pod_id);
        manifest
            .check(slot)
            .map_err(|why| SandboxError::Internal(format!("pod {pod_id}: {why}")))?;
        Ok(Carried {
            container: sandbox,
            slot,
            pod: Some(PodDisks { manifest, disks }),
        })
    }

    /// The waiting members, locked.
    fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<Waiting>> {
        self.restored_members
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// For a restore of `manifest` into `c`: refuse a pod's checkpoint
    /// anywhere but in a pod's sandbox, and the other way round.
    pub(super) fn check_restore_role(c: &ContainerConfig, manifest: &snapshot::Manifest) -> Result<()> {
        let sandbox = pod::role(&c.spec) == pod::Role::Sandbox;
        match (sandbox, manifest.pod.is_some()) {
            (true, false) => Err(SandboxError::InvalidArgument(format!(
                "pod {}: the checkpoint is of one container, not of a pod",
                c.id
            ))),
            (false, true) => Err(SandboxError::InvalidArgument(format!(
                "container {}: the checkpoint is of a pod; restore it as a pod (the pod annotation io.burrow.restore)",
                c.id
            ))),
            _ => Ok(()),
        }
    }

    /// Copy a pod checkpoint's member disks (`files`) into this sandbox's
    /// image directory and record the members as waiting in their slots;
    /// returns the disks in slot order, the sandbox's own `sandbox_disk`
    /// among them when it was in a slot, for the VMM's `--disk` list after
    /// the VM's own disks.
    pub(super) async fn restore_pod_disks(
        &self,
        (pod, sandbox_slot): (&PodManifest, Option<u32>),
        files: &Intake,
        (sandbox_id, sandbox_disk): (&str, &PathBuf),
    ) -> Result<Vec<PathBuf>> {
        self.slots.reset(pod.slots, pod.layer_slots, true);
        let mut in_slots: Vec<(u32, PathBuf)> = Vec::new();
        if let Some(n) = sandbox_slot {
            self.slots.assign(n, sandbox_id);
            in_slots.push((n, sandbox_disk.clone()));
        }
        // Each disk copied once, a shared image layer's too.
        for n in pod.disk_slots() {
            let from = files
                .slots
                .iter()
                .find(|(f, _)| *f == n)
                .map(|(_, f)| f.path())
                .ok_or_else(|| SandboxError::Internal(format!("slot {n} has no disk")))?;
            // `+`: in no containerd id, so no container's image has the name.
            let img = self.images.join(format!("+restored-slot-{n}{}", super::disk_budget::IMAGE_SUFFIX));
            drop(super::disk_budget::create_image(&img)?);
            snapshot::copy_disk(&from, &img).await?;
            in_slots.push((n, img));
        }
        // (The sandbox's slot is never a member's: checked with the manifest.)
        let disk_of = |n: u32| {
            in_slots
                .iter()
                .find(|(c, _)| *c == n)
                .map(|(_, p)| p.clone())
                .ok_or_else(|| SandboxError::Internal(format!("slot {n} has no disk")))
        };
        for n in pod.lower_slots() {
            let users = pod
                .members
                .iter()
                .filter(|m| m.lower_slot == Some(n))
                .map(|m| placeholder(&m.name))
                .collect();
            // Its key is no layer chain's: new containers get their own.
            self.slots.assign_shared(n, &format!("restored {n}"), &disk_of(n)?, users);
        }
        let mut waiting = Vec::new();
        for m in &pod.members {
            let img = disk_of(m.slot)?;
            let lower = match m.lower_slot {
                Some(slot) => Some(super::rootfs::Lower {
                    disk: disk_of(slot)?,
                    slot,
                }),
                None => None,
            };
            self.slots.assign(m.slot, &placeholder(&m.name));
            waiting.push(Waiting {
                name: m.name.clone(),
                slot: m.slot,
                contents: Contents {
                    guest_id: m.guest_id.clone(),
                    rootfs: GuestRootfs {
                        disk: img.clone(),
                        read_only: m.rootfs_read_only,
                        fstype: m.rootfs_fstype.clone(),
                        image: Some(img),
                        lower,
                    },
                    spec: m.spec.clone(),
                },
            });
        }
        *self.waiting() = waiting;
        in_slots.sort_by_key(|(n, _)| *n);
        Ok(in_slots.into_iter().map(|(_, p)| p).collect())
    }

    /// Take up the growth record of pod checkpoint `pod` restored into a
    /// VM of `vcpus` and `memory` (`--mem` and `--mem-max`): its members
    /// count under their placeholders until taken over. A record that
    /// does not fit the VM is refused.
    pub(super) fn restore_growth(
        &self,
        cfg: &crate::config::Config,
        pod: &PodManifest,
        vcpus: u32,
        memory: (u64, Option<u64>),
    ) -> Result<()> {
        let Some(g) = pod.growth.clone() else {
            return Ok(());
        };
        g.check(vcpus, memory, snapshot::MAX_POD_MEMBERS)
            .map_err(|why| SandboxError::InvalidArgument(format!("the pod checkpoint's growth record: {why}")))?;
        self.growth.restore(g, cfg.memory_mib.overhead, placeholder);
        Ok(())
    }

    /// Forget the waiting members of a restore that failed.
    pub(super) fn forget_waiting(&self) {
        self.waiting().clear();
    }

    /// A pod member `c` whose CRI name a restored member has: take that
    /// member over (its process runs already); returns its init's pid, or
    /// None when no restored member waits under that name.
    pub(super) async fn take_over_waiting(&self, c: &ContainerConfig) -> Result<Option<u32>> {
        if pod::role(&c.spec) != pod::Role::Member {
            return Ok(None);
        }
        let name = name_of(&c.id, &c.spec);
        let w = {
            let mut waiting = self.waiting();
            let Some(i) = waiting.iter().position(|w| w.name == name) else {
                return Ok(None);
            };
            waiting.remove(i)
        };
        let agent = self.awake_agent().await?;
        let pid = match agent.restored_init(&w.contents.guest_id).await {
            Ok(pid) => pid,
            Err(e) => {
                // Its slot stays the restored member's.
                self.waiting().push(w);
                return Err(e);
            }
        };
        self.slots.assign(w.slot, &c.id);
        self.slots.rename_user(&placeholder(&name), &c.id);
        self.growth.rename(&placeholder(&name), &c.id);
        tracing::info!(
            "{}: took over restored container {name} (slot {}, guest id {})",
            c.id,
            w.slot,
            w.contents.guest_id
        );
        self.registry().insert(c.id.clone(), w.contents);
        Ok(Some(pid))
    }
}

/// A member's disks by slot: its own and its shared image layer's.
fn member_disks(slot: u32, c: &Contents) -> Vec<(u32, PathBuf)> {
    let lower = c.rootfs.lower.iter().map(|l| (l.slot, l.disk.clone()));
    std::iter::once((slot, c.rootfs.disk.clone())).chain(lower).collect()
}

fn member(name: String, slot: u32, c: &Contents) -> PodMember {
    PodMember {
        guest_id: c.guest_id.clone(),
        name,
        slot,
        lower_slot: c.rootfs.lower.as_ref().map(|l| l.slot),
        rootfs_fstype: c.rootfs.fstype.clone(),
        rootfs_read_only: c.rootfs.read_only,
        spec: c.spec.clone(),
    }
}
