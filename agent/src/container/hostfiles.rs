//! A container's /etc/resolv.conf, /etc/hosts and /etc/hostname, carried
//! from the host in the spec (`burrow_protocol::net::HOST_FILES`): a mount
//! whose source is `burrow-file:NAME` gets a file written under the
//! container's bundle from the annotation `io.burrow.file.NAME`, and is
//! mounted from there.

use std::path::Path;

use burrow_protocol::net::{
    HOST_FILES, HOST_FILE_ANNOTATION, HOST_FILE_SOURCE, MAX_HOST_FILE_BYTES,
};
use oci_spec::runtime::{Mount, Spec};

use crate::error::{invalid, AgentError, Result};

/// `m` with its source pointing at the written file when it is a carried
/// one; `None` for any other mount.
pub fn resolve(bundle: &Path, spec: &Spec, m: &Mount) -> Result<Option<Mount>> {
    let Some(name) = m
        .source()
        .as_ref()
        .and_then(|s| s.to_str())
        .and_then(|s| s.strip_prefix(HOST_FILE_SOURCE))
    else {
        return Ok(None);
    };
    let dest = m.destination().to_string_lossy();
    if !HOST_FILES.iter().any(|(d, n)| *n == name && *d == dest) {
        return Err(invalid(format!(
            "{HOST_FILE_SOURCE}{name} cannot be mounted on {dest}"
        )));
    }
    let text = spec
        .annotations()
        .as_ref()
        .and_then(|a| a.get(&format!("{HOST_FILE_ANNOTATION}{name}")))
        .ok_or_else(|| invalid(format!("no {HOST_FILE_ANNOTATION}{name} for {dest}")))?;
    if text.len() > MAX_HOST_FILE_BYTES {
        return Err(invalid(format!(
            "{HOST_FILE_ANNOTATION}{name} is over {MAX_HOST_FILE_BYTES} bytes"
        )));
    }
    let dir = bundle.join("files");
    std::fs::create_dir_all(&dir)
        .map_err(|e| AgentError::io(format!("mkdir {}", dir.display()), e))?;
    let file = dir.join(name);
    std::fs::write(&file, text)
        .map_err(|e| AgentError::io(format!("writing {}", file.display()), e))?;
    let mut resolved = m.clone();
    resolved.set_source(Some(file));
    Ok(Some(resolved))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn spec(annotations: serde_json::Value) -> Spec {
        serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "annotations": annotations,
        }))
        .unwrap()
    }

    fn mount(dest: &str, source: &str) -> Mount {
        serde_json::from_value(serde_json::json!({
            "destination": dest, "type": "bind", "source": source, "options": ["bind"],
        }))
        .unwrap()
    }

    #[test]
    fn writes_the_carried_file_and_refuses_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let s = spec(serde_json::json!({"io.burrow.file.resolv.conf": "nameserver 10.0.0.1\n"}));
        let m = resolve(
            dir.path(),
            &s,
            &mount("/etc/resolv.conf", "burrow-file:resolv.conf"),
        )
        .unwrap()
        .unwrap();
        let src = m.source().clone().unwrap();
        assert_eq!(src, dir.path().join("files/resolv.conf"));
        assert_eq!(
            std::fs::read_to_string(src).unwrap(),
            "nameserver 10.0.0.1\n"
        );
        // Not one of ours: untouched.
        assert!(resolve(dir.path(), &s, &mount("/data", "/srv"))
            .unwrap()
            .is_none());
        // A carried name on another destination, a missing annotation, a
        // name that is not carried, an oversized file.
        for (dest, src) in [
            ("/etc/passwd", "burrow-file:resolv.conf"),
            ("/etc/hosts", "burrow-file:hosts"),
            ("/etc/passwd", "burrow-file:../passwd"),
        ] {
            assert!(
                resolve(dir.path(), &s, &mount(dest, src)).is_err(),
                "{dest} {src}"
            );
        }
        let big = spec(serde_json::json!({
            "io.burrow.file.hosts": "x".repeat(MAX_HOST_FILE_BYTES + 1),
        }));
        assert!(resolve(dir.path(), &big, &mount("/etc/hosts", "burrow-file:hosts")).is_err());
    }
}
