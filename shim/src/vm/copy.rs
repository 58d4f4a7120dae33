//! `burrow cp`: a file's bytes into or out of a sandbox's container over
//! the control socket, in frames ([`frame`]) of at most [`COPY_CHUNK`]
//! bytes, one agent call each, so neither side holds the whole file.
//!
//! An upload goes to a temporary file beside its target (made before the
//! caller sends anything, so a missing directory is an error at once),
//! appended to frame by frame, and renamed over the target only when all
//! of it came; on any failure (the caller going away included) the
//! temporary file is removed and the target is as it was. A download
//! sends the size it found first and never more than that, however much
//! the guest answers.

use std::time::Duration;

use burrow_protocol::agent as pb;
use burrow_vmm_api::sandbox_control::SandboxReply;
use burrow_vmm_api::sandbox_tools::{
    frame, CopyInfo, DownloadRequest, ToolReply, UploadRequest, COPY_CHUNK, MAX_COPY,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;

use super::agent::Agent;
use super::VmSandbox;
use crate::sandbox::{Result, SandboxError};

/// Longest the shim waits for the caller's next frame of an upload.
const FRAME_WAIT: Duration = Duration::from_secs(600);

/// Longest name a temporary file's name is built from.
const MAX_TEMP_STEM: usize = 128;

/// `parent` and final component of guest path `path` (`/` joined).
fn split(path: &str) -> Result<(&str, &str)> {
    let trimmed = path.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((_, name)) if name.is_empty() || name == "." || name == ".." => Err(
            SandboxError::InvalidArgument(format!("{path} does not name a file")),
        ),
        Some(("", name)) => Ok(("/", name)),
        Some((parent, name)) => Ok((parent, name)),
        None if trimmed.is_empty() || trimmed == "." || trimmed == ".." => Err(
            SandboxError::InvalidArgument(format!("{path:?} does not name a file")),
        ),
        None => Ok((".", trimmed)),
    }
}

