//! Host files a guest can fill, kept bounded.
//!
//! The guest decides how much it writes to its serial port, and a hostile
//! one writes without end; the VMM's own log grows with every warning a
//! guest can provoke. Neither may fill the host's disk (or `/run`, a RAM
//! tmpfs). [`RotatingFile`] keeps the newest output (what a crash report
//! needs) in at most two files of `max` bytes: `PATH` and `PATH.1`.
//! [`CappedLog`] stops the VMM's log at a limit with one line saying so.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use burrow_vmm_api::{DEFAULT_LOG_MAX, DEFAULT_SERIAL_LOG_MAX};

/// `PATH`, rotated to `PATH.1` when the next write would pass `max` bytes.
/// Opened 0600 without following a symlink at `PATH`. Write errors after
/// a failed rotation drop output instead of failing the device: a console
/// that cannot be logged must not stop the guest.
pub struct RotatingFile {
    path: PathBuf,
    max: u64,
    written: u64,
    file: Option<File>,
}

fn open_log(path: &Path, truncate: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.create(true).mode(0o600).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC);
    if truncate {
        o.write(true).truncate(true);
    } else {
        o.append(true);
    }
    let f = o.open(path)?;
    if !f.metadata()?.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(f)
}

/// Where the log at `path` is rotated to: `PATH.1`.
pub fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    p.into()
}

impl RotatingFile {
    /// Open (append to) `path`; `max` is at least 4 KiB.
    pub fn open(path: &Path, max: u64) -> io::Result<Self> {
        let file = open_log(path, false)?;
        let written = file.metadata()?.len();
        Ok(Self { path: path.to_path_buf(), max: max.max(4096), written, file: Some(file) })
    }

    /// Where the previous `max` bytes go.
    pub fn rotated_path(&self) -> PathBuf {
        rotated(&self.path)
    }

    fn rotate(&mut self) {
        self.file = None;
        self.written = 0;
        // A rename replaces an older PATH.1 (even a symlink there, which
        // is replaced, not followed).
        let renamed = std::fs::rename(&self.path, self.rotated_path());
        self.file = renamed.and_then(|()| open_log(&self.path, true)).ok();
    }
}

impl Write for RotatingFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.max.saturating_sub(self.written);
        if buf.len() as u64 > room && self.written > 0 {
            self.rotate();
        }
        let take = buf.len().min(usize::try_from(self.max).unwrap_or(usize::MAX));
        let Some(f) = self.file.as_mut() else {
            return Ok(buf.len());
        };
        match f.write(&buf[..take]) {
            Ok(n) => {
                self.written += n as u64;
                // What did not fit in one file is dropped, not split.
                Ok(if n == take { buf.len() } else { n })
            }
            Err(_) => {
                self.file = None;
                Ok(buf.len())
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self.file.as_mut() {
            Some(f) => f.flush(),
            None => Ok(()),
        }
    }
}

static LOG_WRITTEN: AtomicU64 = AtomicU64::new(0);
static LOG_MAX: AtomicU64 = AtomicU64::new(DEFAULT_LOG_MAX);
static LOG_CAPPED: AtomicBool = AtomicBool::new(false);

/// The VMM's log writer (stderr, a file the shim opened): once `max` bytes
/// are written, one line says so and later messages are dropped. The
/// process's last error line (`eprintln!` in main) is not counted.
#[derive(Clone, Copy, Default)]
pub struct CappedLog;

impl CappedLog {
    pub fn set_max(max: u64) {
        LOG_MAX.store(max, Ordering::Relaxed);
    }
}

impl Write for CappedLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let max = LOG_MAX.load(Ordering::Relaxed);
        let before = LOG_WRITTEN.fetch_add(buf.len() as u64, Ordering::Relaxed);
        if before.saturating_add(buf.len() as u64) <= max {
            return io::stderr().write(buf).map(|_| buf.len());
        }
        if !LOG_CAPPED.swap(true, Ordering::Relaxed) {
            let _ = writeln!(
                io::stderr(),
                "burrow-vmm: log reached its cap of {max} bytes (--log-max); later messages are dropped"
            );
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_at_the_cap_and_keeps_the_newest_output() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("console.log");
        let mut f = RotatingFile::open(&p, 4096).unwrap();
        for i in 0..1000u32 {
            writeln!(f, "line {i:05} of the guest's console").unwrap();
        }
        let cur = std::fs::read_to_string(&p).unwrap();
        let old = std::fs::read_to_string(f.rotated_path()).unwrap();
        assert!(cur.len() <= 4096 && old.len() <= 4096, "{} {}", cur.len(), old.len());
        assert!(cur.ends_with("line 00999 of the guest's console\n"), "{cur}");
        // What came just before PATH's first whole line is at PATH.1's end.
        let first: u32 = cur.lines().nth(1).and_then(|l| l.get(5..10)).and_then(|n| n.parse().ok()).unwrap();
        assert!(old.contains(&format!("line {:05} of", first - 2)), "{old}");
    }

    #[test]
    fn a_write_bigger_than_the_cap_is_cut_to_it() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c");
        let mut f = RotatingFile::open(&p, 4096).unwrap();
        f.write_all(&[b'x'; 10_000]).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4096);
    }

    #[test]
    fn a_symlink_in_place_of_the_log_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("sentinel");
        std::fs::write(&target, "keep").unwrap();
        let p = d.path().join("console.log");
        std::os::unix::fs::symlink(&target, &p).unwrap();
        assert!(RotatingFile::open(&p, 4096).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    }

    #[test]
    fn the_log_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("c");
        let _f = RotatingFile::open(&p, 4096).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
