//! The tool requests of the control socket (`burrow exec|read|write|ls|edit`):
//! what the CLI asks a sandbox's shim to do in its guest, and what comes
//! back. The shim forwards them to the guest agent (waking a hibernated VM
//! first) and bounds everything the guest returns before it answers:
//!
//! ```text
//! {"cmd":"exec","args":["sh","-c","exit 3"],"env":[],"timeout_secs":600}
//!     -> {"ok":true,"state":"running","tool":{"tool":"exec","stdout":"","stderr":"",...,"exit_code":3}}
//! {"cmd":"read","path":"/etc/hostname","lines":{"first":1,"last":null}}
//! {"cmd":"write","path":"/tmp/a","content":"hi\n"}
//! {"cmd":"ls","path":"/tmp"}
//! {"cmd":"edit","path":"/tmp/a","old":"hi","new":"ho"}
//! {"cmd":"detach","args":["sh","-c","make"],"env":[],"timeout_secs":0}
//!     -> {"ok":true,"state":"running","tool":{"tool":"detach","session":"s1","pid":42}}
//! {"cmd":"attach","session":"s1","from":0,"wait_secs":10}
//!     -> {..."tool":{"tool":"attach","output":"...","from":0,"next":812,"end":812,"done":false,...}}
//! {"cmd":"exec","args":["sh"],...,"stream":true,"tty":true,"tty_size":[24,80],"stdin":true}
//!     <- {"input":"data","data":"bHMNCg=="}  (more ExecInput lines up the same connection)
//!     -> {..."tool":{"tool":"chunk","stream":"stdout","data":"","bytes":"..."}} ... then the exec result
//! ```
//!
//! Text only: file contents and output travel as UTF-8 strings (output the
//! guest wrote that is not UTF-8 arrives with U+FFFD in its place), except
//! an interactive exec's input and output, which are bytes (base64), and
//! `burrow cp`'s file contents, which are raw bytes in frames after the
//! reply lines ([`frame`]):
//!
//! ```text
//! {"cmd":"upload","path":"/tmp/a.bin","name":"a.bin","mode":493,"size":5242880}
//!     -> {"ok":true,...,"tool":{"tool":"ready","path":"/tmp/a.bin","size":5242880,"mode":493}}
//!     <- frames: [u32 BE length][bytes] ... [0]
//!     -> {"ok":true,...,"tool":{"tool":"copied","path":"/tmp/a.bin","size":5242880,"mode":493}}
//! {"cmd":"download","path":"/tmp/a.bin"}
//!     -> {..."tool":{"tool":"ready","path":"/tmp/a.bin","size":5242880,"mode":493}}
//!     -> frames ... [0], then {..."tool":{"tool":"copied",...}} or an error line
//! ```

use serde::{Deserialize, Serialize};

/// Most lines one `read` returns.
pub const MAX_READ_LINES: u64 = 500;
/// Most bytes of text one `read` returns (a longer first line is cut).
pub const MAX_READ_TEXT: usize = 256 * 1024;
/// Most bytes a `read` scans to count the file's lines; past it the total
/// is unknown.
pub const MAX_READ_SCAN: u64 = 64 << 20;
/// Most bytes one `write` carries, and the largest file `edit` changes
/// (both are one atomic replacement in the guest).
pub const MAX_WRITE: usize = 1 << 20;
/// Most bytes of each output stream `exec` returns: the first and the last
/// half of it, with a marker saying how much was cut between.
pub const MAX_EXEC_OUTPUT: usize = 32 * 1024;
/// The largest per-stream cap a caller may ask `exec` for
/// ([`ExecRequest::max_output`]): `burrow mcp` keeps this much on the host
/// and pages through it.
pub const MAX_EXEC_OUTPUT_FULL: usize = 2 << 20;
/// Most bytes of page text or element list one browser call returns.
pub const MAX_BROWSE_TEXT: usize = 256 * 1024;
/// Longest URL `browse` takes.
pub const MAX_URL: usize = 64 * 1024;
/// The attribute each listed page element carries with its index.
pub const ELEMENT_INDEX_ATTR: &str = "data-burrow-idx";
/// Most entries one `ls` returns.
pub const MAX_LS_ENTRIES: u32 = 1000;
/// `exec`'s timeout when none is given, and the longest one taken.
pub const DEFAULT_EXEC_TIMEOUT_SECS: u64 = 600;
pub const MAX_EXEC_TIMEOUT_SECS: u64 = 24 * 3600;
/// The exit status `burrow exec` reports for a command it killed at its
/// timeout (as timeout(1) does).
pub const TIMED_OUT_STATUS: i32 = 124;

