//! `burrow sandbox ls|hibernate|wake|checkpoint`: talk to a running shim's control
//! socket (`<state_dir>/<namespace>/<id>/control.sock`, JSON lines:
//! `{"cmd":"hibernate"}` → `{"ok":true,"state":"asleep"}`).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// The control socket's name in a sandbox's state directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Default state directory (the shim's `state_dir`).
pub const DEFAULT_STATE_DIR: &str = "/run/burrow";
/// Longest reply read.
const MAX_REPLY: u64 = 64 * 1024;

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

/// Send one command to the sandbox whose state directory is `dir`; returns
/// the state it reports.
pub fn command(dir: &Path, cmd: &str, timeout: Duration) -> Result<String> {
    request(dir, &serde_json::json!({ "cmd": cmd }), timeout).map(|(state, _)| state)
}

/// Write named checkpoint `name` of the sandbox whose state directory is
/// `dir`; returns the state it reports and the checkpoint's directory.
pub fn checkpoint(dir: &Path, name: &str, timeout: Duration) -> Result<(String, String)> {
    let body = serde_json::json!({ "cmd": "checkpoint", "name": name });
    let (state, reply) = request(dir, &body, timeout)?;
    let at = reply
        .get("dir")
        .and_then(|v| v.as_str())
        .unwrap_or("?")
        .to_string();
    Ok((state, at))
}

/// Send `body` to the sandbox whose state directory is `dir`; returns the
/// state it reports and the whole reply.
fn request(
    dir: &Path,
    body: &serde_json::Value,
    timeout: Duration,
) -> Result<(String, serde_json::Value)> {
    let cmd = body.get("cmd").and_then(|c| c.as_str()).unwrap_or("?");
    let sock = dir.join(CONTROL_SOCKET);
    let mut s = UnixStream::connect(&sock)
        .with_context(|| format!("connecting to {} (is the sandbox running?)", sock.display()))?;
    s.set_read_timeout(Some(timeout))?;
    s.write_all(body.to_string().as_bytes())?;
    s.write_all(b"\n")?;
    let mut line = String::new();
    BufReader::new(s.take(MAX_REPLY))
        .read_line(&mut line)
        .with_context(|| format!("reading the reply to {cmd:?}"))?;
    let reply: serde_json::Value =
        serde_json::from_str(line.trim()).with_context(|| format!("bad reply {line:?}"))?;
    let state = reply
        .get("state")
        .and_then(|v| v.as_str())
        .unwrap_or("?")
        .to_string();
    if reply.get("ok").and_then(|v| v.as_bool()) != Some(true) {
        let err = reply.get("error").and_then(|v| v.as_str()).unwrap_or("?");
        bail!("{cmd} failed: {err} (sandbox is {state})");
    }
    Ok((state, reply))
}

/// Every sandbox with a control socket under `root`: (namespace, id, dir).
pub fn list(root: &Path) -> Vec<(String, String, PathBuf)> {
    let mut out = Vec::new();
    for ns in std::fs::read_dir(root).into_iter().flatten().flatten() {
        for sb in std::fs::read_dir(ns.path()).into_iter().flatten().flatten() {
            if sb.path().join(CONTROL_SOCKET).exists() {
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

/// `burrow sandbox ls` as text.
pub fn ls(root: &Path) -> String {
    let mut text = format!("{:<16} {:<40} STATE\n", "NAMESPACE", "ID");
    for (ns, id, dir) in list(root) {
        let state = command(&dir, "status", Duration::from_secs(5))
            .unwrap_or_else(|e| format!("unreachable ({e:#})"));
        text.push_str(&format!("{ns:<16} {id:<40} {state}\n"));
    }
    text
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn command_round_trip_and_errors() {
        let d = tempfile::tempdir().unwrap();
        let sb = d.path().join("default").join("s1");
        std::fs::create_dir_all(&sb).unwrap();
        let l = std::os::unix::net::UnixListener::bind(sb.join(CONTROL_SOCKET)).unwrap();
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
        assert_eq!(
            command(&sb, "hibernate", Duration::from_secs(5)).unwrap(),
            "asleep"
        );
        let e = command(&sb, "wake", Duration::from_secs(5)).unwrap_err();
        assert!(format!("{e:#}").contains("paused"), "{e:#}");
        let text = ls(d.path());
        assert!(
            text.contains("default") && text.contains("s1") && text.contains("running"),
            "{text}"
        );
        assert_eq!(
            checkpoint(&sb, "cp1", Duration::from_secs(5)).unwrap(),
            ("running".to_string(), "/s/.checkpoints/cp1".to_string())
        );
        t.join().unwrap();
    }
}
