//! Templates made ahead of their first use (`burrow template build`) and
//! listed (`burrow template ls`), so that no container pays for building
//! one.
//!
//! A build boots the shape's VM exactly as a first create would (the same
//! jail, uid lease, block slots and, for a shape with a NIC, the same kind
//! of namespace, tap and holder the shim makes for `ctr run`), snapshots it
//! with [`VmSandbox::build_template`], publishes it under the same key,
//! and stops the VM. Its state directory is a sandbox's
//! (`<state_dir>/burrow-template/build-<pid>/`) and is removed after.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::lifecycle::Gone;
use super::template::{self, Shape};
use super::{cleanup_state, disk_budget, VmSandbox};
use crate::config::Config;
use crate::sandbox::Result;
use crate::spec;

/// The namespace of a build's state directory.
pub const BUILD_NAMESPACE: &str = "burrow-template";

/// The shape a plain `ctr run` of a container without resource limits
/// gets: the config's default vCPUs and memory, one block slot (its
/// rootfs) and, unless `nic` is false (`ctr run --net-host`), a NIC.
pub fn default_shape(cfg: &Config, nic: bool) -> Shape {
    let size = spec::vm_size(&json!({}), cfg);
    Shape {
        vcpus: size.vcpus,
        max_vcpus: size.vcpus,
        memory_mib: size.memory_mib,
        memory_max_mib: None,
        slots: 1,
        nic,
        browser: false,
    }
}

/// The spec a build boots its VM for: what makes a container of `shape`
/// get the same VM (a namespace for the NIC, the browser's annotation).
fn build_spec(shape: Shape) -> Value {
    let mut spec = json!({});
    if shape.nic {
        spec["linux"] = json!({"namespaces": [{"type": "network"}]});
    }
    if shape.browser {
        spec["annotations"] = json!({ spec::ANNOTATION_BROWSER: "true" });
    }
    spec
}

/// What a build did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Built {
    pub key: String,
    pub dir: PathBuf,
    /// False when the template was published already (nothing was built).
    pub built: bool,
}

/// Build the template of `shape` unless it is published already.
pub async fn build(cfg: Config, shape: Shape) -> Result<Built> {
    let (key, info) = template::key(&cfg, shape)?;
    let dir = cfg.template_dir.join(&key);
    if template::published(&dir).is_some() {
        return Ok(Built {
            key,
            dir,
            built: false,
        });
    }
    let id = format!("build-{}", std::process::id());
    let sandbox = VmSandbox::new(Ok(cfg.clone()), BUILD_NAMESPACE, &id);
    let r = sandbox.build_shape(&cfg, shape, &dir, &key, &info).await;
    sandbox.vm.stop(Gone::Stopped).await;
    sandbox.drop_network().await;
    cleanup_state(&sandbox.dir);
    r.map(|()| Built {
        key,
        dir,
        built: true,
    })
}

/// A published template: its key, what went into it, and the bytes it
/// takes on disk (its memory file is sparse).
#[derive(Debug, Clone)]
pub struct Listed {
    pub key: String,
    pub info: Value,
    pub disk_bytes: u64,
}

/// The published templates under `cfg.template_dir`, by key. Anything
/// else there (a build in progress, a stray file) is left out.
pub fn list(cfg: &Config) -> Vec<Listed> {
    let mut out: Vec<Listed> = std::fs::read_dir(&cfg.template_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let key = e.file_name().to_str()?.to_string();
            let dir = e.path();
            if key.starts_with('.') || template::published(&dir).is_none() {
                return None;
            }
            let info = std::fs::read(dir.join(template::INFO))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
                .unwrap_or(Value::Null);
            Some(Listed {
                key,
                info,
                disk_bytes: disk_budget::allocated(&dir),
            })
        })
        .collect();
    out.sort_by(|a, b| a.key.cmp(&b.key));
    out
}

impl VmSandbox {
    /// Boot an empty VM of `shape` and snapshot it as template `key`.
    async fn build_shape(
        &self,
        cfg: &Config,
        shape: Shape,
        dir: &Path,
        key: &str,
        info: &Value,
    ) -> Result<()> {
        self.prepare_state_dir(cfg)?;
        let spec = build_spec(shape);
        let mut args = self.vmm_args(cfg, None, (shape.vcpus, shape.memory_mib), None, &spec)?;
        args.args.max_vcpus = super::grow::vmm_max(shape.vcpus, shape.max_vcpus);
        args.vcpus = shape.max_vcpus;
        args.args.mem_max_mib = shape.memory_max_mib;
        args.memory_max_mib = shape.memory_max_mib;
        let mut args = self.with_network(&spec, args, false).await?;
        args.args.disk_slots = shape.slots;
        self.slots.reset(shape.slots, 0, false);
        tracing::info!("building template {key}: {}", args.describe());
        self.vm.start(args, |_| async { Ok(()) }).await?;
        self.build_template(cfg, dir, key, info).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_default_shape_is_a_plain_ctr_runs() {
        let cfg = Config::default();
        let s = default_shape(&cfg, true);
        assert_eq!(s.slots, 1);
        assert!(s.nic);
        assert_eq!(s.vcpus, cfg.vcpus.default);
        assert_eq!(s.memory_mib, cfg.memory_mib.default);
        assert!(!default_shape(&cfg, false).nic);
    }

    #[test]
    fn a_built_shape_is_the_one_its_containers_start_from() {
        let cfg = Config::default();
        for nic in [true, false] {
            for browser in [true, false] {
                let shape = Shape {
                    browser,
                    ..default_shape(&cfg, nic)
                };
                let spec = build_spec(shape);
                assert_eq!(template::shape_of(&cfg, &spec, 0), shape, "{spec}");
            }
        }
        // `ctr run` with the browser's annotation: the shape built with
        // --browser (a NIC, one slot, the default size).
        let run = json!({
            "linux": {"namespaces": [{"type": "network"}]},
            "annotations": {"io.burrow.browser": "true"}
        });
        let built = Shape {
            browser: true,
            ..default_shape(&cfg, true)
        };
        assert_eq!(template::shape_of(&cfg, &run, 0), built);
    }

    #[test]
    fn only_published_templates_are_listed() {
        let d = tempfile::tempdir().unwrap();
        let cfg = Config {
            template_dir: d.path().to_path_buf(),
            ..Config::default()
        };
        let full = d.path().join("aaaa-bbbb");
        let vm = super::super::snapshot::vm_dir(&full);
        std::fs::create_dir_all(&vm).unwrap();
        std::fs::write(vm.join(super::super::snapshot::STATE_FILE), b"s").unwrap();
        std::fs::write(vm.join(super::super::snapshot::MEMORY), b"m").unwrap();
        std::fs::write(full.join(template::INFO), br#"{"shape":"x"}"#).unwrap();
        std::fs::create_dir_all(d.path().join(".build-cccc-dddd-1/vm")).unwrap();
        std::fs::create_dir_all(d.path().join("eeee-ffff/vm")).unwrap();
        let l = list(&cfg);
        assert_eq!(l.len(), 1, "{l:?}");
        assert_eq!(l[0].key, "aaaa-bbbb");
        assert_eq!(l[0].info["shape"], "x");
        assert!(l[0].disk_bytes > 0);
    }
}
