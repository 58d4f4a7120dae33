//! Checkpoints this host wrote carry a signature (issue 15): an HMAC-SHA256,
//! with a per-host key, over the manifest and the VM state file, in
//! `burrow.sig`. A restore checks it before anything is copied or started,
//! so an edited manifest or state (another size, a base snapshot, a device
//! the VMM would open) is refused with a clear error rather than found, or
//! not, by the checks after it. The memory and disk are not covered: what
//! they hold is the guest's, which is untrusted anyway, and hashing them
//! would cost a read of all of guest memory on every checkpoint and restore.
//!
//! The key is 32 random bytes in the config's `checkpoint_key` (default
//! `/etc/burrow/checkpoint.key`), created mode 0600 (its directory 0700 when
//! made here) with `O_EXCL` on first use; concurrent first uses agree (the
//! loser reads the winner's key). A checkpoint from another host, or from
//! before signing, is refused: restore it on the host that took it.

use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::sandbox::{Result, SandboxError};

/// The signature's file in a checkpoint.
pub const SIG_FILE: &str = "burrow.sig";
const KEY_LEN: usize = 32;
/// What is signed starts with this (a key used for anything else one day
/// cannot be confused with this use).
const DOMAIN: &[u8] = b"burrow-checkpoint-v1\0";

type HmacSha256 = Hmac<Sha256>;

/// This host's key, made on first use.
pub fn host_key(path: &Path) -> Result<Vec<u8>> {
    let err = |what: &str, e: std::io::Error| {
        SandboxError::Internal(format!("{what} the checkpoint key {}: {e}", path.display()))
    };
    match read_key(path) {
        Ok(k) => return Ok(k),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("reading", e)),
    }
    if let Some(dir) = path.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| err("making the directory of", e))?;
    }
    let mut key = vec![0u8; KEY_LEN];
    random(&mut key).map_err(|e| err("making", e))?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&tmp)
        .map_err(|e| err("making", e))?;
    f.write_all(&key).and_then(|()| f.sync_all()).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        err("writing", e)
    })?;
    // A hard link is created only where nothing is: a concurrent first use
    // that won keeps its key, and this one reads it.
    let linked = std::fs::hard_link(&tmp, path);
    let _ = std::fs::remove_file(&tmp);
    match linked {
        Ok(()) => Ok(key),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            read_key(path).map_err(|e| err("reading", e))
        }
        Err(e) => Err(err("installing", e)),
    }
}

fn read_key(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if !meta.is_file() || meta.len() != KEY_LEN as u64 {
        return Err(std::io::Error::other(format!(
            "not a regular file of {KEY_LEN} bytes"
        )));
    }
    let mut key = Vec::with_capacity(KEY_LEN);
    f.take(KEY_LEN as u64).read_to_end(&mut key)?;
    Ok(key)
}

fn random(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = buf.get_mut(filled..).unwrap_or_default();
        // SAFETY: getrandom writes at most rest.len() bytes into rest.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        filled += usize::try_from(n).unwrap_or(0);
    }
    Ok(())
}

fn mac(key: &[u8], manifest: &[u8], state: &[u8]) -> Result<HmacSha256> {
    let mut m = HmacSha256::new_from_slice(key)
        .map_err(|e| SandboxError::Internal(format!("checkpoint key: {e}")))?;
    m.update(DOMAIN);
    for part in [manifest, state] {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part);
    }
    Ok(m)
}

/// The signature of a checkpoint with these manifest and state bytes, as
/// `burrow.sig` holds it (hex).
pub fn sign(key: &[u8], manifest: &[u8], state: &[u8]) -> Result<String> {
    let tag = mac(key, manifest, state)?.finalize().into_bytes();
    Ok(tag.iter().map(|b| format!("{b:02x}")).collect())
}

/// Check `sig` (the bytes of `burrow.sig`) against the manifest and state
/// bytes; the error says what to do.
pub fn verify(
    key: &[u8],
    manifest: &[u8],
    state: &[u8],
    sig: &[u8],
) -> std::result::Result<(), String> {
    let text = std::str::from_utf8(sig).map_err(|_| "its signature is not text".to_string())?;
    let text = text.trim();
    if text.len() != 64 {
        return Err("its signature is malformed".into());
    }
    let mut tag = Vec::with_capacity(32);
    for i in (0..64).step_by(2) {
        let byte = text
            .get(i..i + 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .ok_or_else(|| "its signature is malformed".to_string())?;
        tag.push(byte);
    }
    mac(key, manifest, state)
        .map_err(|e| e.to_string())?
        .verify_slice(&tag)
        .map_err(|_| {
            "its signature does not match: the manifest or the VM state was edited, \
             or it was taken on another host (or with another checkpoint key)"
                .to_string()
        })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_key_is_made_once_private_and_kept() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("etc/burrow/checkpoint.key");
        let k1 = host_key(&path).unwrap();
        assert_eq!(k1.len(), KEY_LEN);
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            std::fs::metadata(path.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        assert_eq!(host_key(&path).unwrap(), k1, "the same key the second time");
        // Nothing but the key is left in its directory.
        assert_eq!(
            std::fs::read_dir(path.parent().unwrap()).unwrap().count(),
            1
        );
        // A symlinked or odd key is an error, not followed or replaced.
        let link = d.path().join("link.key");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(host_key(&link).is_err());
        let short = d.path().join("short.key");
        std::fs::write(&short, b"x").unwrap();
        assert!(host_key(&short)
            .unwrap_err()
            .to_string()
            .contains("32 bytes"));
    }

    #[test]
    fn an_edit_of_manifest_or_state_or_another_key_is_refused() {
        let k = vec![7u8; KEY_LEN];
        let sig = sign(&k, b"manifest", b"state").unwrap();
        assert!(verify(&k, b"manifest", b"state", sig.as_bytes()).is_ok());
        assert!(verify(&k, b"manifest", b"statf", sig.as_bytes())
            .unwrap_err()
            .contains("does not match"));
        assert!(verify(&k, b"manifesu", b"state", sig.as_bytes()).is_err());
        // Moving bytes from one part to the other changes the signature.
        assert!(verify(&k, b"manifests", b"tate", sig.as_bytes()).is_err());
        assert!(verify(&[8u8; KEY_LEN], b"manifest", b"state", sig.as_bytes()).is_err());
        assert!(verify(&k, b"manifest", b"state", b"zz")
            .unwrap_err()
            .contains("malformed"));
        assert!(verify(&k, b"manifest", b"state", &[0xff; 64]).is_err());
    }
}
