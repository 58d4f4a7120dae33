//! `burrow cp SRC DST`: one regular file into or out of a sandbox's
//! container, as `docker cp` / `kubectl cp` do: `burrow cp LOCAL ID:PATH`,
//! `burrow cp ID:PATH LOCAL`, `-` for stdin or stdout. Bytes, any size up
//! to [`MAX_COPY`], streamed through the shim's control socket in frames of
//! at most [`COPY_CHUNK`] (see burrow-vmm-api's `sandbox_tools`); neither
//! this side nor the shim holds the whole file.
//!
//! Both ends are atomic: the guest file is replaced only once all of it
//! arrived (the shim renames a temporary file over it), and a local file
//! is written beside its target and renamed into place at the end; a copy
//! that fails leaves the old file as it was and no temporary file.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use burrow_vmm_api::sandbox_control::{control_socket, SandboxReply, SandboxRequest, MAX_REPLY};
use burrow_vmm_api::sandbox_tools::{
    frame, CopyInfo, DownloadRequest, ToolReply, UploadRequest, COPY_CHUNK, MAX_COPY,
};

use crate::sandbox;
use crate::tools::WAKE_ALLOWANCE;

#[derive(clap::Args, Debug)]
pub struct CpArgs {
    /// What to copy: a local file, `-` (stdin), or ID:PATH (a file in a
    /// sandbox's container; ID as for the other tool verbs).
    pub src: String,
    /// Where to: a local file or directory, `-` (stdout), or ID:PATH (a
    /// file, or an existing directory to put it in).
    pub dst: String,
    /// The shims' state directory (default: `state_dir` from the burrow
    /// config, else /run/burrow).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// containerd namespace.
    #[arg(long, short = 'n', default_value = "default")]
    pub namespace: String,
}

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Side {
    /// stdin or stdout.
    Std,
    Local(PathBuf),
    Sandbox {
        id: String,
        path: String,
    },
}

impl Side {
    /// `-`, `ID:PATH` (ID non-empty, without `/`), or a local path (one
    /// with a `:` in its first component is written `./a:b`).
    pub fn parse(s: &str) -> Result<Self> {
        if s == "-" {
            return Ok(Self::Std);
        }
        if s.is_empty() {
            bail!("an empty path");
        }
        match s.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') => {
                if path.is_empty() {
                    bail!("{s:?}: no path in the sandbox after {id}:");
                }
                Ok(Self::Sandbox {
                    id: id.into(),
                    path: path.into(),
                })
            }
            _ => Ok(Self::Local(s.into())),
        }
    }
}

/// `burrow cp`.
pub fn cp(a: CpArgs) -> Result<i32> {
    let root = a
        .state_dir
        .clone()
        .unwrap_or_else(sandbox::state_dir_from_config);
    match (Side::parse(&a.src)?, Side::parse(&a.dst)?) {
        (Side::Sandbox { .. }, Side::Sandbox { .. }) => {
            bail!("copy between two sandboxes through a local file")
        }
        (Side::Sandbox { id, path }, local) => download(&root, &a.namespace, &id, &path, &local),
        (local, Side::Sandbox { id, path }) => upload(&root, &a.namespace, &id, &path, &local),
        _ => bail!("one of SRC and DST is ID:PATH, a file in a sandbox"),
    }
}

/// A connection to sandbox `id`'s shim with `req` sent on it (wrapped for
/// a pod's container where needed), and what the audit log needs.
struct Conn {
    s: UnixStream,
    r: BufReader<UnixStream>,
    dir: PathBuf,
    routed: bool,
    start: std::time::Instant,
}

fn connect(root: &Path, namespace: &str, id: &str, req: &SandboxRequest) -> Result<Conn> {
    let (dir, routed) = crate::tools::route(root, namespace, id, req)?;
    let sock = control_socket(&dir);
    let s = burrow_vmm_api::sockpath::SocketPath::new(&sock)
        .and_then(|p| UnixStream::connect(p.path()))
        .with_context(|| format!("connecting to {} (is the sandbox running?)", sock.display()))?;
    s.set_read_timeout(Some(WAKE_ALLOWANCE))?;
    s.set_write_timeout(Some(WAKE_ALLOWANCE))?;
    (&s).write_all(&burrow_vmm_api::to_line(routed.as_ref().unwrap_or(req)))?;
    let r = BufReader::with_capacity(COPY_CHUNK + 4, s.try_clone()?);
    Ok(Conn {
        s,
        r,
        dir,
        routed: routed.is_some(),
        start: std::time::Instant::now(),
    })
}