/// Run a command in the sandbox's container and collect its output.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    pub args: Vec<String>,
    /// Working directory in the container (default: the container's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// `K=V` added to (or replacing in) the container's environment.
    #[serde(default)]
    pub env: Vec<String>,
    /// Killed after this long (then the status is [`TIMED_OUT_STATUS`]).
    pub timeout_secs: u64,
    /// Bytes of each output stream to return (default and least
    /// [`MAX_EXEC_OUTPUT`], at most [`MAX_EXEC_OUTPUT_FULL`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_output: Option<u64>,
    /// `exec` only: send the output as it comes, as [`OutputChunk`] reply
    /// lines before the final one (whose [`ExecOutput`] then carries no
    /// output). A shim that predates it answers with one line, the output
    /// in it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stream: bool,
    /// Run the command on a terminal (a PTY in the guest: stdout carries
    /// both streams, with the terminal's line endings).
    #[serde(default, skip_serializing_if = "is_false")]
    pub tty: bool,
    /// The terminal's size, rows and columns (with `tty`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tty_size: Option<(u16, u16)>,
    /// A streamed `exec` only: interactive. The caller's input follows the
    /// request line on the same connection as [`ExecInput`] lines (its
    /// keystrokes or piped stdin, terminal resizes, the end of its input),
    /// and the output chunks carry raw bytes ([`OutputChunk::bytes`]).
    /// The caller keeps its side of the connection open until the final
    /// reply: the connection ending ends the command.
    #[serde(default, skip_serializing_if = "is_false")]
    pub stdin: bool,
}

/// Most bytes of input one [`ExecInput::Data`] line carries.
pub const MAX_INPUT_CHUNK: usize = 16 * 1024;
/// Longest [`ExecInput`] line the shim reads: a full chunk in base64 and
/// room for the rest.
pub const MAX_INPUT_LINE: u64 = (MAX_INPUT_CHUNK as u64).div_ceil(3) * 4 + 1024;

/// What the caller of an interactive `exec` ([`ExecRequest::stdin`]) sends
/// after its request line, one JSON line each:
///
/// ```text
/// {"input":"data","data":"ZWNobyBoaQ0="}     bytes for the command's stdin (base64)
/// {"input":"resize","rows":40,"cols":120}   the caller's terminal changed size
/// {"input":"eof"}                           the caller's input ended
/// ```
///
/// On a terminal the end of input is the terminal's EOF character (^D,
/// twice after a partial line); without one the command's stdin closes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "input", rename_all = "lowercase")]
pub enum ExecInput {
    Data {
        #[serde(with = "base64_bytes")]
        data: Vec<u8>,
    },
    Resize {
        rows: u16,
        cols: u16,
    },
    Eof,
}

impl ExecInput {
    /// One input line (with or without its newline), checked: at most
    /// [`MAX_INPUT_CHUNK`] bytes of data, a size of at least 1x1.
    pub fn parse(line: &[u8]) -> Result<Self, String> {
        let input: Self =
            serde_json::from_slice(line).map_err(|e| format!("bad input line: {e}"))?;
        match &input {
            Self::Data { data } if data.len() > MAX_INPUT_CHUNK => Err(format!(
                "an input line carries {} bytes, more than {MAX_INPUT_CHUNK}",
                data.len()
            )),
            Self::Resize { rows, cols } if *rows == 0 || *cols == 0 => {
                Err(format!("a terminal of {rows}x{cols} has no room"))
            }
            _ => Ok(input),
        }
    }
}

