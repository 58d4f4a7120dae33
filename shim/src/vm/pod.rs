//! A Kubernetes pod in one VM. containerd's CRI plugin creates a pod's
//! sandbox ("pause") container first and then each of its containers, all
//! with the annotation `io.kubernetes.cri.sandbox-id`, which the shim's
//! `start` groups on (one shim, one VM per pod: [`crate::shim::grouping`]).
//!
//! - The sandbox container (`io.kubernetes.cri.container-type: sandbox`)
//!   boots the VM on its own root filesystem (the boot disk) with
//!   `pod_disk_slots` empty block slots for containers and
//!   `pod_layer_slots` for the image layers they share
//!   ([`super::layered`]), and runs its image's holder
//!   process (pause) in the guest: no other guest process.
//! - Every further container (`container-type: container`) gets its root
//!   filesystem image attached to a free slot through the VMM's control
//!   API; the agent finds the disk by its serial (`burrow-slot-<n>`) and
//!   creates the container with its own mount and (as its spec asks) PID
//!   namespace, in the sandbox's IPC and UTS namespaces (the spec names
//!   them as `/proc/<sandbox pid>/ns/...`, and that pid is the guest's);
//!   all of them share the guest's network. Deleting the container empties
//!   its slot again.
//! - A container beyond the slot count is refused (RESOURCE_EXHAUSTED).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use burrow_vmm_api::Command;

use super::rootfs::GuestRootfs;
use super::{vmm, VmSandbox};
use crate::config::Config;
use crate::sandbox::{ContainerConfig, Result, SandboxError};
use crate::spec;

pub use crate::spec::CRI_CONTAINER_TYPE;
/// How long one attach or detach may take.
const SLOT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a container is to its shim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Not a CRI pod's: one container, one VM.
    Alone,
    /// A CRI pod's sandbox: boots the pod's VM.
    Sandbox,
    /// A container of a CRI pod: joins the running VM.
    Member,
}

/// The role the spec's CRI annotations give a container.
pub fn role(spec: &serde_json::Value) -> Role {
    match spec::annotation(spec, CRI_CONTAINER_TYPE) {
        Some("sandbox") => Role::Sandbox,
        Some("container") => Role::Member,
        _ => Role::Alone,
    }
}

/// The slots for shared image layers a VM made for a container of `spec`
/// has: a pod sandbox's VM has `pod_layer_slots` ([`super::layered`]).
pub fn layer_slots(cfg: &Config, spec: &serde_json::Value) -> u32 {
    match role(spec) {
        Role::Sandbox => cfg.pod_layer_slots,
        _ => 0,
    }
}

/// The rootfs source the agent resolves to slot `n`'s disk.
pub fn guest_source(n: u32) -> String {
    format!("serial:burrow-slot-{n}")
}

/// Which container holds which block slot of the VM.
#[derive(Debug, Default)]
pub struct Slots {
    inner: Mutex<SlotsInner>,
    /// The VM is a CRI pod's (a template-born VM has slots too).
    pod: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Default)]
struct SlotsInner {
    owners: Vec<Option<String>>,
    /// Slots holding a read-only image layer that containers share
    /// ([`super::layered`]); their owner is [`shared_owner`] of the key.
    shared: Vec<Shared>,
    /// How many of the slots may hold shared layers; the others are the
    /// containers' own.
    for_layers: usize,
}

impl SlotsInner {
    fn free(&self) -> Option<usize> {
        self.owners.iter().position(Option::is_none)
    }

    fn set(&mut self, n: u32, owner: Option<String>) -> Option<String> {
        let o = usize::try_from(n).ok().and_then(|i| self.owners.get_mut(i))?;
        std::mem::replace(o, owner)
    }

    /// Slot `n` holds image layer `key`'s `disk`, shared by `users`.
    fn share(&mut self, n: u32, key: &str, disk: &Path, users: Vec<String>) {
        self.set(n, Some(shared_owner(key)));
        self.shared.push(Shared {
            slot: n,
            key: key.to_string(),
            disk: disk.to_path_buf(),
            users,
        });
    }
}

/// A slot's shared read-only image and the containers on it.
#[derive(Debug, Clone)]
struct Shared {
    slot: u32,
    key: String,
    disk: PathBuf,
    users: Vec<String>,
}

/// What owns a shared slot (never a container id: those have no NUL).
fn shared_owner(key: &str) -> String {
    format!("\0shared {key}")
}

fn slot_no(i: usize) -> Result<u32> {
    u32::try_from(i).map_err(|_| SandboxError::Internal("slot number".into()))
}