/// `dir/name`.
fn join(dir: &str, name: &str) -> String {
    if dir.ends_with('/') {
        format!("{dir}{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// A fresh temporary name beside `path`: `.NAME.burrow-cp-RANDOM`.
fn temp_beside(path: &str) -> Result<String> {
    let (parent, name) = split(path)?;
    let stem = &name[..name.floor_char_boundary(MAX_TEMP_STEM)];
    let mut random = [0u8; 8];
    getrandom(&mut random);
    Ok(join(
        parent,
        &format!(".{stem}.burrow-cp-{:016x}", u64::from_ne_bytes(random)),
    ))
}

/// Random bytes for temporary names (uniqueness, not secrecy: the clock
/// and a counter when the kernel has none to give).
fn getrandom(buf: &mut [u8]) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // SAFETY: buf is valid for writes of its length.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), libc::GRND_NONBLOCK) };
    if usize::try_from(n).ok() != Some(buf.len()) {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos() as u64;
        let v = t ^ NEXT.fetch_add(1, Ordering::Relaxed).rotate_left(40);
        for (b, s) in buf.iter_mut().zip(v.to_ne_bytes()) {
            *b = s;
        }
    }
}

/// An upload being received: where it goes and where it is meanwhile.
struct Upload {
    agent: Agent,
    gid: String,
    target: String,
    temp: String,
    mode: u32,
}

impl VmSandbox {
    /// Resolve an upload's target (a directory means `name` in it), check
    /// its directory exists and make the (empty) temporary file beside it.
    async fn upload_start(&self, r: &UploadRequest) -> Result<Upload> {
        frame::Bound::new(r.size).map_err(SandboxError::InvalidArgument)?;
        let (agent, gid) = self.tool_agent().await?;
        let mut target = r.path.clone();
        let existing = match agent.stat(&gid, &target).await {
            Ok(info) => Some(info),
            Err(SandboxError::NotFound(_)) => None,
            Err(e) => return Err(e),
        };
        let existing = match existing {
            Some(info) if info.type_.enum_value() == Ok(pb::FileType::DIRECTORY) => {
                let Some(name) = r.name.as_deref() else {
                    return Err(SandboxError::InvalidArgument(format!(
                        "{target} is a directory"
                    )));
                };
                if name.is_empty() || name.contains('/') || name == "." || name == ".." {
                    return Err(SandboxError::InvalidArgument(format!(
                        "{name:?} is not a file name"
                    )));
                }
                target = join(&target, name);
                match agent.stat(&gid, &target).await {
                    Ok(info) => Some(info),
                    Err(SandboxError::NotFound(_)) => None,
                    Err(e) => return Err(e),
                }
            }
            other => other,
        };
        let kept = match &existing {
            Some(info) if info.type_.enum_value() == Ok(pb::FileType::DIRECTORY) => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{target} is a directory"
                )))
            }
            Some(info) if info.type_.enum_value() == Ok(pb::FileType::REGULAR) => {
                info.mode & 0o7777
            }
            Some(_) => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{target} is not a regular file"
                )))
            }
            None => 0,
        };
        if target.ends_with('/') {
            return Err(SandboxError::NotFound(format!(
                "no directory {target} in the container"
            )));
        }
        let (parent, _) = split(&target)?;
        match agent.stat(&gid, parent).await {
            Ok(info) if info.type_.enum_value() == Ok(pb::FileType::DIRECTORY) => {}
            Ok(_) => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{parent} is not a directory"
                )))
            }
            Err(SandboxError::NotFound(_)) => {
                return Err(SandboxError::NotFound(format!(
                    "no directory {parent} in the container (burrow cp makes no directories)"
                )))
            }
            Err(e) => return Err(e),
        }
        let mode = r.mode.map_or(kept, |m| m & 0o777);
        let mode = if mode == 0 { 0o644 } else { mode };
        let temp = temp_beside(&target)?;
        agent.put_file(&gid, &temp, Vec::new(), mode, false).await?;
        Ok(Upload {
            agent,
            gid,
            target,
            temp,
            mode,
        })
    }

    /// Resolve a download: the regular file's size and mode, and the bytes
    /// of it to send (`offset` and `length` applied).
    async fn download_start(&self, r: &DownloadRequest) -> Result<(Agent, String, CopyInfo)> {
        let (agent, gid) = self.tool_agent().await?;
        let info = agent.stat(&gid, &r.path).await?;
        match info.type_.enum_value() {
            Ok(pb::FileType::REGULAR) => {}
            Ok(pb::FileType::DIRECTORY) => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{} is a directory (burrow cp copies single files)",
                    r.path
                )))
            }
            Ok(pb::FileType::SYMLINK) => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{} is a symbolic link (to {}); copy its target",
                    r.path,
                    super::tools::cut(info.symlink_target)
                )))
            }
            _ => {
                return Err(SandboxError::InvalidArgument(format!(
                    "{} is not a regular file",
                    r.path
                )))
            }
        }
        if r.offset > info.size {
            return Err(SandboxError::OutOfRange(format!(
                "offset {} is past the end of {} ({} bytes)",
                r.offset, r.path, info.size
            )));
        }
        let rest = info.size - r.offset;
        let size = r.length.map_or(rest, |l| l.min(rest));
        if size > MAX_COPY {
            return Err(SandboxError::InvalidArgument(format!(
                "{}: {}",
                r.path,
                frame::too_big(size)
            )));
        }
        Ok((
            agent,
            gid,
            CopyInfo {
                path: r.path.clone(),
                size,
                mode: info.mode & 0o7777,
                file_size: Some(info.size),
            },
        ))
    }
}

fn line(state: &str, r: std::result::Result<ToolReply, String>) -> Vec<u8> {
    burrow_vmm_api::to_line(&SandboxReply::tool(state, r))
}

/// Serve an upload: `ready`, then the caller's frames from `rd` into the
/// temporary file, then the rename and the final reply.
pub(super) async fn upload<R: AsyncRead + Unpin>(
    sb: &VmSandbox,
    r: UploadRequest,
    mut w: OwnedWriteHalf,
    mut rd: BufReader<tokio::io::Take<R>>,
) -> std::io::Result<()> {
    let _busy = sb.busy();
    let up = match sb.upload_start(&r).await {
        Ok(up) => up,
        Err(e) => {
            w.write_all(&line(sb.vm.phase().name(), Err(e.to_string())))
                .await?;
            return w.shutdown().await;
        }
    };
    let info = |size| CopyInfo {
        path: up.target.clone(),
        size,
        mode: up.mode,
        file_size: None,
    };
    let ready = line(
        sb.vm.phase().name(),
        Ok(ToolReply::Ready(info(r.size.unwrap_or(0)))),
    );
    let mut result = match w.write_all(&ready).await {
        Ok(()) => {
            // The frames are bounded one by one and in total, not by the
            // request line's limit.
            rd.get_mut().set_limit(u64::MAX);
            receive(&up, r.size, &mut rd).await
        }
        Err(e) => Err(format!("the caller went away: {e}")),
    };
    if let Ok(n) = result {
        result = up
            .agent
            .rename(&up.gid, &up.temp, &up.target)
            .await
            .map(|()| n)
            .map_err(|e| e.to_string());
    }
    if let Err(e) = &result {
        tracing::info!("burrow cp to {}: {e}; removing {}", up.target, up.temp);
        if let Err(e) = up.agent.remove_file(&up.gid, &up.temp).await {
            tracing::warn!("burrow cp: removing {}: {e}", up.temp);
        }
    }
    let answer = result.map(|n| ToolReply::Copied(info(n)));
    w.write_all(&line(sb.vm.phase().name(), answer)).await?;
    w.shutdown().await
}

