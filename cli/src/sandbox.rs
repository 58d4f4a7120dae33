//! `burrow sandbox ls|hibernate|wake|checkpoint`: talk to a running shim's control
//! socket (`<state_dir>/<namespace>/<id>/control.sock`, one
//! [`SandboxRequest`] line in, one [`SandboxReply`] line out; the messages
//! are defined once in burrow-vmm-api, for the shim and this CLI).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
pub use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_control::{control_socket, SandboxReply};
use burrow_vmm_api::sandbox_tools::{OutputChunk, ToolReply};

/// Default state directory (the shim's `state_dir`).
pub const DEFAULT_STATE_DIR: &str = "/run/burrow";

/// `state_dir` from the burrow config (`BURROW_CONFIG` or
/// /etc/burrow/config.toml), else the default.
pub fn state_dir_from_config() -> PathBuf {
    let path = std::env::var_os("BURROW_CONFIG")
        .map_or_else(|| PathBuf::from("/etc/burrow/config.toml"), PathBuf::from);
    let mut text = String::new();
    let read = std::fs::File::open(&path)
        .and_then(|f| f.take(1 << 20).read_to_string(&mut text))
        .is_ok();
    if read {
        if let Ok(doc) = text.parse::<toml_edit::DocumentMut>() {
            if let Some(s) = doc.get("state_dir").and_then(|v| v.as_str()) {
                return PathBuf::from(s);
            }
        }
    }
    PathBuf::from(DEFAULT_STATE_DIR)
}

/// The state directory of sandbox `id` in `namespace`; refuses names that
/// are not plain path components.
pub fn sandbox_dir(root: &Path, namespace: &str, id: &str) -> Result<PathBuf> {
    for (what, v) in [("namespace", namespace), ("sandbox id", id)] {
        if v.is_empty() || v == "." || v == ".." || v.contains('/') || v.contains('\0') {
            bail!("invalid {what} {v:?}");
        }
    }
    Ok(root.join(namespace).join(id))
}

/// Send `req` to the sandbox whose state directory is `dir`; returns its
/// reply, or an error saying why the request failed and in which state the
/// sandbox is.
pub fn request(dir: &Path, req: &SandboxRequest, timeout: Duration) -> Result<SandboxReply> {
    let cmd = req.name();
    let sock = control_socket(dir);
    let mut s = burrow_vmm_api::sockpath::SocketPath::new(&sock)
        .and_then(|p| UnixStream::connect(p.path()))
        .with_context(|| format!("connecting to {} (is the sandbox running?)", sock.display()))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(&burrow_vmm_api::to_line(req))?;
    let mut line = String::new();
    BufReader::new(s.take(req.reply_limit()))
        .read_line(&mut line)
        .with_context(|| format!("reading the reply to {cmd:?}"))?;
    let reply: SandboxReply =
        serde_json::from_str(line.trim()).with_context(|| format!("bad reply {line:?}"))?;
    if !reply.ok {
        let err = reply.error.as_deref().unwrap_or("?");
        bail!("{cmd} failed: {err} (sandbox is {})", reply.state);
    }
    Ok(reply)
}

/// Send a streamed `exec` to the sandbox whose state directory is `dir`:
/// `on_chunk` gets each piece of output as it comes (each reply line
/// bounded by the request's reply limit), the final reply is returned.
/// `timeout` bounds each wait for a line (a command that prints nothing
/// for longer is given up on).
pub fn request_stream(
    dir: &Path,
    req: &SandboxRequest,
    timeout: Duration,
    mut on_chunk: impl FnMut(&OutputChunk) -> Result<()>,
) -> Result<SandboxReply> {
    let cmd = req.name();
    let sock = control_socket(dir);
    let mut s = burrow_vmm_api::sockpath::SocketPath::new(&sock)
        .and_then(|p| UnixStream::connect(p.path()))
        .with_context(|| format!("connecting to {} (is the sandbox running?)", sock.display()))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(&burrow_vmm_api::to_line(req))?;
    let mut r = BufReader::new(s);
    loop {
        let mut line = String::new();
        let n = (&mut r)
            .take(req.reply_limit())
            .read_line(&mut line)
            .with_context(|| format!("reading the reply to {cmd:?}"))?;
        if n == 0 {
            bail!("the shim closed the connection before {cmd:?} ended");
        }
        let reply: SandboxReply =
            serde_json::from_str(line.trim()).with_context(|| format!("bad reply {line:?}"))?;
        if !reply.ok {
            let err = reply.error.as_deref().unwrap_or("?");
            bail!("{cmd} failed: {err} (sandbox is {})", reply.state);
        }
        match &reply.tool {
            Some(ToolReply::Chunk(c)) => on_chunk(c)?,
            _ => return Ok(reply),
        }
    }
}

/// The state the sandbox whose state directory is `dir` reports.
pub fn status(dir: &Path, timeout: Duration) -> Result<String> {
    request(dir, &SandboxRequest::Status, timeout).map(|r| r.state)
}

/// Every sandbox with a control socket under `root`: (namespace, id, dir).
pub fn list(root: &Path) -> Vec<(String, String, PathBuf)> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(root).into_iter().flatten().flatten() {
        for sb in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            if control_socket(&sb.path()).exists() {
                out.push((
                    ns.file_name().to_string_lossy().into_owned(),
                    sb.file_name().to_string_lossy().into_owned(),
                    sb.path(),
                ));
            }
        }
    }
    out.sort();
    out
}

