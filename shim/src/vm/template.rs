//! Warm templates (issue 16): a container's VM starts by restoring a
//! snapshot of a booted guest whose agent is ready and which holds no
//! container yet, instead of booting a kernel.
//!
//! - One template per VM shape: the kernel, the agent's initramfs and the
//!   burrow-vmm binary (each known by device, inode, size and mtime, so a
//!   rewritten file is a new input), the kernel command line, vCPUs,
//!   memory and block slots. Their hash is the template's key and
//!   directory name under `template_dir`: `<shape>-<inputs>/`, holding
//!   `vm/state`, `vm/memory` and `template.json` (what went into the key,
//!   for people).
//! - The first create of a shape boots the template VM (no disk, only
//!   empty block slots), snapshots it into a private directory, publishes
//!   it with a rename, and goes on with that same VM; a template whose
//!   inputs changed is a new key, and publishing it removes the shape's
//!   older ones, so a stale template is never restored.
//! - Every later create restores it: burrow-vmm maps the memory file
//!   MAP_PRIVATE (nothing read up front; copies share its page cache).
//! - Either way the container's rootfs goes into block slot 0, as a pod
//!   member's does ([`super::pod`]), and the guest gets its own identity
//!   before the container exists ([`identity`]): clock, fresh entropy with a
//!   CRNG reseed, hostname, machine id and VM generation.
//!
//! A spec asking for a new network namespace (`ctr run`) gets the shim's
//! namespace, tap and holder as on a cold boot, and a template with a NIC
//! that is down (one MAC for all copies until `ctr run --cni` gives it
//! CNI's at Start). A container with the browser image
//! (`io.burrow.browser=true`) has its own shape: the template boots with
//! the image as its first disk (the rootfs goes into a slot), and the
//! image file is one of the template's inputs. Off with
//! `io.burrow.template=off`, or unless `templates = true` in the config
//! (`io.burrow.template=on` asks for it per container).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::agent::Agent;
use super::lifecycle::{Gone, VmInfo};
use super::rootfs::GuestRootfs;
use super::{guest_rootfs, net, netns, pod, snapshot, VmSandbox};
use crate::config::Config;
use crate::sandbox::{AfterCheckpoint, ContainerConfig, Result, SandboxError};
use crate::spec;

/// Per-container switch: `on` or `off` (else the config's `templates`).
pub const ANNOTATION: &str = "io.burrow.template";
/// In a template's directory: what went into its key.
pub(super) const INFO: &str = "template.json";
/// Bumped when what a template holds changes meaning.
const TEMPLATE_FORMAT: u32 = 2;

/// Whether container `c` starts from a template.
pub fn wanted(cfg: &Config, c: &ContainerConfig) -> bool {
    let asked = match spec::annotation(&c.spec, ANNOTATION) {
        Some("on" | "true") => true,
        Some("off" | "false") => false,
        _ => cfg.templates,
    };
    asked
}

/// Whether container `c`'s VM has a NIC: in a namespace the shim makes
/// (`ctr run`) or a named one (CNI's, a CRI pod's, `--with-ns`).
pub fn has_nic(spec: &serde_json::Value) -> bool {
    netns::wants_fresh(spec) || net::netns_path(spec).is_some()
}

/// The shape a container of `spec` starts from, with `pod_slots` further
/// slots for a pod's members.
pub fn shape_of(cfg: &Config, spec: &serde_json::Value, pod_slots: u32) -> Shape {
    let size = spec::vm_size(spec, cfg);
    Shape {
        vcpus: size.vcpus,
        max_vcpus: super::grow::max_vcpus_for(cfg, spec, size.vcpus),
        memory_mib: size.memory_mib,
        memory_max_mib: super::grow::memory_max_for(cfg, spec, size.memory_mib),
        slots: pod_slots.saturating_add(1),
        nic: has_nic(spec),
        browser: spec::wants_browser(spec, cfg),
    }
}

