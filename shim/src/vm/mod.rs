//! The production [`Sandbox`]: one burrow-vmm microVM per shim, with
//! burrow-agent as PID 1 in the guest.
//!
//! State lives in `<state_dir>/<namespace>/<sandbox id>/`:
//! `vmm.pid`, `api.sock` (VMM control), `vsock.sock` (hybrid vsock),
//! `console.log` (guest serial), `vmm.log` (VMM stderr). The
//! `<container>.rootfs.img` of each container whose rootfs had to be copied
//! lives on disk in `<image_dir>/<namespace>/<sandbox id>/`, within the
//! sandbox's disk limit ([`disk_budget`]). All of it goes when the sandbox
//! shuts down; `containerd-shim-burrow-v2 delete` removes what a crashed
//! shim left behind ([`cleanup_state`], [`disk_budget::remove_sandbox_images`]).
//!
//! The VM itself belongs to its [`lifecycle::Lifecycle`]; this file is the
//! container registry and the [`Sandbox`] calls, which reach the guest
//! through the handle the lifecycle's phase holds.
//!
//! A CRI pod is one VM holding all of the pod's containers ([`pod`]); any
//! other container gets a VM of its own. A pod's VM grows its vCPUs and
//! memory as its containers' limits ask ([`grow`]); any other VM keeps
//! the size it booted with, and Update changes only the container's
//! cgroup in the guest.

pub mod agent;
mod browse;
pub mod checkpoint;
mod copy;
pub mod disk_budget;
pub mod egress;
pub mod egress_dns;
pub mod grow;
pub mod hibernate;
pub mod hostfiles;
pub mod intake;
pub mod jail;
pub mod launch;
pub mod layer_cache;
pub mod layered;
pub mod lifecycle;
pub mod named;
pub mod net;
pub mod netcheck;
pub mod netns;
pub mod pod;
pub mod pod_checkpoint;
pub mod rootfs;
pub mod signing;
pub mod snapshot;
pub mod sparse;
#[cfg(test)]
mod fuzz_tests;
pub mod template;
pub mod template_build;
pub mod tools;
pub mod vmm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use burrow_protocol::agent as pb;

use crate::config::Config;
use crate::sandbox::*;
use crate::spec;

use self::agent::Agent;
use self::checkpoint::Contents;
use self::launch::VmmLauncher;
use self::lifecycle::{Gone, Lifecycle, Phase};
use self::rootfs::GuestRootfs;
use self::vmm::{DiskArg, VmmArgs, VmmLaunch};

/// The guest device the first disk appears as.
pub const GUEST_ROOT_DEVICE: &str = "/dev/vda";
/// The kernel command line's pointer to the browser image, the guest's
/// disk number `index` (disks come first, then block slots): the second
/// disk after a cold boot's rootfs, the first in a template (whose rootfs
/// goes into a slot).
fn browser_cmdline(index: usize) -> String {
    let letter = u8::try_from(index)
        .ok()
        .filter(|i| *i < 26)
        .map_or('b', |i| char::from(b'a' + i));
    format!(" burrow.browser=/dev/vd{letter}")
}

/// A VM-backed sandbox.
pub struct VmSandbox {
    cfg: Result<Config>,
    dir: PathBuf,
    /// Where its containers' rootfs images go ([`disk_budget`]).
    images: PathBuf,
    /// Its disk limit in MiB (0: none): the config's, lowered by the
    /// annotation of the container that made the VM.
    disk_limit_mib: std::sync::atomic::AtomicU64,
    /// The VM: the only owner of its phase.
    vm: Lifecycle,
    /// The VM's NIC when the spec names a network namespace.
    net: tokio::sync::Mutex<Option<net::SandboxNet>>,
    /// What each container runs on and is known by in the guest.
    containers: std::sync::Mutex<HashMap<String, Contents>>,
    /// A pod's block slots and the containers in them.
    slots: pod::Slots,
    /// A pod's vCPUs and what its members ask for ([`grow`]).
    growth: grow::Growth,
    /// A restored pod's members that no container has taken over yet.
    restored_members: std::sync::Mutex<Vec<pod_checkpoint::Waiting>>,
    /// Held while a pod member's shared image layer is made ([`layered`]).
    layering: tokio::sync::Mutex<()>,
    /// Last exec, stdio traffic or RPC (for hibernate-on-idle).
    last_activity: std::sync::Mutex<Instant>,
    /// Work in flight that keeps it from hibernating on idle: exec'd
    /// processes still running, tool calls not yet answered ([`hibernate::Busy`]).
    busy: std::sync::atomic::AtomicUsize,
    /// The uid its VMMs run as, leased at the first launch and kept (wake
    /// and restore reuse it) until the sandbox goes.
    vmm_uid: std::sync::Mutex<Option<jail::UidLease>>,
    /// Itself, for the tasks it spawns (idle timer, control socket).
    me: Weak<VmSandbox>,
}