/// Bytes as a base64 string (standard alphabet, padded) in JSON.
mod base64_bytes {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text.as_bytes())
            .map_err(serde::de::Error::custom)
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// A piece of a streamed `exec`'s output ([`ExecRequest::stream`]), in the
/// order the command wrote it. Text: a character split between two reads
/// waits for the next piece; bytes that are not UTF-8 arrive as U+FFFD.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutputChunk {
    /// `stdout` or `stderr`.
    pub stream: String,
    pub data: String,
    /// An interactive exec's ([`ExecRequest::stdin`]) output: the bytes
    /// as the command wrote them (base64 in JSON; `data` is then empty).
    #[serde(default, skip_serializing_if = "Vec::is_empty", with = "base64_bytes")]
    pub bytes: Vec<u8>,
}

impl ExecRequest {
    /// The per-stream cap this request gets.
    pub fn output_cap(&self) -> usize {
        self.max_output.map_or(MAX_EXEC_OUTPUT, |m| {
            usize::try_from(m)
                .unwrap_or(MAX_EXEC_OUTPUT_FULL)
                .clamp(MAX_EXEC_OUTPUT, MAX_EXEC_OUTPUT_FULL)
        })
    }
}

/// Most bytes of a detached session's output one `attach` returns, and the
/// default.
pub const MAX_ATTACH_BYTES: u64 = 1 << 20;
/// Most bytes of output a detached session keeps in the guest (the
/// agent's `MAX_SESSION_BUFFER`); older output is dropped.
pub const SESSION_BUFFER: usize = 1 << 20;
/// Longest an `attach` waits for output (seconds).
pub const MAX_ATTACH_WAIT_SECS: u64 = 60;

/// Read on in a detached session (`burrow exec ID --attach SESSION`): its
/// output from byte `from`, waiting up to `wait_secs` for some if there is
/// none yet. The session lives in the guest; nothing of it is kept on the
/// host, so a caller reads on from its offset after a wake or a restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachRequest {
    pub session: String,
    #[serde(default)]
    pub from: u64,
    #[serde(default)]
    pub wait_secs: u64,
    /// At most this many bytes (default and most [`MAX_ATTACH_BYTES`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    /// While the command runs, end the piece after its last newline (or,
    /// in a full piece without one, its last space), so that a secret is
    /// not split between two pieces and redacted in neither (`burrow mcp`).
    #[serde(default)]
    pub whole_lines: bool,
}

/// A detached session started (`burrow exec ID --detach`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionStarted {
    pub session: String,
    pub pid: u32,
}

/// A piece of a detached session's output (stdout and stderr together, in
/// the order they came).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionOutput {
    /// Output from `from` (not UTF-8: U+FFFD in its place).
    pub output: String,
    /// Offset of the output's first byte: the one asked for, or later when
    /// the bytes before it were dropped (`dropped` says how many).
    pub from: u64,
    /// Where to read on from.
    pub next: u64,
    /// Bytes of output the command has written so far.
    pub end: u64,
    pub dropped: u64,
    /// The command exited and this reply carries the end of its output.
    pub done: bool,
    pub exit_code: Option<i32>,
    pub signal: Option<u32>,
    pub timed_out: bool,
}

impl SessionOutput {
    /// The status a finished session's command exited with, as
    /// [`ExecOutput::status`]; None while it runs.
    pub fn status(&self) -> Option<i32> {
        self.done.then(|| {
            ExecOutput {
                exit_code: self.exit_code,
                signal: self.signal,
                timed_out: self.timed_out,
                ..Default::default()
            }
            .status()
        })
    }
}

/// Lines `first..=last` (1-based) of a file; `last: None` means "to the
/// end". At most [`MAX_READ_LINES`] come back per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LineRange {
    pub first: u64,
    pub last: Option<u64>,
}

impl Default for LineRange {
    fn default() -> Self {
        Self {
            first: 1,
            last: None,
        }
    }
}

