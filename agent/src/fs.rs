//! File operations confined to a root directory.
//!
//! Every path is resolved by the kernel with `openat2(RESOLVE_IN_ROOT)`
//! against a directory file descriptor for the root, so neither `..` nor a
//! symlink (absolute or relative) can reach outside it: the kernel treats the
//! root as `/` for the whole resolution. Operations on a final component
//! that must not follow it (stat of a symlink, remove, rename) open its
//! parent that way and then use the `*at` system calls with a plain name.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::Path;

use burrow_protocol::agent::{FileInfo, FileType};
use burrow_protocol::{MAX_CHUNK, MAX_DIR_ENTRIES, MAX_PATH_LEN};
use nix::errno::Errno;
use nix::fcntl::{openat2, AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{fstatat, FileStat, Mode, SFlag};

use crate::error::{invalid, AgentError, Result};

/// How deep `remove` with `recursive` descends before giving up.
const MAX_REMOVE_DEPTH: usize = 128;

/// A path split into normal components (no `.`, no `..`, no empty parts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanPath(Vec<String>);

impl CleanPath {
    /// Normalise `path` lexically: `.` and empty parts vanish, `..` drops
    /// the previous part and stops at the root. Absolute and relative paths
    /// both mean "from the root".
    pub fn parse(path: &str) -> Result<Self> {
        if path.len() > MAX_PATH_LEN {
            return Err(invalid(format!(
                "path is {} bytes long, more than the {MAX_PATH_LEN} allowed",
                path.len()
            )));
        }
        if path.contains('\0') {
            return Err(invalid("path contains a NUL byte"));
        }
        let mut parts: Vec<String> = Vec::new();
        for part in path.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                p => parts.push(p.to_string()),
            }
        }
        Ok(CleanPath(parts))
    }

    pub fn is_root(&self) -> bool {
        self.0.is_empty()
    }

    /// The path relative to the root ("." for the root itself).
    pub fn rel(&self) -> String {
        if self.0.is_empty() {
            ".".to_string()
        } else {
            self.0.join("/")
        }
    }

    /// Parent and final name; an error for the root itself.
    pub fn split(&self) -> Result<(CleanPath, &str)> {
        match self.0.split_last() {
            Some((last, rest)) => Ok((CleanPath(rest.to_vec()), last.as_str())),
            None => Err(invalid(
                "this operation needs a path below the root, not the root itself",
            )),
        }
    }

    pub fn display(&self) -> String {
        format!("/{}", self.0.join("/"))
    }
}

/// Open the directory that serves as root for later calls.
pub fn open_root(path: &Path) -> Result<OwnedFd> {
    nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| AgentError::os(format!("open root {}", path.display()), e))
}

/// Open `path` inside `root` (following symlinks, but only within it).
pub fn open_in_root(root: &OwnedFd, path: &CleanPath, flags: OFlag, mode: Mode) -> Result<OwnedFd> {
    let how = OpenHow::new()
        .flags(flags | OFlag::O_CLOEXEC)
        .mode(mode)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let rel = path.rel();
    retry_eagain(|| openat2(root.as_fd(), rel.as_str(), how))
        .map_err(|e| AgentError::os(format!("open {}", path.display()), e))
}

/// Open the existing regular file `path` for `flags` (read, or write with
/// append) without opening anything else on the way: it is resolved with
/// `O_PATH` first (opening a FIFO blocks; opening a device node can act,
/// e.g. arm a watchdog), checked, and only then reopened. Writes are
/// refused on kernel pseudo file systems (`/proc/sysrq-trigger` is a
/// regular file too).
fn open_regular(root: &OwnedFd, path: &CleanPath, flags: OFlag) -> Result<OwnedFd> {
    let o_path = open_in_root(root, path, OFlag::O_PATH, Mode::empty())?;
    let st = nix::sys::stat::fstat(o_path.as_fd())
        .map_err(|e| AgentError::os(format!("stat {}", path.display()), e))?;
    if file_type(&st) != FileType::REGULAR {
        return Err(invalid(format!(
            "{} is not a regular file (it is a {})",
            path.display(),
            type_name(file_type(&st))
        )));
    }
    let writing = flags.intersects(OFlag::O_WRONLY | OFlag::O_RDWR);
    if writing {
        if let Some(fs) = pseudo_fs(&o_path) {
            return Err(AgentError::PermissionDenied(format!(
                "{} is on {fs}: the file API does not write to kernel interfaces",
                path.display()
            )));
        }
    }
    // Reopen the very inode just checked (not the path again).
    nix::fcntl::open(
        proc_fd_path(&o_path).as_str(),
        flags | OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
        Mode::empty(),
    )
    .map_err(|e| AgentError::os(format!("open {}", path.display()), e))
}