/// What the agent mounts as container `c`'s root: the guest's `source`,
/// read-only when its disk is. A spec's `root.readonly` is the agent's to
/// apply once the spec's mounts are in (as runc does): their mount points
/// may have to be made first (CRI's pause has a read-only root and gets
/// /etc/resolv.conf bind-mounted onto an image that lacks it).
/// A layered rootfs ([`layered`]) is its shared image's slot overlaid with
/// `source` as the upper layer.
fn guest_rootfs(_c: &ContainerConfig, rootfs: &GuestRootfs, source: String) -> pb::Rootfs {
    if let Some(lower) = &rootfs.lower {
        return pb::Rootfs {
            source: pod::guest_source(lower.slot),
            fstype: "ext4".into(),
            writable_overlay: true,
            upper: source,
            ..Default::default()
        };
    }
    pb::Rootfs {
        source,
        fstype: rootfs.fstype.clone(),
        options: if rootfs.read_only {
            vec!["ro".into()]
        } else if rootfs.fstype == "ext4" {
            // Made with lazily initialised inode tables (mkfs.ext4's
            // default for a file): no guest thread zeroes them in the
            // background, writing through the VMM while the container starts.
            vec!["noinit_itable".into()]
        } else {
            vec![]
        },
        writable_overlay: false,
        ..Default::default()
    }
}

/// The state directory of a sandbox.
pub fn state_dir(root: &Path, namespace: &str, sandbox_id: &str) -> PathBuf {
    root.join(namespace).join(sandbox_id)
}

/// Remove what a sandbox left in `dir`: kill its VMM (if the pid file names
/// a live burrow-vmm) and delete the directory. Used by `delete` after a
/// crash and by shutdown.
pub fn cleanup_state(dir: &Path) {
    if let Ok(text) = std::fs::read_to_string(dir.join("vmm.pid")) {
        if let Ok(pid) = text.trim().parse::<i32>() {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let is_vmm = cmdline
                .split(|b| *b == 0)
                .next()
                .is_some_and(|argv0| argv0.ends_with(b"burrow-vmm"));
            if pid > 1 && is_vmm {
                // SAFETY: plain kill(2).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                for _ in 0..100 {
                    if !Path::new(&format!("/proc/{pid}")).exists() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }
    jail::remove_cgroup(dir);
    if let Err(e) = std::fs::remove_dir_all(dir) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", dir.display());
        }
    }
    // Drop the namespace directory too once it is empty.
    if let Some(parent) = dir.parent() {
        let _ = std::fs::remove_dir(parent);
    }
}

impl VmSandbox {
    pub fn new(
        cfg: std::result::Result<Config, String>,
        namespace: &str,
        sandbox_id: &str,
    ) -> Arc<Self> {
        let cfg = cfg.map_err(|e| SandboxError::FailedPrecondition(format!("burrow config: {e}")));
        let root = cfg
            .as_ref()
            .map_or_else(|_| PathBuf::from("/run/burrow"), |c| c.state_dir.clone());
        let snapshots = cfg.as_ref().map_or_else(
            |_| PathBuf::from("/var/lib/burrow/snapshots"),
            |c| c.snapshot_dir.clone(),
        );
        let (boot, agent) = cfg.as_ref().map_or((1, 1), |c| {
            (c.boot_timeout_secs.max(1), c.agent_timeout_secs.max(1))
        });
        let dir = state_dir(&root, namespace, sandbox_id);
        let (image_dir, disk_limit) = cfg.as_ref().map_or_else(
            |_| (PathBuf::from("/var/lib/burrow/images"), 0),
            |c| (c.image_dir.clone(), c.sandbox_disk_limit_mib),
        );
        let launcher = VmmLauncher {
            dir: dir.clone(),
            boot_timeout: Duration::from_secs(boot),
            agent_timeout: Duration::from_secs(agent),
            last: std::sync::Mutex::new(None),
        };
        Arc::new_cyclic(|me| Self {
            cfg,
            dir,
            images: disk_budget::sandbox_images(&image_dir, namespace, sandbox_id),
            disk_limit_mib: disk_limit.into(),
            vm: Lifecycle::new(
                Box::new(launcher),
                state_dir(&snapshots, namespace, sandbox_id),
            ),
            net: tokio::sync::Mutex::new(None),
            containers: std::sync::Mutex::new(HashMap::new()),
            slots: pod::Slots::default(),
            growth: grow::Growth::default(),
            layering: tokio::sync::Mutex::new(()),
            restored_members: std::sync::Mutex::new(Vec::new()),
            last_activity: std::sync::Mutex::new(Instant::now()),
            busy: std::sync::atomic::AtomicUsize::new(0),
            vmm_uid: std::sync::Mutex::new(None),
            me: me.clone(),
        })
    }