impl LineRange {
    /// The last line one call returns: `last`, but at most
    /// [`MAX_READ_LINES`] after `first`.
    pub fn last_served(&self) -> u64 {
        let cap = self.first.saturating_add(MAX_READ_LINES - 1);
        self.last.map_or(cap, |l| l.min(cap))
    }

    /// Refuse ranges that name no line.
    pub fn check(&self) -> Result<(), String> {
        if self.first == 0 {
            return Err("lines are counted from 1".into());
        }
        match self.last {
            Some(l) if l < self.first => Err(format!(
                "line range {}:{l} ends before it starts",
                self.first
            )),
            _ => Ok(()),
        }
    }
}

impl std::str::FromStr for LineRange {
    type Err = String;

    /// `A:B`, `A:` (to the end), `:B` (from line 1) or `A` (line A only).
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |v: &str| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| format!("bad line range {s:?}: want A:B, A: or :B"))
        };
        let r = match s.split_once(':') {
            None => {
                let n = num(s)?;
                Self {
                    first: n,
                    last: Some(n),
                }
            }
            Some((a, b)) => Self {
                first: if a.trim().is_empty() { 1 } else { num(a)? },
                last: if b.trim().is_empty() {
                    None
                } else {
                    Some(num(b)?)
                },
            },
        };
        r.check()?;
        Ok(r)
    }
}

/// Read lines of a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadRequest {
    pub path: String,
    #[serde(default)]
    pub lines: LineRange,
}

/// Replace a file atomically with `content` (its mode is kept; missing
/// parent directories are made).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteRequest {
    pub path: String,
    pub content: String,
}

/// List a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LsRequest {
    pub path: String,
}

/// Replace the one occurrence of `old` in a file with `new`; zero or
/// several occurrences are an error that changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EditRequest {
    pub path: String,
    pub old: String,
    pub new: String,
}

/// `burrow browse`: load `url` (if given) in the sandbox's browser, then
/// return the page's text, or with `elements` its visible interactive
/// elements (`[12] button "Submit"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrowseRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default)]
    pub elements: bool,
    /// Wait this long for the page to load (0: the agent's default, 30 s).
    #[serde(default)]
    pub timeout_secs: u64,
}

/// Click element `index` of the last element list (`burrow click`), or type
/// `text` into it (`burrow type`); the page's text after it comes back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ElementRequest {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

impl ElementRequest {
    /// The CSS selector of the element.
    pub fn selector(&self) -> String {
        format!("[{ELEMENT_INDEX_ATTR}=\"{}\"]", self.index)
    }
}

/// A screenshot of the sandbox's browser page (0: keep the viewport).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScreenshotRequest {
    #[serde(default)]
    pub width: u32,
    #[serde(default)]
    pub height: u32,
}

/// The page after a browser call.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrowseOutput {
    /// After a navigation: the URL (after redirects) and the title.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub title: Option<String>,
    /// Page text or element list, at most [`MAX_BROWSE_TEXT`] bytes.
    pub text: String,
    /// There was more than `text`.
    pub truncated: bool,
}

/// A PNG screenshot, base64.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScreenshotOutput {
    pub png_base64: String,
    pub width: u32,
    pub height: u32,
}

/// The largest file `burrow cp` moves either way (4 GiB); a larger one is
/// refused before anything is written.
pub const MAX_COPY: u64 = 4 << 30;
/// Most bytes of a file one frame carries (one agent call each).
pub const COPY_CHUNK: usize = 1 << 20;

/// `burrow cp LOCAL ID:PATH`: replace `path` in the container with the
/// bytes that follow in frames, atomically (a temporary file beside it,
/// renamed over it once all of it arrived; removed if not). The parent
/// directory must exist. When `path` is a directory, the file goes into
/// it as `name`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadRequest {
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Permission bits (the local file's); None keeps an existing file's,
    /// else 0644.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<u32>,
    /// The size, when known beforehand (refused if over [`MAX_COPY`];
    /// the upload fails unless exactly this many bytes come).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
}

/// `burrow cp ID:PATH LOCAL`: the bytes of regular file `path`, from
/// `offset`, at most `length` of them (None: to the end), in frames.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DownloadRequest {
    pub path: String,
    #[serde(default)]
    pub offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub length: Option<u64>,
}

