//! Named checkpoints: `burrow sandbox checkpoint ID NAME` writes a
//! checkpoint of a running sandbox to `<snapshot_dir>/.checkpoints/<NAME>/`
//! (the layout of [`snapshot`], the sandbox runs on), and a container
//! created with the annotation `io.burrow.restore=NAME` is restored from it
//! instead of starting its process. This is the directory form of a
//! checkpoint that `ctr task checkpoint --image-path` cannot give: containerd
//! 1.6 passes an image path only to runtimes named `io.containerd.runc.*`.
//!
//! Names are plain (`[A-Za-z0-9_.-]`, at most 64 characters, not `.` or
//! `..`), so an annotation cannot point anywhere else on the host. The
//! directory starts with a dot, which no containerd namespace does, so it
//! never meets a hibernation directory (`<snapshot_dir>/<namespace>/`).

use std::path::PathBuf;

use super::VmSandbox;
use crate::sandbox::{AfterCheckpoint, Result, SandboxError};

/// The named checkpoints' directory inside `snapshot_dir`.
pub const NAMED_DIR: &str = ".checkpoints";
/// Longest checkpoint name.
pub const MAX_NAME: usize = 64;

/// Whether `name` may name a checkpoint.
pub fn valid_name(name: &str) -> bool {
    crate::is_plain_name(name, MAX_NAME)
}

impl VmSandbox {
    /// The directory of named checkpoint `name`.
    pub fn named_checkpoint_dir(&self, name: &str) -> Result<PathBuf> {
        if !valid_name(name) {
            return Err(SandboxError::InvalidArgument(format!(
                "invalid checkpoint name {name:?}: want 1..={MAX_NAME} characters of [A-Za-z0-9_.-]"
            )));
        }
        Ok(self.cfg()?.snapshot_dir.join(NAMED_DIR).join(name))
    }

    /// Write named checkpoint `name` of this sandbox, which runs on (or stays
    /// paused, if it was); returns its directory. An existing name is
    /// refused, not overwritten.
    pub async fn checkpoint_named(&self, name: &str) -> Result<PathBuf> {
        let dir = self.named_checkpoint_dir(name)?;
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| {
                SandboxError::Internal(format!("creating {}: {e}", parent.display()))
            })?;
        }
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(SandboxError::AlreadyExists(format!(
                    "checkpoint {name} ({}): remove it first",
                    dir.display()
                )));
            }
            Err(e) => {
                return Err(SandboxError::Internal(format!(
                    "creating {}: {e}",
                    dir.display()
                )))
            }
        }
        let after = if self.paused.load(std::sync::atomic::Ordering::SeqCst) {
            AfterCheckpoint::StayPaused
        } else {
            AfterCheckpoint::Resume
        };
        // Plain sparse files: restores map the memory file straight from
        // here.
        let r = self.checkpoint_to(&dir, after, false).await;
        if r.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
        }
        r.map(|()| dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_plain() {
        for ok in ["cp1", "before-review.2", "A_b"] {
            assert!(valid_name(ok), "{ok}");
        }
        let long = "x".repeat(MAX_NAME + 1);
        for bad in ["", ".", "..", "a/b", "../x", "/abs", "a b", "a\0b", long.as_str()] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