    fn cfg(&self) -> Result<&Config> {
        self.cfg
            .as_ref()
            .map_err(|e| SandboxError::FailedPrecondition(e.to_string()))
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Where container `id`'s rootfs image goes.
    fn image_path(&self, id: &str) -> PathBuf {
        self.images.join(disk_budget::image_name(id))
    }

    /// Take the disk limit from the spec of the container that makes the
    /// sandbox's VM (a pod's members share their sandbox's).
    fn set_disk_limit(&self, cfg: &Config, spec: &serde_json::Value) -> Result<()> {
        let mib = disk_budget::limit_mib(cfg.sandbox_disk_limit_mib, spec)?;
        self.disk_limit_mib
            .store(mib, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Refuse `what` when the `adding` bytes it may write would take the
    /// sandbox over its disk limit ([`disk_budget`]).
    fn check_disk(&self, what: &str, adding: u64) -> Result<()> {
        let limit = self
            .disk_limit_mib
            .load(std::sync::atomic::Ordering::Relaxed);
        if limit == 0 {
            return Ok(());
        }
        let used = disk_budget::Usage::of(&self.images, self.vm.hibernate_dir());
        disk_budget::check(limit, used, adding, what)
    }

    /// The registry, locked.
    fn registry(&self) -> std::sync::MutexGuard<'_, HashMap<String, Contents>> {
        self.containers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A container the VM runs, for a hibernation's manifest (which
    /// describes the VM; its disks stay where they are): the first id, so
    /// that a pod's is the same each time.
    fn a_container(&self) -> Result<Contents> {
        let r = self.registry();
        r.iter()
            .min_by(|a, b| a.0.cmp(b.0))
            .map(|(_, c)| c.clone())
            .ok_or_else(|| SandboxError::FailedPrecondition("the sandbox has no container".into()))
    }

    /// The id the guest's agent knows container `id` by.
    fn gid(&self, id: &str) -> String {
        self.registry()
            .get(id)
            .map_or_else(|| id.to_string(), |c| c.guest_id.clone())
    }

    /// The agent, waking the VM first if it is hibernated (and waiting
    /// while it boots or is snapshotted).
    async fn awake_agent(&self) -> Result<Agent> {
        self.touch();
        Ok(self.vm.awake().await?.agent.clone())
    }

    /// Refuse (saying `why`) when this sandbox has a VM or a container
    /// already: only a CRI pod's containers share a VM.
    fn require_no_container(&self, why: &str) -> Result<()> {
        let no_vm = matches!(self.vm.phase(), Phase::Empty | Phase::Gone(_));
        if no_vm && self.registry().is_empty() {
            Ok(())
        } else {
            Err(SandboxError::Unimplemented(format!(
                "this burrow VM has its container already: {why}"
            )))
        }
    }

    /// The uid this sandbox's VMMs run as: leased on first use.
    fn vmm_uid(&self, cfg: &Config) -> Result<u32> {
        if !cfg.vmm_jail {
            return Ok(cfg.vmm_uid);
        }
        let mut lease = self
            .vmm_uid
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(l) = lease.as_ref() {
            return Ok(l.uid);
        }
        let key = self.dir.display().to_string();
        let l = jail::lease_uid(cfg, &cfg.state_dir, &key)?;
        let uid = l.uid;
        *lease = Some(l);
        Ok(uid)
    }

    /// How to start burrow-vmm for a VM of `vcpus` and `memory_mib` on
    /// `disk` (none for a template's VM), restoring `restore` or booting
    /// the configured kernel.
    fn vmm_args(
        &self,
        cfg: &Config,
        disk: Option<(PathBuf, bool)>,
        (vcpus, memory_mib): (u32, u64),
        restore: Option<PathBuf>,
        spec: &serde_json::Value,
    ) -> Result<VmmLaunch> {
        let start = match restore {
            Some(dir) => VmmArgs::restore(dir),
            None => VmmArgs {
                initrd: cfg.initrd.clone(),
                cmdline: cfg.kernel_cmdline.clone(),
                vcpus: u8::try_from(vcpus).map_err(|_| {
                    SandboxError::InvalidArgument(format!(
                        "{vcpus} vCPUs is more than burrow-vmm takes"
                    ))
                })?,
                mem_mib: memory_mib,
                ..VmmArgs::boot(cfg.kernel.clone())
            },
        };
        let mut disks: Vec<DiskArg> = disk
            .map(|(path, read_only)| DiskArg { path, read_only })
            .into_iter()
            .collect();
        let mut start = start;
        if let Some(image) = self.browser_image(cfg, spec)? {
            start.cmdline.push_str(&browser_cmdline(disks.len()));
            disks.push(DiskArg {
                path: image,
                read_only: true,
            });
        }
        Ok(VmmLaunch {
            binary: cfg.vmm_binary(),
            args: VmmArgs {
                disks,
                vsock: Some(self.path("vsock.sock")),
                api: Some(self.path("api.sock")),
                serial_log: Some(self.path("console.log")),
                exit_with_parent: true,
                jail: jail::args(cfg, spec, &self.dir, self.vmm_uid(cfg)?)?,
                ..start
            },
            vcpus,
            memory_mib,
            memory_max_mib: None,
        })
    }

    /// Run `create` (which registers container `c` and starts the VM);
    /// when it fails, drop what it left (all of the state directory if no
    /// VM runs).
    async fn creating(
        &self,
        c: &ContainerConfig,
        create: impl std::future::Future<Output = Result<u32>>,
    ) -> Result<u32> {
        let r = create.await;
        if r.is_ok() {
            self.started(&c.spec);
        } else {
            self.drop_container_files(&c.id);
            if matches!(self.vm.phase(), Phase::Empty | Phase::Gone(_)) {
                self.drop_network().await;
                cleanup_state(&self.dir);
                disk_budget::remove_sandbox_images(&self.images);
            }
        }
        r
    }

    /// The spec the guest gets for container `c`, and its JSON (bounded).
    fn guest_spec(&self, c: &ContainerConfig) -> Result<(serde_json::Value, Vec<u8>)> {
        let (mut guest_spec, stripped) = spec::for_guest(&c.spec);
        let carried = hostfiles::carry(&c.spec, &mut guest_spec);
        if !carried.is_empty() {
            tracing::info!("{}: carried into the guest: {}", c.id, carried.join(", "));
        }
        if !stripped.items.is_empty() {
            tracing::info!(
                "{}: not forwarded to the guest: {}",
                c.id,
                stripped.items.join(", ")
            );
        }
        let spec_json = serde_json::to_vec(&guest_spec)
            .map_err(|e| SandboxError::InvalidArgument(format!("encoding the spec: {e}")))?;
        if spec_json.len() > burrow_protocol::MAX_SPEC_BYTES {
            return Err(SandboxError::InvalidArgument(
                "the OCI spec is too large".into(),
            ));
        }
        Ok((guest_spec, spec_json))
    }

    /// Build container `c`'s root filesystem image and register it, with
    /// the spec the guest gets.
    async fn prepare_rootfs(
        &self,
        cfg: &Config,
        c: &ContainerConfig,
        guest_spec: serde_json::Value,
    ) -> Result<GuestRootfs> {
        let image = self.image_path(&c.id);
        let what = format!("the rootfs image of container {}", c.id);
        let budget = |size| {
            self.check_disk(&what, size)?;
            disk_budget::make_private_dir(&self.images)
        };
        let cache = layer_cache::LayerCache::new(&cfg.layer_cache_dir, cfg.layer_cache_images);
        let rootfs = rootfs::prepare(c, &image, cfg.rootfs_slack_mib, &cache, budget).await?;
        self.registry().insert(
            c.id.clone(),
            Contents {
                rootfs: rootfs.clone(),
                guest_id: c.id.clone(),
                spec: guest_spec,
            },
        );
        Ok(rootfs)
    }

    /// Boot the VM for container `c` on its rootfs, with `slots` empty
    /// block slots (a pod's further containers).
    /// The state directory, shared with the jailed VMM; fails early when
    /// there is no guest kernel to boot.
    fn prepare_state_dir(&self, cfg: &Config) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", self.dir.display())))?;
        jail::share_state_dir(cfg, &self.dir)?;
        if !cfg.kernel.is_file() {
            return Err(SandboxError::FailedPrecondition(format!(
                "guest kernel {} is missing: run `burrow install` or set `kernel` in {}",
                cfg.kernel.display(),
                crate::config::DEFAULT_PATH
            )));
        }
        Ok(())
    }

    async fn create_inner(&self, cfg: &Config, c: &ContainerConfig, slots: u32) -> Result<u32> {
        self.prepare_state_dir(cfg)?;
        let (guest_spec, spec_json) = self.guest_spec(c)?;
        let started = Instant::now();
        let rootfs = self.prepare_rootfs(cfg, c, guest_spec).await?;
        let rootfs_ms = started.elapsed().as_millis();
        let guest_rootfs = guest_rootfs(c, &rootfs, GUEST_ROOT_DEVICE.into());
        let size = spec::vm_size(&c.spec, cfg);
        let mut args = self.vmm_args(
            cfg,
            Some((rootfs.disk.clone(), rootfs.read_only)),
            (size.vcpus, size.memory_mib),
            None,
            &c.spec,
        )?;
        args.args.disk_slots = slots;
        let max_vcpus = grow::max_vcpus_for(cfg, &c.spec, size.vcpus);
        args.args.max_vcpus = grow::vmm_max(size.vcpus, max_vcpus);
        // The VM's vCPUs, running or not: what a snapshot of it holds.
        args.vcpus = max_vcpus;
        let memory_max = grow::memory_max_for(cfg, &c.spec, size.memory_mib);
        args.args.mem_max_mib = grow::vmm_mem_max(size.memory_mib, memory_max);
        args.memory_max_mib = args.args.mem_max_mib;
        self.growth.set_memory(grow::memory_record_for(
            cfg,
            &c.spec,
            size.memory_mib,
            args.args.mem_max_mib,
        ));
        self.growth.set(grow::record_for(&c.spec, size.vcpus, max_vcpus));
        self.slots.reset(slots, pod::layer_slots(cfg, &c.spec), pod::role(&c.spec) == pod::Role::Sandbox);
        let args = self.with_network(&c.spec, args, true).await?;
        tracing::info!(
            "booting VM: {} vCPUs, {} MiB, {}",
            size.vcpus,
            size.memory_mib,
            args.describe()
        );
        let booting = Instant::now();
        let host = template::hostname(&self.sandbox_id());
        let generation = self.vm_generation();
        let (pid, guest_ms) = self
            .vm
            .start(args, |agent| async move {
                let t = Instant::now();
                template::identity(&agent, &host, generation).await?;
                let pid = agent
                    .create_container(&c.id, &spec_json, guest_rootfs, c.stdin)
                    .await?;
                Ok((pid, t.elapsed().as_millis()))
            })
            .await?;
        self.record_phases(
            &c.id,
            &format!(
                "created in {} ms: root filesystem {} ms, VM to agent ready {} ms, identity and container in the guest {} ms",
                started.elapsed().as_millis(),
                rootfs_ms,
                booting.elapsed().as_millis().saturating_sub(guest_ms),
                guest_ms
            ),
        );
        Ok(self.task_pid(pid).await)
    }

    async fn restore_inner(&self, cfg: &Config, c: &ContainerConfig, dir: &Path) -> Result<u32> {
        let (manifest, manifest_bytes) = snapshot::read_manifest_bytes(dir)?;
        Self::check_restore_role(c, &manifest)?;
        // One the shim wrote under its snapshot dir (named), else containerd's.
        let origin = if dir.starts_with(&cfg.snapshot_dir) {
            intake::Origin::Named
        } else {
            intake::Origin::Containerd
        };
        let started = Instant::now();
        let files = intake::take(dir, &manifest, cfg, origin)?;
        // Structure and sizes first (their errors are the more specific),
        // then whether this host wrote it as it is.
        let state = files.verify_signature(
            dir,
            &signing::host_key(&cfg.checkpoint_key)?,
            &manifest_bytes,
        )?;
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| SandboxError::Internal(format!("creating {}: {e}", self.dir.display())))?;
        jail::share_state_dir(cfg, &self.dir)?;
        // The checkpoint's disk becomes the container's own image.
        let disk_size = if manifest.packed {
            sparse::packed_size(&files.disk.path()).map_err(|e| {
                SandboxError::InvalidArgument(format!(
                    "{} is not a usable burrow checkpoint: {e}",
                    dir.display()
                ))
            })?
        } else {
            files.disk.size()
        };
        // A pod's members' disks are copied too.
        let disk_size = files
            .slots
            .iter()
            .map(|(_, f)| f.size())
            .fold(disk_size, u64::saturating_add);
        // A packed checkpoint's memory is unpacked beside the images until
        // the VM runs, unless it is mapped in place (page-aligned).
        let in_place = checkpoint::maps_in_place(&manifest, &files)?;
        let unpacking = if manifest.packed && !in_place {
            manifest.memory_mib << 20
        } else {
            0
        };
        self.check_disk(
            &format!("the rootfs image of container {} (restored)", c.id),
            disk_size.saturating_add(unpacking),
        )?;
        disk_budget::make_private_dir(&self.images)?;
        let img = self.image_path(&c.id);
        drop(disk_budget::create_image(&img)?);
        self.registry().insert(
            c.id.clone(),
            Contents {
                rootfs: GuestRootfs {
                    disk: img.clone(),
                    read_only: manifest.rootfs_read_only,
                    fstype: manifest.rootfs_fstype.clone(),
                    image: Some(img.clone()),
                    lower: None,
                },
                guest_id: manifest.container_id.clone(),
                spec: manifest.spec.clone(),
            },
        );
        // On disk with the images, not in the state directory: that is on
        // /run, a tmpfs, where the memory file would stay in RAM for as
        // long as the VMM maps it (unlinked, privately), beside the VM's
        // own copy of every page the guest writes.
        let unpacked = self.images.join("restore-vm");
        let prepared =
            match checkpoint::prepare_restore(dir, &manifest, (&files, in_place), &state, &img, &unpacked)
                .await
            {
                Ok(d) => d,
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&unpacked);
                    return Err(e);
                }
            };
        // A pod's: its members' disks back in their slots (and the
        // sandbox's, when a template put it in one); a template-born VM's
        // one container's disk goes back into its slot too.
        let in_slots = match &manifest.pod {
            Some(pod) => {
                let memory = (manifest.memory_mib, manifest.memory_max_mib);
                let restored = async {
                    self.restore_growth(cfg, pod, manifest.vcpus, memory)?;
                    self.restore_pod_disks((pod, manifest.rootfs_slot), &files, (&c.id, &img))
                        .await
                };
                match restored.await {
                    Ok(d) => d,
                    Err(e) => {
                        self.forget_waiting();
                        let _ = std::fs::remove_dir_all(&unpacked);
                        return Err(e);
                    }
                }
            }
            None if manifest.rootfs_slot.is_some() => vec![img.clone()],
            None => Vec::new(),
        };
        // Given paths replace the VM's disks (its rootfs when not in a
        // slot, then the browser's image), then its filled slots' in slot
        // order.
        let boot_disk = match manifest.rootfs_slot {
            Some(_) => None,
            None => Some((img, manifest.rootfs_read_only)),
        };
        let disk_ms = started.elapsed().as_millis();
        let mut args = self.vmm_args(
            cfg,
            boot_disk,
            (manifest.vcpus, manifest.memory_mib),
            Some(prepared.vm_dir),
            &c.spec,
        )?;
        args.args.disks.extend(in_slots.into_iter().map(|path| vmm::DiskArg {
            path,
            read_only: false,
        }));
        // Held open here until the VM runs; the VMM inherits its own copy.
        let packed_memory = prepared.packed_memory;
        args.args.packed_memory_fd = packed_memory
            .as_ref()
            .map(std::os::fd::AsRawFd::as_raw_fd);
        let args_mapped = args.args.packed_memory_fd.is_some();
        let mut args = self.with_network(&c.spec, args, false).await?;
        // The VMM checks the state file itself before it opens anything the
        // state names: no base snapshot, slot file or tap by name, and the
        // size the manifest says (checked against the config above).
        args.args.self_contained = true;
        args.args.expect_vcpus = u8::try_from(manifest.vcpus).ok();
        args.args.expect_mem_mib = Some(manifest.memory_mib);
        args.args.expect_mem_max_mib = manifest.memory_max_mib;
        args.memory_max_mib = manifest.memory_max_mib;
        tracing::info!(
            "{}: restoring container {} from {}: {}",
            c.id,
            manifest.container_id,
            dir.display(),
            args.describe()
        );
        let guest_id = &manifest.container_id;
        let host = template::hostname(&self.sandbox_id());
        let generation = self.vm_generation();
        let r = self
            .vm
            .start(args, |agent| async move {
                // Every copy of one checkpoint (a fork) is its own guest,
                // with the address of the namespace it is restored into
                // (the same one again, or another: then the old address
                // goes).
                template::restored_identity(&agent, &host, generation).await?;
                self.configure_restored_network(&agent).await?;
                agent.restored_init(guest_id).await
            })
            .await;
        drop(packed_memory);
        if manifest.packed {
            let _ = std::fs::remove_dir_all(&unpacked);
        }
        if r.is_ok() {
            self.record_phases(
                &c.id,
                &format!(
                    "restored from a checkpoint in {} ms: disk and memory files {disk_ms} ms{}, VM to agent ready and identity {} ms",
                    started.elapsed().as_millis(),
                    if args_mapped { " (memory mapped in place)" } else { "" },
                    started.elapsed().as_millis().saturating_sub(disk_ms)
                ),
            );
        }
        Ok(self.task_pid(r?).await)
    }

    /// Write a checkpoint into `dir` (packed for containerd, or plain), then
    /// do what `after` says.
    pub(super) async fn checkpoint_to(
        &self,
        dir: &Path,
        after: AfterCheckpoint,
        packed: bool,
    ) -> Result<()> {
        let r = async {
            let carried = self.checkpointed(packed)?;
            let key = signing::host_key(&self.cfg()?.checkpoint_key)?;
            // What it writes at most: the memory (and its pack), the disk.
            let memory = self.vm.awake().await?.memory_mib << 20;
            let memory = if packed {
                memory.saturating_mul(2)
            } else {
                memory
            };
            let disk = carried
                .pod
                .iter()
                .flat_map(|p| p.disks.iter())
                .map(|(_, d)| disk_budget::allocated(d))
                .fold(
                    disk_budget::allocated(&carried.container.rootfs.disk),
                    u64::saturating_add,
                );
            self.check_disk("a checkpoint", memory.saturating_add(disk))?;
            self.vm
                .checkpoint(&snapshot::vm_dir(dir), after, |info| {
                    checkpoint::complete(dir, &carried, info, packed, &key)
                })
                .await
        }
        .await;
        if r.is_err() {
            checkpoint::remove_partial(dir);
        }
        r
    }

    /// Whether `id` is the VM's only container, outside a pod, with a
    /// writable root filesystem this shim made (so removes at its delete).
    fn is_last_on_its_own_disk(&self, id: &str) -> bool {
        if self.slots.is_pod() {
            return false;
        }
        let r = self.registry();
        r.len() == 1 && r.get(id).is_some_and(|c| c.rootfs.image.is_some())
    }

    fn drop_container_files(&self, id: &str) {
        let res = self.registry().remove(id);
        if let Some(img) = res.and_then(|r| r.rootfs.image) {
            let _ = std::fs::remove_file(img);
            disk_budget::remove_if_empty(&self.images);
        }
    }
}