/// `burrow sandbox ls` as text; `verbose` adds, under each sandbox, where
/// its VM's start spent its time (the shim's phases file).
pub fn ls(root: &Path, verbose: bool) -> String {
    let mut text = format!("{:<16} {:<40} STATE\n", "NAMESPACE", "ID");
    for (ns, id, dir) in list(root) {
        let state =
            status(&dir, Duration::from_secs(5)).unwrap_or_else(|e| format!("unreachable ({e:#})"));
        text.push_str(&format!("{ns:<16} {id:<40} {state}\n"));
        if verbose {
            text.push_str(&format!("    {}\n", phases(&dir)));
        }
    }
    text
}

/// The one line the shim wrote about its VM's start (bounded).
fn phases(dir: &Path) -> String {
    let mut line = String::new();
    let read = std::fs::File::open(dir.join(burrow_vmm_api::sandbox_control::PHASES_FILE))
        .and_then(|f| f.take(4096).read_to_string(&mut line));
    match read {
        Ok(_) if !line.trim().is_empty() => line.trim().to_string(),
        _ => "no start timings recorded".into(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A state dir holding sandbox default/s1 whose control socket the
    /// test answers: the dir, the sandbox's dir, the listener.
    fn sandbox_listening() -> (tempfile::TempDir, PathBuf, std::os::unix::net::UnixListener) {
        let d = tempfile::tempdir().unwrap();
        let sb = d.path().join("default").join("s1");
        std::fs::create_dir_all(&sb).unwrap();
        let l = std::os::unix::net::UnixListener::bind(control_socket(&sb)).unwrap();
        (d, sb, l)
    }

    #[test]
    fn command_round_trip_and_errors() {
        let (d, sb, l) = sandbox_listening();
        let t = std::thread::spawn(move || {
            for reply in [
                "{\"ok\":true,\"state\":\"asleep\"}\n",
                "{\"ok\":false,\"state\":\"running\",\"error\":\"paused\"}\n",
                "{\"ok\":true,\"state\":\"running\"}\n",
                "{\"ok\":true,\"state\":\"running\",\"dir\":\"/s/.checkpoints/cp1\"}\n",
            ] {
                let (mut s, _) = l.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                assert!(line.contains("\"cmd\""), "{line}");
                if line.contains("checkpoint") {
                    assert!(line.contains("\"name\":\"cp1\""), "{line}");
                }
                s.write_all(reply.as_bytes()).unwrap();
            }
        });
        let t5 = Duration::from_secs(5);
        assert_eq!(
            request(&sb, &SandboxRequest::Hibernate, t5).unwrap().state,
            "asleep"
        );
        let e = request(&sb, &SandboxRequest::Wake, t5).unwrap_err();
        assert!(format!("{e:#}").contains("paused"), "{e:#}");
        let text = ls(d.path(), false);
        assert!(
            text.contains("default") && text.contains("s1") && text.contains("running"),
            "{text}"
        );
        let cp = SandboxRequest::Checkpoint { name: "cp1".into() };
        let reply = request(&sb, &cp, t5).unwrap();
        assert_eq!(reply.state, "running");
        assert_eq!(reply.dir, Some(PathBuf::from("/s/.checkpoints/cp1")));
        t.join().unwrap();
    }

    #[test]
    fn a_streamed_exec_hands_on_each_piece_then_returns_the_end() {
        let (_d, sb, l) = sandbox_listening();
        let t = std::thread::spawn(move || {
            for lines in [
                &[
                    r#"{"ok":true,"state":"running","tool":{"tool":"chunk","stream":"stdout","data":"first\n"}}"#,
                    r#"{"ok":true,"state":"running","tool":{"tool":"chunk","stream":"stderr","data":"oops\n"}}"#,
                    r#"{"ok":true,"state":"running","tool":{"tool":"exec","stdout":"","stderr":"","stdout_cut":0,"stderr_cut":0,"exit_code":7,"signal":null,"timed_out":false,"output_open":false}}"#,
                ][..],
                &[
                    r#"{"ok":true,"state":"running","tool":{"tool":"chunk","stream":"stdout","data":"x"}}"#,
                ],
                &[r#"{"ok":false,"state":"running","error":"no such container"}"#],
            ] {
                let (mut s, _) = l.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                assert!(line.contains("\"stream\":true"), "{line}");
                for reply in lines {
                    s.write_all(reply.as_bytes()).unwrap();
                    s.write_all(b"\n").unwrap();
                }
            }
        });
        let req = SandboxRequest::Exec(burrow_vmm_api::sandbox_tools::ExecRequest {
            args: vec!["sh".into()],
            stream: true,
            ..Default::default()
        });
        let t5 = Duration::from_secs(5);
        let mut got = Vec::new();
        let reply = request_stream(&sb, &req, t5, |c| {
            got.push((c.stream.clone(), c.data.clone()));
            Ok(())
        })
        .unwrap();
        assert_eq!(
            got,
            [
                ("stdout".to_string(), "first\n".to_string()),
                ("stderr".to_string(), "oops\n".to_string())
            ]
        );
        let Some(ToolReply::Exec(out)) = reply.tool else {
            panic!("{reply:?}")
        };
        assert_eq!(out.status(), 7);
        // A connection that ends before the final reply, and a refusal.
        let e = request_stream(&sb, &req, t5, |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("closed the connection"), "{e:#}");
        let e = request_stream(&sb, &req, t5, |_| Ok(())).unwrap_err();
        assert!(format!("{e:#}").contains("no such container"), "{e:#}");
        t.join().unwrap();
    }

    #[test]
    fn phases_are_the_shims_line_or_say_none() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(phases(d.path()), "no start timings recorded");
        let f = d.path().join(burrow_vmm_api::sandbox_control::PHASES_FILE);
        std::fs::write(&f, "created in 9 ms: root filesystem 1 ms\n").unwrap();
        assert_eq!(phases(d.path()), "created in 9 ms: root filesystem 1 ms");
    }
}
