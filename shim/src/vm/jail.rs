//! What the shim does for burrow-vmm's jail (`burrow_vmm_api::jail`):
//! the flags it passes, and the state directory the jailed VMM still
//! writes in (its serial log's rotation, its sockets).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use burrow_vmm_api::jail::JailArgs;

use crate::config::Config;
use crate::sandbox::{Result, SandboxError};

/// The jail flags for a VM of the container with OCI spec `spec`: the
/// configured ids, and the spec's OOM score (the VMM is the process the
/// kernel would pick).
pub fn args(cfg: &Config, spec: &serde_json::Value) -> JailArgs {
    let oom_score_adj = spec
        .pointer("/process/oomScoreAdj")
        .and_then(serde_json::Value::as_i64)
        .and_then(|o| i32::try_from(o.clamp(-1000, 1000)).ok());
    JailArgs {
        jail: cfg.vmm_jail,
        jail_uid: cfg.vmm_uid,
        jail_gid: cfg.vmm_gid,
        oom_score_adj,
        ..JailArgs::default()
    }
}

/// Let the jail's group create files in the state directory `dir` (its
/// serial log rotates there) but list nothing and remove only its own
/// files: root-owned, group the jail's gid, mode 01730.
pub fn share_state_dir(cfg: &Config, dir: &Path) -> Result<()> {
    if !cfg.vmm_jail {
        return Ok(());
    }
    let fail = |e: std::io::Error| {
        SandboxError::Internal(format!(
            "preparing {} for the VMM's jail: {e}",
            dir.display()
        ))
    };
    std::os::unix::fs::chown(dir, Some(0), Some(cfg.vmm_gid)).map_err(fail)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o1730)).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_spec_oom_score_goes_to_the_vmm() {
        let cfg = Config::default();
        let a = args(&cfg, &serde_json::json!({"process": {"oomScoreAdj": -998}}));
        assert!(a.jail, "jailed by default");
        assert_eq!(a.oom_score_adj, Some(-998));
        assert_eq!((a.jail_uid, a.jail_gid), (cfg.vmm_uid, cfg.vmm_gid));
        assert!(
            !a.no_seccomp && !a.test_forbidden_syscall,
            "never passed by the shim"
        );
        assert_eq!(args(&cfg, &serde_json::json!({})).oom_score_adj, None);
        let off = Config {
            vmm_jail: false,
            ..Config::default()
        };
        assert!(!args(&off, &serde_json::json!({})).jail);
    }
}