/// What a template is a snapshot of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub vcpus: u32,
    /// vCPUs it has room for (a pod's VM grows: [`super::grow`]).
    pub max_vcpus: u32,
    pub memory_mib: u64,
    /// What its memory may grow to (a pod's VM: [`super::grow`]).
    pub memory_max_mib: Option<u64>,
    /// Block slots: the container's rootfs takes the first.
    pub slots: u32,
    /// A NIC, down and unaddressed. A restore is handed its own sandbox's
    /// tap: in a namespace the shim made (`ctr run`), `ctr run --cni`
    /// then configures the NIC at Start as for a cold boot; in a named
    /// one (CNI's, a CRI pod's) the agent configures it, the CNI
    /// interface's MAC included, before the container is created.
    pub nic: bool,
    /// The browser image as the first disk (`burrow.browser=/dev/vda`).
    pub browser: bool,
}

/// A file input's identity: path, device, inode, size, mtime (ns).
fn file_id(path: &Path) -> Result<String> {
    let md = std::fs::metadata(path)
        .map_err(|e| SandboxError::io(format_args!("template input {}", path.display()), &e))?;
    let mtime = i128::from(md.mtime()) * 1_000_000_000 + i128::from(md.mtime_nsec());
    Ok(format!(
        "{} dev={} ino={} size={} mtime={mtime}",
        path.display(),
        md.dev(),
        md.ino(),
        md.len()
    ))
}