impl Conn {
    /// The next reply line: a `ready` or `copied` with its file, or the
    /// shim's error.
    fn reply(&mut self, cmd: &str) -> Result<CopyInfo> {
        let mut line = String::new();
        (&mut self.r)
            .take(MAX_REPLY)
            .read_line(&mut line)
            .with_context(|| format!("reading the reply to {cmd}"))?;
        if line.is_empty() {
            bail!("the shim closed the connection before the {cmd} ended");
        }
        let reply: SandboxReply =
            serde_json::from_str(line.trim()).with_context(|| format!("bad reply {line:?}"))?;
        if !reply.ok {
            bail!("{}", reply.error.as_deref().unwrap_or("?"));
        }
        match reply.tool {
            Some(ToolReply::Ready(i) | ToolReply::Copied(i)) => Ok(i),
            _ => bail!(
                "the shim answered {cmd} with another tool's result (is it older than this CLI?)"
            ),
        }
    }

    fn record(&self, id: &str, req: &SandboxRequest, result: &Result<ToolReply>, bytes: u64) {
        crate::tools::record(
            &self.dir,
            id,
            req,
            self.routed,
            result,
            self.start,
            bytes,
            None,
        );
    }
}

/// The name a copy into a directory gives the file: `path`'s last part.
fn base_name(path: &str) -> Option<&str> {
    path.trim_end_matches('/')
        .rsplit('/')
        .next()
        .filter(|n| !n.is_empty() && *n != "." && *n != "..")
}

fn upload(root: &Path, ns: &str, id: &str, path: &str, src: &Side) -> Result<i32> {
    let (mut input, size, mode, name): (Box<dyn Read>, _, _, _) = match src {
        Side::Std => (Box::new(std::io::stdin().lock()), None, None, None),
        Side::Local(p) => {
            let f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
            let meta = f.metadata()?;
            if meta.is_dir() {
                bail!(
                    "{} is a directory (burrow cp copies single files)",
                    p.display()
                );
            }
            if !meta.is_file() {
                bail!("{} is not a regular file", p.display());
            }
            if meta.len() > MAX_COPY {
                bail!("{}: {}", p.display(), frame::too_big(meta.len()));
            }
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .filter(|n| !n.is_empty());
            // Never more than announced, should the file grow meanwhile.
            let input = Box::new(f.take(meta.len()));
            (
                input as Box<dyn Read>,
                Some(meta.len()),
                Some(meta.permissions().mode() & 0o777),
                name,
            )
        }
        Side::Sandbox { .. } => unreachable!("cp checked"),
    };
    let req = SandboxRequest::Upload(UploadRequest {
        path: path.into(),
        name,
        mode,
        size,
    });
    let mut c = connect(root, ns, id, &req)?;
    let mut sent = 0u64;
    let result = send(&mut c, &mut *input, size, &mut sent);
    let recorded = result.as_ref().map(|i| ToolReply::Copied(i.clone()));
    let recorded = recorded.map_err(|e| anyhow::anyhow!("{e:#}"));
    c.record(id, &req, &recorded, sent);
    let info = result?;
    println!("copied {} bytes to {id}:{}", info.size, info.path);
    Ok(0)
}

/// The upload's frames after `ready`, then the final reply.
fn send(c: &mut Conn, input: &mut dyn Read, size: Option<u64>, sent: &mut u64) -> Result<CopyInfo> {
    c.reply("upload")?;
    let mut bound = frame::Bound::new(size).map_err(anyhow::Error::msg)?;
    let mut buf = vec![0u8; COPY_CHUNK];
    // Err((why, whether the connection failed rather than this side)).
    let streamed = (|| -> std::result::Result<(), (anyhow::Error, bool)> {
        let local = |e: anyhow::Error| (e, false);
        let socket = |e: std::io::Error| (anyhow::Error::from(e), true);
        loop {
            let n = read_full(input, &mut buf)
                .context("reading the local file")
                .map_err(local)?;
            if n == 0 {
                break;
            }
            bound.take(n).map_err(anyhow::Error::msg).map_err(local)?;
            (&c.s).write_all(&frame::header(n)).map_err(socket)?;
            (&c.s).write_all(&buf[..n]).map_err(socket)?;
            *sent += n as u64;
        }
        bound.finish().map_err(anyhow::Error::msg).map_err(local)?;
        (&c.s).write_all(&frame::header(0)).map_err(socket)?;
        Ok(())
    })();
    if let Err((e, connection)) = streamed {
        // The connection's end tells the shim to remove its temporary
        // file; when it stopped first, its reply says why.
        let _ = c.s.shutdown(std::net::Shutdown::Write);
        let shim = c.reply("upload");
        return Err(match shim {
            Err(why) if connection => why,
            _ => e,
        })
        .map_err(|e| anyhow::anyhow!("{e:#}; nothing was changed in the sandbox"));
    }
    c.reply("upload")
}