/// Append the caller's frames to the upload's temporary file until the
/// end frame: the bytes received.
async fn receive<R: AsyncRead + Unpin>(
    up: &Upload,
    announced: Option<u64>,
    rd: &mut R,
) -> std::result::Result<u64, String> {
    let mut bound = frame::Bound::new(announced)?;
    loop {
        let mut h = [0u8; 4];
        read_frame_part(rd, &mut h).await?;
        let n = frame::parse(h)?;
        if n == 0 {
            return bound.finish();
        }
        bound.take(n)?;
        let mut data = vec![0u8; n];
        read_frame_part(rd, &mut data).await?;
        up.agent
            .put_file(&up.gid, &up.temp, data, up.mode, true)
            .await
            .map_err(|e| e.to_string())?;
    }
}

async fn read_frame_part<R: AsyncRead + Unpin>(
    rd: &mut R,
    buf: &mut [u8],
) -> std::result::Result<(), String> {
    match tokio::time::timeout(FRAME_WAIT, rd.read_exact(buf)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Err("the upload was cut off before its end".into())
        }
        Ok(Err(e)) => Err(format!("reading the upload: {e}")),
        Err(_) => Err(format!(
            "no data came for {} s: the upload is given up",
            FRAME_WAIT.as_secs()
        )),
    }
}

/// Serve a download: `ready` with the size, the file's bytes in frames
/// (never more than that size), the end frame and the final reply.
pub(super) async fn download(
    sb: &VmSandbox,
    r: DownloadRequest,
    mut w: OwnedWriteHalf,
) -> std::io::Result<()> {
    let _busy = sb.busy();
    let (agent, gid, info) = match sb.download_start(&r).await {
        Ok(x) => x,
        Err(e) => {
            w.write_all(&line(sb.vm.phase().name(), Err(e.to_string())))
                .await?;
            return w.shutdown().await;
        }
    };
    w.write_all(&line(
        sb.vm.phase().name(),
        Ok(ToolReply::Ready(info.clone())),
    ))
    .await?;
    let end = r.offset.saturating_add(info.size);
    let mut offset = r.offset;
    let mut result = Ok(());
    while offset < end {
        let want = usize::try_from(end - offset)
            .unwrap_or(COPY_CHUNK)
            .min(COPY_CHUNK);
        // The agent wrapper refuses more than `want` bytes.
        let data = match agent.read_file(&gid, &r.path, offset, want).await {
            Ok((data, _, _)) => data,
            Err(e) => {
                result = Err(e.to_string());
                break;
            }
        };
        if data.is_empty() {
            result = Err(format!(
                "{} ended at {offset} bytes while it was copied ({} were announced)",
                r.path,
                end - r.offset
            ));
            break;
        }
        w.write_all(&frame::header(data.len())).await?;
        w.write_all(&data).await?;
        offset += data.len() as u64;
    }
    w.write_all(&frame::header(0)).await?;
    let answer = result.map(|()| ToolReply::Copied(info));
    w.write_all(&line(sb.vm.phase().name(), answer)).await?;
    w.shutdown().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn temporary_names_sit_beside_the_target() {
        assert_eq!(split("/tmp/a.bin").unwrap(), ("/tmp", "a.bin"));
        assert_eq!(split("/a").unwrap(), ("/", "a"));
        assert_eq!(split("a").unwrap(), (".", "a"));
        assert_eq!(split("/tmp/dir/").unwrap(), ("/tmp", "dir"));
        for bad in ["/", "", "/tmp/..", "/tmp/.", ".."] {
            assert!(split(bad).is_err(), "{bad:?}");
        }
        let t = temp_beside("/tmp/a.bin").unwrap();
        assert!(t.starts_with("/tmp/.a.bin.burrow-cp-"), "{t}");
        assert_ne!(t, temp_beside("/tmp/a.bin").unwrap());
        assert!(temp_beside("/x").unwrap().starts_with("/.x.burrow-cp-"));
        let long = format!("/d/{}", "é".repeat(200));
        let t = temp_beside(&long).unwrap();
        assert!(t.len() < 3 + 1 + MAX_TEMP_STEM + 30, "{t}");
        assert_eq!(join("/", "a"), "/a");
        assert_eq!(join("/tmp", "a"), "/tmp/a");
    }
}