#[async_trait]
impl Sandbox for VmSandbox {
    async fn create_container(&self, c: &ContainerConfig) -> Result<u32> {
        let cfg = self.cfg()?.clone();
        let slots = match pod::role(&c.spec) {
            pod::Role::Member => return self.create_in_pod(&cfg, c).await,
            pod::Role::Sandbox => cfg.pod_disk_slots.saturating_add(cfg.pod_layer_slots),
            pod::Role::Alone => 0,
        };
        self.require_no_container("a container outside a CRI pod has its VM to itself")?;
        self.set_disk_limit(&cfg, &c.spec)?;
        if template::wanted(&cfg, c) {
            return self
                .creating(c, self.create_from_template(&cfg, c, slots))
                .await;
        }
        self.creating(c, self.create_inner(&cfg, c, slots)).await
    }

    async fn restore_container(&self, c: &ContainerConfig, dir: &Path) -> Result<u32> {
        let cfg = self.cfg()?.clone();
        self.require_no_container("cannot restore into a sandbox that has one")?;
        self.set_disk_limit(&cfg, &c.spec)?;
        self.creating(c, self.restore_inner(&cfg, c, dir)).await
    }

    fn named_checkpoint(&self, name: &str) -> Result<PathBuf> {
        self.named_checkpoint_dir(name)
    }