impl Slots {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotsInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the VM is a CRI pod's.
    pub fn is_pod(&self) -> bool {
        self.pod.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The VM booted with `n` empty slots, `for_layers` of them for shared
    /// image layers, for a CRI pod if `pod`.
    pub fn reset(&self, n: u32, for_layers: u32, pod: bool) {
        let n = usize::try_from(n).unwrap_or(0);
        *self.lock() = SlotsInner {
            owners: vec![None; n],
            shared: Vec::new(),
            for_layers: usize::try_from(for_layers).unwrap_or(0).min(n),
        };
        self.pod.store(pod, std::sync::atomic::Ordering::Relaxed);
    }

    /// How many slots are for shared image layers.
    pub fn for_layers(&self) -> u32 {
        u32::try_from(self.lock().for_layers).unwrap_or(0)
    }

    /// Give container `id` the lowest free slot.
    pub fn take(&self, id: &str) -> Result<u32> {
        let mut s = self.lock();
        let total = s.owners.len().saturating_sub(s.for_layers);
        let used = s.owners.iter().flatten().count().saturating_sub(s.shared.len());
        let free = s.free().filter(|_| used < total).ok_or_else(|| {
            SandboxError::ResourceExhausted(format!(
                "container {id}: the pod's VM has {total} block slots for containers and all are in use (pod_disk_slots in the burrow config)"
            ))
        })?;
        s.set(slot_no(free)?, Some(id.to_string()));
        slot_no(free)
    }

    /// The slot container `id` holds.
    pub fn of(&self, id: &str) -> Option<u32> {
        let s = self.lock();
        let n = s.owners.iter().position(|o| o.as_deref() == Some(id))?;
        u32::try_from(n).ok()
    }

    /// How many slots the VM has.
    pub fn count(&self) -> u32 {
        u32::try_from(self.lock().owners.len()).unwrap_or(u32::MAX)
    }

    /// Record that `owner` holds slot `n` (a restored VM's).
    pub fn assign(&self, n: u32, owner: &str) {
        self.lock().set(n, Some(owner.to_string()));
    }

    /// Free container `id`'s slot; returns its number.
    pub fn release(&self, id: &str) -> Option<u32> {
        let mut s = self.lock();
        let n = s.owners.iter().position(|o| o.as_deref() == Some(id))?;
        let n = u32::try_from(n).ok()?;
        s.set(n, None);
        Some(n)
    }

    /// Add container `id` to the users of the shared slot of image layer
    /// `key`; its slot and disk, if the VM has one.
    pub fn join_shared(&self, key: &str, id: &str) -> Option<(u32, PathBuf)> {
        let mut s = self.lock();
        let sh = s.shared.iter_mut().find(|sh| sh.key == key)?;
        sh.users.push(id.to_string());
        Some((sh.slot, sh.disk.clone()))
    }

    /// Whether a new shared image layer has a slot.
    pub fn room_for_layer(&self) -> bool {
        let s = self.lock();
        s.shared.len() < s.for_layers && s.free().is_some()
    }

    /// Give image layer `key`'s `disk` the lowest free slot, shared, with
    /// `users` on it.
    pub fn take_shared(&self, key: &str, disk: &Path, users: Vec<String>) -> Result<u32> {
        let mut s = self.lock();
        let free = s.free().filter(|_| s.shared.len() < s.for_layers).ok_or_else(|| {
            SandboxError::ResourceExhausted(format!(
                "the pod's VM has {} block slots for shared image layers and all are in use (pod_layer_slots in the burrow config)",
                s.for_layers
            ))
        })?;
        let slot = slot_no(free)?;
        s.share(slot, key, disk, users);
        Ok(slot)
    }

    /// Record that slot `n` holds image layer `key`'s `disk` for `users` (a
    /// restored VM's).
    pub fn assign_shared(&self, n: u32, key: &str, disk: &Path, users: Vec<String>) {
        self.lock().share(n, key, disk, users);
    }

    /// A shared slot's user `from` is now `to` (a restored member taken over).
    pub fn rename_user(&self, from: &str, to: &str) {
        for sh in self.lock().shared.iter_mut() {
            for u in sh.users.iter_mut().filter(|u| *u == from) {
                *u = to.to_string();
            }
        }
    }

    /// Take container `id` off its shared slot; when it was the last user,
    /// the slot is freed and its number and disk returned.
    pub fn leave_shared(&self, id: &str) -> Option<(u32, PathBuf)> {
        let mut s = self.lock();
        let i = s.shared.iter().position(|sh| sh.users.iter().any(|u| u == id))?;
        let sh = s.shared.get_mut(i)?;
        sh.users.retain(|u| u != id);
        if !sh.users.is_empty() {
            return None;
        }
        let sh = s.shared.remove(i);
        s.set(sh.slot, None);
        Some((sh.slot, sh.disk))
    }
}

/// A member's memory limit must fit a pod VM that cannot grow (`vm_mib`,
/// of which `overhead_mib` are the guest kernel's and agent's): one
/// restored from a checkpoint (see [`spec::vm_size`] for how it is sized;
/// a VM this shim booted grows instead, [`super::grow`]), since a limit it
/// cannot honour would only surprise later as an OOM.
fn check_fits(c: &ContainerConfig, vm_mib: u64, overhead_mib: u64) -> Result<()> {
    let limit = c
        .spec
        .pointer("/linux/resources/memory/limit")
        .and_then(serde_json::Value::as_i64)
        .filter(|l| *l > 0)
        .and_then(|l| u64::try_from(l).ok());
    let room = vm_mib.saturating_sub(overhead_mib);
    match limit {
        Some(l) if l.div_ceil(1 << 20) > room => Err(SandboxError::ResourceExhausted(format!(
            "container {}: its memory limit ({} MiB) does not fit its pod's VM ({vm_mib} MiB, {overhead_mib} MiB of it the guest's). The VM is sized when the pod starts: from the pod annotation {}=<MiB> (containerd's CRI passes io.burrow.* pod annotations when the runtime's pod_annotations allow them, as `burrow install` sets), else from the sum of the pod's containers' limits that the kubelet sends ({}), else memory_mib.default in the burrow config",
            c.id,
            l.div_ceil(1 << 20),
            spec::ANNOTATION_MEMORY_MIB,
            spec::CRI_SANDBOX_MEMORY,
        ))),
        _ => Ok(()),
    }
}

/// Give back the IPC, UTS and PID namespace paths that
/// [`spec::for_guest`] strips, when they name a process's namespaces
/// (`/proc/<pid>/ns/...`, the guest's pids): a pod member joins its
/// sandbox's (the PID one only when the pod shares it:
/// `shareProcessNamespace`).
pub fn keep_pod_namespaces(spec: &serde_json::Value, guest: &mut serde_json::Value) {
    let Some(given) = spec.pointer("/linux/namespaces").and_then(|n| n.as_array()) else {
        return;
    };
    let Some(out) = guest
        .pointer_mut("/linux/namespaces")
        .and_then(|n| n.as_array_mut())
    else {
        return;
    };
    for kind in ["ipc", "uts", "pid"] {
        let path = given
            .iter()
            .filter(|n| n.get("type").and_then(|t| t.as_str()) == Some(kind))
            .find_map(|n| n.get("path").and_then(|p| p.as_str()))
            .filter(|p| {
                p.strip_prefix("/proc/")
                    .and_then(|r| r.strip_suffix(&format!("/ns/{kind}")))
                    .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()))
            });
        let (Some(path), Some(ns)) = (
            path,
            out.iter_mut()
                .find(|n| n.get("type").and_then(|t| t.as_str()) == Some(kind)),
        ) else {
            continue;
        };
        if let Some(o) = ns.as_object_mut() {
            o.insert("path".into(), serde_json::Value::String(path.to_string()));
        }
    }
}

