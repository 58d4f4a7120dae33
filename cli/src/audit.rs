//! The audit log: every tool call made through this CLI (its verbs and
//! `burrow mcp`) is appended to `<sandbox state dir>/audit.jsonl` on the
//! host, one JSON line each: time, tool, arguments (secrets redacted, file
//! contents as their size), result size, exit status, duration, error.
//! An interactive exec's input (typed at a terminal or piped) is recorded
//! too: its size and its first [`MAX_ARG`] bytes, redacted ([`Typed`]).
//! `burrow audit ID [--json]` prints it. The file lives beside the
//! sandbox's control socket, so it outlasts hibernation and wake; it is
//! bounded (the oldest half is dropped past [`MAX_LOG`]).

use std::io::{BufRead, BufReader, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::ToolReply;
use serde::{Deserialize, Serialize};

use crate::mcp::redact::redact;

/// The log's file name in a sandbox's state directory.
pub const AUDIT_LOG: &str = "audit.jsonl";
/// Largest log kept; past it the older half goes.
const MAX_LOG: u64 = 8 << 20;
/// Longest argument string recorded.
const MAX_ARG: usize = 4096;

/// One tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Seconds since the epoch (UTC), with milliseconds.
    pub time: String,
    pub tool: String,
    /// The request's arguments, redacted.
    pub args: serde_json::Value,
    pub ok: bool,
    /// Bytes of the result (its JSON).
    pub result_bytes: u64,
    /// `exec`'s exit status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_status: Option<i32>,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// `s` redacted and cut to [`MAX_ARG`] bytes.
fn clean(s: &str) -> String {
    let mut t = redact(s, false).text;
    if t.len() > MAX_ARG {
        t.truncate(t.floor_char_boundary(MAX_ARG));
        t.push_str("[...]");
    }
    t
}

/// The arguments of `req` as recorded: strings redacted and bounded, a
/// write's content as its size.
pub fn args_of(req: &SandboxRequest) -> serde_json::Value {
    let mut v = serde_json::to_value(req).unwrap_or_default();
    if let Some(o) = v.as_object_mut() {
        o.remove("cmd");
        if let Some(content) = o.remove("content") {
            let n = content.as_str().map_or(0, str::len);
            o.insert("content".into(), format!("<{n} bytes>").into());
        }
    }
    scrub(&mut v);
    v
}

fn scrub(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::String(s) => *s = clean(s),
        serde_json::Value::Array(a) => a.iter_mut().for_each(scrub),
        serde_json::Value::Object(o) => o.values_mut().for_each(scrub),
        _ => {}
    }
}

/// The entry for `req`, answered with `result` after `took`.
pub fn entry(
    req: &SandboxRequest,
    result: &Result<ToolReply>,
    took: Duration,
    now: SystemTime,
) -> Entry {
    let secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let (ok, result_bytes, exit_status, error) = match result {
        Ok(r) => (
            true,
            serde_json::to_vec(r).map_or(0, |b| b.len() as u64),
            match r {
                ToolReply::Exec(out) => Some(out.status()),
                ToolReply::Attach(out) => out.status(),
                _ => None,
            },
            None,
        ),
        Err(e) => (false, 0, None, Some(clean(&format!("{e:#}")))),
    };
    Entry {
        time: format!("{secs:.3}"),
        tool: req.name().into(),
        args: args_of(req),
        ok,
        result_bytes,
        exit_status,
        duration_ms: u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
        error,
    }
}

/// What an interactive exec read from its input (typed or piped): how
/// many bytes, and the first [`MAX_ARG`] of them, kept as they are read.
#[derive(Debug, Clone, Default)]
pub struct Typed(Arc<Mutex<(u64, Vec<u8>)>>);

impl Typed {
    /// `input`, with what is read from it recorded here.
    pub fn tee(&self, input: Box<dyn Read + Send>) -> Box<dyn Read + Send> {
        Box::new(Tee {
            input,
            typed: self.clone(),
        })
    }

    fn add(&self, data: &[u8]) {
        let mut g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        g.0 += data.len() as u64;
        let room = (MAX_ARG + 1).saturating_sub(g.1.len());
        let keep = data.get(..room.min(data.len())).unwrap_or_default();
        g.1.extend_from_slice(keep);
    }

    /// Record it in `e`'s arguments: `input_bytes`, and `input` as text
    /// (redacted, control characters escaped by JSON, cut with `[...]`).
    pub fn note(&self, e: &mut Entry) {
        let g = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let mut text = clean(&String::from_utf8_lossy(&g.1));
        if g.0 > g.1.len() as u64 && !text.ends_with("[...]") {
            text.push_str("[...]");
        }
        e.args["input_bytes"] = g.0.into();
        e.args["input"] = text.into();
    }
}

struct Tee {
    input: Box<dyn Read + Send>,
    typed: Typed,
}