    async fn take_over_restored(&self, c: &ContainerConfig) -> Result<Option<u32>> {
        self.take_over_waiting(c).await
    }

    async fn checkpoint(&self, dir: &Path, after: AfterCheckpoint) -> Result<()> {
        // containerd tars it without holes: pack the sparse files.
        self.checkpoint_to(dir, after, true).await
    }

    async fn start_container(&self, id: &str) -> Result<()> {
        let agent = self.awake_agent().await?;
        self.wire_network(&agent).await?;
        agent.start_container(&self.gid(id)).await
    }

    async fn delete_container(&self, id: &str) -> Result<()> {
        // The VM's only container, on a disk this shim made and removes
        // with it: nothing of the guest's cleanup (its unmount, the slot's
        // detach) outlives the VM, which stops now. A pod, or a root
        // filesystem that stays (a snapshotter's block device), is cleaned
        // up in the guest first so that what it wrote reaches the disk.
        if self.is_last_on_its_own_disk(id) {
            let _ = self.slots.release(id);
            self.drop_container_files(id);
            self.vm.stop(Gone::Stopped).await;
            return Ok(());
        }
        // A pod member with a disk in a hibernated VM: the VM's snapshot
        // holds that slot and would not wake without the file, which goes
        // below, so wake it now to take the disk out. Any other asleep VM
        // is not woken for this: it is stopped below.
        if matches!(self.vm.phase(), Phase::Asleep(_))
            && self.slots.of(id).is_some()
            && self.registry().len() > 1
        {
            if let Err(e) = self.vm.awake().await {
                tracing::warn!("{id}: waking the pod's VM to take its disk out: {e}");
            }
        }
        if let Some(h) = self.vm.phase().handle() {
            match h.agent.delete_container(&self.gid(id)).await {
                Ok(()) | Err(SandboxError::NotFound(_)) | Err(SandboxError::Unavailable(_)) => {}
                Err(e) => tracing::warn!("{id}: agent DeleteContainer: {e}"),
            }
        }
        self.release_slot(id).await;
        self.drop_container_files(id);
        // The last container (a pod's sandbox goes last): the VM goes with it.
        if self.registry().is_empty() {
            self.vm.stop(Gone::Stopped).await;
        }
        Ok(())
    }

