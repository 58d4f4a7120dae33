//! The VMM control API: JSON lines on the unix socket given with `--api`.
//! One [`Request`] per line, one [`Response`] line each; every connected
//! client also receives [`Event`] lines, which may come before a response
//! ([`Line`] tells them apart).
//!
//! ```text
//! {"cmd":"pause"}                                  -> {"ok":true,"state":"paused"}
//! {"cmd":"snapshot","dir":"/s","incremental":false} -> {"ok":true,"state":"paused","snapshot":{...}}
//! {"cmd":"attach_disk","slot":0,"path":"/c.img","read_only":false} -> {"ok":true,"state":"running"}
//! {"cmd":"set_vcpus","count":2}                   -> {"ok":true,"state":"running"}
//! {"cmd":"resize_memory","mib":768}                -> {"ok":true,"state":"running","memory":{...}}
//! {"cmd":"resume"} (VM exited)                     -> {"ok":false,"error":{"kind":"invalid_state","message":"..."}}
//! events: {"event":"paused"}, {"event":"exit","reason":"poweroff","success":true}, ...
//! ```

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ErrorKind};

/// Longest request or response line.
pub const MAX_LINE: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "lowercase")]
pub enum Command {
    /// Run the vCPUs of a VM started with `--paused`.
    Start,
    Pause,
    Resume,
    /// End the VM (the VMM exits with status 0).
    Stop,
    Status,
    /// Pause (if running) and write a snapshot to `dir`; the VM stays paused.
    /// A client may pass two empty files with the request (`SCM_RIGHTS`:
    /// memory, then state): the VMM writes into those and records `dir`
    /// (absolute) as where they are. A jailed VMM sees no snapshot
    /// directory, so this is how the shim takes every snapshot.
    Snapshot {
        dir: PathBuf,
        #[serde(default)]
        incremental: bool,
    },
    /// Back block slot `slot` (`--disk-slots`) with `path`, replacing what
    /// it had; the guest sees the new capacity (config-change interrupt).
    #[serde(rename = "attach_disk")]
    AttachDisk {
        slot: u32,
        path: PathBuf,
        #[serde(default)]
        read_only: bool,
    },
    /// Empty block slot `slot` (its capacity becomes 0).
    #[serde(rename = "detach_disk")]
    DetachDisk {
        slot: u32,
    },
    /// Let the first `count` vCPUs run (`--max-vcpus`): the guest can then
    /// bring the new ones online. Fewer than run hold those past `count`
    /// again (the guest must have taken them offline first); more than the
    /// VM has is an error.
    #[serde(rename = "set_vcpus")]
    SetVcpus {
        count: u8,
    },
    /// Ask the guest to make its memory `mib` MiB in all (between `--mem`
    /// and `--mem-max`, in 2 MiB steps) through virtio-mem. Answered once
    /// the request is set; the guest plugs (or unplugs) asynchronously:
    /// [`Response::memory`] (from `status`) says how far it is.
    #[serde(rename = "resize_memory")]
    ResizeMemory {
        mib: u64,
    },
}

/// One request line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    #[serde(flatten)]
    pub cmd: Command,
}

impl Request {
    /// Parse one request line.
    pub fn parse(line: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(line)
            .map_err(|e| ApiError::new(ErrorKind::InvalidRequest, format!("bad request: {e}")))
    }
}

impl From<Command> for Request {
    fn from(cmd: Command) -> Self {
        Self { cmd }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Created,
    Running,
    Paused,
    Exited,
}

/// What the API answers for a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotInfo {
    pub dir: PathBuf,
    pub incremental: bool,
    /// Size of `<dir>/state`.
    pub state_bytes: u64,
    /// Apparent size of `<dir>/memory`.
    pub memory_bytes: u64,
    /// Pages actually written (non-zero ones in a full snapshot, dirty ones
    /// in an incremental one).
    pub memory_pages: u64,
    pub took_ms: u64,
}

/// Guest memory of a VM started with `--mem-max`, all in MiB and all
/// totals (`--mem` included).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryInfo {
    /// `--mem`: memory the VM always has.
    pub base_mib: u64,
    /// `--mem-max`: the most `resize_memory` may ask for.
    pub max_mib: u64,
    /// What the last `resize_memory` asked for (`base_mib` before any).
    pub requested_mib: u64,
    /// What the guest has now: `base_mib` plus what it plugged. Equal to
    /// `requested_mib` once the guest has followed a resize.
    pub plugged_mib: u64,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub state: Option<VmState>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub error: Option<ApiError>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub snapshot: Option<SnapshotInfo>,
    /// The VM's memory, in answers to `status` and `resize_memory` of a VM
    /// with `--mem-max` (absent otherwise and from older VMMs).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory: Option<MemoryInfo>,
}

/// A successful response's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub state: Option<VmState>,
    pub snapshot: Option<SnapshotInfo>,
    pub memory: Option<MemoryInfo>,
}

impl Response {
    pub fn ok(state: VmState) -> Self {
        Self {
            ok: true,
            state: Some(state),
            error: None,
            snapshot: None,
            memory: None,
        }
    }
    /// This answer with the VM's memory (if it has a virtio-mem device).
    pub fn with_memory(mut self, memory: Option<MemoryInfo>) -> Self {
        self.memory = memory;
        self
    }
    pub fn err(error: ApiError) -> Self {
        Self {
            ok: false,
            state: None,
            error: Some(error),
            snapshot: None,
            memory: None,
        }
    }
    pub fn snapshot(state: VmState, info: SnapshotInfo) -> Self {
        Self {
            ok: true,
            state: Some(state),
            error: None,
            snapshot: Some(info),
            memory: None,
        }
    }