impl Read for Tee {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.input.read(buf)?;
        self.typed.add(buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

/// The audit log of the sandbox whose state directory is `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join(AUDIT_LOG)
}

/// Append `e` to the log in `dir` (private to its owner); past
/// [`MAX_LOG`], keep only the newer half.
pub fn append(dir: &Path, e: &Entry) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let p = path(dir);
    let mut line = serde_json::to_vec(e)?;
    line.push(b'\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(&p)
        .with_context(|| format!("opening {}", p.display()))?;
    f.write_all(&line)?;
    if f.metadata()?.len() > MAX_LOG {
        let mut r = std::fs::File::open(&p)?;
        r.seek(std::io::SeekFrom::Start(MAX_LOG / 2))?;
        let mut rest = Vec::new();
        r.take(MAX_LOG).read_to_end(&mut rest)?;
        // From the first whole line on.
        let start = rest
            .iter()
            .position(|&b| b == b'\n')
            .map_or(rest.len(), |i| i + 1);
        let tmp = p.with_extension("jsonl.tmp");
        std::fs::write(&tmp, &rest[start..])?;
        std::fs::rename(&tmp, &p)?;
    }
    Ok(())
}

/// The entries of the log in `dir` (lines that do not parse are skipped).
pub fn read(dir: &Path) -> Result<Vec<Entry>> {
    let p = path(dir);
    let f = match std::fs::File::open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("opening {}", p.display())),
    };
    Ok(BufReader::new(f.take(MAX_LOG * 2))
        .lines()
        .map_while(std::result::Result::ok)
        .filter_map(|l| serde_json::from_str(&l).ok())
        .collect())
}

/// One entry as a line of text.
pub fn text(e: &Entry) -> String {
    let status = match (&e.error, e.exit_status) {
        (Some(err), _) => format!("error: {err}"),
        (None, Some(s)) => format!("exit {s}"),
        (None, None) => "ok".into(),
    };
    format!(
        "{} {:<10} {} {} bytes {} ms {status}",
        e.time, e.tool, e.args, e.result_bytes, e.duration_ms
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use burrow_vmm_api::sandbox_tools::{ExecOutput, ExecRequest, WriteRequest};

    #[test]
    fn entries_are_redacted_bounded_and_read_back() {
        let d = tempfile::tempdir().unwrap();
        let exec = SandboxRequest::Exec(ExecRequest {
            args: vec![
                "sh".into(),
                "-c".into(),
                "curl -H 'Authorization: Bearer abcdefgh12345'".into(),
            ],
            cwd: None,
            env: vec!["GITHUB_TOKEN=ghp_0123456789abcdefghijklmnopqrstuvwxyzAB".into()],
            timeout_secs: 5,
            max_output: None,
            ..Default::default()
        });
        let out = Ok(ToolReply::Exec(ExecOutput {
            stdout: "hi\n".into(),
            exit_code: Some(3),
            ..Default::default()
        }));
        let e = entry(
            &exec,
            &out,
            Duration::from_millis(1500),
            SystemTime::UNIX_EPOCH,
        );
        let line = serde_json::to_string(&e).unwrap();
        assert!(
            !line.contains("abcdefgh12345") && !line.contains("ghp_0123"),
            "{line}"
        );
        assert!(line.contains("[REDACTED:"), "{line}");
        assert_eq!((e.exit_status, e.duration_ms, e.ok), (Some(3), 1500, true));
        append(d.path(), &e).unwrap();
        let write = SandboxRequest::Write(WriteRequest {
            path: "/a".into(),
            content: "x".repeat(100_000),
        });
        let failed = Err(anyhow::anyhow!("no space"));
        let w = entry(&write, &failed, Duration::ZERO, SystemTime::UNIX_EPOCH);
        assert_eq!(w.args["content"], "<100000 bytes>");
        append(d.path(), &w).unwrap();
        let back = read(d.path()).unwrap();
        assert_eq!(back, vec![e, w]);
        assert!(
            text(&back[1]).contains("error: no space"),
            "{}",
            text(&back[1])
        );
        assert!(text(&back[0]).contains("exit 3"));
    }

    #[test]
    fn typed_input_is_counted_kept_in_part_and_redacted() {
        let exec = SandboxRequest::Exec(ExecRequest {
            args: vec!["sh".into()],
            ..Default::default()
        });
        let typed = Typed::default();
        let mut input = format!(
            "echo hi\r\x7fexport AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY\n{}",
            "y".repeat(3 * MAX_ARG)
        )
        .into_bytes();
        input.push(0xff);
        let mut tee = typed.tee(Box::new(std::io::Cursor::new(input.clone())));
        let mut read = Vec::new();
        tee.read_to_end(&mut read).unwrap();
        assert_eq!(read, input, "the tee passes everything through");
        let mut e = entry(
            &exec,
            &Ok(ToolReply::Exec(ExecOutput::default())),
            Duration::ZERO,
            SystemTime::UNIX_EPOCH,
        );
        typed.note(&mut e);
        assert_eq!(e.args["input_bytes"], input.len() as u64);
        let text = e.args["input"].as_str().unwrap();
        assert!(text.starts_with("echo hi\r\u{7f}export "), "{text:?}");
        assert!(!text.contains("wJalrXUtnFEMI"), "redacted: {text}");
        assert!(
            text.ends_with("[...]") && text.len() <= MAX_ARG + 5,
            "{}",
            text.len()
        );
        let line = serde_json::to_string(&e).unwrap();
        assert!(
            line.contains("echo hi\\r") && !line.bytes().any(|b| b < 0x20),
            "control characters escaped: {line}"
        );
        let none = Typed::default();
        let mut e = entry(
            &exec,
            &Ok(ToolReply::Exec(ExecOutput::default())),
            Duration::ZERO,
            SystemTime::UNIX_EPOCH,
        );
        none.note(&mut e);
        assert_eq!(
            (e.args["input_bytes"].as_u64(), e.args["input"].as_str()),
            (Some(0), Some(""))
        );
    }
}