impl VmSandbox {
    /// Create a pod member in the running VM (see the module doc).
    pub(super) async fn create_in_pod(&self, cfg: &Config, c: &ContainerConfig) -> Result<u32> {
        let handle = match self.vm.phase().handle() {
            Some(_) => self.vm.awake().await?,
            None => {
                return Err(SandboxError::FailedPrecondition(format!(
                    "container {}: its pod's VM is not running (the sandbox container boots it)",
                    c.id
                )))
            }
        };
        // A pod VM this shim started grows its memory for the member (or
        // refuses one past the maximum); any other has what it booted with.
        if self.growth.memory_grows() {
            let memory = c.spec.pointer("/linux/resources/memory");
            if let Err(e) = self.grow_memory_for(&c.id, memory).await {
                self.growth.forget(&c.id);
                return Err(e);
            }
        } else {
            check_fits(c, handle.memory_mib, cfg.memory_mib.overhead)?;
        }
        let prepared = || -> Result<_> {
            let (mut guest_spec, _) = self.guest_spec(c)?;
            keep_pod_namespaces(&c.spec, &mut guest_spec);
            let spec_json = serde_json::to_vec(&guest_spec)
                .ok()
                .filter(|j| j.len() <= burrow_protocol::MAX_SPEC_BYTES)
                .ok_or_else(|| SandboxError::InvalidArgument("the OCI spec is too large".into()))?;
            let slot = self.slots.take(&c.id)?;
            Ok((guest_spec, spec_json, slot))
        };
        let (guest_spec, spec_json, slot) = match prepared() {
            Ok(p) => p,
            Err(e) => {
                // The memory grown for it goes back.
                self.fit_to_members(&c.id).await;
                return Err(e);
            }
        };
        // More vCPUs first, so the container starts with them.
        let cpu = c.spec.pointer("/linux/resources/cpu");
        if let Err(e) = self.grow_for(&c.id, cpu).await {
            tracing::warn!("{}: the pod's VM did not grow: {e}", c.id);
        }
        let r = async {
            let rootfs = match self.layered_rootfs(cfg, c, &guest_spec).await? {
                Some(layered) => layered,
                None => self.prepare_rootfs(cfg, c, guest_spec).await?,
            };
            self.attach_rootfs(slot, &rootfs).await?;
            tracing::info!("{}: root filesystem in slot {slot}", c.id);
            let guest_rootfs = super::guest_rootfs(c, &rootfs, guest_source(slot));
            handle
                .agent
                .create_container(&c.id, &spec_json, guest_rootfs, c.stdin)
                .await
        }
        .await;
        if r.is_err() {
            self.release_slot(&c.id).await;
            self.drop_container_files(&c.id);
        }
        r
    }