/// The file a copy moves: its path in the container (a directory's
/// resolved to the file in it), size in bytes (for `ready` on a download,
/// the bytes that will come; on an upload, the announced size or 0) and
/// permission bits.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyInfo {
    pub path: String,
    pub size: u64,
    pub mode: u32,
    /// A download: the whole file's size (`size` is what is sent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_size: Option<u64>,
}

/// The framing of `burrow cp`'s bytes on the control connection: each
/// frame a 4-byte big-endian length and that many bytes (at most
/// [`COPY_CHUNK`]); a zero length ends them.
pub mod frame {
    use super::{COPY_CHUNK, MAX_COPY};

    /// The header of a frame of `len` bytes.
    pub fn header(len: usize) -> [u8; 4] {
        u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes()
    }

    /// The length a header announces, refused past [`COPY_CHUNK`].
    pub fn parse(h: [u8; 4]) -> Result<usize, String> {
        let n = u32::from_be_bytes(h) as usize;
        if n > COPY_CHUNK {
            return Err(format!(
                "a frame of {n} bytes is more than the {COPY_CHUNK} one may carry"
            ));
        }
        Ok(n)
    }

    /// Counts a copy's bytes against its bound: the size announced (no
    /// more may come, and exactly that many must) or [`MAX_COPY`].
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct Bound {
        announced: Option<u64>,
        got: u64,
    }

    impl Bound {
        /// A copy of `announced` bytes (None: unknown, up to
        /// [`MAX_COPY`]); refused when that is over [`MAX_COPY`].
        pub fn new(announced: Option<u64>) -> Result<Self, String> {
            match announced {
                Some(n) if n > MAX_COPY => Err(too_big(n)),
                _ => Ok(Self { announced, got: 0 }),
            }
        }

        /// `n` more bytes came: an error if that passes the bound.
        pub fn take(&mut self, n: usize) -> Result<(), String> {
            let got = self.got.saturating_add(n as u64);
            match self.announced {
                Some(a) if got > a => {
                    return Err(format!(
                        "more than the {a} bytes announced came ({got} so far)"
                    ))
                }
                None if got > MAX_COPY => return Err(too_big(got)),
                _ => {}
            }
            self.got = got;
            Ok(())
        }

        /// Bytes so far.
        pub fn got(&self) -> u64 {
            self.got
        }

        /// Bytes still to come before the announced size (None: unknown).
        pub fn left(&self) -> Option<u64> {
            self.announced.map(|a| a - self.got)
        }

        /// The end came: an error if fewer bytes came than announced.
        pub fn finish(&self) -> Result<u64, String> {
            match self.announced {
                Some(a) if self.got != a => Err(format!(
                    "the copy ended after {} of the {a} bytes announced",
                    self.got
                )),
                _ => Ok(self.got),
            }
        }
    }

    /// The error for a file of `n` bytes.
    pub fn too_big(n: u64) -> String {
        format!(
            "{n} bytes is more than the {} GiB burrow cp copies",
            MAX_COPY >> 30
        )
    }
}

/// What a tool request returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "tool", rename_all = "lowercase")]
pub enum ToolReply {
    Exec(ExecOutput),
    Read(ReadOutput),
    /// Bytes written.
    Write {
        bytes: u64,
    },
    Ls(LsOutput),
    /// The file's new size and the line the replacement starts on.
    Edit {
        bytes: u64,
        line: u64,
    },
    Browse(BrowseOutput),
    Screenshot(ScreenshotOutput),
    Detach(SessionStarted),
    Attach(SessionOutput),
    /// A piece of a streamed exec's output; more lines follow.
    Chunk(OutputChunk),
    /// A copy ([`UploadRequest`], [`DownloadRequest`]) may begin: frames
    /// of the file's bytes follow (from the caller for an upload).
    Ready(CopyInfo),
    /// A copy is done (an upload: the file is in place).
    Copied(CopyInfo),
}

