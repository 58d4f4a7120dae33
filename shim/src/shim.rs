//! The shim binary's protocol with containerd:
//!
//! - `start` (cwd = bundle): pick the grouping (the CRI sandbox id, else the
//!   container id), start the serving shim for it unless one already serves
//!   that socket, write `address` into the bundle and print the address.
//! - `delete` (cwd = bundle): containerd's cleanup after the serving shim
//!   died: unmount the bundle's rootfs, kill the VM a crashed shim left and
//!   remove its state, rootfs images and hibernation snapshot; answer
//!   "killed" (137).
//! - serve: the task service over ttrpc until Shutdown.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::util::write_str_to_file;
use containerd_shim::{api, Config as ShimConfig, Error, Flags, StartOpts};

use crate::config::Config;
use crate::events::RemoteEvents;
use crate::spec;
use crate::task::{now, TaskService};
use crate::vm::{self, VmSandbox};

/// The runtime name containerd knows us by.
pub const RUNTIME: &str = "io.containerd.burrow.v2";

/// Which shim (and VM) a container belongs to: its CRI sandbox, else itself.
pub fn grouping(bundle: &Path, id: &str) -> String {
    spec::read_spec(bundle)
        .ok()
        .and_then(|s| spec::annotation(&s, spec::CRI_SANDBOX_ID).map(str::to_string))
        .filter(|g| crate::task::validate_id("sandbox id", g).is_ok())
        .unwrap_or_else(|| id.to_string())
}

/// The crate's options for a burrow shim: its logger (the `log` FIFO), and
/// no reaper, because the shim's own children (burrow-vmm, mkfs.ext4) are
/// waited for by tokio, which a `waitpid(-1)` loop would rob.
pub fn shim_config() -> ShimConfig {
    ShimConfig {
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    }
}

pub struct BurrowShim {
    exit: Arc<ExitSignal>,
    namespace: String,
    id: String,
}

#[async_trait]
impl Shim for BurrowShim {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut ShimConfig) -> Self {
        Self {
            exit: Arc::new(ExitSignal::default()),
            namespace: args.namespace.clone(),
            id: args.id.clone(),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        crate::task::validate_id("container id", &opts.id)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let group = grouping(Path::new("."), &opts.id);
        let address = spawn(opts, &group, Vec::new()).await?;
        write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> Result<api::DeleteResponse, Error> {
        let bundle = Path::new(".");
        vm::rootfs::unmount(&bundle.join("rootfs"));
        let cfg = Config::load().unwrap_or_else(|e| {
            tracing::warn!("{e}; cleaning up under the default directories");
            Config::default()
        });
        let root = cfg.state_dir.clone();
        // A killed shim's uid lease file (the kernel dropped its lock).
        vm::jail::remove_stale_uid_leases(&root);
        if crate::task::validate_id("container id", &self.id).is_ok()
            && !self.namespace.contains('/')
        {
            let group = grouping(bundle, &self.id);
            let dir = vm::state_dir(&root, &self.namespace, &group);
            let images = vm::disk_budget::sandbox_images(&cfg.image_dir, &self.namespace, &group);
            if group == self.id {
                vm::cleanup_state(&dir);
                // The images and the hibernation snapshot the crashed shim left.
                vm::disk_budget::remove_sandbox_images(&images);
                let snap = vm::state_dir(&cfg.snapshot_dir, &self.namespace, &group);
                let _ = std::fs::remove_dir_all(&snap);
            } else {
                let _ = std::fs::remove_file(images.join(vm::disk_budget::image_name(&self.id)));
                vm::disk_budget::remove_if_empty(&images);
                // Where shims before `image_dir` made it.
                let _ = std::fs::remove_file(dir.join(format!("{}.rootfs.img", self.id)));
            }
        }
        Ok(api::DeleteResponse {
            pid: 0,
            exit_status: 128 + 9,
            exited_at: Some(now()).into(),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        let cfg = Config::load();
        if let Err(e) = &cfg {
            tracing::error!("{e}");
        }
        let drain = cfg.as_ref().map_or(5, |c| c.io_drain_secs);
        let sandbox = VmSandbox::new(cfg.map_err(|e| e.to_string()), &self.namespace, &self.id);
        TaskService::with_io_drain(
            sandbox,
            Arc::new(RemoteEvents::new(publisher, self.namespace.clone())),
            self.exit.clone(),
            std::time::Duration::from_secs(drain),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grouping_uses_the_cri_sandbox() {
        let d = tempfile::tempdir().expect("tempdir");
        assert_eq!(grouping(d.path(), "c1"), "c1");
        let spec = serde_json::json!({"process": {"args": ["sh"]}, "annotations": {spec::CRI_SANDBOX_ID: "pod1"}});
        std::fs::write(d.path().join("config.json"), spec.to_string()).expect("write");
        assert_eq!(grouping(d.path(), "c1"), "pod1");
        let spec = serde_json::json!({"process": {"args": ["sh"]}, "annotations": {spec::CRI_SANDBOX_ID: "../x"}});
        std::fs::write(d.path().join("config.json"), spec.to_string()).expect("write");
        assert_eq!(grouping(d.path(), "c1"), "c1");
    }
}