fn type_name(t: FileType) -> &'static str {
    match t {
        FileType::DIRECTORY => "directory",
        FileType::SYMLINK => "symbolic link",
        FileType::REGULAR => "regular file",
        _ => "device, FIFO or socket",
    }
}

/// The kernel pseudo file system `fd` is on, if it is one.
fn pseudo_fs(fd: &OwnedFd) -> Option<&'static str> {
    let st = nix::sys::statfs::fstatfs(fd).ok()?;
    // The f_type magic numbers of linux/magic.h.
    let magic = st.filesystem_type().0 as i64;
    [
        (0x9fa0, "procfs"),
        (0x6265_6572, "sysfs"),
        (0x6367_7270, "cgroup2"),
        (0x0027_e0eb, "cgroup"),
        (0x6462_6720, "debugfs"),
        (0x7472_6163, "tracefs"),
        (0x7363_6673, "securityfs"),
        (0xcafe_4a11, "bpffs"),
        (0x6265_6570, "configfs"),
        (0xde5e_81e4, "efivarfs"),
        (0x6165_676c, "pstore"),
    ]
    .iter()
    .find(|(m, _)| *m == magic)
    .map(|(_, name)| *name)
}

/// openat2 may answer EAGAIN with RESOLVE_IN_ROOT when a rename raced with
/// the lookup; retry a few times.
fn retry_eagain<T>(mut f: impl FnMut() -> nix::Result<T>) -> nix::Result<T> {
    let mut tries = 0;
    loop {
        match f() {
            Err(Errno::EAGAIN) if tries < 16 => tries += 1,
            other => return other,
        }
    }
}

fn open_dir_path(root: &OwnedFd, path: &CleanPath) -> Result<OwnedFd> {
    open_in_root(
        root,
        path,
        OFlag::O_PATH | OFlag::O_DIRECTORY,
        Mode::empty(),
    )
}

fn file_type(st: &FileStat) -> FileType {
    match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
        SFlag::S_IFREG => FileType::REGULAR,
        SFlag::S_IFDIR => FileType::DIRECTORY,
        SFlag::S_IFLNK => FileType::SYMLINK,
        _ => FileType::OTHER,
    }
}

fn info_from_stat(name: &str, st: &FileStat) -> FileInfo {
    let mut info = FileInfo::new();
    info.name = name.to_string();
    info.type_ = file_type(st).into();
    info.size = u64::try_from(st.st_size).unwrap_or(0);
    info.mode = st.st_mode & 0o7777;
    info.mtime_unix = st.st_mtime;
    info.uid = st.st_uid;
    info.gid = st.st_gid;
    info
}

