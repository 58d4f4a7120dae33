//! Control API: JSON lines on a unix socket. One request per line, one
//! response line each; every connected client also receives event lines.
//!
//! Requests: `{"cmd":"start"}`, `{"cmd":"pause"}`, `{"cmd":"resume"}`,
//! `{"cmd":"stop"}`, `{"cmd":"status"}`,
//! `{"cmd":"snapshot","dir":"/path","incremental":false}` (answered with a
//! `"snapshot"` object: sizes and time taken; the VM stays paused).
//! Responses: `{"ok":true,"state":"running"}` or `{"ok":false,"error":"..."}`.
//! Events: `{"event":"started"}`, `{"event":"paused"}`, `{"event":"resumed"}`,
//! `{"event":"exit","reason":"poweroff","success":true}`,
//! `{"event":"error","message":"..."}`.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::vmm::SnapshotInfo;

/// Longest request line accepted.
pub const MAX_LINE: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Command {
    Start,
    Pause,
    Resume,
    Stop,
    Status,
    /// Pause (if running) and write a snapshot to `dir`; the VM stays paused.
    Snapshot {
        dir: PathBuf,
        #[serde(default)]
        incremental: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    #[serde(flatten)]
    pub cmd: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Created,
    Running,
    Paused,
    Exited,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub state: Option<VmState>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub snapshot: Option<SnapshotInfo>,
}

impl Response {
    pub fn ok(state: VmState) -> Self {
        Self { ok: true, state: Some(state), error: None, snapshot: None }
    }
    pub fn err(msg: impl Into<String>) -> Self {
        Self { ok: false, state: None, error: Some(msg.into()), snapshot: None }
    }
    pub fn snapshot(state: VmState, info: SnapshotInfo) -> Self {
        Self { ok: true, state: Some(state), error: None, snapshot: Some(info) }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum Event {
    Started,
    Paused,
    Resumed,
    Exit { reason: String, success: bool },
    Error { message: String },
}

/// Parse one request line.
pub fn parse_request(line: &[u8]) -> Result<Request, String> {
    serde_json::from_slice(line).map_err(|e| format!("bad request: {e}"))
}

/// One connected API client.
pub struct Client {
    pub stream: UnixStream,
    buf: Vec<u8>,
}

impl Client {
    pub fn new(stream: UnixStream) -> std::io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(Self { stream, buf: Vec::new() })
    }

    /// Read what is available; returns complete lines, or None when the
    /// client is gone or misbehaved.
    pub fn read_lines(&mut self) -> Option<Vec<Vec<u8>>> {
        let mut chunk = [0u8; 1024];
        loop {
            match self.stream.read(&mut chunk) {
                Ok(0) => return None,
                Ok(n) => self.buf.extend_from_slice(chunk.get(..n)?),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return None,
            }
            if self.buf.len() > MAX_LINE * 4 {
                break;
            }
        }
        let mut lines = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            lines.push(line.get(..nl).map(<[u8]>::to_vec).unwrap_or_default());
        }
        if self.buf.len() > MAX_LINE {
            return None;
        }
        Some(lines)
    }

    /// Send one JSON line (small; a client that cannot take it is dropped).
    pub fn send<T: Serialize>(&mut self, msg: &T) -> bool {
        let Ok(mut line) = serde_json::to_vec(msg) else {
            return false;
        };
        line.push(b'\n');
        self.stream.set_nonblocking(false).is_ok()
            && self
                .stream
                .set_write_timeout(Some(std::time::Duration::from_secs(1)))
                .is_ok()
            && self.stream.write_all(&line).is_ok()
            && self.stream.set_nonblocking(true).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        assert_eq!(parse_request(br#"{"cmd":"pause"}"#).unwrap().cmd, Command::Pause);
        assert!(parse_request(br#"{"cmd":"explode"}"#).is_err());
        assert_eq!(
            parse_request(br#"{"cmd":"snapshot","dir":"/s"}"#).unwrap().cmd,
            Command::Snapshot { dir: "/s".into(), incremental: false }
        );
        assert_eq!(
            parse_request(br#"{"cmd":"snapshot","dir":"/s","incremental":true}"#).unwrap().cmd,
            Command::Snapshot { dir: "/s".into(), incremental: true }
        );
        assert!(parse_request(br#"{"cmd":"snapshot"}"#).is_err(), "dir is required");
        assert!(parse_request(b"\xff").is_err());
        assert_eq!(serde_json::to_string(&Response::ok(VmState::Running)).unwrap(), r#"{"ok":true,"state":"running"}"#);
        assert_eq!(serde_json::to_string(&Response::err("x")).unwrap(), r#"{"ok":false,"error":"x"}"#);
        assert_eq!(
            serde_json::to_string(&Event::Exit { reason: "poweroff".into(), success: true }).unwrap(),
            r#"{"event":"exit","reason":"poweroff","success":true}"#
        );
    }

    #[test]
    fn client_lines_and_limits() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut c = Client::new(a).unwrap();
        b.write_all(b"{\"cmd\":\"status\"}\n{\"cmd\":").unwrap();
        let lines = c.read_lines().unwrap();
        assert_eq!(lines, vec![b"{\"cmd\":\"status\"}".to_vec()]);
        b.write_all(&vec![b'x'; MAX_LINE + 10]).unwrap();
        assert!(c.read_lines().is_none(), "over-long line drops the client");
    }
}