/// Fill `buf` as far as `r` gives (short only at its end).
fn read_full(r: &mut dyn Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// A local file being written: a temporary file beside the target,
/// removed unless [`Self::commit`] renames it into place.
struct LocalTemp {
    temp: PathBuf,
    target: PathBuf,
    file: Option<std::fs::File>,
}

impl LocalTemp {
    fn new(target: PathBuf) -> Result<Self> {
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = target
            .file_name()
            .with_context(|| format!("{} does not name a file", target.display()))?;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let temp = parent.join(format!(
            ".{}.burrow-cp-{}-{n}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)
            .with_context(|| format!("creating {}", temp.display()))?;
        Ok(Self {
            temp,
            target,
            file: Some(file),
        })
    }

    fn commit(mut self, mode: u32) -> Result<()> {
        let file = self.file.take().context("committed twice")?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&self.temp, &self.target)
            .with_context(|| format!("renaming into {}", self.target.display()))?;
        self.temp = PathBuf::new();
        Ok(())
    }
}

impl Drop for LocalTemp {
    fn drop(&mut self) {
        if !self.temp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

fn download(root: &Path, ns: &str, id: &str, path: &str, dst: &Side) -> Result<i32> {
    // Where it goes, checked before the sandbox is asked.
    let target = match dst {
        Side::Std => None,
        Side::Local(p) => {
            let mut t = p.clone();
            if t.is_dir() {
                let name =
                    base_name(path).with_context(|| format!("{path} does not name a file"))?;
                t = t.join(name);
            } else if p.to_string_lossy().ends_with('/') {
                bail!("no directory {} here", p.display());
            }
            if t.is_dir() {
                bail!("{} is a directory", t.display());
            }
            match t.parent() {
                Some(d) if !d.as_os_str().is_empty() && !d.is_dir() => {
                    bail!("no directory {} here", d.display())
                }
                _ => {}
            }
            Some(t)
        }
        Side::Sandbox { .. } => unreachable!("cp checked"),
    };
    let req = SandboxRequest::Download(DownloadRequest {
        path: path.into(),
        ..Default::default()
    });
    let mut c = connect(root, ns, id, &req)?;
    let mut got = 0u64;
    let dest = match &target {
        Some(t) => Dest::File(t.clone()),
        None => Dest::Stdout,
    };
    let result = receive(&mut c, dest, &mut got);
    let recorded = result.as_ref().map(|i| ToolReply::Copied(i.clone()));
    let recorded = recorded.map_err(|e| anyhow::anyhow!("{e:#}"));
    c.record(id, &req, &recorded, got);
    let info = result?;
    match target {
        Some(t) => println!(
            "copied {} bytes from {id}:{} to {}",
            info.size,
            info.path,
            t.display()
        ),
        None => eprintln!("copied {} bytes from {id}:{}", info.size, info.path),
    }
    Ok(0)
}

/// Where a download's bytes go.
enum Dest<'a> {
    /// A local file, replaced atomically.
    File(PathBuf),
    Stdout,
    /// Memory (`burrow mcp`: a bounded range).
    Buf(&'a mut Vec<u8>),
}

/// The download's `ready`, frames (never more than announced) and final
/// reply, into `dest`.
fn receive(c: &mut Conn, dest: Dest<'_>, got: &mut u64) -> Result<CopyInfo> {
    let info = c.reply("download")?;
    let mut bound = frame::Bound::new(Some(info.size)).map_err(anyhow::Error::msg)?;
    let mut temp = None;
    let stdout = std::io::stdout();
    let mut out: Box<dyn Write + '_> = match dest {
        Dest::File(p) => {
            let t = LocalTemp::new(p)?;
            let f = t.file.as_ref().context("no file")?.try_clone()?;
            temp = Some(t);
            Box::new(std::io::BufWriter::with_capacity(COPY_CHUNK, f))
        }
        Dest::Stdout => Box::new(stdout.lock()),
        Dest::Buf(v) => Box::new(v),
    };
    let mut buf = vec![0u8; COPY_CHUNK];
    loop {
        let mut h = [0u8; 4];
        c.r.read_exact(&mut h).context("the download was cut off")?;
        let n = frame::parse(h).map_err(anyhow::Error::msg)?;
        if n == 0 {
            break;
        }
        bound.take(n).map_err(anyhow::Error::msg)?;
        c.r.read_exact(&mut buf[..n])
            .context("the download was cut off")?;
        out.write_all(&buf[..n]).context("writing the copy")?;
        *got += n as u64;
    }
    out.flush().context("writing the copy")?;
    drop(out);
    let done = c.reply("download")?;
    bound.finish().map_err(anyhow::Error::msg)?;
    if let Some(t) = temp {
        t.commit(info.mode & 0o777)?;
    }
    Ok(done)
}

/// `burrow mcp`'s binary read: at most `length` bytes of file `path` in
/// sandbox `id` from `offset`, and the file (its whole size in
/// `file_size`).
pub fn read_bytes(
    root: &Path,
    ns: &str,
    id: &str,
    path: &str,
    offset: u64,
    length: u64,
) -> Result<(Vec<u8>, CopyInfo)> {
    let req = SandboxRequest::Download(DownloadRequest {
        path: path.into(),
        offset,
        length: Some(length),
    });
    let mut c = connect(root, ns, id, &req)?;
    let mut data = Vec::new();
    let mut got = 0u64;
    let result = receive(&mut c, Dest::Buf(&mut data), &mut got);
    let recorded = result.as_ref().map(|i| ToolReply::Copied(i.clone()));
    let recorded = recorded.map_err(|e| anyhow::anyhow!("{e:#}"));
    c.record(id, &req, &recorded, got);
    result.map(|i| (data, i))
}

/// `burrow mcp`'s binary write: replace file `path` in sandbox `id` with
/// `data`, atomically (an existing file's mode is kept).
pub fn write_bytes(root: &Path, ns: &str, id: &str, path: &str, data: &[u8]) -> Result<CopyInfo> {
    let req = SandboxRequest::Upload(UploadRequest {
        path: path.into(),
        name: None,
        mode: None,
        size: Some(data.len() as u64),
    });
    let mut c = connect(root, ns, id, &req)?;
    let mut sent = 0u64;
    let result = send(&mut c, &mut &data[..], Some(data.len() as u64), &mut sent);
    let recorded = result.as_ref().map(|i| ToolReply::Copied(i.clone()));
    let recorded = recorded.map_err(|e| anyhow::anyhow!("{e:#}"));
    c.record(id, &req, &recorded, sent);
    result
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sides_parse_as_docker_cp_does() {
        assert_eq!(Side::parse("-").unwrap(), Side::Std);
        assert_eq!(
            Side::parse("c1:/tmp/a.bin").unwrap(),
            Side::Sandbox {
                id: "c1".into(),
                path: "/tmp/a.bin".into()
            }
        );
        assert_eq!(Side::parse("./a:b").unwrap(), Side::Local("./a:b".into()));
        assert_eq!(Side::parse("/x/a:b").unwrap(), Side::Local("/x/a:b".into()));
        assert_eq!(Side::parse("a.bin").unwrap(), Side::Local("a.bin".into()));
        assert!(Side::parse("c1:").is_err());
        assert!(Side::parse("").is_err());
        assert_eq!(base_name("/tmp/a.bin"), Some("a.bin"));
        assert_eq!(base_name("/tmp/d/"), Some("d"));
        assert_eq!(base_name("/"), None);
    }

    #[test]
    fn a_local_temporary_file_is_gone_unless_committed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("out.bin");
        std::fs::write(&target, b"old").unwrap();
        let t = LocalTemp::new(target.clone()).unwrap();
        t.file.as_ref().unwrap().write_all(b"partial").unwrap();
        drop(t);
        assert_eq!(std::fs::read(&target).unwrap(), b"old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let t = LocalTemp::new(target.clone()).unwrap();
        t.file.as_ref().unwrap().write_all(b"\x00\xffnew").unwrap();
        t.commit(0o755).unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), b"\x00\xffnew");
        let mode = std::fs::metadata(&target).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn reads_fill_whole_chunks() {
        let data = vec![7u8; COPY_CHUNK + 10];
        let mut r: &[u8] = &data;
        let mut buf = vec![0u8; COPY_CHUNK];
        assert_eq!(read_full(&mut r, &mut buf).unwrap(), COPY_CHUNK);
        assert_eq!(read_full(&mut r, &mut buf).unwrap(), 10);
        assert_eq!(read_full(&mut r, &mut buf).unwrap(), 0);
    }
}