/// A finished (or killed) command.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecOutput {
    /// Output, at most [`MAX_EXEC_OUTPUT`] bytes of it; a cut is marked in
    /// the text.
    pub stdout: String,
    pub stderr: String,
    /// Bytes left out of each.
    pub stdout_cut: u64,
    pub stderr_cut: u64,
    /// The exit code, or the signal that killed it.
    pub exit_code: Option<i32>,
    pub signal: Option<u32>,
    /// Killed at its timeout.
    pub timed_out: bool,
    /// The output was still open when the command had exited (a background
    /// process holds it): what it wrote later is not here.
    pub output_open: bool,
}

impl ExecOutput {
    /// The status `burrow exec` exits with: the command's exit code, 128 +
    /// the signal that killed it, [`TIMED_OUT_STATUS`] at the timeout.
    pub fn status(&self) -> i32 {
        if self.timed_out {
            return TIMED_OUT_STATUS;
        }
        match (self.exit_code, self.signal) {
            (_, Some(sig)) => 128i32.saturating_add(i32::try_from(sig.min(127)).unwrap_or(127)),
            (Some(code), None) => code & 0xff,
            (None, None) => 255,
        }
    }
}

/// Lines of a file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReadOutput {
    /// The lines, each with its newline as in the file.
    pub text: String,
    /// First and last line in `text` (0 when it has none).
    pub first: u64,
    pub last: u64,
    /// Lines in the file (None: larger than [`MAX_READ_SCAN`]; not counted).
    pub total: Option<u64>,
    /// The last line in `text` is longer than [`MAX_READ_TEXT`] and was cut.
    pub line_cut: bool,
}

impl ReadOutput {
    /// Lines after the last one returned (None when the total is unknown).
    pub fn remaining(&self) -> Option<u64> {
        self.total.map(|t| t.saturating_sub(self.last))
    }
}