/// `name` as `$PATH` finds it, when it is not a path already.
fn resolve(binary: &Path) -> PathBuf {
    if binary.components().count() > 1 {
        return binary.to_path_buf();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
        .unwrap_or_else(|| binary.to_path_buf())
}

fn hex(bytes: &[u8], n: usize) -> String {
    bytes.iter().take(n).map(|b| format!("{b:02x}")).collect()
}

/// The template's key (`<shape>-<inputs>`) and the description of its
/// inputs written beside it.
pub fn key(cfg: &Config, shape: Shape) -> Result<(String, serde_json::Value)> {
    let shape_text = format!(
        "format={TEMPLATE_FORMAT} vcpus={} max_vcpus={} memory_mib={} memory_max_mib={} slots={} nic={} browser={} cmdline={}",
        shape.vcpus,
        shape.max_vcpus,
        shape.memory_mib,
        shape.memory_max_mib.unwrap_or(0),
        shape.slots,
        shape.nic,
        shape.browser,
        cfg.kernel_cmdline
    );
    let mut files = vec![file_id(&cfg.kernel)?, file_id(&resolve(&cfg.vmm_binary()))?];
    if let Some(initrd) = &cfg.initrd {
        files.push(file_id(initrd)?);
    }
    if shape.browser {
        files.push(file_id(&cfg.browser_image)?);
    }
    let shape_hash = Sha256::digest(shape_text.as_bytes());
    let inputs_hash = Sha256::digest(files.join("\n").as_bytes());
    let key = format!("{}-{}", hex(&shape_hash, 8), hex(&inputs_hash, 8));
    let info = serde_json::json!({"shape": shape_text, "inputs": files});
    Ok((key, info))
}

/// A published template's VM snapshot directory, if `dir` holds one.
pub(super) fn published(dir: &Path) -> Option<PathBuf> {
    let vm = snapshot::vm_dir(dir);
    let complete = dir.join(INFO).is_file()
        && vm.join(snapshot::STATE_FILE).is_file()
        && vm.join(snapshot::MEMORY).is_file();
    complete.then_some(vm)
}

/// Publish the template built in `build` as `dir` (a rename: readers see
/// all of it or none), then remove the shape's older templates. Losing a
/// race with another shim building the same key is fine: its copy stays.
fn publish(build: &Path, dir: &Path, key: &str) -> Result<()> {
    if let Err(e) = std::fs::rename(build, dir) {
        let _ = std::fs::remove_dir_all(build);
        if published(dir).is_none() {
            return Err(SandboxError::io(
                format_args!("publishing template {}", dir.display()),
                &e,
            ));
        }
    }
    let (shape, _) = key.split_once('-').unwrap_or((key, ""));
    let Some(parent) = dir.parent() else {
        return Ok(());
    };
    for entry in std::fs::read_dir(parent).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name != key && name.starts_with(&format!("{shape}-")) {
            tracing::info!("removing stale template {name}");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(())
}

/// 16 random bytes from the host, as lowercase hex.
pub(super) fn random_hex() -> Result<String> {
    use std::io::Read;
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| SandboxError::Internal(format!("reading /dev/urandom: {e}")))?;
    Ok(hex(&b, 16))
}

/// The guest hostname for sandbox `id`: its id, cut to what a hostname
/// may hold.
pub fn hostname(id: &str) -> String {
    let h: String = id
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .take(63)
        .collect();
    if h.is_empty() {
        "burrow".into()
    } else {
        h
    }
}

/// Make the guest its own before anything runs in it: clock, entropy (the
/// agent reseeds the kernel's CRNG), hostname, machine id, generation.
/// The calls are independent and share one connection, so they go out
/// together: one round trip to the guest instead of four in a row.
pub async fn identity(agent: &Agent, hostname: &str, generation: u64) -> Result<()> {
    tokio::try_join!(
        agent.set_time_now(),
        agent.add_entropy(),
        restored_identity(agent, hostname, generation),
    )
    .map(drop)
}

/// [`identity`] for a guest the launcher restored: the launch already set
/// its clock and added entropy (reseeding its CRNG) before anything else,
/// so only the names are left.
pub async fn restored_identity(agent: &Agent, hostname: &str, generation: u64) -> Result<()> {
    agent.set_identity(hostname, &random_hex()?, generation).await
}

/// Where the guest side of a template start went, in ms from the agent's
/// first answer.
struct GuestPhases {
    total: u128,
    /// The identity calls and a named namespace's NIC.
    identity: u128,
    /// When the root filesystem made beside the restore was ready.
    rootfs_ready: u128,
    /// When its slot was attached.
    attached: u128,
    /// The container's create in the guest (after both).
    container: u128,
}

impl VmSandbox {
    /// The sandbox id (its state directory's name).
    pub(super) fn sandbox_id(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Start container `c` from its shape's template (see the module doc),
    /// with `pod_slots` further slots for a pod's members.
    pub(super) async fn create_from_template(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        pod_slots: u32,
    ) -> Result<u32> {
        self.prepare_state_dir(cfg)?;
        let (guest_spec, spec_json) = self.guest_spec(c)?;
        let started = Instant::now();
        let shape = shape_of(cfg, &c.spec, pod_slots);
        let (key, info) = key(cfg, shape)?;
        let dir = cfg.template_dir.join(&key);
        let restored = published(&dir);
        let from_template = restored.is_some();
        let from = if from_template {
            "restored"
        } else {
            "built"
        };
        let mut args = self.vmm_args(
            cfg,
            None,
            (shape.vcpus, shape.memory_mib),
            restored.clone(),
            &c.spec,
        )?;
        // A template built here, on first use, boots with the shape's room
        // to grow (a restore takes it from the template instead).
        args.args.max_vcpus = super::grow::vmm_max(shape.vcpus, shape.max_vcpus);
        args.args.mem_max_mib = shape.memory_max_mib;
        args.vcpus = shape.max_vcpus;
        args.memory_max_mib = shape.memory_max_mib;
        self.growth.set_memory(super::grow::memory_record_for(
            cfg,
            &c.spec,
            shape.memory_mib,
            shape.memory_max_mib,
        ));
        self.growth.set(super::grow::record_for(&c.spec, shape.vcpus, shape.max_vcpus));
        // The namespace the shim makes, its tap, and the holder whose pid
        // is the task's (so `ctr run --cni` configures that namespace).
        // Nothing of this sandbox's network on a template's command line:
        // a named namespace's NIC is configured in `fill`.
        let mut args = self.with_network(&c.spec, args, false).await?;
        self.slots.reset(
            shape.slots,
            pod::layer_slots(cfg, &c.spec),
            pod::role(&c.spec) == pod::Role::Sandbox,
        );
        let slot = self.slots.take(&c.id)?;
        let host = hostname(&self.sandbox_id());
        // The root filesystem is made while the VM restores (it goes into a
        // slot once the agent answers, not on the VMM's command line), so a
        // start costs the longer of the two, not their sum.
        let (made, rootfs) = tokio::sync::oneshot::channel::<GuestRootfs>();
        let prepare = async {
            let rootfs = self.prepare_rootfs(cfg, c, guest_spec).await?;
            let _ = made.send(rootfs);
            Ok::<_, SandboxError>(started.elapsed().as_millis())
        };
        let fill = |agent: Agent| async move {
            let t = Instant::now();
            // The guest's identity and network, and the root filesystem's
            // slot (the VMM's API), are independent: all at once.
            let guest_side = async {
                if from_template {
                    restored_identity(&agent, &host, self.vm_generation()).await?;
                } else {
                    identity(&agent, &host, self.vm_generation()).await?;
                }
                self.configure_restored_network(&agent).await?;
                Ok::<_, SandboxError>(t.elapsed().as_millis())
            };
            let disk_side = async {
                let rootfs = rootfs.await.map_err(|_| {
                    SandboxError::Internal(format!("no root filesystem for container {}", c.id))
                })?;
                let waited = t.elapsed().as_millis();
                self.attach_rootfs(slot, &rootfs).await?;
                Ok::<_, SandboxError>((rootfs, waited, t.elapsed().as_millis()))
            };
            let (identity_ms, (rootfs, waited, attached)) =
                tokio::try_join!(guest_side, disk_side)?;
            let guest = guest_rootfs(c, &rootfs, pod::guest_source(slot));
            let container = Instant::now();
            let pid = agent
                .create_container(&c.id, &spec_json, guest, c.stdin)
                .await?;
            Ok((
                pid,
                GuestPhases {
                    total: t.elapsed().as_millis(),
                    identity: identity_ms,
                    rootfs_ready: waited,
                    attached,
                    container: container.elapsed().as_millis(),
                },
            ))
        };
        let booting = Instant::now();
        let start = async {
            if restored.is_some() {
                tracing::info!("{}: restoring template {key}", c.id);
                return self.vm.start(args, fill).await;
            }
            args.args.disk_slots = shape.slots;
            tracing::info!("{}: building template {key}: {}", c.id, args.describe());
            self.vm.start(args, |_| async { Ok(()) }).await?;
            let built = async {
                self.build_template(cfg, &dir, &key, &info).await?;
                let agent = self.awake_agent().await?;
                fill(agent).await
            }
            .await;
            if built.is_err() {
                self.vm.stop(Gone::Stopped).await;
            }
            built
        };
        // The root filesystem's error first: the VM's is then only that it
        // had none.
        let (rootfs_ms, started_vm) = tokio::join!(prepare, start);
        let rootfs_ms = rootfs_ms?;
        let (pid, guest) = started_vm?;
        self.record_phases(
            &c.id,
            &format!(
                "created from a template ({from}) in {} ms: root filesystem {} ms (beside the VM's start), VM to agent ready {} ms, identity, slot and container in the guest {} ms (identity and network {} ms; the root filesystem ready {} ms into it, its slot attached at {} ms; the container's create {} ms)",
                started.elapsed().as_millis(),
                rootfs_ms,
                booting.elapsed().as_millis().saturating_sub(guest.total),
                guest.total,
                guest.identity,
                guest.rootfs_ready,
                guest.attached,
                guest.container,
            ),
        );
        Ok(self.task_pid(pid).await)
    }

    /// Snapshot the running, empty VM as template `key` into `dir`.
    pub(super) async fn build_template(
        &self,
        cfg: &Config,
        dir: &Path,
        key: &str,
        info: &serde_json::Value,
    ) -> Result<()> {
        std::fs::create_dir_all(&cfg.template_dir).map_err(|e| {
            SandboxError::io(format_args!("creating {}", cfg.template_dir.display()), &e)
        })?;
        let build = cfg
            .template_dir
            .join(format!(".build-{key}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&build);
        let info = info.clone();
        let b = build.clone();
        let r = self
            .vm
            .checkpoint(
                &snapshot::vm_dir(&build),
                AfterCheckpoint::Resume,
                |_: VmInfo| async move {
                    let text = serde_json::to_vec_pretty(&info).unwrap_or_default();
                    std::fs::write(b.join(INFO), text)
                        .map_err(|e| SandboxError::io(format_args!("writing {INFO}"), &e))
                },
            )
            .await;
        match r {
            Ok(()) => publish(&build, dir, key),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&build);
                Err(e)
            }
        }
    }

    /// Say where container `id`'s start spent its time: at info, and in
    /// the state directory's phases file for `burrow sandbox ls -v`.
    pub(super) fn record_phases(&self, id: &str, text: &str) {
        tracing::info!("{id}: {text}");
        let file = self.path(burrow_vmm_api::sandbox_control::PHASES_FILE);
        if let Err(e) = std::fs::write(&file, format!("{text}\n")) {
            tracing::debug!("writing {}: {e}", file.display());
        }
    }

    /// A number that changes with every VM this sandbox starts.
    pub(super) fn vm_generation(&self) -> u64 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        u64::try_from(nanos & u128::from(u64::MAX)).unwrap_or(0)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cfg(dir: &Path) -> Config {
        for f in ["vmlinux", "initrd", "burrow-vmm"] {
            std::fs::write(dir.join(f), f).unwrap();
        }
        Config {
            kernel: dir.join("vmlinux"),
            initrd: Some(dir.join("initrd")),
            vmm: Some(dir.join("burrow-vmm")),
            template_dir: dir.join("templates"),
            ..Config::default()
        }
    }

    const SHAPE: Shape = Shape {
        vcpus: 1,
        max_vcpus: 1,
        memory_mib: 256,
        memory_max_mib: None,
        slots: 1,
        nic: false,
        browser: false,
    };

    #[test]
    fn a_changed_input_is_a_new_key_of_the_same_shape() {
        let d = tempfile::tempdir().unwrap();
        let c = cfg(d.path());
        let (k1, info) = key(&c, SHAPE).unwrap();
        assert_eq!(key(&c, SHAPE).unwrap().0, k1, "stable");
        assert!(info["inputs"][0].as_str().unwrap().contains("vmlinux"));
        // Rewritten (new inode, size): a new key with the same shape part.
        std::fs::remove_file(d.path().join("initrd")).unwrap();
        std::fs::write(d.path().join("initrd"), "a newer initrd").unwrap();
        let (k2, _) = key(&c, SHAPE).unwrap();
        assert_ne!(k1, k2);
        assert_eq!(k1.split('-').next(), k2.split('-').next());
        let bigger = Shape {
            memory_mib: 512,
            ..SHAPE
        };
        let (k3, _) = key(&c, bigger).unwrap();
        assert_ne!(k2.split('-').next(), k3.split('-').next());
        std::fs::remove_file(d.path().join("vmlinux")).unwrap();
        assert!(key(&c, SHAPE).is_err(), "a missing kernel is an error");
    }

    #[test]
    fn a_browser_template_is_its_own_shape_and_keyed_by_the_image() {
        let d = tempfile::tempdir().unwrap();
        let mut c = cfg(d.path());
        c.browser_image = d.path().join("browser.img");
        let browser = Shape {
            browser: true,
            ..SHAPE
        };
        assert!(key(&c, browser).is_err(), "a missing image is an error");
        std::fs::write(&c.browser_image, "erofs").unwrap();
        let (plain, _) = key(&c, SHAPE).unwrap();
        let (k1, info) = key(&c, browser).unwrap();
        assert_ne!(plain.split('-').next(), k1.split('-').next());
        assert!(info["inputs"].to_string().contains("browser.img"), "{info}");
        // A rebuilt image: a new key of the same shape (the old is stale).
        std::fs::remove_file(&c.browser_image).unwrap();
        std::fs::write(&c.browser_image, "a newer erofs").unwrap();
        let (k2, _) = key(&c, browser).unwrap();
        assert_ne!(k1, k2);
        assert_eq!(k1.split('-').next(), k2.split('-').next());
    }

    #[test]
    fn publishing_replaces_the_shapes_stale_templates_only() {
        let d = tempfile::tempdir().unwrap();
        let root = d.path();
        let make = |name: &str| {
            let dir = root.join(name);
            std::fs::create_dir_all(snapshot::vm_dir(&dir)).unwrap();
            for f in [snapshot::STATE_FILE, snapshot::MEMORY] {
                std::fs::write(snapshot::vm_dir(&dir).join(f), "x").unwrap();
            }
            std::fs::write(dir.join(INFO), "{}").unwrap();
            dir
        };
        make("aaaa-0001");
        make("bbbb-0001");
        let build = make(".build-aaaa-0002-1");
        assert!(published(&root.join("aaaa-0002")).is_none());
        publish(&build, &root.join("aaaa-0002"), "aaaa-0002").unwrap();
        assert!(published(&root.join("aaaa-0002")).is_some());
        assert!(!root.join("aaaa-0001").exists(), "stale one removed");
        assert!(root.join("bbbb-0001").exists(), "other shapes stay");
        assert!(!build.exists());
        // Losing the race to a complete copy is not an error.
        let again = make(".build-aaaa-0002-2");
        std::fs::write(snapshot::vm_dir(&root.join("aaaa-0002")).join("x"), "").unwrap();
        publish(&again, &root.join("aaaa-0002"), "aaaa-0002").unwrap();
        assert!(!again.exists());
    }

    #[test]
    fn hostnames_are_the_sandbox_id_cut_to_size() {
        assert_eq!(hostname("t-tmpl-1"), "t-tmpl-1");
        assert_eq!(hostname("a_b/c"), "abc");
        assert_eq!(hostname(&"x".repeat(100)).len(), 63);
        assert_eq!(hostname("///"), "burrow");
    }

    #[test]
    fn the_annotation_and_config_switch_it() {
        let mut c = Config::default();
        let with = |v: Option<&str>| ContainerConfig {
            id: "c".into(),
            bundle: "/b".into(),
            spec: match v {
                Some(v) => serde_json::json!({"annotations": {ANNOTATION: v}}),
                None => serde_json::json!({}),
            },
            rootfs: vec![],
            stdin: false,
        };
        assert!(c.templates, "templates are on by default");
        assert!(wanted(&c, &with(None)));
        assert!(!wanted(&c, &with(Some("off"))));
        c.templates = false;
        assert!(!wanted(&c, &with(None)));
        assert!(wanted(&c, &with(Some("on"))));
        c.templates = true;
        let mut netns = with(None);
        netns.spec = serde_json::json!({"linux": {"namespaces": [
            {"type": "network", "path": "/var/run/netns/x"}]}});
        assert!(
            wanted(&c, &netns),
            "a named namespace's VM is restored too (the agent takes the CNI MAC)"
        );
        assert!(has_nic(&netns.spec));
        assert!(has_nic(
            &serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}})
        ));
        assert!(!has_nic(&serde_json::json!({"linux": {"namespaces": []}})));
    }
}
