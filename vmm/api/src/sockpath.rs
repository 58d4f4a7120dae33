//! Unix socket paths of any length. `sun_path` holds 107 bytes, and a
//! sandbox's sockets live in `<state_dir>/<namespace>/<id>/`, which under
//! CRI (namespace `k8s.io`, 64-character ids) outgrows it with any
//! `state_dir` longer than the default. A path that does not fit is
//! reached through its directory, opened `O_PATH`, as
//! `/proc/self/fd/<fd>/<name>`: short whatever the directory, and the
//! same socket file for every process that binds or connects.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Longest path `sun_path` takes (less its NUL).
pub const MAX_SUN_PATH: usize = 107;

/// A path to bind or connect a unix socket at; keep it alive until the
/// bind or connect has returned.
#[derive(Debug)]
pub struct SocketPath {
    path: PathBuf,
    _dir: Option<OwnedFd>,
}

impl SocketPath {
    /// `path` itself when it fits, else a short alias through its
    /// directory (which must exist).
    pub fn new(path: &Path) -> std::io::Result<Self> {
        if path.as_os_str().len() <= MAX_SUN_PATH {
            return Ok(Self {
                path: path.to_path_buf(),
                _dir: None,
            });
        }
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        };
        let dir_c = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: dir_c is a valid C string; open(2) has no other
        // memory-safety preconditions.
        let fd = unsafe {
            libc::open(
                dir_c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd was just opened and is owned by nothing else.
        let dir_fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let short = Path::new("/proc/self/fd")
            .join(dir_fd.as_raw_fd().to_string())
            .join(name);
        if short.as_os_str().len() > MAX_SUN_PATH {
            return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
        }
        Ok(Self {
            path: short,
            _dir: Some(dir_fd),
        })
    }

    /// The path to hand to bind(2) or connect(2).
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::unix::net::{UnixListener, UnixStream};

    #[test]
    fn a_socket_deeper_than_sun_path_binds_and_connects() {
        let base = std::env::temp_dir().join(format!("burrow-sockpath-{}", std::process::id()));
        let deep = base
            .join("k8s.io")
            .join("a".repeat(64))
            .join("b".repeat(40));
        std::fs::create_dir_all(&deep).unwrap();
        let sock = deep.join("api.sock");
        assert!(sock.as_os_str().len() > MAX_SUN_PATH);
        assert!(UnixListener::bind(&sock).is_err(), "too long as it is");
        let l = UnixListener::bind(SocketPath::new(&sock).unwrap().path()).unwrap();
        assert!(sock.exists(), "the socket is where it was asked for");
        let _c = UnixStream::connect(SocketPath::new(&sock).unwrap().path()).unwrap();
        assert!(l.accept().is_ok());
        let short = base.join("s.sock");
        assert_eq!(SocketPath::new(&short).unwrap().path(), short);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