    /// The answer, or the error the VMM reported.
    pub fn into_result(self) -> Result<Answer, ApiError> {
        if self.ok {
            Ok(Answer {
                state: self.state,
                snapshot: self.snapshot,
                memory: self.memory,
            })
        } else {
            Err(self.error.unwrap_or_else(|| {
                ApiError::new(ErrorKind::Internal, "the VMM refused without saying why")
            }))
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "lowercase")]
pub enum Event {
    Started,
    Paused,
    Resumed,
    /// The VM ended: `reason` is `reboot`, `poweroff`, `stopped`, `panic`,
    /// `triple-fault` or `error`; `success` for the first three.
    Exit {
        reason: String,
        success: bool,
    },
    Error {
        message: String,
    },
}

/// A line the VMM sends: an event or the response to a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Line {
    Event(Event),
    Response(Response),
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn requests() {
        let parse = |s: &[u8]| Request::parse(s).map(|r| r.cmd);
        assert_eq!(parse(br#"{"cmd":"pause"}"#).unwrap(), Command::Pause);
        assert_eq!(
            parse(br#"{"cmd":"explode"}"#).unwrap_err().kind,
            ErrorKind::InvalidRequest
        );
        assert_eq!(
            parse(br#"{"cmd":"snapshot","dir":"/s"}"#).unwrap(),
            Command::Snapshot {
                dir: "/s".into(),
                incremental: false
            }
        );
        assert_eq!(
            parse(br#"{"cmd":"snapshot","dir":"/s","incremental":true}"#).unwrap(),
            Command::Snapshot {
                dir: "/s".into(),
                incremental: true
            }
        );
        assert!(parse(br#"{"cmd":"snapshot"}"#).is_err(), "dir is required");
        assert_eq!(
            parse(br#"{"cmd":"attach_disk","slot":2,"path":"/c.img"}"#).unwrap(),
            Command::AttachDisk {
                slot: 2,
                path: "/c.img".into(),
                read_only: false
            }
        );
        assert_eq!(
            parse(br#"{"cmd":"detach_disk","slot":0}"#).unwrap(),
            Command::DetachDisk { slot: 0 }
        );
        assert!(parse(br#"{"cmd":"attach_disk","slot":-1,"path":"/c"}"#).is_err());
        assert_eq!(
            parse(br#"{"cmd":"set_vcpus","count":3}"#).unwrap(),
            Command::SetVcpus { count: 3 }
        );
        assert!(parse(br#"{"cmd":"set_vcpus","count":256}"#).is_err());
        assert_eq!(
            parse(br#"{"cmd":"resize_memory","mib":768}"#).unwrap(),
            Command::ResizeMemory { mib: 768 }
        );
        assert!(parse(br#"{"cmd":"resize_memory"}"#).is_err(), "mib is required");
        assert!(parse(br#"{"cmd":"resize_memory","mib":-1}"#).is_err());
        assert!(parse(b"\xff").is_err());
        // What a client writes is what the VMM parses.
        let cmd = Command::Snapshot {
            dir: "/a b".into(),
            incremental: true,
        };
        let line = crate::to_line(&Request::from(cmd.clone()));
        assert_eq!(line.last(), Some(&b'\n'));
        assert_eq!(parse(&line).unwrap(), cmd);
    }

    #[test]
    fn responses_and_events() {
        assert_eq!(
            serde_json::to_string(&Response::ok(VmState::Running)).unwrap(),
            r#"{"ok":true,"state":"running"}"#
        );
        let refused = Response::err(ApiError::new(ErrorKind::NoSpace, "x"));
        assert_eq!(
            serde_json::to_string(&refused).unwrap(),
            r#"{"ok":false,"error":{"kind":"no_space","message":"x"}}"#
        );
        assert_eq!(refused.into_result().unwrap_err().kind, ErrorKind::NoSpace);
        assert_eq!(
            serde_json::to_string(&Event::Exit {
                reason: "poweroff".into(),
                success: true
            })
            .unwrap(),
            r#"{"event":"exit","reason":"poweroff","success":true}"#
        );
        let line = |s: &str| serde_json::from_str::<Line>(s).unwrap();
        assert_eq!(line(r#"{"event":"paused"}"#), Line::Event(Event::Paused));
        assert_eq!(
            line(r#"{"ok":true,"state":"paused"}"#),
            Line::Response(Response::ok(VmState::Paused))
        );
        assert!(serde_json::from_str::<Line>(r#"{"hello":1}"#).is_err());
        // Memory in a status answer; older answers without it still parse.
        let m = MemoryInfo { base_mib: 256, max_mib: 1024, requested_mib: 768, plugged_mib: 512 };
        let with = Response::ok(VmState::Running).with_memory(Some(m));
        assert_eq!(
            serde_json::to_string(&with).unwrap(),
            r#"{"ok":true,"state":"running","memory":{"base_mib":256,"max_mib":1024,"requested_mib":768,"plugged_mib":512}}"#
        );
        assert_eq!(with.into_result().unwrap().memory, Some(m));
        assert_eq!(line(r#"{"ok":true,"state":"running"}"#), Line::Response(Response::ok(VmState::Running)));
    }
}