/// A directory's entries, sorted by name.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LsOutput {
    pub entries: Vec<DirEntry>,
    /// More entries than [`MAX_LS_ENTRIES`]: the rest are not listed.
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirEntry {
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    pub kind: String,
    pub size: u64,
    /// Permission bits.
    pub mode: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

impl DirEntry {
    /// `ls -l`'s mode column: `drwxr-xr-x`.
    pub fn mode_string(&self) -> String {
        let kind = match self.kind.as_str() {
            "dir" => 'd',
            "symlink" => 'l',
            "file" => '-',
            _ => '?',
        };
        let mut s = String::with_capacity(10);
        s.push(kind);
        for shift in [6u32, 3, 0] {
            let bits = (self.mode >> shift) & 7;
            s.push(if bits & 4 != 0 { 'r' } else { '-' });
            s.push(if bits & 2 != 0 { 'w' } else { '-' });
            s.push(if bits & 1 != 0 { 'x' } else { '-' });
        }
        s
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn line_ranges_parse_and_cap_at_500() {
        let r: LineRange = "10:20".parse().unwrap();
        assert_eq!((r.first, r.last, r.last_served()), (10, Some(20), 20));
        let r: LineRange = "501:".parse().unwrap();
        assert_eq!((r.first, r.last, r.last_served()), (501, None, 1000));
        let r: LineRange = ":3".parse().unwrap();
        assert_eq!((r.first, r.last), (1, Some(3)));
        let r: LineRange = "7".parse().unwrap();
        assert_eq!((r.first, r.last_served()), (7, 7));
        assert_eq!("1:100000".parse::<LineRange>().unwrap().last_served(), 500);
        assert_eq!(LineRange::default().last_served(), 500);
        for bad in ["0:5", "5:4", "a:b", "", "1:x", "-3:"] {
            assert!(bad.parse::<LineRange>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn exec_output_caps_are_clamped() {
        let mut r = ExecRequest {
            args: vec!["true".into()],
            cwd: None,
            env: vec![],
            timeout_secs: 1,
            max_output: None,
            ..Default::default()
        };
        assert_eq!(r.output_cap(), MAX_EXEC_OUTPUT);
        r.max_output = Some(1);
        assert_eq!(r.output_cap(), MAX_EXEC_OUTPUT);
        r.max_output = Some(u64::MAX);
        assert_eq!(r.output_cap(), MAX_EXEC_OUTPUT_FULL);
        r.max_output = Some(1 << 20);
        assert_eq!(r.output_cap(), 1 << 20);
    }

    #[test]
    fn a_session_has_a_status_once_done() {
        let mut out = SessionOutput {
            exit_code: Some(3),
            ..Default::default()
        };
        assert_eq!(out.status(), None);
        out.done = true;
        assert_eq!(out.status(), Some(3));
        out.timed_out = true;
        assert_eq!(out.status(), Some(TIMED_OUT_STATUS));
        let r: AttachRequest = serde_json::from_str(r#"{"session":"s1"}"#).unwrap();
        assert_eq!(
            (r.from, r.wait_secs, r.max_bytes, r.whole_lines),
            (0, 0, None, false)
        );
    }

    #[test]
    fn exec_status_is_the_commands_own() {
        let code = |c| ExecOutput {
            exit_code: Some(c),
            ..Default::default()
        };
        assert_eq!(code(3).status(), 3);
        assert_eq!(code(0).status(), 0);
        assert_eq!(code(256 + 5).status(), 5);
        let killed = ExecOutput {
            signal: Some(9),
            ..Default::default()
        };
        assert_eq!(killed.status(), 137);
        let late = ExecOutput {
            signal: Some(9),
            timed_out: true,
            ..Default::default()
        };
        assert_eq!(late.status(), TIMED_OUT_STATUS);
    }

    #[test]
    fn remaining_lines_and_modes() {
        let r = ReadOutput {
            first: 1,
            last: 500,
            total: Some(1200),
            ..Default::default()
        };
        assert_eq!(r.remaining(), Some(700));
        assert_eq!(ReadOutput::default().remaining(), None);
        let e = DirEntry {
            name: "bin".into(),
            kind: "dir".into(),
            size: 4096,
            mode: 0o755,
            target: None,
        };
        assert_eq!(e.mode_string(), "drwxr-xr-x");
        let f = DirEntry {
            kind: "file".into(),
            mode: 0o640,
            ..e
        };
        assert_eq!(f.mode_string(), "-rw-r-----");
    }

    #[test]
    fn copy_frames_are_bounded_and_counted_against_the_announced_size() {
        assert_eq!(frame::header(0), [0, 0, 0, 0]);
        assert_eq!(frame::parse(frame::header(COPY_CHUNK)).unwrap(), COPY_CHUNK);
        assert_eq!(frame::parse(frame::header(5)).unwrap(), 5);
        let e = frame::parse(frame::header(COPY_CHUNK + 1)).unwrap_err();
        assert!(e.contains("more than the 1048576"), "{e}");
        assert!(frame::parse([0xff; 4]).is_err());
        // An announced size: no more may come, and no less.
        let mut b = frame::Bound::new(Some(10)).unwrap();
        b.take(6).unwrap();
        assert_eq!(b.left(), Some(4));
        let e = b.finish().unwrap_err();
        assert!(e.contains("after 6 of the 10 bytes"), "{e}");
        let e = b.take(5).unwrap_err();
        assert!(e.contains("more than the 10 bytes announced"), "{e}");
        b.take(4).unwrap();
        assert_eq!(b.finish().unwrap(), 10);
        // None announced: up to MAX_COPY; more than that is refused, as
        // is announcing more.
        let mut b = frame::Bound::new(None).unwrap();
        assert_eq!(b.left(), None);
        for _ in 0..(MAX_COPY / COPY_CHUNK as u64) {
            b.take(COPY_CHUNK).unwrap();
        }
        assert_eq!(b.got(), MAX_COPY);
        let e = b.take(1).unwrap_err();
        assert!(e.contains("more than the 4 GiB"), "{e}");
        assert!(frame::Bound::new(Some(MAX_COPY)).is_ok());
        let e = frame::Bound::new(Some(MAX_COPY + 1)).unwrap_err();
        assert!(e.contains("4294967297 bytes is more than the 4 GiB"), "{e}");
        // The requests and replies on the wire.
        let up: UploadRequest = serde_json::from_str(r#"{"path":"/a"}"#).unwrap();
        assert_eq!((up.name, up.mode, up.size), (None, None, None));
        let ready = ToolReply::Ready(CopyInfo {
            path: "/a".into(),
            size: 3,
            mode: 0o755,
            file_size: None,
        });
        let text = serde_json::to_string(&ready).unwrap();
        assert_eq!(text, r#"{"tool":"ready","path":"/a","size":3,"mode":493}"#);
        assert_eq!(serde_json::from_str::<ToolReply>(&text).unwrap(), ready);
    }

    #[test]
    fn interactive_input_and_output_frames_carry_bytes_and_are_bounded() {
        let data = ExecInput::Data {
            data: b"echo hi\r\x1b[A\xff".to_vec(),
        };
        let line = crate::to_line(&data);
        assert_eq!(
            line,
            b"{\"input\":\"data\",\"data\":\"ZWNobyBoaQ0bW0H/\"}\n"
        );
        assert_eq!(ExecInput::parse(&line).unwrap(), data);
        let resize = ExecInput::Resize { rows: 40, cols: 120 };
        let line = crate::to_line(&resize);
        assert_eq!(line, b"{\"input\":\"resize\",\"rows\":40,\"cols\":120}\n");
        assert_eq!(ExecInput::parse(&line).unwrap(), resize);
        assert_eq!(
            ExecInput::parse(br#"{"input":"eof"}"#).unwrap(),
            ExecInput::Eof
        );
        // A full chunk fits in one line; one byte more is refused, as are
        // bad base64, a terminal with no room and unknown inputs.
        let full = crate::to_line(&ExecInput::Data {
            data: vec![0xaa; MAX_INPUT_CHUNK],
        });
        assert!(full.len() as u64 <= MAX_INPUT_LINE, "{}", full.len());
        assert!(ExecInput::parse(&full).is_ok());
        let over = crate::to_line(&ExecInput::Data {
            data: vec![0xaa; MAX_INPUT_CHUNK + 1],
        });
        let e = ExecInput::parse(&over).unwrap_err();
        assert!(e.contains("more than 16384"), "{e}");
        assert!(ExecInput::parse(br#"{"input":"data","data":"!!"}"#).is_err());
        assert!(ExecInput::parse(br#"{"input":"resize","rows":0,"cols":80}"#).is_err());
        assert!(ExecInput::parse(br#"{"input":"resize","rows":70000,"cols":80}"#).is_err());
        assert!(ExecInput::parse(br#"{"input":"kill"}"#).is_err());
        // Output: bytes in base64 when there are any, the old form else.
        let chunk = ToolReply::Chunk(OutputChunk {
            stream: "stdout".into(),
            data: String::new(),
            bytes: vec![0x1b, b'[', b'H', 0xff],
        });
        let text = serde_json::to_string(&chunk).unwrap();
        assert_eq!(
            text,
            r#"{"tool":"chunk","stream":"stdout","data":"","bytes":"G1tI/w=="}"#
        );
        assert_eq!(serde_json::from_str::<ToolReply>(&text).unwrap(), chunk);
        let plain: ToolReply =
            serde_json::from_str(r#"{"tool":"chunk","stream":"stdout","data":"hi"}"#).unwrap();
        assert_eq!(
            plain,
            ToolReply::Chunk(OutputChunk {
                stream: "stdout".into(),
                data: "hi".into(),
                bytes: Vec::new()
            })
        );
        // The request says so; without it, nothing changes on the wire.
        let req = ExecRequest {
            args: vec!["sh".into()],
            stream: true,
            tty: true,
            stdin: true,
            ..Default::default()
        };
        let text = serde_json::to_string(&req).unwrap();
        assert!(text.ends_with(r#""stream":true,"tty":true,"stdin":true}"#), "{text}");
        assert!(!serde_json::to_string(&ExecRequest::default())
            .unwrap()
            .contains("stdin"));
    }
}