fn readlink_at(dir: &OwnedFd, name: &str) -> String {
    nix::fcntl::readlinkat(dir.as_fd(), name)
        .map(|t| t.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Stat `path` without following a final symlink.
pub fn stat(root: &OwnedFd, path: &CleanPath) -> Result<FileInfo> {
    if path.is_root() {
        let st = nix::sys::stat::fstat(root.as_fd()).map_err(|e| AgentError::os("stat /", e))?;
        return Ok(info_from_stat("/", &st));
    }
    let (parent, name) = path.split()?;
    let dir = open_dir_path(root, &parent)?;
    let st = fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)
        .map_err(|e| AgentError::os(format!("stat {}", path.display()), e))?;
    let mut info = info_from_stat(name, &st);
    if info.type_ == FileType::SYMLINK.into() {
        info.symlink_target = readlink_at(&dir, name);
    }
    Ok(info)
}

/// Read up to `max` bytes (capped at MAX_CHUNK) from `offset`.
pub fn read(
    root: &OwnedFd,
    path: &CleanPath,
    offset: u64,
    max: u32,
) -> Result<(Vec<u8>, u64, bool)> {
    let fd = open_regular(root, path, OFlag::O_RDONLY)?;
    let st = nix::sys::stat::fstat(fd.as_fd())
        .map_err(|e| AgentError::os(format!("stat {}", path.display()), e))?;
    let size = u64::try_from(st.st_size).unwrap_or(0);
    // Read up to the cap whatever stat says: /proc and /sys files report
    // size 0 but have content.
    let mut want = chunk_len(max);
    if size > 0 {
        want = want.min(usize::try_from(size.saturating_sub(offset)).unwrap_or(usize::MAX));
    }
    let mut buf = vec![0u8; want];
    let mut got = 0;
    let mut eof = false;
    let file = std::fs::File::from(fd);
    while got < want {
        let pos = offset.saturating_add(got as u64);
        let n = std::os::unix::fs::FileExt::read_at(&file, &mut buf[got..], pos)
            .map_err(|e| AgentError::io(format!("read {}", path.display()), e))?;
        if n == 0 {
            eof = true;
            break;
        }
        got += n;
    }
    buf.truncate(got);
    // A full chunk that ends exactly at the (known) size is the end too.
    let eof = eof || (size > 0 && offset.saturating_add(got as u64) >= size);
    Ok((buf, size, eof))
}

/// A requested chunk length, 0 or too large meaning MAX_CHUNK.
pub fn chunk_len(max: u32) -> usize {
    let max = usize::try_from(max).unwrap_or(MAX_CHUNK);
    if max == 0 || max > MAX_CHUNK {
        MAX_CHUNK
    } else {
        max
    }
}

/// Write `data` to `path`: atomically (a temporary file in the same
/// directory renamed over the target) or appended.
pub fn write(
    root: &OwnedFd,
    path: &CleanPath,
    data: &[u8],
    mode: u32,
    append: bool,
    make_parents: bool,
) -> Result<()> {
    if data.len() > MAX_CHUNK {
        return Err(invalid(format!(
            "write of {} bytes is more than the {MAX_CHUNK} one call may carry; append in chunks",
            data.len()
        )));
    }
    let mode = if mode == 0 { 0o644 } else { mode & 0o7777 };
    let (parent, name) = path.split()?;
    if make_parents {
        mkdir(root, &parent, 0o755, true)?;
    }
    let dir = open_dir_path(root, &parent)?;
    use std::io::Write;
    if append {
        let flags = OFlag::O_WRONLY | OFlag::O_APPEND;
        let fd = match open_regular(root, path, flags) {
            // A new file: created beside its siblings, never through a
            // symlink (O_EXCL): a dangling link stays "not found".
            Err(AgentError::NotFound(missing)) => nix::fcntl::openat(
                dir.as_fd(),
                name,
                flags | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(mode),
            )
            .map_err(|e| match e {
                Errno::EEXIST => AgentError::NotFound(missing),
                e => AgentError::os(format!("create {}", path.display()), e),
            })?,
            other => other?,
        };
        let mut f = std::fs::File::from(fd);
        return f
            .write_all(data)
            .map_err(|e| AgentError::io(format!("append to {}", path.display()), e));
    }
    let tmp = format!(".{name}.burrow-{}-{}", std::process::id(), unique());
    let fd = nix::fcntl::openat(
        dir.as_fd(),
        tmp.as_str(),
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW,
        Mode::from_bits_truncate(mode),
    )
    .map_err(|e| {
        AgentError::os(
            format!("create a temporary file beside {}", path.display()),
            e,
        )
    })?;
    let mut f = std::fs::File::from(fd);
    let written = f
        .write_all(data)
        .and_then(|()| {
            nix::sys::stat::fchmod(f.as_fd(), Mode::from_bits_truncate(mode))
                .map_err(std::io::Error::from)
        })
        .and_then(|()| f.sync_all());
    let renamed = written
        .map_err(|e| AgentError::io(format!("write {}", path.display()), e))
        .and_then(|()| {
            nix::fcntl::renameat(dir.as_fd(), tmp.as_str(), dir.as_fd(), name)
                .map_err(|e| AgentError::os(format!("rename into {}", path.display()), e))
        });
    if renamed.is_err() {
        let _ = nix::unistd::unlinkat(
            dir.as_fd(),
            tmp.as_str(),
            nix::unistd::UnlinkatFlags::NoRemoveDir,
        );
    }
    renamed
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// List a directory, sorted by name, at most `max` entries.
pub fn list(root: &OwnedFd, path: &CleanPath, max: u32) -> Result<(Vec<FileInfo>, bool)> {
    let max = match usize::try_from(max) {
        Ok(0) | Err(_) => MAX_DIR_ENTRIES,
        Ok(m) => m.min(MAX_DIR_ENTRIES),
    };
    let fd = open_in_root(
        root,
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY,
        Mode::empty(),
    )?;
    let statfd = fd
        .try_clone()
        .map_err(|e| AgentError::io(format!("list {}", path.display()), e))?;
    let mut dir = nix::dir::Dir::from_fd(fd)
        .map_err(|e| AgentError::os(format!("list {}", path.display()), e))?;
    let mut names = Vec::new();
    let mut truncated = false;
    for entry in dir.iter() {
        let entry = entry.map_err(|e| AgentError::os(format!("list {}", path.display()), e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name == "." || name == ".." {
            continue;
        }
        if names.len() >= max {
            truncated = true;
            break;
        }
        names.push(name);
    }
    names.sort();
    let mut out = Vec::with_capacity(names.len());
    for name in names {
        match fstatat(statfd.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => {
                let mut info = info_from_stat(&name, &st);
                if info.type_ == FileType::SYMLINK.into() {
                    info.symlink_target = readlink_at(&statfd, &name);
                }
                out.push(info);
            }
            // Removed between readdir and stat: leave it out.
            Err(Errno::ENOENT) => {}
            Err(e) => return Err(AgentError::os(format!("stat {}/{name}", path.display()), e)),
        }
    }
    Ok((out, truncated))
}

/// Make a directory (and its parents with `parents`, like `mkdir -p`).
pub fn mkdir(root: &OwnedFd, path: &CleanPath, mode: u32, parents: bool) -> Result<()> {
    let mode = Mode::from_bits_truncate(if mode == 0 { 0o755 } else { mode & 0o7777 });
    if path.is_root() {
        return if parents {
            Ok(())
        } else {
            Err(AgentError::AlreadyExists("/ exists".into()))
        };
    }
    let upto: Vec<usize> = if parents {
        (1..=path.0.len()).collect()
    } else {
        vec![path.0.len()]
    };
    for n in upto {
        let sub = CleanPath(path.0[..n].to_vec());
        let (parent, name) = sub.split()?;
        let dir = open_dir_path(root, &parent)?;
        match nix::sys::stat::mkdirat(dir.as_fd(), name, mode) {
            Ok(()) => {}
            Err(Errno::EEXIST) if parents => {
                // Must be a directory (or a symlink to one inside the root).
                open_dir_path(root, &sub)?;
            }
            Err(e) => return Err(AgentError::os(format!("mkdir {}", sub.display()), e)),
        }
    }
    Ok(())
}

/// Rename `from` to `to` (a file there is replaced atomically; neither
/// final component is followed if it is a symlink).
pub fn rename(root: &OwnedFd, from: &CleanPath, to: &CleanPath) -> Result<()> {
    let (from_parent, from_name) = from.split()?;
    let (to_parent, to_name) = to.split()?;
    let from_dir = open_dir_path(root, &from_parent)?;
    let to_dir = open_dir_path(root, &to_parent)?;
    nix::fcntl::renameat(from_dir.as_fd(), from_name, to_dir.as_fd(), to_name).map_err(|e| {
        AgentError::os(
            format!("rename {} to {}", from.display(), to.display()),
            e,
        )
    })
}

/// Remove a file, symlink or directory (recursively with `recursive`).
pub fn remove(root: &OwnedFd, path: &CleanPath, recursive: bool) -> Result<()> {
    let (parent, name) = path.split()?;
    let dir = open_dir_path(root, &parent)?;
    remove_at(&dir, name, recursive, 0)
        .map_err(|e| AgentError::os(format!("remove {}", path.display()), e))
}

fn remove_at(dir: &OwnedFd, name: &str, recursive: bool, depth: usize) -> nix::Result<()> {
    use nix::unistd::{unlinkat, UnlinkatFlags};
    match unlinkat(dir.as_fd(), name, UnlinkatFlags::NoRemoveDir) {
        Ok(()) => return Ok(()),
        Err(Errno::EISDIR) => {}
        Err(e) => return Err(e),
    }
    match unlinkat(dir.as_fd(), name, UnlinkatFlags::RemoveDir) {
        Err(Errno::ENOTEMPTY | Errno::EEXIST) if recursive => {}
        other => return other,
    }
    if depth >= MAX_REMOVE_DEPTH {
        return Err(Errno::ELOOP);
    }
    let sub = nix::fcntl::openat(
        dir.as_fd(),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let subfd = sub.try_clone().map_err(|_| Errno::EMFILE)?;
    let mut d = nix::dir::Dir::from_fd(sub)?;
    let mut children = Vec::new();
    for entry in d.iter() {
        let entry = entry?;
        let n = entry.file_name().to_string_lossy().into_owned();
        if n != "." && n != ".." {
            children.push(n);
        }
    }
    drop(d);
    for child in children {
        remove_at(&subfd, &child, true, depth + 1)?;
    }
    unlinkat(dir.as_fd(), name, UnlinkatFlags::RemoveDir)
}

/// The raw fd as a `/proc/self/fd/N` path, for mount(2) onto a resolved target.
pub fn proc_fd_path(fd: &OwnedFd) -> String {
    format!("/proc/self/fd/{}", fd.as_raw_fd())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appending_to_a_kernel_interface_is_refused_before_opening_it() {
        let root = open_root(Path::new("/")).expect("root");
        // (/proc/sysrq-trigger where the kernel has one; drop_caches everywhere.)
        let sysrq = CleanPath::parse("/proc/sys/vm/drop_caches").expect("path");
        match open_regular(&root, &sysrq, OFlag::O_WRONLY | OFlag::O_APPEND) {
            Err(AgentError::PermissionDenied(m)) => assert!(m.contains("procfs"), "{m}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // Reading a /proc file stays allowed (it is the caller's own guest).
        let meminfo = CleanPath::parse("/proc/meminfo").expect("path");
        open_regular(&root, &meminfo, OFlag::O_RDONLY).expect("read /proc/meminfo");
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("plain");
        std::fs::write(&f, "x").expect("write");
        let fd = open_in_root(
            &root,
            &CleanPath::parse(f.to_str().expect("utf-8")).expect("path"),
            OFlag::O_PATH,
            Mode::empty(),
        )
        .expect("open");
        assert_eq!(pseudo_fs(&fd), None);
    }

    #[test]
    fn rename_replaces_a_file_inside_the_root_and_never_leaves_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = open_root(dir.path()).expect("root");
        let p = |s: &str| CleanPath::parse(s).expect("path");
        std::fs::write(dir.path().join("old"), "old").expect("write");
        std::fs::write(dir.path().join(".new.tmp"), "new").expect("write");
        rename(&root, &p("/.new.tmp"), &p("/old")).expect("rename");
        assert_eq!(std::fs::read(dir.path().join("old")).expect("read"), b"new");
        assert!(!dir.path().join(".new.tmp").exists());
        // `..` stops at the root: nothing lands outside it.
        std::fs::write(dir.path().join("a"), "a").expect("write");
        rename(&root, &p("/a"), &p("/../../escaped")).expect("rename");
        assert!(dir.path().join("escaped").exists());
        assert!(!dir.path().parent().expect("parent").join("escaped").exists());
        // A missing source or directory is an error.
        assert!(rename(&root, &p("/nope"), &p("/x")).is_err());
        assert!(rename(&root, &p("/escaped"), &p("/no/dir/x")).is_err());
    }

    #[test]
    fn clean_path_clamps_dotdot_at_root() {
        assert_eq!(
            CleanPath::parse("/../../etc/passwd").unwrap().rel(),
            "etc/passwd"
        );
        assert_eq!(CleanPath::parse("a/./b/../c").unwrap().rel(), "a/c");
        assert!(CleanPath::parse("/").unwrap().is_root());
        assert!(CleanPath::parse("a\0b").is_err());
    }
}