    /// Put `rootfs`'s disk into block slot `slot` of the running VM.
    pub(super) async fn attach_rootfs(&self, slot: u32, rootfs: &GuestRootfs) -> Result<()> {
        self.attach_disk(slot, &rootfs.disk, rootfs.read_only).await
    }

    /// Put file `path` into block slot `slot` of the running VM.
    pub(super) async fn attach_disk(&self, slot: u32, path: &Path, read_only: bool) -> Result<()> {
        // Opened here and passed: a jailed VMM cannot open host paths.
        let disk = std::fs::File::options()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| SandboxError::io(format_args!("opening {}", path.display()), &e))?;
        self.slot_command_with(
            Command::AttachDisk {
                slot,
                path: path.to_path_buf(),
                read_only,
            },
            &[disk],
        )
        .await
    }

    /// Empty container `id`'s slot, if it has one (the VM may be gone),
    /// and its shared image layer's when no other container uses it (its
    /// file removed too); then give back the vCPUs and memory it alone
    /// needed.
    pub(super) async fn release_slot(&self, id: &str) {
        let own = self.slots.release(id);
        let shared = self.slots.leave_shared(id);
        for slot in own.into_iter().chain(shared.as_ref().map(|s| s.0)) {
            if self.vm.phase().handle().is_some() {
                if let Err(e) = self.slot_command(Command::DetachDisk { slot }).await {
                    tracing::warn!("{id}: emptying slot {slot}: {e}");
                }
            }
        }
        if let Some((_, disk)) = shared {
            let _ = std::fs::remove_file(disk);
        }
        self.fit_to_members(id).await;
    }

    async fn slot_command(&self, cmd: Command) -> Result<()> {
        self.slot_command_with(cmd, &[]).await
    }

    async fn slot_command_with(&self, cmd: Command, files: &[std::fs::File]) -> Result<()> {
        let api = self.path("api.sock");
        tokio::time::timeout(SLOT_TIMEOUT, vmm::command_at_with(&api, cmd, files))
            .await
            .map_err(|_| SandboxError::Timeout("burrow-vmm did not answer a slot change".into()))?
            .map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_the_cri_annotations() {
        let with = |t: &str| serde_json::json!({"annotations": {CRI_CONTAINER_TYPE: t}});
        assert_eq!(role(&with("sandbox")), Role::Sandbox);
        assert_eq!(role(&with("container")), Role::Member);
        assert_eq!(role(&with("other")), Role::Alone);
        assert_eq!(role(&serde_json::json!({})), Role::Alone);
    }

    #[test]
    fn pod_members_keep_the_sandbox_ipc_and_uts_paths() {
        let spec = serde_json::json!({"linux": {"namespaces": [
            {"type": "pid", "path": "/proc/42/ns/pid"},
            {"type": "ipc", "path": "/proc/42/ns/ipc"},
            {"type": "uts", "path": "/proc/42/ns/uts"},
            {"type": "network", "path": "/var/run/netns/cni-1"},
            {"type": "mount"}
        ]}});
        let (mut guest, _) = spec::for_guest(&spec);
        keep_pod_namespaces(&spec, &mut guest);
        let nss = &guest["linux"]["namespaces"];
        assert_eq!(nss[0]["path"], "/proc/42/ns/pid", "shareProcessNamespace");
        assert_eq!(nss[1]["path"], "/proc/42/ns/ipc");
        assert_eq!(nss[2]["path"], "/proc/42/ns/uts");
        assert!(
            nss[3].get("path").is_none(),
            "the network path stays stripped"
        );
        let odd = serde_json::json!({"linux": {"namespaces": [
            {"type": "ipc", "path": "/proc/self/ns/ipc"}
        ]}});
        let (mut guest, _) = spec::for_guest(&odd);
        keep_pod_namespaces(&odd, &mut guest);
        assert!(guest["linux"]["namespaces"][0].get("path").is_none());
    }

    #[test]
    fn a_memory_limit_beyond_the_pods_vm_is_refused() {
        let with = |limit: serde_json::Value| ContainerConfig {
            id: "c1".into(),
            bundle: "/b".into(),
            spec: serde_json::json!({"linux": {"resources": {"memory": {"limit": limit}}}}),
            rootfs: vec![],
            stdin: false,
        };
        assert!(check_fits(&with(serde_json::json!(448 << 20)), 512, 64).is_ok());
        assert!(check_fits(&with(serde_json::json!(-1)), 512, 64).is_ok());
        assert!(check_fits(&with(serde_json::Value::Null), 512, 64).is_ok());
        let e =
            check_fits(&with(serde_json::json!((448 << 20) + 1)), 512, 64).expect_err("too big");
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
        assert!(e.to_string().contains("io.burrow.memory_mib"), "{e}");
    }

    #[test]
    fn slots_are_handed_out_and_refused_when_full() {
        let s = Slots::default();
        assert!(!s.is_pod());
        s.reset(1, 0, false);
        assert!(!s.is_pod(), "a template-born VM's rootfs slot is no pod");
        s.reset(2, 0, true);
        assert!(s.is_pod());
        assert_eq!(s.take("a").expect("a"), 0);
        assert_eq!(s.take("b").expect("b"), 1);
        let e = s.take("c").expect_err("full");
        assert!(matches!(e, SandboxError::ResourceExhausted(_)), "{e:?}");
        assert!(e.to_string().contains("2 block slots"), "{e}");
        assert_eq!(s.release("a"), Some(0));
        assert_eq!(s.release("a"), None);
        assert_eq!(s.take("c").expect("c"), 0, "a freed slot is reused");
        assert_eq!(guest_source(1), "serial:burrow-slot-1");
        assert!(!s.room_for_layer(), "no slot for layers");
    }

    #[test]
    fn shared_layers_have_slots_of_their_own_and_go_with_their_last_user() {
        let s = Slots::default();
        s.reset(4, 2, true);
        assert_eq!(s.for_layers(), 2);
        let (d1, d2) = (Path::new("/i/l1"), Path::new("/i/l2"));
        assert_eq!(s.take("a").expect("a"), 0);
        assert_eq!(s.join_shared("k1", "a"), None, "no layer k1 yet");
        assert!(s.room_for_layer());
        assert_eq!(s.take_shared("k1", d1, vec!["a".into()]).expect("k1"), 1);
        assert_eq!(s.take("b").expect("b"), 2);
        assert_eq!(s.join_shared("k1", "b"), Some((1, d1.to_path_buf())));
        // Two containers' slots, whatever the layers leave free.
        let e = s.take("c").expect_err("containers' slots full");
        assert!(e.to_string().contains("2 block slots for containers"), "{e}");
        assert_eq!(s.take_shared("k2", d2, vec!["b".into()]).expect("k2"), 3);
        assert!(!s.room_for_layer());
        let e = s.take_shared("k3", d2, vec![]).expect_err("layers' slots full");
        assert!(e.to_string().contains("pod_layer_slots"), "{e}");
        // `a` goes: k1 stays for `b`.
        assert_eq!(s.release("a"), Some(0));
        assert_eq!(s.leave_shared("a"), None);
        assert_eq!(s.of("b"), Some(2));
        // A restored member's placeholder becomes the container's id.
        s.rename_user("b", "b2");
        assert_eq!(s.leave_shared("b"), None, "b is b2 now");
        assert_eq!(s.leave_shared("b2"), Some((1, d1.to_path_buf())));
        assert_eq!(s.leave_shared("b2"), Some((3, d2.to_path_buf())));
        assert!(s.room_for_layer());
        assert_eq!(s.take("c").expect("c"), 0);
        assert_eq!(s.take_shared("k3", d2, vec!["c".into()]).expect("k3"), 1);
    }
}