    async fn exec_process(&self, id: &str, exec_id: &str, cfg: &ExecConfig) -> Result<u32> {
        let json = serde_json::to_vec(&cfg.process)
            .map_err(|e| SandboxError::InvalidArgument(format!("encoding the process: {e}")))?;
        self.awake_agent()
            .await?
            .exec(&self.gid(id), exec_id, &json, cfg.stdin)
            .await
    }

    async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()> {
        self.awake_agent()
            .await?
            .delete_process(&self.gid(id), exec_id)
            .await
    }

    async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        // SIGKILL of the only container's init: the VM is its whole world,
        // so a VM that cannot take the call is killed instead (and an
        // asleep one is not woken only to be killed).
        let ends_vm = signal == libc::SIGKILL as u32
            && exec_id.is_empty()
            && self.registry().len() == 1
            && !self.slots.is_pod();
        if ends_vm && matches!(self.vm.phase(), Phase::Asleep(_)) {
            self.vm.kill(Gone::Killed).await;
            return Ok(());
        }
        let r = async {
            self.awake_agent()
                .await?
                .signal(&self.gid(id), exec_id, signal, all)
                .await
        }
        .await;
        match r {
            Err(SandboxError::Timeout(why)) | Err(SandboxError::Unavailable(why)) if ends_vm => {
                tracing::warn!("{id}: the agent did not take SIGKILL ({why}); killing the VM");
                self.vm.kill(Gone::Killed).await;
                Ok(())
            }
            r => r,
        }
    }

    async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus> {
        // An exec'd process that runs keeps the sandbox from hibernating
        // on idle, however long it stays silent (a build, a test run):
        // asleep, it would stop until something woke the VM. The
        // container's own init does not (it always runs).
        let _busy = (!exec_id.is_empty()).then(|| self.busy());
        let gid = &self.gid(id);
        let r = self
            .vm
            .across_sleep(
                || format!("{id}/{exec_id}: wait"),
                |agent| async move { agent.wait(gid, exec_id).await },
            )
            .await;
        match r {
            // Reported like runc's: killed (137), not lost (255).
            Err(_) if matches!(self.vm.phase(), Phase::Gone(Gone::Checkpointed | Gone::Killed)) => {
                Ok(ExitStatus::Signal(9))
            }
            r => r,
        }
    }

    async fn read_output(&self, id: &str, exec_id: &str, stream: Stream) -> Result<Chunk> {
        let gid = &self.gid(id);
        let chunk = self
            .vm
            .across_sleep(
                || format!("{id}/{exec_id}: read"),
                |agent| async move { agent.read(gid, exec_id, stream, OUTPUT_CHUNK).await },
            )
            .await?;
        if !chunk.data.is_empty() {
            self.touch();
        }
        Ok(chunk)
    }

    async fn wait_oom(&self, id: &str, seen: u64) -> Result<u64> {
        let gid = self.gid(id);
        self.vm
            .across_sleep(
                || format!("{id}: OOM watch"),
                |agent| {
                    let gid = gid.clone();
                    async move { agent.wait_oom_kill(&gid, seen).await }
                },
            )
            .await
    }

    async fn oom_kills(&self, id: &str) -> Result<u64> {
        Ok(self
            .awake_agent()
            .await?
            .stats(&self.gid(id))
            .await?
            .oom_kills)
    }

    async fn update_resources(&self, id: &str, resources: &[u8]) -> Result<()> {
        // A pod member's larger CPU limit may need more vCPUs first.
        if self.slots.of(id).is_some() {
            let parsed: Option<serde_json::Value> = serde_json::from_slice(resources).ok();
            let cpu = parsed.as_ref().and_then(|r| r.get("cpu"));
            if cpu.and_then(|c| c.get("quota")).is_some() {
                if let Err(e) = self.grow_for(id, cpu).await {
                    tracing::warn!("{id}: the pod's VM did not grow: {e}");
                }
            }
            let memory = parsed.as_ref().and_then(|r| r.get("memory"));
            if grow::memory_mib(memory).is_some() {
                self.grow_memory_for(id, memory).await?;
            }
        }
        self.awake_agent()
            .await?
            .update_container(&self.gid(id), resources)
            .await
    }

    async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize> {
        self.awake_agent()
            .await?
            .write_stdin(&self.gid(id), exec_id, data)
            .await
    }

    async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.awake_agent()
            .await?
            .close_stdin(&self.gid(id), exec_id)
            .await
    }

    async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        self.awake_agent()
            .await?
            .resize_pty(&self.gid(id), exec_id, rows, cols)
            .await
    }

    async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>> {
        self.awake_agent().await?.processes(&self.gid(id)).await
    }

    async fn pause(&self) -> Result<()> {
        self.vm.pause().await
    }

    async fn resume(&self) -> Result<()> {
        self.vm.resume().await?;
        self.touch();
        Ok(())
    }

    async fn stats(&self, id: &str) -> Result<SandboxStats> {
        // Neither wakes the VM nor counts as activity: polling stats must
        // not keep a sandbox from hibernating when idle.
        match self.vm.settled().await? {
            // Hibernated: no guest runs to count anything.
            Phase::Asleep(_) => Ok(SandboxStats::default()),
            Phase::Paused(_) => Err(SandboxError::FailedPrecondition(
                "the VM is paused: its guest reports its resource use once resumed".into(),
            )),
            phase => {
                let h = phase.handle().ok_or_else(|| {
                    SandboxError::FailedPrecondition("the VM is not running".into())
                })?;
                h.agent.stats(&self.gid(id)).await
            }
        }
    }

    async fn shutdown(&self) -> Result<()> {
        let ids: Vec<String> = self.registry().keys().cloned().collect();
        for id in ids {
            self.drop_container_files(&id);
        }
        self.vm.stop(Gone::Stopped).await;
        self.drop_network().await;
        cleanup_state(&self.dir);
        disk_budget::remove_sandbox_images(&self.images);
        Ok(())
    }
}

#[cfg(test)]
mod browser_disk_tests {
    #[test]
    fn the_browser_image_is_named_by_the_disks_before_it() {
        assert_eq!(super::browser_cmdline(0), " burrow.browser=/dev/vda");
        assert_eq!(super::browser_cmdline(1), " burrow.browser=/dev/vdb");
    }
}
